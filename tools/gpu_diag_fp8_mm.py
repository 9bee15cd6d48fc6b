"""Is the FP8 product (kernels/fp8_matmul.py) as exact as torch._scaled_mm on the same
quantized operands? Relative error of each against the float64 product, at the GPU test
model's projection shapes and Llama-3-8B's, 8 and 48 rows, PDL on and off.

    python tools/gpu_diag_fp8_mm.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from folio.model.kernels.act_quant import quantize_activations  # noqa: E402
from folio.model.kernels.fp8_matmul import choose_config, fp8_matmul  # noqa: E402
from folio.model.quant.formats import quantize_fp8_per_channel  # noqa: E402

CUDA = torch.device("cuda")


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    torch.manual_seed(0)
    for n, k in [(768, 512), (512, 512), (2048, 512), (512, 1024), (6144, 4096), (4096, 14336)]:
        for std in (0.02, 0.2):
            q = quantize_fp8_per_channel(torch.randn(n, k, device=CUDA) * std)
            deq = q.codes.double() * q.scale.double()[:, None]
            for m in (2, 8, 48, 64):
                x = (torch.randn(m, k, device=CUDA) * 3).to(torch.bfloat16)
                xq, xs = quantize_activations(x, torch.float8_e4m3fn)
                ref = (xq.double() * xs.double()) @ deq.t()
                mm = torch._scaled_mm(xq, q.codes.t(), scale_a=xs, scale_b=q.scale.view(1, -1),
                                      out_dtype=torch.bfloat16)
                tri = fp8_matmul(xq, q.codes, q.scale, xs, out_dtype=torch.bfloat16)
                tri_pdl = fp8_matmul(xq, q.codes, q.scale, xs, out_dtype=torch.bfloat16,
                                     pdl=True)
                w16 = fp8_matmul(x, q.codes, q.scale)
                ref16 = x.double() @ deq.t()
                print(f"N={n:5d} K={k:5d} std={std} M={m:3d} cfg={choose_config(m, n, k)} "
                      f"scaled_mm {rel(mm, ref):.2e} tri8 {rel(tri, ref):.2e} "
                      f"tri8-pdl {rel(tri_pdl, ref):.2e} tri16 {rel(w16, ref16):.2e} "
                      f"tri8-vs-mm maxdiff {(tri.float() - mm.float()).abs().max().item():.3g}"
                      f" (|ref| max {ref.abs().max().item():.3g})", flush=True)


if __name__ == "__main__":
    main()
