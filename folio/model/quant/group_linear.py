"""A projection whose weight is integer codes with a scale (and an offset) per group of input
channels: W4A16 (AWQ, GPTQ, compressed-tensors pack-quantized; formats.Int4Weight) and, from a
GGUF file kept quantized on the GPU, Q4_0 / Q4_1 / Q4_K as 4-bit codes with float minimums and
Q8_0 / Q6_K as int8 codes with group scales (formats.GroupInt8Weight).

On CUDA the Triton kernel (kernels/int4_matmul.py) multiplies straight from the codes up to
`DEQUANT_MIN_ROWS` rows; from there the product is compute-bound and the weight is widened once
per call for cuBLAS instead (one pass over the codes writing 16-bit weights is small next to a
GEMM of that many rows). Act-order (GPTQ desc_act) weights gather the input's columns by `perm`
first. Elsewhere `reference` dequantizes and multiplies in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from folio.model.kernel_config import DEFAULT_KERNEL_CONFIG, KernelConfig
from folio.model.quant.formats import GroupInt8Weight, Int4Weight

# From this many rows on, dequantize + cuBLAS (measured on an H200: docs/benchmarks.md).
DEQUANT_MIN_ROWS = 1024


class GroupQuantLinear(nn.Module):
    def __init__(self, weight: Int4Weight | GroupInt8Weight,
                 kernels: KernelConfig = DEFAULT_KERNEL_CONFIG) -> None:
        super().__init__()
        self.kernels = kernels
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        if isinstance(weight, GroupInt8Weight):
            self.bits = 8
            codes, zeros, mins, perm = weight.codes, None, None, None
        else:
            self.bits = 4
            codes, zeros, mins, perm = weight.packed, weight.zeros, weight.mins, weight.perm
            if zeros is not None:
                _check_zero_points(zeros)
        self.register_buffer("codes", codes.contiguous(), persistent=False)
        self.register_buffer("scales", weight.scales.contiguous(), persistent=False)
        self.register_buffer("zeros", None if zeros is None else zeros.contiguous(),
                             persistent=False)
        self.register_buffer("mins", None if mins is None else mins.contiguous(),
                             persistent=False)
        self.register_buffer("perm", perm, persistent=False)

    def weight(self) -> Int4Weight | GroupInt8Weight:
        if self.bits == 8:
            return GroupInt8Weight(self.codes, self.scales, self.group_size)
        return Int4Weight(self.codes, self.scales, self.zeros, self.group_size, self.perm,
                          self.mins)

    def dequantize(self) -> torch.Tensor:
        return self.weight().dequantize()

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if not x2.is_cuda:
            out = self.reference(x2, bias).to(x.dtype)
            return out.view(*shape[:-1], self.out_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        from folio.model.kernels import int4_matmul
        kw = dict(mins=self.mins, bits=self.bits)
        if x2.shape[0] >= DEQUANT_MIN_ROWS:
            w = int4_matmul.dequantize_int4(self.codes, self.scales, self.zeros,
                                            self.group_size, x.dtype, **kw)
            out = F.linear(x2, w, bias)
        else:
            out = int4_matmul.int4_matmul(x2, self.codes, self.scales, self.zeros,
                                          self.group_size, bias, pdl=self.kernels.pdl_on,
                                          **kw)
        return out.view(*shape[:-1], self.out_features)

    def _one_row_gemv_ok(self, x: torch.Tensor) -> bool:
        """Whether the one-row 4-bit GEMV can serve x: one row of 4-bit codes on CUDA
        (batch-1 decode), 16-bit activations, a shape the kernel's tiles fit."""
        from folio.model.kernels import int4_gemv
        return (self.bits == 4 and self.kernels.gemv_on and x.is_cuda and x.dim() > 0
                and x.shape[-1] == self.in_features and x.numel() == self.in_features
                and x.dtype in (torch.float16, torch.bfloat16)
                and int4_gemv.supported(self.in_features, self.group_size))

    def _one_row_gemv(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                      **kind) -> None:
        """x's row (act-order permuted) through the one-row GEMV into out; `kind`:
        int4_gemv's gate_up or norm."""
        from folio.model.kernels import int4_gemv, int4_matmul
        x2 = x.reshape(1, self.in_features)
        x2 = x2.index_select(1, self.perm) if self.perm is not None else x2.contiguous()
        offsets = self.zeros if self.zeros is not None else self.mins
        int4_gemv.int4_gemv(x2, self.codes, self.scales, offsets,
                            int4_matmul.zero_mode(self.zeros, self.mins), self.group_size, bias,
                            out, pdl=self.kernels.pdl_on, **kind)

    def gate_up_silu_wanted(self, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether gate_up_silu serves x: the one-row GEMV, no bias."""
        return bias is None and self.out_features % 2 == 0 and self._one_row_gemv_ok(x)

    def gate_up_silu(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """For a merged gate|up projection (gate rows first): silu(gate) * up in one pass
        over the codes where gate_up_silu_wanted (the SiLU-and-mul launch saved, as the bf16
        and 8-bit MLPs fuse it); None elsewhere (the caller runs the two apart)."""
        if not self.gate_up_silu_wanted(x, bias):
            return None
        out = torch.empty((1, self.out_features // 2), dtype=x.dtype, device=x.device)
        self._one_row_gemv(x, None, out, gate_up=True)
        return out.view(*x.shape[:-1], self.out_features // 2)

    def forward_add_norm(self, x: torch.Tensor, bias: torch.Tensor | None,
                         residual: torch.Tensor, norm_weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The product, the residual add and the RMSNorm after it in one launch where the
        one-row GEMV serves x (batch-1 decode; Linear.forward_add_norm); None elsewhere."""
        from folio.model.kernels import gemv
        if not self._one_row_gemv_ok(x) or (bias is not None and bias.dtype != x.dtype):
            return None
        residual = residual.reshape(1, self.out_features)
        gemv.check_norm_operands(residual, norm_weight, 1, self.out_features, x.dtype)
        out = torch.empty((1, self.out_features), dtype=x.dtype, device=x.device)
        normed, stream = torch.empty_like(out), torch.empty_like(out)
        self._one_row_gemv(x, bias, out, norm=(residual, norm_weight, eps, normed, stream))
        return normed, stream

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = x.to(torch.float32) @ self.dequantize().t()
        return out if bias is None else out + bias.to(torch.float32)

    def extra_repr(self) -> str:
        offsets = "zeros" if self.zeros is not None else "mins" if self.mins is not None \
            else "symmetric"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.bits}-bit, groups of {self.group_size}, {offsets}, "
                f"act_order={self.perm is not None}")


def _check_zero_points(zeros: torch.Tensor) -> None:
    """ValueError unless every zero point is an integer in 0..int4_gemv.MAX_ZERO_POINT, the
    range the one-row GEMV's fp16 subtrahends hold exactly (read once, at load)."""
    from folio.model.kernels.int4_gemv import MAX_ZERO_POINT
    z = zeros.float()
    if not bool(((z == z.round()) & (z >= 0) & (z <= MAX_ZERO_POINT)).all()):
        raise ValueError(f"4-bit zero points must be integers in 0..{MAX_ZERO_POINT}; got "
                         f"values from {float(z.min())} to {float(z.max())}")
