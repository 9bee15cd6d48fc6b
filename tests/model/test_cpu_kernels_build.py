"""The CPU extension's name follows its sources and checkout: torch's builder keys its build
directory by name, so an edited kernel (or another checkout, whose include path differs) must
not share a name."""
from __future__ import annotations

import os
import shutil

import pytest

from folio.model import cpu_kernels


def test_extension_name_changes_with_any_source_and_checkout(tmp_path) -> None:
    here = os.path.join(os.path.dirname(cpu_kernels.__file__), "csrc")
    copy = tmp_path / "csrc"
    shutil.copytree(here, copy)
    name = cpu_kernels._extension_name(str(copy))
    assert name.startswith(cpu_kernels._NAME + "_")
    assert name == cpu_kernels._extension_name(str(copy))
    # the same sources in another checkout: its own build (the include path differs)
    assert name != cpu_kernels._extension_name(here)
    with open(copy / "ops.h", "a") as f:  # a header counts too
        f.write("\n// edited\n")
    assert cpu_kernels._extension_name(str(copy)) != name


def test_a_build_killed_midway_does_not_hang_the_next_start(tmp_path) -> None:
    """A builder killed while it held the directory leaves torch's `lock` file behind (torch's
    builder would then wait for it forever); the next build clears it, because the flock the
    dead builder held was released with it."""
    import signal
    import subprocess
    import sys
    build_dir = str(tmp_path / "build")
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from folio.model import cpu_kernels\n"
         f"with cpu_kernels._build_lock({build_dir!r}):\n"
         f"    open({build_dir!r} + '/lock', 'w').close()  # torch's baton, as its builder makes it\n"
         "    print('building', flush=True)\n"
         "    time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "building"
        assert os.path.exists(os.path.join(build_dir, "lock"))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    with cpu_kernels._build_lock(build_dir):
        assert not os.path.exists(os.path.join(build_dir, "lock"))


def _isa_variants() -> list[str]:
    """The -march values whose simd.h branch differs from this machine's own build: the
    portable loops (what an Arm machine runs) and, where the CPU has them, AVX2 + FMA (what this
    project's 2-vCPU VM without AVX-512 runs natively; on an AVX-512 machine it is another
    branch)."""
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    out = ["x86-64"]
    if " avx512f" in flags and " avx2" in flags and " fma" in flags:
        out.append("x86-64-v3")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("march", _isa_variants())
