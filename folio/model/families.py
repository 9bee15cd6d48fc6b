"""Model families: each is a few choices over the shared decoder, read from the HF config.

Adding a Llama-like family is one entry here, not a new decoder.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Callable


class MoEScoring(str, Enum):
    """How a router turns its logits into expert scores."""
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"
    # top-k on the raw logits, then a softmax over the k chosen (GPT-OSS)
    TOPK_SOFTMAX = "topk_softmax"


class ExpertActivation(str, Enum):
    """The experts' gated activation: act(gate) * up with the config's act, or GPT-OSS's
    clamped SwiGLU, (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l)."""
    GATED = "gated"
    SWIGLU_OAI = "swiglu_oai"


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP: which layers have one, the routing, the experts' shape."""
    num_experts: int
    top_k: int
    intermediate_size: int           # each routed expert's
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or the dense MLP
    scoring: MoEScoring = MoEScoring.SOFTMAX
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    # DeepSeek-V3: a learned per-expert bias added to the scores for the choice only
    score_correction_bias: bool = False
    # Always-on experts beside the routed ones (Qwen2-MoE: one, behind a sigmoid gate)
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # The router's matmul in float32 whatever the model's dtype (DeepSeek's routers)
    router_float32: bool = False
    # GPT-OSS: biases on the router and on every expert's projections, its clamped SwiGLU,
    # and checkpoints that store the stacked experts transposed ([E, H, 2I], [E, I, H]) with
    # gate and up interleaved column by column
    router_bias: bool = False
    expert_bias: bool = False
    activation: ExpertActivation = ExpertActivation.GATED
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    transposed_interleaved_checkpoint: bool = False


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3; folio/model/mla.py)."""
    q_lora_rank: int | None      # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool        # rotary on interleaved pairs (DeepSeek's checkpoints)
    softmax_scale: float

    @property
    def latent_width(self) -> int:
        """Cache elements per token and layer: the latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


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
    # Mixture-of-experts MLPs (None: every layer dense)
    moe: MoESpec | None = None
    # Multi-head latent attention in place of the usual (None: q/k/v heads)
    mla: MLASpec | None = None
    # Checkpoint layers past num_layers that are multi-token-prediction modules (DeepSeek-V3's
    # MTP), not decoder layers: skipped when loading the model
    num_mtp_layers: int = 0
    # A bidirectional encoder (BERT, RoBERTa, XLM-R: folio/model/encoder.py), run only by the
    # pooling runner; the fields above describe its layers (rms_norm_eps is LayerNorm's eps).
    is_encoder: bool = False

    @property
    def kv_planes(self) -> int:
        """Planes per layer in the cache: K and V, MLA's one latent plane, or none for an
        encoder (its attention sees only the step's own keys: nothing is kept)."""
        if self.is_encoder:
            return 0
        return 1 if self.mla is not None else 2

    @property
    def kv_entry(self) -> tuple[int, int]:
        """(heads, width) of one token's cache entry in one plane of one layer."""
        if self.mla is not None:
            return 1, self.mla.latent_width
        return self.num_kv_heads, self.head_dim


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


def _sparse_layers(cfg: Any, num_layers: int) -> tuple[bool, ...]:
    """Qwen-MoE's placement: every decoder_sparse_step-th layer, minus mlp_only_layers."""
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def _mixtral(cfg: Any) -> ArchSpec:
    spec = _mistral(cfg)
    spec.moe = MoESpec(num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
                       intermediate_size=cfg.intermediate_size,
                       sparse_layers=(True,) * spec.num_layers, renormalize=True)
    return spec


def _qwen2_moe(cfg: Any) -> ArchSpec:
    spec = ArchSpec(**_base(cfg))
    spec.qkv_bias = bool(getattr(cfg, "qkv_bias", True))
    spec.sliding_windows = _qwen_windows(cfg, spec.num_layers)
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    spec.moe = MoESpec(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                       intermediate_size=cfg.moe_intermediate_size,
                       sparse_layers=_sparse_layers(cfg, spec.num_layers),
                       renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
                       shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0)
    return spec


def _qwen3_moe(cfg: Any) -> ArchSpec:
    spec = _qwen3(cfg)
    spec.moe = MoESpec(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                       intermediate_size=cfg.moe_intermediate_size,
                       sparse_layers=_sparse_layers(cfg, spec.num_layers),
                       renormalize=bool(getattr(cfg, "norm_topk_prob", False)))
    return spec


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _mla_spec(cfg: Any, rope_interleave: bool) -> MLASpec:
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    scale = (nope + rope) ** -0.5
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type", "default")) != "default" \
            and params.get("mscale_all_dim"):
        # YaRN's attention temperature, applied to the softmax scale (DeepSeek's rule)
        scale *= _yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return MLASpec(q_lora_rank=getattr(cfg, "q_lora_rank", None), kv_lora_rank=cfg.kv_lora_rank,
                   qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=cfg.v_head_dim,
                   rope_interleave=rope_interleave, softmax_scale=scale)


