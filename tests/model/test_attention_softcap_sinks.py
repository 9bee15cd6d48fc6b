"""Attention logit soft-capping (Gemma 2) and attention sinks (GPT-OSS) in the attention
backends.

The torch reference (TorchPagedAttention) is checked against a dense per-query loop written
from the definitions (float64), then folio's C++ CPU kernel against the torch reference, on
random paged steps (paged_cases.make_step): decodes and prefill chunks, fresh and over a cached
prefix, grouped-query heads, windows, the kernel's vector path (head_dim 64) and its generic
one (80). The Triton kernels are checked under the interpreter in test_triton_attention.py.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from paged_cases import make_step, rel_err

from folio.model.attention.torch_paged import TorchPagedAttention

MIXED = [(0, 13), (20, 9), (37, 16), (40, 1), (5, 1), (70, 1)]
# cap: the soft cap (None = none); sinks: draw per-head sink logits. Scores here are about
# N(0, 1) (scale = D^-0.5 over unit-variance q, k), so a cap of 1.5 bends most of them and
# sinks around +1 take a real share of the softmax.
CASES = [
    dict(name="cap_g2_d64", dtype="float32", H=4, KVH=2, D=64, bs=16, win=None, reqs=MIXED,
         cap=1.5, sinks=False),
    dict(name="sinks_g2_d64", dtype="float32", H=4, KVH=2, D=64, bs=16, win=None, reqs=MIXED,
         cap=None, sinks=True),
    dict(name="both_window_g4_bs32", dtype="float32", H=8, KVH=2, D=64, bs=32, win=20,
         reqs=[(45, 7), (0, 9), (60, 1), (3, 1)], cap=2.0, sinks=True),
    dict(name="both_d80_generic", dtype="float32", H=4, KVH=2, D=80, bs=16, win=None,
         reqs=[(0, 5), (17, 6), (30, 1)], cap=1.5, sinks=True),
    dict(name="sinks_window_g1_d128", dtype="float32", H=2, KVH=2, D=128, bs=16, win=24,
         reqs=[(0, 30), (33, 12), (50, 1)], cap=None, sinks=True),
    dict(name="both_bf16_cache", dtype="float32", cache_dtype="bfloat16", H=4, KVH=2, D=64,
         bs=16, win=None, reqs=MIXED, cap=1.5, sinks=True),
]


def _inputs(case: dict) -> tuple:
    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    q, k, v, cache, meta = make_step(case, gen)
    sinks = (torch.randn(case["H"], generator=gen) + 1.0) if case["sinks"] else None
    return q, k, v, cache, meta, sinks


def dense_reference(q: torch.Tensor, cache: torch.Tensor, meta, scale: float,
                    window: int | None, cap: float | None,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """Each query token over its request's visible keys, read from `cache` (already written),
    one at a time, from the definitions: s = cap * tanh(q.k * scale / cap), p_i = exp(s_i) /
    (sum_j exp(s_j) + exp(sink)), out = sum_i p_i v_i. float64."""
    H, KVH = q.shape[1], cache.shape[3]
    G = H // KVH
    bs = meta.block_size
    out = torch.empty(q.shape, dtype=torch.float64)
    qsl = meta.query_start_loc
    for b in range(meta.num_reqs):
        n = qsl[b + 1] - qsl[b]
        ctx = meta.seq_lens[b]
        slots = [int(meta.block_tables[b, p // bs]) * bs + p % bs for p in range(ctx)]
        flat = cache.view(2, -1, KVH, cache.shape[4]).double()
        keys, values = flat[0, slots], flat[1, slots]                 # [ctx, KVH, D]
        for i in range(n):
            t, pos = qsl[b] + i, ctx - n + i
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(H):
                kk, vv = keys[lo:pos + 1, h // G], values[lo:pos + 1, h // G]
                s = kk @ q[t, h].double() * scale
                if cap:
                    s = cap * torch.tanh(s / cap)
                logits = s if sinks is None else torch.cat((s, sinks[h:h + 1].double()))
                p = torch.softmax(logits, 0)[:len(s)]
                out[t, h] = p @ vv
    return out


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_torch_reference_matches_the_definition(case: dict) -> None:
    q, k, v, cache, meta, sinks = _inputs(case)
    scale = case["D"] ** -0.5
    out = TorchPagedAttention().forward(q, k, v, cache, meta, scale=scale,
                                        sliding_window=case["win"],
                                        logits_soft_cap=case["cap"], sinks=sinks)
    # cache now holds this step's K/V too; a bf16 cache: the fresh prefill's K/V are rounded
    # through it by the reference as well, so both sides read the same values.
    ref = dense_reference(q, cache.float(), meta, scale, case["win"], case["cap"], sinks)
    assert rel_err(out, ref) < 1e-5
    # The options change the result (a cap or sinks that did nothing would pass vacuously).
    plain = TorchPagedAttention().forward(q, k, v, cache.clone(), meta, scale=scale,
                                          sliding_window=case["win"])
    assert rel_err(plain, ref) > 1e-2


def _cpu_backend():
    # builds the C++ kernels (a failed build fails the test: they are part of the product)
    from folio.model.attention.cpu_backend import CpuPagedAttention
    return CpuPagedAttention()


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_cpu_kernel_matches_the_torch_reference(case: dict) -> None:
    backend = _cpu_backend()
    q, k, v, cache, meta, sinks = _inputs(case)
    scale = case["D"] ** -0.5
    ref_cache, cpu_cache = cache.clone(), cache.clone()
    kwargs = dict(scale=scale, sliding_window=case["win"], logits_soft_cap=case["cap"],
                  sinks=sinks)
    ref = TorchPagedAttention().forward(q, k, v, ref_cache, meta, **kwargs)
    out = backend.forward(q, k, v, cpu_cache, meta, **kwargs)
    assert torch.equal(cpu_cache, ref_cache)
    exact = case.get("cache_dtype", "float32") == "float32"
    assert rel_err(out, ref) < (1e-5 if exact else 1e-2)


def test_cpu_kernel_refuses_sinks_of_the_wrong_shape() -> None:
    backend = _cpu_backend()
    case = CASES[1]
    q, k, v, cache, meta, _ = _inputs(case)
    with pytest.raises(RuntimeError, match="sinks"):
        backend.forward(q, k, v, cache, meta, scale=0.125, sinks=torch.zeros(case["H"] + 1))
