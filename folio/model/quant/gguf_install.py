"""Putting a GGUF file's plane-typed weights into a DecoderLM as packed modules (CPU).

Two phases around `to_empty`, which would allocate (and then discard) a float tensor for every
parameter: `shrink_packed_params` runs on the meta model and gives every weight that will be
packed an empty shape, so no float copy of it is ever allocated; `install_packed` runs after
and attaches the packed modules. A merged projection (qkv, gate_up) is packed only when all of
its shards have planes; its shards are stacked in the module's order, a shard with fewer
planes padded with a zero plane. Everything else (norms, biases, tensors of other GGUF types)
stays float and is loaded by `DecoderLM.load_weights`.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from folio.model.decoder import DecoderLM
from folio.model.layers import Linear, MergedLinear
from folio.model.quant.gguf_planes import GROUP, Plane
from folio.model.quant.int4_packed import PackedInt4Weight

_EMBED = "embed_tokens"


class PackedEmbedding(nn.Module):
    """nn.Embedding's face over a packed weight's rows, returning the model's dtype (a tied
    model's lm_head multiplies by the same packed weight)."""

    def __init__(self, packed: PackedInt4Weight, dtype: torch.dtype) -> None:
        super().__init__()
        self.packed = packed
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.packed.lookup(ids).to(self.dtype)


def _zero_plane(n: int, k: int) -> Plane:
    groups = k // GROUP
    return Plane(np.full((n, k), 8, np.uint8), np.zeros((n, groups), np.float32),
                 np.zeros((n, groups), np.float32))


def _stack(shards: list[list[Plane]]) -> list[Plane]:
    depth = max(len(p) for p in shards)
    out = []
    for level in range(depth):
        parts = [p[level] if level < len(p) else _zero_plane(*p[0].codes.shape) for p in shards]
        out.append(Plane(np.concatenate([q.codes for q in parts]),
                         np.concatenate([q.scale for q in parts]),
                         np.concatenate([q.zero for q in parts])))
    return out


def plan_packed(model: DecoderLM, planes: dict[str, list[Plane]]
                ) -> tuple[dict[str, list[Plane]], set[str]]:
    """(module path -> its stacked planes, the checkpoint names they consume). Module path
    `embed_tokens` is the embedding; a tied model's lm_head is packed from the same planes."""
    by_module: dict[str, dict[str | None, list[Plane]]] = {}
    names: dict[str, list[str]] = {}
    for name, p in planes.items():
        target = model.weight_target(name)
        if target is None or target[2] != "weight":
            continue
        path, shard, _ = target
        by_module.setdefault(path, {})[shard] = p
        names.setdefault(path, []).append(name)
    plan: dict[str, list[Plane]] = {}
    consumed: set[str] = set()
    for path, shards in by_module.items():
        if path == _EMBED or path == "lm_head":
            if any(p[0].codes.shape[1] % GROUP for p in shards.values()):
                continue
            plan[path] = shards[None]
        else:
            module = model.get_submodule(path)
            if not isinstance(module, Linear) or module.in_features % GROUP:
                continue
            if isinstance(module, MergedLinear):
                if set(shards) != set(module.shard_offsets):
                    continue  # a shard of another GGUF type: keep the module float
                plan[path] = _stack([shards[s] for s in module.shard_offsets])
            else:
                plan[path] = shards[None]
        consumed.update(names[path])
    return plan, consumed


def shrink_packed_params(model: DecoderLM, plan: dict[str, list[Plane]]) -> None:
    """On the meta model: the weights that will be packed take no memory."""
    for path in plan:
        module = model.get_submodule(path)
        module.weight = nn.Parameter(torch.empty(0, device="meta", dtype=module.weight.dtype),
                                     requires_grad=False)


def install_packed(model: DecoderLM, plan: dict[str, list[Plane]], dtype: torch.dtype) -> None:
    """After to_empty: attach the packed modules."""
    for path, planes in plan.items():
        if path == _EMBED:
            packed = PackedInt4Weight(planes)
            model.embed_tokens = PackedEmbedding(packed, dtype)
            if model.lm_head is None:
                model.lm_head_packed = packed
        elif path == "lm_head":
            model.lm_head_packed = PackedInt4Weight(planes)
        else:
            model.get_submodule(path).packed = PackedInt4Weight(planes)
