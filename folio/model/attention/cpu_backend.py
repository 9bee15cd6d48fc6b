"""Paged attention on the CPU through folio's C++ kernel (folio/model/cpu_kernels/csrc/
paged_attention.cpp): one call per layer writes the step's K/V into the cache and attends the
whole flat batch (decodes and prefill chunks alike) over the blocks in place, where the torch
reference (torch_paged.py) gathers every request's blocks into new tensors first.

Queries, keys and values go in as float32 (a bfloat16 model's are converted, and the output
converted back); the cache may be float32, bfloat16 or float16.
"""
from __future__ import annotations

import torch

from folio.model.attention.backend import AttentionBackend, AttentionMetadata

_LAYOUT_KEY = "cpu_layout"


class CpuPagedAttention(AttentionBackend):
    def __init__(self) -> None:
        from folio.model.cpu_kernels import extension
        self._kernel = extension()

    @staticmethod
    def _layout(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
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

    def forward(self, query, key, value, kv_cache, metadata, *, scale, sliding_window=None):
        slots, tables, qsl, lens = self._layout(metadata)
        dtype = query.dtype
        q = query.to(torch.float32).contiguous()
        out = torch.empty_like(q)
        self._kernel.paged_attention(
            out, q, key.to(torch.float32).contiguous(), value.to(torch.float32).contiguous(),
            kv_cache, slots, tables, qsl, lens, float(scale),
            0 if sliding_window is None else int(sliding_window))
        return out.to(dtype)
