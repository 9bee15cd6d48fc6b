"""Paged attention in plain torch: the reference path, and the CPU path.

Decodes (one query token) of the whole batch run as one padded, masked SDPA call over their
gathered blocks. Requests with several query tokens (prefill chunks) run one SDPA each: with no
cached prefix they attend over their own new K/V directly, otherwise over their gathered blocks
with an offset causal mask.

The cache may hold another dtype than the model's (--kv-cache-dtype): K/V are cast to it on
write and back to the query's dtype on read. A fresh prefill, which attends over its own new
K/V without reading the cache, rounds them through the cache's dtype too, so every query sees
the keys and values the cache holds (as the C++ CPU kernel, which reads them back, does) and
the result does not depend on how a prompt was chunked.

An FP8 cache (fp8.py) holds K / k_scale and V / v_scale: quantized on write, and on read
dequantized to float32 times the scale, then cast to the query's dtype, element by element:
exactly the arithmetic of attending over a cache that holds the dequantized values.

A soft cap (Gemma 2) or attention sinks (GPT-OSS) are beyond SDPA: with either, the same
calls go through `_attend_explicit`, the scores written out in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from folio.model.attention.backend import AttentionBackend, AttentionMetadata
from folio.model.attention.fp8 import dequantize_kv, is_fp8, per_head_scales, quantize_kv


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """K or V rows [..., KVH, D] as the cache holds them (`scale` only for FP8)."""
    return quantize_kv(x, scale, cache_dtype) if is_fp8(cache_dtype) else x.to(cache_dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """Cache rows [..., KVH, D] back in `dtype` (`scale` only for FP8)."""
    return dequantize_kv(x, scale, dtype) if is_fp8(x.dtype) else x.to(dtype)


def _rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache[index]; for FP8 through the bytes, as the write goes (torch's float8 support
    varies by op and device: index_copy_ has none on the CPU)."""
    if not is_fp8(cache.dtype):
        return cache[index]
    return cache.view(torch.uint8)[index].view(cache.dtype)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    num_blocks, block_size, kv_heads = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[3]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    k_scale = per_head_scales(k_scale, kv_heads, kv_cache.device)
    v_scale = per_head_scales(v_scale, kv_heads, kv_cache.device)
    key, value = to_cache(key, kv_cache.dtype, k_scale), to_cache(value, kv_cache.dtype, v_scale)
    if is_fp8(kv_cache.dtype):  # index_copy_ has no float8 kernels: copy the bytes
        flat, key, value = (x.view(torch.uint8) for x in (flat, key, value))
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[Q, K] bool: key visible to query (causal, and inside the sliding window if any)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def _attend_explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None, scale: float, soft_cap: float | None,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax(cap(q k^T * scale), masked, with sinks in the denominator) v, in float32, in
    q's dtype. q [..., M, D], k and v [..., L, D] (broadcast against q's leading dimensions:
    the grouped heads of one KV head), mask bool broadcastable to [..., M, L] (True =
    visible; None = causal with M == L), sinks broadcastable to [..., M, 1]."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if soft_cap:
        s = torch.tanh(s / soft_cap) * soft_cap
    if mask is None:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        # The sink as one more column of logits, dropped after the softmax: it takes its
        # share of the denominator and adds no value.
        sink_col = sinks.float().expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat((s, sink_col), dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.float()).to(q.dtype)


