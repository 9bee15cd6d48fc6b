"""The dense prefill path's host-side rules (folio/model/attention/dense_prefill.py): which
requests take it, and the padded lengths that bound cuDNN's per-length plans. The kernels
themselves run on the GPU only (tests/gpu/test_gpu_dense_prefill.py)."""
from __future__ import annotations

import pytest

from folio.model.attention import dense_prefill
from folio.model.attention.dense_prefill import (DENSE_PREFILL_MIN_TOKENS, padded_length,
                                                 padded_lengths)


def test_padded_length_bounds_the_waste_and_the_count():
    for n in range(DENSE_PREFILL_MIN_TOKENS, 40_000, 7):
        p = padded_length(n)
        assert n <= p <= n * 1.125 + 256, (n, p)
        assert p % 256 == 0
    # at most eight lengths per doubling above the minimum
    for lo in (4096, 8192, 16384):
        assert len({padded_length(n) for n in range(lo + 1, 2 * lo + 1)}) <= 8


def test_padded_lengths_cover_every_request_up_to_the_budget():
    for budget in (DENSE_PREFILL_MIN_TOKENS, DENSE_PREFILL_MIN_TOKENS + 1, 5000, 8192, 20_000):
        lengths = padded_lengths(budget)
        assert lengths == sorted(set(lengths))
        for n in range(DENSE_PREFILL_MIN_TOKENS, budget + 1, 13):
            assert padded_length(n) in lengths, (budget, n)
        assert lengths[-1] == padded_length(budget)


def test_only_long_fresh_prompts_take_the_path():
    pytest.importorskip("triton")
    from folio.model.attention.triton_backend import TritonPagedAttention
    on, off = TritonPagedAttention(), TritonPagedAttention(dense_prefill=False)
    n = DENSE_PREFILL_MIN_TOKENS
    assert on.takes_dense_path(0, n)
    assert not on.takes_dense_path(0, n - 1)          # too short to pay
    assert not on.takes_dense_path(1, n)              # a cached prefix: the paged kernel
    assert not off.takes_dense_path(0, n)             # FOLIO_DENSE_PREFILL=0


def test_cpu_tensors_never_take_the_path():
    import torch
    q = torch.zeros(4, 8, 64, dtype=torch.bfloat16)
    k = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 1, 16, 2, 64, dtype=torch.bfloat16)
    assert not dense_prefill.layer_supported(q, k, cache, sliding_window=None,
                                             logits_soft_cap=None, sinks=None)
    assert dense_prefill.warm_up(8, 2, 64, 0.125, torch.bfloat16, torch.device("cpu"),
                                 max_tokens=1000) == 0


@pytest.mark.parametrize("n", [1, 255, 300, 512])
def test_causal_attention_pads_without_changing_real_rows(n):
    """Padded to a bucket length (here on the CPU's SDPA kernels), grouped heads: the rows of
    the request equal causal attention computed directly in float64."""
    import torch
    gen = torch.Generator().manual_seed(n)
    h, kvh, d = 8, 2, 32
    q = torch.randn(n, h, d, generator=gen)
    k = torch.randn(n, kvh, d, generator=gen)
    v = torch.randn(n, kvh, d, generator=gen)
    scale = d ** -0.5
    got = dense_prefill.causal_attention(q, k, v, scale)
    out = torch.full_like(q, float("nan"))
    assert dense_prefill.causal_attention(q, k, v, scale, out) is out
    kk, vv = (x.double().repeat_interleave(h // kvh, dim=1) for x in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    assert got.shape == (n, h, d)
    assert torch.allclose(got.double(), ref, atol=1e-5), (got.double() - ref).abs().max()
    assert torch.equal(out, got)


def test_warm_up_runs_every_padded_length_of_the_budget():
    import torch
    budget = DENSE_PREFILL_MIN_TOKENS + 300
    ran = dense_prefill.warm_up(2, 1, 16, 0.25, torch.float32, torch.device("cpu"), budget)
    assert ran == len(padded_lengths(budget)) == 2   # 4096, 4608