def _deepseek(cfg: Any, v3: bool) -> ArchSpec:
    spec = ArchSpec(**_base(cfg))
    spec.head_dim = cfg.qk_rope_head_dim  # the rotary part's width (RotaryEmbedding's)
    spec.num_kv_heads = 1                 # one latent per token (kv_entry)
    spec.qkv_bias = spec.o_bias = bool(getattr(cfg, "attention_bias", False))
    spec.sliding_windows = (None,) * spec.num_layers
    spec.mla = _mla_spec(cfg, bool(getattr(cfg, "rope_interleave", True)) if v3 else True)
    first_dense = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
    experts = cfg.n_routed_experts
    groups = int(getattr(cfg, "n_group", None) or 1)
    if v3:
        method = "noaux_tc"
    else:
        method = getattr(cfg, "topk_method", None) or "greedy"
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"DeepSeek topk_method {method!r} is not supported")
    grouped = method != "greedy" and groups > 1
    spec.moe = MoESpec(
        num_experts=experts, top_k=cfg.num_experts_per_tok,
        intermediate_size=cfg.moe_intermediate_size,
        sparse_layers=tuple(i >= first_dense for i in range(spec.num_layers)),
        scoring=MoEScoring.SIGMOID if v3 else MoEScoring.SOFTMAX,
        # transformers' DeepSeek-V2 never renormalizes (whatever norm_topk_prob says)
        renormalize=bool(getattr(cfg, "norm_topk_prob", False)) if v3 else False,
        routed_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0),
        num_groups=groups if grouped else 1,
        topk_groups=int(getattr(cfg, "topk_group", None) or 1) if grouped else 1,
        score_correction_bias=v3,
        shared_expert_intermediate_size=cfg.moe_intermediate_size
        * int(getattr(cfg, "n_shared_experts", 0) or 0),
        router_float32=True)
    spec.num_mtp_layers = int(getattr(cfg, "num_nextn_predict_layers", None)
                              or getattr(cfg, "num_mtp_layers", 0) or 0) if v3 else 0
    return spec


def _gpt_oss(cfg: Any) -> ArchSpec:
    """GPT-OSS: biased q/k/v/o, attention sinks, sliding layers alternating with full ones,
    YaRN rotary; every MLP a mixture of experts with biases and a clamped SwiGLU."""
    spec = ArchSpec(**_base(cfg))
    spec.qkv_bias = spec.o_bias = bool(getattr(cfg, "attention_bias", True))
    spec.attention_sinks = True
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * spec.num_layers)
    spec.sliding_windows = tuple(cfg.sliding_window if t == "sliding_attention" else None
                                 for t in types)
    spec.moe = MoESpec(
        num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
        intermediate_size=cfg.intermediate_size, sparse_layers=(True,) * spec.num_layers,
        scoring=MoEScoring.TOPK_SOFTMAX, renormalize=False, router_bias=True,
        expert_bias=True, activation=ExpertActivation.SWIGLU_OAI,
        swiglu_alpha=float(getattr(cfg, "swiglu_alpha", 1.702)),
        swiglu_limit=float(getattr(cfg, "swiglu_limit", 7.0)),
        transposed_interleaved_checkpoint=True)
    return spec


def _deepseek_v2(cfg: Any) -> ArchSpec:
    return _deepseek(cfg, v3=False)


def _deepseek_v3(cfg: Any) -> ArchSpec:
    return _deepseek(cfg, v3=True)


def encoder_position_offset(cfg: Any) -> int:
    """What an encoder adds to a token's position to find its row of the position table:
    RoBERTa and XLM-R count positions from pad_token_id + 1 (the rows before belong to
    padding), BERT from 0."""
    archs = getattr(cfg, "architectures", None) or []
    roberta = getattr(cfg, "model_type", None) in ("roberta", "xlm-roberta") or any(
        a.startswith(("Roberta", "XLMRoberta")) for a in archs)
    return int(cfg.pad_token_id) + 1 if roberta else 0


def _encoder(cfg: Any) -> ArchSpec:
    """BERT, RoBERTa, XLM-R: post-LN layers with biases everywhere, absolute positions."""
    position_type = getattr(cfg, "position_embedding_type", None) or "absolute"
    if position_type != "absolute":
        raise ValueError(f"position_embedding_type {position_type!r} is not supported "
                         "(absolute only)")
    heads = cfg.num_attention_heads
    return ArchSpec(
        hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers, num_heads=heads,
        num_kv_heads=heads, head_dim=cfg.hidden_size // heads,
        intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.layer_norm_eps,
        # the longest input: RoBERTa's table starts past the padding rows
        max_position_embeddings=cfg.max_position_embeddings - encoder_position_offset(cfg),
        tie_word_embeddings=False, qkv_bias=True, o_bias=True, mlp_bias=True,
        hidden_act=cfg.hidden_act, sliding_windows=(None,) * cfg.num_hidden_layers,
        is_encoder=True)


