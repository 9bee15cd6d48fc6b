"""Weights kept as int8 codes with float32 scales on the CPU: GGUF Q8_0 and Q6_K matrices
(folio.model.quant.gguf_int8) and float checkpoints quantized on load per output channel
(`--quantization int8`). The matmul is folio's C++ kernel
(folio/model/cpu_kernels/csrc/int8_matmul.cpp), float32 activations and accumulation: the
only error against dequantize-then-matmul is float32 summation order."""
from __future__ import annotations

import functools

import numpy as np
import torch

from folio.model.quant.gguf_int8 import Int8Rows
from folio.model.quant.packed import PackedWeight


class PackedInt8Weight(PackedWeight):
    """W [N, K] = codes * scale, one scale per group of K / G weights along each row (G = 1:
    per output channel)."""

    def __init__(self, rows: Int8Rows) -> None:
        super().__init__()
        codes, scale = rows.codes, rows.scale
        if codes.ndim != 2 or scale.ndim != 2 or scale.shape[0] != codes.shape[0]:
            raise ValueError(f"int8 codes {codes.shape} and scales {scale.shape} do not match")
        self.out_features, self.in_features = codes.shape
        if self.in_features % scale.shape[1] or rows.group % 16:
            raise ValueError(f"groups of {self.in_features}/{scale.shape[1]} weights: the "
                             "kernel needs a multiple of 16")
        self.group = rows.group
        self.register_buffer("codes", torch.from_numpy(np.ascontiguousarray(codes, np.int8)),
                             persistent=False)
        self.register_buffer("scale", torch.from_numpy(
            np.ascontiguousarray(scale, np.float32)), persistent=False)
        from folio.model.cpu_kernels import extension
        self._matmul = functools.partial(extension().int8_matmul, codes=self.codes,
                                         scale=self.scale)

    def cpu_parts(self) -> list:
        from folio.model.cpu_kernels import extension
        return [extension().int8_part(self.codes, self.scale)]

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        codes = self.codes.index_select(0, flat).to(torch.float32)
        scale = self.scale.index_select(0, flat).repeat_interleave(self.group, dim=1)
        return (codes * scale).view(*ids.shape, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int8, groups of {self.group}")


def quantize_per_channel(weight: torch.Tensor) -> Int8Rows:
    """Symmetric int8 per output channel (`--quantization int8`): scale = max|w| / 127 per row,
    codes = round(w / scale) in [-127, 127]; an all-zero row gets scale 0."""
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.clamp(torch.round(w / safe), -127, 127).to(torch.int8)
    return Int8Rows(codes.numpy(), scale.numpy().astype(np.float32))
