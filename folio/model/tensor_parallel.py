"""Tensor parallelism (`--tensor-parallel-size N`): each rank holds a slice of every layer.

The model is built from the rank's *local* spec (`local_spec`: 1/N of the query heads, of the
KV heads — or one replicated KV head when there are fewer KV heads than ranks — and of the
MLP's width), so attention, the KV cache and the kernels run unchanged on the rank's share.
What differs from one device:
  * column-parallel projections (the fused qkv and gate_up) keep their rows of each
    checkpoint part: whole heads of q, k and v, and the same slice of gate and up;
  * row-parallel projections (o_proj, down_proj) keep the matching input columns, and their
    partial outputs are summed over the ranks (one all-reduce after attention, one after the
    MLP); a bias is added by rank 0 only;
  * the embedding and the output matrix are split by vocabulary rows: a rank looks up only
    its ids (the rest read zeros) and the lookups are summed; each rank's logits are
    gathered into the whole vocabulary, so every rank samples the same token with the same
    seed (each rank's worker seeds torch alike).
Weights are read sharded: the checkpoint's tensors come as lazy slices (safetensors), and each
rank reads only its rows or columns (`read_part`).

The collectives are torch.distributed's (gloo on the CPU, NCCL on GPUs), in the group the
worker process joined.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from folio.model.families import ArchSpec


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group; size 1 = no parallelism."""
    rank: int = 0
    size: int = 1
    group: Any = None   # a torch.distributed ProcessGroup (None: the default one)
    # --enable-expert-parallel: a mixture of experts spreads its experts over the ranks
    expert_parallel: bool = False
    # A group of one rank that still runs the collectives and the sharded layers
    # (ParallelConfig.distributed_single_rank: the multi-rank code path on one device).
    single_rank_collectives: bool = False

    @property
    def sharded(self) -> bool:
        """Whether the model is built and run as tensor-parallel ranks (sharded loading,
        vocabulary-parallel embedding and logits, all-reduces)."""
        return self.size > 1 or self.single_rank_collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.sharded:
            import torch.distributed as dist
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension, in rank order."""
        if not self.sharded:
            return x
        import torch.distributed as dist
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()


def check_tp_support(spec: ArchSpec, size: int, expert_parallel: bool = False) -> None:
    """ValueError naming what keeps this model from `size` ranks."""
    if size == 1:
        return
    what = None
    if spec.moe is not None and not expert_parallel:
        what = ("mixture-of-experts models without --enable-expert-parallel (their experts "
                "are spread over the ranks, not split)")
    elif spec.moe is not None and spec.moe.num_experts % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's "
                         f"{spec.moe.num_experts} experts (expert parallelism)")
    elif spec.mla is not None:
        what = "latent-attention (DeepSeek) models"
    elif spec.is_encoder:
        what = "encoder (pooling) models"
    if what is not None:
        raise ValueError(f"tensor_parallel_size={size}: not supported for {what}")
    for name, value in (("num_attention_heads", spec.num_heads),
                        ("intermediate_size", spec.intermediate_size)):
        if value % size:
            raise ValueError(f"tensor_parallel_size={size} must divide the model's {name} "
                             f"({value})")
    kv = spec.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size={size} and the model's {kv} KV heads: one "
                         "must divide the other (heads are split, or replicated)")


def local_spec(spec: ArchSpec, size: int) -> ArchSpec:
    """The layer shapes one of `size` ranks holds (check_tp_support first)."""
    if size == 1:
        return spec
    return replace(spec, num_heads=spec.num_heads // size,
                   num_kv_heads=max(1, spec.num_kv_heads // size),
                   intermediate_size=spec.intermediate_size // size)


@dataclass(frozen=True)
class Part:
    """The slice of a checkpoint dimension a rank keeps: `size` of `full`, from `start`."""
    full: int
    start: int
    size: int


def head_parts(spec: ArchSpec, tp: TPGroup) -> dict[str, Part]:
    """The q, k and v rows (whole heads) rank `tp.rank` keeps of the fused qkv projection.
    With fewer KV heads than ranks, ranks share a head: rank r keeps head r * kv // size."""
    hd, h, kv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    hl = h // tp.size
    kvl = max(1, kv // tp.size)
    kv_start = (tp.rank * kv // tp.size) if kv < tp.size else tp.rank * kvl
    return {"q": Part(h * hd, tp.rank * hl * hd, hl * hd),
            "k": Part(kv * hd, kv_start * hd, kvl * hd),
            "v": Part(kv * hd, kv_start * hd, kvl * hd)}


def even_part(full: int, tp: TPGroup) -> Part:
    size = full // tp.size
    return Part(full, tp.rank * size, size)


def vocab_part(vocab: int, tp: TPGroup) -> Part:
    """A rank's rows of the vocabulary: ceil(vocab / size) each, the last rank's padded."""
    size = -(-vocab // tp.size)
    return Part(vocab, tp.rank * size, size)


class VocabParallelEmbedding(nn.Module):
    """The embedding's rows [part.start, part.start + part.size) on this rank (padding rows
    past the vocabulary stay zero); ids of other ranks read zeros, and the ranks' lookups
    are summed."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.part = vocab_part(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.part.size, hidden_size),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.part.start
        outside = (local < 0) | (local >= self.part.size)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


def read_part(source: Any, dim: int, part: Part | None) -> torch.Tensor:
    """A checkpoint tensor, or its slice along `dim` (None: all of it). `source` is a tensor
    or a lazy safetensors slice, which then reads only the slice; rows past the end of the
    checkpoint tensor (a padded vocabulary shard) come back as zeros."""
    shape = list(source.get_shape()) if hasattr(source, "get_shape") else list(source.shape)
    if part is None:
        return source[:] if hasattr(source, "get_shape") else source
    if shape[dim] != part.full:
        raise ValueError(f"checkpoint tensor has {shape[dim]} along dimension {dim}, "
                         f"expected {part.full}")
    end = min(part.start + part.size, part.full)
    index = [slice(None)] * len(shape)
    index[dim] = slice(min(part.start, end), end)
    out = source[tuple(index)]
    if end - part.start < part.size:   # padding rows of the last vocabulary shard
        pad = list(out.shape)
        pad[dim] = part.size - max(0, end - part.start)
        out = torch.cat([out, torch.zeros(pad, dtype=out.dtype)], dim=dim)
    return out


def _plan_experts(block: nn.Module, tp: TPGroup) -> None:
    """Expert parallelism for one MoE block (still on the meta device): this rank keeps
    1/N of the experts, whole; the shared expert, a gated MLP, is split as the dense ones."""
    from folio.model.layers import GatedMLP
    experts = block.experts
    part = even_part(experts.num_experts, tp)
    experts.num_experts, experts.expert_offset = part.size, part.start
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        param = getattr(experts, name)
        if param is not None:
            setattr(experts, name, nn.Parameter(
                torch.empty(part.size, *param.shape[1:], device=param.device),
                requires_grad=False))
    experts.tp_param_parts = {name: part for name in ("gate_up_proj", "down_proj",
                                                      "gate_up_proj_bias", "down_proj_bias")}
    block.tp = tp
    shared = block.shared_expert
    if shared is not None:
        full = shared.down_proj.in_features
        with torch.device(shared.down_proj.weight.device):
            block.shared_expert = GatedMLP(shared.down_proj.out_features, full // tp.size,
                                           False, shared.act_name, shared.kernels)
        block.shared_expert.tp_full_width = full


def plan_shards(model: nn.Module, spec: ArchSpec, tp: TPGroup) -> None:
    """Mark each module with the slices its parameters take from the checkpoint, and the
    row-parallel projections with their all-reduce. `spec` is the full (not local) spec."""
    from folio.model.layers import Attention, GatedMLP
    from folio.model.moe.layer import SparseMoeBlock
    heads = head_parts(spec, tp)
    for module in list(model.modules()):
        if isinstance(module, SparseMoeBlock):
            _plan_experts(module, tp)
    for module in model.modules():
        if isinstance(module, Attention):
            module.qkv_proj.tp_rows = heads
            module.o_proj.tp_cols = heads["q"]
            module.o_proj.tp_reduce = tp
            if module.sinks is not None:
                q = heads["q"]
                module.tp_param_parts = {"sinks": Part(spec.num_heads, q.start // spec.head_dim,
                                                       q.size // spec.head_dim)}
        elif isinstance(module, GatedMLP):
            part = even_part(getattr(module, "tp_full_width", spec.intermediate_size), tp)
            module.gate_up_proj.tp_rows = {"gate": part, "up": part}
            module.down_proj.tp_cols = part
            module.down_proj.tp_reduce = tp


def shard_of_checkpoint(module: nn.Module, attr: str, shard: str | None, source: Any,
                        tp: TPGroup) -> torch.Tensor:
    """The part of checkpoint tensor `source` (for `module`'s parameter `attr`, merged shard
    `shard`) this rank keeps."""
    rows = getattr(module, "tp_rows", None)
    if rows is not None:
        if shard is not None:
            return read_part(source, 0, rows[shard])
        # a checkpoint that stores the parts fused (Phi-3's qkv_proj, gate_up_proj)
        full = read_part(source, 0, None)
        pieces, offset = [], 0
        for part in rows.values():
            piece = full[offset:offset + part.full]
            pieces.append(piece[part.start:part.start + part.size])
            offset += part.full
        if offset != full.shape[0]:
            raise ValueError(f"fused checkpoint tensor has {full.shape[0]} rows, expected "
                             f"{offset}")
        return torch.cat(pieces)
    cols = getattr(module, "tp_cols", None)
    if cols is not None:
        if attr == "bias":   # added once: by rank 0
            bias = read_part(source, 0, None)
            return bias if tp.rank == 0 else torch.zeros_like(bias)
        return read_part(source, 1, cols)
    if isinstance(module, VocabParallelEmbedding) or getattr(module, "tp_vocab", None):
        return read_part(source, 0, vocab_part(module.tp_vocab if not isinstance(
            module, VocabParallelEmbedding) else module.part.full, tp))
    parts = getattr(module, "tp_param_parts", None)
    if parts is not None and shard is not None and "." in shard:
        expert = int(shard.partition(".")[0]) - module.expert_offset
        if not 0 <= expert < module.num_experts:
            return torch.empty(0)   # another rank's expert: not read (load_shard drops it)
    if parts is not None and attr in parts and shard is None:
        # a stacked tensor (all experts' weights, or all heads' sinks): this rank's rows; a
        # per-expert tensor (shard "<expert>.<part>") is kept or dropped by the module
        return read_part(source, 0, parts[attr])
    return read_part(source, 0, None)
