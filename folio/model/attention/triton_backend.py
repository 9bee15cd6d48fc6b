"""Paged attention through the Triton kernels in `triton_kernels`.

Per step, the int32 metadata the kernels read (query_start_loc, seq_lens, block_tables) is built
once into `metadata.cache` and shared by every layer, so a layer's forward is two launches
(cache write + attention; three for split-K decode) with no host work beyond argument packing,
one where the rotary kernel took the cache write (`fused_kv_write`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from folio.model.attention.backend import AttentionBackend, AttentionMetadata
from folio.model.attention import dense_prefill
from folio.model.attention import triton_kernels as tk
from folio.model.attention.fp8 import fp8_max
from folio.model.host_copy import device_tensor
from folio.model.kernels.rotary import PagedKVWrite

# The key of `AttentionMetadata.cache` that holds a step's TritonStepTensors (the CUDA-graph
# runners put theirs there for the layers to reuse).
STEP_CACHE_KEY = "triton_step"


@dataclass
class TritonStepTensors:
    """Kernel-ready view of one step's metadata."""
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor         # [B] int32
    block_tables: torch.Tensor     # [B, max_blocks] int32, contiguous
    slot_mapping: torch.Tensor     # [T] int64
    max_query_len: int
    max_seq_len: int
    all_decode: bool               # every request has exactly one query token
    # Fixed split-K count for decode, set by the CUDA-graph runner: a captured graph must not
    # re-derive it from the step (its launch grid is baked in). None = choose per step.
    num_splits: int | None = None
    # Eager steps only: the requests whose attention takes dense_prefill's path, as (first
    # token, query length), and the varlen kernel's int32 [B] skip flags for them.
    dense: tuple[tuple[int, int], ...] = ()
    dense_skip: torch.Tensor | None = None


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # only steers the split heuristic; H200 value


