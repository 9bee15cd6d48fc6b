"""Loading a quantized checkpoint (compressed-tensors, fp8, AWQ, GPTQ) or quantizing a float
one on load (`--quantization fp8`) into a DecoderLM.

The phases match the GGUF and int8 paths: on the meta model the projections that will be
quantized get an empty float weight (`shrink_packed_params`: no float copy is ever allocated),
the model is materialised, and the checkpoint streams through `QuantizedCollector.take`, which
takes each projection's quantized tensors (qweight, weight_scale, ...) out of the stream onto
the target device, converts a projection's shard into folio's layout (formats.py) as soon as
its tensors are all in, and lets everything else (norms, embeddings, biases, the lm_head) go on
to `DecoderLM.load_weights`. `install` then attaches one quantized module per projection: the
shards of a merged qkv / gate_up stacked along N.

On CUDA the modules are the GPU kernels' (EightBitLinear, GroupQuantLinear). On the CPU the
weights go to folio's C++ kernels where their form fits one exactly — int8 rows (PackedInt8Weight) and
4-bit planes (PackedInt4Weight, groups that are multiples of 32) — and are dequantized to the
model dtype otherwise (FP8): W8A16 / W4A16 arithmetic, the "same model dequantized" that
transformers runs.
"""
from __future__ import annotations

import logging
from typing import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from folio.model.decoder import DecoderLM
from folio.model.kernel_config import KernelConfig
from folio.model.layers import Linear, MergedLinear
from folio.model.quant import formats
from folio.model.quant.eight_bit_linear import EightBitLinear
from folio.model.quant.formats import EightBitWeight, Int4Weight
from folio.model.quant.gguf_install import shrink_packed_params
from folio.model.quant.group_linear import GroupQuantLinear
from folio.model.quant.packed import PackedConcat
from folio.model.quant.scheme import LAYOUT_ON_LOAD, QuantConfig, describe_scheme

# checkpoint names of the projections folio stores merged, by (merged module, shard)
_SHARD_NAMES = {("qkv_proj", "q"): "q_proj", ("qkv_proj", "k"): "k_proj",
                ("qkv_proj", "v"): "v_proj", ("gate_up_proj", "gate"): "gate_proj",
                ("gate_up_proj", "up"): "up_proj"}

Converted = EightBitWeight | Int4Weight

logger = logging.getLogger(__name__)


def checkpoint_module_name(path: str, shard: str | None) -> str:
    """The checkpoint's name of a folio module (a shard of a merged one): layers.0.self_attn.
    qkv_proj, shard q -> model.layers.0.self_attn.q_proj."""
    if shard is not None:
        parent, merged = path.rsplit(".", 1)
        path = f"{parent}.{_SHARD_NAMES[(merged, shard)]}"
    return f"model.{path}"


def plan_quantized(model: DecoderLM, config: QuantConfig) -> dict[str, list[str | None]]:
    """Module path -> its shards (None for an unmerged projection), for every projection of
    the decoder layers that the config quantizes. A merged module whose shards the config
    treats differently (one ignored, one not) cannot be one matmul: an error naming them."""
    plan: dict[str, list[str | None]] = {}
    for name, module in model.layers.named_modules():
        if not isinstance(module, Linear):
            continue
        path = f"layers.{name}"
        shards = list(module.shard_offsets) if isinstance(module, MergedLinear) else [None]
        ignored = {s: config.is_ignored(checkpoint_module_name(path, s)) for s in shards}
        if all(ignored.values()):
            continue
        if any(ignored.values()):
            names = [checkpoint_module_name(path, s) for s in shards]
            raise ValueError(f"quantization method {config.method!r}: the ignore list keeps "
                             f"only some of {names} float; folio runs them as one matmul")
        plan[path] = shards
    return plan


