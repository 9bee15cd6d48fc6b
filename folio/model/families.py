"""Model families: each is a few choices over the shared decoder, read from the HF config.

Adding a Llama-like family is one entry here, not a new decoder.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class ArchSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    # Sliding window per layer (None = full attention on that layer).
    sliding_windows: tuple[int | None, ...] = ()


def _base(cfg: Any) -> dict:
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return dict(
        hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
        intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        hidden_act=getattr(cfg, "hidden_act", "silu"),
    )


def _llama(cfg: Any) -> ArchSpec:
    spec = ArchSpec(**_base(cfg))
    spec.qkv_bias = spec.o_bias = bool(getattr(cfg, "attention_bias", False))
    spec.mlp_bias = bool(getattr(cfg, "mlp_bias", False))
    spec.sliding_windows = (None,) * spec.num_layers
    return spec


def _mistral(cfg: Any) -> ArchSpec:
    spec = ArchSpec(**_base(cfg))
    window = getattr(cfg, "sliding_window", None)
    spec.sliding_windows = (window,) * spec.num_layers
    return spec


def _qwen_windows(cfg: Any, num_layers: int) -> tuple[int | None, ...]:
    if not getattr(cfg, "use_sliding_window", False) or not getattr(cfg, "sliding_window", None):
        return (None,) * num_layers
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        return tuple(cfg.sliding_window if t == "sliding_attention" else None for t in layer_types)
    # Older configs: layers from max_window_layers on use the window.
    first = getattr(cfg, "max_window_layers", num_layers)
    return tuple(cfg.sliding_window if i >= first else None for i in range(num_layers))


def _qwen2(cfg: Any) -> ArchSpec:
    spec = ArchSpec(**_base(cfg))
    spec.qkv_bias = True   # Qwen2 always has q/k/v biases, and no o_proj bias
    spec.sliding_windows = _qwen_windows(cfg, spec.num_layers)
    return spec


def _qwen3(cfg: Any) -> ArchSpec:
    spec = ArchSpec(**_base(cfg))
    spec.qkv_bias = spec.o_bias = bool(getattr(cfg, "attention_bias", False))
    spec.qk_norm = True    # per-head RMSNorm on q and k before rotary
    spec.sliding_windows = _qwen_windows(cfg, spec.num_layers)
    return spec


FAMILIES: dict[str, Callable[[Any], ArchSpec]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
}


def arch_spec_from_hf_config(cfg: Any) -> ArchSpec:
    architectures = getattr(cfg, "architectures", None) or []
    for arch in architectures:
        if arch in FAMILIES:
            return FAMILIES[arch](cfg)
    raise ValueError(
        f"model architecture {architectures or getattr(cfg, 'model_type', '?')} is not supported; "
        f"supported: {sorted(FAMILIES)}")
