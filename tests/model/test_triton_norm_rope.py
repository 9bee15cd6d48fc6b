"""Triton RMSNorm(+residual), rotary, SiLU-and-mul and grammar-bitmask kernels vs their torch
references, under the interpreter.

Like test_triton_attention.py, the checks run in a child process started with
TRITON_INTERPRET=1 (the flag must precede triton's first import and must not leak into other
tests); it prints one JSON line per case. Fresh random inputs per case (strided views as a
fused qkv would give), fp32 and fp16 only; every output element is compared (relative error
against the layers' torch code) and must be finite.
"""
from __future__ import annotations

import pytest
from interpreter_harness import child_main, interpreter_results, rel_err

CASES = [
    dict(name="rmsnorm_fp32_d64", kind="rmsnorm", dtype="float32", D=64, rows=7, residual=False),
    dict(name="rmsnorm_res_fp16_d96", kind="rmsnorm", dtype="float16", D=96, rows=5,
         residual=True),
    dict(name="rope_fp32_full_d64", kind="rope", dtype="float32", H=4, KVH=2, D=64, T=6,
         partial=1.0),
    dict(name="rope_fp16_partial_d128", kind="rope", dtype="float16", H=2, KVH=1, D=128, T=5,
         partial=0.5),
    dict(name="rope_qknorm_fp32_d64", kind="rope", dtype="float32", H=4, KVH=2, D=64, T=5,
         partial=1.0, norm=True),
    dict(name="rope_qknorm_fp16_partial_d128", kind="rope", dtype="float16", H=2, KVH=1, D=128,
         T=3, partial=0.5, norm=True),
    # More heads than one program's block (8): two query blocks, the second half masked.
    dict(name="rope_qknorm_fp32_h12_kvh4_d64", kind="rope", dtype="float32", H=12, KVH=4, D=64,
         T=4, partial=1.0, norm=True),
    dict(name="rope_fp16_h16_kvh8_partial_d64", kind="rope", dtype="float16", H=16, KVH=8, D=64,
         T=3, partial=0.5),
    # The cache write in the rotary's launch (PagedKVWrite) against the separate write kernel:
    # the same cache bytes, a padding token's slot (-1) left alone.
    dict(name="rope_cache_fp32_d64", kind="rope", dtype="float32", H=4, KVH=2, D=64, T=6,
         partial=1.0, cache="float32"),
    dict(name="rope_cache_qknorm_fp16_partial_d128", kind="rope", dtype="float16", H=2, KVH=1,
         D=128, T=5, partial=0.5, norm=True, cache="float16"),
    dict(name="rope_cache_fp8_fp16_h12_kvh4_d64", kind="rope", dtype="float16", H=12, KVH=4,
         D=64, T=4, partial=1.0, cache="float8_e4m3fn"),
    dict(name="bitmask_fp32_v1000", kind="bitmask", dtype="float32", V=1000, rows=3),
    dict(name="bitmask_fp16_v2085", kind="bitmask", dtype="float16", V=2085, rows=2),
    dict(name="silu_mul_fp32_i96", kind="silu_mul", dtype="float32", I=96, rows=3),
    dict(name="silu_mul_fp16_i1500", kind="silu_mul", dtype="float16", I=1500, rows=4),
]


