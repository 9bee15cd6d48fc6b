"""Skinny (few-row) Triton matmul and fused gate_up + SiLU-and-mul vs torch, under the
interpreter; and the layers' CPU fallback.

Like test_triton_norm_rope.py, the kernel checks run in a child process started with
TRITON_INTERPRET=1 (the flag must precede triton's first import and must not leak into other
tests); it prints one JSON line per case. fp32 and fp16 only (the interpreter's bf16 arithmetic
is wrong). N and K are ragged against the tiles, x is a strided row view, and besides the
autotuner's (single, interpreter) config each kernel path is forced once: split-K (ticket
reduction) and tl.dot on x padded to 16 rows. Outputs are poisoned with NaN first so unwritten
elements show. Reference: float64 matmul; for gate_up, the float64 projection rounded to the
dtype, then silu rounded, then the product rounded, as the unfused path rounds.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from interpreter_harness import calls_with_norm, child_main, interpreter_results, rel_err

FMA_SPLIT = dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=3, DOT=0)
DOT = dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, DOT=1)
DOT_SPLIT = dict(BLOCK_N=16, BLOCK_K=16, SPLIT_K=2, DOT=1)
# K = 64 in three splits of two 16-wide tiles: the last split is empty (k_lo = K), and K is a
# whole number of tiles, so only the split's own range masks its first (peeled) tile.
EMPTY_SPLIT = dict(BLOCK_N=8, BLOCK_K=16, SPLIT_K=3, DOT=0)

CASES: list[dict[str, Any]] = []
for _dt in ("float32", "float16"):
    for _m in (1, 3, 8):
        CASES.append(dict(name=f"mm_{_dt}_m{_m}_n37_k100", kind="mm", dtype=_dt, M=_m, N=37,
                          K=100, bias=_m != 3))
    CASES.append(dict(name=f"gu_{_dt}_m3_i37_k100", kind="gate_up", dtype=_dt, M=3, N=37,
                      K=100, bias=True))
CASES += [
    dict(name="mm_float16_m8_n96_k64", kind="mm", dtype="float16", M=8, N=96, K=64, bias=True),
    dict(name="mm_float32_m2_n40_k100_split", kind="mm", dtype="float32", M=2, N=40, K=100,
         bias=True, config=FMA_SPLIT),
    dict(name="mm_float16_m1_n37_k100_split", kind="mm", dtype="float16", M=1, N=37, K=100,
         bias=False, config=FMA_SPLIT),
    dict(name="mm_float32_m5_n37_k100_dot", kind="mm", dtype="float32", M=5, N=37, K=100,
         bias=True, config=DOT),
    dict(name="mm_float16_m8_n40_k96_dot_split", kind="mm", dtype="float16", M=8, N=40, K=96,
         bias=False, config=DOT_SPLIT),
    dict(name="gu_float32_m1_i24_k64", kind="gate_up", dtype="float32", M=1, N=24, K=64,
         bias=False),
    dict(name="gu_float16_m8_i48_k64", kind="gate_up", dtype="float16", M=8, N=48, K=64,
         bias=True),
    dict(name="gu_float32_m2_i37_k100_split", kind="gate_up", dtype="float32", M=2, N=37,
         K=100, bias=True, config=FMA_SPLIT),
    dict(name="gu_float16_m6_i37_k100_dot", kind="gate_up", dtype="float16", M=6, N=37, K=100,
         bias=False, config=DOT),
    dict(name="mm_float16_m1_n24_k64_empty_split", kind="mm", dtype="float16", M=1, N=24,
         K=64, bias=True, config=EMPTY_SPLIT),
    dict(name="gu_float32_m2_i24_k64_empty_split", kind="gate_up", dtype="float32", M=2, N=24,
         K=64, bias=False, config=EMPTY_SPLIT),
    dict(name="gu_float32_m4_i40_k96_dot_split", kind="gate_up", dtype="float32", M=4, N=40,
         K=96, bias=True, config=DOT_SPLIT),
    # The residual add + RMSNorm epilogue (skinny_matmul_add_norm) against the product, then
    # the norm kernel: equal bit for bit, on every kernel path.
    dict(name="norm_float32_m1_n37_k100", kind="mm_norm", dtype="float32", M=1, N=37, K=100,
         bias=False),
    dict(name="norm_float16_m3_n40_k100_split", kind="mm_norm", dtype="float16", M=3, N=40,
         K=100, bias=True, config=FMA_SPLIT),
    dict(name="norm_float16_m8_n37_k100_dot", kind="mm_norm", dtype="float16", M=8, N=37,
         K=100, bias=False, config=DOT),
    dict(name="norm_float32_m2_n40_k96_dot_split", kind="mm_norm", dtype="float32", M=2, N=40,
         K=96, bias=True, config=DOT_SPLIT),
    # rows wider than the epilogue's chunk (1,024 columns): two passes of two chunks
    dict(name="norm_float16_m2_n1100_k32", kind="mm_norm", dtype="float16", M=2, N=1100,
         K=32, bias=False),
    # autotuned: a key's first launch with the epilogue is preceded by one of the plain
    # product, which then chooses the key's config (gemv.tune_on_plain_product)
    dict(name="norm_tuned_plain_first_float32_m2_n40_k64", kind="mm_norm_tuning",
         dtype="float32", M=2, N=40, K=64, bias=True),
]


def _run(case: dict) -> dict:
    import zlib

    from folio.model.kernels import gemv

    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    dtype = getattr(torch, case["dtype"])
    M, N, K = case["M"], case["N"], case["K"]
    rows = 2 * N if case["kind"] == "gate_up" else N
    # A strided row view, as a slice of a wider activation would be.
    x = torch.randn(M, K + 24, generator=gen).to(dtype)[:, 5:K + 5]
    w = (torch.randn(rows, K, generator=gen) * K ** -0.5).to(dtype)
    b = torch.randn(rows, generator=gen).to(dtype) if case["bias"] else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    cfg = case.get("config")
    # Poison the workspace: split-K must not read partials it did not write.
    partials, counters = gemv._workspace(x.device)
    partials.fill_(float("nan"))
    checks = {}
    if case["kind"] == "mm":
        out = torch.full((M, N), float("nan"), dtype=dtype)
        res = gemv.skinny_matmul(x, w, b, out=out, _config=cfg)
        checks["same_out"] = (0.0, res.data_ptr() == out.data_ptr())
        checks["out"] = (rel_err(out, ref), bool(torch.isfinite(out).all()))
        again = gemv.skinny_matmul(x, w, b, _config=cfg)
        checks["deterministic"] = (0.0, bool(torch.equal(again, out)))
    elif case["kind"] == "mm_norm":
        from folio.model.kernels.rmsnorm import rms_norm
        residual = torch.randn(M, N, generator=gen).to(dtype)
        norm_w = (1 + 0.1 * torch.randn(N, generator=gen)).to(dtype)
        normed, res_out = gemv.skinny_matmul_add_norm(x, w, residual, norm_w, 1e-5, b,
                                                      _config=cfg)
        y = gemv.skinny_matmul(x, w, b, _config=cfg)
        want_normed, want_res = rms_norm(y, norm_w, 1e-5, residual)
        checks["normed"] = (0.0 if torch.equal(normed, want_normed) else 1.0,
                            bool(torch.isfinite(normed).all()))
        checks["residual"] = (0.0 if torch.equal(res_out, want_res) else 1.0,
                              bool(torch.isfinite(res_out).all()))
        checks["out"] = (rel_err(y, ref), bool(torch.isfinite(y).all()))
    elif case["kind"] == "mm_norm_tuning":
        from folio.model.kernels.rmsnorm import rms_norm
        residual = torch.randn(M, N, generator=gen).to(dtype)
        norm_w = (1 + 0.1 * torch.randn(N, generator=gen)).to(dtype)
        with calls_with_norm(gemv, "_launch") as launches:
            first = gemv.skinny_matmul_add_norm(x, w, residual, norm_w, 1e-5, b)
            second = gemv.skinny_matmul_add_norm(x, w, residual, norm_w, 1e-5, b)
        checks["plain_first_then_epilogue_only"] = (
            0.0, launches == [False, True, True])
        want = rms_norm(gemv.skinny_matmul(x, w, b), norm_w, 1e-5, residual)
        checks["normed"] = (0.0 if all(torch.equal(a, e) for r in (first, second)
                                       for a, e in zip(r, want)) else 1.0, True)
    else:
        gate, up = ref.to(dtype).float().chunk(2, dim=-1)
        expect = (F.silu(gate).to(dtype).float() * up).to(dtype)
        out = gemv.skinny_gate_up_silu(x, w, b, _config=cfg)
        checks["out"] = (rel_err(out, expect), bool(torch.isfinite(out).all()))
        checks["shape"] = (0.0, tuple(out.shape) == (M, N))
    checks["counters_reset"] = (0.0, bool((counters == 0).all()))
    return {"name": case["name"], "checks": checks}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_kernel_matches_torch(results: dict, case: dict) -> None:
    res = results.get(case["name"])
    assert res is not None, f"no result; child stderr:\n{results['_stderr']}"
    assert "error" not in res, res.get("error")
    tol = 1e-5 if case["dtype"] == "float32" else 2e-3
    for label, (err, ok) in res["checks"].items():
        assert ok, f"{label}: failed (unwritten/NaN elements, or the property does not hold)"
        assert err < tol, f"{label}: rel err {err:.2e} >= {tol}"


# ---- in process, no interpreter: the gate and the layers' CPU path ------------------------

def test_skinny_supported_gates() -> None:
    """skinny_supported is a capability check only; whether the kernel is wanted at all is the
    layers' KernelConfig's (FOLIO_GEMV / FOLIO_KERNELS, resolved once: test_kernel_config.py)."""
    pytest.importorskip("triton")
    from folio.model.kernel_config import KernelConfig
    from folio.model.kernels import gemv
    x, w = torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    assert not gemv.skinny_supported(x, w)  # CPU tensors
    assert KernelConfig().gemv_on and KernelConfig().gemv == "1"  # on by default
    assert not KernelConfig(gemv="0").gemv_on
    assert KernelConfig(gemv="narrow").gemv_on
    assert not KernelConfig(kernels="torch").gemv_on
    with pytest.raises(ValueError, match="gemv"):
        KernelConfig(gemv="yes")


def test_skinny_preferred() -> None:
    pytest.importorskip("triton")
    from folio.model.kernels import gemv
    assert gemv.skinny_preferred(1, 28672, 4096)      # one row: always
    assert not gemv.skinny_preferred(8, 1024, 3072)   # default: one row only
    assert gemv.skinny_preferred(8, 1024, 3072, mode="narrow")      # narrow output
    assert not gemv.skinny_preferred(4, 6144, 4096, mode="narrow")  # wide, 4 rows: cuBLAS
    assert gemv.skinny_preferred(4, 6144, 4096, mode="all")
    assert not gemv.skinny_preferred(1, 28672, 4096, mode="0")


def test_tune_on_plain_product_once_per_kernel_and_key() -> None:
    """The plain product is launched once per (kernel, key), before the key's first launch
    with the norm epilogue, whose config it then chooses (not the epilogue's launch)."""
    pytest.importorskip("triton")
    from folio.model.kernels import gemv
    plain: list[str] = []
    kernel_a, kernel_b = object(), object()
    try:
        for kernel, key in ((kernel_a, (40, 64)), (kernel_a, (40, 64)), (kernel_a, (48, 64)),
                            (kernel_b, (40, 64))):
            gemv.tune_on_plain_product(kernel, key, lambda k=key: plain.append(k))
    finally:
        gemv._PLAIN_TUNED.difference_update(
            {(id(k),) + key for k in (kernel_a, kernel_b) for key in ((40, 64), (48, 64))})
    assert plain == [(40, 64), (48, 64), (40, 64)]


def test_prune_respects_workspace() -> None:
    triton = pytest.importorskip("triton")
    from folio.model.kernels import gemv
    configs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "DOT": dot},
                             num_warps=w, num_stages=st)
               for bn, bk, sk, dot, w, st in gemv._FULL_CONFIGS]
    for N, K, m_pad in ((1024, 3072, 1), (1024, 3072, 8), (28672, 4096, 4), (151936, 64, 1),
                        (96, 16, 1), (8192, 32, 8), (4096, 14336, 1)):
        kept = gemv._prune(configs, {}, N=N, K=K, M_PAD=m_pad)
        assert kept
        for c in kept:
            k = c.kwargs
            if N > gemv._SPLIT_MAX_N:
                assert k["SPLIT_K"] == 1
            assert k["SPLIT_K"] <= gemv._MAX_SPLIT and k["BLOCK_N"] >= gemv._MIN_BLOCK_N
        if K >= 1024:  # realistic shapes: the right kernel family for the row count
            assert all(c.kwargs["DOT"] == (m_pad > gemv._FMA_MAX_M_PAD) for c in kept) \
                or m_pad == 2
        # the 2048-wide configs are for 8-bit weights only
        assert all(c.kwargs["BLOCK_K"] < gemv._EIGHT_BIT_ONLY_K for c in kept)
        eight = gemv._prune(configs, {"W": torch.empty(0, dtype=torch.int8)}, N=N, K=K,
                            M_PAD=m_pad)
        if K >= 4096 and m_pad == 1:
            assert any(c.kwargs["BLOCK_K"] == gemv._EIGHT_BIT_ONLY_K for c in eight)


