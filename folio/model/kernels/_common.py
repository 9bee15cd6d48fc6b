"""Shared bits for folio's Triton kernels: optional import, interpreter-aware autotune configs,
programmatic dependent launch."""
from __future__ import annotations

import functools
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


_BENCHMARKS = [0]


def autotune(*, behind_lead: bool = False, **kwargs):
    """triton.autotune whose choices are kept on disk (Triton's cache directory, keyed by the
    kernel's source, the GPU, the tuning key and the configs): a restart reads them instead of
    benchmarking every config again (seconds of each start). Not under the interpreter.
    Every config benchmarked is counted (`autotune_benchmarks`). `behind_lead`: each config
    is timed behind a short kernel, as a decode step runs it (`bench_behind_lead`)."""
    if behind_lead:
        kwargs.setdefault("do_bench", bench_behind_lead)
    decorate = triton.autotune(cache_results=not INTERPRET, **kwargs)

    def wrap(fn):
        tuner = decorate(fn)
        bench = getattr(tuner, "_bench", None)
        if bench is not None:
            def counted(*args, **kw):
                _BENCHMARKS[0] += 1
                return bench(*args, **kw)
            tuner._bench = counted
        return tuner
    return wrap


_LEADS: dict[int, object] = {}


def bench_behind_lead(kernel_call, quantiles=None):
    """Time a config as the one-row GEMVs run in a decode step: right behind a short kernel
    (a norm of one 4096-wide row) that lets it launch at its own start (PDL, where the GPU
    has it). Such a GEMV loads its first weight tiles before it waits for the kernel before
    it, so under PDL those loads overlap that kernel; timed alone, after an L2 flush and a
    launch, they cannot. On the H100 the alone-timed choices for the narrow projections were
    5-7 % slower, back to back under PDL, than the best config (session 33's sweep: the
    tuner ranked FP8 qkv's best fourth). The lead's own time is the same for every config,
    so the ranking is the configs'. Triton's do_bench still flushes the L2 before each
    call (the weights of a large model's layer are not in it either)."""
    import torch
    from triton.testing import do_bench
    device = torch.cuda.current_device()
    lead = _LEADS.get(device)
    if lead is None:
        x = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        pdl = _pdl_capable(device)

        def lead():
            _lead_kernel[(1,)](x, y, N=4096, USE_PDL=pdl, launch_pdl=pdl, num_warps=4)
        _LEADS[device] = lead

    def chained():
        lead()
        kernel_call()
    return do_bench(chained, quantiles=quantiles)


def autotune_benchmarks() -> int:
    """How many autotune configs this process has benchmarked so far: a caller can tell
    whether a run tuned anything (nothing, on a restart whose choices were on disk)."""
    return _BENCHMARKS[0]


def warps_configs(warps: tuple[int, ...]) -> list:
    if INTERPRET:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    return [triton.Config({}, num_warps=w, num_stages=1) for w in warps]


@functools.lru_cache(maxsize=None)
def device_capability(device_index: int) -> tuple[int, int]:
    """The CUDA device's compute capability, asked once per device."""
    import torch
    return torch.cuda.get_device_capability(device_index)


def _pdl_capable(device_index: int) -> bool:
    return device_capability(device_index)[0] >= 9


def pdl_launch(x, allowed: bool) -> bool:
    """Whether a kernel reading `x` launches with programmatic dependent launch (PDL): wanted
    (`allowed`, the layers' KernelConfig.pdl_on), a CUDA tensor on a Hopper-or-newer GPU, not
    the interpreter. Under PDL the next kernel in the stream is launched while this one still
    runs and waits (griddepcontrol.wait) before touching memory, so the launch gap between
    the many small kernels of a decode step is hidden; kernels launched this way must start
    with `pdl_entry`."""
    if not allowed or INTERPRET or not HAS_TRITON or not x.is_cuda:
        return False
    return _pdl_capable(x.device.index if x.device.index is not None else 0)


def split_k_workspace(cache: dict, device, partials: int, counters: int):
    """The split-K workspace of one kernel family on `device`, made on first use and kept in
    `cache`: fp32 partials and int32 ticket counters, zero between launches (the last program
    of each output tile resets its own). Kernels sharing one must not run concurrently on two
    streams."""
    import torch
    key = (device.type, device.index)
    ws = cache.get(key)
    if ws is None:
        ws = cache[key] = (torch.empty(partials, dtype=torch.float32, device=device),
                           torch.zeros(counters, dtype=torch.int32, device=device))
    return ws


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")


if HAS_TRITON:

    @triton.jit
    def pdl_entry(USE_PDL: tl.constexpr):
        """First statement of a kernel that may be launched with PDL: wait until the kernel
        before it has finished and its writes are visible (its outputs are this one's
        inputs), then let the next kernel launch (it waits the same way, so nothing reads
        this one's outputs early). A no-op when launched without PDL."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _lead_kernel(X, Y, N: tl.constexpr, USE_PDL: tl.constexpr):
        """bench_behind_lead's lead: an RMS norm of one N-wide row (N a power of two)."""
        pdl_entry(USE_PDL)
        offs = tl.arange(0, N)
        x = tl.load(X + offs).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, axis=0) / N + 1e-6)
        tl.store(Y + offs, y.to(Y.dtype.element_ty))

    @triton.jit
    def load_k_tile(rows, offs_k, K: tl.constexpr, BLOCK_K: tl.constexpr):
        """rows [R, 1] pointers -> the [R, BLOCK_K] tile at offs_k; only the tile at K can be
        ragged (masked only where K is not a multiple of BLOCK_K)."""
        if K % BLOCK_K == 0:
            tile = tl.load(rows + offs_k[None, :])
        else:
            tile = tl.load(rows + offs_k[None, :], mask=offs_k[None, :] < K, other=0.0)
        return tile
