"""A GGUF file's quantized projections kept quantized on the GPU.

The GGUF decoders (gguf_planes.py, gguf_int8.py) give each matrix exactly as 4-bit planes
((q - 8) * s + z per group of 32: Q4_0, Q4_1, Q4_K) or int8 codes with group scales (Q8_0 per
32, Q6_K per 16). Both are forms the group-quantized Triton kernel reads (group_linear.py):
a plane becomes 4-bit codes with a float32 scale and minimum per group, W = q * s + (z - 8 s);
int8 rows stay int8 with their float32 scales. No value is re-quantized, so the GPU model
computes with the file's own weights. Q5's two planes, and the embedding and output matrix,
are dequantized to the model dtype as before (the embedding is a lookup; the output matrix is
read once per step by a bf16 GEMV at full speed).

The float32 scales and minimums cost 2 bits per weight on top of the codes (4-bit) and 1 bit
(8-bit): exactness first; fp16 scales would round Q4_K's d * sc products.
"""
from __future__ import annotations

import torch
from torch import nn

from folio.model.decoder import DecoderLM
from folio.model.quant.formats import GroupInt8Weight, Int4Weight, concat_int4, pack_rows
from folio.model.quant.gguf_int8 import Int8Rows
from folio.model.quant.gguf_planes import GROUP, PlaneSum
from folio.model.quant.group_linear import GroupQuantLinear
from folio.model.quant.packed import PackedConcat

Quantized = PlaneSum | Int8Rows


def _to_gpu_weight(q: Quantized, device: torch.device) -> Int4Weight | GroupInt8Weight:
    if isinstance(q, Int8Rows):
        codes = torch.from_numpy(q.codes).to(device)
        scales = torch.from_numpy(q.scale).to(device=device, dtype=torch.float32)
        return GroupInt8Weight(codes.contiguous(), scales.contiguous(), q.group)
    (plane,) = q.planes
    codes = torch.from_numpy(plane.codes).to(device)
    s = torch.from_numpy(plane.scale).to(device=device, dtype=torch.float32)
    z = torch.from_numpy(plane.zero).to(device=device, dtype=torch.float32)
    return Int4Weight(pack_rows(codes), s.contiguous(), None, GROUP,
                      mins=(z - 8.0 * s).contiguous())


def _module(parts: list[Int4Weight | GroupInt8Weight]) -> nn.Module:
    """One module for shards of one form stacked along N."""
    if isinstance(parts[0], GroupInt8Weight):
        return GroupQuantLinear(GroupInt8Weight(torch.cat([p.codes for p in parts]),
                                                torch.cat([p.scales for p in parts]),
                                                parts[0].group_size))
    merged = concat_int4(parts)
    assert merged is not None   # GGUF planes: one group size, no permutation
    return GroupQuantLinear(merged)


def _same_form(a, b) -> bool:
    if isinstance(a, GroupInt8Weight) and isinstance(b, GroupInt8Weight):
        return a.group_size == b.group_size
    return isinstance(a, Int4Weight) and isinstance(b, Int4Weight)


def install_packed_gpu(model: DecoderLM, plan: dict[str, list[Quantized]],
                       device: torch.device) -> None:
    """After to_empty: attach the GPU modules (a merged projection whose shards have different
    forms, a Q4_K q/k with a Q6_K v, becomes a PackedConcat of its runs)."""
    for path, shards in plan.items():
        weights = [_to_gpu_weight(q, device) for q in shards]
        runs: list[list] = []
        for w in weights:
            if runs and _same_form(runs[-1][-1], w):
                runs[-1].append(w)
            else:
                runs.append([w])
        modules = [_module(run) for run in runs]
        model.get_submodule(path).packed = modules[0] if len(modules) == 1 \
            else PackedConcat(modules)
