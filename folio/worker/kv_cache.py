"""Sizing and allocating the paged KV cache."""
from __future__ import annotations

import logging

import psutil
import torch

from folio.model.families import ArchSpec

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 4 << 30


def bytes_per_block(spec: ArchSpec, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * element


def default_cpu_kv_bytes() -> int:
    """A quarter of the memory available now, at most 4 GiB: room for the weights, the
    activations and the rest of the machine's work."""
    return int(min(_DEFAULT_CPU_KV_BYTES, psutil.virtual_memory().available // 4))


def determine_num_blocks(spec: ArchSpec, *, block_size: int, dtype: torch.dtype,
                         max_model_len: int, kv_cache_memory_bytes: int | None,
                         num_blocks_override: int | None) -> int:
    per_block = bytes_per_block(spec, block_size, dtype)
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
    else:
        budget = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else default_cpu_kv_bytes()
        num_blocks = budget // per_block
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens), fewer than "
            f"one sequence of max_model_len={max_model_len} needs ({needed} blocks); lower "
            f"max_model_len or give the cache more memory (kv_cache_memory_bytes / "
            f"num_gpu_blocks_override)")
    return num_blocks


def allocate_kv_caches(spec: ArchSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer. Zeroed, so padded
    reads of never-written slots hold finite values (0 * NaN would poison masked attention)."""
    shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
