"""Sleep mode's memory moves (vLLM's --enable-sleep-mode): a model's weights out to host
memory and back, without a second full copy of them anywhere: each tensor goes through one
bounded pinned staging buffer into its own pageable host tensor (pinning a whole model's worth
of host memory is what runs hosts out of memory), and comes back the same way."""
from __future__ import annotations

import torch
from torch import nn

# The pinned staging buffer's size: large enough to keep the copies near PCIe speed.
STAGING_BYTES = 64 << 20


def _copy_out(tensor: torch.Tensor, staging: torch.Tensor | None) -> torch.Tensor:
    """`tensor` (CUDA) as a new pageable host tensor, chunk by chunk through `staging`."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    if tensor.numel() == 0:
        return host
    src = tensor.detach().reshape(-1).view(torch.uint8)
    dst = host.reshape(-1).view(torch.uint8)
    assert staging is not None
    for start in range(0, src.numel(), staging.numel()):
        n = min(staging.numel(), src.numel() - start)
        staging[:n].copy_(src[start:start + n])          # device -> pinned (synchronous)
        dst[start:start + n].copy_(staging[:n])          # pinned -> pageable
    return host


def offload_to_host(module: nn.Module) -> int:
    """Move every parameter and buffer of `module` that lives on a CUDA device to host
    memory; returns the bytes moved. A CPU module stays where it is (0)."""
    moved = 0
    staging = None

    def out(t: torch.Tensor) -> torch.Tensor:
        nonlocal moved, staging
        if not t.is_cuda:
            return t
        if staging is None:
            staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
        moved += t.numel() * t.element_size()
        return _copy_out(t, staging)

    module._apply(out)
    return moved


def tensors_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def module_bytes(module: nn.Module) -> int:
    """Bytes of `module`'s parameters and buffers (packed quantized weights are buffers)."""
    return tensors_bytes((*module.parameters(), *module.buffers()))


def reload_to_device(module: nn.Module, device: torch.device) -> None:
    """The inverse of offload_to_host: every tensor back on `device`."""
    if device.type != "cuda":
        return
    module._apply(lambda t: t.to(device) if t.device.type == "cpu" else t)


def trim_host_heap() -> None:
    """Hand freed heap pages back to the system (glibc's malloc_trim). A large tensor is
    usually its own mapping, unmapped when freed; but after a long run the allocator may have
    placed it in a heap arena, whose freed pages it keeps, and a CPU engine asleep would then
    hold the memory it says it freed. No-op where there is no glibc."""
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        return
    if trim is not None:
        trim(0)
