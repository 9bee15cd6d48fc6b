"""A Llama-form decoder layer as one call into folio's C++ kernels (CPU, float32, packed
weights).

At batch 1 on a two-core CPU a decode step of the default model took ~20 ms, of which the
kernels took ~11: the rest was Python between them, ten calls per layer through nn.Module and
pybind11 with their checks and views. `CpuLayerRunner` hands a qualifying layer's whole
forward to `DecoderLayerKernel` (cpu_kernels/csrc/decoder_layer.cpp), which calls the same
kernels in the same order on the same inputs: the output is the Python path's bit for bit
(tests/model/test_cpu_layer.py), so the Python path stays the definition.

A layer qualifies when every part of it is what the C++ layer composes: RMSNorms, an
Attention over CpuPagedAttention without per-head norms, neox rotary, a SiLU-gated MLP, and
four projections kept packed (4-bit planes, int8 rows, or a concatenation of those), with
float32 biases or none, and no LoRA or tensor parallelism. Anything else (and a step the C++
layer does not take: M-RoPE positions, computed FP8 KV scales) runs the Python path, as does
every layer with `FOLIO_KERNELS=torch` or `FOLIO_CPU_LAYER=0` (KernelConfig.cpu_layer, the
A/B switch).
"""
from __future__ import annotations

from typing import Any

import torch

from folio.model.attention import AttentionMetadata
from folio.model.attention.cpu_backend import CpuPagedAttention
from folio.model.attention.fp8 import is_fp8, per_head_scales
from folio.model.layers import Attention, GatedMLP, Linear, RMSNorm, RotaryEmbedding

__all__ = ["CpuLayerRunner"]


class CpuLayerRunner:
    """One decoder layer's C++ form, built on its first CPU float32 step and rebuilt when an
    attribute it was built from is replaced (loading, LoRA, KV scales): `run` checks those
    attributes by identity in the dicts that hold them, a dictionary read each (fetching them
    through nn.Module's attribute lookup cost ~20 us a layer and step)."""

    def __init__(self) -> None:
        self._watch: list[tuple[dict, str, Any]] | None = None
        self._kernel: Any = None

    def run(self, layer: Any, positions: torch.Tensor, hidden: torch.Tensor,
            residual: torch.Tensor | None, kv_cache: torch.Tensor,
            metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`layer`'s (output, residual stream) through the C++ layer, or None where the
        Python path must run (the layer or this step does not qualify)."""
        if hidden.dtype != torch.float32 or positions.dim() != 1 \
                or positions.dtype != torch.int64:
            return None
        if metadata.calculate_kv_scales and is_fp8(kv_cache.dtype):
            return None
        watch = self._watch
        if watch is None or not all(slot.get(name, _GONE) is obj for slot, name, obj in watch):
            self._kernel = build_layer_kernel(layer)
            self._watch = _watch_list(layer)
        kernel = self._kernel
        if kernel is None:
            return None
        if metadata.groups is not None:
            metadata = metadata.groups[layer.self_attn.kv_group]
        slots, tables, qsl, lens = CpuPagedAttention.layout(metadata)
        out, stream = kernel.forward(positions, hidden, residual, kv_cache, slots, tables, qsl,
                                     lens)
        return out, stream


_GONE = object()  # what a watched slot holds once its attribute moved elsewhere

# Where the C++ layer's inputs live: a path from the layer, and the attributes there that it is
# built from.
_WATCHED: dict[str, tuple[str, ...]] = {
    "": ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp"),
    "input_layernorm": ("weight",),
    "post_attention_layernorm": ("weight",),
    "self_attn": ("qkv_proj", "o_proj", "rotary", "backend", "q_norm", "k_scale", "v_scale",
                  "sinks"),
    "self_attn.rotary": ("cos", "sin"),
    "mlp": ("gate_up_proj", "down_proj"),
    **{proj: ("packed", "lora", "bias", "tp_reduce")
       for proj in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                    "mlp.down_proj")},
}


def _watch_list(layer: Any) -> list[tuple[dict, str, Any]]:
    """(the dict holding the attribute, its name, its value now) for every attribute of
    _WATCHED on a module that exists: nn.Module keeps parameters, buffers and submodules in
    dicts of their own, anything else in __dict__. A value moved from one of those dicts to
    another (None replaced by a module) leaves `_GONE` where it was: a change too."""
    watch = []
    for path, names in _WATCHED.items():
        owner = layer
        for part in path.split(".") if path else ():
            owner = getattr(owner, part, None)
        if not isinstance(owner, torch.nn.Module):
            continue
        for name in names:
            slot = next((d for d in (owner._parameters, owner._buffers, owner._modules)
                         if name in d), owner.__dict__)
            watch.append((slot, name, slot.get(name)))
    return watch


def build_layer_kernel(layer: Any) -> Any | None:
    """`layer` as a DecoderLayerKernel, or None where it does not qualify (module doc)."""
    from folio.model.cpu_kernels import loaded
    ext = loaded()
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if ext is None or type(attn) is not Attention or type(mlp) is not GatedMLP:
        return None
    if not all(type(n) is RMSNorm and n.weight.dtype == torch.float32
               and n.weight.device.type == "cpu" and n.kernels.cpu_layer_on for n in norms):
        return None
    if norms[0].eps != norms[1].eps:
        return None
    rotary = attn.rotary
    if not isinstance(attn.backend, CpuPagedAttention) or attn.q_norm is not None \
            or type(rotary) is not RotaryEmbedding or rotary.cos.dtype != torch.float32 \
            or not mlp.fused_silu:
        return None
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    parts = [_packed_parts(p) for p in projections]
    biases = [p.bias for p in projections]
    if any(p is None for p in parts) or not all(_usable_bias(b) for b in biases):
        return None
    qkv, o, gate_up, down = parts
    k_scale = per_head_scales(attn.k_scale, attn.num_kv_heads, torch.device("cpu"))
    v_scale = per_head_scales(attn.v_scale, attn.num_kv_heads, torch.device("cpu"))
    if k_scale is not attn.k_scale or v_scale is not attn.v_scale:
        # a derived copy would miss in-place updates of the scales: keep the Python path
        return None
    sinks = attn.sinks
    if sinks is not None:
        if sinks.dtype != torch.float32 or not sinks.is_contiguous():
            return None
        sinks = sinks.detach()
    return ext.decoder_layer(
        norms[0].weight.detach(), norms[1].weight.detach(), float(norms[0].eps),
        qkv, o, gate_up, down, rotary.cos, rotary.sin, int(rotary.rotary_dim),
        int(attn.num_heads), int(attn.num_kv_heads), int(attn.head_dim), float(attn.scale),
        0 if attn.sliding_window is None else int(attn.sliding_window), k_scale, v_scale,
        float(attn.logits_soft_cap or 0.0), sinks,
        [None if b is None else b.detach() for b in biases])


def _packed_parts(proj: Linear) -> list | None:
    """`proj`'s packed weight as the C++ layer's parts; None where the projection does more
    than multiply by it and add its bias (LoRA, a tensor-parallel reduce) or is not
    packed."""
    packed = proj.packed
    if packed is None or proj.lora is not None or proj.tp_reduce is not None \
            or not hasattr(packed, "cpu_parts"):
        return None
    return packed.cpu_parts()


def _usable_bias(bias: torch.Tensor | None) -> bool:
    """A bias the C++ layer adds as the Python path does (out + bias, both float32)."""
    return bias is None or (bias.dtype == torch.float32 and bias.dim() == 1
                            and bias.is_contiguous() and bias.device.type == "cpu")
