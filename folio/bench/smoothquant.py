"""SmoothQuant (Xiao et al. 2022, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models") for the checkpoint writers: a float checkpoint whose
activations are easier to quantize per token, with the same float outputs (the arithmetic;
quant_checkpoints.write_smoothed reads and writes the checkpoints).

Per-token activation quantization (W8A8) loses most where a few input channels carry values
far larger than the rest: the one scale per token is set by them and the others round to a
few levels. SmoothQuant moves that range into the weights: for each projection input channel
j, s_j = max|X_j|^a / max|W_j|^(1-a) (`strength` a, llm-compressor's smoothing_strength; X
from calibration text, W over the projections that read X), the projections' columns j are
multiplied by s_j and what produces X divided by it, so the product is unchanged in exact
arithmetic. What produces X, by llm-compressor's default mappings for Llama-style models:
- q/k/v read input_layernorm's output: its weight is divided by s;
- gate/up read post_attention_layernorm's: likewise;
- down reads silu(gate) * up: up_proj's rows are divided by s.
Written here from the paper and those mappings. On SmolLM2-135M it took the W8A8 INT8
perplexity from +4.1 % to +0.6 % of the float model's (docs/benchmarks.md); the channel into
down_proj carries most of that (without the down mapping: +4.3 %).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Families whose layers are pre-norm with plain RMSNorm weights (x * w) before the attention
# and the MLP, and a SiLU-gated MLP: the mappings above hold. (Gemma's norms scale by 1 + w
# and sit around the blocks; Phi-3's projections are fused.)
SMOOTHABLE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _mappings(layer: int) -> list[tuple[str, list[str], str, bool]]:
    """(statistic key, projections reading the input, what produces it, whether that is a
    norm's weight (else a projection's rows))."""
    p = f"model.layers.{layer}."
    return [
        (p + "qkv", [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
         p + "input_layernorm.weight", True),
        (p + "gate_up", [p + f"mlp.{x}_proj.weight" for x in ("gate", "up")],
         p + "post_attention_layernorm.weight", True),
        (p + "down", [p + "mlp.down_proj.weight"], p + "mlp.up_proj.weight", False),
    ]


def activation_absmax(src: str, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per input channel, the largest |x| each mapping's projections read over `tokens`
    (int64 [samples, len]): transformers runs `src` in float32, 8 samples at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    stats: dict[str, torch.Tensor] = {}

    def hook(key: str):
        def pre_hook(module, args) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).abs().amax(0).float()
            stats[key] = torch.maximum(stats[key], x) if key in stats else x
        return pre_hook

    handles = []
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        handles += [layer.self_attn.q_proj.register_forward_pre_hook(hook(p + "qkv")),
                    layer.mlp.gate_proj.register_forward_pre_hook(hook(p + "gate_up")),
                    layer.mlp.down_proj.register_forward_pre_hook(hook(p + "down"))]
    try:
        with torch.no_grad():
            for start in range(0, tokens.shape[0], 8):
                model.model(input_ids=tokens[start:start + 8], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return stats


def smooth_tensors(tensors: dict[str, torch.Tensor], stats: dict[str, torch.Tensor],
                   num_layers: int, strength: float) -> dict[str, torch.Tensor]:
    """`tensors` (a checkpoint's, HF names) with every layer's mappings smoothed at `strength`
    from the activation maxima `stats` (activation_absmax); a new dict, the inputs untouched.
    Each changed tensor keeps its dtype."""
    import torch

    out = dict(tensors)
    for layer in range(num_layers):
        for key, readers, producer, is_norm in _mappings(layer):
            act = stats[key].clamp(min=1e-5)
            weight = torch.cat([out[name].float() for name in readers]).abs().amax(0)
            scale = (act.pow(strength) / weight.clamp(min=1e-5).pow(1 - strength)).clamp(min=1e-5)
            for name in readers:
                out[name] = (out[name].float() * scale).to(out[name].dtype)
            shape = scale if is_norm else scale[:, None]
            out[producer] = (out[producer].float() / shape).to(out[producer].dtype)
    return out


def check_smoothable(config: dict) -> None:
    """Refuse (ValueError naming smoothing_strength) a model the mappings do not describe."""
    archs = config.get("architectures") or []
    if not any(a in SMOOTHABLE for a in archs):
        raise ValueError(f"smoothing_strength: SmoothQuant's mappings are written for "
                         f"{SMOOTHABLE}, not architectures {archs}")
