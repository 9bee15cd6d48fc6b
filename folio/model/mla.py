"""Multi-head latent attention (DeepSeek-V2/V3): keys and values live in the cache as one
compressed latent per token, not per head.

Per token the model computes a latent c = norm(W_DKV x) (kv_lora_rank wide) and one rotary
key k_pe shared by all heads (qk_rope_head_dim); the cache holds [c ; k_pe], kv_lora_rank +
qk_rope_head_dim elements per token and layer (576 for DeepSeek-V3, against 2 x 128 heads x
192/128 for the same model's full K and V). Head h's key would be [W_UK_h c ; k_pe] and its
value W_UV_h c; instead of expanding them, the up-projections are absorbed into the query and
the output (the form DeepSeek's paper gives for inference):
  score_h(j) = q_nope_h . W_UK_h c_j + q_pe_h . k_pe_j = [W_UK_h^T q_nope_h ; q_pe_h] . [c_j ; k_pe_j]
  out_h      = W_UV_h sum_j p_j c_j
so the attention is multi-query attention with one KV head of width kv_lora_rank +
qk_rope_head_dim whose values are its keys: any paged backend runs it on the one latent plane
viewed as both the K and V planes (the cache tensor is [1, blocks, block_size, 1, width],
expanded to two planes with stride 0), and the value's rotary tail is dropped afterwards.

Rotary: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; permuting the rotary rows
of the q and kv_a projections once at load (evens first, then odds) turns that into the
neox-layout rotation the shared RotaryEmbedding applies, and q_pe . k_pe is unchanged because
both sides are permuted alike.
"""
from __future__ import annotations

import torch
from torch import nn

from folio.model.attention import AttentionBackend, AttentionMetadata
from folio.model.families import ArchSpec
from folio.model.kernel_config import DEFAULT_KERNEL_CONFIG, KernelConfig
from folio.model.layers import Linear, RMSNorm, RotaryEmbedding

# DeepSeek's q_a / kv_a norms use the RMSNorm default, not the config's rms_norm_eps
_LATENT_NORM_EPS = 1e-6


def latent_cache_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The [1, blocks, block_size, 1, width] latent cache as the backends' [2, ...] K/V
    planes: the same memory twice (stride 0), so writing V writes what K wrote."""
    return kv_cache.expand(2, *kv_cache.shape[1:])


def deinterleave_rows(weight: torch.Tensor, start: int, width: int, period: int) -> None:
    """In place: within every `period` rows, rows [start, start + width) reordered evens
    first, then odds (interleaved rotary pairs to the neox layout)."""
    perm = torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])
    view = weight.view(-1, period, *weight.shape[1:])
    view[:, start:start + width] = view[:, start + perm.to(weight.device)].clone()


class MLAttention(nn.Module):
    def __init__(self, spec: ArchSpec, rotary: RotaryEmbedding, backend: AttentionBackend,
                 kernels: KernelConfig = DEFAULT_KERNEL_CONFIG) -> None:
        super().__init__()
        mla = spec.mla
        assert mla is not None
        self.mla = mla
        self.num_heads = spec.num_heads
        h, nope, rope = spec.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim
        qk = nope + rope
        if mla.q_lora_rank is None:
            self.q_proj = Linear(spec.hidden_size, h * qk, bias=False, kernels=kernels)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(spec.hidden_size, mla.q_lora_rank, bias=spec.qkv_bias,
                                   kernels=kernels)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS, kernels)
            self.q_b_proj = Linear(mla.q_lora_rank, h * qk, bias=False, kernels=kernels)
        self.kv_a_proj_with_mqa = Linear(spec.hidden_size, mla.kv_lora_rank + rope,
                                         bias=spec.qkv_bias, kernels=kernels)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS, kernels)
        self.kv_b_proj = Linear(mla.kv_lora_rank, h * (nope + mla.v_head_dim), bias=False,
                                kernels=kernels)
        self.o_proj = Linear(h * mla.v_head_dim, spec.hidden_size, bias=spec.o_bias,
                             kernels=kernels)
        self.rotary = rotary
        self.backend = backend
        self.scale = mla.softmax_scale

    @torch.no_grad()
    def after_load(self) -> None:
        """Interleaved rotary pairs to the neox layout (module docstring)."""
        if not self.mla.rope_interleave:
            return
        nope, rope = self.mla.qk_nope_head_dim, self.mla.qk_rope_head_dim
        q = self.q_proj if self.q_proj is not None else self.q_b_proj
        deinterleave_rows(q.weight, nope, rope, nope + rope)
        kv_lora = self.mla.kv_lora_rank
        deinterleave_rows(self.kv_a_proj_with_mqa.weight, kv_lora, rope, kv_lora + rope)
        if self.kv_a_proj_with_mqa.bias is not None:
            deinterleave_rows(self.kv_a_proj_with_mqa.bias, kv_lora, rope, kv_lora + rope)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        mla, h = self.mla, self.num_heads
        nope, rope, kv_lora = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, h, nope + rope)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([kv_lora, rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.reshape(t, 1, rope))
        # the up-projections, per head: kv_b's rows are each head's nope key rows, then its
        # value rows
        w_kv = self.kv_b_proj.weight.view(h, nope + mla.v_head_dim, kv_lora)
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)   # [T, H, kv_lora]
        query = torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1)
        key = torch.cat([latent.unsqueeze(1), k_pe.to(latent.dtype)], dim=-1)  # [T, 1, width]
        out = self.backend.forward(query, key, key, latent_cache_view(kv_cache), metadata,
                                   scale=self.scale)
        out_latent = out[..., :kv_lora].transpose(0, 1)                       # [H, T, kv_lora]
        values = torch.bmm(out_latent, w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return self.o_proj(values.reshape(t, h * mla.v_head_dim))
