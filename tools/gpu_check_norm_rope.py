"""GPU check and timing of folio.model.kernels (RMSNorm+residual, rotary) vs folio.model.layers.

    python tools/gpu_check_norm_rope.py     # bf16/fp16/fp32, prints a table
"""
from __future__ import annotations

import os
import sys
import types

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from folio.model.kernels.rmsnorm import rms_norm  # noqa: E402
from folio.model.kernels.rotary import apply_rotary  # noqa: E402
from folio.model.layers import RMSNorm, RotaryEmbedding  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def main() -> None:
    dev = torch.device("cuda")
    T, D, H, KVH, HD = 8192, 4096, 32, 8, 128
    fails = 0
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        norm = RMSNorm(D, 1e-5).to(dev, dt)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(D, device=dev))
        x, r = torch.randn(T, D, device=dev, dtype=dt), torch.randn(T, D, device=dev, dtype=dt)
        with torch.no_grad():
            ro, rr = norm(x, r)
            o, nr = rms_norm(x, norm.weight, 1e-5, residual=r)
        e1, e2 = rel(o, ro), rel(nr, rr)
        rope = RotaryEmbedding(HD, 16384, types.SimpleNamespace(rope_theta=5e5)).to(dev)
        qkv = torch.randn(T, (H + 2 * KVH) * HD, device=dev, dtype=dt)
        q = qkv[:, :H * HD].view(T, H, HD)
        k = qkv[:, H * HD:(H + KVH) * HD].view(T, KVH, HD)
        pos = torch.randint(0, 16384, (T,), device=dev)
        rq, rk = rope(pos, q, k)
        oq, ok_ = apply_rotary(pos, q, k, rope.cos, rope.sin)
        e3, e4 = rel(oq, rq), rel(ok_, rk)
        tol = 1e-5 if dt == torch.float32 else 1e-2
        finite = all(bool(torch.isfinite(t).all()) for t in (o, nr, oq, ok_))
        good = finite and max(e1, e2, e3, e4) < tol
        fails += not good
        t_norm_tri = ms(lambda: rms_norm(x, norm.weight, 1e-5, residual=r))
        with torch.no_grad():
            t_norm_ref = ms(lambda: norm(x, r))
        t_rope_tri = ms(lambda: apply_rotary(pos, q, k, rope.cos, rope.sin))
        t_rope_ref = ms(lambda: rope(pos, q, k))
        print(f"{str(dt):15s} errs norm {e1:.1e}/{e2:.1e} rope {e3:.1e}/{e4:.1e} "
              f"{'OK' if good else 'FAIL'} | rmsnorm+res {t_norm_tri:.4f} ms vs {t_norm_ref:.4f}"
              f" | rope {t_rope_tri:.4f} ms vs {t_rope_ref:.4f}", flush=True)
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
