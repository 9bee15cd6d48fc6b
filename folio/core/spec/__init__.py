"""Speculative decoding on the scheduler's side (torch-free): proposers that guess a request's
next tokens from its own context, and the rules for which requests speculate and how far."""
