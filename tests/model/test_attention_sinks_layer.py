"""The model side of attention sinks (GPT-OSS's `self_attn.sinks`): ArchSpec.attention_sinks
gives every Attention a float32 [heads] `sinks` weight, the decoder loads it from the
checkpoint (and misses it when absent), and the layer's output is a plain-torch attention with
the sink in each softmax's denominator, on every CPU backend. The GPT-OSS family itself
(mixture-of-experts) is not here."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from folio.model.attention.backend import AttentionMetadata
from folio.model.attention.torch_paged import TorchPagedAttention
from folio.model.decoder import DecoderLM
from folio.model.families import ArchSpec
from folio.model.layers import Attention, RotaryEmbedding

H, KVH, D, HIDDEN = 4, 2, 16, 32
HF_CONFIG = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _backends() -> list:
    # the C++ backend always: a failed build fails the test rather than dropping the case
    from folio.model.attention.cpu_backend import CpuPagedAttention
    return [TorchPagedAttention(), CpuPagedAttention()]


def _prefill_metadata(t: int, block_size: int = 16) -> tuple[AttentionMetadata, torch.Tensor]:
    blocks = -(-t // block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(t), query_start_loc=[0, t], seq_lens=[t],
        num_computed_tokens=[0], block_tables=torch.arange(blocks)[None], block_size=block_size)
    return meta, torch.zeros(2, blocks, block_size, KVH, D)


def _plain_attention(layer: Attention, positions: torch.Tensor, x: torch.Tensor,
                     window: int | None) -> torch.Tensor:
    """The layer's projections and rotary, then causal attention with a sink logit per head
    written out from the definition."""
    t = x.shape[0]
    q, k, v = layer.qkv_proj(x).split([H * D, KVH * D, KVH * D], dim=-1)
    q, k = layer.rotary(positions, q.reshape(t, H, D), k.reshape(t, KVH, D))
    v = v.reshape(t, KVH, D)
    k, v = (z.repeat_interleave(H // KVH, dim=1) for z in (k, v))
    s = torch.einsum("qhd,khd->hqk", q, k) * layer.scale
    i = torch.arange(t)
    visible = i[None, :] <= i[:, None]
    if window is not None:
        visible &= i[None, :] > i[:, None] - window
    s = s.masked_fill(~visible, -math.inf)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    sink = torch.exp(layer.sinks.view(H, 1, 1) - s.amax(-1, keepdim=True))
    p = e / (e.sum(-1, keepdim=True) + sink)
    out = torch.einsum("hqk,khd->qhd", p, v).reshape(t, H * D)
    return layer.o_proj(out)


@pytest.mark.parametrize("window", [None, 7])
def test_attention_with_sinks_matches_plain_torch(window: int | None) -> None:
    torch.manual_seed(0)
    rotary = RotaryEmbedding(D, 64, HF_CONFIG)
    for backend in _backends():
        layer = Attention(hidden_size=HIDDEN, num_heads=H, num_kv_heads=KVH, head_dim=D,
                          qkv_bias=False, o_bias=False, qk_norm=False, rms_norm_eps=1e-6,
                          rotary=rotary, backend=backend, sliding_window=window, sinks=True)
        assert layer.sinks is not None and layer.sinks.shape == (H,)
        assert layer.sinks.dtype == torch.float32
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape))
            layer.sinks.copy_(torch.tensor([2.0, -1.0, 0.5, 3.0]))
        t = 21
        positions = torch.arange(t)
        x = torch.randn(t, HIDDEN)
        meta, cache = _prefill_metadata(t)
        with torch.no_grad():
            out = layer(positions, x, cache, meta)
            ref = _plain_attention(layer, positions, x, window)
            layer.sinks.fill_(-math.inf)  # a sink of -inf takes no share: plain attention
            without = layer(positions, x, torch.zeros_like(cache), meta)
        assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), type(backend).__name__
        assert not torch.allclose(out, without, atol=1e-2)


def _spec(sinks: bool) -> ArchSpec:
    return ArchSpec(hidden_size=HIDDEN, num_layers=2, num_heads=H, num_kv_heads=KVH, head_dim=D,
                    intermediate_size=48, vocab_size=50, rms_norm_eps=1e-6,
                    max_position_embeddings=64, tie_word_embeddings=True,
                    sliding_windows=(None, None), attention_sinks=sinks)


def _checkpoint(model: DecoderLM, sinks: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face-named state dict for `model` (q/k/v and gate/up as separate tensors)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name.endswith(".sinks"):
            continue
        if "qkv_proj" in name:
            for shard, (off, size) in model.get_submodule(
                    name.rsplit(".", 1)[0]).shard_offsets.items():
                out["model." + name.replace("qkv_proj", f"{shard}_proj")] = \
                    torch.randn(size, param.shape[1])
        elif "gate_up_proj" in name:
            for shard, (off, size) in model.get_submodule(
                    name.rsplit(".", 1)[0]).shard_offsets.items():
                out["model." + name.replace("gate_up_proj", f"{shard}_proj")] = \
                    torch.randn(size, param.shape[1])
        else:
            out["model." + name] = torch.randn(param.shape)
    for layer, value in sinks.items():
        out[f"model.layers.{layer}.self_attn.sinks"] = value
    return out


def test_decoder_loads_sinks_from_the_checkpoint() -> None:
    torch.manual_seed(1)
    model = DecoderLM(_spec(True), HF_CONFIG, TorchPagedAttention(), 64)
    values = {i: torch.randn(H) for i in range(2)}
    model.load_weights(_checkpoint(model, values).items())
    for i in range(2):
        assert torch.equal(model.layers[i].self_attn.sinks.detach(), values[i])


def test_decoder_without_sinks_in_the_checkpoint_says_so() -> None:
    model = DecoderLM(_spec(True), HF_CONFIG, TorchPagedAttention(), 64)
    with pytest.raises(ValueError, match="sinks"):
        model.load_weights(_checkpoint(model, {}).items())


def test_sinks_in_a_checkpoint_of_a_model_without_them_are_refused() -> None:
    model = DecoderLM(_spec(False), HF_CONFIG, TorchPagedAttention(), 64)
    assert all(layer.self_attn.sinks is None for layer in model.layers)
    with pytest.raises(ValueError, match="does not use"):
        model.load_weights(_checkpoint(model, {0: torch.zeros(H)}).items())
