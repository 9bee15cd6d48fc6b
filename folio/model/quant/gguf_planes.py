"""GGUF quantized blocks as 4-bit planes, exactly: no value is re-quantized.

A plane is a [N, K] array of 4-bit codes q (0..15) with one scale s and one zero z per group of
32 along K; it stands for the weights (q - 8) * s + z, the form torch's CPU int4 matmul
(`aten._weight_int4pack_mm_for_cpu`, groups of 32) computes with. Each GGUF type is a sum of
one or two such planes:

  * Q4_0  (d, 4-bit q):            d * (q - 8)                 one plane, s = d, z = 0
  * Q4_1  (d, m, 4-bit q):         d * q + m                   one plane, s = d, z = m + 8d
  * Q4_K  (super-blocks of 256: eight groups of 32 with 6-bit scale and min codes):
                                   d*sc * q - dmin*mn          one plane per group's s, z
  * Q5_0 / Q5_1 / Q5_K (a fifth bit h): the 4-bit plane plus a plane of h (0/1) at 16 s

Decoding is numpy over whole tensors (no Python loop over blocks). Q8_0 and Q6_K are int8
codes instead (gguf_int8.py); the Q2/Q3 K-quants and the IQ types are neither: the loader keeps
those tensors dequantized.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32

# GGML type name -> (block elements, block bytes).
BLOCKS = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q4_K": (256, 144), "Q5_K": (256, 176),
}
PLANE_TYPES = frozenset(BLOCKS)


@dataclass
class Plane:
    codes: np.ndarray   # uint8 [N, K], 0..15
    scale: np.ndarray   # float32 [N, K // 32]
    zero: np.ndarray    # float32 [N, K // 32]

    def dequantize(self) -> np.ndarray:
        s = np.repeat(self.scale, GROUP, axis=1)
        z = np.repeat(self.zero, GROUP, axis=1)
        return (self.codes.astype(np.float32) - 8.0) * s + z

    def take_rows(self, rows: np.ndarray) -> "Plane":
        return Plane(self.codes[rows], self.scale[rows], self.zero[rows])


@dataclass
class PlaneSum:
    """A weight as the sum of its planes (one or two), with Int8Rows' face (gguf_int8.py):
    shape, dequantize, take_rows."""

    planes: list[Plane]

    @property
    def shape(self) -> tuple[int, int]:
        return self.planes[0].codes.shape

    def dequantize(self) -> np.ndarray:
        return sum(p.dequantize() for p in self.planes)

    def take_rows(self, rows: np.ndarray) -> "PlaneSum":
        return PlaneSum([p.take_rows(rows) for p in self.planes])


def f16_field(block: np.ndarray, offset: int) -> np.ndarray:
    """[..., 1] float32 of the little-endian fp16 at `offset` of each block."""
    return block[..., offset:offset + 2].copy().view(np.float16).astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """qs [..., 16] bytes of a 32-element block -> [..., 32] codes: low nibbles are elements
    0..15, high nibbles 16..31 (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bit_32(qh: np.ndarray) -> np.ndarray:
    """qh [..., 4] bytes (a little-endian u32) -> [..., 32] bits: bit j is element j's."""
    word = qh.copy().view(np.uint32)  # [..., 1]
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K-quant 12-byte scale fields [..., 12] -> (sc, mn) [..., 8] 6-bit codes."""
    q = scales.astype(np.uint8)
    lo_sc, lo_mn = q[..., 0:4] & 63, q[..., 4:8] & 63
    hi_sc = (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)
    hi_mn = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return (np.concatenate([lo_sc, hi_sc], -1).astype(np.float32),
            np.concatenate([lo_mn, hi_mn], -1).astype(np.float32))


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K qs [..., 128] -> [..., 256] low 4 bits: in each 64-element chunk c, bytes
    qs[32c:32c+32] give elements 64c..64c+31 (low nibbles) and 64c+32..64c+63 (high)."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=-1).reshape(*qs.shape[:-1], 256)


def _k_fifth_bit(qh: np.ndarray) -> np.ndarray:
    """Q5_K qh [..., 32] -> [..., 256] fifth bits: element 64c + 32u + l has bit 2c + u of
    qh[l]."""
    bits = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., 8, 32]
    return bits.reshape(*qh.shape[:-1], 256).astype(np.uint8)


def planes_from_blocks(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> list[Plane]:
    """The planes of a GGUF tensor of `type_name` whose blocks are `raw` (uint8, any shape
    holding the tensor's bytes in order), as an [N, K] = `shape` weight."""
    if type_name not in BLOCKS:
        raise ValueError(f"GGUF type {type_name} has no 4-bit plane form")
    n, k = shape
    elems, nbytes = BLOCKS[type_name]
    if k % elems:
        raise ValueError(f"rows of {k} elements do not hold whole {type_name} blocks")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // elems, nbytes)

    def rows(a: np.ndarray) -> np.ndarray:  # [n, blocks, per-block] -> [n, K or groups]
        return np.ascontiguousarray(a.reshape(n, -1))

    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = f16_field(blocks, 0)
        has_min = type_name.endswith("_1")
        m = f16_field(blocks, 2) if has_min else np.zeros_like(d)
        off = 4 if has_min else 2
        five = type_name.startswith("Q5")
        codes = _nibbles_32(blocks[..., off + (4 if five else 0):])
        if not five:
            zero = m + 8 * d if has_min else np.zeros_like(d)
            return [Plane(rows(codes), rows(d), rows(zero))]
        # Q5: value = d * (lo + 16 h) + (m, or -16 d for Q5_0).
        high = _fifth_bit_32(blocks[..., off:off + 4])
        base = m if has_min else -16 * d
        return [Plane(rows(codes), rows(d), rows(base + 8 * d)),
                Plane(rows(high), rows(16 * d), rows(128 * d))]
    # Q4_K / Q5_K: per 32-element group, scale d*sc and offset -dmin*mn.
    d, dmin = f16_field(blocks, 0), f16_field(blocks, 2)
    sc, mn = _k_scales(blocks[..., 4:16])
    scale = d * sc                        # [n, blocks, 8]
    offset = -dmin * mn
    if type_name == "Q4_K":
        codes = _k_nibbles(blocks[..., 16:144])
        return [Plane(rows(codes), rows(scale), rows(offset + 8 * scale))]
    high = _k_fifth_bit(blocks[..., 16:48])
    codes = _k_nibbles(blocks[..., 48:176])
    return [Plane(rows(codes), rows(scale), rows(offset + 8 * scale)),
            Plane(rows(high), rows(16 * scale), rows(128 * scale))]
