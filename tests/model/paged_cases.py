"""Random paged-attention steps for comparing a backend with the torch reference
(test_triton_attention.py, test_cpu_attention.py).

A case is a dict: dtype, H (query heads), KVH, D, bs (block size), win (sliding window or None)
and reqs, (num_computed_tokens, query_len) per request; cache_dtype optionally (default
dtype). make_step draws random q/k/v, fills the
whole cache (unused blocks too) with random data and shuffles the block tables.
"""
from __future__ import annotations

from typing import Any


def make_step(case: dict, gen: Any) -> tuple:
    """Random query/key/value, a randomly filled cache and metadata with shuffled blocks."""
    import torch
    from folio.model.attention.backend import AttentionMetadata

    dtype = getattr(torch, case["dtype"])
    H, KVH, D, bs = case["H"], case["KVH"], case["D"], case["bs"]
    reqs = case["reqs"]
    ctx = [c + n for c, n in reqs]
    blocks_per_req = [-(-L // bs) for L in ctx]
    num_blocks = sum(blocks_per_req) + 3  # a few spare blocks the requests never own
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_req) + 1  # one padding column
    tables = torch.zeros(len(reqs), max_blocks, dtype=torch.int64)
    pos = 0
    for i, nb in enumerate(blocks_per_req):
        tables[i, :nb] = torch.tensor(perm[pos:pos + nb])
        pos += nb
    qsl, slots = [0], []
    for i, (c, n) in enumerate(reqs):
        qsl.append(qsl[-1] + n)
        for p in range(c, c + n):
            slots.append(int(tables[i, p // bs]) * bs + p % bs)
    T = qsl[-1]
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    k = torch.randn(T, KVH, D, generator=gen).to(dtype)
    v = torch.randn(T, KVH, D, generator=gen).to(dtype)
    cache_dtype = getattr(torch, case.get("cache_dtype", case["dtype"]))
    cache = torch.randn(2, num_blocks, bs, KVH, D, generator=gen).to(cache_dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=qsl,
        seq_lens=ctx, num_computed_tokens=[c for c, _ in reqs], block_tables=tables,
        block_size=bs)
    return q, k, v, cache, meta


def rel_err(out: Any, ref: Any) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())
