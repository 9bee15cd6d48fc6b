"""folio's C++ CPU kernels (csrc/), compiled on first use with torch's extension builder and
cached (TORCH_EXTENSIONS_DIR, or ~/.cache/torch_extensions): the first start on a machine
takes about a minute, later ones load the built library. Built for the machine it runs on
(-march=native), with OpenMP so that at::parallel_for uses torch's threads.
"""
from __future__ import annotations

import functools
import logging
import os
import threading

logger = logging.getLogger(__name__)

_SOURCES = {"folio_q4_matmul": "q4_matmul.cpp"}
_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _build(name: str):
    from torch.utils.cpp_extension import load
    source = os.path.join(os.path.dirname(__file__), "csrc", _SOURCES[name])
    logger.info("building the CPU kernel %s (first use on this machine only)", name)
    return load(name=name, sources=[source], verbose=False,
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"])


def kernel(name: str):
    """The compiled module `name` (one build per process, under a lock: two threads must not
    race on the build directory)."""
    with _lock:
        return _build(name)


def q4_matmul_module():
    return kernel("folio_q4_matmul")
