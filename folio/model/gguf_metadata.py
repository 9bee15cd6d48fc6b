"""What a llama-family GGUF file says about its model, without its weights: the Hugging Face
style config, the chat template, the tokenizer. Torch-free (numpy and the `gguf` package), so
the front end (the API process) can read a GGUF model's config; gguf_loader.py builds the
weights' state dict on top of this.

We use the `gguf` package only for parsing the container and for dequantizing
blocks; the mapping to Hugging Face names, the config reconstruction and the
undoing of llama.cpp's layout changes live here and in gguf_loader.py so that
folio does not depend on the (slow, model-instantiating) GGUF path inside
transformers.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["GGUFMetadata", "read_gguf_metadata", "load_gguf_tokenizer", "SUPPORTED_ARCHITECTURES"]


@dataclass
class GGUFMetadata:
    """Everything folio needs from a GGUF file but its weights, in Hugging Face vocabulary."""

    hf_config: dict[str, Any]
    chat_template: str | None
    # Metadata that doesn't belong in config.json: end-of-turn ids beyond eos_token_id (for
    # generation_config.json and the engine's stop ids), and the model's name.
    extra_eos_token_ids: list[int] = field(default_factory=list)
    name: str | None = None


@dataclass(frozen=True)
class _ArchSpec:
    hf_architecture: str
    model_type: str
    # llama.cpp's converter reorders Q/K rows of LlamaModel checkpoints so that
    # its "normal" (interleaved pairs) rotary kernel can be used; HF uses the
    # rotate-half layout. Qwen models are converted with NEOX rope and are left
    # untouched (transformers' GGUF loader only un-permutes "llama" too).
    qk_permuted: bool
    # llama.cpp's Gemma converter stores norm weights as 1 + w (its norms scale by the
    # weight); Hugging Face's Gemma stores w (its norms scale by 1 + w): subtracted on read.
    norm_shift: float = 0.0
    # GGUF layer tensor names whose Hugging Face name differs from the llama mapping.
    layer_names: tuple[tuple[str, str], ...] = ()


_ARCHS: dict[str, _ArchSpec] = {
    "llama": _ArchSpec("LlamaForCausalLM", "llama", qk_permuted=True),
    "qwen2": _ArchSpec("Qwen2ForCausalLM", "qwen2", qk_permuted=False),
    "qwen3": _ArchSpec("Qwen3ForCausalLM", "qwen3", qk_permuted=False),
    # Gemma 3 text: sandwich norms (ffn_norm is the norm before the MLP here)
    "gemma3": _ArchSpec("Gemma3ForCausalLM", "gemma3_text", qk_permuted=False, norm_shift=1.0,
                        layer_names=(("ffn_norm", "pre_feedforward_layernorm"),
                                     ("post_attention_norm", "post_attention_layernorm"),
                                     ("post_ffw_norm", "post_feedforward_layernorm"))),
}
# llama.cpp's Gemma 3 constants that its GGUF files do not carry: every sixth layer is full
# attention, the others sliding; sliding layers rotate with base 10,000; queries are scaled
# by head_dim^-0.5 (all sizes but 27B, which GGUF cannot tell apart by name here).
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHS)

# GGUF per-layer tensor suffix -> HF per-layer parameter suffix.
_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Consumed into the config (llama3 rope scaling), not a parameter.
ROPE_FREQS = "rope_freqs.weight"

_MISSING = object()


# --------------------------------------------------------------------------- #
# Metadata helpers
# --------------------------------------------------------------------------- #


# The last file parsed, by (real path, size, mtime): the front end reads a file's metadata
# and the worker its tensors (gguf_reader.py parses a 262,144-token vocabulary in ~0.1 s;
# gguf-py's reader took ~8 s for Gemma 3's on this project's 2-core machine).
_LAST_READER: tuple[tuple, Any] | None = None


def _open_reader(path: str):
    """Parse the container, turning any low-level failure into a ValueError.

    The reader memory-maps the file and trusts its offsets, so garbage or a
    truncated copy surfaces as struct/index/reshape errors deep inside it;
    callers should only have to catch one, readable, exception type. The last
    file parsed is kept and reused while it is unchanged (size and mtime).
    """
    global _LAST_READER
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    if _LAST_READER is not None and _LAST_READER[0] == key:
        return _LAST_READER[1]
    reader = _parse(path)
    _LAST_READER = (key, reader)
    return reader


def _parse(path: str):
    from folio.model.gguf_reader import GGUFFile

    try:
        reader = GGUFFile(path)
    except Exception as exc:  # noqa: BLE001 - deliberately broad, see docstring
        raise ValueError(
            f"{path}: not a valid GGUF file (corrupt or truncated?): {type(exc).__name__}: {exc}"
        ) from exc
    _check_tensor_extents(reader, path)
    return reader


def _check_tensor_extents(reader, path: str) -> None:
    """Make sure each tensor's bytes really are in the file.

    A copy truncated inside the data section can still parse (the memmap slice
    simply comes back short), so compare against what the type requires.
    """
    from gguf import GGML_QUANT_SIZES

    file_size = os.path.getsize(path)
    for t in reader.tensors:
        block_size, type_size = GGML_QUANT_SIZES[t.tensor_type]
        n_elems = int(np.prod(t.shape, dtype=np.int64))
        expected = n_elems // block_size * type_size
        if t.data.nbytes != expected or t.data_offset + expected > file_size:
            raise ValueError(
                f"{path}: tensor {t.name!r} needs {expected} bytes at offset {t.data_offset} "
                f"but the file has {file_size} bytes (truncated or corrupt GGUF)"
            )


def _meta(reader, key: str, default: Any = _MISSING) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return default
    value = f.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def _as_int(value: Any, key: str) -> int:
    # head_count_kv may be a per-layer array in some files; folio needs one value.
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ValueError(f"GGUF metadata {key!r} varies per layer ({value}); not supported")
        value = value[0]
    return int(value)


# --------------------------------------------------------------------------- #
# Tensor names and data
# --------------------------------------------------------------------------- #


def dequantize_array(t, path: str) -> np.ndarray:
    """One tensor as a float32 array that owns its memory."""
    from gguf.quants import dequantize

    try:
        arr = dequantize(t.data, t.tensor_type)
    except Exception as exc:  # noqa: BLE001 - e.g. a quant type gguf-py can't decode
        raise ValueError(
            f"{path}: cannot dequantize tensor {t.name!r} of type {t.tensor_type.name}: {exc}"
        ) from exc
    # F32 tensors come back as read-only views into the memmap; copy so the
    # state dict owns its memory and the file can be closed/replaced.
    if isinstance(arr, np.memmap) or not arr.flags.writeable or arr.dtype != np.float32:
        arr = np.array(arr, dtype=np.float32)
    return np.ascontiguousarray(arr)


def hf_tensor_name(gguf_name: str, n_layers: int, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None:
        return None
    layer, part, kind = int(m.group(1)), m.group(2), m.group(3)
    names = _layer_names(arch)
    if part not in names or layer >= n_layers:
        return None
    return f"model.layers.{layer}.{names[part]}.{kind}"


def _layer_names(arch: str) -> dict[str, str]:
    spec = _ARCHS.get(arch)
    if spec is None or not spec.layer_names:
        return _LAYER_NAMES
    return {**_LAYER_NAMES, **dict(spec.layer_names)}


# --------------------------------------------------------------------------- #
# Rope scaling
# --------------------------------------------------------------------------- #


def _llama3_factors(
    head_dim: int, theta: float, factor: float, low: float, high: float, orig_ctx: int
) -> np.ndarray:
    """Per-frequency divisors llama.cpp stores in rope_freqs for llama3 scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    out = np.empty_like(inv_freq)
    for i, wl in enumerate(wavelen):
        if wl < orig_ctx / high:
            out[i] = 1.0
        elif wl > orig_ctx / low:
            out[i] = factor
        else:
            smooth = (orig_ctx / wl - low) / (high - low)
            out[i] = 1.0 / ((1 - smooth) / factor + smooth)
    return out


