"""The Triton paged attention kernels over an FP8 KV cache, against the torch reference, under
the Triton CPU interpreter (in a child process: interpreter_harness.py).

Reads (varlen prefill/mixed, decode with and without split-K, per-head and per-tensor scales,
e4m3 and e5m2, fp32 and fp16 queries) run on the cache the reference wrote, and match its
output within the dtype's tolerance (the kernels fold the scales into the scores and the
output instead of scaling every element: the same math, another rounding). The writes are
checked on values the format holds exactly: the interpreter's own float32 -> float8 cast
is not the GPU's (it drops the carry when rounding overflows the mantissa, and flushes
subnormals), so a rounding write is compared byte for byte only on the GPU
(tests/gpu/test_fp8_kv_cache_gpu.py).
"""
from __future__ import annotations

import zlib
from typing import Any

import pytest
from interpreter_harness import child_main, interpreter_results, rel_err

MIXED = [(0, 13), (20, 9), (37, 16), (40, 1), (5, 1), (70, 1)]
DECODES = [(0, 1), (16, 1), (99, 1), (180, 1)]
CASES: list[dict[str, Any]] = [
    dict(name="varlen_fp32_e4m3_per_head", kind="read", dtype="float32",
         cache_dtype="float8_e4m3fn", H=4, KVH=2, D=64, bs=16, win=None, reqs=MIXED,
         scales=([0.02, 0.05], [0.03, 0.01])),
    dict(name="varlen_fp16_e4m3_per_tensor_g4_d128", kind="read", dtype="float16",
         cache_dtype="float8_e4m3fn", H=8, KVH=2, D=128, bs=32, win=None, reqs=MIXED,
         scales=([0.04], [0.02])),
    dict(name="varlen_fp32_e5m2_window_d80", kind="read", dtype="float32",
         cache_dtype="float8_e5m2", H=4, KVH=2, D=80, bs=16, win=24,
         reqs=[(0, 30), (33, 12), (50, 1), (3, 1)], scales=([0.01, 0.03], [0.02, 0.04])),
    dict(name="decode_fp32_e4m3_per_head_splits", kind="read", dtype="float32",
         cache_dtype="float8_e4m3fn", H=8, KVH=2, D=64, bs=16, win=None, reqs=DECODES,
         scales=([0.03, 0.01], [0.02, 0.06]), splits=[1, 4]),
    dict(name="decode_fp16_e4m3_window_splits", kind="read", dtype="float16",
         cache_dtype="float8_e4m3fn", H=4, KVH=2, D=128, bs=32, win=40,
         reqs=[(130, 1), (7, 1), (64, 1)], scales=([0.05], [0.01]), splits=[1, 3]),
    dict(name="decode_fp32_e5m2_splits", kind="read", dtype="float32",
         cache_dtype="float8_e5m2", H=4, KVH=1, D=64, bs=16, win=None, reqs=DECODES,
         scales=([0.02], [0.03]), splits=[2]),
    # The decode kernel reads pairs of elements (even D, padded to >= 32): half of a padded
    # head dim (80 -> 128: 40 of 64 columns), and a head dim too narrow for pairs (16).
    dict(name="decode_fp16_e4m3_d80_window_splits", kind="read", dtype="float16",
         cache_dtype="float8_e4m3fn", H=4, KVH=2, D=80, bs=16, win=50, reqs=DECODES,
         scales=([0.02, 0.04], [0.03, 0.02]), splits=[1, 4]),
    dict(name="decode_fp32_e4m3_d16_splits", kind="read", dtype="float32",
         cache_dtype="float8_e4m3fn", H=4, KVH=2, D=16, bs=16, win=None, reqs=DECODES,
         scales=([0.03, 0.02], [0.01, 0.05]), splits=[1, 2]),
    # The varlen kernel's float8 tiles (its 64-128-row tiles on a GPU; the interpreter's
    # 16-row tile reads pairs wherever the head dim allows them).
    dict(name="varlen_fp16_e4m3_d16_float8_tiles", kind="read", dtype="float16",
         cache_dtype="float8_e4m3fn", H=4, KVH=2, D=16, bs=16, win=None, reqs=MIXED,
         scales=([0.02, 0.05], [0.04, 0.01])),
    # Power-of-two scales and K/V the format holds exactly (one out of range: it saturates).
    dict(name="write_e4m3_per_head", kind="write", dtype="float32",
         cache_dtype="float8_e4m3fn", H=4, KVH=2, D=64, bs=16, win=None, reqs=MIXED,
         scales=([0.0625, 0.25], [0.125, 0.03125])),
    dict(name="write_e5m2_fp16", kind="write", dtype="float16", cache_dtype="float8_e5m2",
         H=4, KVH=2, D=64, bs=16, win=None, reqs=MIXED, scales=([0.5], [0.125])),
    dict(name="backend_e4m3_mixed", kind="backend", dtype="float32",
         cache_dtype="float8_e4m3fn", H=4, KVH=2, D=64, bs=16, win=None,
         reqs=[(0, 6), (21, 5), (9, 1)], scales=([0.0625, 0.125], [0.25, 0.125])),
    dict(name="backend_e4m3_decode_fp16", kind="backend", dtype="float16",
         cache_dtype="float8_e4m3fn", H=4, KVH=1, D=64, bs=16, win=30,
         reqs=[(120, 1), (40, 1), (2, 1)], scales=([0.125], [0.0625])),
]


