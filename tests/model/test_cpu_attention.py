"""folio's C++ paged attention (CpuPagedAttention) against the torch reference
(TorchPagedAttention) on random steps: decodes and prefill chunks (fresh, and over a cached
prefix) in one batch, grouped-query heads, sliding windows, head sizes from 32 to 256 and one
that is not a multiple of the vector width, float32 / bfloat16 / float16 caches, a bfloat16 model."""
from __future__ import annotations

import zlib

import pytest
import torch

from paged_cases import make_step, rel_err

from folio.model.attention.torch_paged import TorchPagedAttention

pytest.importorskip("torch.utils.cpp_extension")

MIXED = [(0, 13), (20, 9), (37, 16), (40, 1), (5, 1), (70, 1)]
CASES = [
    dict(name="mixed_g2_d64", dtype="float32", H=4, KVH=2, D=64, bs=16, win=None, reqs=MIXED),
    dict(name="smollm_shape_g3", dtype="float32", H=9, KVH=3, D=64, bs=16, win=None,
         reqs=[(0, 40), (128, 1), (63, 1), (17, 30)]),
    dict(name="window_g1_d128", dtype="float32", H=2, KVH=2, D=128, bs=16, win=24,
         reqs=[(0, 30), (33, 12), (50, 1), (3, 1)]),
    dict(name="window_g4_bs32", dtype="float32", H=4, KVH=1, D=64, bs=32, win=20,
         reqs=[(45, 7), (0, 9), (60, 1)]),
    dict(name="d80_pad", dtype="float32", H=4, KVH=2, D=80, bs=16, win=None,
         reqs=[(0, 5), (17, 6), (30, 1)]),
    dict(name="long_decodes", dtype="float32", H=8, KVH=2, D=64, bs=16, win=None,
         reqs=[(0, 1), (16, 1), (99, 1), (380, 1)]),
    dict(name="bf16_cache", dtype="float32", cache_dtype="bfloat16", H=4, KVH=2, D=64, bs=16,
         win=None, reqs=MIXED),
    dict(name="fp16_cache", dtype="float32", cache_dtype="float16", H=4, KVH=2, D=64, bs=16,
         win=None, reqs=MIXED),
    dict(name="bf16_model", dtype="bfloat16", H=4, KVH=2, D=64, bs=16, win=None, reqs=MIXED),
    # the widest and narrowest head sizes the blocked kernel takes (Gemma 3's 256; 32)
    dict(name="d256_g4", dtype="float32", H=4, KVH=1, D=256, bs=16, win=None,
         reqs=[(0, 21), (40, 1), (9, 3)]),
    dict(name="d32_bf16_cache", dtype="float32", cache_dtype="bfloat16", H=6, KVH=2, D=32,
         bs=16, win=None, reqs=MIXED),
]


def _backend():
    from folio.model.attention.cpu_backend import CpuPagedAttention
    return CpuPagedAttention()


