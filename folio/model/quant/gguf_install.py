"""Putting a GGUF file's quantized matrices into a DecoderLM as packed modules (CPU).

Two phases around `to_empty`, which would allocate (and then discard) a float tensor for every
parameter: `shrink_packed_params` runs on the meta model and gives every weight that will be
packed an empty shape, so no float copy of it is ever allocated; `install_packed` runs after
and attaches the packed modules. A merged projection (qkv, gate_up) is packed only when all of
its shards are kept quantized; shards of one kind are stacked into one packed weight in the
module's order (planes: a shard with fewer planes padded with a zero plane; int8: the same
group size), shards of different kinds (a Q4_K q with a Q6_K v) become a PackedConcat.
Everything else (norms, biases, tensors of other GGUF types) stays float and is loaded by
`DecoderLM.load_weights`.
"""
from __future__ import annotations

from typing import Union

import numpy as np
import torch
from torch import nn

from folio.model.decoder import DecoderLM
from folio.model.layers import Linear, MergedLinear
from folio.model.quant.gguf_int8 import Int8Rows
from folio.model.quant.gguf_planes import GROUP, Plane, PlaneSum
from folio.model.quant.int4_packed import PackedInt4Weight
from folio.model.quant.int8_packed import PackedInt8Weight
from folio.model.quant.packed import PackedConcat, PackedWeight

_EMBED = "embed_tokens"
Quantized = Union[PlaneSum, Int8Rows]


class PackedEmbedding(nn.Module):
    """nn.Embedding's face over a packed weight's rows, returning the model's dtype (a tied
    model's lm_head multiplies by the same packed weight)."""

    def __init__(self, packed: PackedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.packed = packed
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.packed.lookup(ids).to(self.dtype)


def _zero_plane(n: int, k: int) -> Plane:
    groups = k // GROUP
    return Plane(np.full((n, k), 8, np.uint8), np.zeros((n, groups), np.float32),
                 np.zeros((n, groups), np.float32))


def _stack_planes(shards: list[PlaneSum]) -> PlaneSum:
    depth = max(len(s.planes) for s in shards)
    out = []
    for level in range(depth):
        parts = [s.planes[level] if level < len(s.planes) else _zero_plane(*s.shape)
                 for s in shards]
        out.append(Plane(np.concatenate([q.codes for q in parts]),
                         np.concatenate([q.scale for q in parts]),
                         np.concatenate([q.zero for q in parts])))
    return PlaneSum(out)


def _same_form(a: Quantized, b: Quantized) -> bool:
    """Two shards one packed weight can hold: both planes, or int8 of one group size."""
    if isinstance(a, PlaneSum) and isinstance(b, PlaneSum):
        return True
    return isinstance(a, Int8Rows) and isinstance(b, Int8Rows) and a.group == b.group


def _stacked(shards: list[Quantized]) -> PackedWeight:
    """One packed weight for shards of one form."""
    if isinstance(shards[0], PlaneSum):
        return PackedInt4Weight(_stack_planes(shards).planes)
    return PackedInt8Weight(Int8Rows(np.concatenate([s.codes for s in shards]),
                                     np.concatenate([s.scale for s in shards])))


def packed_module(shards: list[Quantized]) -> nn.Module:
    """One packed module for a weight made of `shards` (rows, in order): one packed weight
    when all are of one form, else a PackedConcat of the runs of neighbours that are (a Q4_K
    q and k stacked, then a Q6_K v)."""
    runs: list[list[Quantized]] = []
    for shard in shards:
        if runs and _same_form(runs[-1][-1], shard):
            runs[-1].append(shard)
        else:
            runs.append([shard])
    if len(runs) == 1:
        return _stacked(runs[0])
    return PackedConcat([_stacked(run) for run in runs])


def _packable(shards: list[Quantized]) -> bool:
    """The kernels need whole groups along K (32 for planes, 16 for int8)."""
    return all(s.shape[1] % (GROUP if isinstance(s, PlaneSum) else 16) == 0 for s in shards)


def plan_packed(model: DecoderLM, quantized: dict[str, Quantized], gpu: bool = False
                ) -> tuple[dict[str, list[Quantized]], set[str]]:
    """(module path -> its shards in the module's order, the checkpoint names they consume).
    Module path `embed_tokens` is the embedding; a tied model's lm_head is packed from the
    same weight. `gpu`: only what the GPU kernels take (gguf_gpu.py): the decoder layers'
    projections, as int8 codes or single 4-bit planes (not Q5's two)."""
    by_module: dict[str, dict[str | None, Quantized]] = {}
    names: dict[str, list[str]] = {}
    for name, matrix in quantized.items():
        target = model.weight_target(name)
        if target is None or target[2] != "weight":
            continue
        path, shard, _ = target
        by_module.setdefault(path, {})[shard] = matrix
        names.setdefault(path, []).append(name)
    plan: dict[str, list[Quantized]] = {}
    consumed: set[str] = set()
    for path, shards in by_module.items():
        if gpu and (path in (_EMBED, "lm_head") or any(
                isinstance(q, PlaneSum) and len(q.planes) != 1 for q in shards.values())):
            continue
        if path in (_EMBED, "lm_head"):
            ordered = [shards[None]]
        else:
            module = model.get_submodule(path)
            if not isinstance(module, Linear):
                continue
            if isinstance(module, MergedLinear):
                if set(shards) != set(module.shard_offsets):
                    continue  # a shard of another GGUF type: keep the module float
                ordered = [shards[s] for s in module.shard_offsets]
            else:
                ordered = [shards[None]]
        if not _packable(ordered):
            continue
        plan[path] = ordered
        consumed.update(names[path])
    return plan, consumed


def shrink_packed_params(model: DecoderLM, plan: dict[str, list[Quantized]]) -> None:
    """On the meta model: the weights that will be packed take no memory."""
    for path in plan:
        module = model.get_submodule(path)
        module.weight = nn.Parameter(torch.empty(0, device="meta", dtype=module.weight.dtype),
                                     requires_grad=False)


def install_packed(model: DecoderLM, plan: dict[str, list[Quantized]],
                   dtype: torch.dtype) -> None:
    """After to_empty: attach the packed modules."""
    for path, shards in plan.items():
        packed = packed_module(shards)
        if path == _EMBED:
            model.embed_tokens = PackedEmbedding(packed, dtype)
            if model.lm_head is None:
                model.lm_head_packed = packed
        elif path == "lm_head":
            model.lm_head_packed = packed
        else:
            model.get_submodule(path).packed = packed
