"""Copies between host and device that do not stall the host.

`torch.tensor(values, device="cuda")` copies from pageable memory, and such a copy waits for
every kernel queued before it: one in the middle of a step's launches makes the host wait for
the previous step to finish, which undoes async scheduling. Going through pinned memory with
non_blocking=True queues the copy instead.
"""
from __future__ import annotations

from typing import Sequence

import torch


def device_tensor(values: Sequence, device: torch.device,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, queued through pinned memory on CUDA (the caching host
    allocator keeps the pinned buffer until the copy is done); as it is elsewhere."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_host_async(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a CUDA tensor, queued behind the work already on the stream (the
    caller records an event and waits for it before reading); CPU tensors come back as they
    are."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
