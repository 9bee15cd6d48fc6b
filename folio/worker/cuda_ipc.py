"""CUDA tensors shared between two processes on one host (CUDA IPC): the producer exports
handles to its KV cache tensors once, a consumer on the same GPU (or one that can reach it)
maps them and copies blocks device to device — no host memory, no socket for the bytes.

The handles travel as plain msgspec fields (never pickled: they arrive over a socket), and
the tensors are rebuilt with torch's own `rebuild_cuda_tensor`, the classes fixed here. The
GPU is named by its UUID, since device indices differ between processes
(CUDA_VISIBLE_DEVICES). A producer's memory stays valid while its process lives; a
consumer keys what it mapped by the producer's engine id, which a restart changes.
"""
from __future__ import annotations

import msgspec
import torch


class IpcTensor(msgspec.Struct, array_like=True):
    size: list[int]
    stride: list[int]
    offset: int
    dtype: str
    device_uuid: str
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_tensors(tensors: list[torch.Tensor]) -> list[IpcTensor]:
    from torch.multiprocessing.reductions import reduce_tensor
    out = []
    for tensor in tensors:
        _, args = reduce_tensor(tensor)
        (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_size,
         storage_offset, _grad, ref_handle, ref_offset, event_handle, event_sync) = args
        out.append(IpcTensor(list(size), list(stride), int(offset),
                             str(dtype).removeprefix("torch."), gpu_uuid(tensor.device),
                             bytes(handle), int(storage_size), int(storage_offset),
                             bytes(ref_handle), int(ref_offset), bytes(event_handle or b""),
                             bool(event_sync)))
    return out


def import_tensors(handles: list[IpcTensor]) -> list[torch.Tensor]:
    """The producer's tensors, mapped into this process (ValueError when its GPU is not one
    this process sees)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    local = {gpu_uuid(torch.device("cuda", i)): i for i in range(torch.cuda.device_count())}
    out = []
    for h in handles:
        index = local.get(h.device_uuid)
        if index is None:
            raise ValueError("the producer's GPU is not visible to this process")
        dtype = getattr(torch, h.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {h.dtype!r}")
        out.append(rebuild_cuda_tensor(
            torch.Tensor, torch.Size(h.size), tuple(h.stride), h.offset,
            torch.storage.TypedStorage, dtype, index, h.handle, h.storage_size,
            h.storage_offset, False, h.ref_counter_handle, h.ref_counter_offset,
            h.event_handle or None, h.event_sync_required))
    return out
