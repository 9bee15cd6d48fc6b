"""Multi-head latent attention (folio/model/mla.py): the latent cache against an uncompressed
reference, and the cache's size.

The reference is the textbook form: every head's key [W_UK_h c ; k_pe] and value W_UV_h c
expanded from the latents, causal softmax attention over the whole sequence at once. folio's
layer runs the same sequence through the paged cache in steps (a prefill in two chunks, then
decodes), with the up-projections absorbed, on each CPU backend; the outputs must agree. The
family-level parity with transformers is test_models_vs_transformers.py (deepseek_v2/v3)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from folio.model.attention.backend import AttentionMetadata
from folio.model.families import ArchSpec, MLASpec
from folio.model.layers import RotaryEmbedding
from folio.model.mla import MLAttention, deinterleave_rows
from folio.worker.kv_cache import allocate_kv_caches, bytes_per_block


def _spec(q_lora: int | None, interleave: bool) -> ArchSpec:
    nope, rope, v = 16, 8, 12
    spec = ArchSpec(hidden_size=48, num_layers=1, num_heads=4, num_kv_heads=1, head_dim=rope,
                    intermediate_size=64, vocab_size=100, rms_norm_eps=1e-6,
                    max_position_embeddings=256, tie_word_embeddings=False)
    spec.mla = MLASpec(q_lora_rank=q_lora, kv_lora_rank=20, qk_nope_head_dim=nope,
                       qk_rope_head_dim=rope, v_head_dim=v, rope_interleave=interleave,
                       softmax_scale=(nope + rope) ** -0.5)
    return spec


class _Cfg:
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}


def _backends() -> list:
    # the C++ backend always: a failed build fails the test rather than dropping the case
    from folio.model.attention.cpu_backend import CpuPagedAttention
    from folio.model.attention.torch_paged import TorchPagedAttention
    return [("torch", TorchPagedAttention()), ("cpu", CpuPagedAttention())]


def _layer(spec: ArchSpec, backend, gen) -> MLAttention:
    rotary = RotaryEmbedding(spec.head_dim, 256, _Cfg())
    layer = MLAttention(spec, rotary, backend)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for norm in (layer.kv_a_layernorm, layer.q_a_layernorm):
            if norm is not None:
                norm.weight.copy_(1 + 0.2 * torch.randn(norm.weight.shape, generator=gen))
    return layer


def _interleaved_rotary(x: torch.Tensor, positions: torch.Tensor, rope: int) -> torch.Tensor:
    """DeepSeek's rotation: pairs (x0, x1), (x2, x3), ... each by its own frequency."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, rope, 2).float() / rope))
    ang = positions.float()[:, None] * inv[None, :]                       # [T, rope/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out


def _reference(layer: MLAttention, weights: dict, x: torch.Tensor) -> torch.Tensor:
    """Uncompressed attention from the checkpoint-layout (interleaved) weights."""
    mla, h = layer.mla, layer.num_heads
    nope, rope, kv_lora, vd = (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank,
                               mla.v_head_dim)
    t = x.shape[0]
    pos = torch.arange(t)
    if "q_proj" in weights:
        q = x @ weights["q_proj"].t()
    else:
        qa = x @ weights["q_a_proj"].t()
        qa = qa * torch.rsqrt(qa.pow(2).mean(-1, keepdim=True) + 1e-6) * weights["q_a_norm"]
        q = qa @ weights["q_b_proj"].t()
    q = q.view(t, h, nope + rope)
    kv = x @ weights["kv_a"].t()
    c, k_pe = kv[:, :kv_lora], kv[:, kv_lora:]
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * weights["kv_norm"]
    rot = _interleaved_rotary if mla.rope_interleave else None
    q_pe, k_pe = q[..., nope:], k_pe.view(t, 1, rope)
    if rot is not None:
        q_pe, k_pe = rot(q_pe, pos, rope), rot(k_pe, pos, rope)
    else:
        q_pe, k_pe = layer.rotary(pos, q_pe.contiguous(), k_pe.contiguous())
    kvb = (c @ weights["kv_b"].t()).view(t, h, nope + vd)
    k = torch.cat([kvb[..., :nope], k_pe.expand(t, h, rope)], -1)
    v = kvb[..., nope:]
    q = torch.cat([q[..., :nope], q_pe], -1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       is_causal=True, scale=mla.softmax_scale)
    return o.transpose(0, 1).reshape(t, h * vd) @ weights["o_proj"].t()


