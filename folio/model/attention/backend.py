"""The attention backend interface: what the model layers call, and what a GPU kernel implements.

One call per layer does two things for the whole flat batch of scheduled tokens: write the new
K/V into the paged cache at `slot_mapping`, then attend each request's queries over its
context (cached prefix + this step's tokens), causally. Writing first means a request can read,
in the same step, blocks another request is filling (prefix-cache hits on freshly scheduled
blocks rely on it).

Types only: the backends (torch_paged.py, triton_backend.py) import this module and
selector.py picks one of them, so no import here goes back up to a backend.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Per-step layout of the flat token batch; built once, shared by every layer."""
    slot_mapping: torch.Tensor        # [T] int64: cache slot (block_id * block_size + offset)
    query_start_loc: list[int]        # [B+1]: request i owns tokens [qsl[i], qsl[i+1])
    seq_lens: list[int]               # [B]: context length after this step
    num_computed_tokens: list[int]    # [B]: context length before this step
    block_tables: torch.Tensor        # [B, max_blocks] int64, padded with 0
    block_size: int
    # The first real step of an engine with --calculate-kv-scales (FP8 cache): each layer sets
    # its K/V scales from this step's keys and values before writing them (Attention.forward).
    # Always an eager step: the captured CUDA graphs only read the scales.
    calculate_kv_scales: bool = False
    # Several KV cache groups (sliding-window layers beside full ones): one metadata per group,
    # alike but for slot_mapping and block_tables; each layer reads its group's
    # (Attention.kv_group). None: one group, this metadata.
    groups: list["AttentionMetadata"] | None = None
    # Backend-specific precomputed tensors (masks, gather indices), filled lazily and reused
    # by all layers of the step.
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


class AttentionBackend(ABC):
    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, *, scale: float,
                sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None, kv_written: bool = False) -> torch.Tensor:
        """query [T, H, D], key/value [T, KVH, D], kv_cache [2, num_blocks, block_size, KVH, D].
        Returns [T, H, D]. An FP8 cache (fp8.py) holds key / k_scale and value / v_scale,
        the scales float32 [KVH] (or one element; None = 1.0); other caches ignore them.
        `kv_written`: the step's keys and values are already in the cache, written by the
        `fused_kv_write` this backend handed out for them (the rotary's launch).

        `logits_soft_cap` (Gemma 2's attn_logit_softcapping; None = none): each score, after
        `scale`, becomes cap * tanh(score / cap) before masking and the softmax.
        `sinks` (GPT-OSS; None = none): float32 [H], one learned logit per query head that
        joins the softmax's denominator only: p_i = exp(s_i - m) / (sum_j exp(s_j - m) +
        exp(sink - m)); it has no value, so a row's weights sum to less than one."""

    def fused_kv_write(self, value: torch.Tensor, kv_cache: torch.Tensor,
                       metadata: AttentionMetadata, k_scale: torch.Tensor | None,
                       v_scale: torch.Tensor | None) -> Any | None:
        """The cache write `forward` would make, as a `kernels.rotary.PagedKVWrite` for the
        rotary kernel to make in its own launch (then `forward(..., kv_written=True)`), or
        None where this backend writes the cache itself (the default)."""
        return None

