"""`--quantization int8`: a float checkpoint's projections quantized on load to int8 (CPU).

Any checkpoint folio loads (a Hugging Face directory, or a GGUF file's dequantized weights):
every folio `Linear` of the decoder layers (the merged qkv and gate_up included) and the output
matrix become `PackedInt8Weight`s of `quantize_per_channel` (symmetric, one float32 scale per
output row). Per-channel rows are independent, so each checkpoint tensor (a q, k or v shard
too) is quantized as it streams in and dropped; a merged module's shards are stacked in the
module's order once all are in. As on the GGUF path, the weights to be quantized get an empty
shape on the meta model before `to_empty` (`gguf_install.shrink_packed_params`), so no float
copy of them is ever held beyond the one checkpoint tensor being quantized. Norms, biases and
matrices whose K is not a multiple of 16 (the kernel's unit) stay float.

The output matrix of a tied model is the embedding: it is quantized once, the embedding reads
its rows back through `PackedEmbedding` (as a tied GGUF model's does) and the lm_head
multiplies by the same codes: a quarter of the float32 bytes instead of a float embedding plus
an int8 copy (1.25x). On the default model (tests/model/test_int8_quant.py, perplexity of an
English text against the float path) the projections alone cost +1.16 %, the int8 embedding
rows +0.07 % more.

`load_int8` runs the phases: plan and shrink on the meta model, `to_empty`, the load with the
planned tensors taken out of the stream, then the packed modules attached.
"""
from __future__ import annotations

import ctypes
from typing import Iterable, Iterator

import torch
from torch import nn

from folio.model.decoder import DecoderLM
from folio.model.layers import Linear, MergedLinear
from folio.model.quant.gguf_install import (PackedEmbedding, packed_module,
                                           shrink_packed_params)
from folio.model.quant.gguf_int8 import Int8Rows
from folio.model.quant.int8_packed import quantize_per_channel

_EMBED = "embed_tokens"
# The int8 kernel reads K in multiples of 16; a matrix with another K stays float.
_K_MULTIPLE = 16


def plan_int8(model: DecoderLM) -> list[str]:
    """The module paths whose weights are quantized: the decoder layers' Linears, and the
    lm_head, or the embedding when the lm_head is tied to it."""
    plan = [f"layers.{name}" for name, m in model.layers.named_modules()
            if isinstance(m, Linear) and m.in_features % _K_MULTIPLE == 0]
    if model.lm_head is not None:
        if model.lm_head.in_features % _K_MULTIPLE == 0:
            plan.append("lm_head")
    elif model.embed_tokens.embedding_dim % _K_MULTIPLE == 0:
        plan.append(_EMBED)
    return plan


class Int8Quantizer:
    """Takes the planned weights out of a checkpoint's tensor stream, quantized, and installs
    them once the stream is consumed (after `DecoderLM.load_weights` has checked that nothing
    is missing)."""

    def __init__(self, model: DecoderLM, plan: Iterable[str]) -> None:
        self.model = model
        self.shards: dict[str, dict[str | None, Int8Rows]] = {path: {} for path in plan}
        self.consumed: set[str] = set()   # checkpoint names, for load_weights' `preloaded`

    def _expected_shape(self, path: str, shard: str | None) -> tuple[int, int]:
        module = self.model.get_submodule(path)
        if path == _EMBED:
            return module.num_embeddings, module.embedding_dim
        rows = module.shard_offsets[shard][1] if shard is not None else module.out_features
        return rows, module.in_features

    def take(self, weights: Iterable[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, torch.Tensor]]:
        """`weights` less the planned ones, which are quantized and kept."""
        for name, tensor in weights:
            target = self.model.weight_target(name)
            if target is None or target[2] != "weight" or target[0] not in self.shards:
                yield name, tensor
                continue
            path, shard, _ = target
            module = self.model.get_submodule(path)
            if (shard is None) == isinstance(module, MergedLinear):
                yield name, tensor  # not this module's layout: load_weights reports it
                continue
            expected = self._expected_shape(path, shard)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected "
                                 f"{expected}")
            self.shards[path][shard] = quantize_per_channel(tensor)
            self.consumed.add(name)

    def install(self, dtype: torch.dtype) -> None:
        """Attach the packed modules; `dtype`: what the embedding's rows come back in."""
        model = self.model
        for path, shards in self.shards.items():
            module = model.get_submodule(path)
            order = list(module.shard_offsets) if isinstance(module, MergedLinear) else [None]
            packed = packed_module([shards[s] for s in order])
            if path == _EMBED:
                model.embed_tokens = PackedEmbedding(packed, dtype)
                model.lm_head_packed = packed
            elif path == "lm_head":
                model.lm_head_packed = packed
            else:
                module.packed = packed
        self.shards.clear()


def quantize_linears(module: nn.Module) -> int:
    """Every folio `Linear` of a module already loaded in float (K a multiple of 16, not yet
    packed, no LoRA) quantized per output channel in place, its float weight freed; returns
    how many. For small modules beside a quantized CPU target: an EAGLE head's float32
    projections, read every step, cost 4x a 4-bit target layer on the CPU."""
    count = 0
    for m in module.modules():
        if (isinstance(m, Linear) and m.packed is None and m.lora is None
                and m.weight.numel() and m.in_features % _K_MULTIPLE == 0):
            m.packed = packed_module([quantize_per_channel(m.weight)])
            m.weight = nn.Parameter(torch.empty(0, dtype=m.weight.dtype), requires_grad=False)
            count += 1
    return count


def check_device(device: torch.device) -> None:
    if device.type != "cpu":
        raise ValueError("quantization 'int8' runs on the CPU only so far; use "
                         "quantization 'none' on CUDA")


def load_int8(model: DecoderLM, weights: Iterable[tuple[str, torch.Tensor]],
              dtype: torch.dtype, device: torch.device) -> DecoderLM:
    """The meta-device `model` materialised on `device` (the CPU) in `dtype`, `weights` loaded,
    its projections and output matrix int8."""
    check_device(device)
    plan = plan_int8(model)
    shrink_packed_params(model, plan)
    model = model.to(dtype=dtype).to_empty(device=device)
    quantizer = Int8Quantizer(model, plan)
    model.load_weights(quantizer.take(weights), preloaded=quantizer.consumed)
    quantizer.install(dtype)
    _return_freed_memory()
    return model


def _return_freed_memory() -> None:
    """Hand the checkpoint tensors' freed pages back to the OS. glibc keeps the freed chunks
    of its heap, interleaved with the int8 codes allocated between them: without this the
    default model's process held 423 MiB more after loading instead of 218 MiB (its int8
    weights are 129 MiB). A no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