def _checkpoint_weights(layer: MLAttention) -> dict:
    w = {"kv_a": layer.kv_a_proj_with_mqa.weight.detach().clone(),
         "kv_norm": layer.kv_a_layernorm.weight.detach().clone(),
         "kv_b": layer.kv_b_proj.weight.detach().clone(),
         "o_proj": layer.o_proj.weight.detach().clone()}
    if layer.q_proj is not None:
        w["q_proj"] = layer.q_proj.weight.detach().clone()
    else:
        w.update(q_a_proj=layer.q_a_proj.weight.detach().clone(),
                 q_a_norm=layer.q_a_layernorm.weight.detach().clone(),
                 q_b_proj=layer.q_b_proj.weight.detach().clone())
    return w


def _run_paged(layer: MLAttention, x: torch.Tensor, chunks: list[int], block_size: int = 4):
    """x through the layer in steps of `chunks` tokens, over a shuffled block table."""
    t = x.shape[0]
    spec_width = layer.mla.latent_width
    num_blocks = -(-t // block_size) + 2
    cache = torch.zeros(1, num_blocks, block_size, 1, spec_width)
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(9))
    outs, done = [], 0
    for n in chunks:
        positions = torch.arange(done, done + n)
        slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size
                              for p in range(done, done + n)])
        meta = AttentionMetadata(slot_mapping=slots, query_start_loc=[0, n],
                                 seq_lens=[done + n], num_computed_tokens=[done],
                                 block_tables=table.view(1, -1).clone(), block_size=block_size)
        with torch.no_grad():
            outs.append(layer(positions, x[done:done + n], cache, meta))
        done += n
    assert done == t
    return torch.cat(outs), cache


@pytest.mark.parametrize("backend_name", [name for name, _ in _backends()])
@pytest.mark.parametrize("q_lora,interleave", [(None, True), (16, True), (16, False)])
def test_latent_cache_matches_uncompressed_attention(backend_name: str, q_lora, interleave):
    gen = torch.Generator().manual_seed(3)
    backend = dict(_backends())[backend_name]
    spec = _spec(q_lora, interleave)
    layer = _layer(spec, backend, gen)
    weights = _checkpoint_weights(layer)   # as a checkpoint holds them
    layer.after_load()                     # what loading does: interleaved rows permuted
    x = torch.randn(23, spec.hidden_size, generator=gen)
    out, cache = _run_paged(layer, x, [9, 7, 1, 1, 1, 1, 1, 1, 1])
    ref = _reference(layer, weights, x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # the cache holds exactly one latent entry per token: its rows are the latents
    assert cache.shape[0] == 1 and cache.shape[3] == 1


def test_deinterleave_rows() -> None:
    w = torch.arange(2 * 6, dtype=torch.float32).view(12, 1)   # two periods of 6 rows
    deinterleave_rows(w, 2, 4, 6)
    assert w.view(-1).tolist() == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]


def test_latent_cache_size() -> None:
    """DeepSeek-V2-Lite's shape: 16 heads of 128 + 64 (keys) and 128 (values) against one
    512 + 64 latent: KV bytes per token 8.9x smaller than the equivalent MHA cache."""
    from transformers import DeepseekV2Config

    from folio.model.families import arch_spec_from_hf_config
    cfg = DeepseekV2Config(hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
                           kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                           qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                           num_experts_per_tok=6, moe_intermediate_size=1408,
                           n_shared_experts=2, first_k_dense_replace=1, vocab_size=102400)
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    spec = arch_spec_from_hf_config(cfg)
    per_token = bytes_per_block(spec, 16, torch.bfloat16) / 16
    assert per_token == 27 * 576 * 2
    mha = 27 * 16 * (128 + 64 + 128) * 2   # K and V, every head, bf16
    assert mha / per_token >= 4
    caches = allocate_kv_caches(spec, 3, 16, torch.bfloat16, torch.device("cpu"))
    assert len(caches) == 27 and tuple(caches[0].shape) == (1, 3, 16, 1, 576)


def test_fp8_cache_refused_for_mla(tmp_path) -> None:
    from transformers import AutoConfig

    from folio.model.discovery import resolve_model_source
    from folio.model.loader import load_model
    cfg = AutoConfig.for_model("deepseek_v2", hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, kv_lora_rank=16, q_lora_rank=None,
                               qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                               n_routed_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=8, vocab_size=64, intermediate_size=16)
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    cfg.save_pretrained(tmp_path)  # a config, no weights: the refusal comes before them
    with pytest.raises(ValueError, match="FP8 KV cache"):
        load_model(resolve_model_source(str(tmp_path)), cfg, torch.float32,
                   torch.device("cpu"), 64, kv_cache_dtype=torch.float8_e4m3fn)
