"""Sizing and allocating the paged KV cache."""
from __future__ import annotations

import logging
from typing import Callable

import psutil
import torch

from folio.core.kv_cache_layout import KVCacheLayout, full_attention_layout
from folio.model.families import ArchSpec

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 4 << 30

# CacheConfig.cache_dtype's names (normalized by the config) -> torch dtypes. vLLM's "fp8" is
# e4m3 on CUDA: 3 mantissa bits where e5m2 has 2, ample range once scaled.
_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                 "fp8_e5m2": torch.float8_e5m2}


def resolve_cache_dtype(cache_dtype: str, model_dtype: torch.dtype,
                        quantization: str = "none") -> torch.dtype:
    """The KV cache's torch dtype: the one named, or for "auto" the model's — except for a
    model run on its GGUF file's quantized weights ("gguf", CPU), whose float32 activations
    get a float16 cache, llama.cpp's default for the same file: half the bytes every decode
    step's attention reads (1.4x faster attention at 64 streams on the default model), and
    the default model's greedy answers unchanged (15 of 15 chat prompts, 16 tokens, against
    a float32 cache)."""
    if cache_dtype != "auto":
        return _CACHE_DTYPES[cache_dtype]
    if quantization == "gguf" and model_dtype == torch.float32:
        return torch.float16
    return model_dtype


def bytes_per_block(spec: ArchSpec, block_size: int, dtype: torch.dtype,
                    num_layers: int | None = None) -> int:
    """One block id's bytes: a page of K and V in each of `num_layers` cache tensors (every
    layer's by default; a KVCacheLayout's group_size when layers share tensors)."""
    element = torch.empty((), dtype=dtype).element_size()
    layers = spec.num_layers if num_layers is None else num_layers
    heads, width = spec.kv_entry
    return spec.kv_planes * layers * block_size * heads * width * element


def default_cpu_kv_bytes() -> int:
    """A quarter of the memory available now, at most 4 GiB: room for the weights, the
    activations and the rest of the machine's work."""
    return int(min(_DEFAULT_CPU_KV_BYTES, psutil.virtual_memory().available // 4))


def determine_num_blocks(spec: ArchSpec, *, block_size: int, dtype: torch.dtype,
                         max_model_len: int, kv_cache_memory_bytes: int | None,
                         num_blocks_override: int | None, extra_bytes_per_block: int = 0,
                         layout: KVCacheLayout | None = None, max_step_tokens: int = 1,
                         max_num_seqs: int = 1) -> int:
    """Blocks that fit the budget; `extra_bytes_per_block`: a draft model's cache, which
    has the same blocks beside the target's. The cache must hold one sequence of
    max_model_len in every KV cache group of `layout` (default: one group of every layer; a
    sliding group holds only its window and a step of `max_step_tokens`), besides the
    reserved null block. An encoder keeps no KV cache (its blocks cost no bytes): enough
    blocks for max_num_seqs sequences of max_model_len, so they never limit a batch."""
    layout = layout or full_attention_layout(spec.num_layers)
    per_block = bytes_per_block(spec, block_size, dtype, layout.group_size) + extra_bytes_per_block
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
    elif per_block == 0:
        num_blocks = (max_num_seqs * layout.blocks_per_sequence(max_model_len, block_size)
                      + layout.num_reserved_blocks)
    else:
        budget = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else default_cpu_kv_bytes()
        num_blocks = budget // per_block
    needed = (layout.blocks_per_sequence(max_model_len, block_size, max_step_tokens)
              + layout.num_reserved_blocks)
    if num_blocks < needed:
        missing = (needed - num_blocks) * per_block
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens), fewer than "
            f"one sequence of max_model_len={max_model_len} needs ({needed} blocks): "
            f"{missing / 2**20:.1f} MiB missing; lower max_model_len or give the cache more "
            f"memory (--gpu-memory-utilization, --kv-cache-memory-bytes, "
            f"--num-gpu-blocks-override)")
    return num_blocks


