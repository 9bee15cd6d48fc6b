"""Test helper: re-quantize the default model's GGUF (SmolLM2-135M, Q4_1 projections and a Q8_0
embedding) into the K-quant mix of llama.cpp's Q4_K_M files, as a new GGUF file.

Encoders for Q4_K, Q5_K and Q6_K (gguf-py only dequantizes those), written for these tests from
the block layouts: simple, not llama.cpp's search for the best scales — each 32 (Q4_K/Q5_K) or
16 (Q6_K) weights get the smallest step that covers their range, the super-block's fp16 scales
rounded up so that no code clips. Every weight is then within half a step of its value (the
round trip through gguf-py's `dequantize` is checked in tests/model/test_gguf_kquants.py).
Q8_0, Q5_0 and Q5_1 use gguf-py's `quantize`.

The type plan (`q4_k_m_type`) follows llama.cpp's Q4_K_M: Q6_K for attn_v and ffn_down of the
first and last eighth of the layers and every third one between (its `use_more_bits`), Q4_K for
the rest, here with Q5_K for a few ffn_up / ffn_down so that the file holds every K-quant type
folio keeps packed, and Q8_0 for the (tied) embedding. A K-quant needs rows of whole 256-element
super-blocks; where a matrix's rows are not (SmolLM2-135M's hidden size is 576, so everything
but ffn_down), llama.cpp falls back to Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and so does
`write_requantized`: llama.cpp's Q4_K_M of SmolLM2-135M has K-quants in ffn_down only.
`widen` (e.g. hidden size 768 = 3 * 256 and 12 heads of 64) writes the same model zero-padded
to a width whose rows are whole super-blocks, an exact transformation (`Widening`), so that
every projection can be a K-quant: the layout of the Q4_K_M files of larger models (a Q4_K q/k
with a Q6_K v in one qkv).

Everything else is copied: the metadata keys and values (the tokenizer's too) with their GGUF
value types (but general.file_type, now MOSTLY_Q4_K_M, and, widened, the width's keys), the 1-D
tensors, the tensor order, and llama.cpp's Q/K row permutation (the same tensors re-encoded in
the same layout). Deterministic: no randomness anywhere.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

QK_K = 256
# A K-quant on rows that are not whole super-blocks: llama.cpp's fallback type.
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_LAYER = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


# --------------------------------------------------------------------------- #
# K-quant encoders: float32 [N, K] (K a multiple of 256) -> uint8 [N, K / 256 * block bytes]
# --------------------------------------------------------------------------- #


def _f16_at_least(v: np.ndarray) -> np.ndarray:
    """The smallest fp16 values >= v (v >= 0, finite in fp16)."""
    h = v.astype(np.float16)
    low = h.astype(np.float32) < v
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _steps(need: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Per super-block fp16 d and per sub-block integer codes 0..top with d * code >= need
    (need [B, S] >= 0): d covers the largest need in `top` steps, each code is rounded up."""
    d = _f16_at_least(need.max(axis=1, keepdims=True) / top)
    d32 = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        code = np.where(d32 > 0, np.ceil(need / d32), 0)
    return d, np.clip(code, 0, top).astype(np.uint8)


def _codes(x: np.ndarray, step: np.ndarray, top_code: int) -> np.ndarray:
    """round(x / step) clipped to 0..top_code; 0 where the step is 0 (x [B, S, G], step [B, S])."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint(x / step[..., None]), 0)
    return np.clip(q, 0, top_code).astype(np.uint8)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scale codes and eight 6-bit min codes [B, 8] -> the 12 bytes [B, 12]: bytes
    0..3 / 4..7 hold scales / mins 0..3 in their low 6 bits and the top 2 bits of scales / mins
    4..7; bytes 8..11 the low 4 bits of scales 4..7 (low nibble) and mins 4..7 (high)."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _low_nibbles_k(q: np.ndarray) -> np.ndarray:
    """Codes [B, 256] -> the 128 bytes of their low 4 bits: in each 64-element chunk c, byte
    32c + l holds element 64c + l (low nibble) and 64c + 32 + l (high nibble)."""
    q = (q & 15).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _encode_min_scale(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: value = d * sc * q - dmin * mn per 32 weights, q in 0..2**bits - 1.
    Returns (d, dmin, scale bytes, codes [B, 256], step [B, 8])."""
    top = 2 ** bits - 1
    x = np.asarray(w, np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(axis=2), 0.0)           # the offset -dmin*mn is never positive
    dmin, mn = _steps(-lo, 63)
    offset = dmin.astype(np.float32) * mn.astype(np.float32)   # >= -lo: no code below 0
    # The step of each 32 covers x + offset in `top` steps: d * sc >= (max + offset) / top.
    d, sc = _steps((x.max(axis=2) + offset) / top, 63)
    step = d.astype(np.float32) * sc.astype(np.float32)
    q = _codes(x + offset[..., None], step, top)
    return d, dmin, _k_scale_bytes(sc, mn), q.reshape(-1, QK_K), step