# ---------------------------------------------------------------------- child-process side
def _run(case: dict) -> dict:
    import torch
    from paged_cases import make_step

    from folio.model.attention import triton_kernels as tk
    from folio.model.attention.fp8 import dequantize_kv, per_head_scales, quantize_kv
    from folio.model.attention.torch_paged import TorchPagedAttention, write_kv_cache
    from folio.model.attention.triton_backend import TritonPagedAttention

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    q, k, v, cache, meta = make_step(case, gen)
    kvh, f8 = case["KVH"], cache.dtype
    limit = torch.finfo(f8).max
    ks, vs = (per_head_scales(torch.tensor(s), kvh, torch.device("cpu")) for s in case["scales"])
    cache = (cache.float() * 8).to(f8)    # codes across the format's range
    if case["kind"] == "read":
        k = (k.float() * 30 * ks.max()).to(k.dtype)
        v = (v.float() * 30 * vs.max()).to(v.dtype)
    else:   # K/V the format holds exactly (scales are powers of two), one element past it
        k = dequantize_kv(quantize_kv(k.float() * 8 * ks[:, None], ks, f8), ks, k.dtype)
        v = dequantize_kv(quantize_kv(v.float() * 8 * vs[:, None], vs, f8), vs, v.dtype)
        k[0, 0, 0] = 4 * limit * ks[0]
    scale = case["D"] ** -0.5
    win = case["win"]
    ref_cache = cache.clone()
    ref = TorchPagedAttention().forward(q, k, v, ref_cache, meta, scale=scale,
                                        sliding_window=win, k_scale=ks, v_scale=vs)
    result: dict[str, Any] = {"name": case["name"], "checks": {}}

    def record(label: str, out: torch.Tensor) -> None:
        result["checks"][label] = {"rel_err": rel_err(out, ref),
                                   "all_written": bool(torch.isfinite(out).all())}

    backend = TritonPagedAttention()
    st = backend.step_tensors(meta)
    if case["kind"] == "backend":
        tri_cache = cache.clone()
        record("backend", backend.forward(q, k, v, tri_cache, meta, scale=scale,
                                          sliding_window=win, k_scale=ks, v_scale=vs))
        result["cache_equal"] = bool(torch.equal(tri_cache.view(torch.uint8),
                                                 ref_cache.view(torch.uint8)))
        return result
    if case["kind"] == "write":
        slots = st.slot_mapping.clone()
        slots[1] = -1   # a padding token: skipped
        tri_cache = cache.clone()
        tk.reshape_and_cache(k, v, tri_cache, slots, k_scale=ks, v_scale=vs)
        expect = cache.clone()
        keep = slots >= 0
        write_kv_cache(k[keep], v[keep], expect, slots[keep], ks, vs)
        result["cache_equal"] = bool(torch.equal(tri_cache.view(torch.uint8),
                                                 expect.view(torch.uint8)))
        first = tri_cache[0].view(-1, kvh, case["D"])[int(slots[0]), 0, 0]
        result["saturated"] = float(first.float()) == limit
        return result
    out = torch.full_like(q, float("nan"))
    tk.paged_attention_varlen(
        q, ref_cache, query_start_loc=st.query_start_loc, seq_lens=st.seq_lens,
        block_tables=st.block_tables, max_query_len=st.max_query_len,
        max_seq_len=st.max_seq_len, scale=scale, sliding_window=win, out=out,
        k_scale=ks, v_scale=vs)
    record("varlen", out)
    for splits in case.get("splits", []):
        out = torch.full_like(q, float("nan"))
        tk.paged_attention_decode(q, ref_cache, st.seq_lens, st.block_tables, scale, win,
                                  num_splits=splits, out=out, k_scale=ks, v_scale=vs)
        record(f"decode_splits{splits}", out)
    return result


