"""What a checkpoint's `quantization_config` (config.json) or `--quantization` asks of the
linear layers, parsed and checked once: which weight format, which scales, which activations.

Torch-free (the front end checks a model's config before any weight is read). Every refusal is
a ValueError naming the method and the field, as users meet them in config.json:
`quantization_config.config_groups.group_0.weights.strategy`, `quantization_config.bits`, ...

Formats read (vLLM's method names, `quant_method` in config.json):
- "compressed-tensors" (llmcompressor's): `float-quantized` FP8 W8A8 (per-tensor or
  per-channel weight scales; dynamic per-token, dynamic per-tensor or static per-tensor
  activation scales), `int-quantized`/`naive-quantized` INT8 W8A8 (or W8A16) per-channel, and
  `pack-quantized` INT4 W4A16 (group or channel scales, symmetric or with zero points);
- "fp8": AutoFP8 / transformers' FP8 files (per-tensor or per-channel `weight_scale`,
  `activation_scheme` dynamic or static);
- "awq": AutoAWQ's GEMM layout (4 bits, zero points);
- "gptq": AutoGPTQ / GPTQModel (4 bits, symmetric or not, `desc_act` false or true, the v1
  zero-minus-one convention or `checkpoint_format` gptq_v2; GPTQModel's `dynamic` rules that
  keep modules float).
Modules kept float are named as each tool names them: compressed-tensors' `ignore` and vLLM's
`ignored_layers` by module name or "re:" regex; `modules_to_not_convert` (AutoAWQ, transformers)
by any part of the name; GPTQModel's `dynamic` "-:" keys by a regex matched at the name's start.
And `--quantization fp8` on a float checkpoint: FP8 weights quantized per output channel on
load, dynamic per-token activations.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from folio.config import QUANTIZATION_ALIASES

# vLLM's names of the methods read from a checkpoint's config.json (plus "fp8", which is also
# the quantize-on-load flag).
CHECKPOINT_METHODS = ("fp8", "compressed-tensors", "awq", "gptq")
# Names vLLM users pass that mean one of the above here (vLLM's kernel-specific variants): the
# same table the engine's config normalizes `--quantization` with.
METHOD_ALIASES = QUANTIZATION_ALIASES

# Where the weights come from, which decides the tensor names read (formats.py).
LAYOUT_CT_FLOAT = "ct-float"     # compressed-tensors float-quantized: weight (fp8), weight_scale
LAYOUT_CT_INT = "ct-int"         # compressed-tensors int-quantized: weight (int8), weight_scale
LAYOUT_CT_PACK = "ct-pack"       # compressed-tensors pack-quantized: weight_packed, ...
LAYOUT_FP8 = "fp8"               # quant_method fp8: weight (fp8), weight_scale
LAYOUT_AWQ = "awq"               # qweight, qzeros, scales (packed along N, interleaved)
LAYOUT_GPTQ = "gptq"             # qweight, qzeros, scales, g_idx (packed along K)
LAYOUT_ON_LOAD = "on-load"       # a float weight, quantized by folio as it loads

# What an activation is quantized to before the matmul (None: weight-only, W*A16).
ACT_FP8 = "fp8"
ACT_INT8 = "int8"


@dataclass(frozen=True)
class LinearScheme:
    """How every quantized projection of the model is stored and multiplied."""

    weight: str                 # "fp8" (e4m3), "int8" or "int4"
    strategy: str               # weight scales: "tensor", "channel" or "group"
    group_size: int | None      # for "group": input channels per scale
    symmetric: bool             # False: zero points (int4)
    activation: str | None      # ACT_FP8 / ACT_INT8 (W8A8) or None (weight-only)
    act_strategy: str = "token"  # "token" (a scale per row) or "tensor"
    act_dynamic: bool = True    # False: a static per-tensor `input_scale` from the checkpoint
    layout: str = LAYOUT_ON_LOAD
    desc_act: bool = False      # GPTQ act-order: g_idx permutes the input channels
    zero_offset: int = 0        # GPTQ v1 files store zero - 1: add this to the stored zero


@dataclass(frozen=True)
class QuantConfig:
    method: str                      # one of CHECKPOINT_METHODS
    scheme: LinearScheme
    ignore: tuple[str, ...] = ()     # checkpoint module names kept float ("re:" = a regex)
    # compressed-tensors' config_groups targets: the modules quantized ("Linear" = every
    # projection, "re:" = a regex, else a module name); () = every projection
    targets: tuple[str, ...] = ()
    # `modules_to_not_convert`: a module whose name contains one of these stays float
    # (AutoAWQ's and transformers' rule: "self_attn" keeps every attention projection float)
    not_converted: tuple[str, ...] = ()
    # GPTQModel's `dynamic` "-:" rules: a module whose name a regex matches from its start
    skipped: tuple[str, ...] = ()
    # the config.json fields that choose the float modules, for errors that point at them
    float_fields: tuple[str, ...] = ("ignore",)

    def is_ignored(self, module_name: str) -> bool:
        """Whether checkpoint module `module_name` (e.g. model.layers.0.mlp.down_proj) is
        left unquantized: named by the config's ignore list (compressed-tensors' `ignore`,
        vLLM's `ignored_layers`), containing a `modules_to_not_convert` entry, matched by a
        GPTQModel `dynamic` "-:" rule, or not named by the targets."""
        if self.targets and not any(entry == "Linear" or _names(entry, module_name)
                                    for entry in self.targets):
            return True
        return (any(_names(entry, module_name) for entry in self.ignore)
                or any(entry in module_name for entry in self.not_converted)
                or any(re.match(pattern, module_name) for pattern in self.skipped))

    def float_fields_text(self) -> str:
        """The fields that keep modules float, as config.json spells them."""
        return " / ".join(f"quantization_config.{f}" for f in self.float_fields)


def _names(entry: str, module_name: str) -> bool:
    """Whether an ignore or targets entry (a module name, or "re:" and a regex) names the
    checkpoint module `module_name`, with or without its leading "model."."""
    short = module_name.removeprefix("model.")
    if entry.startswith("re:"):
        pattern = entry[3:]
        return bool(re.fullmatch(pattern, module_name) or re.fullmatch(pattern, short))
    return (module_name == entry or short == entry or module_name.endswith("." + entry)
            or module_name.startswith(entry + "."))


# `--quantization fp8` on a float checkpoint. vLLM's on-load FP8 takes one scale per weight
# tensor; folio takes one per output channel: the same bytes, and an outlier row no longer
# coarsens every other row's steps.
ON_LOAD_FP8 = QuantConfig("fp8", LinearScheme(weight="fp8", strategy="channel", group_size=None,
                                              symmetric=True, activation=ACT_FP8))


def describe_scheme(scheme: LinearScheme) -> str:
    """The settings that decide a projection's tensor shapes and dtypes, under the field names
    config.json gives them (`group_size` in all three 4-bit formats)."""
    if scheme.weight == "int4":
        text = (f"bits 4, group_size {scheme.group_size or -1}, "
                f"{'symmetric' if scheme.symmetric else 'with zero points'}")
        return text + (", desc_act true" if scheme.desc_act else "")
    return (f"{scheme.weight} weights, {scheme.strategy} weight scales, activations "
            f"{scheme.activation or 'none (weight-only)'}")


def normalize_method(name: str) -> str:
    return METHOD_ALIASES.get(name, name)


def _fail(method: str, field: str, message: str) -> ValueError:
    return ValueError(f"quantization method {method!r}: quantization_config.{field} {message}")


def _int(value: Any, method: str, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(method, field, f"must be an integer, got {value!r}")
    return value


def checkpoint_method(hf_config: Any) -> str | None:
    """The quant_method of a config's `quantization_config` (normalized), or None — also for
    a compressed-tensors config that quantizes no weights (only a `kv_cache_scheme`: the
    KV scales it stores are read by the decoder's loader, the weights are float)."""
    qc = _quantization_dict(hf_config)
    if qc is None:
        return None
    if str(qc.get("quant_method", "")).lower().replace("_", "-") == "compressed-tensors":
        _check_ct_extras(qc)
        if not qc.get("config_groups") and qc.get("kv_cache_scheme") is not None:
            return None
    method = qc.get("quant_method")
    if not isinstance(method, str):
        raise ValueError(f"quantization_config.quant_method must be a string, got {method!r}")
    return normalize_method(method.lower())


def _check_ct_extras(qc: dict) -> None:
    """compressed-tensors fields beside the weights' scheme: the KV cache's scheme (FP8 KV
    scales are read; anything else is refused, as vLLM does), and sparsity or transforms,
    which folio does not apply (loading such a file as if dense would give wrong outputs)."""
    m = "compressed-tensors"
    kv = qc.get("kv_cache_scheme")
    if kv is not None:
        if not isinstance(kv, dict):
            raise _fail(m, "kv_cache_scheme", "must be an object")
        kv_type = str(kv.get("type", "float")).lower()
        if kv_type != "float":
            raise _fail(m, "kv_cache_scheme.type", f"{kv.get('type')!r}: only an FP8 KV cache "
                        "(type 'float', num_bits 8) is supported")
        if _int(kv.get("num_bits", 8), m, "kv_cache_scheme.num_bits") != 8:
            raise _fail(m, "kv_cache_scheme.num_bits", f"{kv.get('num_bits')}: only an FP8 KV "
                        "cache (type 'float', num_bits 8) is supported")
    sparsity = qc.get("sparsity_config")
    if sparsity and not (isinstance(sparsity, dict)
                         and str(sparsity.get("format", "dense")).lower() == "dense"):
        raise _fail(m, "sparsity_config", f"{sparsity!r}: sparse checkpoints are not "
                    "supported (format 'dense' or none is)")
    if qc.get("transform_config"):
        raise _fail(m, "transform_config", "is not supported (rotations such as Hadamard "
                    "transforms are not applied): only checkpoints without one load")


def _quantization_dict(hf_config: Any) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        # compressed-tensors' older key for the same object (vLLM reads it too)
        qc = getattr(hf_config, "compression_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        to_dict = getattr(qc, "to_dict", None)
        qc = to_dict() if callable(to_dict) else None
        if not isinstance(qc, dict):
            raise ValueError("quantization_config must be a JSON object")
    return qc


def parse_quant_config(hf_config: Any, method: str) -> QuantConfig:
    """The QuantConfig for `method` (already resolved against the checkpoint: see
    discovery.resolve_quantization): the checkpoint's config for a pre-quantized model, the
    on-load FP8 scheme for `--quantization fp8` on a float one."""
    qc = _quantization_dict(hf_config)
    if qc is None:
        if method == "fp8":
            return ON_LOAD_FP8
        raise ValueError(f"quantization method {method!r} needs a checkpoint quantized with it "
                         f"(config.json has no quantization_config)")
    parsers = {"fp8": _parse_fp8, "compressed-tensors": _parse_compressed_tensors,
               "awq": _parse_awq, "gptq": _parse_gptq}
    found = checkpoint_method(hf_config)
    if found not in parsers:
        raise ValueError(f"quantization_config.quant_method {found!r} is not supported; "
                         f"supported: {list(CHECKPOINT_METHODS)}")
    return parsers[found](qc)


def _parse_fp8(qc: dict) -> QuantConfig:
    m = "fp8"
    if qc.get("weight_block_size") is not None:
        raise _fail(m, "weight_block_size", f"{qc['weight_block_size']!r}: block-wise FP8 "
                    "scales are not supported yet (per-tensor and per-channel are)")
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _fail(m, "fmt", f"must be 'e4m3', got {qc.get('fmt')!r}")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _fail(m, "activation_scheme", f"must be 'dynamic' or 'static', got {scheme!r}")
    dynamic = scheme == "dynamic"
    # The weight scale's shape (one, or one per row) is the file's to say: formats.py reads it.
    return QuantConfig(m, LinearScheme(
        weight="fp8", strategy="channel", group_size=None, symmetric=True, activation=ACT_FP8,
        act_strategy="token" if dynamic else "tensor", act_dynamic=dynamic, layout=LAYOUT_FP8),
        ignore=_names_list(qc, m, "ignored_layers"),
        not_converted=_names_list(qc, m, "modules_to_not_convert"),
        float_fields=("ignored_layers", "modules_to_not_convert"))


def _parse_awq(qc: dict) -> QuantConfig:
    m = "awq"
    bits = _int(qc.get("bits", qc.get("w_bit")), m, "bits")
    if bits != 4:
        raise _fail(m, "bits", f"must be 4, got {bits}")
    group = _int(qc.get("group_size", qc.get("q_group_size")), m, "group_size")
    if group <= 0 or group % 8:
        raise _fail(m, "group_size", f"must be a positive multiple of 8, got {group}")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _fail(m, "version", f"{qc.get('version')!r}: only AutoAWQ's 'gemm' layout is "
                    "read")
    if qc.get("zero_point", True) is not True:
        raise _fail(m, "zero_point", "must be true (AWQ without zero points is not supported)")
    return QuantConfig(m, LinearScheme(
        weight="int4", strategy="group", group_size=group, symmetric=False, activation=None,
        layout=LAYOUT_AWQ), not_converted=_names_list(qc, m, "modules_to_not_convert"),
        float_fields=("modules_to_not_convert",))


def _parse_gptq(qc: dict) -> QuantConfig:
    m = "gptq"
    bits = _int(qc.get("bits"), m, "bits")
    if bits != 4:
        raise _fail(m, "bits", f"must be 4, got {bits}")
    group = _int(qc.get("group_size", 128), m, "group_size")
    if group != -1 and (group <= 0 or group % 8):
        raise _fail(m, "group_size", f"must be -1 or a positive multiple of 8, got {group}")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _fail(m, "checkpoint_format", f"must be 'gptq' or 'gptq_v2', got "
                    f"{qc.get('checkpoint_format')!r}")
    sym = qc.get("sym", True)
    desc_act = qc.get("desc_act", False)
    for field, value in (("sym", sym), ("desc_act", desc_act)):
        if not isinstance(value, bool):
            raise _fail(m, field, f"must be true or false, got {value!r}")
    if qc.get("lm_head", False) is not False:
        raise _fail(m, "lm_head", f"{qc['lm_head']!r}: a quantized lm_head is not supported "
                    "(folio's output layer reads float weights); quantize with lm_head false")
    base = {"bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act}
    return QuantConfig(m, LinearScheme(
        weight="int4", strategy="channel" if group == -1 else "group",
        group_size=None if group == -1 else group, symmetric=sym, activation=None,
        layout=LAYOUT_GPTQ, desc_act=desc_act, zero_offset=1 if fmt == "gptq" else 0),
        not_converted=_names_list(qc, m, "modules_to_not_convert"),
        skipped=_gptq_dynamic(qc.get("dynamic"), base),
        float_fields=("modules_to_not_convert", "dynamic"))


def _names_list(qc: dict, method: str, field: str) -> tuple[str, ...]:
    """A list of module names (or name parts) from config.json; null means none."""
    value = qc.get(field)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _fail(method, field, f"must be a list of module names, got {value!r}")
    return tuple(value)


def _gptq_dynamic(dynamic: Any, base: dict[str, Any]) -> tuple[str, ...]:
    """GPTQModel's per-module rules: {"-:regex": {}} keeps the modules a regex matches float;
    "+:regex" (or a bare regex) overrides settings for them. One scheme runs every quantized
    projection here, so an override may only repeat the base settings."""
    m = "gptq"
    if dynamic is None:
        return ()
    if not isinstance(dynamic, dict):
        raise _fail(m, "dynamic", f"must be an object of regex rules, got {dynamic!r}")
    skipped = []
    for key, overrides in dynamic.items():
        negative = key.startswith("-:")
        pattern = key[2:] if key.startswith(("-:", "+:")) else key
        try:
            re.compile(pattern)
        except re.error as exc:
            raise _fail(m, f"dynamic.{key}", f"is not a valid regex: {exc}") from None
        if negative:
            skipped.append(pattern)
            continue
        if not isinstance(overrides, dict):
            raise _fail(m, f"dynamic.{key}", f"must be an object of settings, got {overrides!r}")
        for field, value in overrides.items():
            if field in base and value != base[field]:
                raise _fail(m, f"dynamic.{key}.{field}", f"{value!r} differs from the "
                            f"model's {field} {base[field]!r}: per-module schemes are not "
                            "supported (a '-:' rule keeping modules float is)")
    return tuple(skipped)


def _parse_compressed_tensors(qc: dict) -> QuantConfig:
    m = "compressed-tensors"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _fail(m, "config_groups", "must be a non-empty object")
    status = qc.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise _fail(m, "quantization_status", f"must be 'compressed', got {status!r}")
    schemes = {}
    targets: list[str] = []
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise _fail(m, f"config_groups.{name}", "must be an object")
        fmt = group.get("format") or qc.get("format")
        schemes[name] = _ct_group(group, fmt, f"config_groups.{name}")
        group_targets = group.get("targets", ["Linear"])
        if not isinstance(group_targets, list) or not group_targets \
                or not all(isinstance(t, str) for t in group_targets):
            raise _fail(m, f"config_groups.{name}.targets", f"must be a non-empty list of "
                        f"module names or 're:' regexes, got {group_targets!r}")
        targets += group_targets
    distinct = set(schemes.values())
    if len(distinct) > 1:
        raise _fail(m, "config_groups", f"mixes schemes across groups {list(schemes)}: one "
                    "scheme for every layer is supported")
    return QuantConfig(m, distinct.pop(), ignore=_names_list(qc, m, "ignore"),
                       targets=() if "Linear" in targets else tuple(targets),
                       float_fields=("ignore", "config_groups.*.targets"))


def _ct_args(args: Any, prefix: str) -> dict:
    m = "compressed-tensors"
    if not isinstance(args, dict):
        raise _fail(m, prefix, "must be an object")
    out = dict(args)
    out["type"] = str(out.get("type", "int")).lower()
    out["num_bits"] = _int(out.get("num_bits", 8), m, f"{prefix}.num_bits")
    out["strategy"] = str(out.get("strategy", "tensor")).lower()
    return out


def _ct_group(group: dict, fmt: Any, prefix: str) -> LinearScheme:
    m = "compressed-tensors"
    if group.get("weights") is None:
        raise _fail(m, f"{prefix}.weights", "is missing (activation-only schemes are not "
                    "supported)")
    w = _ct_args(group["weights"], f"{prefix}.weights")
    if w.get("dynamic"):
        raise _fail(m, f"{prefix}.weights.dynamic", "must be false")
    act = group.get("input_activations")
    a = _ct_args(act, f"{prefix}.input_activations") if act is not None else None
    if group.get("output_activations") is not None:
        raise _fail(m, f"{prefix}.output_activations", "are not supported")
    fmt = str(fmt or "").lower()
    sym = w.get("symmetric", True)
    if w["type"] == "float":
        if w["num_bits"] != 8:
            raise _fail(m, f"{prefix}.weights.num_bits", f"{w['num_bits']}: float weights "
                        "must be 8-bit (FP8 e4m3)")
        if w["strategy"] not in ("tensor", "channel"):
            raise _fail(m, f"{prefix}.weights.strategy", f"{w['strategy']!r}: FP8 weights "
                        "with 'tensor' or 'channel' scales are supported")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise _fail(m, "format", f"{fmt!r}: FP8 weights are read from 'float-quantized' "
                        "checkpoints")
        if a is None:
            raise _fail(m, f"{prefix}.input_activations", "are missing: FP8 weight-only "
                        "(W8A16) is not supported, W8A8 is")
        return LinearScheme(weight="fp8", strategy=w["strategy"], group_size=None,
                            symmetric=True, layout=LAYOUT_CT_FLOAT,
                            **_ct_activation(a, "float", prefix))
    if w["type"] != "int":
        raise _fail(m, f"{prefix}.weights.type", f"must be 'int' or 'float', got {w['type']!r}")
    if w["num_bits"] == 8:
        if w["strategy"] != "channel" or not sym:
            raise _fail(m, f"{prefix}.weights.strategy", f"{w['strategy']!r} "
                        f"(symmetric={sym}): INT8 weights must be symmetric per channel")
        if fmt not in ("int-quantized", "naive-quantized"):
            raise _fail(m, "format", f"{fmt!r}: INT8 weights are read from 'int-quantized' "
                        "checkpoints")
        acts = _ct_activation(a, "int", prefix) if a is not None else {"activation": None}
        return LinearScheme(weight="int8", strategy="channel", group_size=None, symmetric=True,
                            layout=LAYOUT_CT_INT, **acts)
    if w["num_bits"] == 4:
        if a is not None:
            raise _fail(m, f"{prefix}.input_activations", "must be null for 4-bit weights "
                        "(W4A16; W4A8 is not supported)")
        if fmt != "pack-quantized":
            raise _fail(m, "format", f"{fmt!r}: 4-bit weights are read from 'pack-quantized' "
                        "checkpoints")
        if w["strategy"] == "group":
            group = _int(w.get("group_size"), m, f"{prefix}.weights.group_size")
            if group <= 0 or group % 8:
                raise _fail(m, f"{prefix}.weights.group_size", f"must be a positive multiple "
                            f"of 8, got {group}")
        elif w["strategy"] == "channel":
            group = None
        else:
            raise _fail(m, f"{prefix}.weights.strategy", f"{w['strategy']!r}: 4-bit weights "
                        "take 'group' or 'channel' scales")
        actorder = w.get("actorder")
        if actorder not in (None, False, "static", "weight", "group"):
            raise _fail(m, f"{prefix}.weights.actorder", f"{actorder!r} is not supported "
                        "('weight', 'static' and 'group' are)")
        if actorder == "group" and group is None:
            raise _fail(m, f"{prefix}.weights.actorder", "'group' needs strategy 'group'")
        # "group": the groups are scattered over K as each projection's weight_g_idx says
        # (GPTQ's desc_act); "weight" / "static" quantized in act-order, groups contiguous
        return LinearScheme(weight="int4", strategy=w["strategy"], group_size=group,
                            symmetric=bool(sym), activation=None, layout=LAYOUT_CT_PACK,
                            desc_act=actorder == "group")
    raise _fail(m, f"{prefix}.weights.num_bits", f"{w['num_bits']}: integer weights of 4 or 8 "
                "bits are supported")


def _ct_activation(a: dict, weight_type: str, prefix: str) -> dict:
    m = "compressed-tensors"
    if a["type"] != weight_type or a["num_bits"] != 8:
        raise _fail(m, f"{prefix}.input_activations", f"must be 8-bit {weight_type} like the "
                    f"weights, got {a['num_bits']}-bit {a['type']}")
    if not a.get("symmetric", True):
        raise _fail(m, f"{prefix}.input_activations.symmetric", "must be true")
    dynamic = bool(a.get("dynamic", False))
    strategy = a["strategy"]
    if strategy not in ("token", "tensor") or (strategy == "token" and not dynamic):
        raise _fail(m, f"{prefix}.input_activations.strategy", f"{strategy!r} "
                    f"(dynamic={dynamic}): dynamic per-token, dynamic per-tensor or static "
                    "per-tensor activation scales are supported")
    return {"activation": ACT_FP8 if weight_type == "float" else ACT_INT8,
            "act_strategy": strategy, "act_dynamic": dynamic}