def _q4_k(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K blocks (144 bytes): fp16 d, fp16 dmin, 12 scale bytes, 128 bytes of 4-bit codes."""
    d, dmin, scales, q, step = _encode_min_scale(w, 4)
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, _low_nibbles_k(q)],
                          axis=1), step


def _q5_k(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q5_K blocks (176 bytes): fp16 d, fp16 dmin, 12 scale bytes, 32 bytes of fifth bits
    (element 32j + l: bit j of byte l), 128 bytes of low 4 bits (as Q4_K's)."""
    d, dmin, scales, q, step = _encode_min_scale(w, 5)
    high = (q >> 4).reshape(-1, 8, 32)
    qh = np.zeros((high.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, qh,
                           _low_nibbles_k(q)], axis=1), step


def _q6_k(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K blocks (210 bytes): 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8
    scales (one per 16 weights), fp16 d; value = d * scale * (q - 32), q in 0..63. Each
    128-element half h: element 128h + 32t + l has the low nibble (t = 0, 1) or high nibble
    (t = 2, 3) of low byte 64h + 32 (t % 2) + l and bits 2t, 2t + 1 of high byte 32h + l."""
    x = np.asarray(w, np.float32).reshape(-1, 16, 16)
    # Symmetric, codes -31..31 (the 32nd negative level is left unused); the scale negative
    # where the sub-block's largest magnitude is positive, as llama.cpp's (which maps that
    # value to code -32) are.
    d, sc = _steps(np.abs(x).max(axis=2) / 31, 127)
    extreme = np.take_along_axis(x, np.abs(x).argmax(axis=2)[..., None], axis=2)[..., 0]
    sc = np.where(extreme > 0, -sc.astype(np.int8), sc.astype(np.int8))
    step = d.astype(np.float32) * sc.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] != 0, np.rint(x / step[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)   # [B, h, t, l]
    low = q & 15
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4),
                         low[:, :, 1] | (low[:, :, 3] << 4)], axis=2).reshape(-1, 128)
    high = q >> 4
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4)
          | (high[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], axis=1), np.abs(step)


_K_ENCODERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def quantize_k(w: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """float32 [N, K] (K a multiple of 256) -> (the uint8 blocks [N, K / 256 * block bytes]
    of K-quant `type_name`, the step of each 32 (Q4_K/Q5_K) or 16 (Q6_K) weights [N, groups],
    its magnitude):
    each weight decodes within half its step."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    n, k = w.shape
    if k % QK_K:
        raise ValueError(f"{type_name} needs rows of whole {QK_K}-element super-blocks")
    blocks, step = _K_ENCODERS[type_name](w)
    return blocks.reshape(n, -1), step.reshape(n, -1)


def quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [N, K] -> the uint8 blocks [N, bytes per row] of GGML type `type_name`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize
    if type_name in _K_ENCODERS:
        return quantize_k(w, type_name)[0]
    w = np.ascontiguousarray(w, dtype=np.float32)
    return gguf_quantize(w, getattr(GGMLQuantizationType, type_name))


# --------------------------------------------------------------------------- #
# The type plan
# --------------------------------------------------------------------------- #


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in Q4_K_M: the
    first and last eighth, and every third layer between."""
    return (layer < n_layers // 8 or layer >= 7 * n_layers // 8
            or (layer - n_layers // 8) % 3 == 2)


def q4_k_m_type(name: str, n_layers: int) -> str | None:
    """The type a 2-D tensor `name` gets (None: 1-D, copied as it is)."""
    if name == "token_embd.weight":
        return "Q8_0"
    if name == "output.weight":      # an untied lm_head (SmolLM2's is tied)
        return "Q6_K"
    m = _LAYER.match(name)
    if m is None:
        return None
    layer, part = int(m.group(1)), m.group(2)
    if part in ("attn_v", "ffn_down") and use_more_bits(layer, n_layers):
        return "Q6_K"
    if (part == "ffn_down" and layer % 4 == 0) or (part == "ffn_up" and layer % 7 == 3):
        return "Q5_K"
    if part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        return "Q4_K"
    return None


def stored_type(wanted: str, row_length: int) -> str:
    """The type written for a `wanted` type on rows of `row_length` (llama.cpp's fallback for
    a K-quant on rows that are not whole super-blocks)."""
    if wanted in K_FALLBACK and row_length % QK_K:
        return K_FALLBACK[wanted]
    return wanted


# --------------------------------------------------------------------------- #
# Writing the file
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Widening:
    """The model with hidden size `hidden` zero-padded to `new_hidden` and `heads` attention
    heads (groups of heads / kv_heads per KV head) padded to `new_heads` with zero heads, each
    KV group's new heads after its own: the same function, every projection's rows now whole
    K-quant super-blocks (transformers' configs want the hidden size a multiple of the heads,
    so both grow). The residual stream's new channels stay 0: the embedding's, attn_output's
    and ffn_down's new rows / columns are 0, and the projections read them through zero
    columns. A zero head's query is 0 (its attention output is its KV group's mean value) and
    attn_output reads it through zero columns. RMSNorm averages over more channels: eps scaled
    by hidden / new_hidden (in the metadata) and the norm weights by sqrt(hidden / new_hidden)
    keep each norm's output."""

    hidden: int
    new_hidden: int
    heads: int
    new_heads: int
    kv_heads: int

    def head_order(self) -> np.ndarray:
        """For each new head, the old head it is (-1: a zero head)."""
        per, new_per = self.heads // self.kv_heads, self.new_heads // self.kv_heads
        group, slot = np.divmod(np.arange(self.new_heads), new_per)
        return np.where(slot < per, group * per + slot, -1)

    def _heads(self, w: np.ndarray, axis: int) -> np.ndarray:
        """Rows (axis 0) or columns (axis 1) of heads, in the new head order."""
        order = self.head_order()
        parts = np.split(w, self.heads, axis=axis)
        zero = np.zeros_like(parts[0])
        return np.concatenate([parts[h] if h >= 0 else zero for h in order], axis=axis)

    def apply(self, name: str, w: np.ndarray) -> np.ndarray:
        extra = self.new_hidden - self.hidden
        if w.ndim == 1:
            if not name.endswith("norm.weight"):
                raise ValueError(f"no widening rule for the 1-D tensor {name}")
            return np.pad(w * np.float32(math.sqrt(self.hidden / self.new_hidden)), (0, extra))
        part = name.split(".")[-2]
        if part == "attn_q":                  # [heads * hd, hidden]
            w = self._heads(w, 0)
        if part == "attn_output":             # [hidden, heads * hd]
            w = self._heads(w, 1)
        if part in ("attn_output", "ffn_down"):
            return np.pad(w, ((0, extra), (0, 0)))
        return np.pad(w, ((0, 0), (0, extra)))   # reads the residual stream


def _field_value(field):
    """(value, GGUF value type, element type of an array or None) of a reader's field."""
    from gguf import GGUFValueType
    main = field.types[0]
    return field.contents(), main, (field.types[-1] if main == GGUFValueType.ARRAY else None)


def write_requantized(src, dst: str,
                      type_of: Callable[[str, int], str | None] = q4_k_m_type,
                      widen: tuple[int, int] | None = None,
                      layers: int | None = None) -> dict[str, str]:
    """Write the model of `src` (a GGUF path, or its GGUFReader: parsing the tokenizer's
    metadata takes seconds) to `dst` with each 2-D tensor dequantized and re-encoded as
    `type_of(gguf name, number of layers)` (through `stored_type`; None: copied as it is).
    `widen` (hidden size, heads): the model widened to these (see `Widening`); `layers`: only
    the first this many layers (a small file for the helper's own tests). Returns {tensor
    name: the GGML type written}."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize

    reader = src if isinstance(src, GGUFReader) else GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    hidden = int(reader.fields[f"{arch}.embedding_length"].contents())
    keep_layers = n_layers if layers is None else layers
    overrides: dict[str, object] = {f"{arch}.block_count": keep_layers,
                                    "general.file_type": int(LlamaFileType.MOSTLY_Q4_K_M)}
    widening = None
    if widen is not None:
        widening = Widening(hidden, widen[0], int(reader.fields[f"{arch}.attention.head_count"]
                                                   .contents()), widen[1],
                            int(reader.fields[f"{arch}.attention.head_count_kv"].contents()))
        eps_key = f"{arch}.attention.layer_norm_rms_epsilon"
        eps = float(reader.fields[eps_key].contents())
        overrides[f"{arch}.embedding_length"] = widening.new_hidden
        overrides[f"{arch}.attention.head_count"] = widening.new_heads
        overrides[eps_key] = float(np.float32(eps * hidden / widening.new_hidden))

    writer = GGUFWriter(dst, arch)      # writes general.architecture itself
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue                    # the header, written by the writer
        value, main, sub = _field_value(field)
        writer.add_key_value(key, overrides.get(key, value), main, sub)

    written: dict[str, str] = {}
    for t in reader.tensors:
        m = re.match(r"^blk\.(\d+)\.", t.name)
        if m is not None and int(m.group(1)) >= keep_layers:
            continue
        # GGUF shapes are innermost first: [K, N] is an [N, K] matrix.
        shape = tuple(int(s) for s in reversed(t.shape))
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        if widening is not None:
            w = widening.apply(t.name, w)
        wanted = type_of(t.name, n_layers) if w.ndim == 2 else None
        if wanted is None:
            if t.tensor_type != GGMLQuantizationType.F32 and widening is None:
                writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
                written[t.name] = t.tensor_type.name
            else:
                writer.add_tensor(t.name, np.ascontiguousarray(w))
                written[t.name] = "F32"
            continue
        type_name = stored_type(wanted, w.shape[1])
        writer.add_tensor(t.name, quantize(w, type_name),
                          raw_dtype=getattr(GGMLQuantizationType, type_name))
        written[t.name] = type_name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written
