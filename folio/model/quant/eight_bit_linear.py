"""A projection whose weight is stored in 8 bits (FP8 e4m3 or int8) with one float32 scale per
output row: FP8 W8A8, INT8 W8A8, INT8 W8A16 (formats.EightBitWeight).

On CUDA, by row count:
- one row (batch-1 decode; up to gemv.MAX_M rows under the GEMV modes that say so, as for bf16):
  folio's skinny GEMV reads the 8-bit weight and widens it in registers (W8A16 arithmetic: the
  activations are not quantized, so decode is as exact as the weights allow, and the bytes read
  are halved all the same; a merged gate|up projection fuses SiLU-and-mul there, `gate_up_silu`);
- FP8 weights at 2-64 rows (decode batches): folio's Triton product (kernels/fp8_matmul.py),
  on activations quantized as below for W8A8, on the 16-bit activations for weight-only FP8;
- more rows: the activations are quantized (per token, or with the checkpoint's static scale;
  kernels/act_quant.py) and the product runs on the tensor cores in 8 bits: FP8 through
  torch._scaled_mm (row-wise scales; fast accumulation from 1024 rows), INT8 through
  torch._int_mm with the scales applied after. A weight-only INT8 model widens the weight for
  cuBLAS instead.
Where W8A8 quantizes its input per token, the kernel that produces the input may quantize it
itself (`quantized_input_dtype`, `forward_quantized`): a gated MLP's SiLU-and-mul hands the
down projection its codes (kernels/activation.py) without writing the 16-bit activation.
Elsewhere (CPU tensors, tests) `reference` does the same arithmetic in float32 torch ops: the
activations fake-quantized as the W8A8 kernels quantize them, the weight dequantized.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from folio.model.kernel_config import DEFAULT_KERNEL_CONFIG, KernelConfig
from folio.model.kernels.act_quant import quantize_activations_reference
from folio.model.quant.formats import FP8_DTYPE, EightBitWeight
from folio.model.quant.scheme import ACT_FP8, ACT_INT8

# torch._int_mm takes more than 16 rows (cuBLASLt's int8 kernels); fewer are padded.
_INT_MM_MIN_ROWS = 17
# From this many rows (a long prefill) FP8 products accumulate fast (see _cuda).
FAST_ACCUM_MIN_ROWS = 1024


class EightBitLinear(nn.Module):
    def __init__(self, weight: EightBitWeight, activation: str | None,
                 act_per_tensor: bool = False,
                 kernels: KernelConfig = DEFAULT_KERNEL_CONFIG) -> None:
        super().__init__()
        if activation not in (None, ACT_FP8, ACT_INT8):
            raise ValueError(f"activation {activation!r}")
        if activation == ACT_FP8 and weight.codes.dtype != FP8_DTYPE:
            raise ValueError("FP8 activations need FP8 weights")
        self.out_features, self.in_features = weight.codes.shape
        self.activation = activation
        self.act_per_tensor = act_per_tensor
        self.kernels = kernels
        self.register_buffer("codes", weight.codes.contiguous(), persistent=False)
        self.register_buffer("scale", weight.scale.to(torch.float32).contiguous(),
                             persistent=False)
        self.register_buffer("input_scale", weight.input_scale, persistent=False)

    @property
    def act_dtype(self) -> torch.dtype | None:
        return {ACT_FP8: FP8_DTYPE, ACT_INT8: torch.int8}.get(self.activation)

    def dequantize(self) -> torch.Tensor:
        return self.codes.to(torch.float32) * self.scale[:, None]

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda:
            out = self._cuda(x2, bias)
        else:
            out = self.reference(x2, bias).to(x.dtype)
        return out.view(*shape[:-1], self.out_features)

    def _gemv_wanted(self, x: torch.Tensor, fused: bool = False) -> bool:
        """The GEMV where the bf16 one is used (by default one row: each further row bucket
        is more compiling and autotuning at start-up for a few percent)."""
        from folio.model.kernels import gemv
        return self.kernels.gemv_on and gemv.skinny_supported(x, self.codes) and \
            gemv.skinny_preferred(x.shape[0], self.out_features, self.in_features, fused=fused,
                                  mode=self.kernels.gemv)

    def gate_up_silu_wanted(self, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether gate_up_silu serves x (the GEMV's rows on CUDA)."""
        if not x.is_cuda or x.dim() == 0 or x.shape[-1] != self.in_features:
            return False
        if bias is not None and bias.dtype != x.dtype:
            return False
        return self._gemv_wanted(x.reshape(-1, self.in_features), fused=True)

    def gate_up_silu(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """For a merged gate|up projection (gate rows first): silu(gate) * up in one pass over
        the weight where the GEMV serves x (decode on CUDA), as the bf16 MLP fuses it; None
        elsewhere (the caller then runs the projection and the activation apart)."""
        if not self.gate_up_silu_wanted(x, bias):
            return None
        x2 = x.reshape(-1, self.in_features)
        from folio.model.kernels import gemv
        act = gemv.skinny_gate_up_silu(x2, self.codes, bias, scale=self.scale,
                                       pdl=self.kernels.pdl_on)
        return act.view(*x.shape[:-1], -1)

    def forward_add_norm(self, x: torch.Tensor, bias: torch.Tensor | None,
                         residual: torch.Tensor, norm_weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The product, the residual add and the RMSNorm after it in one launch where the GEMV
        serves x (Linear.forward_add_norm); None elsewhere."""
        if not x.is_cuda or x.shape[-1] != self.in_features:
            return None
        x2 = x.reshape(-1, self.in_features)
        if not self._gemv_wanted(x2):
            return None
        from folio.model.kernels import gemv
        return gemv.skinny_matmul_add_norm(x2, self.codes, residual, norm_weight, eps, bias,
                                           scale=self.scale, pdl=self.kernels.pdl_on)

    def _cuda(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from folio.model.kernels import gemv
        if self._gemv_wanted(x):
            return gemv.skinny_matmul(x, self.codes, bias, scale=self.scale,
                                      pdl=self.kernels.pdl_on)
        if self.activation is None:
            if self._fp8_kernel_wanted(x, bias):   # weight-only FP8: W8A16 in the kernel
                from folio.model.kernels.fp8_matmul import fp8_matmul
                return fp8_matmul(x, self.codes, self.scale, bias=bias,
                                  pdl=self.kernels.pdl_on)
            w = (self.codes.to(torch.float32) * self.scale[:, None]).to(x.dtype)
            return F.linear(x, w, bias)
        codes, x_scale = self._quantize_input(x)
        return self.forward_quantized(codes, x_scale, bias, x.dtype)

    def quantized_input_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """The dtype `forward` would quantize an input like x ([..., K], CUDA) to, per token
        and dynamically, before its product -- so that the kernel producing x may hand over
        those codes instead (`forward_quantized`); None where forward does not quantize x
        that way (the GEMV's rows, weight-only, static or per-tensor scales, CPU)."""
        if (not x.is_cuda or self.activation is None or self.act_per_tensor
                or self.input_scale is not None or x.dtype not in (torch.float16, torch.bfloat16)
                or x.shape[-1] != self.in_features):
            return None
        if self._gemv_wanted(x.reshape(-1, self.in_features)):
            return None
        return self.act_dtype

    def forward_quantized(self, codes: torch.Tensor, x_scale: torch.Tensor,
                          bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """The W8A8 product of activations already quantized per token ([M, K] codes in
        `act_dtype`, x_scale [M, 1] float32, as `quantize_activations` gives them) -> [M, N]
        in `out_dtype`."""
        m = codes.shape[0]
        if self.activation == ACT_FP8 and self._fp8_kernel_wanted(codes, bias, out_dtype):
            from folio.model.kernels.fp8_matmul import fp8_matmul
            return fp8_matmul(codes, self.codes, self.scale, x_scale, bias, out_dtype=out_dtype,
                              pdl=self.kernels.pdl_on)
        if self.activation == ACT_FP8:
            # Row-wise scaling gives bfloat16 out; other dtypes are cast after. Fast
            # accumulation (Hopper's FP8 MMA without the periodic promotion to full fp32, as
            # vLLM's CUTLASS FP8 kernels run) was 5-15 % faster at 4096 rows on an H200
            # (tools/gpu_check_quant.py, docs/benchmarks.md), but on a small random model it
            # moved greedy tokens past near-ties, so only long prefills take it.
            out = torch._scaled_mm(codes, self.codes.t(), scale_a=x_scale,
                                   scale_b=self.scale.view(1, -1), out_dtype=torch.bfloat16,
                                   use_fast_accum=m >= FAST_ACCUM_MIN_ROWS)
            out = out.to(out_dtype)
        else:
            pad = max(0, _INT_MM_MIN_ROWS - m)
            if pad:
                codes = F.pad(codes, (0, 0, 0, pad))
            acc = torch._int_mm(codes, self.codes.t())[:m]
            out = (acc.to(torch.float32) * x_scale * self.scale.view(1, -1)).to(out_dtype)
        return out if bias is None else out + bias.to(out.dtype)

    def _fp8_kernel_wanted(self, x: torch.Tensor, bias: torch.Tensor | None,
                           out_dtype: torch.dtype | None = None) -> bool:
        """FP8 weights at a decode batch's rows (2 to fp8_matmul.MAX_M): folio's Triton
        product, which read the weight 1.2-2x faster than activation quantization +
        cuBLASLt there on the H200 (tools/gpu_sweep_fp8_mm.py); cuBLASLt past it. x: the
        16-bit input, or its FP8 codes with the output's dtype in `out_dtype`."""
        out_dtype = x.dtype if out_dtype is None else out_dtype
        if self.codes.dtype != FP8_DTYPE or not self.kernels.gemv_on \
                or out_dtype not in (torch.float16, torch.bfloat16) \
                or (bias is not None and bias.dtype != out_dtype):
            return False
        from folio.model.kernels import fp8_matmul
        return fp8_matmul.supported(x, self.codes)

    def _quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.act_per_tensor and self.input_scale is None:
            # dynamic per-tensor: one amax over the batch, then the static path
            return quantize_activations_reference(x, self.act_dtype, per_tensor=True)
        from folio.model.kernels.act_quant import quantize_activations
        if x.stride(1) != 1:
            x = x.contiguous()
        return quantize_activations(x, self.act_dtype, self.input_scale)

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] float32: the W8A8 arithmetic in torch ops (any device)."""
        w = self.dequantize()
        if self.activation is None:
            xq = x.to(torch.float32)
        else:
            codes, scale = quantize_activations_reference(
                x, self.act_dtype, self.input_scale, per_tensor=self.act_per_tensor)
            xq = codes.to(torch.float32) * scale
        out = xq @ w.t()
        return out if bias is None else out + bias.to(torch.float32)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight={self.codes.dtype}, activation={self.activation}")
