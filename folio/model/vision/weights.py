"""Loading a vision encoder's weights by the checkpoint's names (shared by the encoders)."""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn


def load_by_name(module: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                 local_name: Callable[[str], str | None],
                 reshape: Callable[[str, torch.Tensor], torch.Tensor] | None = None
                 ) -> list[str]:
    """Copy into `module`'s parameters the checkpoint tensors whose names `local_name` maps
    to one of them (None: not this encoder's); `reshape(local, tensor)` adapts a layout.
    ValueError for a shape that does not match; returns the parameters not found."""
    own = dict(module.named_parameters())
    found = set()
    for name, tensor in tensors:
        local = local_name(name)
        if local is None or local not in own:
            continue
        if reshape is not None:
            tensor = reshape(local, tensor)
        param = own[local]
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected "
                             f"{tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        found.add(local)
    return sorted(set(own) - found)