class TritonPagedAttention(AttentionBackend):
    def __init__(self, max_splits: int = 32, min_tokens_per_split: int = 256,
                 pdl: bool = False, dense_prefill: bool = True,
                 kv_write_in_rotary: bool = True) -> None:
        """`pdl`: launch the decode path's kernels (cache write, attention, merge) with
        programmatic dependent launch where the GPU has it (KernelConfig.pdl_on).
        `dense_prefill`: long fresh prefills through torch's fused attention
        (dense_prefill.py; KernelConfig.dense_prefill_on). `kv_write_in_rotary`: hand the
        cache write to the rotary kernel (`fused_kv_write`; KernelConfig.kv_write_in_rotary)."""
        self.pdl = pdl
        self.dense_prefill = dense_prefill
        self.kv_write_in_rotary = kv_write_in_rotary
        self.max_splits = max_splits
        self.min_tokens_per_split = min_tokens_per_split
        self._sms: int | None = None

    def takes_dense_path(self, num_computed_tokens: int, num_query_tokens: int) -> bool:
        """Whether a request's attention in an eager step goes to dense_prefill (for layers
        that it fits): its context starts in this step and is long enough to pay."""
        return (self.dense_prefill and num_computed_tokens == 0
                and num_query_tokens >= dense_prefill.DENSE_PREFILL_MIN_TOKENS)

    def step_tensors(self, meta: AttentionMetadata) -> TritonStepTensors:
        st = meta.cache.get(STEP_CACHE_KEY)
        if st is not None:
            return st
        device = meta.block_tables.device
        qsl = meta.query_start_loc
        q_lens = [qsl[i + 1] - qsl[i] for i in range(meta.num_reqs)]
        flags = [device.type == "cuda" and self.takes_dense_path(meta.num_computed_tokens[i], n)
                 for i, n in enumerate(q_lens)]
        dense = tuple((qsl[i], n) for i, n in enumerate(q_lens) if flags[i])
        skip = device_tensor([int(f) for f in flags], device, torch.int32) if dense else None
        # Pinned, non-blocking copies: a pageable one here would make the host wait for the
        # step in flight before launching the rest of this one (async scheduling).
        st = TritonStepTensors(
            query_start_loc=device_tensor(qsl, device, torch.int32),
            seq_lens=device_tensor(meta.seq_lens, device, torch.int32),
            block_tables=meta.block_tables.to(torch.int32).contiguous(),
            slot_mapping=meta.slot_mapping.to(device=device, dtype=torch.int64),
            max_query_len=max(q_lens, default=0),
            max_seq_len=max(meta.seq_lens, default=0),
            all_decode=bool(q_lens) and all(n == 1 for n in q_lens),
            dense=dense, dense_skip=skip,
        )
        meta.cache[STEP_CACHE_KEY] = st
        return st

    def num_splits(self, st: TritonStepTensors, kv_heads: int, device: torch.device) -> int:
        return self.splits_for(st.seq_lens.shape[0], kv_heads, st.max_seq_len, device)

    def splits_for(self, num_reqs: int, kv_heads: int, max_seq_len: int,
                   device: torch.device) -> int:
        """The decode kernel's split count for `num_reqs` requests whose longest context is
        `max_seq_len`: a power of two, non-decreasing in max_seq_len."""
        if self._sms is None:
            self._sms = _num_sms(device)
        return tk.choose_num_splits(num_reqs, kv_heads, max_seq_len, num_sms=self._sms,
                                    min_tokens_per_split=self.min_tokens_per_split,
                                    max_splits=self.max_splits)

    def fused_kv_write(self, value, kv_cache, metadata, k_scale, v_scale) -> PagedKVWrite | None:
        if not self.kv_write_in_rotary:
            return None
        st = self.step_tensors(metadata)
        fp8, ks, vs = tk.kv_scales(kv_cache, k_scale, v_scale)

        def separately(key: torch.Tensor) -> None:
            tk.reshape_and_cache(key, value, kv_cache, st.slot_mapping, pdl=self.pdl,
                                 k_scale=k_scale, v_scale=v_scale)

        return PagedKVWrite(value, kv_cache, st.slot_mapping, ks, vs,
                            fp8_max(kv_cache.dtype) if fp8 else 0.0, separately)

    def forward(self, query, key, value, kv_cache, metadata, *, scale, sliding_window=None,
                k_scale=None, v_scale=None, logits_soft_cap=None, sinks=None, kv_written=False):
        st = self.step_tensors(metadata)
        # Write first: a request may read, in this same step, blocks another request fills
        # (or the rotary kernel did, kv_written).
        if not kv_written:
            tk.reshape_and_cache(key, value, kv_cache, st.slot_mapping, pdl=self.pdl,
                                 k_scale=k_scale, v_scale=v_scale)
        if st.all_decode:
            splits = st.num_splits
            if splits is None:
                splits = self.num_splits(st, kv_cache.shape[3], query.device)
            return tk.paged_attention_decode(
                query, kv_cache, st.seq_lens, st.block_tables, scale, sliding_window,
                num_splits=splits, pdl=self.pdl, k_scale=k_scale, v_scale=v_scale,
                logits_soft_cap=logits_soft_cap, sinks=sinks)
        dense = st.dense if st.dense and dense_prefill.layer_supported(
            query, key, kv_cache, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, sinks=sinks) else ()
        if len(dense) == 1 and dense[0] == (0, query.shape[0]):   # the step is one prompt
            return dense_prefill.causal_attention(query, key, value, scale)
        out = torch.empty_like(query)
        if sum(n for _, n in dense) < query.shape[0]:
            tk.paged_attention_varlen(
                query, kv_cache, query_start_loc=st.query_start_loc, seq_lens=st.seq_lens,
                block_tables=st.block_tables, max_query_len=st.max_query_len,
                max_seq_len=st.max_seq_len, scale=scale, sliding_window=sliding_window,
                out=out, k_scale=k_scale, v_scale=v_scale, logits_soft_cap=logits_soft_cap,
                sinks=sinks, skip=st.dense_skip if dense else None)
        for start, n in dense:
            rows = slice(start, start + n)
            dense_prefill.causal_attention(query[rows], key[rows], value[rows], scale, out[rows])
        return out
