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
    # Rotary parameters per layer (Gemma 3: a local base on sliding layers, the global one
    # on full ones); empty = the config's one set for every layer.
    layer_rope_parameters: tuple[dict, ...] = ()
    # Gemma: embeddings scaled by sqrt(hidden); norm weights stored as w for a scale of
    # 1 + w (norm_offset 1.0, added at load); "sandwich" layers with a norm after attention
    # and around the MLP; attention scaled by query_pre_attn_scalar^-0.5 (None: head_dim's);
    # Gemma 2's tanh soft-capping of the final logits (None: none).
    embed_scale: float = 1.0
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    attn_scale: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 2's tanh soft-capping of the attention scores, after scaling, before the mask and
    # softmax (None: none); every attention backend applies it.
    attn_logit_softcapping: float | None = None
    # GPT-OSS: a learned logit per query head (checkpoint `self_attn.sinks`) that joins each
    # softmax's denominator and carries no value.
    attention_sinks: bool = False


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
        hidden_act=getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None)
        or "silu",
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


def _gemma_layers(cfg: Any, spec: ArchSpec, default_types: list[str]) -> list[str]:
    """What Gemma 2 and 3 share: sandwich norms, (1 + w) norm weights, scaled embeddings,
    query_pre_attn_scalar, both soft caps, and sliding layers by `layer_types` (`default_types`
    when the config has none). Returns the layer types."""
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention (an encoder variant) is not supported")
    spec.qkv_bias = spec.o_bias = bool(getattr(cfg, "attention_bias", False))
    spec.sandwich_norms = True
    spec.norm_offset = 1.0
    spec.embed_scale = float(cfg.hidden_size) ** 0.5
    spec.attn_scale = float(cfg.query_pre_attn_scalar) ** -0.5
    spec.final_logit_softcapping = getattr(cfg, "final_logit_softcapping", None) or None
    spec.attn_logit_softcapping = getattr(cfg, "attn_logit_softcapping", None) or None
    types = list(getattr(cfg, "layer_types", None) or default_types)
    spec.sliding_windows = tuple(cfg.sliding_window if t == "sliding_attention" else None
                                 for t in types)
    return types


def _gemma2(cfg: Any) -> ArchSpec:
    """Gemma 2: Gemma 3's layer without q/k norms and with one rotary table; attention
    scores soft-capped; sliding layers first and every other one after (transformers'
    default layer_types: sliding where (i + 1) is odd)."""
    spec = ArchSpec(**_base(cfg))
    _gemma_layers(cfg, spec, ["sliding_attention" if (i + 1) % 2 else "full_attention"
                              for i in range(spec.num_layers)])
    return spec


def _gemma3(cfg: Any) -> ArchSpec:
    """Gemma 3 (text): q/k norms, sandwich norms, (1 + w) norm weights, scaled embeddings,
    sliding layers interleaved with full ones, each kind with its own rotary base."""
    spec = ArchSpec(**_base(cfg))
    spec.qk_norm = True
    types = _gemma_layers(cfg, spec, ["full_attention"] * spec.num_layers)
    # Gemma 3's config keeps attn_logit_softcapping (None in the published checkpoints: q/k
    # norms replaced the cap), and transformers' Gemma 3 never applies it; neither do we, so
    # a config that sets it runs as the reference runs it.
    spec.attn_logit_softcapping = None
    rope = getattr(cfg, "rope_parameters", None) or {}
    if all(t in rope for t in set(types)):
        spec.layer_rope_parameters = tuple(dict(rope[t]) for t in types)
    return spec


def _phi3(cfg: Any) -> ArchSpec:
    """Phi-3: Llama's layer with q/k/v and gate/up fused in the checkpoint (loaded whole into
    the merged projections, whose shard order is the same), partial rotary, one sliding
    window on every layer when the config sets one."""
    spec = ArchSpec(**_base(cfg))
    window = getattr(cfg, "sliding_window", None)
    spec.sliding_windows = (window,) * spec.num_layers
    return spec


FAMILIES: dict[str, Callable[[Any], ArchSpec]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
    "Phi3ForCausalLM": _phi3,
}


def arch_spec_from_hf_config(cfg: Any) -> ArchSpec:
    architectures = getattr(cfg, "architectures", None) or []
    for arch in architectures:
        if arch in FAMILIES:
            return FAMILIES[arch](cfg)
    raise ValueError(
        f"model architecture {architectures or getattr(cfg, 'model_type', '?')} is not supported; "
        f"supported: {sorted(FAMILIES)}")
