"""Shared bits for folio's Triton kernels: optional import, interpreter-aware autotune configs."""
from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs without triton
    triton = None
    tl = None
    HAS_TRITON = False

# Read once at import: the interpreter runs every config it is given, so give it one.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def warps_configs(warps: tuple[int, ...]) -> list:
    if INTERPRET:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    return [triton.Config({}, num_warps=w, num_stages=1) for w in warps]


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
