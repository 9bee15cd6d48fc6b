"""The newest token of each request of a step, as the worker hands it to a draft model or head
(model_runner._next_tokens): host ints where the step's request is a prompt chunk (its next
prompt token), the sampled ids put at the sampling requests' places — scattered on the device
from the sampler's tensor (never read on the host), or from a verify step's host lists."""
from __future__ import annotations

import torch

from folio.worker.model_runner import _next_tokens

CPU = torch.device("cpu")


def test_sampled_ids_are_scattered_among_prompt_tokens() -> None:
    # step order: a (prompt chunk, next prompt token 7), b (sampled 2nd), c (sampled 1st)
    sampled = torch.tensor([[30], [20]])          # the sampler's order: c, b
    got = _next_tokens([7, 0, 0], [(1, 1), (2, 0)], sampled, CPU)
    assert got.tolist() == [7, 20, 30] and got.dtype == torch.int64


def test_every_request_sampled_in_order_is_the_sampled_tensor() -> None:
    sampled = torch.tensor([5, 6, 7])
    got = _next_tokens([0, 0, 0], [(0, 0), (1, 1), (2, 2)], sampled, CPU)
    assert got.tolist() == [5, 6, 7] and got.data_ptr() == sampled.data_ptr()


def test_host_ints_of_a_verify_step() -> None:
    # a verify step's last kept tokens, host ints, in the sampling order: b then a
    got = _next_tokens([0, 0, 9], [(1, 0), (0, 1)], [41, 42], CPU)
    assert got.tolist() == [42, 41, 9]


def test_a_step_of_prompt_chunks_only() -> None:
    assert _next_tokens([3, 4], [], [], CPU).tolist() == [3, 4]