class TorchPagedAttention(AttentionBackend):
    def _plan(self, meta: AttentionMetadata, sliding_window: int | None) -> dict:
        key = ("torch_plan", sliding_window)
        plan = meta.cache.get(key)
        if plan is not None:
            return plan
        qsl = meta.query_start_loc
        decode_reqs = [i for i in range(meta.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        plan = {"decode_reqs": decode_reqs, "prefills": []}
        device = meta.block_tables.device
        if decode_reqs:
            lens = torch.tensor([meta.seq_lens[i] for i in decode_reqs], device=device)
            max_len = int(lens.max())
            num_blocks = -(-max_len // meta.block_size)
            k_pos = torch.arange(num_blocks * meta.block_size, device=device)
            visible = k_pos[None, :] < lens[:, None]
            if sliding_window is not None:
                visible &= k_pos[None, :] >= (lens[:, None] - sliding_window)
            plan["decode_tokens"] = torch.tensor([qsl[i] for i in decode_reqs], device=device)
            plan["decode_tables"] = meta.block_tables[decode_reqs, :num_blocks]
            plan["decode_mask"] = visible[:, None, None, :]
        for i in range(meta.num_reqs):
            n = qsl[i + 1] - qsl[i]
            if n == 1:
                continue
            start, ctx = meta.num_computed_tokens[i], meta.seq_lens[i]
            entry = {"req": i, "start": qsl[i], "end": qsl[i + 1], "fresh": start == 0}
            if start == 0 and sliding_window is None:
                entry["mask"] = None  # plain causal over the request's own new tokens
            else:
                q_pos = torch.arange(start, ctx, device=device)
                entry["mask"] = _window_mask(q_pos, torch.arange(ctx, device=device), sliding_window)
            if start > 0:
                num_blocks = -(-ctx // meta.block_size)
                entry["blocks"] = meta.block_tables[i, :num_blocks]
                entry["ctx"] = ctx
            plan["prefills"].append(entry)
        meta.cache[key] = plan
        return plan

    def forward(self, query, key, value, kv_cache, metadata, *, scale, sliding_window=None,
                k_scale=None, v_scale=None, logits_soft_cap=None, sinks=None, kv_written=False):
        assert not kv_written, "this backend hands out no fused KV write"
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        block_size, kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        k_scale = per_head_scales(k_scale, kv_heads, kv_cache.device)
        v_scale = per_head_scales(v_scale, kv_heads, kv_cache.device)
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        plan = self._plan(metadata, sliding_window)
        out = torch.empty_like(query)
        dtype = query.dtype
        num_heads = query.shape[1]
        group = num_heads // kv_heads
        explicit = bool(logits_soft_cap) or sinks is not None

        for entry in plan["prefills"]:
            s, e = entry["start"], entry["end"]
            q = query[s:e].transpose(0, 1)                      # [H, n, D]
            if entry["fresh"]:  # the new K/V as the cache holds them
                k = to_cache(key[s:e], kv_cache.dtype, k_scale)
                v = to_cache(value[s:e], kv_cache.dtype, v_scale)
            else:
                blocks = entry["blocks"]
                ctx = entry["ctx"]
                k = _rows(k_cache, blocks).reshape(-1, kv_heads, head_dim)[:ctx]
                v = _rows(v_cache, blocks).reshape(-1, kv_heads, head_dim)[:ctx]
            k = from_cache(k, dtype, k_scale).transpose(0, 1)  # [KVH, ctx, D]
            v = from_cache(v, dtype, v_scale).transpose(0, 1)
            mask = entry["mask"]
            if explicit:
                n = e - s
                o = _attend_explicit(
                    q.reshape(kv_heads, group, n, head_dim), k[:, None], v[:, None], mask,
                    scale, logits_soft_cap,
                    None if sinks is None else sinks.view(kv_heads, group, 1, 1),
                ).reshape(num_heads, n, head_dim)
            else:
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                    enable_gqa=True)
            out[s:e] = o.transpose(0, 1)

        if plan["decode_reqs"]:
            tokens = plan["decode_tokens"]
            tables = plan["decode_tables"]                      # [B, nb]
            batch = tables.shape[0]
            # Grouped layout: the G query heads sharing a KV head become G "query positions"
            # of that KV head, so K/V are never repeated across heads.
            q = query[tokens].view(batch, kv_heads, num_heads // kv_heads, head_dim)
            k = _rows(k_cache, tables).reshape(batch, -1, kv_heads, head_dim)
            v = _rows(v_cache, tables).reshape(batch, -1, kv_heads, head_dim)
            k = from_cache(k, dtype, k_scale).transpose(1, 2)
            v = from_cache(v, dtype, v_scale).transpose(1, 2)
            if explicit:
                o = _attend_explicit(
                    q, k, v, plan["decode_mask"], scale, logits_soft_cap,
                    None if sinks is None else sinks.view(kv_heads, group, 1))
            else:
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=plan["decode_mask"], scale=scale)
            out[tokens] = o.reshape(batch, num_heads, head_dim)
        return out