def test_every_instruction_set_branch_computes_the_same_matmuls(march) -> None:
    """csrc/simd.h writes the matmul kernels once for AVX-512, AVX2 + FMA and plain loops; the
    build picks one by -march. A build for another branch than this machine's gives the same
    products (float32 summation order apart) on every path: 1..8-row blocks with their row
    remainders, the tiled many-row path, two planes, float32 and float16 group parameters,
    per-group and per-row int8 scales; and SiLU-and-mul."""
    import numpy as np
    import torch

    other = cpu_kernels._build(march=march, simd_only=True)
    native = cpu_kernels.extension()
    rng = np.random.default_rng(0)
    n, k = 70, 192          # N not a multiple of any row block; K = 6 groups of 32
    codes = torch.from_numpy(rng.integers(0, 256, (2, n, k // 2), dtype=np.uint8))
    scale = torch.from_numpy(rng.random((2, n, k // 32), dtype=np.float32) * 0.02)
    zero = torch.from_numpy(rng.standard_normal((2, n, k // 32), dtype=np.float32) * 0.01)
    i8 = torch.from_numpy(rng.integers(-127, 128, (n, k), dtype=np.int8))
    group_scale = torch.from_numpy(rng.random((n, k // 16), dtype=np.float32) * 0.01)
    row_scale = group_scale[:, :1].contiguous()
    # the weights as dequantization gives them: byte i of a group of 16 holds element i (low
    # nibble) and element i + 16 (high nibble)
    groups = codes.view(2, n, k // 32, 16).to(torch.float32)
    nibbles = torch.cat([groups % 16, torch.div(groups, 16, rounding_mode="floor")], dim=-1)
    planes_w = ((nibbles - 8) * scale[..., None] + zero[..., None]).view(2, n, k)
    # float16 group parameters: ggml's d and m, weights code * d + m
    d16, m16 = scale.half(), zero.half()
    planes_w16 = (nibbles * d16.float()[..., None] + m16.float()[..., None]).view(2, n, k)
    for m in (1, 3, 8, 11, 40):
        x = torch.randn(m, k)
        for planes in (1, 2):
            for params, weights in (((scale, zero), planes_w), ((d16, m16), planes_w16)):
                args = (x, codes[:planes].contiguous(), params[0][:planes].contiguous(),
                        params[1][:planes].contiguous())
                want = x @ weights[:planes].sum(0).T
                for ext in (native, other):
                    torch.testing.assert_close(ext.q4_matmul(*args), want, rtol=1e-4,
                                               atol=1e-4)
        for s in (group_scale, row_scale):
            want = x @ (i8.to(torch.float32) * s.repeat_interleave(k // s.shape[1], 1)).T
            for ext in (native, other):
                torch.testing.assert_close(ext.int8_matmul(x, i8, s), want, rtol=1e-4, atol=1e-4)
    # SiLU-and-mul (elementwise.cpp over simd.h's exponential): 77 features leave a remainder
    # past either vector width; gates from -100 to 100 reach both sides' saturation
    gate_up = torch.cat([torch.linspace(-100, 100, 5 * 77).view(5, 77),
                         torch.randn(5, 77)], dim=1)
    want = torch.nn.functional.silu(gate_up[:, :77]) * gate_up[:, 77:]
    for ext in (native, other):
        torch.testing.assert_close(ext.silu_and_mul(gate_up), want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("march", _isa_variants())
def test_every_instruction_set_branch_computes_the_same_attention(march) -> None:
    """paged_attention on another instruction set's branch of csrc/simd.h equals this
    machine's build (float32 summation order apart): the blocked kernel at every head size it
    takes (32..256, as 4..32 vectors of either width) and the plain loop (80), float32,
    bfloat16, float16 and both FP8 caches (per-head scales), a soft cap, attention sinks, a
    sliding window; and on a float32 cache both equal the torch reference."""
    import torch
    from paged_cases import make_step, rel_err

    from folio.model.attention.cpu_backend import CpuPagedAttention
    from folio.model.attention.torch_paged import TorchPagedAttention

    native = CpuPagedAttention()
    other = CpuPagedAttention()
    other._kernel = cpu_kernels._build(march=march, simd_only=True)
    gen = torch.Generator().manual_seed(3)
    reqs = [(0, 19), (33, 1), (70, 2), (5, 1)]
    for D in (32, 64, 80, 128, 256):
        for cache_dtype in ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"):
            case = dict(dtype="float32", cache_dtype="float32", H=6, KVH=2, D=D, bs=16,
                        reqs=reqs)
            q, k, v, cache, meta = make_step(case, gen)
            cache = (cache * 0.5).to(getattr(torch, cache_dtype))
            extra = {}
            if cache_dtype.startswith("float8"):
                extra = dict(k_scale=torch.tensor([0.02, 0.05]), v_scale=torch.tensor([0.03, 0.01]))
            window = 24 if D == 128 else None
            capped = dict(logits_soft_cap=30.0, sinks=torch.randn(6, generator=gen)) \
                if D in (64, 256) else {}
            outs = []
            for backend in (native, other):
                outs.append(backend.forward(q, k, v, cache.clone(), meta, scale=D ** -0.5,
                                            sliding_window=window, **extra, **capped))
            assert rel_err(outs[1], outs[0]) < 1e-5, (D, cache_dtype)
            if cache_dtype == "float32" and not capped:
                ref = TorchPagedAttention().forward(q, k, v, cache.clone(), meta,
                                                    scale=D ** -0.5, sliding_window=window)
                assert rel_err(outs[0], ref) < 1e-5, (D, "reference")
