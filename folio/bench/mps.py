"""A CUDA MPS control daemon of the benchmark's own (`folio bench disagg --mps`).

Two processes on one GPU without MPS take the GPU in turns: while the prefill server's long
kernels are queued, the decode server's wait (measured on an H100 by
tools/gpu_diag_colocated.py: a 200 ms burst of another process's GEMMs held a server's decode
steps for 226 ms). Under MPS their kernels share the SMs at once. The daemon's pipe and log
directories are private (a temporary directory), so only the processes given its
environment connect to it; it is told to quit when the block ends.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from typing import Iterator

_CONTROL = "nvidia-cuda-mps-control"


def mps_available() -> bool:
    """Whether the MPS control program is on PATH (it comes with the NVIDIA driver)."""
    return shutil.which(_CONTROL) is not None


def mps_control() -> str:
    """The control program's path; ValueError when it is not on PATH."""
    exe = shutil.which(_CONTROL)
    if exe is None:
        raise ValueError(f"--mps needs {_CONTROL} on PATH (it comes with the NVIDIA driver)")
    return exe


@contextlib.contextmanager
def mps_daemon() -> Iterator[dict[str, str]]:
    """Start a private MPS daemon; yield the environment variables its clients need."""
    exe = mps_control()
    root = tempfile.mkdtemp(prefix="folio-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}
    for path in env.values():
        os.makedirs(path)
    full = {**os.environ, **env}
    subprocess.run([exe, "-d"], env=full, check=True, timeout=30)
    try:
        yield env
    finally:
        subprocess.run([exe], input="quit\n", text=True, env=full, timeout=30,
                       capture_output=True)
