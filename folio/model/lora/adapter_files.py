"""A PEFT LoRA adapter directory, read and checked without torch (the front end refuses a bad
adapter before a request reaches the engine core, and the worker then loads files known to
fit): adapter_config.json, and the names, shapes and dtypes in adapter_model.safetensors'
header. Every problem is a LoRAAdapterError (a ValueError) naming the file and the field."""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass

from folio.model.families import ArchSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# adapter_config.json is a few hundred bytes; the safetensors header of an adapter for every
# projection of a 128-layer model is well under a megabyte.
_MAX_CONFIG_BYTES = 1 << 20
_MAX_HEADER_BYTES = 16 << 20
# The projections an adapter may target, as folio names them: (block, projection).
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
BLOCK_OF = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn",
             "gate": "mlp", "up": "mlp", "down": "mlp"}
# PEFT's tensor names, with or without the base_model.model. prefix and the adapter's name
# (save_pretrained drops it; a raw state dict keeps it).
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\."
    r"(q|k|v|o|gate|up|down)_proj\.lora_([AB])(?:\.[A-Za-z0-9_\-]+)?\.weight$")
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class LoRAAdapterError(ValueError):
    """An adapter directory folio cannot serve: the message names the file and the field."""


@dataclass(frozen=True)
class ProjectionLoRA:
    """One projection's LoRA: A [rank, in] and B [out, rank] in the safetensors file, and the
    scaling PEFT applies to B(A(x)) (lora_alpha / rank, or / sqrt(rank) for rsLoRA)."""
    layer: int
    projection: str        # one of PROJECTIONS
    rank: int
    scaling: float
    a_name: str
    b_name: str


@dataclass(frozen=True)
class AdapterFiles:
    path: str                                   # the directory, resolved
    weights_path: str
    rank: int                                   # the largest rank of its projections
    modules: tuple[ProjectionLoRA, ...]
    dtype: str                                  # of its tensors (float32, float16, bfloat16)


