"""Skinny matmul for decode: y = x @ W^T (+ b) with few rows of x (M <= MAX_M) and an
nn.Linear-layout weight W [N, K].

At batch 1-8 a projection is a pass over its weight and little else, and cuBLAS reaches only
0.3-0.9 TB/s on the narrow matrices of a small model (Qwen3-0.6B's o_proj 2048->1024, down_proj
3072->1024). Here each program owns BLOCK_N rows of W (output columns) and streams them in
[BLOCK_N, BLOCK_K] tiles against the matching slice of x, accumulating in fp32, in one of two
ways the autotuner picks between per (N, K, M_PAD):
- DOT=0, M_PAD <= 2: broadcast multiply + sum on the CUDA cores (at one row, elementwise
  partial sums reduced once after the loop);
- DOT=1, M_PAD >= 2: tl.dot on x padded to 16 rows (tl.dot's minimum). At 4-8 rows the
  CUDA-core FMAs cost more than streaming the weight (measured on an H200); the tensor cores
  do not, and the pipelined loads tl.dot gets keep more of the weight in flight.
M_PAD, the next power of two of M, is the only compiled dimension of x (3 and 4 rows share a
variant); M itself is not specialized on. Rows of W past N are clamped reads, never stored, so
only a ragged K edge needs masking there. Rows of x past M are clamped on the CUDA cores; for
tl.dot they are masked instead (zeros, no memory read): a k = 4 verify step has 5 rows (8 in
its CUDA graph), so 8-11 of the 16 are padding, and clamped they streamed the last row's tile
into shared memory that many more times an iteration, a quarter to a half of the weight
tile's own bytes (on the H100 the o projection at 5 rows went from 16.9 to 15.4 µs).

When N / BLOCK_N gives too few programs to cover the SMs (N = 1024 above), configs may split K
over SPLIT_K programs per column block. Each writes its fp32 partial to a workspace; a ticket
counter per column block tells the last to finish, which sums the SPLIT_K partials in split
order (deterministic whatever order the programs ran in: the atomic only counts, it adds no
data), applies the epilogue and resets the counter. The workspace is one per device, so these
kernels must not run concurrently on two streams.

`skinny_matmul_add_norm` ends a projection with the residual add and RMSNorm that follow it
in a decoder layer (o_proj, then the post-attention norm; down_proj, then the next layer's
input norm): every program that stores output columns takes a ticket of the whole grid, and
the last one adds the residual to the finished rows and normalizes them
(`rmsnorm._add_norm_row_chunked`, the norm kernel's arithmetic over chunks of a row, so the
results are rms_norm's bit for bit). At batch 1 the
separate norm kernel, one program waiting on the whole GEMV before it, was exposed for 4.3 µs
a call under PDL on the H100 (64 calls a token of Llama-3-8B: 8 % of an FP8 step); the
epilogue is one program's pass over the rows, after the others finish.

`skinny_gate_up_silu` fuses a merged gate|up projection (MergedLinear: gate rows first) with
SiLU-and-mul: gate and up are rounded to the activations' dtype as F.linear would round them,
then silu(gate) is rounded and the product once more, as `activation.silu_and_mul` does.

`skinny_supported` says whether the kernel can serve a call; `skinny_preferred` whether it
beat cuBLAS there (tools/gpu_check_gemv.py measures both).
"""
from __future__ import annotations

import torch

from folio.model.kernel_config import DEFAULT_KERNEL_CONFIG
from folio.model.kernels._common import (HAS_TRITON, INTERPRET, next_pow2, pdl_launch,
                                         require_triton, split_k_workspace, tl, triton)

MAX_M = 8
_MAX_SPLIT = 4
_SPLIT_MAX_N = 4096       # split-K only for narrow outputs (it pays only when programs are few)
_MIN_BLOCK_N = 4

_FMA_MAX_M_PAD = 2          # past this, CUDA-core FMAs cost more than the weight stream