def test_skinny_shape_checks() -> None:
    pytest.importorskip("triton")
    from folio.model.kernels import gemv
    w = torch.randn(8, 16)
    with pytest.raises(ValueError):
        gemv.skinny_matmul(torch.randn(gemv.MAX_M + 1, 16), w)
    with pytest.raises(ValueError):
        gemv.skinny_matmul(torch.randn(2, 15), w)
    with pytest.raises(ValueError):
        gemv.skinny_gate_up_silu(torch.randn(2, 16), torch.randn(7, 16))


@pytest.mark.parametrize("bias", [False, True])
def test_layers_cpu_path_unchanged(bias: bool) -> None:
    from torch import nn

    from folio.model.layers import GatedMLP, Linear, MergedLinear
    torch.manual_seed(0)
    lin = Linear(16, 12, bias=bias)
    assert isinstance(lin, nn.Linear)
    assert list(dict(lin.named_parameters())) == (["weight", "bias"] if bias else ["weight"])
    for shape in ((1, 16), (3, 16), (2, 5, 16), (40, 16)):
        x = torch.randn(*shape)
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))

    merged = MergedLinear(16, {"gate": 6, "up": 6}, bias=bias)
    assert isinstance(merged, Linear)
    merged.load_shard("up", "weight", torch.ones(6, 16))
    assert torch.equal(merged.weight[6:], torch.ones(6, 16))
    x = torch.randn(4, 16)
    assert torch.equal(merged(x), F.linear(x, merged.weight, merged.bias))

    mlp = GatedMLP(16, 6, bias=bias, act="silu")
    assert isinstance(mlp.down_proj, Linear) and isinstance(mlp.gate_up_proj, MergedLinear)
    assert sorted(dict(mlp.named_parameters())) == sorted(
        f"{m}.{p}" for m in ("gate_up_proj", "down_proj") for p in (("weight", "bias")
                                                                    if bias else ("weight",)))
    for rows in (1, 8):
        x = torch.randn(rows, 16)
        gate, up = F.linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).chunk(2, -1)
        ref = F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        assert torch.equal(mlp(x), ref)


if __name__ == "__main__":
    child_main(CASES, _run)