def _run(case: dict) -> dict:
    import types
    import zlib

    import torch
    from folio.model.layers import RMSNorm, RotaryEmbedding

    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    dtype = getattr(torch, case["dtype"])
    checks = {}
    if case["kind"] == "rmsnorm":
        from folio.model.kernels.rmsnorm import rms_norm
        D = case["D"]
        norm = RMSNorm(D, eps=1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(D, generator=gen))
        # A strided view, as a slice of a wider activation would be.
        x = torch.randn(case["rows"], 2 * D, generator=gen).to(dtype)[:, :D]
        if case["residual"]:
            res = torch.randn(case["rows"], D, generator=gen).to(dtype)
            ref_out, ref_res = norm(x, res)
            out, new_res = rms_norm(x, norm.weight.data, 1e-5, residual=res)
            checks["residual"] = (rel_err(new_res, ref_res), bool(torch.isfinite(new_res).all()))
        else:
            ref_out = norm(x)
            out = rms_norm(x, norm.weight.data, 1e-5)
        checks["out"] = (rel_err(out, ref_out.detach()), bool(torch.isfinite(out).all()))
    elif case["kind"] == "bitmask":
        from folio.model.kernels.bitmask import apply_bitmask_inplace
        from folio.structured_output.masking import unpack_bitmask
        V, rows = case["V"], case["rows"]
        words = (V + 31) // 32
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=gen,
                                dtype=torch.int64).to(torch.int32)
        bitmask[-1] = -1  # an unconstrained row: must come out unchanged
        logits = torch.randn(rows, V, generator=gen).to(dtype)
        ref = logits.masked_fill(~unpack_bitmask(bitmask, V), float("-inf"))
        out = logits.clone()
        apply_bitmask_inplace(out, bitmask)
        same_inf = bool(torch.equal(torch.isinf(out), torch.isinf(ref)))
        finite = ~torch.isinf(ref)
        checks["out"] = (rel_err(out[finite], ref[finite]), same_inf)
    elif case["kind"] == "silu_mul":
        from folio.model.kernels.activation import silu_and_mul
        from folio.model.layers import GatedMLP
        I, rows = case["I"], case["rows"]
        gate_up = torch.randn(rows, 2 * I, generator=gen).to(dtype) * 4
        mlp = GatedMLP(8, I, bias=False, act="silu")
        gate, up = gate_up.chunk(2, dim=-1)
        ref = mlp.act(gate) * up  # the eager path GatedMLP.forward takes off CUDA
        out = silu_and_mul(gate_up)
        checks["out"] = (rel_err(out, ref), bool(torch.isfinite(out).all()))
    else:
        from folio.model.kernels.rotary import apply_rotary
        H, KVH, D, T = case["H"], case["KVH"], case["D"], case["T"]
        cfg = types.SimpleNamespace(rope_theta=10000.0, partial_rotary_factor=case["partial"])
        rope = RotaryEmbedding(D, 64, cfg)
        qkv = torch.randn(T, (H + 2 * KVH) * D, generator=gen).to(dtype)
        q = qkv[:, :H * D].view(T, H, D)                    # strided views of a fused qkv
        k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
        pos = torch.randint(0, 64, (T,), generator=gen)
        if case.get("norm"):  # Qwen3's per-head q/k RMSNorm, fused into the rotary launch
            q_norm, k_norm = RMSNorm(D, eps=1e-6).to(dtype), RMSNorm(D, eps=1e-6).to(dtype)
            with torch.no_grad():
                q_norm.weight.copy_(torch.randn(D, generator=gen))
                k_norm.weight.copy_(torch.randn(D, generator=gen))
            ref_q, ref_k = rope(pos, q_norm(q), k_norm(k))
            weights = (q_norm.weight.data, k_norm.weight.data)
        else:
            ref_q, ref_k = rope(pos, q, k)
            weights = (None, None)
        out_q, out_k = apply_rotary(pos, q, k, rope.cos, rope.sin, *weights, 1e-6)
        checks["q"] = (rel_err(out_q, ref_q), bool(torch.isfinite(out_q).all()))
        checks["k"] = (rel_err(out_k, ref_k), bool(torch.isfinite(out_k).all()))
        if case.get("cache"):
            checks.update(_rope_cache_checks(case, gen, qkv, pos, rope, q, k, weights, out_q,
                                             out_k))
    return {"name": case["name"], "checks": checks}


def _rope_cache_checks(case: dict, gen, qkv, pos, rope, q, k, weights, out_q, out_k) -> dict:
    """apply_rotary with a PagedKVWrite: the same q and k as without, and the cache bytes the
    separate write (reshape_and_cache) gives for the rotated keys; one padding slot."""
    import torch
    from folio.model.attention import triton_kernels as tk
    from folio.model.kernels.rotary import PagedKVWrite, apply_rotary
    H, KVH, D, T = case["H"], case["KVH"], case["D"], case["T"]
    v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
    cache_dtype = getattr(torch, case["cache"])
    fp8 = cache_dtype.itemsize == 1
    cache = torch.randn(2, 3, 4, KVH, D, generator=gen).to(cache_dtype)   # 12 slots
    slots = torch.randperm(12, generator=gen)[:T]
    slots[1] = -1
    ks = torch.rand(KVH, generator=gen) + 0.5 if fp8 else None
    vs = torch.rand(KVH, generator=gen) + 0.5 if fp8 else None
    expect = cache.clone()
    tk.reshape_and_cache(out_k, v, expect, slots, k_scale=ks, v_scale=vs)
    fused = cache.clone()
    fp8_flag, kss, vss = tk.kv_scales(fused, ks, vs)
    write = PagedKVWrite(v, fused, slots, kss, vss,
                         float(torch.finfo(cache_dtype).max) if fp8_flag else 0.0,
                         separately=lambda key: None)
    fq, fk = apply_rotary(pos, q, k, rope.cos, rope.sin, *weights, 1e-6, kv_write=write)
    same = bool(torch.equal(fused.view(torch.uint8), expect.view(torch.uint8)))
    return {"q_with_write": (rel_err(fq, out_q), bool(torch.isfinite(fq).all())),
            "k_with_write": (rel_err(fk, out_k), bool(torch.isfinite(fk).all())),
            "cache": (0.0 if same else 1.0, bool(torch.isfinite(fused.float()).all()))}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_kernel_matches_layers(results: dict, case: dict) -> None:
    res = results.get(case["name"])
    assert res is not None, f"no result; child stderr:\n{results['_stderr']}"
    assert "error" not in res, res.get("error")
    tol = 1e-5 if case["dtype"] == "float32" else 2e-3
    for label, (err, written) in res["checks"].items():
        assert written, f"{label}: unwritten (NaN) elements"
        assert err < tol, f"{label}: rel err {err:.2e} >= {tol}"


if __name__ == "__main__":
    child_main(CASES, _run)
