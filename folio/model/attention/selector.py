"""Which attention backend a device gets."""
from __future__ import annotations

import torch

from folio.model.attention.backend import AttentionBackend
from folio.model.attention.fp8 import is_fp8
from folio.model.kernel_config import DEFAULT_KERNEL_CONFIG, KernelConfig


def get_attention_backend(device: torch.device,
                          kernels: KernelConfig = DEFAULT_KERNEL_CONFIG) -> AttentionBackend:
    """The device's own kernels: Triton on CUDA, folio's C++ kernel on the CPU (where it
    builds); the torch reference with `kernels.attention` "torch" (FOLIO_ATTENTION=torch, read
    once by `resolve_kernel_config`) or on a CPU where the C++ kernels cannot be built. Called
    once per model build, so the choice is fixed for the model's life."""
    if device.type == "cuda" and kernels.triton_attention:
        from folio.model.attention.triton_backend import TritonPagedAttention
        return TritonPagedAttention(pdl=kernels.pdl_on,
                                    dense_prefill=kernels.dense_prefill_on,
                                    kv_write_in_rotary=kernels.kv_write_in_rotary)
    if device.type == "cpu" and kernels.triton_attention:
        from folio.model import cpu_kernels
        if cpu_kernels.loaded() is not None:
            from folio.model.attention.cpu_backend import CpuPagedAttention
            return CpuPagedAttention()
    from folio.model.attention.torch_paged import TorchPagedAttention
    return TorchPagedAttention()


def check_kv_cache_dtype(device: torch.device, model_dtype: torch.dtype,
                         cache_dtype: torch.dtype,
                         kernels: KernelConfig = DEFAULT_KERNEL_CONFIG,
                         capability: tuple[int, int] | None = None) -> None:
    """Refuse, before any weight is loaded, a KV cache dtype that the backend
    `get_attention_backend(device, kernels)` picks cannot read. The C++ CPU kernel converts to
    and from a float32, bfloat16, float16 or FP8 cache whatever the model's dtype, and the
    torch reference casts on write and read; the Triton kernels read the cache in the query's
    dtype (triton_kernels._check_query) or as FP8 (converted on load and scaled), so on CUDA
    the cache must be in the model's dtype or FP8. Triton converts e4m3 only on GPUs of
    compute capability 8.9 or newer (Ada, Hopper): `capability` (None = the device's, when
    CUDA is here) below that refuses fp8_e4m3."""
    if device.type != "cuda" or not kernels.triton_attention:
        return
    name = str(cache_dtype).removeprefix("torch.")
    if is_fp8(cache_dtype):
        if capability is None and torch.cuda.is_available():
            capability = torch.cuda.get_device_capability(device)
        if cache_dtype == torch.float8_e4m3fn and capability is not None and capability < (8, 9):
            raise ValueError(
                f"kv_cache_dtype fp8 ({name}) needs a GPU of compute capability 8.9 or newer "
                f"for the Triton attention kernels, this one is {capability[0]}."
                f"{capability[1]}; use kv_cache_dtype fp8_e5m2 or auto (FOLIO_ATTENTION=torch, "
                "the slow reference backend, takes any cache dtype)")
        return
    if cache_dtype == model_dtype:
        return
    model = str(model_dtype).removeprefix("torch.")
    raise ValueError(
        f"kv_cache_dtype {name} differs from the model's dtype {model}: the CUDA (Triton) "
        f"attention kernels need the KV cache in the model's dtype or FP8; use kv_cache_dtype "
        f"auto or fp8, or dtype {name} to run the model in it (FOLIO_ATTENTION=torch, the slow "
        "reference backend, takes any cache dtype)")