def _rope_scaling_from_freqs(freqs: np.ndarray, head_dim: int, theta: float, orig_ctx: int | None) -> dict | None:
    """Recover HF's llama3 rope_scaling from the rope_freqs tensor.

    The tensor only stores the resulting divisors, so we try the parameters all
    published Llama 3.x checkpoints use and verify they reproduce it exactly,
    rather than silently guessing.
    """
    freqs = np.asarray(freqs, dtype=np.float64).reshape(-1)
    if np.allclose(freqs, 1.0):
        return None
    factor = float(freqs.max())
    for ctx in [c for c in (orig_ctx, 8192) if c]:
        for low, high in ((1.0, 4.0),):
            ref = _llama3_factors(head_dim, theta, factor, low, high, ctx)
            if ref.shape == freqs.shape and np.allclose(ref, freqs, rtol=1e-4, atol=1e-6):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": int(ctx),
                }
    raise ValueError("rope_freqs tensor does not match llama3 rope scaling; unsupported rope variant")


def _rope_scaling_from_meta(reader, arch: str) -> dict | None:
    kind = _meta(reader, f"{arch}.rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    factor = float(_meta(reader, f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        out: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        orig = _meta(reader, f"{arch}.rope.scaling.original_context_length", None)
        if orig is not None:
            out["original_max_position_embeddings"] = int(orig)
        return out
    raise ValueError(f"unsupported rope scaling type {kind!r}")


# --------------------------------------------------------------------------- #
# Public API
# --------------------------------------------------------------------------- #


def open_gguf(path: str):
    """(reader, architecture, arch spec) of a supported GGUF file; ValueError naming the file
    otherwise."""
    reader = _open_reader(path)
    try:
        arch = _meta(reader, "general.architecture")
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    spec = _ARCHS.get(arch)
    if spec is None:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; folio supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return reader, arch, spec


def read_gguf_metadata(path: str) -> GGUFMetadata:
    """Parse `path`'s metadata (and tensor names and shapes, not their data): the HF-layout
    config, the chat template and the extra end-of-turn ids. Raises ValueError for a file
    folio cannot run (unsupported architecture or tensors, corrupt or truncated)."""
    return read_with(path, metadata_from_reader)


def read_with(path: str, build: Any) -> Any:
    """Open `path` and run build(reader, path, arch, spec); a ValueError names the file."""
    path = os.fspath(path)
    reader, arch, spec = open_gguf(path)
    try:
        return build(reader, path, arch, spec)
    except ValueError as exc:
        if path in str(exc):
            raise
        raise ValueError(f"{path}: {exc}") from exc


def metadata_from_reader(reader, path: str, arch: str, spec: _ArchSpec) -> GGUFMetadata:
    tensors = {t.name: t for t in reader.tensors}
    n_layers = _as_int(_meta(reader, f"{arch}.block_count"), "block_count")
    n_heads = _as_int(_meta(reader, f"{arch}.attention.head_count"), "head_count")
    n_kv = _as_int(_meta(reader, f"{arch}.attention.head_count_kv", n_heads), "head_count_kv")
    hidden = _as_int(_meta(reader, f"{arch}.embedding_length"), "embedding_length")

    if "token_embd.weight" not in tensors or "blk.0.attn_q.weight" not in tensors:
        raise ValueError("GGUF is missing token_embd/attn_q tensors; not a llama-family decoder")
    # The real head_dim is what Q's rows say: key_length is optional and
    # rope.dimension_count may in principle be a partial-rotary width.
    q_rows = int(tensors["blk.0.attn_q.weight"].shape[-1])
    head_dim = _as_int(_meta(reader, f"{arch}.attention.key_length", q_rows // n_heads), "key_length")
    # GGUF shapes are innermost-first: (in_features, out_features) -> rows are [-1].
    vocab = int(tensors["token_embd.weight"].shape[-1])
    theta = float(_meta(reader, f"{arch}.rope.freq_base", 10000.0))

    rope_scaling = _rope_scaling_from_meta(reader, arch)
    if ROPE_FREQS in tensors:
        freqs = dequantize_array(tensors[ROPE_FREQS], path)
        orig = _meta(reader, f"{arch}.rope.scaling.original_context_length", None)
        rope_scaling = _rope_scaling_from_freqs(freqs, head_dim, theta, orig) or rope_scaling

    cfg: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": _as_int(_meta(reader, f"{arch}.feed_forward_length"), "feed_forward_length"),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": _as_int(_meta(reader, f"{arch}.context_length", 4096), "context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    if spec.model_type in ("llama", "qwen3"):
        # Qwen2 hard-codes qkv bias; llama/qwen3 make it a config switch.
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if spec.model_type == "llama":
        cfg["mlp_bias"] = "blk.0.ffn_gate.bias" in tensors
    if spec.model_type in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
    if spec.model_type == "gemma3_text":
        _gemma3_config(cfg, reader, arch, rope_scaling)
    for gkey, hkey in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        v = _meta(reader, f"tokenizer.ggml.{gkey}_token_id", None)
        if v is not None:
            cfg[hkey] = int(v)

    unknown = [name for name in tensors
               if name != ROPE_FREQS and hf_tensor_name(name, n_layers, arch) is None]
    if unknown:
        # An unexpected tensor means a variant (MoE, extra norms, ...) we would
        # otherwise silently drop and then run a wrong model.
        shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        raise ValueError(f"unsupported tensors in {arch} GGUF: {shown}")

    extra_eos = [
        int(v)
        for k in ("eot", "eom")
        if (v := _meta(reader, f"tokenizer.ggml.{k}_token_id", None)) is not None
    ]
    template = _meta(reader, "tokenizer.chat_template", None)
    return GGUFMetadata(
        hf_config=cfg,
        chat_template=template,
        extra_eos_token_ids=extra_eos,
        name=_meta(reader, "general.name", None),
    )


def _gemma3_config(cfg: dict[str, Any], reader, arch: str, rope_scaling: dict | None) -> None:
    """Gemma 3's Hugging Face config keys from its GGUF metadata and llama.cpp's constants."""
    n_layers = cfg["num_hidden_layers"]
    cfg.pop("hidden_act")
    cfg.pop("rope_theta")
    cfg.pop("rope_scaling", None)
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    cfg["sliding_window"] = _as_int(_meta(reader, f"{arch}.attention.sliding_window", 4096),
                                    "sliding_window")
    cfg["layer_types"] = ["full_attention" if (i + 1) % _GEMMA3_SLIDING_PATTERN == 0
                          else "sliding_attention" for i in range(n_layers)]
    full = {"rope_type": "default", "rope_theta": float(_meta(reader, f"{arch}.rope.freq_base",
                                                               1_000_000.0))}
    if rope_scaling is not None:
        full.update(rope_scaling)
    cfg["rope_parameters"] = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_BASE}}
    cfg["final_logit_softcapping"] = None
    cfg["attn_logit_softcapping"] = None


def load_gguf_tokenizer(path: str, *, chat_template: str | None = None):
    """A transformers fast tokenizer rebuilt from the GGUF's tokenizer metadata.

    transformers already copies `tokenizer.chat_template` into the tokenizer;
    `chat_template` lets a caller that has parsed the file (read_gguf_metadata) pin it
    explicitly without paying for a second metadata parse here.
    """
    from transformers import AutoTokenizer

    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    cached = _tokenizer_cache_dir(path)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        tok = AutoTokenizer.from_pretrained(cached)
    else:
        try:
            tok = AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                gguf_file=os.path.basename(path))
        except Exception:
            # Re-diagnose with our reader so a corrupt file gives a ValueError
            # naming it; if the container is fine, transformers' error stands.
            _open_reader(path)
            raise
        _save_tokenizer(tok, cached)
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def _tokenizer_cache_dir(path: str) -> str:
    """Where the tokenizer converted from this GGUF file is kept: transformers parses the
    whole file again and rebuilds the merges for it (~24 s for a 262,144-token vocabulary
    on a 2-core machine); a saved tokenizer.json loads in well under a second. Keyed by the
    file's real path, size and mtime."""
    import hashlib

    from folio.model.cache_dir import folio_cache_dir
    stat = os.stat(path)
    key = f"{os.path.realpath(path)}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return os.path.join(folio_cache_dir(), "gguf-tokenizers", digest)


def _save_tokenizer(tokenizer: Any, target: str) -> None:
    """Best effort (a read-only cache directory only costs the next start its time); written
    beside the target and renamed, so a concurrent reader never sees half a directory."""
    import shutil
    import tempfile
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(target))
        tokenizer.save_pretrained(staging)
        try:
            os.replace(staging, target)
        except OSError:          # another process saved it first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError:
        return