def _poison_invisible(cache: torch.Tensor, meta) -> torch.Tensor:
    """The cache with NaN in every slot no request may read (spare blocks, the tails of last
    blocks): the kernel must not read them (the reference, masking after reading, would turn
    them into NaN)."""
    poisoned = torch.full_like(cache, float("nan"))
    bs = meta.block_size
    for i, length in enumerate(meta.seq_lens):
        for p in range(length):
            block = int(meta.block_tables[i, p // bs])
            poisoned[:, block, p % bs] = cache[:, block, p % bs]
    return poisoned


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_cpu_attention_matches_the_torch_reference(case: dict) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    q, k, v, cache, meta = make_step(case, gen)
    scale = case["D"] ** -0.5
    ref_cache = cache.clone()
    ref = TorchPagedAttention().forward(q, k, v, ref_cache, meta, scale=scale,
                                        sliding_window=case["win"])
    # The kernel's cache: this step's slots written exactly as the reference writes them, and
    # nothing invisible is ever read.
    cpu_cache = cache.clone()
    out = _backend().forward(q, k, v, cpu_cache, meta, scale=scale, sliding_window=case["win"])
    assert torch.equal(cpu_cache, ref_cache)
    assert out.dtype == q.dtype and out.shape == q.shape
    # A reduced-precision cache: the reference attends a fresh prefill over its unrounded K/V,
    # the kernel over the cache's rounded copy.
    exact = case["dtype"] == "float32" and case.get("cache_dtype", "float32") == "float32"
    tol = 1e-5 if exact else 1e-2
    assert rel_err(out, ref) < tol
    poisoned = _poison_invisible(cache, meta)
    again = _backend().forward(q, k, v, poisoned, meta, scale=scale, sliding_window=case["win"])
    assert torch.isfinite(again).all()
    assert torch.equal(again, out)


def test_cpu_attention_refuses_out_of_range_slots_and_blocks() -> None:
    case = dict(name="bad", dtype="float32", H=2, KVH=1, D=16, bs=4, win=None,
                reqs=[(3, 2), (0, 1)])
    q, k, v, cache, meta = make_step(case, torch.Generator().manual_seed(0))
    backend = _backend()
    meta.slot_mapping = meta.slot_mapping.clone()
    meta.slot_mapping[0] = cache.shape[1] * cache.shape[2]
    with pytest.raises(RuntimeError, match=f"slot {cache.shape[1] * cache.shape[2]} out of range"):
        backend.forward(q, k, v, cache, meta, scale=0.25)
    q, k, v, cache, meta = make_step(case, torch.Generator().manual_seed(0))
    meta.block_tables = meta.block_tables.clone()
    meta.block_tables[0, 0] = cache.shape[1] + 5
    with pytest.raises(RuntimeError, match=f"block id {cache.shape[1] + 5} out of range"):
        backend.forward(q, k, v, cache, meta, scale=0.25)


def test_cpu_attention_takes_views_of_the_fused_projection() -> None:
    """q, k and v as the model hands them over: strided views into one qkv row per token."""
    case = dict(name="views", dtype="float32", H=9, KVH=3, D=64, bs=16, win=None, reqs=MIXED)
    q, k, v, cache, meta = make_step(case, torch.Generator().manual_seed(3))
    T = q.shape[0]
    qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
    qv, kv, vv = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    views = qv.view(T, 9, 64), kv.view(T, 3, 64), vv.view(T, 3, 64)
    assert not views[1].is_contiguous()
    ref_cache, cpu_cache = cache.clone(), cache.clone()
    ref = _backend().forward(q, k, v, ref_cache, meta, scale=0.125)
    out = _backend().forward(*views, cpu_cache, meta, scale=0.125)
    assert torch.equal(out, ref) and torch.equal(cpu_cache, ref_cache)


INVARIANCE_CASES = [
    dict(name="verify_g3", dtype="float32", H=9, KVH=3, D=64, bs=16, win=None,
         reqs=[(600, 5), (90, 1), (37, 9), (0, 12)]),
    dict(name="verify_window_d32", dtype="float32", H=6, KVH=2, D=32, bs=16, win=40,
         reqs=[(200, 5), (10, 17)], soft_cap=20.0, sinks=True),
    dict(name="verify_bf16_cache_d128", dtype="float32", cache_dtype="bfloat16", H=8, KVH=2,
         D=128, bs=16, win=None, reqs=[(130, 4), (64, 3), (3, 1)]),
]


@pytest.mark.parametrize("case", INVARIANCE_CASES, ids=[c["name"] for c in INVARIANCE_CASES])
def test_cpu_attention_of_a_token_does_not_depend_on_the_other_query_tokens(case: dict) -> None:
    """The kernel takes a request's query tokens (a verify step's drafts, a prefill chunk) in
    blocks that read the keys once for all of them; every token's output must still be the
    bits it gets alone, as a plain decode step of that position (speculative decoding is
    lossless only if a verify step's logits are the decode steps')."""
    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    q, k, v, cache, meta = make_step(case, gen)
    extra = {}
    if case.get("soft_cap"):
        extra["logits_soft_cap"] = case["soft_cap"]
    if case.get("sinks"):
        extra["sinks"] = torch.randn(case["H"], generator=gen)
    scale = case["D"] ** -0.5
    backend = _backend()
    full = backend.forward(q, k, v, cache, meta, scale=scale, sliding_window=case["win"],
                           **extra)
    from folio.model.attention.backend import AttentionMetadata
    for i, (computed, n) in enumerate(case["reqs"]):
        for j in range(n):
            t = meta.query_start_loc[i] + j
            one = AttentionMetadata(
                slot_mapping=meta.slot_mapping[t:t + 1], query_start_loc=[0, 1],
                seq_lens=[computed + j + 1], num_computed_tokens=[computed + j],
                block_tables=meta.block_tables[i:i + 1], block_size=meta.block_size)
            alone = backend.forward(q[t:t + 1], k[t:t + 1], v[t:t + 1], cache, one,
                                    scale=scale, sliding_window=case["win"], **extra)
            assert torch.equal(alone[0], full[t]), (i, j)
