"""Which attention backend a device gets."""
from __future__ import annotations

import os

import torch

from folio.model.attention.backend import AttentionBackend


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """Triton kernels on CUDA; the torch reference on CPU (and with FOLIO_ATTENTION=torch)."""
    if device.type == "cuda" and os.environ.get("FOLIO_ATTENTION", "triton") == "triton":
        from folio.model.attention.triton_backend import TritonPagedAttention
        return TritonPagedAttention()
    from folio.model.attention.torch_paged import TorchPagedAttention
    return TorchPagedAttention()