def projection_shapes(spec: ArchSpec) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection an adapter may target."""
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    h, i = spec.hidden_size, spec.intermediate_size
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h),
            "gate": (h, i), "up": (h, i), "down": (i, h)}


def check_lora_support(spec: ArchSpec) -> None:
    """LoRA applies to the dense attention and MLP projections of a decoder; refuse models
    whose projections are otherwise (experts, latent attention, encoders)."""
    if spec.is_encoder:
        raise ValueError("enable_lora: LoRA adapters are served for decoders only")
    if spec.moe is not None:
        raise ValueError("enable_lora: LoRA on mixture-of-experts models is not supported")
    if spec.mla is not None:
        raise ValueError("enable_lora: LoRA on latent-attention (DeepSeek) models is not "
                         "supported")


def _fail(path: str, message: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {path}: {message}")


def _read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise _fail(path, f"no {CONFIG_FILE} (not a PEFT adapter directory)")
    if os.path.getsize(file) > _MAX_CONFIG_BYTES:
        raise _fail(path, f"{CONFIG_FILE} is larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise _fail(path, f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise _fail(path, f"{CONFIG_FILE} must hold a JSON object")
    return config


def _read_header(path: str) -> tuple[str, dict]:
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise _fail(path, "adapter_model.bin (pickle) is not read: save the adapter as "
                              "safetensors (PEFT's save_pretrained does by default)")
        raise _fail(path, f"no {WEIGHTS_FILE}")
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _fail(path, f"{WEIGHTS_FILE} is truncated")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER_BYTES:
                raise _fail(path, f"{WEIGHTS_FILE}'s header claims {length} bytes")
            raw = f.read(length)
        if len(raw) < length:
            raise _fail(path, f"{WEIGHTS_FILE} is truncated")
        header = json.loads(raw)
    except LoRAAdapterError:
        raise
    except (OSError, ValueError) as exc:
        raise _fail(path, f"{WEIGHTS_FILE} is not a safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise _fail(path, f"{WEIGHTS_FILE} has a malformed header")
    size = os.path.getsize(file) - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]
                <= size):
            raise _fail(path, f"{WEIGHTS_FILE}: tensor {name} lies outside the file")
    return file, header


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name that ends
    with it (at a dot)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter(path: str, spec: ArchSpec, max_rank: int) -> AdapterFiles:
    """The adapter at `path`, checked against the model (`spec`) and --max-lora-rank."""
    if not isinstance(path, str) or not path:
        raise LoRAAdapterError("lora_path must name an adapter directory")
    resolved = os.path.realpath(path)
    if not os.path.isdir(resolved):
        raise LoRAAdapterError(f"LoRA adapter {path}: no such directory")
    config = _read_config(resolved)
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _fail(path, f"peft_type is {peft_type!r}; only LORA adapters are served")
    for flag, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights"),
                       ("lora_bias", "LoRA biases")):
        if config.get(flag):
            raise _fail(path, f"{flag}: {what} are not supported")
    if config.get("bias", "none") not in ("none", None):
        raise _fail(path, f"bias {config.get('bias')!r}: trained biases are not supported "
                          "(only bias \"none\")")
    if config.get("modules_to_save"):
        raise _fail(path, f"modules_to_save {config.get('modules_to_save')!r}: adapters that "
                          "replace whole modules (embeddings, lm_head) are not supported")
    if config.get("layer_replication"):
        raise _fail(path, "layer_replication is not supported")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _fail(path, f"lora_alpha must be a number, got {alpha!r}")
    alpha_pattern = config.get("alpha_pattern") or {}
    if not isinstance(alpha_pattern, dict):
        raise _fail(path, "alpha_pattern must be an object")
    rslora = bool(config.get("use_rslora", False))

    file, header = _read_header(resolved)
    shapes = projection_shapes(spec)
    found: dict[tuple[int, str], dict[str, tuple[str, list[int]]]] = {}
    dtypes = set()
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise _fail(path, f"tensor {name} is not a LoRA weight of a q/k/v/o/gate/up/down "
                              "projection (embedding and lm_head adapters are not supported)")
        layer, block, proj, which = int(match[1]), match[2], match[3], match[4]
        if BLOCK_OF[proj] != block:
            raise _fail(path, f"tensor {name}: {proj}_proj is not in {block}")
        if layer >= spec.num_layers:
            raise _fail(path, f"tensor {name}: layer {layer} is past the model's "
                              f"{spec.num_layers} layers")
        dtype = _DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise _fail(path, f"tensor {name} has dtype {entry.get('dtype')!r} (float32, "
                              "float16 or bfloat16 expected)")
        dtypes.add(dtype)
        shape = entry.get("shape")
        if not (isinstance(shape, list) and len(shape) == 2
                and all(isinstance(d, int) and d > 0 for d in shape)):
            raise _fail(path, f"tensor {name} has shape {shape!r}, expected a matrix")
        slot = found.setdefault((layer, proj), {})
        if which in slot:
            raise _fail(path, f"tensor {name} duplicates {slot[which][0]}")
        slot[which] = (name, shape)
    if not found:
        raise _fail(path, f"{WEIGHTS_FILE} holds no LoRA weights")

    modules = []
    for (layer, proj), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise _fail(path, f"layers.{layer} {proj}_proj has no {missing} weight")
        (a_name, a_shape), (b_name, b_shape) = pair["A"], pair["B"]
        in_features, out_features = shapes[proj]
        rank = a_shape[0]
        if a_shape[1] != in_features or b_shape != [out_features, rank]:
            raise _fail(path, f"layers.{layer} {proj}_proj: lora_A {a_shape} and lora_B "
                              f"{b_shape} do not fit the model's {in_features} -> "
                              f"{out_features} projection (expected [r, {in_features}] and "
                              f"[{out_features}, r]); was it trained on another model?")
        if rank > max_rank:
            raise _fail(path, f"rank {rank} (layers.{layer} {proj}_proj) is larger than "
                              f"max_lora_rank ({max_rank}); start the server with a larger "
                              "--max-lora-rank")
        module = f"model.layers.{layer}.{BLOCK_OF[proj]}.{proj}_proj"
        mod_alpha = _pattern_value(alpha_pattern, module, alpha)
        if not isinstance(mod_alpha, (int, float)) or isinstance(mod_alpha, bool):
            raise _fail(path, f"alpha_pattern value for {module} must be a number")
        scaling = mod_alpha / math.sqrt(rank) if rslora else mod_alpha / rank
        modules.append(ProjectionLoRA(layer, proj, rank, float(scaling), a_name, b_name))
    if len(dtypes) > 1:
        raise _fail(path, f"tensors mix dtypes {sorted(dtypes)}")
    return AdapterFiles(resolved, file, max(m.rank for m in modules), tuple(modules),
                        dtypes.pop())


def path_inside(path: str, allowed_dirs: list[str]) -> bool:
    """Whether `path`, links resolved, lies inside one of `allowed_dirs` (also resolved)."""
    real = os.path.realpath(path)
    for allowed in allowed_dirs:
        root = os.path.realpath(allowed)
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return True
    return False
