"""Which attention backend a device gets."""
from __future__ import annotations

import torch

from folio.model.attention.backend import AttentionBackend
from folio.model.kernel_config import DEFAULT_KERNEL_CONFIG, KernelConfig


def get_attention_backend(device: torch.device,
                          kernels: KernelConfig = DEFAULT_KERNEL_CONFIG) -> AttentionBackend:
    """Triton kernels on CUDA; the torch reference on CPU (and with `kernels.attention` "torch":
    FOLIO_ATTENTION=torch, read once by `resolve_kernel_config`). Called once per model build,
    so the choice is fixed for the model's life."""
    if device.type == "cuda" and kernels.triton_attention:
        from folio.model.attention.triton_backend import TritonPagedAttention
        return TritonPagedAttention(pdl=kernels.pdl_on)
    from folio.model.attention.torch_paged import TorchPagedAttention
    return TorchPagedAttention()