# (BLOCK_N, BLOCK_K, SPLIT_K, DOT, num_warps, num_stages). Each won at least one of the
# Qwen3-0.6B / Llama-3-8B projections at 1-8 rows on an H200 (tools/gpu_check_gemv.py).
_FULL_CONFIGS = [
    # broadcast multiply + sum (M_PAD <= _FMA_MAX_M_PAD)
    (4, 1024, 1, 0, 4, 2),
    (8, 1024, 1, 0, 4, 2),
    (8, 512, 1, 0, 4, 2),
    (4, 512, 4, 0, 2, 2),
    # tl.dot on x padded to 16 rows (M_PAD >= 2)
    (32, 128, 1, 1, 4, 4),
    (32, 256, 1, 1, 4, 3),
    (64, 128, 1, 1, 4, 4),
    (64, 128, 1, 1, 4, 5),
    (64, 256, 1, 1, 4, 3),
    (128, 128, 1, 1, 4, 4),
    (16, 256, 4, 1, 4, 3),
    (32, 256, 2, 1, 4, 3),
    (32, 128, 4, 1, 4, 4),
    # 8-bit weights only (the prune drops them for 16-bit ones): the same bytes per row-tile
    # as the 1024-wide configs of a bf16 weight. Not yet measured on a GPU.
    (4, 2048, 1, 0, 4, 2),
    (8, 2048, 1, 0, 8, 2),
    (4, 2048, 2, 0, 4, 2),
]
_EIGHT_BIT_ONLY_K = 2048
# Small tiles keep the interpreter quick and make the test shapes ragged in N and K.
_INTERPRET_CONFIG = (8, 32, 1, 0, 4, 1)


def _configs() -> list:
    chosen = [_INTERPRET_CONFIG] if INTERPRET else _FULL_CONFIGS
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "DOT": dot},
                          num_warps=w, num_stages=s) for bn, bk, sk, dot, w, s in chosen]


def _prune(configs: list, named_args: dict, **kwargs) -> list:
    """Drop configs that cannot pay off for this shape: K splits smaller than one tile, splits
    of wide outputs (enough programs already; the workspace is sized for narrow ones), tiles
    much wider than K, CUDA-core configs at the larger M buckets and tl.dot ones at M = 1, the
    8-bit-only configs for 16-bit weights."""
    args = {**named_args, **kwargs}
    N, K, m_pad = args["N"], args["K"], args["M_PAD"]
    weight = args.get("W")
    eight_bit = weight is not None and weight.element_size() == 1

    def fits(c, k_rule: bool) -> bool:
        bn, bk, sk, dot = (c.kwargs[k] for k in ("BLOCK_N", "BLOCK_K", "SPLIT_K", "DOT"))
        if bk >= _EIGHT_BIT_ONLY_K and not eight_bit:
            return False
        if sk > 1 and (N > _SPLIT_MAX_N or triton.cdiv(K, sk) < bk):
            return False
        if k_rule and bk > max(128, next_pow2(K)):
            return False
        return (m_pad >= 2) if dot else (m_pad <= _FMA_MAX_M_PAD)

    for k_rule in (True, False):  # tiny K (test models): every tile is wider than K
        kept = [c for c in configs if fits(c, k_rule)]
        if kept:
            return kept
    return [min((c for c in configs if c.kwargs["SPLIT_K"] == 1),
                key=lambda c: c.kwargs["BLOCK_K"] * c.kwargs["BLOCK_N"])]


def workspace_capacity() -> tuple[int, int]:
    """(fp32 partials, column-block ticket counters) the split-K workspace holds: kernels of
    one row may split outputs wider than _SPLIT_MAX_N as long as SPLIT_K * N partials and
    their column blocks fit. (The workspace has one counter more: _GRID_TICKET.)"""
    return _MAX_SPLIT * MAX_M * 2 * _SPLIT_MAX_N, triton.cdiv(_SPLIT_MAX_N, _MIN_BLOCK_N)


