"""The quantized linears' Triton kernels under the interpreter, against torch references:
the W4A16 matmul (kernels/int4_matmul.py) at decode and prefill row counts, groups wider and
narrower than a tile, with and without zero points and bias, split-K forced; the W4A16
dequantizer; the skinny GEMV reading 8-bit weights with per-row scales (int8 and FP8 e4m3);
int8 activation quantization. The interpreter's float32 -> FP8 conversion rounds wrongly (a
value of 124 became 64), so FP8 activation quantization is checked on the GPU only
(tests/gpu/test_gpu_quant.py).

As in test_triton_gemv.py, the cases run in a child process with TRITON_INTERPRET=1 and
report one JSON line each. Reference: float64 products of the dequantized weight.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from interpreter_harness import calls_with_norm, child_main, interpreter_results, rel_err

CASES: list[dict[str, Any]] = []
for _m, _n, _k, _g, _zero, _bias in [(1, 48, 64, 32, False, False), (3, 40, 128, 64, True, True),
                                     (20, 24, 256, 128, True, False), (5, 16, 64, 64, False, True),
                                     (2, 36, 64, 16, True, True), (40, 24, 96, 8, False, False)]:
    CASES.append(dict(name=f"int4_m{_m}_n{_n}_k{_k}_g{_g}_z{int(_zero)}_b{int(_bias)}",
                      kind="int4", M=_m, N=_n, K=_k, G=_g, zero=_zero, bias=_bias))
CASES += [
    dict(name="int4_split2", kind="int4", M=3, N=40, K=128, G=32, zero=True, bias=True,
         config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=2)),
    dict(name="int4_split4_m1", kind="int4", M=1, N=24, K=128, G=64, zero=False, bias=False,
         config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=4)),
    # the one-row elementwise path and the per-element word loads, forced
    dict(name="int4_fma_m1_gather", kind="int4", M=1, N=40, K=128, G=32, zero=True, bias=True,
         config=dict(BLOCK_M=16, BLOCK_N=8, BLOCK_K=64, SPLIT_K=1, DOT=0, UNPACK=1)),
    dict(name="int4_fma_m1_reshape_split", kind="int4", M=1, N=24, K=128, G=64, zero=False,
         bias=False, config=dict(BLOCK_M=16, BLOCK_N=8, BLOCK_K=32, SPLIT_K=2, DOT=0,
                                 UNPACK=0)),
    dict(name="int4_dot_gather_g16", kind="int4", M=5, N=40, K=128, G=16, zero=True,
         bias=False, config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=1, DOT=1,
                                 UNPACK=1)),
    dict(name="int4_mins_fma_m1", kind="int4", M=1, N=24, K=64, G=32, zero="mins", bias=True,
         config=dict(BLOCK_M=16, BLOCK_N=8, BLOCK_K=64, SPLIT_K=1, DOT=0, UNPACK=1)),
    dict(name="int4_mins_g32", kind="int4", M=4, N=40, K=128, G=32, zero="mins", bias=True),
    dict(name="int4_mins_g32_m1", kind="int4", M=1, N=24, K=64, G=32, zero="mins", bias=False),
    # the one-row 4-bit GEMV (kernels/int4_gemv.py), forced: every offset form, tiles over
    # several groups and inside one, split-K
    dict(name="gemv4_sym_g32", kind="int4", M=1, N=20, K=128, G=32, zero=False, bias=True,
         config=dict(BLOCK_N=8, BLOCK_W=8, SPLIT_K=1)),
    dict(name="gemv4_zero_g16", kind="int4", M=1, N=20, K=128, G=16, zero=True, bias=False,
         config=dict(BLOCK_N=8, BLOCK_W=8, SPLIT_K=1)),
    dict(name="gemv4_mins_g32", kind="int4", M=1, N=24, K=128, G=32, zero="mins",
         bias=True, config=dict(BLOCK_N=4, BLOCK_W=16, SPLIT_K=1)),
    dict(name="gemv4_zero_inside_group", kind="int4", M=1, N=24, K=256, G=128, zero=True,
         bias=False, config=dict(BLOCK_N=4, BLOCK_W=4, SPLIT_K=1)),
    dict(name="gemv4_mins_split2", kind="int4", M=1, N=24, K=256, G=32, zero="mins",
         bias=True, config=dict(BLOCK_N=8, BLOCK_W=8, SPLIT_K=2)),
    dict(name="gemv4_sym_split4", kind="int4", M=1, N=40, K=256, G=64, zero=False,
         bias=False, config=dict(BLOCK_N=16, BLOCK_W=8, SPLIT_K=4)),
    # the same GEMV on a merged gate|up weight with SiLU-and-mul fused: every offset form,
    # an output count no tile divides (the last tile's outputs masked), split-K
    dict(name="gemv4_gate_up_sym", kind="int4_gate_up", N=20, K=256, G=64, zero=False,
         config=dict(BLOCK_N=8, BLOCK_W=8, SPLIT_K=1)),
    dict(name="gemv4_gate_up_zero_split2", kind="int4_gate_up", N=12, K=256, G=32, zero=True,
         config=dict(BLOCK_N=8, BLOCK_W=8, SPLIT_K=2)),
    dict(name="gemv4_gate_up_mins_ragged_split4", kind="int4_gate_up", N=13, K=256, G=32,
         zero="mins", config=dict(BLOCK_N=8, BLOCK_W=8, SPLIT_K=4)),
    dict(name="gemv4_gate_up_autotuned", kind="int4_gate_up", N=24, K=128, G=32, zero=True),
    # the one-row 4-bit GEMV ending with the residual add + RMSNorm (gemv's epilogue): bit
    # for bit the GEMV then rms_norm, split-K and not
    dict(name="gemv4_norm_zero_g32", kind="int4_norm", N=40, K=128, G=32, zero=True,
         bias=True, config=dict(BLOCK_N=8, BLOCK_W=8, SPLIT_K=1)),
    dict(name="gemv4_norm_mins_split2", kind="int4_norm", N=24, K=256, G=32, zero="mins",
         bias=False, config=dict(BLOCK_N=8, BLOCK_W=8, SPLIT_K=2)),
    # autotuned: the key's config chosen on the plain product first
    dict(name="gemv4_norm_autotuned_plain_first", kind="int4_norm", N=40, K=128, G=32,
         zero=True, bias=False, config=None),
    dict(name="gemv4_ragged_split4_sentinel", kind="split_sentinel", M=1, N=40, K=256, G=64,
         zero=False, config=dict(BLOCK_N=16, BLOCK_W=8, SPLIT_K=4)),
    dict(name="gemv4_wide_range_x", kind="int4", M=1, N=24, K=256, G=64, zero=True,
         bias=False, wide_x=True, config=dict(BLOCK_N=8, BLOCK_W=8, SPLIT_K=1)),
    # an odd number of tiles per program (the loop takes them in pairs)
    dict(name="gemv4_zero_three_tiles", kind="int4", M=1, N=20, K=192, G=64, zero=True,
         bias=True, config=dict(BLOCK_N=8, BLOCK_W=8, SPLIT_K=1)),
    dict(name="gemv4_autotuned_k576_g32", kind="int4", M=1, N=24, K=576, G=32, zero="mins",
         bias=False),
    dict(name="int8_group16", kind="int8g", M=3, N=40, K=96, G=16),
    dict(name="int8_group32_m1", kind="int8g", M=1, N=24, K=128, G=32),
    dict(name="int8_group32_m20", kind="int8g", M=20, N=24, K=64, G=32),
    dict(name="dequant_int8_group16", kind="dequant8", N=24, K=64, G=16),
    dict(name="dequant_int4_mins", kind="dequant", N=24, K=64, G=32, zero="mins"),
    dict(name="dequant_int4_zero", kind="dequant", N=40, K=128, G=32, zero=True),
    dict(name="dequant_int4_sym", kind="dequant", N=24, K=64, G=64, zero=False),
]
for _dt in ("int8", "float8_e4m3fn"):
    for _m in (1, 3, 8):
        CASES.append(dict(name=f"gemv8_{_dt}_m{_m}", kind="gemv8", wdtype=_dt, M=_m, N=37,
                          K=96, bias=_m == 3))
    CASES.append(dict(name=f"gateup8_{_dt}", kind="gateup8", wdtype=_dt, M=2, N=24, K=64))
# the FP8-weight product of decode batches (kernels/fp8_matmul.py): W8A16 and W8A8, ragged
# rows and columns, bias, split-K forced
for _m, _n, _k, _a8, _bias, _split in [(2, 40, 128, False, True, 1), (17, 33, 256, True, False, 1),
                                        (5, 48, 192, True, True, 1), (3, 40, 256, False, False, 2),
                                        (20, 24, 256, True, True, 4)]:
    CASES.append(dict(name=f"fp8mm_m{_m}_n{_n}_k{_k}_a{8 if _a8 else 16}_b{int(_bias)}_s{_split}",
                      kind="fp8mm", M=_m, N=_n, K=_k, a8=_a8, bias=_bias, split=_split))
CASES.append(dict(name="act_int8", kind="act", M=7, K=100))
CASES.append(dict(name="act_int8_static", kind="act", M=3, K=64, static=True))
# SiLU-and-mul writing the down projection's int8 codes (kernels/activation.py): the bytes of
# silu_and_mul then quantize_activations, over several blocks of a row and a ragged last one
CASES.append(dict(name="silu_quant_int8", kind="silu_q", M=5, I=2100))
# RMSNorm writing a W8A8 projection's int8 codes (kernels/rmsnorm.py): the bytes of rms_norm then
# quantize_activations, with and without the residual add, a ragged row, an all-zero row
CASES += [dict(name="norm_quant_int8", kind="norm_q", M=5, D=96, res=False),
          dict(name="norm_quant_int8_residual", kind="norm_q", M=4, D=200, res=True)]


def _int4_weight(n: int, k: int, g: int, zero: bool | str) -> Any:
    """`zero`: False (symmetric), True (integer zero points) or "mins" (GGUF's float
    minimums, float32 scales as the GGUF planes keep them)."""
    from folio.model.quant.formats import Int4Weight, pack_rows
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    if zero == "mins":
        s = torch.rand(n, k // g) * 0.05 + 0.01
        return Int4Weight(pack_rows(q), s, None, g, mins=-torch.rand(n, k // g) * 0.4)
    s = (torch.rand(n, k // g) * 0.05 + 0.01).to(torch.float16)
    z = torch.randint(0, 16, (n, k // g)).to(torch.float16) if zero else None
    return Int4Weight(pack_rows(q), s, z, g)


def _int8_weight(n: int, k: int, g: int) -> Any:
    from folio.model.quant.formats import GroupInt8Weight
    return GroupInt8Weight(torch.randint(-128, 128, (n, k), dtype=torch.int8),
                           torch.rand(n, k // g) * 0.01 + 0.001, g)


def _run(case: dict) -> dict:
    from folio.model.kernels import act_quant, gemv, int4_matmul
    torch.manual_seed(0)
    kind = case["kind"]
    if kind == "int4":
        w = _int4_weight(case["N"], case["K"], case["G"], case["zero"])
        # a strided row view of x: the kernel takes rows with any stride
        x = torch.randn(case["M"], case["K"] + 8, dtype=torch.float16)[:, 4:case["K"] + 4]
        if case.get("wide_x"):
            # elements from 1e-6 to 1e6 (past fp16's range): the one-row GEMV's fp16 pairs
            # must scale each word's elements into range
            x = x.float() * 10 ** (torch.rand(x.shape) * 12 - 6)
        bias = torch.randn(case["N"], dtype=x.dtype) if case["bias"] else None
        out = int4_matmul.int4_matmul(x, w.packed, w.scales, w.zeros, w.group_size, bias,
                                      mins=w.mins, _config=case.get("config"))
        ref = x.double() @ w.dequantize().double().t()
        if bias is not None:
            ref = ref + bias.double()
        return {"name": case["name"], "err": rel_err(out, ref),
                "nan": bool(torch.isnan(out).any())}
    if kind == "int4_gate_up":
        # the one-row GEMV on a merged gate|up weight, SiLU-and-mul fused (gate rows first)
        from folio.model.kernels import int4_gemv
        w = _int4_weight(2 * case["N"], case["K"], case["G"], case["zero"])
        x = torch.randn(1, case["K"], dtype=torch.float16)
        out = torch.empty(1, case["N"], dtype=torch.float16)
        offsets = w.zeros if w.zeros is not None else w.mins
        int4_gemv.int4_gemv(x, w.packed, w.scales, offsets,
                            int4_matmul.zero_mode(w.zeros, w.mins), w.group_size, None, out,
                            gate_up=True, _config=case.get("config"))
        gate, up = (x.double() @ w.dequantize().double().t()).chunk(2, dim=-1)
        ref = gate * torch.sigmoid(gate) * up
        return {"name": case["name"], "err": rel_err(out, ref),
                "nan": bool(torch.isnan(out).any())}
    if kind == "int4_norm":
        from folio.model.kernels import int4_gemv
        from folio.model.kernels.rmsnorm import rms_norm
        w = _int4_weight(case["N"], case["K"], case["G"], case["zero"])
        x = torch.randn(1, case["K"], dtype=torch.float16)
        bias = torch.randn(case["N"], dtype=torch.float16) if case["bias"] else None
        residual = torch.randn(1, case["N"], dtype=torch.float16)
        norm_w = (1 + 0.1 * torch.randn(case["N"])).to(torch.float16)
        offsets = w.zeros if w.zeros is not None else w.mins
        mode = int4_matmul.zero_mode(w.zeros, w.mins)
        out, plain = torch.empty(1, case["N"], dtype=torch.float16), \
            torch.empty(1, case["N"], dtype=torch.float16)
        normed, stream = torch.empty_like(out), torch.empty_like(out)
        with calls_with_norm(int4_gemv, "int4_gemv") as launches:
            for _ in range(2):
                int4_gemv.int4_gemv(x, w.packed, w.scales, offsets, mode, w.group_size, bias,
                                    out, norm=(residual, norm_w, 1e-5, normed, stream),
                                    _config=case["config"])
        # autotuned: the first call tunes on a plain launch inside it, the second does not
        want_launches = [True, True] if case["config"] else [True, False, True]
        int4_gemv.int4_gemv(x, w.packed, w.scales, offsets, mode, w.group_size, bias, plain,
                            _config=case["config"])
        want_normed, want_stream = rms_norm(plain, norm_w, 1e-5, residual)
        counters = gemv._workspace(x.device)[1]
        return {"name": case["name"], "nan": bool(torch.isnan(normed).any()),
                "equal": bool(torch.equal(normed, want_normed)
                              and torch.equal(stream, want_stream)
                              and torch.equal(out, plain)),
                "launches": launches == want_launches,
                "counters_zero": bool((counters == 0).all())}
    if kind == "split_sentinel":
        # split-K partials of a ragged last column block stay inside the workspace rows of
        # their own split: past SPLIT_K * N nothing is written
        from folio.model.kernels import gemv
        partials, _ = gemv._workspace(torch.device("cpu"))
        partials.fill_(12345.0)
        w = _int4_weight(case["N"], case["K"], case["G"], case["zero"])
        x = torch.randn(1, case["K"], dtype=torch.float16)
        out = int4_matmul.int4_matmul(x, w.packed, w.scales, w.zeros, w.group_size,
                                      _config=case["config"])
        past = partials[case["config"]["SPLIT_K"] * case["N"]:]
        return {"name": case["name"], "err": rel_err(out, x.double() @ w.dequantize().double().t()),
                "nan": bool(torch.isnan(out).any()), "untouched": bool((past == 12345.0).all())}
    if kind == "int8g":
        w = _int8_weight(case["N"], case["K"], case["G"])
        x = torch.randn(case["M"], case["K"], dtype=torch.float16)
        out = int4_matmul.int4_matmul(x, w.codes, w.scales, None, w.group_size, bits=8)
        ref = x.double() @ w.dequantize().double().t()
        return {"name": case["name"], "err": rel_err(out, ref),
                "nan": bool(torch.isnan(out).any())}
    if kind == "dequant8":
        w = _int8_weight(case["N"], case["K"], case["G"])
        out = int4_matmul.dequantize_int4(w.codes, w.scales, None, w.group_size,
                                          torch.float16, bits=8)
        ref = w.dequantize().to(torch.float16)
        return {"name": case["name"], "err": float((out.float() - ref.float()).abs().max()),
                "nan": bool(torch.isnan(out).any())}
    if kind == "dequant":
        w = _int4_weight(case["N"], case["K"], case["G"], case["zero"])
        out = int4_matmul.dequantize_int4(w.packed, w.scales, w.zeros, w.group_size,
                                          torch.float16, mins=w.mins)
        ref = w.dequantize().to(torch.float16)
        return {"name": case["name"], "err": float((out.float() - ref.float()).abs().max()),
                "nan": bool(torch.isnan(out).any())}
    if kind in ("gemv8", "gateup8"):
        dtype = getattr(torch, case["wdtype"])
        rows = case["N"] * (2 if kind == "gateup8" else 1)
        w = torch.randn(rows, case["K"])
        qmax = 127.0 if dtype == torch.int8 else 448.0
        scale = w.abs().amax(dim=1) / qmax
        scaled = w / scale[:, None]
        codes = scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
        deq = codes.double() * scale.double()[:, None]
        x = torch.randn(case["M"], case["K"], dtype=torch.float16)
        if kind == "gemv8":
            bias = torch.randn(rows, dtype=torch.float16) if case["bias"] else None
            out = gemv.skinny_matmul(x, codes, bias, scale=scale.float().contiguous())
            ref = x.double() @ deq.t() + (bias.double() if bias is not None else 0)
        else:
            out = gemv.skinny_gate_up_silu(x, codes, scale=scale.float().contiguous())
            gu = (x.double() @ deq.t()).to(torch.float16).double()
            gate, up = gu[:, :case["N"]], gu[:, case["N"]:]
            ref = torch.nn.functional.silu(gate) * up
        return {"name": case["name"], "err": rel_err(out, ref),
                "nan": bool(torch.isnan(out).any())}
    if kind == "fp8mm":
        from folio.model.kernels import fp8_matmul
        w = torch.randn(case["N"], case["K"]) * 0.05
        w_scale = (w.abs().amax(dim=1) / 448).contiguous()
        codes = (w / w_scale[:, None]).to(torch.float8_e4m3fn)
        deq = codes.double() * w_scale.double()[:, None]
        x = torch.randn(case["M"], case["K"] + 8, dtype=torch.float16)[:, 4:case["K"] + 4]
        bias = torch.randn(case["N"], dtype=torch.float16) if case["bias"] else None
        config = None
        if case["split"] > 1:
            config = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=case["split"])
        if case["a8"]:
            # activations quantized by torch (the interpreter's own FP8 rounding is wrong)
            xq, x_scale = act_quant.quantize_activations_reference(x, torch.float8_e4m3fn)
            out = fp8_matmul.fp8_matmul(xq, codes, w_scale, x_scale, bias,
                                        out_dtype=torch.float16, _config=config)
            ref = (xq.double() * x_scale.double()) @ deq.t()
        else:
            out = fp8_matmul.fp8_matmul(x, codes, w_scale, bias=bias, _config=config)
            ref = x.double() @ deq.t()
        if bias is not None:
            ref = ref + bias.double()
        return {"name": case["name"], "err": rel_err(out, ref),
                "nan": bool(torch.isnan(out).any()), "dtype": str(out.dtype)}
    if kind == "act":
        x = torch.randn(case["M"], case["K"], dtype=torch.float16) * 3
        static = torch.tensor(0.05) if case.get("static") else None
        codes, scale = act_quant.quantize_activations(x, torch.int8, static)
        ref_codes, ref_scale = act_quant.quantize_activations_reference(x, torch.int8, static)
        return {"name": case["name"],
                "code_diff": float((codes.float() - ref_codes.float()).abs().max()),
                "scale_err": float(((scale - ref_scale).abs() / ref_scale).max()),
                "nan": False}
    if kind == "norm_q":
        from folio.model.kernels.rmsnorm import rms_norm, rms_norm_quantized
        m, d = case["M"], case["D"]
        x = torch.randn(m, d, dtype=torch.float16) * 3
        w = (torch.rand(d) + 0.5).to(torch.float16)
        res = torch.randn(m, d, dtype=torch.float16) if case["res"] else None
        if res is not None:
            res[1] = -x[1]     # x + residual = 0 in row 1: the smallest scale, zero codes
        else:
            x[1] = 0.0
        codes, scale, res_out = rms_norm_quantized(x, w, 1e-6, torch.int8, residual=res)
        normed = rms_norm(x, w, 1e-6, residual=res)
        if res is not None:
            normed, ref_res = normed
        ref_codes, ref_scale = act_quant.quantize_activations(normed, torch.int8)
        return {"name": case["name"], "nan": False,
                "codes_equal": bool(torch.equal(codes, ref_codes)),
                "scales_equal": bool(torch.equal(scale, ref_scale)),
                "zero_row": bool((codes[1] == 0).all()),
                "res_equal": res is None or bool(torch.equal(res_out, ref_res))}
    if kind == "silu_q":
        from folio.model.kernels.activation import silu_and_mul, silu_and_mul_quantized
        x = torch.randn(case["M"], 2 * case["I"], dtype=torch.float16) * 3
        x[1] = 0.0   # an all-zero row: the smallest scale, zero codes
        codes, scale = silu_and_mul_quantized(x, torch.int8)
        ref_codes, ref_scale = act_quant.quantize_activations(silu_and_mul(x), torch.int8)
        return {"name": case["name"], "nan": False,
                "codes_equal": bool(torch.equal(codes, ref_codes)),
                "scales_equal": bool(torch.equal(scale, ref_scale)),
                "zero_row": bool((codes[1] == 0).all())}
    raise ValueError(kind)


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_quant_kernel(results: dict[str, dict], case: dict) -> None:
    res = results.get(case["name"])
    assert res is not None, f"no result for {case['name']}:\n{results['_stderr']}"
    assert "error" not in res, res["error"]
    assert not res["nan"], "unwritten (NaN) outputs"
    if case["kind"] == "act":
        # the kernel multiplies by 1/scale where the reference divides: a tie may round apart
        assert res["code_diff"] <= 1.0 and res["scale_err"] < 1e-6, res
    elif case["kind"] == "silu_q":
        assert res["codes_equal"] and res["scales_equal"] and res["zero_row"], res
    elif case["kind"] == "norm_q":
        assert res["codes_equal"] and res["scales_equal"] and res["zero_row"], res
        assert res["res_equal"], res
    elif case["kind"] == "int4_norm":
        assert res["equal"] and res["counters_zero"] and res["launches"], res
    elif case["kind"] in ("dequant", "dequant8"):
        assert res["err"] == 0.0, res
    elif case["kind"] == "split_sentinel":
        assert res["untouched"] and res["err"] < 2e-3, res
    elif case["kind"] == "fp8mm":
        assert res["dtype"] == "torch.float16" and res["err"] < 2e-3, res
    else:
        # fp16 activations and fp16-rounded weights in the tensor-core product
        assert res["err"] < 2e-3, res


def test_fp8_matmul_configs_fit_every_shape() -> None:
    """The chosen tile config serves every row count and the shapes models have (K a multiple
    of 64, e.g. SmolLM2's 576 and 1536), within the split-K workspace."""
    pytest.importorskip("triton")
    from folio.model.kernels import fp8_matmul
    for m in (1, 2, 7, 16, 17, 32, 33, 64):
        for n, k in ((6144, 4096), (4096, 4096), (57344, 4096), (4096, 14336), (576, 576),
                     (3072, 576), (576, 1536), (40, 192)):
            c = fp8_matmul.choose_config(m, n, k)
            assert fp8_matmul.fits(fp8_matmul.row_bucket(m), n, k, c["BLOCK_M"], c["BLOCK_N"],
                                   c["BLOCK_K"], c["SPLIT_K"]), (m, n, k, c)


def test_fp8_matmul_refuses_bad_operands() -> None:
    pytest.importorskip("triton")
    from folio.model.kernels.fp8_matmul import fp8_matmul
    codes = torch.zeros(8, 64, dtype=torch.float8_e4m3fn)
    scale = torch.ones(8)
    with pytest.raises(ValueError, match="x_scale"):
        fp8_matmul(torch.zeros(2, 64, dtype=torch.float8_e4m3fn), codes, scale)
    with pytest.raises(ValueError, match="cannot serve"):
        fp8_matmul(torch.zeros(2, 32, dtype=torch.float16), codes, scale)
    with pytest.raises(ValueError, match="cannot serve"):
        fp8_matmul(torch.zeros(65, 64, dtype=torch.float16), codes, scale)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_matmul(torch.zeros(2, 64, dtype=torch.float16), codes, torch.ones(4))


def test_int4_refuses_bad_shapes() -> None:
    pytest.importorskip("triton")
    from folio.model.kernels.int4_matmul import int4_matmul
    packed = torch.zeros(8, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="x \\[M, 64\\]"):
        int4_matmul(torch.zeros(1, 32, dtype=torch.float16), packed,
                    torch.ones(8, 2, dtype=torch.float16), None, 32)
    with pytest.raises(ValueError, match="scales"):
        int4_matmul(torch.zeros(1, 64, dtype=torch.float16), packed,
                    torch.ones(8, 3, dtype=torch.float16), None, 32)


def test_int4_zero_points_outside_the_kernels_range_are_refused() -> None:
    """The one-row 4-bit GEMV builds its fp16 subtrahends from integer zero points 0..63: a
    negative or fractional one is refused at load, naming the range."""
    from folio.model.quant.formats import Int4Weight, pack_rows
    from folio.model.quant.group_linear import GroupQuantLinear
    q = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    s = torch.full((8, 2), 0.01)
    GroupQuantLinear(Int4Weight(pack_rows(q), s, torch.full((8, 2), 16.0), 32))
    for bad in (-1.0, 2.5, 64.0):
        with pytest.raises(ValueError, match="zero points must be integers in 0..63"):
            GroupQuantLinear(Int4Weight(pack_rows(q), s, torch.full((8, 2), bad), 32))


if __name__ == "__main__":
    child_main(CASES, _run)


def test_int4_prune_fits_every_bucket_and_gguf_widths() -> None:
    """Every row bucket gets configs of its class, split-K only where the workspace takes it,
    the one-row path only at one row; a K that only narrow tiles divide (GGUF groups of 32,
    SmolLM2's 576) falls back to them instead of failing."""
    triton = pytest.importorskip("triton")
    from folio.model.kernels import gemv, int4_matmul as im
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk,
                              "DOT": dot, "UNPACK": un, "CLASS": cls}, num_warps=w, num_stages=st)
               for cls, bm, bn, bk, sk, dot, un, w, st in im._CONFIGS]
    interpret, im.INTERPRET = im.INTERPRET, False
    try:
        for n, k, g in ((6144, 4096, 128), (4096, 14336, 128), (1536, 576, 32), (576, 1536, 32)):
            for m in (1, 5, 16, 40, 300):
                bucket = im._m_bucket(m)
                kept = im._prune(configs, {}, N=n, K=k, G=g, M_BUCKET=bucket)
                assert kept, (n, k, g, m)
                for c in kept:
                    kw = c.kwargs
                    assert k % kw["BLOCK_K"] == 0
                    assert kw["DOT"] or bucket == 1
                    if kw["SPLIT_K"] > 1:
                        assert bucket <= 16 and n <= gemv._SPLIT_MAX_N
                    if k % 128 == 0:
                        assert kw["CLASS"] in im._bucket_classes(bucket)
    finally:
        im.INTERPRET = interpret
