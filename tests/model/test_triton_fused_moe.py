"""The fused-MoE Triton kernel (folio/model/kernels/fused_moe.py) against the per-token,
per-slot loop, under the interpreter (a child process with TRITON_INTERPRET=1, as
test_triton_attention.py does). Routes: random, skewed (most pairs on two experts, so one
expert spans several row blocks) and sparse (most experts empty); sizes that cross every tile
bucket of the kernel, K and N not multiples of the tiles; fp32 and fp16; FP8 experts (e4m3
codes with a scale per expert row) against the loop on the dequantized weights."""
from __future__ import annotations

import pytest
from interpreter_harness import child_main, interpreter_results, rel_err

CASES = [
    dict(name="decode_t1_k2_e8_fp32", T=1, k=2, E=8, H=48, I=40, dtype="float32", routes="random"),
    dict(name="t13_k2_e8_skewed_fp32", T=13, k=2, E=8, H=64, I=24, dtype="float32",
         routes="skewed"),
    dict(name="t40_k4_e16_sparse_fp16", T=40, k=4, E=16, H=32, I=72, dtype="float16",
         routes="sparse"),
    # > 64 pairs: the 32-row tiles; a gelu gate (the unfused activation path)
    dict(name="t50_k2_e4_random_fp32_gelu", T=50, k=2, E=4, H=40, I=16, dtype="float32",
         routes="random", act="gelu"),
    dict(name="t300_k4_e6_skewed_fp16", T=300, k=4, E=6, H=32, I=32, dtype="float16",
         routes="skewed"),
    # the few-token form (kernels/moe_gemv.py), forced and chosen, with and without biases
    # (the interpreter runs fp32 and fp16 only)
    dict(name="few_t1_k4_e8_fp32", T=1, k=4, E=8, H=48, I=40, dtype="float32", routes="random",
         few=True),
    dict(name="few_t3_k2_e5_skewed_fp16_bias", T=3, k=2, E=5, H=40, I=24, dtype="float16",
         routes="skewed", bias=True, few=True),
    dict(name="few_t4_k8_e16_auto_fp16", T=4, k=8, E=16, H=64, I=48, dtype="float16",
         routes="random"),
    # the few-token form with tiles given (`_config`, as tools/gpu_bench_moe.py --sweep
    # passes them): K not a multiple of either BLOCK_K
    dict(name="few_t2_k4_e8_tiles_fp32", T=2, k=4, E=8, H=48, I=40, dtype="float32",
         routes="random", few=True,
         tiles={"gate_up": (2, 32, 2), "down": (1, 32, 2), "stages": 1}),
    # GPT-OSS's experts: biases on both projections, the clamped SwiGLU
    dict(name="t21_k2_e5_bias_swiglu_fp32", T=21, k=2, E=5, H=40, I=24, dtype="float32",
         routes="random", act="swiglu_oai", bias=True),
    # FP8 experts (--quantization fp8): both forms, both activation paths, with biases
    dict(name="fp8_t13_k2_e8_skewed_fp32", T=13, k=2, E=8, H=64, I=24, dtype="float32",
         routes="skewed", fp8=True),
    dict(name="fp8_t300_k4_e6_skewed_fp16", T=300, k=4, E=6, H=32, I=32, dtype="float16",
         routes="skewed", fp8=True),
    dict(name="fp8_t21_k2_e5_bias_swiglu_fp32", T=21, k=2, E=5, H=40, I=24, dtype="float32",
         routes="random", act="swiglu_oai", bias=True, fp8=True),
    dict(name="fp8_few_t1_k4_e8_fp32", T=1, k=4, E=8, H=48, I=40, dtype="float32",
         routes="random", few=True, fp8=True),
    dict(name="fp8_few_t3_k2_e5_skewed_fp16_bias", T=3, k=2, E=5, H=40, I=24, dtype="float16",
         routes="skewed", bias=True, few=True, fp8=True),
]


