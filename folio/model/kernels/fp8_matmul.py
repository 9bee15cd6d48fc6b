"""FP8-weight product for a few rows (decode batches of 2-64 rows):
y = x @ (codes * w_scale[:, None])^T (+ b), codes [N, K] float8 e4m3 in nn.Linear layout.

At these rows the product is bound by reading the weight, and cuBLASLt's FP8 GEMM
(torch._scaled_mm) read it at only 29-43 % of the copy bandwidth on the H200 (its tiles are
built for compute-bound shapes; from ~128 rows it wins again). Here each program owns a
[BLOCK_M, BLOCK_N] output tile and streams [BLOCK_N, BLOCK_K] weight tiles through
software-pipelined loads into tl.dot, in one of two arithmetics chosen by the caller:
- A8 (W8A8): x already quantized per row (kernels/act_quant.py), codes times codes on the
  tensor cores; both scales in the epilogue. On Hopper's FP8 MMA (row tiles of 64) the
  accumulator is promoted to full fp32 every PROMOTE_K elements of K, as cuBLASLt does without
  fast accumulation; smaller row tiles widen the codes to fp16 (exact) for the MMA.
- A16 (W8A16), for weight-only FP8 checkpoints: x in its 16-bit dtype and each weight tile
  widened to it in registers (exact for e4m3). It was slower than A8 at every size on the
  H200 (widening every weight element costs more than quantizing the activations), so W8A8
  models take A8.
Narrow outputs (few column blocks for the SMs) may split K over SPLIT_K programs; each writes
an fp32 partial to a workspace and the last of a tile's programs (a ticket counter says which)
sums them in split order, so results do not depend on scheduling, as in kernels/gemv.py.

`supported` says whether a call should be served here; `fp8_matmul` runs it with the tile
config `choose_config` gives for the row count and shape.
"""
from __future__ import annotations

import torch

from folio.model.kernels._common import (HAS_TRITON, INTERPRET, next_pow2, pdl_launch,
                                         require_triton, split_k_workspace, tl, triton)

FP8_DTYPE = torch.float8_e4m3fn
MAX_M = 64                  # past this cuBLASLt's FP8 GEMM was as fast or faster
_MIN_BLOCK_K = 64
_MAX_SPLIT = 4
_SPLIT_MAX_M = 64           # split-K only for small row counts (the workspace is sized for it)
_SPLIT_MAX_N = 8192
_MIN_BLOCK = 16
PROMOTE_K = 128             # FP8 MMA partial sums promoted to fp32 this often along K

# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) by row bucket and output width,
# from the sweep of every config at Llama-3-8B's projections, 2-64 rows, on the H200
# (tools/gpu_sweep_fp8_mm.py; docs/benchmarks.md): each choice was the best or within ~10 % of
# it. Chosen, not autotuned: Triton's autotuner times one launch at a time, and there the
# split-K tiles that won inside a CUDA graph (as decode runs) lost, by up to a third.
_WIDE_N = 16384
_CHOICES = {
    # (row bucket, wide output): config
    (16, False): (16, 64, 256, 2, 4, 4), (32, False): (16, 64, 256, 1, 4, 4),
    (16, True): (16, 128, 128, 1, 4, 4), (32, True): (32, 128, 128, 1, 4, 4),
    (64, True): (64, 128, 256, 1, 8, 3),
}
_INTERPRET_CONFIG = (16, 16, 64, 1, 4, 1)


def row_bucket(m: int) -> int:
    """The row count a config is chosen for: the next power of two, at least 16 (tl.dot's
    rows)."""
    return max(16, next_pow2(m))


def choose_config(m: int, n: int, k: int) -> dict:
    """The tile config for an [m, k] x [n, k]^T product (a forced-config dict, as `_config`
    takes it)."""
    mb = row_bucket(m)
    if INTERPRET:
        chosen = _INTERPRET_CONFIG
    elif mb >= 64 and n <= _WIDE_N:
        # 64 rows of a narrow output: two row blocks of 32 keep more programs busy, except
        # where the output is wide enough to fill the SMs with one
        chosen = (64, 64, 256, 1, 4, 4) if n >= 6144 else (32, 64, 256, 1, 4, 4)
    else:
        chosen = _CHOICES[(min(mb, 64), n > _WIDE_N)]
    bm, bn, bk, sk, warps, stages = chosen
    while k % (bk * sk):          # K not in whole tiles per split: narrower tiles, no split
        bk, sk = (bk // 2, 1) if sk == 1 else (bk, 1)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=warps,
                num_stages=stages)


