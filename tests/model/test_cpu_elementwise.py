"""folio's C++ float32 RMSNorm / rotary / SiLU-and-mul (used by the layers on the CPU) against
the layers' eager torch code (KernelConfig(kernels="torch")) on the same inputs."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from folio.model.kernel_config import KernelConfig
from folio.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, cpu_kernel_ops

EAGER = KernelConfig(kernels="torch")
FUSED = KernelConfig()


def test_the_cpu_ops_serve_float32_only() -> None:
    """The comparisons below mean something only if FUSED really takes the C++ path."""
    x = torch.zeros(2, 8)
    assert cpu_kernel_ops(x, FUSED) is not None
    assert cpu_kernel_ops(x, EAGER) is None
    assert cpu_kernel_ops(x.bfloat16(), FUSED) is None


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-6) -> bool:
    return bool(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() < tol)


@pytest.mark.parametrize("rows,dim", [(1, 576), (37, 64), (5, 100)])
def test_rms_norm_matches_the_eager_code(rows: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)
    weight = torch.randn(dim, generator=gen)
    fused, eager = RMSNorm(dim, 1e-5, FUSED), RMSNorm(dim, 1e-5, EAGER)
    with torch.no_grad():
        fused.weight.copy_(weight)
        eager.weight.copy_(weight)
    with torch.inference_mode():
        assert _close(fused(x), eager(x))
        (a, a_sum), (b, b_sum) = fused(x, res), eager(x, res)
        assert _close(a, b) and torch.equal(a_sum, b_sum)
        # A strided input (rows of a wider tensor) reads the right elements.
        wide = torch.randn(rows, dim * 2, generator=gen)[:, :dim]
        assert _close(fused(wide), eager(wide))


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_matches_the_eager_code(partial: float) -> None:
    config = SimpleNamespace(rope_theta=10000.0, partial_rotary_factor=partial)
    fused = RotaryEmbedding(64, 512, config, FUSED)
    eager = RotaryEmbedding(64, 512, config, EAGER)
    gen = torch.Generator().manual_seed(7)
    T = 11
    qkv = torch.randn(T, (4 + 2 + 2) * 64, generator=gen)
    positions = torch.randint(0, 512, (T,), generator=gen)
    q, k = qkv[:, :256].view(T, 4, 64), qkv[:, 256:384].view(T, 2, 64)  # strided views
    with torch.inference_mode():
        before = qkv.clone()
        ref_q, ref_k = eager(positions, q, k)
        out_q, out_k = fused(positions, q, k)
        assert _close(out_q, ref_q) and _close(out_k, ref_k)
        assert torch.equal(qkv, before)  # the inputs are left as they were
        with pytest.raises(RuntimeError, match="out of range"):
            fused(torch.tensor([512] * T), q, k)


def test_silu_and_mul_saturates_on_both_sides_without_overflow() -> None:
    """Gates far past float32's exp range on either side give g (large positive) and 0
    (large negative), never inf or NaN, whether they fall in a full vector or in a row's
    remainder (widths 1..17: the remainder goes through libm's exp, the vectors through
    SLEEF's)."""
    ext = cpu_kernel_ops(torch.zeros(1), FUSED)
    assert ext is not None       # the C++ kernels are built here (first test of this file)
    for width in range(1, 18):
        gate = torch.linspace(-1e4, 1e4, 3 * width).view(3, width)
        gate_up = torch.cat([gate, torch.full_like(gate, 2.0)], dim=1)
        out = ext.silu_and_mul(gate_up)
        want = torch.nn.functional.silu(gate) * 2.0
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-30)


def test_silu_and_mul_matches_the_eager_code() -> None:
    fused, eager = GatedMLP(64, 96, False, "silu", FUSED), GatedMLP(64, 96, False, "silu", EAGER)
    eager.load_state_dict(fused.state_dict())
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert _close(fused(x), eager(x))
