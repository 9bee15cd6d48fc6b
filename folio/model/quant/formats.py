"""Quantized checkpoint tensors, as each format stores them, turned into folio's two layouts.

- `EightBitWeight`: codes [N, K] (float8 e4m3 or int8) in nn.Linear's row order and one float32
  scale per output row (a per-tensor scale is repeated over the rows, so one kernel serves
  both), plus the static activation scale when the checkpoint has one.
- `Int4Weight`: 4-bit codes packed eight to an int32 along K — element k of row n at bits
  4*(k % 8) of word [n, k // 8], unsigned 0..15, the order compressed-tensors writes — with a
  scale and a zero point per group of G input channels: w = (q - z) * s. Symmetric formats
  have z = 8 and store no zeros. Act-order files (GPTQ's desc_act, compressed-tensors'
  actorder "group"), whose groups are scattered over K by `g_idx` (`weight_g_idx`), are
  stored with K permuted so that each group is contiguous; the layer then permutes its input
  by `perm` (one gather per call) and the kernel sees plain groups.

AWQ, GPTQ and compressed-tensors' pack-quantized files thus share one layout and one kernel
(kernels/int4_matmul.py). Everything here is torch on whatever device the tensors are on (the
loader moves them to the target device first: unpacking 8B weights is quick on a GPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from folio.model.quant.scheme import (LAYOUT_AWQ, LAYOUT_CT_FLOAT, LAYOUT_CT_INT,
                                      LAYOUT_CT_PACK, LAYOUT_FP8, LAYOUT_GPTQ, LinearScheme)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)   # 448
INT8_MAX = 127.0

# AutoAWQ's GEMM layout interleaves the eight output columns of each int32: nibble slot i
# holds column AWQ_ORDER[i] of the block of eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass
class EightBitWeight:
    codes: torch.Tensor                 # [N, K] float8_e4m3fn or int8
    scale: torch.Tensor                 # [N] float32
    input_scale: torch.Tensor | None = None  # [] float32: static activation scale

    def dequantize(self) -> torch.Tensor:
        return self.codes.to(torch.float32) * self.scale[:, None]


@dataclass
class Int4Weight:
    packed: torch.Tensor                # [N, K // 8] int32
    scales: torch.Tensor                # [N, K // G], the checkpoint's float dtype
    zeros: torch.Tensor | None          # [N, K // G], same dtype; None: 8 (symmetric)
    group_size: int
    perm: torch.Tensor | None = None    # [K] int64: the layer multiplies x[:, perm]
    # GGUF's 4-bit types instead: W = q * s + mins (float32 [N, K // G]), zeros None
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 8

    def codes(self) -> torch.Tensor:
        """[N, K] uint8, 0..15, in the stored (permuted) K order."""
        return unpack_rows(self.packed)

    def dequantize(self) -> torch.Tensor:
        """W [N, K] in float32, in the checkpoint's K order (the permutation undone)."""
        q = self.codes().to(torch.float32)
        s = self.scales.to(torch.float32).repeat_interleave(self.group_size, dim=1)
        if self.mins is not None:
            w = q * s + self.mins.to(torch.float32).repeat_interleave(self.group_size, dim=1)
        else:
            z = 8.0 if self.zeros is None else \
                self.zeros.to(torch.float32).repeat_interleave(self.group_size, dim=1)
            w = (q - z) * s
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w


@dataclass
class GroupInt8Weight:
    """int8 codes with a float32 scale per group of G along K: GGUF's Q8_0 (G = 32) and Q6_K
    (G = 16, its sub-block scales folded in), W = q * s."""
    codes: torch.Tensor                 # [N, K] int8
    scales: torch.Tensor                # [N, K // G] float32
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        s = self.scales.to(torch.float32).repeat_interleave(self.group_size, dim=1)
        return self.codes.to(torch.float32) * s


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 -> [R, 8C] uint8: nibble i of word c is column 8c + i."""
    shifts = _SHIFTS.to(packed.device)
    q = (packed[:, :, None] >> shifts) & 0xF
    return q.reshape(packed.shape[0], -1).to(torch.uint8)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """[R, 8C] values 0..15 -> [R, C] int32, the inverse of unpack_rows."""
    r, k = codes.shape
    if k % 8:
        raise ValueError(f"{k} columns do not pack eight to an int32")
    q = codes.to(torch.int32).reshape(r, k // 8, 8) << _SHIFTS.to(codes.device)
    return q.sum(dim=2, dtype=torch.int32)   # disjoint bits: the sum is the OR


# ---- 8-bit weights --------------------------------------------------------------------------

def _row_scale(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A weight scale of shape [], [1], [N] or [N, 1] -> [N] float32."""
    s = scale.to(torch.float32).reshape(-1)
    if s.numel() == 1:
        return s.expand(rows).contiguous()
    if s.numel() != rows:
        raise ValueError(f"{name} has {s.numel()} values, expected 1 or {rows} (one per "
                         "output channel)")
    return s.contiguous()