def _config_kwargs(block_m: int, block_n: int, block_k: int, split_k: int) -> dict:
    # The promotion interval may not exceed one tl.dot's K.
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k,
            "PROMOTE": min(block_k, PROMOTE_K)}


def fits(m_bucket: int, n: int, k: int, block_m: int, block_n: int, block_k: int,
         split_k: int) -> bool:
    """Whether a config serves the shape: K in whole tiles per split, a row tile no taller than
    the bucket, split-K only where the workspace holds the partials."""
    if k % (block_k * split_k) or block_m > m_bucket:
        return False
    if split_k > 1 and (m_bucket > _SPLIT_MAX_M or n > _SPLIT_MAX_N or split_k > _MAX_SPLIT):
        return False
    return True


def servable(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether the kernel can take these operands at all: x [M, K] with 1..MAX_M rows against
    contiguous FP8 codes [N, K], K in whole 64-wide tiles."""
    return codes.dtype == FP8_DTYPE and x.dim() == 2 and codes.dim() == 2 \
        and x.shape[1] == codes.shape[1] and 1 <= x.shape[0] <= MAX_M \
        and codes.shape[1] % _MIN_BLOCK_K == 0 and codes.is_contiguous()


def supported(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether fp8_matmul should serve x against the codes here: servable, on CUDA with
    triton."""
    return HAS_TRITON and x.is_cuda and codes.is_cuda and servable(x, codes)


def _workspace_sizes() -> tuple[int, int]:
    return (_MAX_SPLIT * _SPLIT_MAX_M * _SPLIT_MAX_N,
            triton.cdiv(_SPLIT_MAX_M, _MIN_BLOCK) * triton.cdiv(_SPLIT_MAX_N, _MIN_BLOCK))


_workspaces: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This kernel's split-K partials and ticket counters on `device`."""
    return split_k_workspace(_workspaces, device, *_workspace_sizes())


if HAS_TRITON:
    from folio.model.kernels._common import pdl_entry

    @triton.jit
    def _mac(acc, x, w, A8: tl.constexpr, PROMOTE: tl.constexpr):
        """acc [BLOCK_M, BLOCK_N] += x [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T."""
        if A8:
            acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE)
        else:   # e4m3 widens exactly to either 16-bit dtype
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        return acc

    @triton.jit(do_not_specialize=["M"])
    def _fp8_mm_kernel(X, XS, W, WS, B, OUT, P, C, M, stride_xm, stride_om, N, K,
                       A8: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       PROMOTE: tl.constexpr, USE_PDL: tl.constexpr):
        # Row blocks vary fastest: the programs of one weight tile run together and share
        # its reads through the L2.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        # Rows past M and columns past N read clamped (valid) memory and are never stored.
        x_rows = X + tl.minimum(rows, M - 1).to(tl.int64)[:, None] * stride_xm
        w_rows = W + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K
        # N and K are runtime values (one compiled kernel per config serves every shape);
        # Triton still specializes them on divisibility by 16, so the rows load as vectors.
        K_SPLIT = K // SPLIT_K
        k_lo = pid_k * K_SPLIT
        # The weight is no kernel's output: under PDL its first tile streams in while the
        # kernel before this one finishes.
        w = tl.load(w_rows + (k_lo + offs_k)[None, :])
        pdl_entry(USE_PDL)
        acc = _mac(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
                   tl.load(x_rows + (k_lo + offs_k)[None, :]), w, A8, PROMOTE)
        for k0 in range(k_lo + BLOCK_K, k_lo + K_SPLIT, BLOCK_K):
            w = tl.load(w_rows + (k0 + offs_k)[None, :])
            x = tl.load(x_rows + (k0 + offs_k)[None, :])
            acc = _mac(acc, x, w, A8, PROMOTE)
        is_last = True
        if SPLIT_K > 1:
            tile = pid_m * tl.num_programs(1) + pid_n
            p_off = rows[:, None] * N + cols[None, :]
            p_mask = (rows[:, None] < M) & (cols[None, :] < N)
            tl.store(P + pid_k * (M * N) + p_off, acc, mask=p_mask)
            # every thread's partial is written before the (single-thread) ticket release
            tl.debug_barrier()
            ticket = tl.atomic_add(C + tile, 1, sem="acq_rel")
            is_last = ticket == SPLIT_K - 1
            if is_last:
                acc = tl.zeros_like(acc)
                for s in tl.static_range(SPLIT_K):
                    # .cg: from the L2, never a stale L1 line of an earlier launch
                    acc += tl.load(P + s * (M * N) + p_off, mask=p_mask, other=0.0,
                                   cache_modifier=".cg")
                tl.store(C + tile, 0)
        if is_last:
            acc *= tl.load(WS + cols, mask=cols < N, other=0.0)[None, :]
            if A8:
                acc *= tl.load(XS + tl.minimum(rows, M - 1))[:, None]
            if HAS_BIAS:
                acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            o_mask = (rows[:, None] < M) & (cols[None, :] < N)
            tl.store(OUT + rows[:, None] * stride_om + cols[None, :],
                     acc.to(OUT.dtype.element_ty), mask=o_mask)


