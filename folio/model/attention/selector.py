"""Which attention backend a device gets."""
from __future__ import annotations

import torch

from folio.model.attention.backend import AttentionBackend
from folio.model.kernel_config import DEFAULT_KERNEL_CONFIG, KernelConfig


def get_attention_backend(device: torch.device,
                          kernels: KernelConfig = DEFAULT_KERNEL_CONFIG) -> AttentionBackend:
    """The device's own kernels: Triton on CUDA, folio's C++ kernel on the CPU (where it
    builds); the torch reference with `kernels.attention` "torch" (FOLIO_ATTENTION=torch, read
    once by `resolve_kernel_config`) or on a CPU where the C++ kernels cannot be built. Called
    once per model build, so the choice is fixed for the model's life."""
    if device.type == "cuda" and kernels.triton_attention:
        from folio.model.attention.triton_backend import TritonPagedAttention
        return TritonPagedAttention(pdl=kernels.pdl_on)
    if device.type == "cpu" and kernels.triton_attention:
        from folio.model import cpu_kernels
        if cpu_kernels.loaded() is not None:
            from folio.model.attention.cpu_backend import CpuPagedAttention
            return CpuPagedAttention()
    from folio.model.attention.torch_paged import TorchPagedAttention
    return TorchPagedAttention()


def check_kv_cache_dtype(device: torch.device, model_dtype: torch.dtype,
                         cache_dtype: torch.dtype,
                         kernels: KernelConfig = DEFAULT_KERNEL_CONFIG) -> None:
    """Refuse, before any weight is loaded, a KV cache dtype that the backend
    `get_attention_backend(device, kernels)` picks cannot read. The C++ CPU kernel converts to
    and from a float32, bfloat16 or float16 cache whatever the model's dtype, and the torch
    reference casts on write and read; the Triton kernels read the cache in the query's dtype
    (triton_kernels._check_query), so on CUDA the cache must be in the model's dtype."""
    if cache_dtype == model_dtype or device.type != "cuda" or not kernels.triton_attention:
        return
    name = str(cache_dtype).removeprefix("torch.")
    model = str(model_dtype).removeprefix("torch.")
    raise ValueError(
        f"kv_cache_dtype {name} differs from the model's dtype {model}: the CUDA (Triton) "
        f"attention kernels need the KV cache in the model's dtype; use kv_cache_dtype auto, "
        f"or dtype {name} to run the model in it (FOLIO_ATTENTION=torch, the slow reference "
        "backend, takes any cache dtype)")
