"""Paged attention on the CPU through folio's C++ kernel (folio/model/cpu_kernels/csrc/
paged_attention.cpp): one call per layer writes the step's K/V into the cache and attends the
whole flat batch (decodes and prefill chunks alike) over the blocks in place, where the torch
reference (torch_paged.py) gathers every request's blocks into new tensors first.

Queries, keys and values go in as float32 (a bfloat16 model's are converted, and the output
converted back), strided views as they are; the cache may be float32, bfloat16, float16 or
FP8 (e4m3fn / e5m2, fp8.py): the kernel converts float8 to float32 itself (e5m2 is float16's
top byte, e4m3fn float16's bits shifted, sixteen elements at a time) and scales it, so an FP8
cache is read in place like the others, at half a 2-byte cache's memory traffic.
"""
from __future__ import annotations

import torch

from folio.model.attention.backend import AttentionBackend, AttentionMetadata
from folio.model.attention.fp8 import per_head_scales

_LAYOUT_KEY = "cpu_layout"


class CpuPagedAttention(AttentionBackend):
    def __init__(self) -> None:
        from folio.model.cpu_kernels import extension
        self._kernel = extension()

    @staticmethod
    def layout(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                  torch.Tensor]:
        """The step's layout as the kernel's int64 tensors, built once and shared by every
        layer."""
        layout = meta.cache.get(_LAYOUT_KEY)
        if layout is None:
            layout = (meta.slot_mapping.to(torch.int64).contiguous(),
                      meta.block_tables.to(torch.int64).contiguous(),
                      torch.tensor(meta.query_start_loc, dtype=torch.int64),
                      torch.tensor(meta.seq_lens, dtype=torch.int64))
            meta.cache[_LAYOUT_KEY] = layout
        return layout

    def forward(self, query, key, value, kv_cache, metadata, *, scale, sliding_window=None,
                k_scale=None, v_scale=None, logits_soft_cap=None, sinks=None, kv_written=False):
        assert not kv_written, "this backend hands out no fused KV write"
        slots, tables, qsl, lens = self.layout(metadata)
        dtype = query.dtype
        q, k, v = (_rows(x) for x in (query, key, value))
        out = torch.empty(q.shape, dtype=torch.float32)
        kv_heads = kv_cache.shape[3]
        self._kernel.paged_attention(out, q, k, v, kv_cache, slots, tables, qsl, lens,
                                     float(scale),
                                     0 if sliding_window is None else int(sliding_window),
                                     per_head_scales(k_scale, kv_heads, kv_cache.device),
                                     per_head_scales(v_scale, kv_heads, kv_cache.device),
                                     float(logits_soft_cap or 0.0),
                                     None if sinks is None else
                                     sinks.to(torch.float32).contiguous())
        return out if dtype == torch.float32 else out.to(dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel takes it: float32, the last dimension contiguous (views into the qkv
    projection's output pass as they are)."""
    x = x.to(torch.float32)
    return x if x.stride(-1) == 1 else x.contiguous()
