"""Benchmark request generation.

Only the random-token dataset for now: prompts are uniformly random token ids, so the workload
is defined purely by its length distribution (nano-vllm's published workload is 256 requests with
prompt and output lengths uniform in [100, 1024]). `bench throughput` uses it today; `bench serve`
and `bench latency` are meant to reuse the same generator so all three see identical requests for
the same seed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np


@dataclass
class SampleRequest:
    """One benchmark request: the prompt as token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _check_range(name: str, value: Sequence[int]) -> tuple[int, int]:
    if len(value) != 2:
        raise ValueError(f"{name} must be two integers LOW HIGH, got {list(value)!r}")
    low, high = int(value[0]), int(value[1])
    if low < 1 or high < low:
        raise ValueError(f"{name} must satisfy 1 <= LOW <= HIGH, got [{low}, {high}]")
    return low, high


def special_token_ids(tokenizer: Any) -> set[int]:
    """Every id the tokenizer treats as special or added (BOS, EOS, chat markers...).

    Random prompts avoid them: a stray EOS or <|im_start|> in the middle of a prompt is
    harmless to the engine's speed, but it would make the workload depend on how each engine
    handles control tokens, and it is not what real prompts look like."""
    if tokenizer is None:
        return set()
    ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []) if i is not None}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i in added)
    return ids


def sample_random_requests(
    num_requests: int,
    input_len_range: Sequence[int],
    output_len_range: Sequence[int],
    vocab_size: int,
    *,
    seed: int = 0,
    exclude_token_ids: Iterable[int] = (),
) -> list[SampleRequest]:
    """`num_requests` requests with prompt and output lengths drawn uniformly from the inclusive
    ranges, and prompt tokens drawn uniformly from [0, vocab_size) minus `exclude_token_ids`.

    The same arguments always give the same requests (a private numpy Generator, so the global
    random state of torch/numpy/random is neither used nor disturbed)."""
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be a positive int, got {num_requests!r}")
    in_low, in_high = _check_range("input_len_range", input_len_range)
    out_low, out_high = _check_range("output_len_range", output_len_range)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    excluded = np.fromiter((t for t in exclude_token_ids if 0 <= t < vocab_size), dtype=np.int64)
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), excluded, assume_unique=False)
    if allowed.size == 0:
        raise ValueError("no token ids left to sample from after excluding special tokens")

    rng = np.random.default_rng(seed)
    # Draw all lengths first, then the tokens: changing the vocabulary (another model) keeps
    # the length distribution, the thing that decides the engine's work, identical.
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    requests = []
    for in_len, out_len in zip(input_lens.tolist(), output_lens.tolist()):
        ids = allowed[rng.integers(0, allowed.size, size=in_len)]
        requests.append(SampleRequest(prompt_token_ids=ids.tolist(), expected_output_len=out_len))
    return requests
