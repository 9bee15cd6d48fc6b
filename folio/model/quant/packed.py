"""What the packed weights of folio.model.quant share: a weight kept quantized on the CPU that
multiplies (forward, in the input's dtype) and gives rows back (lookup, for embeddings), with its
matmul one call into folio's C++ kernels (folio/model/cpu_kernels), float32 throughout."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class PackedWeight(nn.Module):
    """W [out_features, in_features] kept packed. Subclasses register their buffers and bind
    `_matmul` (x [M, K] contiguous float32 -> [M, N] float32) once: a decode step makes ~120 of
    these calls, and a Module attribute lookup per buffer per call shows in its time (the
    buffers never move: CPU only)."""

    out_features: int
    in_features: int
    _matmul: Callable[[torch.Tensor], torch.Tensor]

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            return self._matmul(x)  # the float32 model's usual case, with no reshaping
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        out = self._matmul(x2)
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(x.dtype).view(*shape[:-1], self.out_features)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W, rebuilt exactly in float32 ([*ids.shape, K])."""
        raise NotImplementedError

    def cpu_parts(self) -> list | None:
        """W as the C++ decoder layer takes it (folio.model.cpu_layer): the extension's packed
        parts whose outputs, concatenated, are forward's; None where it has no such form."""
        return None

    def dequantize(self) -> torch.Tensor:
        """W in float32 (tests, reference)."""
        return self.lookup(torch.arange(self.out_features))


class PackedConcat(nn.Module):
    """A merged projection whose shards were packed in different formats (e.g. a GGUF file
    with Q4_K q/k and Q6_K v): each part multiplies on its own, outputs concatenated in the
    module's row order."""

    def __init__(self, parts: list[PackedWeight]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.cat([p.forward(x) for p in self.parts], dim=-1)
        return out if bias is None else out + bias.to(out.dtype)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("a concatenation of packed shards has no row lookup")

    def cpu_parts(self) -> list | None:
        # a part that is not a PackedWeight (an act-order permutation around one) has none
        parts = [p.cpu_parts() if hasattr(p, "cpu_parts") else None for p in self.parts]
        return None if any(p is None for p in parts) else [q for p in parts for q in p]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts], dim=0)
