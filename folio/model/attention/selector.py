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