def eight_bit_from_checkpoint(t: dict[str, torch.Tensor], scheme: LinearScheme, name: str,
                              shape: tuple[int, int]) -> EightBitWeight:
    """compressed-tensors float-/int-quantized and fp8 files: `weight` (codes), `weight_scale`,
    optionally `input_scale` (static activations)."""
    weight = t["weight"]
    want = FP8_DTYPE if scheme.weight == "fp8" else torch.int8
    if weight.dtype != want:
        raise ValueError(f"{name}.weight is {weight.dtype}, expected {want} "
                         f"({scheme.weight} weights)")
    if tuple(weight.shape) != shape:
        raise ValueError(f"{name}.weight has shape {tuple(weight.shape)}, expected {shape}")
    scale = _checked_scales(_row_scale(t["weight_scale"], shape[0], f"{name}.weight_scale"),
                            f"{name}.weight_scale")
    input_scale = None
    if not scheme.act_dynamic:
        if "input_scale" not in t:
            raise ValueError(f"{name}.input_scale is missing (static activation scales)")
        stored = t["input_scale"]
        if stored.numel() != 1:
            raise ValueError(f"{name}.input_scale has shape {tuple(stored.shape)}, expected "
                             "one value (a static per-tensor activation scale)")
        input_scale = _checked_scales(stored.to(torch.float32).reshape(()),
                                      f"{name}.input_scale", positive=True)
    return EightBitWeight(weight.contiguous(), scale, input_scale)


def _checked_scales(scales: torch.Tensor, name: str, positive: bool = False) -> torch.Tensor:
    """Scales as stored, refused when one is not finite or is negative (or, `positive`, zero):
    a NaN scale would make every logit NaN, and the tokens garbage, without an error."""
    finite = torch.isfinite(scales)
    bad = ~finite | ((scales <= 0) if positive else (scales < 0))
    if bool(bad.any()):
        value = float(scales.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]])
        raise ValueError(f"{name} holds {value} (scales must be finite and "
                         f"{'positive' if positive else 'not negative'})")
    return scales


def concat_eight_bit(parts: list[EightBitWeight]) -> EightBitWeight:
    """Shards of a merged projection stacked along N. Static activation scales differ per
    shard but the shards share their input: the largest serves all (no value clips)."""
    statics = [p.input_scale for p in parts if p.input_scale is not None]
    return EightBitWeight(torch.cat([p.codes for p in parts]),
                          torch.cat([p.scale for p in parts]),
                          torch.stack(statics).amax() if statics else None)


# ---- 4-bit weights --------------------------------------------------------------------------

def _check_int4_shape(name: str, shape: tuple[int, int], group: int, layout: str) -> None:
    n, k = shape
    if k % 8:
        raise ValueError(f"{name}: in_features {k} must be a multiple of 8")
    if k % group and (layout != LAYOUT_GPTQ or group % 8):
        raise ValueError(f"{name}: in_features {k} must be a multiple of the group size "
                         f"{group} (only GPTQ files end a row in a shorter group)")


def int4_from_checkpoint(t: dict[str, torch.Tensor], scheme: LinearScheme, name: str,
                         shape: tuple[int, int]) -> Int4Weight:
    readers = {LAYOUT_CT_PACK: _from_ct_pack, LAYOUT_AWQ: _from_awq, LAYOUT_GPTQ: _from_gptq}
    group = scheme.group_size or shape[1]
    _check_int4_shape(name, shape, group, scheme.layout)
    weight = readers[scheme.layout](t, scheme, name, shape, group)
    _checked_scales(weight.scales, f"{name} scales")
    return _regroup(weight, shape[1]) if shape[1] % group else weight