def allocate_kv_caches(spec: ArchSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device,
                       layout: KVCacheLayout | None = None) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, kv_heads, head_dim] tensor ([1, ..., 1, latent width]
    for multi-head latent attention: ArchSpec.kv_planes, kv_entry) per layer slot of `layout`
    (default: one per layer), returned per model layer: layers in the same slot of different
    KV cache groups get the same tensor (each reads only its group's block ids). Zeroed, so
    padded reads of never-written slots hold finite values (0 * NaN would poison masked
    attention); a float8 zero is all zero bits too."""
    shape = (spec.kv_planes, num_blocks, block_size, *spec.kv_entry)
    num_tensors = spec.num_layers if layout is None else layout.group_size
    if spec.kv_planes == 0:   # an encoder: empty tensors (its attention reads no cache)
        tensors = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_tensors)]
    elif device.type == "cpu":
        tensors = [_lazily_zeroed(shape, dtype) for _ in range(num_tensors)]
    else:
        tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_tensors)]
    if layout is None:
        return tensors
    return [tensors[slot] for _, slot in layout.layer_placement(spec.num_layers)]


def _lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages the OS maps on first touch: numpy's zeros is calloc,
    which for large sizes maps fresh zero pages instead of writing zeros, so a 4 GiB cache
    costs no start-up time (torch.zeros wrote it all: ~12 s on a 2-vCPU VM) and no resident
    memory until blocks are used."""
    import numpy as np
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = np.zeros(int(np.prod(shape)) * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def kv_budget_message(total: int, utilization: float, peak: int, outside_torch: int,
                      detail: str = "") -> str:
    """The start-up refusal when the KV cache would get no memory: how much is missing, and
    the flags that change it."""
    allowed = int(total * utilization)
    missing = peak + outside_torch - allowed
    return (f"the KV cache gets no memory: gpu_memory_utilization={utilization} of "
            f"{total / 2**30:.1f} GiB allows {allowed / 2**30:.2f} GiB, and the model's "
            f"forward pass peaks at {peak / 2**30:.2f} GiB{detail} with "
            f"{outside_torch / 2**30:.2f} GiB held outside torch: {missing / 2**30:.2f} GiB "
            "missing before any KV cache. Raise --gpu-memory-utilization, lower "
            "--max-num-batched-tokens or --max-num-seqs, or use a smaller model or dtype")


def gpu_kv_cache_bytes(run_profile: Callable[[], int], device: torch.device,
                       utilization: float, activation_bytes: int | None = None,
                       peak_detail: Callable[[], str] | None = None) -> tuple[int, int]:
    """Memory the KV cache may take on a GPU: `utilization` of the card, less the peak the
    model reaches in a forward pass at the largest batch (weights + activations, and a
    vision-language model's encoder at its largest image batch, measured by `run_profile`,
    which returns bytes of scratch it allocated that the real run will not hold), less
    memory held outside torch's allocator (CUDA context, other processes).
    `activation_bytes`: the peak above what is allocated now, from an earlier identical start
    (worker/profile_cache.py); the pass is then not run. `peak_detail`: what the refusal
    says of the peak's parts. Returns (budget, the peak above what was allocated before the
    pass: the figure to keep)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    resident = torch.cuda.memory_allocated(device)
    if activation_bytes is None:
        torch.cuda.reset_peak_memory_stats(device)
        scratch = run_profile()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - scratch
        activation_bytes = max(0, peak - resident)
        # the pass's freed blocks stay reserved, which is not memory "outside torch"
    peak = resident + activation_bytes
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    budget = int(total * utilization) - peak - outside_torch
    logger.info("GPU memory: %.1f GiB total, utilization %.2f, model peak %.2f GiB, outside torch "
                "%.2f GiB -> KV cache %.2f GiB", total / 2**30, utilization, peak / 2**30,
                outside_torch / 2**30, max(budget, 0) / 2**30)
    if budget <= 0:
        raise ValueError(kv_budget_message(total, utilization, peak, outside_torch,
                                           peak_detail() if peak_detail else ""))
    return budget, activation_bytes