FAMILIES: dict[str, Callable[[Any], ArchSpec]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
    "Phi3ForCausalLM": _phi3,
    "MixtralForCausalLM": _mixtral,
    "Qwen2MoeForCausalLM": _qwen2_moe,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "DeepseekV2ForCausalLM": _deepseek_v2,
    "DeepseekV3ForCausalLM": _deepseek_v3,
    "GptOssForCausalLM": _gpt_oss,
    "BertModel": _encoder,
    "RobertaModel": _encoder,
    "XLMRobertaModel": _encoder,
    "BertForSequenceClassification": _encoder,
    "RobertaForSequenceClassification": _encoder,
    "XLMRobertaForSequenceClassification": _encoder,
}

_SEQ_CLS = "ForSequenceClassification"


def _sequence_classifier(arch: str) -> Callable[[Any], ArchSpec] | None:
    """A decoder's XForSequenceClassification: XForCausalLM's layers (Gemma 3's text-only
    XTextFor... too) with a classifier in place of the language-model head, which is therefore
    not built (tie_word_embeddings: DecoderLM makes no lm_head)."""
    if not arch.endswith(_SEQ_CLS):
        return None
    stem = arch.removesuffix(_SEQ_CLS)
    for causal in (stem + "ForCausalLM", stem.removesuffix("Text") + "ForCausalLM"):
        if causal in FAMILIES:
            family = FAMILIES[causal]
            return lambda cfg: replace(family(cfg), tie_word_embeddings=True)
    return None


# Vision-language models (issue 24): a vision encoder in front of one of the decoders above.
# The decoder paths read the text config (`decoder_config`); the vision part is described in
# its `vision_language` attribute.
VISION_LANGUAGE_ARCHS = {"LlavaForConditionalGeneration": "llava",
                         "Qwen2VLForConditionalGeneration": "qwen2_vl",
                         "Qwen2_5_VLForConditionalGeneration": "qwen2_vl"}
_DECODER_ARCH_OF_TEXT_MODEL = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM", "qwen2_vl_text": "Qwen2ForCausalLM",
                               "qwen2_5_vl_text": "Qwen2ForCausalLM"}


def decoder_config(cfg: Any) -> Any:
    """The config every decoder path reads: a vision-language model's text config (its
    architecture named as the decoder family's, and `vision_language` set to what the vision
    part needs: the kind, the image token, the vision config and the projector's settings);
    any other config as it is."""
    architectures = getattr(cfg, "architectures", None) or []
    kind = next((VISION_LANGUAGE_ARCHS[a] for a in architectures
                 if a in VISION_LANGUAGE_ARCHS), None)
    if kind is None:
        return cfg
    text = cfg.text_config
    arch = _DECODER_ARCH_OF_TEXT_MODEL.get(getattr(text, "model_type", None))
    if arch is None:
        raise ValueError(f"{architectures[0]} with a {getattr(text, 'model_type', '?')} "
                         f"decoder is not supported; decoders: "
                         f"{sorted(_DECODER_ARCH_OF_TEXT_MODEL)}")
    text.architectures = [arch]
    vision = {"kind": kind, "architecture": architectures[0],
              "vision_config": cfg.vision_config}
    if kind == "llava":
        vision.update(
            image_token_index=cfg.image_token_index,
            vision_feature_layer=cfg.vision_feature_layer,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy,
            projector_hidden_act=getattr(cfg, "projector_hidden_act", "gelu"),
            multimodal_projector_bias=getattr(cfg, "multimodal_projector_bias", True))
    else:
        # Qwen2-VL and Qwen2.5-VL (the same prompts and positions; their vision
        # transformers differ): images between <|vision_start|> and <|vision_end|>; positions in three
        # rows (M-RoPE: time, height, width) over sections of the rotary frequencies
        vision.update(
            image_token_index=cfg.image_token_id,
            vision_start_token_id=cfg.vision_start_token_id,
            vision_end_token_id=getattr(cfg, "vision_end_token_id", None),
            spatial_merge_size=cfg.vision_config.spatial_merge_size)
    text.vision_language = vision
    return text


# A vision-language checkpoint's names for its decoder's weights -> the decoder's own names
# (transformers 5's layout and the older llava-hf one); its vision weights are not the
# decoder's.
_DECODER_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."), ("language_model.", ""))
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                    "multi_modal_projector.", "model.visual.", "visual.")


def decoder_weight_name(name: str) -> str | None:
    """A vision-language checkpoint's tensor name as its decoder names it; None for the
    vision tower's and the projector's (loaded apart)."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, replacement in _DECODER_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


def arch_spec_from_hf_config(cfg: Any) -> ArchSpec:
    architectures = getattr(cfg, "architectures", None) or []
    for arch in architectures:
        family = FAMILIES.get(arch) or _sequence_classifier(arch)
        if family is not None:
            return family(cfg)
    raise ValueError(
        f"model architecture {architectures or getattr(cfg, 'model_type', '?')} is not supported; "
        f"supported: {sorted(FAMILIES)}, and the decoders' *{_SEQ_CLS}")