def _regroup(weight: Int4Weight, k: int) -> Int4Weight:
    """A GPTQ weight whose K is not a multiple of its group size G (AutoGPTQ and GPTQModel
    write ceil(K / G) groups, the last one shorter: SmolLM2's K = 576 at G = 128) as the same
    weight in groups of gcd(K, G), each G-group's scale and zero point repeated over the
    smaller groups it spans. The kernels then see whole groups (every gcd here is a multiple
    of 8, since K and G are); the bytes of scales read grow by G / gcd."""
    g = math.gcd(k, weight.group_size)
    repeat = weight.group_size // g

    def spread(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return t.repeat_interleave(repeat, dim=1)[:, :k // g].contiguous()

    return Int4Weight(weight.packed, spread(weight.scales), spread(weight.zeros), g,
                      weight.perm)


def _expect(t: dict[str, torch.Tensor], key: str, name: str, shape: tuple[int, ...],
            dtype: torch.dtype | None = None) -> torch.Tensor:
    tensor = t[key]
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name}.{key} has shape {tuple(tensor.shape)}, expected "
                         f"{tuple(shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{name}.{key} is {tensor.dtype}, expected {dtype}")
    return tensor


def _from_ct_pack(t, scheme, name, shape, group) -> Int4Weight:
    """weight_packed [N, K/8] int32 (signed codes + 8, our order already), weight_scale
    [N, K/G], weight_zero_point packed along N ([N/8, K/G] int32, zero + 8) when asymmetric."""
    n, k = shape
    if "weight_shape" in t:
        stored = tuple(int(v) for v in t["weight_shape"].reshape(-1).tolist())
        if stored != shape:
            raise ValueError(f"{name}.weight_shape is {stored}, expected {shape}")
    packed = _expect(t, "weight_packed", name, (n, k // 8), torch.int32)
    scales = _expect(t, "weight_scale", name, (n, k // group))
    zeros = None
    if not scheme.symmetric:
        zp = t["weight_zero_point"]
        if zp.dtype == torch.int32 and tuple(zp.shape) == (-(-n // 8), k // group):
            # unsigned (zero + 8) codes: exactly the z of w = (q_unsigned - z) * s
            zeros = unpack_rows(zp.t().contiguous())[:, :n].t()
        elif tuple(zp.shape) == (n, k // group):
            zeros = zp.to(torch.int32) + 8   # older files: signed zero points, unpacked
        else:
            raise ValueError(f"{name}.weight_zero_point has shape {tuple(zp.shape)}, expected "
                             f"{(-(-n // 8), k // group)} (packed) or {(n, k // group)}")
        zeros = zeros.to(scales.dtype).contiguous()
    perm = act_order_perm(t, "weight_g_idx", name, k, group, scheme.desc_act)
    if perm is not None:
        packed = pack_rows(unpack_rows(packed)[:, perm])
    return Int4Weight(packed.contiguous(), scales.contiguous(), zeros, group, perm)


def act_order_perm(t: dict[str, torch.Tensor], key: str, name: str, k: int, group: int,
               required: bool) -> torch.Tensor | None:
    """The input-channel permutation that makes each group of an act-order weight contiguous,
    from its `key` tensor ([K]: each input channel's group; GPTQ's g_idx, compressed-tensors'
    weight_g_idx), or None where there is none or it is the plain order."""
    g_idx = t.get(key)
    if g_idx is None:
        if required:
            raise ValueError(f"{name}.{key} is missing (the config's act-order needs it)")
        return None
    g_idx = _expect(t, key, name, (k,)).to(torch.int64)
    plain = torch.arange(k, device=g_idx.device) // group
    if torch.equal(g_idx, plain):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], plain):
        raise ValueError(f"{name}.{key} does not give every group {group} input channels")
    return perm


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 in AutoAWQ's interleaved order -> [R, 8C] codes in column order."""
    q = unpack_rows(packed).reshape(packed.shape[0], -1, 8)
    inverse = [AWQ_ORDER.index(c) for c in range(8)]
    return q[:, :, inverse].reshape(packed.shape[0], -1)


def _from_awq(t, scheme, name, shape, group) -> Int4Weight:
    """qweight [K, N/8], qzeros [K/G, N/8] (both packed along N, interleaved), scales
    [K/G, N]: w[k, n] = (q - z) * s, stored K-major."""
    n, k = shape
    if n % 8:
        raise ValueError(f"{name}: out_features {n} must be a multiple of 8 (AWQ packs N)")
    qweight = _expect(t, "qweight", name, (k, n // 8), torch.int32)
    qzeros = _expect(t, "qzeros", name, (k // group, n // 8), torch.int32)
    scales = _expect(t, "scales", name, (k // group, n))
    codes = _unpack_awq(qweight).t().contiguous()          # [N, K]
    zeros = _unpack_awq(qzeros).t().to(scales.dtype).contiguous()
    return Int4Weight(pack_rows(codes), scales.t().contiguous(), zeros, group)


def _from_gptq(t, scheme, name, shape, group) -> Int4Weight:
    """qweight [K/8, N] packed along K, qzeros [K/G, N/8] packed along N (v1 files store
    zero - 1), scales [K/G, N], g_idx [K] (input channel -> group)."""
    n, k = shape
    if n % 8:
        raise ValueError(f"{name}: out_features {n} must be a multiple of 8 (GPTQ packs the "
                         "zeros along N)")
    groups = -(-k // group)   # a last, shorter group where G does not divide K
    qweight = _expect(t, "qweight", name, (k // 8, n), torch.int32)
    qzeros = _expect(t, "qzeros", name, (groups, n // 8), torch.int32)
    scales = _expect(t, "scales", name, (groups, n))
    codes = unpack_rows(qweight.t().contiguous())           # [N, K]
    zeros = (unpack_rows(qzeros).to(torch.int32) + scheme.zero_offset).t()
    zeros = zeros.to(scales.dtype).contiguous()
    if scheme.symmetric and scheme.zero_offset and bool((zeros == 8).all()):
        zeros = None   # the usual symmetric file: z = 8 everywhere, nothing to read
    perm = act_order_perm(t, "g_idx", name, k, group, scheme.desc_act)
    if perm is not None:
        codes = codes[:, perm].contiguous()
    return Int4Weight(pack_rows(codes), scales.t().contiguous(), zeros, group, perm)


def concat_int4(parts: list[Int4Weight]) -> Int4Weight | None:
    """Shards stacked along N, or None when they cannot share one weight (different groups
    or act-order permutations: then each multiplies on its own)."""
    first = parts[0]
    for p in parts[1:]:
        if p.group_size != first.group_size or (p.perm is None) != (first.perm is None) \
                or (p.perm is not None and not torch.equal(p.perm, first.perm)) \
                or p.scales.dtype != first.scales.dtype \
                or (p.mins is None) != (first.mins is None):
            return None
    if first.mins is not None:
        return Int4Weight(torch.cat([p.packed for p in parts]),
                          torch.cat([p.scales for p in parts]), None, first.group_size,
                          first.perm, torch.cat([p.mins for p in parts]))
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([p.zeros if p.zeros is not None else
                           torch.full_like(p.scales, 8) for p in parts])
    else:
        zeros = None
    return Int4Weight(torch.cat([p.packed for p in parts]),
                      torch.cat([p.scales for p in parts]), zeros, first.group_size,
                      first.perm)


# ---- which tensors each layout has -----------------------------------------------------------

# Every name (after "<module>.") a layout below stores beside or instead of a float `weight`:
# the decoder's load error calls such tensors quantized ones when the config reads the
# projection as float.
QUANTIZED_TENSOR_NAMES = frozenset({
    "weight_scale", "weight_packed", "weight_zero_point", "weight_g_idx", "weight_shape",
    "input_scale", "qweight", "qzeros", "scales", "g_idx"})


def required_tensors(scheme: LinearScheme) -> tuple[str, ...]:
    """The tensor names (after `<module>.`) a projection of this layout must have."""
    if scheme.layout in (LAYOUT_CT_FLOAT, LAYOUT_CT_INT, LAYOUT_FP8):
        return ("weight", "weight_scale") + (() if scheme.act_dynamic else ("input_scale",))
    if scheme.layout == LAYOUT_CT_PACK:
        return ("weight_packed", "weight_scale") + \
            (() if scheme.symmetric else ("weight_zero_point",)) + \
            (("weight_g_idx",) if scheme.desc_act else ())
    if scheme.layout == LAYOUT_AWQ:
        return ("qweight", "qzeros", "scales")
    if scheme.layout == LAYOUT_GPTQ:
        return ("qweight", "qzeros", "scales") + (("g_idx",) if scheme.desc_act else ())
    return ("weight",)


def optional_tensors(scheme: LinearScheme) -> tuple[str, ...]:
    """Tensor names a projection may carry that the loader takes (or drops) with it."""
    if scheme.layout == LAYOUT_CT_PACK:
        return ("weight_shape", "weight_g_idx")
    if scheme.layout == LAYOUT_GPTQ:
        return ("g_idx",)
    if scheme.layout in (LAYOUT_CT_FLOAT, LAYOUT_CT_INT, LAYOUT_FP8):
        return ("input_scale",)
    return ()


# ---- quantizing a float weight (--quantization fp8) ------------------------------------------

def quantize_fp8_per_channel(weight: torch.Tensor) -> EightBitWeight:
    """FP8 e4m3 codes with scale = max|w_row| / 448 per output row (an all-zero row gets 1)."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return EightBitWeight(codes, scale)
