"""Weights kept as packed 4-bit planes on the CPU (see gguf_planes.py), for matmuls and row
lookups.

Each plane's codes are stored two to a byte in ggml's order within a group of 32 (byte i holds
element i in its low nibble and element i + 16 in its high one), with two parameters per group:
float32 (scale, zero), weights (code - 8) * scale + zero, 6 bits per weight per plane; or,
where every group allows it, float16 in ggml's form (d, m), weights code * d + m, 5 bits. A
decode step streams the weights from memory, so the smaller form is what it waits for: a
Q4_0 / Q4_1 file's d and m are float16 already, and the weights come out the same bit for bit
(`_half_params`); K-quants' products of a super-block scale and a 6-bit one are not float16
values, and keep float32. The matmul is folio's C++ kernel
(folio/model/cpu_kernels/csrc/q4_matmul.cpp), float32 throughout.

Why not torch's own CPU int4 matmul (`aten._weight_int4pack_mm_for_cpu`): it is fast only with
bfloat16 activations, scales and output (on this project's 2-vCPU AVX-512 VM, 86 µs for a
576 -> 1536 product at one row against ~2.2 ms fed float32), and those roundings cost ~0.3 % per
matmul, which moved the default model's greedy answers (12 of 15 prompts kept their first 16
tokens against the float path; the issue asks 13). The C++ kernel's error against
dequantize-then-matmul is float32 summation order (~3e-7 relative).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from folio.model.quant.gguf_planes import GROUP, Plane
from folio.model.quant.packed import PackedWeight


def _ggml_nibbles(codes: np.ndarray) -> np.ndarray:
    """[N, K] codes 0..15 -> [N, K / 2] bytes, ggml's order within each group of 32."""
    n, k = codes.shape
    groups = codes.reshape(n, k // GROUP, GROUP)
    two = groups[..., :GROUP // 2] | (groups[..., GROUP // 2:] << 4)
    return np.ascontiguousarray(two.reshape(n, k // 2), dtype=np.uint8)


class PackedInt4Weight(PackedWeight):
    """W [N, K] = the sum of the planes. forward(x [..., K]) = x @ W^T (+ bias), in x's
    dtype; lookup(ids) = rows of W in float32."""

    def __init__(self, planes: list[Plane]) -> None:
        super().__init__()
        if not planes:
            raise ValueError("a packed weight needs at least one plane")
        self.out_features, self.in_features = planes[0].codes.shape
        if self.in_features % GROUP:
            raise ValueError(f"in_features {self.in_features} is not a multiple of {GROUP}")
        self.num_planes = len(planes)
        # The planes stacked ([P, N, ...]): the kernel takes three tensors, whatever P is.
        self.register_buffer("codes", torch.from_numpy(
            np.stack([_ggml_nibbles(p.codes) for p in planes])), persistent=False)
        scale = np.stack([p.scale for p in planes]).astype(np.float32)
        zero = np.stack([p.zero for p in planes]).astype(np.float32)
        half = _half_params(scale, zero)
        if half is not None:
            scale, zero = half
        self.register_buffer("scale", torch.from_numpy(scale), persistent=False)
        self.register_buffer("zero", torch.from_numpy(zero), persistent=False)
        from folio.model.cpu_kernels import extension
        self._matmul = functools.partial(extension().q4_matmul, codes=self.codes,
                                         scale=self.scale, zero=self.zero)

    def cpu_parts(self) -> list:
        from folio.model.cpu_kernels import extension
        return [extension().q4_part(self.codes, self.scale, self.zero)]

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        k = self.in_features
        out = torch.zeros(flat.shape[0], k, dtype=torch.float32)
        bias = 0.0 if self.scale.dtype == torch.float16 else 8.0
        for two, scale, zero in zip(self.codes, self.scale.float(), self.zero.float()):
            b = two.index_select(0, flat).view(-1, k // GROUP, GROUP // 2)
            codes = torch.cat([b & 0x0F, b >> 4], dim=-1).to(torch.float32) - bias
            out += (codes * scale.index_select(0, flat).unsqueeze(-1)
                    + zero.index_select(0, flat).unsqueeze(-1)).view(-1, k)
        return out.view(*ids.shape, k)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"planes={self.num_planes}, params={str(self.scale.dtype)[6:]}")


def _half_params(scale: np.ndarray, zero: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Float32 (scale, zero) as float16 (d, m) = (scale, zero - 8 * scale) when that changes no
    weight: d and m are float16 values and m is exact, so code * d + m and (code - 8) * scale +
    zero are the same real number, which one rounding (the kernel's FMA) makes the same float.
    None where any group does not allow it."""
    d = scale
    m = zero - np.float32(8.0) * scale
    exact = (m.astype(np.float64) + 8.0 * scale.astype(np.float64)) == zero.astype(np.float64)
    if not exact.all():
        return None
    d16, m16 = d.astype(np.float16), m.astype(np.float16)
    if not (np.isfinite(d16).all() and np.isfinite(m16).all()
            and (d16.astype(np.float32) == d).all() and (m16.astype(np.float32) == m).all()):
        return None
    return d16, m16
