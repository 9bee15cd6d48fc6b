"""Triton paged attention vs the torch reference, under the Triton CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported, and other test modules in the
same pytest process may import triton first (and the flag would then leak into them). So the
checks run in one child process (this file run as a script, with TRITON_INTERPRET=1), which
prints one JSON line per case; the pytest tests below assert on those lines.

Each case draws fresh random inputs, fills the whole cache (unused blocks too) with random data,
shuffles block tables, poisons the output with NaN, and compares with TorchPagedAttention by
relative error ||out - ref|| / ||ref||. fp32 and fp16 only: the interpreter gets bf16 wrong.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from typing import Any

import pytest
from paged_cases import make_step, rel_err

# (name, dtype, heads, kv_heads, head_dim, block_size, sliding_window, reqs, extra)
# reqs: (num_computed_tokens, query_len) per request.
MIXED = [(0, 13), (20, 9), (37, 16), (40, 1), (5, 1), (70, 1)]
CASES: list[dict[str, Any]] = [
    dict(name="mixed_fp32_g2_d64_bs16", dtype="float32", H=4, KVH=2, D=64, bs=16, win=None,
         reqs=MIXED),
    dict(name="mixed_fp16_g4_d128_bs32", dtype="float16", H=8, KVH=2, D=128, bs=32, win=None,
         reqs=MIXED),
    dict(name="mixed_fp32_g1_d128_bs16_window", dtype="float32", H=2, KVH=2, D=128, bs=16,
         win=24, reqs=[(0, 30), (33, 12), (50, 1), (3, 1)]),
    dict(name="mixed_fp16_g4_d64_bs32_window", dtype="float16", H=4, KVH=1, D=64, bs=32,
         win=20, reqs=[(45, 7), (0, 9), (60, 1)]),
    dict(name="mixed_fp32_g2_d80_pad", dtype="float32", H=4, KVH=2, D=80, bs=16, win=None,
         reqs=[(0, 5), (17, 6), (30, 1)]),
    dict(name="single_long_prefill_fp32_g1", dtype="float32", H=1, KVH=1, D=64, bs=16,
         win=None, reqs=[(0, 40)]),
    dict(name="decode_fp32_g4_d64_bs16", dtype="float32", H=8, KVH=2, D=64, bs=16, win=None,
         reqs=[(0, 1), (16, 1), (99, 1), (180, 1)], splits=[1, 4]),
    dict(name="decode_fp16_g2_d128_bs32_window", dtype="float16", H=4, KVH=2, D=128, bs=32,
         win=40, reqs=[(130, 1), (7, 1), (64, 1)], splits=[1, 3]),
    # the fused merge reads _MERGE_BLOCK // (G_P * D_PAD) splits a load (the child sets the
    # block to 1024 for this case: 2 splits), so 4 and 5 splits merge over several loads
    # (the running maximum rescaled), with 3 heads per KV head padded to 4, and a sink
    # counted once
    dict(name="decode_fp32_g3_d128_merge_chunks", dtype="float32", H=6, KVH=2, D=128, bs=16,
         win=None, reqs=[(0, 1), (70, 1), (250, 1)], splits=[4, 5], sinks=True,
         merge_block=1024),
    dict(name="decode_fp32_g1_d128_bs16_window", dtype="float32", H=2, KVH=2, D=128, bs=16,
         win=33, reqs=[(150, 1), (31, 1)], splits=[2]),
    dict(name="backend_mixed_fp16", dtype="float16", H=4, KVH=2, D=64, bs=16, win=None,
         reqs=[(0, 6), (21, 5), (9, 1)], backend=True),
    dict(name="backend_decode_fp32_window", dtype="float32", H=4, KVH=1, D=64, bs=16, win=30,
         reqs=[(120, 1), (40, 1), (2, 1)], backend=True),
    # Soft cap (Gemma 2) and attention sinks (GPT-OSS): scores are about N(0, 1) here, so a
    # cap of 1.5 bends most of them and sinks near +1 take a real share of the softmax. Split
    # decode checks that the sink is counted once across splits.
    dict(name="softcap_mixed_fp32_g2", dtype="float32", H=4, KVH=2, D=64, bs=16, win=None,
         reqs=MIXED, cap=1.5),
    dict(name="sinks_mixed_fp16_g4_window", dtype="float16", H=8, KVH=2, D=64, bs=16, win=20,
         reqs=[(45, 7), (0, 9), (60, 1)], sinks=True),
    dict(name="softcap_sinks_decode_fp32_g4", dtype="float32", H=8, KVH=2, D=64, bs=16,
         win=None, reqs=[(0, 1), (16, 1), (99, 1), (180, 1)], splits=[1, 4], cap=2.0,
         sinks=True),
    dict(name="softcap_sinks_backend_mixed_fp32", dtype="float32", H=4, KVH=2, D=80, bs=16,
         win=None, reqs=[(0, 6), (21, 5), (9, 1)], backend=True, cap=1.5, sinks=True),
]


# ---------------------------------------------------------------------- child-process side
def _run_case(case: dict) -> dict:
    import torch
    from folio.model.attention import triton_kernels as tk
    from folio.model.attention.torch_paged import TorchPagedAttention
    from folio.model.attention.triton_backend import TritonPagedAttention

    # Fresh inputs per case, reproducible across runs (str hash() is salted per process).
    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    q, k, v, cache, meta = make_step(case, gen)
    scale = case["D"] ** -0.5
    win = case["win"]
    cap = case.get("cap")
    sinks = (torch.randn(case["H"], generator=gen) + 1.0) if case.get("sinks") else None
    extra = dict(logits_soft_cap=cap, sinks=sinks)
    ref_cache = cache.clone()
    ref = TorchPagedAttention().forward(q, k, v, ref_cache, meta, scale=scale,
                                        sliding_window=win, **extra)
    result: dict[str, Any] = {"name": case["name"], "checks": {}}

    def record(label: str, out: torch.Tensor) -> None:
        result["checks"][label] = {"rel_err": rel_err(out, ref),
                                   "all_written": bool(torch.isfinite(out).all())}

    backend = TritonPagedAttention()
    if case.get("backend"):
        tri_cache = cache.clone()
        out = backend.forward(q, k, v, tri_cache, meta, scale=scale, sliding_window=win,
                              **extra)
        record("backend", out)
        result["cache_equal"] = bool(torch.equal(tri_cache, ref_cache))
        return result

    st = backend.step_tensors(meta)
    tri_cache = cache.clone()
    tk.reshape_and_cache(k, v, tri_cache, st.slot_mapping)
    result["cache_equal"] = bool(torch.equal(tri_cache, ref_cache))
    out = torch.full_like(q, float("nan"))
    tk.paged_attention_varlen(
        q, tri_cache, query_start_loc=st.query_start_loc, seq_lens=st.seq_lens,
        block_tables=st.block_tables, max_query_len=st.max_query_len,
        max_seq_len=st.max_seq_len, scale=scale, sliding_window=win, out=out, **extra)
    record("varlen", out)
    merge_block = tk._MERGE_BLOCK
    tk._MERGE_BLOCK = case.get("merge_block", merge_block)
    try:
        _decode_splits(case, q, tri_cache, st, scale, win, extra, record)
    finally:
        tk._MERGE_BLOCK = merge_block
    return result


def _decode_splits(case, q, tri_cache, st, scale, win, extra, record) -> None:
    """The decode kernel at each of the case's split counts, merged in its last split and,
    forced, by the merge kernel."""
    import torch
    from folio.model.attention import triton_kernels as tk
    for splits in case.get("splits", []):
        out = torch.full_like(q, float("nan"))
        tk.paged_attention_decode(q, tri_cache, st.seq_lens, st.block_tables, scale, win,
                                  num_splits=splits, out=out, **extra)
        record(f"decode_splits{splits}", out)
        if splits > 1:
            # the merge kernel, where the batch has more (request, KV head) pairs than the
            # fused merge's tickets
            tickets, tk._MERGE_TICKETS = tk._MERGE_TICKETS, 0
            try:
                out = torch.full_like(q, float("nan"))
                tk.paged_attention_decode(q, tri_cache, st.seq_lens, st.block_tables, scale,
                                          win, num_splits=splits, out=out, **extra)
            finally:
                tk._MERGE_TICKETS = tickets
            record(f"decode_splits{splits}_merge_kernel", out)


def _run_reshape_and_cache_padding() -> dict:
    """Padding slots (-1) are skipped; a strided key view (as sliced from a fused qkv) works."""
    import torch
    from folio.model.attention import triton_kernels as tk

    gen = torch.Generator().manual_seed(7)
    KVH, D, bs, nb = 2, 64, 16, 4
    qkv = torch.randn(5, 3 * KVH * D, generator=gen)
    k = qkv[:, KVH * D:2 * KVH * D].view(5, KVH, D)   # non-contiguous rows
    v = qkv[:, 2 * KVH * D:].view(5, KVH, D)
    cache = torch.randn(2, nb, bs, KVH, D, generator=gen)
    expect = cache.clone()
    slots = torch.tensor([3, -1, 40, 17, -1])
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect[0, s // bs, s % bs] = k[t]
            expect[1, s // bs, s % bs] = v[t]
    tk.reshape_and_cache(k, v, cache, slots)
    return {"name": "reshape_and_cache_padding", "checks": {},
            "cache_equal": bool(torch.equal(cache, expect))}


def _run_varlen_skip() -> dict:
    """Requests flagged in `skip` leave their output rows alone (their attention is another
    kernel's: dense_prefill.py); the others match the reference as without flags."""
    import torch
    from folio.model.attention import triton_kernels as tk
    from folio.model.attention.torch_paged import TorchPagedAttention
    from folio.model.attention.triton_backend import TritonPagedAttention

    case = dict(name="varlen_skip", dtype="float32", H=4, KVH=2, D=64, bs=16, win=None,
                reqs=MIXED)
    gen = torch.Generator().manual_seed(11)
    q, k, v, cache, meta = make_step(case, gen)
    ref = TorchPagedAttention().forward(q, k, v, cache.clone(), meta, scale=0.125)
    st = TritonPagedAttention().step_tensors(meta)
    tri_cache = cache.clone()
    tk.reshape_and_cache(k, v, tri_cache, st.slot_mapping)
    skip = torch.tensor([1, 0, 1, 0, 0, 0], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    tk.paged_attention_varlen(
        q, tri_cache, query_start_loc=st.query_start_loc, seq_lens=st.seq_lens,
        block_tables=st.block_tables, max_query_len=st.max_query_len,
        max_seq_len=st.max_seq_len, scale=0.125, out=out, skip=skip)
    qsl = meta.query_start_loc
    skipped = torch.zeros(q.shape[0], dtype=torch.bool)
    for i, flag in enumerate(skip.tolist()):
        if flag:
            skipped[qsl[i]:qsl[i + 1]] = True
    return {"name": "varlen_skip", "checks": {}, "cache_equal": True,
            "skipped_untouched": bool(torch.isnan(out[skipped]).all()),
            "others_rel_err": rel_err(out[~skipped], ref[~skipped])}


def _child_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    torch.set_num_threads(1)
    jobs = [(c["name"], lambda c=c: _run_case(c)) for c in CASES]
    jobs.append(("reshape_and_cache_padding", _run_reshape_and_cache_padding))
    jobs.append(("varlen_skip", _run_varlen_skip))
    for name, job in jobs:
        try:
            res = job()
        except Exception as exc:  # report, keep going with the other cases
            import traceback
            res = {"name": name, "error": f"{exc!r}\n{traceback.format_exc()}"}
        print("RESULT " + json.dumps(res), flush=True)


# ---------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    parsed = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT "):])
            parsed[res["name"]] = res
    if proc.returncode != 0 and not parsed:
        pytest.fail(f"interpreter child failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    parsed["_stderr"] = {"text": proc.stderr[-4000:]}
    return parsed


def _get(results: dict, name: str) -> dict:
    res = results.get(name)
    assert res is not None, f"no result for {name}; child stderr:\n{results['_stderr']['text']}"
    assert "error" not in res, res.get("error")
    return res


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_attention_matches_reference(results: dict, case: dict) -> None:
    res = _get(results, case["name"])
    tol = 1e-3 if case["dtype"] == "float32" else 1e-2
    assert res["cache_equal"], "K/V cache write differs from the reference"
    assert res["checks"], "no checks ran"
    for label, chk in res["checks"].items():
        assert chk["all_written"], f"{label}: output has unwritten (NaN) elements"
        assert chk["rel_err"] < tol, f"{label}: rel err {chk['rel_err']:.2e} >= {tol}"


def test_reshape_and_cache_skips_padding(results: dict) -> None:
    assert _get(results, "reshape_and_cache_padding")["cache_equal"]


def test_varlen_skips_flagged_requests(results: dict) -> None:
    res = _get(results, "varlen_skip")
    assert res["skipped_untouched"], "a skipped request's rows were written"
    assert res["others_rel_err"] < 1e-3, res["others_rel_err"]


if __name__ == "__main__":
    _child_main()
