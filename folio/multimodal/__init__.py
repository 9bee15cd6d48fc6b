"""Multimodal input (issue 24): images named by requests, fetched and decoded safely
(media_fetch.py). Torch-free."""
