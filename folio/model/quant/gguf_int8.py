"""GGUF Q8_0 and Q6_K blocks as int8 codes with a float32 scale per group, exactly: no value is
re-quantized.

  * Q8_0 (d, 32 int8 q):                        value = d * q          groups of 32, scale d
  * Q6_K (super-blocks of 256: 6-bit q, an int8 scale per 16, fp16 d):
                                                value = (d * sc) * (q - 32)
                                                                       groups of 16, scale d*sc

Each value is float(code) * scale with one float32 rounding, the order gguf-py dequantizes in
(Q6_K: d * sc first, exact in float32, then the code). Decoding is numpy over whole tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from folio.model.quant.gguf_planes import f16_field

# GGML type name -> (block elements, block bytes).
INT8_BLOCKS = {"Q8_0": (32, 34), "Q6_K": (256, 210)}
INT8_TYPES = frozenset(INT8_BLOCKS)


@dataclass
class Int8Rows:
    """W [N, K] = codes * scale, scale per group of K / G weights along each row."""

    codes: np.ndarray   # int8 [N, K]
    scale: np.ndarray   # float32 [N, G]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def dequantize(self) -> np.ndarray:
        return self.codes.astype(np.float32) * np.repeat(self.scale, self.group, axis=1)

    def take_rows(self, rows: np.ndarray) -> "Int8Rows":
        return Int8Rows(self.codes[rows], self.scale[rows])


def _q6k_codes(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q6_K ql [..., 128] (low 4 bits) and qh [..., 64] (high 2 bits) -> [..., 256] codes
    0..63. Each 128-element half h reads ql[64h:64h+64] and qh[32h:32h+32]; its element
    32t + l (t = 0..3) takes the low nibble (t = 0, 1) or high nibble (t = 2, 3) of
    ql[l + 32 (t % 2)] and bits 2t..2t+1 of qh[l]."""
    lead = ql.shape[:-1]
    low = ql.reshape(*lead, 2, 1, 2, 32)                                  # [.., h, -, t%2, l]
    low = (low >> np.array([0, 4], np.uint8).reshape(2, 1, 1)) & 0x0F     # [.., h, t//2, t%2, l]
    high = (qh.reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    return (low.reshape(*lead, 2, 4, 32) | (high << 4)).reshape(*lead, 256)


def int8_from_blocks(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> Int8Rows:
    """The int8 form of a GGUF tensor of `type_name` whose blocks are `raw` (uint8, the
    tensor's bytes in order), as an [N, K] = `shape` weight."""
    if type_name not in INT8_BLOCKS:
        raise ValueError(f"GGUF type {type_name} has no int8 form")
    n, k = shape
    elems, nbytes = INT8_BLOCKS[type_name]
    if k % elems:
        raise ValueError(f"rows of {k} elements do not hold whole {type_name} blocks")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // elems, nbytes)
    if type_name == "Q8_0":
        codes = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return Int8Rows(codes, np.ascontiguousarray(f16_field(blocks, 0).reshape(n, -1)))
    # Q6_K: ql[128] qh[64] scales[16] (int8) d (fp16).
    q = _q6k_codes(blocks[..., :128], blocks[..., 128:192]).astype(np.int16) - 32
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)    # [n, blocks, 16]
    scale = f16_field(blocks, 208) * sc
    return Int8Rows(q.astype(np.int8).reshape(n, k),
                    np.ascontiguousarray(scale.reshape(n, -1), dtype=np.float32))
