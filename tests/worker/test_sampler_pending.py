"""Under async scheduling a request's latest token can still be on the device when its next
step samples: its host history lacks it and its `pending_row` column points at it in the previous step's
sampled ids. Penalties and min_tokens must then give exactly what they give with the token
already on the host."""
from __future__ import annotations

import torch

from folio.sampling_params import SamplingParams
from sampler_rows import Row
from sampler_rows import RowSampler as Sampler

VOCAB = 40
EOS = 7


def _states(params: list[SamplingParams], outputs: list[list[int]],
            pending_rows: list[int | None]) -> list[Row]:
    return [Row(p, [1, 2, 3], list(out), None, (EOS,), row)
            for p, out, row in zip(params, outputs, pending_rows)]


def test_pending_token_counts_like_a_host_token():
    torch.manual_seed(0)
    logits = torch.randn(5, VOCAB) * 3
    params = [SamplingParams(temperature=0, repetition_penalty=1.7),
              SamplingParams(temperature=0, frequency_penalty=0.9, presence_penalty=0.6),
              SamplingParams(temperature=0, min_tokens=3, max_tokens=10),
              SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.5),
              SamplingParams(temperature=0)]
    history = [[11, 12], [13, 13, 20], [21, 22], [30], [5]]
    latest = [25, 13, 24, 30, 6]  # row 1 repeats a token; row 3 repeats its only one
    # The previous step's sampled ids, in another order: row i's latest token is at 4 - i.
    prev_sampled = torch.tensor(list(reversed(latest)))
    sampler = Sampler()
    on_host = sampler.process_logits(
        logits, _states(params, [h + [t] for h, t in zip(history, latest)], [None] * 5))
    in_flight = sampler.process_logits(
        logits, _states(params, history, [4 - i for i in range(5)]), prev_sampled)
    assert torch.equal(on_host, in_flight)
    # ... and the check can fail: ignoring the pending token changes these rows.
    ignored = sampler.process_logits(logits, _states(params, history, [None] * 5))
    for row in (0, 1, 2, 3):
        assert not torch.equal(ignored[row], on_host[row]), row
    assert torch.equal(ignored[4], on_host[4])
    # min_tokens: two outputs on the host + one in flight = 3, so EOS is allowed again.
    assert on_host[2, EOS] != float("-inf") and ignored[2, EOS] == float("-inf")


def test_sample_uses_the_pending_token():
    logits = torch.zeros(1, VOCAB)
    logits[0, 9] = 5.0
    logits[0, 10] = 4.0
    params = [SamplingParams(temperature=0, repetition_penalty=3.0)]
    prev = torch.tensor([0, 9])
    # Token 9 was just sampled (row 1 of the previous step): penalised, 10 wins.
    sampled, _ = Sampler().sample(logits, _states(params, [[]], [1]), prev)
    assert sampled.tolist() == [10]
    sampled, _ = Sampler().sample(logits, _states(params, [[]], [None]), prev)
    assert sampled.tolist() == [9]