def _run(case: dict) -> dict:
    import torch
    import torch.nn.functional as F

    from folio.model.kernels.fused_moe import fused_experts
    from moe_reference import experts_loop, make_routes, swiglu_oai

    dtype = getattr(torch, case["dtype"])
    gen = torch.Generator().manual_seed(len(case["name"]))
    T, k, E, H, I = case["T"], case["k"], case["E"], case["H"], case["I"]
    x = torch.randn(T, H, generator=gen)
    gate_up = torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5
    down = torch.randn(E, H, I, generator=gen) * I ** -0.5
    ids = make_routes(case["routes"], T, k, E, gen)
    w = torch.rand(T, k, generator=gen)
    b13 = torch.randn(E, 2 * I, generator=gen) * 0.5 if case.get("bias") else None
    b2 = torch.randn(E, H, generator=gen) * 0.5 if case.get("bias") else None
    gelu = lambda h: F.gelu(h, approximate="tanh")  # noqa: E731
    if case.get("act") == "gelu":
        gated, ref_kw = (lambda gu: gelu(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1]), {"act": gelu}
    elif case.get("act") == "swiglu_oai":
        gated = lambda gu: swiglu_oai(*gu.chunk(2, -1), 1.702, 0.9)  # noqa: E731
        ref_kw = {"gated": lambda g, u: swiglu_oai(g, u, 1.702, 0.9)}
    else:
        gated, ref_kw = None, {}
    cast = (lambda t: None if t is None else t.to(dtype))  # noqa: E731
    if case.get("fp8"):
        from folio.model.quant.formats import quantize_fp8_per_channel
        scales = {}
        for name, weight in (("gate_up", gate_up), ("down", down)):
            parts = [quantize_fp8_per_channel(e.to(dtype)) for e in weight]
            codes = torch.stack([p.codes for p in parts])
            scales[name] = torch.stack([p.scale for p in parts]).float()
            # the reference multiplies the weights the codes stand for
            dequantized = codes.float() * scales[name][:, :, None]
            if name == "gate_up":
                gate_up, gate_up_codes = dequantized, codes
            else:
                down, down_codes = dequantized, codes
        out = fused_experts(x.to(dtype), gate_up_codes, down_codes, w, ids, gated, cast(b13),
                            cast(b2), few_tokens=case.get("few"),
                            gate_up_scale=scales["gate_up"], down_scale=scales["down"])
        ref = experts_loop(x.to(dtype).float(), gate_up, down, w, ids, b13=b13, b2=b2, **ref_kw)
        return {"name": case["name"], "err": rel_err(out, ref),
                "finite": bool(torch.isfinite(out).all()), "dtype": str(out.dtype),
                "shape": list(out.shape), "codes": str(gate_up_codes.dtype)}
    if "tiles" in case:
        from folio.model.kernels.moe_gemv import few_token_experts
        out = few_token_experts(x.to(dtype), gate_up.to(dtype), down.to(dtype), w, ids,
                                _config=case["tiles"])
    else:
        out = fused_experts(x.to(dtype), gate_up.to(dtype), down.to(dtype), w, ids, gated,
                            cast(b13), cast(b2), few_tokens=case.get("few"))
    ref = experts_loop(x.to(dtype).float(), gate_up.to(dtype).float(), down.to(dtype).float(),
                       w, ids, b13=b13, b2=b2, **ref_kw)
    return {"name": case["name"], "err": rel_err(out, ref),
            "finite": bool(torch.isfinite(out).all()), "dtype": str(out.dtype),
            "shape": list(out.shape)}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_fused_moe_kernel_matches_loop(results: dict, case: dict) -> None:
    res = results.get(case["name"])
    assert res is not None, f"no result; child stderr:\n{results['_stderr']}"
    assert "error" not in res, res.get("error")
    assert res["finite"]
    assert res["shape"] == [case["T"], case["H"]]
    assert res["dtype"] == f"torch.{case['dtype']}"
    if case.get("fp8"):
        assert res["codes"] == "torch.float8_e4m3fn"
    tol = 1e-5 if case["dtype"] == "float32" else 3e-3
    assert res["err"] < tol, f"rel err {res['err']:.2e} >= {tol}"


if __name__ == "__main__":
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    child_main(CASES, _run)
