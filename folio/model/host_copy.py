"""Small host lists to the device without stalling the host.

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
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