# ---------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__, timeout=600)


def _get(results: dict, name: str) -> dict:
    res = results.get(name)
    assert res is not None, f"no result for {name}; child stderr:\n{results['_stderr']}"
    assert "error" not in res, res.get("error")
    return res


@pytest.mark.parametrize("case", [c for c in CASES if c["kind"] != "write"],
                         ids=[c["name"] for c in CASES if c["kind"] != "write"])
def test_fp8_attention_matches_the_reference(results: dict, case: dict) -> None:
    res = _get(results, case["name"])
    tol = 1e-4 if case["dtype"] == "float32" else 1e-2
    assert res["checks"], "no checks ran"
    if case["kind"] == "backend":
        assert res["cache_equal"], "the FP8 cache write differs from the reference"
    for label, chk in res["checks"].items():
        assert chk["all_written"], f"{label}: output has unwritten (NaN) elements"
        assert chk["rel_err"] < tol, f"{label}: rel err {chk['rel_err']:.2e} >= {tol}"


@pytest.mark.parametrize("dtype,d,pairs", [("float8_e4m3fn", 128, True),
                                           ("float8_e5m2", 80, True),
                                           ("float8_e4m3fn", 16, False),
                                           ("float8_e4m3fn", 33, False),
                                           ("bfloat16", 128, False)])
def test_even_head_dims_are_read_in_pairs(dtype: str, d: int, pairs: bool) -> None:
    import torch

    from folio.model.attention import triton_kernels as tk
    cache = torch.zeros(2, 3, 16, 2, d, dtype=getattr(torch, dtype))
    mode = tk._read_mode(cache, max(16, tk._next_pow2(d)))
    assert mode["PAIRS"] is pairs
    assert mode["E5M2"] is (pairs and dtype == "float8_e5m2")
    assert mode["CVT_ASM"] is False   # a CPU tensor: the byte-wise widening


def test_a_cache_view_with_odd_strides_reads_float8_tiles() -> None:
    # The pairs halve the cache's offsets: a view whose strides (or start) are odd must not
    # take them. Its head dim (32 of a row of 33) is even.
    import torch

    from folio.model.attention import triton_kernels as tk
    base = torch.zeros(2, 3, 16, 2, 33, dtype=torch.float8_e4m3fn)
    assert tk._read_mode(base[..., :32].contiguous(), 32)["PAIRS"] is True
    assert tk._read_mode(base[..., :32], 32)["PAIRS"] is False          # odd strides
    flat = torch.zeros(1 + 2 * 3 * 16 * 2 * 32, dtype=torch.float8_e4m3fn)
    shifted = flat[1:].view(2, 3, 16, 2, 32)                              # odd start
    assert tk._read_mode(shifted, 32)["PAIRS"] is False


@pytest.mark.parametrize("case", [c for c in CASES if c["kind"] == "write"],
                         ids=[c["name"] for c in CASES if c["kind"] == "write"])
def test_fp8_cache_write_matches_the_reference(results: dict, case: dict) -> None:
    res = _get(results, case["name"])
    assert res["cache_equal"], "K/V bytes differ from the reference's (or padding was written)"
    assert res["saturated"], "an out-of-range key did not saturate to the format's largest value"


if __name__ == "__main__":
    child_main(CASES, _run)
