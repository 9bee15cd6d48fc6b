"""A fake model for matcher tests: sample uniformly among the tokens a bitmask allows."""
from __future__ import annotations

import random

import torch

from folio.structured_output.backend import allocate_bitmask


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    words = bitmask[row].to(torch.int64)
    bits = (words.unsqueeze(1) >> torch.arange(32)) & 1
    ids = torch.nonzero(bits.flatten()).flatten()
    return ids[ids < vocab_size].tolist()


def random_generate(matcher, vocab_size: int, seed: int, max_steps: int = 200) -> list[int]:
    """Token ids until the stop token (included); fails on an empty mask, a rejected allowed
    token, or no termination within max_steps."""
    rng = random.Random(seed)
    bitmask = allocate_bitmask(1, vocab_size)
    tokens: list[int] = []
    for _ in range(max_steps):
        if matcher.is_terminated():
            break
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_ids(bitmask, 0, vocab_size)
        assert allowed, f"empty mask after {len(tokens)} tokens"
        token = rng.choice(allowed)
        assert matcher.accept_token(token), f"allowed token {token} was rejected"
        tokens.append(token)
    assert matcher.is_terminated(), f"no termination within {max_steps} tokens"
    return tokens