# The counter the norm epilogue's programs count on: past every column block's.
_GRID_TICKET = -(-_SPLIT_MAX_N // _MIN_BLOCK_N)
# The norm epilogue walks a row in chunks of this many columns (registers: the plain loop's,
# not a whole row's), and serves rows of up to NORM_MAX_N.
_NORM_CHUNK = 1024
NORM_MAX_N = 16384


_workspaces: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 split-K partials [_MAX_SPLIT * MAX_M * 2 * _SPLIT_MAX_N] and int32 ticket
    counters, shared by the skinny kernels (and the 4-bit GEMV) of one device."""
    partials, counters = workspace_capacity()
    return split_k_workspace(_workspaces, device, partials, counters + 1)   # + _GRID_TICKET


if HAS_TRITON:
    from folio.model.kernels._common import autotune
    from folio.model.kernels._common import load_k_tile, pdl_entry
    from folio.model.kernels.rmsnorm import _add_norm_row_chunked

    @triton.jit
    def _acc_init(M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT: tl.constexpr):
        if DOT:  # tl.dot wants >= 16 rows: x is padded to 16
            acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        elif M_PAD == 1:  # one row: elementwise partial sums, reduced once after the loop
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        else:
            acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        return acc

    @triton.jit
    def _mac(acc, x, w, M_PAD: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
        """acc += x [rows, BLOCK_K] times w [BLOCK_N, BLOCK_K]^T, in the shape _acc_init gave."""
        if DOT:
            # 8-bit weights (fp8 e4m3, int8) widen exactly to the activations' 16-bit dtype.
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
        elif M_PAD == 1:
            acc += w.to(tl.float32) * x.to(tl.float32)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        return acc

    @triton.jit
    def _acc_finish(acc, M_PAD: tl.constexpr, DOT: tl.constexpr):
        """-> [rows, BLOCK_N] fp32."""
        if not DOT and M_PAD == 1:
            acc = tl.sum(acc, axis=1)[None, :]
        return acc

    @triton.jit
    def _load_first(rows, k_lo, k_hi, K: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT_K: tl.constexpr):
        """The first [R, BLOCK_K] tile of this program's K range. A split may be empty
        (k_lo >= K, when K_SPLIT rounds up), so split programs mask by their own range."""
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        if SPLIT_K == 1:
            tile = load_k_tile(rows, offs_k, K, BLOCK_K)
        else:
            tile = tl.load(rows + offs_k[None, :], mask=offs_k[None, :] < k_hi, other=0.0)
        return tile

    @triton.jit
    def _load_x(x_rows, row_ok, offs_k, k_hi, K: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT_K: tl.constexpr, DOT: tl.constexpr, FIRST: tl.constexpr):
        """The [rows, BLOCK_K] tile of x at offs_k (FIRST: the program's first tile, which
        a split may find empty). For tl.dot the padding rows (row_ok false) are masked to
        zeros, not read; the CUDA-core path's padding rows are clamped reads, as the weight's
        (one row: no mask at all)."""
        if DOT:
            mask = row_ok[:, None]
            if SPLIT_K > 1 or K % BLOCK_K != 0:
                mask = mask & (offs_k < k_hi)[None, :]
            tile = tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0)
        elif FIRST and SPLIT_K > 1:
            tile = tl.load(x_rows + offs_k[None, :], mask=offs_k[None, :] < k_hi, other=0.0)
        else:
            tile = load_k_tile(x_rows, offs_k, K, BLOCK_K)
        return tile

    @triton.jit
    def _k_range(pid_k, K: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        if SPLIT_K == 1:
            k_lo = 0
            k_hi = K
        else:
            # Split boundaries fall on whole tiles.
            K_SPLIT: tl.constexpr = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K \
                * BLOCK_K
            k_lo = pid_k * K_SPLIT
            k_hi = tl.minimum(k_lo + K_SPLIT, K)
        return k_lo, k_hi

    @triton.jit
    def _row_offsets(M_PAD: tl.constexpr, DOT: tl.constexpr):
        if DOT:
            offs_m = tl.arange(0, 16)
        else:
            offs_m = tl.arange(0, M_PAD)
        return offs_m

    @triton.jit
    def _split_reduce(acc, P, C, pid_n, pid_k, offs_m, cols, M, N_P, N_OK,
                      SPLIT_K: tl.constexpr):
        """Store this program's partial; the last of the SPLIT_K programs of this column
        block gets the sum over splits in split order. Returns (is_last, total). Partials
        are [SPLIT_K, M, N_P]; only columns below N_OK are stored and read (a ragged last
        block's columns past it would land in the next split's, or the other half's, rows,
        which another program writes)."""
        p_off = offs_m[:, None] * N_P + cols[None, :]
        p_mask = (offs_m[:, None] < M) & (cols[None, :] < N_OK)
        tl.store(P + pid_k * (M * N_P) + p_off, acc, mask=p_mask)
        # Every thread's partial is written before the (single-thread) release of the ticket.
        tl.debug_barrier()
        ticket = tl.atomic_add(C + pid_n, 1, sem="acq_rel")
        is_last = ticket == SPLIT_K - 1
        total = tl.zeros_like(acc)
        if is_last:
            for s in tl.static_range(SPLIT_K):
                # .cg: read from L2, never a stale L1 line from an earlier launch.
                total += tl.load(P + s * (M * N_P) + p_off, mask=p_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(C + pid_n, 0)
        return is_last, total

    @triton.jit
    def _add_norm_epilogue(OUT, R, NW, NORMED, RES_OUT, C, M, stride_om, stride_rm, stride_nm,
                           stride_rom, eps, N, NORM_BLOCK: tl.constexpr,
                           GRID_TICKET: tl.constexpr):
        """After this program's output columns are stored: the last program of the grid to
        get here adds the residual to each finished row and normalizes it. (Also the 4-bit
        GEMV's, kernels/int4_gemv.py: one row, N a runtime value there.)"""
        # Every thread's output stores before the (single-thread) release of the ticket.
        tl.debug_barrier()
        ticket = tl.atomic_add(C + GRID_TICKET, 1, sem="acq_rel")
        if ticket == tl.num_programs(0) - 1:
            for row in range(0, M):   # at most MAX_M rows: int32 offsets suffice
                _add_norm_row_chunked(OUT, R, NW, NORMED, RES_OUT, row, stride_om, stride_rm,
                                      stride_nm, stride_rom, eps, N, NORM_BLOCK)
            tl.store(C + GRID_TICKET, 0)

    # NORM is not in the key: the variant with the norm epilogue runs the config of the plain
    # one (the same products bit for bit, so the same tokens with the epilogue on or off).
    @autotune(configs=_configs(), key=["N", "K", "M_PAD"],
                     prune_configs_by={"early_config_prune": _prune}, behind_lead=True)
    @triton.jit(do_not_specialize=["M"])
    def _skinny_kernel(X, W, S, B, OUT, P, C, M, stride_xm, stride_om,
                       R, NW, NORMED, RES_OUT, stride_rm, stride_nm, stride_rom, eps,
                       N: tl.constexpr, K: tl.constexpr, M_PAD: tl.constexpr,
                       HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT: tl.constexpr,
                       NORM: tl.constexpr, NORM_BLOCK: tl.constexpr,
                       GRID_TICKET: tl.constexpr, USE_PDL: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = _row_offsets(M_PAD, DOT)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Columns past N read valid memory (clamped) and are never stored: the weight loads
        # need no row masks. x's padding rows: _load_x.
        x_rows = X + tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * stride_xm
        w_rows = W + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K
        k_lo, k_hi = _k_range(pid_k, K, BLOCK_K, SPLIT_K)
        # The first weight tile is no kernel's output: under PDL it streams in while the
        # kernel before this one finishes (at K <= BLOCK_K that is the whole weight).
        w = _load_first(w_rows, k_lo, k_hi, K, BLOCK_K, SPLIT_K)
        pdl_entry(USE_PDL)
        acc = _acc_init(M_PAD, BLOCK_N, BLOCK_K, DOT)
        row_ok = offs_m < M
        acc = _mac(acc, _load_x(x_rows, row_ok, k_lo + tl.arange(0, BLOCK_K), k_hi, K, BLOCK_K,
                                SPLIT_K, DOT, True), w, M_PAD, DOT, PRECISION)
        for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = load_k_tile(w_rows, offs_k, K, BLOCK_K)
            x = _load_x(x_rows, row_ok, offs_k, k_hi, K, BLOCK_K, SPLIT_K, DOT, False)
            acc = _mac(acc, x, w, M_PAD, DOT, PRECISION)
        acc = _acc_finish(acc, M_PAD, DOT)
        is_last = True
        if SPLIT_K > 1:
            is_last, acc = _split_reduce(acc, P, C, pid_n, pid_k, offs_m, cols, M, N, N,
                                         SPLIT_K)
        if is_last:
            if HAS_SCALE:  # 8-bit weights: one scale per output row, applied once
                acc *= tl.load(S + cols, mask=cols < N, other=0.0)[None, :]
            if HAS_BIAS:
                acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            o_mask = (offs_m[:, None] < M) & (cols[None, :] < N)
            tl.store(OUT + offs_m[:, None] * stride_om + cols[None, :],
                     acc.to(OUT.dtype.element_ty), mask=o_mask)
            if NORM:
                _add_norm_epilogue(OUT, R, NW, NORMED, RES_OUT, C, M, stride_om, stride_rm,
                                   stride_nm, stride_rom, eps, N, NORM_BLOCK, GRID_TICKET)

    @autotune(configs=_configs(), key=["N", "K", "M_PAD"],
                     prune_configs_by={"early_config_prune": _prune}, behind_lead=True)
    @triton.jit(do_not_specialize=["M"])
    def _skinny_gate_up_kernel(X, W, S, B, OUT, P, C, M, stride_xm, stride_om,
                               N: tl.constexpr, K: tl.constexpr, M_PAD: tl.constexpr,
                               HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                               PRECISION: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               SPLIT_K: tl.constexpr, DOT: tl.constexpr, USE_PDL: tl.constexpr):
        # N is the intermediate size I: gate rows [0, I) of W, up rows [I, 2I).
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = _row_offsets(M_PAD, DOT)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        x_rows = X + tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * stride_xm
        g_rows = W + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K
        u_rows = g_rows + N * K
        k_lo, k_hi = _k_range(pid_k, K, BLOCK_K, SPLIT_K)
        # As in _skinny_kernel: the first weight tiles load before waiting for the inputs.
        wg = _load_first(g_rows, k_lo, k_hi, K, BLOCK_K, SPLIT_K)
        wu = _load_first(u_rows, k_lo, k_hi, K, BLOCK_K, SPLIT_K)
        pdl_entry(USE_PDL)
        row_ok = offs_m < M
        x = _load_x(x_rows, row_ok, k_lo + tl.arange(0, BLOCK_K), k_hi, K, BLOCK_K, SPLIT_K, DOT,
                    True)
        acc_g = _mac(_acc_init(M_PAD, BLOCK_N, BLOCK_K, DOT), x, wg, M_PAD, DOT, PRECISION)
        acc_u = _mac(_acc_init(M_PAD, BLOCK_N, BLOCK_K, DOT), x, wu, M_PAD, DOT, PRECISION)
        for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            wg = load_k_tile(g_rows, offs_k, K, BLOCK_K)
            wu = load_k_tile(u_rows, offs_k, K, BLOCK_K)
            x = _load_x(x_rows, row_ok, offs_k, k_hi, K, BLOCK_K, SPLIT_K, DOT, False)
            acc_g = _mac(acc_g, x, wg, M_PAD, DOT, PRECISION)
            acc_u = _mac(acc_u, x, wu, M_PAD, DOT, PRECISION)
        acc_g = _acc_finish(acc_g, M_PAD, DOT)
        acc_u = _acc_finish(acc_u, M_PAD, DOT)
        is_last = True
        if SPLIT_K > 1:
            # Partials laid out [SPLIT_K, M, 2I] like the merged output: gate | up. The up
            # half is stored first; the gate's ticket then orders both.
            p_mask = (offs_m[:, None] < M) & (cols[None, :] < N)
            tl.store(P + pid_k * (M * 2 * N) + offs_m[:, None] * (2 * N) + N + cols[None, :],
                     acc_u, mask=p_mask)
            is_last, acc_g = _split_reduce(acc_g, P, C, pid_n, pid_k, offs_m, cols, M, 2 * N,
                                           N, SPLIT_K)
            if is_last:
                p_off = offs_m[:, None] * (2 * N) + N + cols[None, :]
                acc_u = tl.zeros_like(acc_u)
                for s in tl.static_range(SPLIT_K):
                    acc_u += tl.load(P + s * (M * 2 * N) + p_off, mask=p_mask, other=0.0,
                                     cache_modifier=".cg")
        if is_last:
            if HAS_SCALE:
                acc_g *= tl.load(S + cols, mask=cols < N, other=0.0)[None, :]
                acc_u *= tl.load(S + N + cols, mask=cols < N, other=0.0)[None, :]
            if HAS_BIAS:
                c_mask = cols < N
                acc_g += tl.load(B + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
                acc_u += tl.load(B + N + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
            dt = OUT.dtype.element_ty
            gate = acc_g.to(dt).to(tl.float32)
            up = acc_u.to(dt).to(tl.float32)
            act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
            o_mask = (offs_m[:, None] < M) & (cols[None, :] < N)
            tl.store(OUT + offs_m[:, None] * stride_om + cols[None, :], (act * up).to(dt),
                     mask=o_mask)


_DTYPES = (torch.float16, torch.bfloat16)


def skinny_preferred(m: int, n: int, k: int, fused: bool = False,
                     mode: str = DEFAULT_KERNEL_CONFIG.gemv) -> bool:
    """Whether the skinny kernel should replace cuBLAS for an [m, k] x [n, k]^T product it
    supports (`fused`: the gate_up + SiLU-and-mul kernel, which also saves a launch and a pass),
    under GEMV `mode` (one of folio.model.kernel_config.GEMV_MODES: the layers pass their
    KernelConfig's; "0" is never).
    On an H200 (tools/gpu_check_gemv.py) it beat cuBLAS at one row for every shape tried, and
    at 2-8 rows where the output is narrow (n <= 2048: cuBLAS runs too few blocks there); at
    2-8 rows and wide outputs it was 0-15% slower. By default only one row takes it (each
    further row bucket is another autotuning pass at start-up, for a few percent)."""
    if mode == "0":
        return False
    if m == 1 or mode == "all":
        return True
    return mode == "narrow" and (fused or n <= 2048)


# Weights stored in 8 bits with one float32 scale per output row (folio.model.quant): the
# kernel widens them to the activations' dtype, exactly (W8A16 arithmetic).
EIGHT_BIT_DTYPES = (torch.float8_e4m3fn, torch.int8)


def skinny_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_matmul(x.reshape(-1, K), weight)` should serve this call: CUDA, triton,
    fp16/bf16 activations and a weight of their dtype (or 8-bit, with scales), 1..MAX_M rows,
    a contiguous 2-D weight, no autograd. Capability only: whether it is wanted at all
    (FOLIO_GEMV=0, FOLIO_KERNELS=torch) is the layers' KernelConfig's to say."""
    if not (HAS_TRITON and x.is_cuda) or x.dtype not in _DTYPES:
        return False
    if weight.dim() != 2 or weight.dtype not in (x.dtype, *EIGHT_BIT_DTYPES) \
            or not weight.is_contiguous() \
            or weight.device != x.device or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return 1 <= x.numel() // max(x.shape[-1], 1) <= MAX_M


def _prepare(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             scale: torch.Tensor | None = None):
    require_triton()
    if (weight.dtype in EIGHT_BIT_DTYPES) != (scale is not None):
        raise ValueError("an 8-bit weight needs its per-row float32 scale, and only an 8-bit "
                         "weight takes one")
    if scale is not None and (scale.shape != (weight.shape[0],) or scale.dtype != torch.float32
                              or not scale.is_contiguous()):
        raise ValueError(f"scale must be contiguous float32 [{weight.shape[0]}], got "
                         f"{tuple(scale.shape)} {scale.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny matmul needs x [M, K] and weight [N, K], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    M = x.shape[0]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"skinny matmul serves 1..{MAX_M} rows, got {M}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if not weight.is_contiguous():
        raise ValueError("skinny matmul needs a contiguous weight")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{weight.shape[0]}], got {tuple(bias.shape)}")
    return x, M, next_pow2(M)


def _launch(kernel, x, weight, scale, bias, out, N: int, M: int, m_pad: int,
            config: dict | None, pdl: bool, norm: tuple | None = None):
    """`norm` (_skinny_kernel only): (residual, norm weight, eps, normed out, residual out)
    for the add + RMSNorm epilogue."""
    partials, counters = _workspace(x.device)
    pdl = pdl_launch(x, pdl)
    args = (x, weight, scale if scale is not None else weight,
            bias if bias is not None else weight, out, partials, counters, M,
            x.stride(0), out.stride(0))
    meta = dict(N=N, K=x.shape[1], M_PAD=m_pad, HAS_SCALE=scale is not None,
                HAS_BIAS=bias is not None,
                # fp32 stays exact in tl.dot (its default there is tf32)
                PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                USE_PDL=pdl, launch_pdl=pdl)
    if kernel is _skinny_kernel:
        norm_args, norm_meta = norm_epilogue_args(norm, out, N)
        args += norm_args
        meta.update(norm_meta)
    if config is None:
        kernel[lambda c: (triton.cdiv(N, c["BLOCK_N"]), c["SPLIT_K"])](*args, **meta)
    else:  # a fixed config, bypassing the autotuner (tests)
        config = dict(config)
        warps = config.pop("num_warps", 4)
        stages = config.pop("num_stages", 1)
        kernel.fn[(triton.cdiv(N, config["BLOCK_N"]), config["SPLIT_K"])](
            *args, **meta, **config, num_warps=warps, num_stages=stages)


# (kernel, autotune key) pairs whose config this process has chosen on the plain product.
_PLAIN_TUNED: set[tuple] = set()


def tune_on_plain_product(kernel, key: tuple, launch_plain) -> None:
    """Before a key's first launch with the norm epilogue, launch the plain product once
    (`launch_plain()`, into scratch) so that the autotuner chooses the key's config on it.
    The epilogue shares its product's config (NORM is not in the autotune key: the two are
    then bit-identical), so whichever launch comes first chooses for both, and a choice
    made with the epilogue's serial tail in every benchmark need not suit the plain product.
    That is the likely cause of FP8 batch 1 on the H100 at 3.63 ms/token with the epilogue
    off, where code without it, tuned afresh, read 3.48 (docs/benchmarks.md, session 27)."""
    tag = (id(kernel),) + key
    if tag not in _PLAIN_TUNED:
        launch_plain()
        _PLAIN_TUNED.add(tag)


def norm_epilogue_args(norm: tuple | None, out: torch.Tensor, n: int) -> tuple[tuple, dict]:
    """The add + RMSNorm epilogue's kernel arguments (R, NW, NORMED, RES_OUT, their row
    strides, eps) and constexprs (NORM, NORM_BLOCK, GRID_TICKET) for `norm` = (residual, norm
    weight, eps, normed out, residual out), or None (out stands in, never read)."""
    if norm is None:
        return (out, out, out, out, 0, 0, 0, 0.0), dict(NORM=False, NORM_BLOCK=1,
                                                         GRID_TICKET=_GRID_TICKET)
    residual, norm_weight, eps, normed, res_out = norm
    return ((residual, norm_weight, normed, res_out, residual.stride(0), normed.stride(0),
             res_out.stride(0), float(eps)),
            dict(NORM=True, NORM_BLOCK=min(next_pow2(n), _NORM_CHUNK), GRID_TICKET=_GRID_TICKET))


def check_norm_operands(residual: torch.Tensor, norm_weight: torch.Tensor, m: int, n: int,
                        dtype: torch.dtype) -> None:
    """The epilogue's operands: the stream [m, n] with contiguous rows and the weight [n],
    both in the activations' dtype, rows no wider than NORM_MAX_N."""
    if residual.shape != (m, n) or residual.dtype != dtype or residual.stride(1) != 1:
        raise ValueError(f"residual must be [{m}, {n}] {dtype} with contiguous rows, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if norm_weight.shape != (n,) or norm_weight.dtype != dtype \
            or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be contiguous [{n}] {dtype}, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype}")
    if n > NORM_MAX_N:
        raise ValueError(f"the norm epilogue serves rows of at most {NORM_MAX_N}, got {n}")


def _check_split(n: int, partial_cols: int, config: dict | None) -> None:
    """A forced split-K config (tests) must fit the workspace the autotuned ones fit."""
    if config is not None and config["SPLIT_K"] > 1:
        if config["SPLIT_K"] > _MAX_SPLIT or n > _SPLIT_MAX_N \
                or triton.cdiv(n, config["BLOCK_N"]) > triton.cdiv(_SPLIT_MAX_N, _MIN_BLOCK_N) \
                or partial_cols > 2 * _SPLIT_MAX_N:
            raise ValueError(f"split-K config {config} exceeds the workspace")


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, *, scale: torch.Tensor | None = None,
                  pdl: bool = False, _config: dict | None = None) -> torch.Tensor:
    """x [M, K] (1 <= M <= MAX_M, rows may be strided) @ weight [N, K]^T (+ bias [N]) ->
    [M, N] in x.dtype, accumulated in fp32. An 8-bit weight (EIGHT_BIT_DTYPES) comes with
    `scale`, float32 [N]: the product is then x @ (weight * scale[:, None])^T. `out`, if
    given, is an [M, N] tensor whose rows are contiguous. `pdl`: launch with programmatic
    dependent launch where the GPU has it."""
    x, M, m_pad = _prepare(x, weight, bias, scale)
    N = weight.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.stride(1) != 1:
        raise ValueError(f"out must be [{M}, {N}] with contiguous rows, got {tuple(out.shape)}")
    _check_split(N, N, _config)
    _launch(_skinny_kernel, x, weight, scale, bias, out, N, M, m_pad, _config, pdl)
    return out


def skinny_matmul_add_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                           norm_weight: torch.Tensor, eps: float,
                           bias: torch.Tensor | None = None, *,
                           scale: torch.Tensor | None = None, pdl: bool = False,
                           _config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`skinny_matmul(x, weight, bias, scale=scale)` followed by the decoder layer's residual
    add and RMSNorm, in one launch: returns (rms_norm(y + residual), y + residual), what
    `rms_norm(y, norm_weight, eps, residual)` returns, bit for bit. `residual` [M, N] with
    contiguous rows and `norm_weight` [N], both in x's dtype."""
    x, M, m_pad = _prepare(x, weight, bias, scale)
    N = weight.shape[0]
    check_norm_operands(residual, norm_weight, M, N, x.dtype)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    normed, res_out = torch.empty_like(out), torch.empty_like(out)
    _check_split(N, N, _config)
    if _config is None:
        tune_on_plain_product(
            _skinny_kernel, (N, x.shape[1], m_pad, x.dtype, weight.dtype, scale is None,
                             bias is None, x.device),
            lambda: _launch(_skinny_kernel, x, weight, scale, bias, torch.empty_like(out), N,
                            M, m_pad, None, pdl))
    _launch(_skinny_kernel, x, weight, scale, bias, out, N, M, m_pad, _config, pdl,
            norm=(residual, norm_weight, eps, normed, res_out))
    return normed, res_out


def skinny_gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        *, scale: torch.Tensor | None = None, pdl: bool = False,
                        _config: dict | None = None) -> torch.Tensor:
    """x [M, K] with a merged gate|up weight [2I, K] (gate rows first) -> silu(gate) * up,
    [M, I] in x.dtype; gate and up are rounded to x.dtype first, as the unfused
    F.linear + silu_and_mul path rounds them. `scale` as in skinny_matmul."""
    x, M, m_pad = _prepare(x, weight, bias, scale)
    two_i = weight.shape[0]
    if two_i % 2:
        raise ValueError(f"a merged gate|up weight needs an even row count, got {two_i}")
    inner = two_i // 2
    out = torch.empty((M, inner), dtype=x.dtype, device=x.device)
    _check_split(inner, two_i, _config)
    _launch(_skinny_gate_up_kernel, x, weight, scale, bias, out, inner, M, m_pad, _config,
            pdl)
    return out
