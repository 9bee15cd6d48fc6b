"""Small host-to-device helpers for the step's hot path."""
from __future__ import annotations

from typing import Any

import torch


def to_device(values: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(values) on `device` without stalling the host. torch.tensor(..., device=cuda)
    copies synchronously, which waits for every queued kernel: a few of those per step made the
    GPU path host-bound. A pinned staging tensor and a non-blocking copy queue behind the GPU's
    work instead (the pinned allocator keeps the buffer alive until the copy has run)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor if device.type == "cpu" else tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
