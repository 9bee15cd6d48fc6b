"""The sampler's Gumbel-max fast path on the GPU (bf16 logits, a real vocabulary size):
its draws follow softmax(logits / T) and greedy rows beside random ones stay argmax. Skipped
without CUDA; run through the device tool."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _chi2_limit(dof: int) -> float:
    z = 3.09  # upper 0.1% point, Wilson-Hilferty
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


@pytest.mark.parametrize("rows,temperature", [(10000, 0.9), (300, 1.0)])
def test_gumbel_draws_follow_the_softmax(rows, temperature):
    from folio.model.kernels.sampling import gumbel_sample
    vocab = 151936
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(vocab, device="cuda", generator=gen)
    base[:40] += 9.0  # most of the mass on a few ids, spread over the first chunk...
    base[-25:] += 9.0  # ...and the last
    logits = base.to(torch.bfloat16).expand(rows, vocab).contiguous()
    draws = []
    for seed in range(max(1, 20000 // rows)):
        draws.append(gumbel_sample(logits, [temperature] * rows, seed=seed))
    got = torch.cat(draws)
    n = got.numel()
    probs = torch.softmax(logits[0].double() / temperature, dim=-1)
    counts = torch.bincount(got, minlength=vocab).double()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = obs.numel() - 1
    assert chi2 < _chi2_limit(dof), (chi2, dof)


def test_sampler_fast_path_mixed_greedy_and_random_rows():
    from folio.sampling_params import SamplingParams
    from folio.worker.sampler import SamplePath, Sampler, SamplingState, choose_path
    from folio.worker.sampling_columns import SamplingColumns
    logits = torch.randn(64, 151936, device="cuda").to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.7, logprobs=1 if i % 5 == 0
                             else None) for i in range(64)]
    states = [SamplingState(p) for p in params]
    columns = SamplingColumns.from_params(params, [([1, 2], [])] * len(params))
    assert choose_path(logits, columns) is SamplePath.GUMBEL
    sampled, logprobs = Sampler().sample(logits, states, columns)
    greedy = [i for i in range(64) if i % 3 == 0]
    assert torch.equal(sampled[greedy], logits[greedy].float().argmax(dim=-1))
    assert logprobs.rows == [i for i in range(64) if i % 5 == 0]
    ref = torch.log_softmax(logits.float(), dim=-1)
    for row, entry in zip(logprobs.rows, logprobs.tensors.entries()):
        assert entry.token_id == sampled[row].item()
        assert abs(entry.logprob - ref[row, entry.token_id].item()) < 1e-4


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_argmax_rows_equals_torch_argmax(rows):
    """The greedy path's chunked argmax (bf16 logits, Llama-3's vocabulary) is torch.argmax:
    planted ties across chunks go to the lowest id, a NaN ranks first."""
    from folio.model.kernels.sampling import argmax_rows
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, 128256, device="cuda", generator=gen).to(torch.bfloat16)
    logits[0, 7] = logits[0, 128000] = 30.0
    if rows > 1:
        logits[1, 99999] = float("nan")
    got = argmax_rows(logits)
    assert got.dtype == torch.int64 and got.tolist() == logits.argmax(dim=-1).tolist()
    assert got[0].item() == 7