def fp8_matmul(x: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor,
               x_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
               out_dtype: torch.dtype | None = None, pdl: bool = False,
               _config: dict | None = None) -> torch.Tensor:
    """x [M, K] @ (codes [N, K] * w_scale [N, 1])^T (+ bias) -> [M, N].

    W8A8: x is float8 e4m3 codes with `x_scale` [M, 1] float32 (per row), and `out_dtype` (the
    activations' 16-bit dtype) must be given. W8A16: x is float16/bfloat16 and `x_scale` None;
    the output takes x's dtype. Accumulates in fp32. `_config` (tests, the sweep tool) forces
    one tile config."""
    require_triton()
    a8 = x.dtype == FP8_DTYPE
    if a8 and (x_scale is None or out_dtype is None):
        raise ValueError("FP8 activations need their per-row x_scale and an out_dtype")
    if not a8 and (x_scale is not None or x.dtype not in (torch.float16, torch.bfloat16)):
        raise ValueError("16-bit activations take no x_scale (W8A16), got "
                         f"{x.dtype} with x_scale={x_scale is not None}")
    if not servable(x, codes):
        raise ValueError(f"fp8_matmul cannot serve x {tuple(x.shape)} {x.dtype} against codes "
                         f"{tuple(codes.shape)} {codes.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = codes.shape[0]
    if w_scale.shape != (n,) or w_scale.dtype != torch.float32 or not w_scale.is_contiguous():
        raise ValueError(f"w_scale must be contiguous float32 [{n}], got "
                         f"{tuple(w_scale.shape)} {w_scale.dtype}")
    if a8 and (x_scale.shape != (m, 1) or x_scale.dtype != torch.float32):
        raise ValueError(f"x_scale must be float32 [{m}, 1], got {tuple(x_scale.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{n}], got {tuple(bias.shape)}")
    dtype = out_dtype if a8 else x.dtype
    out = torch.empty((m, n), dtype=dtype, device=x.device)
    partials, counters = _workspace(x.device)
    xs = x_scale.reshape(m) if a8 else w_scale
    if a8 and xs.stride(0) != 1:
        xs = xs.contiguous()
    pdl = pdl_launch(x, pdl)
    args = (x, xs, codes, w_scale, bias if bias is not None else w_scale, out, partials,
            counters, m, x.stride(0), out.stride(0))
    meta = dict(A8=a8, HAS_BIAS=bias is not None, USE_PDL=pdl, launch_pdl=pdl)
    config = dict(_config if _config is not None else choose_config(m, n, k))
    warps, stages = config.pop("num_warps", 4), config.pop("num_stages", 1)
    if not fits(row_bucket(m), n, k, config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"],
                config["SPLIT_K"]):
        raise ValueError(f"config {config} does not fit M={m}, N={n}, K={k}")
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]),
            config["SPLIT_K"])
    kwargs = _config_kwargs(config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"],
                            config["SPLIT_K"])
    _fp8_mm_kernel[grid](*args, n, k, **meta, **kwargs, num_warps=warps, num_stages=stages)
    return out