class QuantizedCollector:
    """Takes the planned projections' tensors out of a checkpoint stream and converts them."""

    def __init__(self, model: DecoderLM, config: QuantConfig,
                 plan: dict[str, list[str | None]], device: torch.device) -> None:
        self.model = model
        self.config = config
        self.scheme = config.scheme
        self.plan = plan
        self.device = device
        self.required = formats.required_tensors(self.scheme)
        self.accepted = set(self.required) | set(formats.optional_tensors(self.scheme))
        self.pending: dict[tuple[str, str | None], dict[str, torch.Tensor]] = {}
        self.done: dict[tuple[str, str | None], Converted] = {}
        self.consumed: set[str] = set()   # checkpoint names, for load_weights' `preloaded`

    def _shape(self, path: str, shard: str | None) -> tuple[int, int]:
        module = self.model.get_submodule(path)
        rows = module.shard_offsets[shard][1] if shard is not None else module.out_features
        return rows, module.in_features

    def take(self, weights: Iterable[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            target = self.model.weight_target(name)
            if target is not None and target[0] in self.plan and target[2] == "weight" \
                    and "weight" not in self.accepted:
                self._float_weight(name, *target[:2])
            if target is None or target[0] not in self.plan or target[2] not in self.accepted:
                yield name, tensor
                continue
            path, shard, attr = target
            if shard not in self.plan[path]:
                yield name, tensor   # not this module's layout: load_weights reports it
                continue
            key = (path, shard)
            if key in self.done:
                self._late(name, key, attr, tensor)
                continue
            self.pending.setdefault(key, {})[attr] = tensor.to(self.device)
            # load_weights counts the (shrunk) float weight of this shard as loaded
            self.consumed.add(f"{checkpoint_module_name(path, shard)}.weight")
            if all(r in self.pending[key] for r in self.required) and \
                    self._complete_optional(key):
                self._convert(key)

    def _float_weight(self, name: str, path: str, shard: str | None) -> None:
        """A float weight for a projection the config quantizes (the checkpoint keeps it
        float, but the config's float-module fields do not say so): named, with the fields."""
        if shard is not None and shard not in self.plan[path]:
            return   # not this module's layout: load_weights reports it
        module = checkpoint_module_name(path, shard)
        raise ValueError(f"quantization method {self.config.method!r}: checkpoint tensor {name} "
                         f"is a float weight, but quantization_config quantizes {module} (its "
                         f"{self.config.float_fields_text()} do not keep it float)")

    def _late(self, name: str, key: tuple[str, str | None], attr: str,
              tensor: torch.Tensor) -> None:
        """A tensor of a projection already converted: only those that add nothing may come
        late (weight_shape, checked; an input_scale of dynamic activations, unused)."""
        if attr == "weight_shape":
            stored = tuple(int(v) for v in tensor.reshape(-1).tolist())
            if stored != self._shape(*key):
                raise ValueError(f"{name} is {stored}, expected {self._shape(*key)}")
        elif attr == "weight_g_idx":
            # read with the rest only where the config's actorder is "group": elsewhere it
            # must be the plain order, or the groups the weight was read with were wrong
            k = self._shape(*key)[1]
            if formats.act_order_perm({attr: tensor}, attr, name.removesuffix("." + attr), k,
                                      self.scheme.group_size or k, False) is not None:
                raise ValueError(f"quantization method {self.config.method!r}: {name} scatters "
                                 "the groups over the input channels, but quantization_config"
                                 "'s weights.actorder is not 'group'")
        elif not (attr == "input_scale" and self.scheme.act_dynamic):
            raise ValueError(f"checkpoint tensor {name} comes after its projection was "
                             "complete (a duplicate?)")
        path, shard = key
        self.consumed.add(f"{checkpoint_module_name(path, shard)}.weight")

    def _complete_optional(self, key: tuple[str, str | None]) -> bool:
        """GPTQ's g_idx is optional but, when a file has it, it must be read with the rest: a
        projection converts once its tensors stop arriving (in `finish`) unless the layout
        has no optional tensor that changes the result."""
        return self.scheme.layout != "gptq" or "g_idx" in self.pending[key]

    def _convert(self, key: tuple[str, str | None]) -> None:
        path, shard = key
        tensors = self.pending.pop(key)
        name = checkpoint_module_name(path, shard)
        shape = self._shape(path, shard)
        scheme = self.scheme
        if scheme.layout == LAYOUT_ON_LOAD:
            weight = tensors["weight"]
            if tuple(weight.shape) != shape:
                raise ValueError(f"weight {name}.weight has shape {tuple(weight.shape)}, "
                                 f"expected {shape}")
            self.done[key] = formats.quantize_fp8_per_channel(weight)
            return
        try:
            if scheme.weight in ("fp8", "int8"):
                self.done[key] = formats.eight_bit_from_checkpoint(tensors, scheme, name, shape)
            else:
                self.done[key] = formats.int4_from_checkpoint(tensors, scheme, name, shape)
        except ValueError as err:
            # The tensors' shapes and dtypes follow from the config: name the method and the
            # settings they were checked against (a config.json edited apart from its files).
            raise ValueError(f"quantization method {self.config.method!r}: {err} (checked "
                             f"against quantization_config {describe_scheme(scheme)})") from None

    def finish(self) -> None:
        """Convert what waited for optional tensors; every planned shard must be complete."""
        for key in list(self.pending):
            if all(r in self.pending[key] for r in self.required):
                self._convert(key)
        missing = []
        for path, shards in self.plan.items():
            for shard in shards:
                if (path, shard) not in self.done:
                    have = sorted(self.pending.get((path, shard), {}))
                    need = [r for r in self.required if r not in have]
                    missing.append(f"{checkpoint_module_name(path, shard)}.{{{','.join(need)}}}")
        if missing:
            raise ValueError(f"quantization method {self.config.method!r}: the checkpoint "
                             f"lacks quantized tensors: {missing[:4]}"
                             f"{' ...' if len(missing) > 4 else ''}")

    def install(self, kernels: KernelConfig, dtype: torch.dtype) -> None:
        widened = 0
        for path, shards in self.plan.items():
            parts = [self.done.pop((path, s)) for s in shards]
            module = self.model.get_submodule(path)
            if self.device.type == "cuda":
                module.packed = self._gpu_module(parts, kernels)
            else:
                packed = _cpu_module(parts)
                if packed is None:   # no exact CPU kernel form: the dequantized weight
                    w = torch.cat([p.dequantize() for p in parts]).to(dtype)
                    module.weight = nn.Parameter(w, requires_grad=False)
                    widened += 1
                else:
                    module.packed = packed
        if widened:
            # the same outputs as the quantized model, but none of its memory or speed
            logger.warning("%d of %d quantized projections (%s) run dequantized to %s on the "
                           "CPU, which has no kernel for their form: they take the float "
                           "model's memory and time (int8 and 4-bit groups of 32 run packed)",
                           widened, len(self.plan), describe_scheme(self.scheme),
                           str(dtype).replace("torch.", ""))

    def _gpu_module(self, parts: list[Converted], kernels: KernelConfig) -> nn.Module:
        scheme = self.scheme
        if isinstance(parts[0], EightBitWeight):
            per_tensor = scheme.act_strategy == "tensor" and scheme.act_dynamic
            return EightBitLinear(formats.concat_eight_bit(parts), scheme.activation,
                                  act_per_tensor=per_tensor, kernels=kernels)
        merged = formats.concat_int4(parts)
        if merged is not None:
            return GroupQuantLinear(merged, kernels)
        return PackedConcat([GroupQuantLinear(p, kernels) for p in parts])


class _PermutedInput(nn.Module):
    """A CPU packed weight stored with K permuted (GPTQ act-order): gathers x's columns."""

    def __init__(self, packed: nn.Module, perm: torch.Tensor) -> None:
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.register_buffer("perm", perm, persistent=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.packed.forward(x.index_select(-1, self.perm), bias)

    def dequantize(self) -> torch.Tensor:
        """W in the checkpoint's K order."""
        w = self.packed.dequantize()
        return torch.empty_like(w).index_copy_(1, self.perm, w)


def _cpu_module(parts: list[Converted]) -> nn.Module | None:
    """The C++ kernels' packed form of these shards when one holds them exactly, else None."""
    from folio.model.quant.gguf_int8 import Int8Rows
    from folio.model.quant.gguf_planes import GROUP, Plane
    from folio.model.quant.int4_packed import PackedInt4Weight
    from folio.model.quant.int8_packed import PackedInt8Weight
    if isinstance(parts[0], EightBitWeight):
        merged = formats.concat_eight_bit(parts)
        if merged.codes.dtype != torch.int8 or merged.codes.shape[1] % 16:
            return None
        return PackedInt8Weight(Int8Rows(merged.codes.numpy(),
                                         merged.scale[:, None].numpy().astype(np.float32)))
    merged = formats.concat_int4(parts)
    if merged is None:   # shards with their own act-order permutations: one matmul each
        modules = [_cpu_module([p]) for p in parts]
        return None if any(m is None for m in modules) else PackedConcat(modules)
    if merged.group_size % GROUP or merged.shape[1] % GROUP:
        return None
    # (q - z) * s = (q - 8) * s + (8 - z) * s: one plane of groups of 32, scale and zero
    # repeated over the group's 32-wide pieces.
    reps = merged.group_size // GROUP
    s = merged.scales.to(torch.float32)
    z = torch.full_like(s, 8.0) if merged.zeros is None else merged.zeros.to(torch.float32)
    plane = Plane(merged.codes().numpy(),
                  s.repeat_interleave(reps, dim=1).numpy(),
                  ((8.0 - z) * s).repeat_interleave(reps, dim=1).numpy())
    packed = PackedInt4Weight([plane])
    return packed if merged.perm is None else _PermutedInput(packed, merged.perm)


def load_quantized(model: DecoderLM, config: QuantConfig,
                   weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                   device: torch.device, kernels: KernelConfig) -> DecoderLM:
    """The meta-device `model` materialised on `device` with `config`'s projections
    quantized, everything else loaded from `weights` in `dtype`."""
    plan = plan_quantized(model, config)
    shrink_packed_params(model, plan)
    model = model.to(dtype=dtype).to_empty(device=device)
    collector = QuantizedCollector(model, config, plan, device)
    model.load_weights(collector.take(weights), preloaded=collector.consumed)
    collector.finish()
    collector.install(kernels, dtype)
    return model
