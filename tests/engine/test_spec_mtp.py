"""DeepSeek-V3's multi-token-prediction module as the `mtp` proposer, on a tiny random
DeepSeek-V3 whose checkpoint gets one MTP module (model.layers.{L}.*, random): every draft the
engine makes equals a reference built from transformers' own DeepseekV3DecoderLayer (no KV
cache: each draft recomputed over the whole context from transformers' final hidden states
of the target), and the answers equal the engine without speculation, greedy and seeded. A
model without MTP layers is refused."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_utils import load_hf_model
from test_spec_eagle import _make, check_drafts_and_outputs


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def add_mtp_module(src: str, dst: Path, seed: int = 11) -> tuple[str, dict, torch.nn.Module]:
    """A copy of `src` with one random MTP module after its layers; returns (path, the
    module's extra tensors by short name, transformers' decoder layer holding its layer)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    shutil.copytree(src, dst)
    cfg = AutoConfig.from_pretrained(src)
    L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    torch.manual_seed(seed)
    layer = DeepseekV3DecoderLayer(cfg, layer_idx=L).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
        layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(
            layer.mlp.gate.e_score_correction_bias.shape, generator=gen))
    extra = {"enorm.weight": 1 + 0.3 * torch.randn(H, generator=gen),
             "hnorm.weight": 1 + 0.3 * torch.randn(H, generator=gen),
             "eh_proj.weight": torch.randn(H, 2 * H, generator=gen) * 0.15,
             "shared_head.norm.weight": 1 + 0.3 * torch.randn(H, generator=gen),
             "shared_head.head.weight": torch.randn(V, H, generator=gen) * 0.25,
             "embed_tokens.weight": torch.randn(V, H, generator=gen) * 0.25}
    state = load_file(str(dst / "model.safetensors"))
    prefix = f"model.layers.{L}."
    for name, tensor in layer.state_dict().items():
        state[prefix + name] = tensor.contiguous()
    for name, tensor in extra.items():
        state[prefix + name] = tensor.contiguous()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst), extra, layer.eval()


def reference_drafts(target, layer, extra, context: list[int], k: int) -> list[int]:
    """The module's chain over the whole context, recomputed from scratch per draft."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
    rotary = DeepseekV3RotaryEmbedding(target.config)
    with torch.no_grad():
        feats = target(torch.tensor([context]), output_hidden_states=True).hidden_states[-1][0]
        tokens, feats = list(context[1:]), feats[:len(context) - 1]
        drafts = []
        for _ in range(k):
            n = len(tokens)
            pos = torch.arange(n)
            e = extra["embed_tokens.weight"][torch.tensor(tokens)]
            e[pos == 0] = 0
            x = torch.cat([_rms(e, extra["enorm.weight"]), _rms(feats, extra["hnorm.weight"])],
                          -1) @ extra["eh_proj.weight"].T
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            cos, sin = rotary(x[None], pos[None])
            out = layer(x[None], attention_mask=mask, position_ids=pos[None],
                        position_embeddings=(cos, sin))
            out = out[0] if isinstance(out, tuple) else out
            out = out[0]
            logits = _rms(out[-1], extra["shared_head.norm.weight"]) @ \
                extra["shared_head.head.weight"].T
            drafts.append(int(logits.argmax()))
            tokens.append(drafts[-1])
            feats = torch.cat([feats, out[-1:]])
        return drafts


def test_mtp_drafts_follow_the_reference_and_outputs_equal(tiny_model_dir, tmp_path) -> None:
    target, extra, layer = add_mtp_module(tiny_model_dir("deepseek_v3"), tmp_path / "v3mtp")
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive_draft_length": False}
    check_drafts_and_outputs(
        target, spec,
        lambda context: reference_drafts(load_hf_model(target), layer, extra, context, 3),
        seed=23, max_tokens=12, first=12, at_least=8)


def test_mtp_needs_the_module(tiny_model_dir, tmp_path) -> None:
    # the tiny V3's config names an MTP layer its checkpoint does not have
    with pytest.raises(ValueError, match="MTP module"):
        _make(tiny_model_dir("deepseek_v3"), {"method": "mtp"})
