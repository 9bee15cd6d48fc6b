"""Where rms_norm_quantized's codes differ from quantize_activations(rms_norm(...)): counts the
differing rows and codes at a prefill-sized M, then launches both norm kernels again with
floating-point contraction off (Triton's enable_fp_fusion=False) to test whether an FMA
contracted in one kernel and not the other is the cause. GPU only; prints one line each."""
from __future__ import annotations

import torch

from folio.model.kernels import rmsnorm as rn
from folio.model.kernels.act_quant import FP8_MAX, INT8_MAX, quantize_activations


def _launch(x, w, r, dtype, fusion: bool):
    m, d = x.shape
    has_res = r is not None
    r = x if r is None else r
    is_int = dtype == torch.int8
    codes = torch.empty((m, d), dtype=dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    res_q = torch.empty_like(x)
    rn._rmsnorm_quant_kernel[(m,)](
        x, r, w, codes, scale, res_q, x.stride(0), r.stride(0), codes.stride(0), res_q.stride(0),
        1e-5, D=d, BLOCK_D=rn.next_pow2(d), HAS_RES=has_res, QMAX=INT8_MAX if is_int else FP8_MAX,
        IS_INT=is_int, USE_PDL=False, num_warps=rn._num_warps(rn.next_pow2(d)),
        enable_fp_fusion=fusion)
    out = torch.empty_like(x)
    res_o = torch.empty_like(x)
    rn._rmsnorm_kernel[(m,)](
        x, r, w, out, res_o, x.stride(0), r.stride(0), out.stride(0), res_o.stride(0), 1e-5,
        D=d, BLOCK_D=rn.next_pow2(d), HAS_RES=has_res, USE_PDL=False,
        num_warps=rn._num_warps(rn.next_pow2(d)), enable_fp_fusion=fusion)
    ref_codes, ref_scale = quantize_activations(out, dtype)
    return codes, scale, ref_codes, ref_scale, out


def main() -> None:
    for dtype in (torch.float8_e4m3fn, torch.int8):
        for m in (300, 8000):
            torch.manual_seed(m)
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16) * 4
            w = (torch.rand(4096, device="cuda") + 0.5).to(torch.bfloat16)
            r = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            summed = (x.float() + r.float()).to(torch.bfloat16)
            for fusion, xx, rr in ((True, x, r), (False, x, r), (True, summed, None)):
                codes, scale, rc, rs, out = _launch(xx, w, rr, dtype, fusion)
                diff = codes.view(torch.uint8) != rc.view(torch.uint8)
                rows = diff.any(dim=1).nonzero().flatten().tolist()
                step = ((codes.float() - rc.float()).abs().max().item() if diff.any() else 0.0)
                print(f"{str(dtype):20s} m={m:5d} fp_fusion={fusion!s:5s} res={rr is not None!s:5s}: "
                      f"{int(diff.sum())} codes in {len(rows)} rows differ (max |diff| {step}); "
                      f"scales equal {torch.equal(scale, rs)}; rows {rows[:6]}")
                for i, j in diff.nonzero().tolist()[:3]:
                    o = out[i, j].float().item()
                    v = out[i, j].float() * (1.0 / rs[i, 0])
                    print(f"    [{i},{j}] rms_norm out {o!r} scale {rs[i, 0].item()!r} "
                          f"v {v.item()!r} fused {codes[i, j].float().item()} "
                          f"ref {rc[i, j].float().item()}")


if __name__ == "__main__":
    main()
