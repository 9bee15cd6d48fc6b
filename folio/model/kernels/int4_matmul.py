"""Weight-quantized matmul with group scales: y = x @ W^T (+ b), W stored as 4-bit codes eight
to an int32 along K (BITS=4) or as int8 codes (BITS=8), with a scale and an offset per group of
G input channels, in one of three forms (ZERO_MODE):
  0: W = (q - 8) * s               symmetric 4-bit (GPTQ/compressed-tensors sym), or q * s at
                                   8 bits (GGUF Q8_0, Q6_K)
  1: W = (q - z) * s               integer zero points (AWQ, GPTQ and compressed-tensors asym)
  2: W = q * s + m                 a float offset per group (GGUF Q4_0 / Q4_1 / Q4_K, whose
                                   minimums are no integer number of steps)
(folio.model.quant.formats.Int4Weight, GroupInt8Weight).

One row of 4-bit codes (batch-1 decode) runs the GEMV form in kernels/int4_gemv.py; this kernel
serves every other case. Each program owns BLOCK_N output columns (rows of W)
and BLOCK_M rows of x and streams its slice of the codes, widening each [BLOCK_N, BLOCK_K] tile
in registers (shift, mask, subtract the zero or add the minimum, scale: float32, then the
activations' dtype). Rows of x > 1: the tensor cores with the operands swapped,
acc[BLOCK_N, BLOCK_M] += W_tile @ x_tile^T, the widened tile the dot's left operand straight
from registers and x (padded to 16 rows, tl.dot's minimum, at decode) the transposed one. One
row (8-bit codes): also elementwise FMAs into a [BLOCK_N, BLOCK_K] accumulator summed once at
the end, as the skinny GEMV does (DOT 0). Tiles are widened either from a [BLOCK_N, BLOCK_K / 8] word tile by a
3-D broadcast and reshape (UNPACK 0) or by loading each element's own word, eight loads of one
word that hit L1 (UNPACK 1); the autotuner picks among both per shape and row bucket.

When the output is narrow (few column blocks to spread over the SMs) the K range is split over
SPLIT_K programs, reduced in split order through the skinny GEMV's workspace and ticket
counters (kernels/gemv.py: deterministic, whatever order the programs ran in).

`dequantize_int4` writes W in the activations' dtype, for the large-M path that hands a
compute-bound product to cuBLAS (`group_linear.GroupQuantLinear` picks by row count).
"""
from __future__ import annotations

import torch

from folio.model.kernels._common import (HAS_TRITON, INTERPRET, next_pow2, require_triton, tl,
                                         triton)
from folio.model.kernels import gemv, int4_gemv

# (class, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, DOT, UNPACK, num_warps, num_stages). Few on
# purpose: every config is one more compile at start-up (N and K are runtime arguments, so a
# config compiles once for all of a model's shapes). Class "one": one row (DOT 0: elementwise
# FMAs into a [BLOCK_N, BLOCK_K] accumulator, summed once at the end, as the skinny GEMV does);
# "small": up to 16 rows; "mid": 17-128; "large": more. UNPACK 0 widens a tile of words with a
# 3-D broadcast and reshape, 1 loads each element's word (eight loads of one word, from L1)
# and shifts it by its own nibble: which is faster is the autotuner's to find per shape (the
# first H200 run measured UNPACK 0 alone at ~0.5 TB/s at one row, docs/benchmarks.md).
_CONFIGS = [
    ("one", 16, 8, 512, 1, 0, 1, 4, 2), ("one", 16, 16, 256, 1, 0, 1, 4, 3),
    ("one", 16, 8, 512, 2, 0, 1, 4, 2), ("one", 16, 4, 1024, 1, 0, 1, 4, 2),
    ("small", 16, 32, 128, 1, 1, 0, 4, 4), ("small", 16, 64, 128, 1, 1, 0, 4, 4),
    ("small", 16, 64, 256, 1, 1, 0, 4, 3), ("small", 16, 32, 128, 2, 1, 0, 4, 4),
    ("small", 16, 32, 128, 4, 1, 0, 4, 4), ("small", 16, 32, 128, 1, 1, 1, 4, 4),
    ("small", 16, 64, 128, 1, 1, 1, 4, 4), ("small", 16, 32, 256, 2, 1, 1, 4, 3),
    ("mid", 32, 64, 128, 1, 1, 0, 4, 4), ("mid", 64, 128, 64, 1, 1, 0, 4, 4),
    ("mid", 64, 64, 128, 1, 1, 0, 4, 4), ("mid", 64, 64, 128, 1, 1, 1, 4, 4),
    ("large", 128, 128, 64, 1, 1, 0, 8, 3), ("large", 64, 128, 64, 1, 1, 0, 4, 4),
    ("large", 128, 128, 64, 1, 1, 1, 8, 3),
    # Narrow tiles for a K no wider tile divides (GGUF groups of 32: SmolLM2's K = 576), used
    # only when no config of the row bucket's class fits.
    ("any", 16, 32, 32, 1, 1, 1, 4, 3), ("any", 64, 64, 32, 1, 1, 0, 4, 3),
]
# The interpreter runs every config it is given: one of each kind of path.
_INTERPRET_CONFIGS = [("small", 16, 16, 32, 1, 1, 0, 4, 1)]
_MAX_M_BUCKET = 256


def _m_bucket(m: int) -> int:
    """The autotuning key's row bucket: 1 (one row), then powers of two from 16 to 256."""
    return 1 if m == 1 else min(max(next_pow2(m), 16), _MAX_M_BUCKET)


def _bucket_classes(bucket: int) -> tuple[str, ...]:
    if bucket == 1:
        return ("one", "small")
    return ("small",) if bucket <= 16 else ("mid",) if bucket <= 128 else ("large",)


def _configs() -> list:
    chosen = _INTERPRET_CONFIGS if INTERPRET else _CONFIGS
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk,
                           "DOT": dot, "UNPACK": unpack, "CLASS": cls},
                          num_warps=w, num_stages=st)
            for cls, bm, bn, bk, sk, dot, unpack, w, st in chosen]


def _prune(configs: list, named_args: dict, **kwargs) -> list:
    """Tiles fitting the shape: BLOCK_K dividing K and (when wider than a group) a multiple
    of G, the config's class matching the row bucket, split-K only where the GEMV workspace
    takes it (one row block, a narrow output) and each split keeps whole tiles."""
    args = {**named_args, **kwargs}
    n, k, g, bucket = args["N"], args["K"], args["G"], args["M_BUCKET"]

    def fits(c, classes) -> bool:
        bk, sk = c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"]
        if k % bk or (bk > g and bk % g) or (bk < g and g % bk):
            return False
        if not INTERPRET and c.kwargs["CLASS"] not in classes:
            return False
        if not c.kwargs["DOT"] and bucket != 1:
            return False
        return sk == 1 or not (bucket > 16 or n > gemv._SPLIT_MAX_N or (k // bk) < sk
                               or (k // bk) % sk)

    for classes in (_bucket_classes(bucket), ("any",)):
        kept = [c for c in configs if fits(c, classes)]
        if kept:
            return kept
    raise ValueError(f"no int4 tile fits K={k} with groups of {g}")


if HAS_TRITON:
    from folio.model.kernels._common import autotune

    @triton.jit
    def _widen(q, s, z_ptrs, ZERO_MODE: tl.constexpr, BITS: tl.constexpr):
        """Codes `q` (float32) to weights with their scales `s`, in the module docstring's
        form ZERO_MODE; `z_ptrs` (shaped as s) point at the zeros or minimums, read only in
        the forms that have them."""
        s = s.to(tl.float32)
        if ZERO_MODE == 2:
            w = q * s + tl.load(z_ptrs).to(tl.float32)
        elif ZERO_MODE == 1:
            w = (q - tl.load(z_ptrs).to(tl.float32)) * s
        elif BITS == 4:
            w = (q - 8.0) * s
        else:
            w = q * s
        return w

    @autotune(configs=_configs(), key=["N", "K", "G", "M_BUCKET", "BITS"],
                     prune_configs_by={"early_config_prune": _prune})
    @triton.jit(do_not_specialize=["M", "M_BUCKET"])
    def _int4_kernel(X, QW, SC, ZP, B, OUT, P, C, M, stride_xm, stride_om, N, K, M_BUCKET,
                     G: tl.constexpr, BITS: tl.constexpr, ZERO_MODE: tl.constexpr,
                     HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, DOT: tl.constexpr, UNPACK: tl.constexpr,
                     CLASS: tl.constexpr):
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows of x past M and columns past N read clamped (valid) memory and are never stored.
        x_rows = X + tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * stride_xm
        cols_c = tl.minimum(cols, N - 1).to(tl.int64)
        if BITS == 4:
            w_rows = QW + cols_c[:, None] * (K // 8)
        else:
            w_rows = QW + cols_c[:, None] * K
        s_rows = SC + cols_c[:, None] * (K // G)
        z_rows = ZP + cols_c[:, None] * (K // G)
        shifts = tl.arange(0, 8) * 4
        k_split = K // SPLIT_K
        k_lo = pid_k * k_split
        if DOT:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:  # one row (M == 1): elementwise partial sums
            acc_e = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_lo, k_lo + k_split, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if BITS == 4:
                if UNPACK == 0:
                    packed = tl.load(w_rows + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :])
                    q = (packed[:, :, None] >> shifts[None, None, :]) & 0xF
                    q = tl.reshape(q, (BLOCK_N, BLOCK_K)).to(tl.float32)
                else:
                    words = tl.load(w_rows + (offs_k // 8)[None, :])
                    q = ((words >> ((offs_k % 8) * 4)[None, :]) & 0xF).to(tl.float32)
            else:
                q = tl.load(w_rows + offs_k[None, :]).to(tl.float32)
            if BLOCK_K <= G:  # the tile lies in one group: one scale (and offset) per row
                g_off = k0 // G
                w = _widen(q, tl.load(s_rows + g_off), z_rows + g_off, ZERO_MODE, BITS)
            elif UNPACK == 1:  # each element's group scale (and offset) gathered, from L1
                g_off = (offs_k // G)[None, :]
                w = _widen(q, tl.load(s_rows + g_off), z_rows + g_off, ZERO_MODE, BITS)
            else:
                GPT: tl.constexpr = BLOCK_K // G
                g_off = (k0 // G + tl.arange(0, GPT))[None, :, None]
                w = _widen(tl.reshape(q, (BLOCK_N, GPT, G)), tl.load(s_rows[:, :, None] + g_off),
                           z_rows[:, :, None] + g_off, ZERO_MODE, BITS)
                w = tl.reshape(w, (BLOCK_N, BLOCK_K))
            if DOT:
                x = tl.load(x_rows + offs_k[None, :])
                acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
            else:
                # the weights rounded to x's dtype first, as the tl.dot path and cuBLAS see them
                x1 = tl.load(X + offs_k).to(tl.float32)
                acc_e += w.to(X.dtype.element_ty).to(tl.float32) * x1[None, :]
        if not DOT:
            acc = tl.where(offs_m[None, :] == 0, tl.sum(acc_e, axis=1)[:, None], 0.0)
        is_last = True
        if SPLIT_K > 1:
            # One row block (the prune allows splits at <= 16 rows only): partials as [M, N].
            is_last, acc_t = gemv._split_reduce(tl.trans(acc), P, C, pid_n, pid_k, offs_m,
                                                cols, M, N, N, SPLIT_K)
            acc = tl.trans(acc_t)
        if is_last:
            if HAS_BIAS:
                acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
            o_mask = (cols[:, None] < N) & (offs_m[None, :] < M)
            tl.store(OUT + offs_m[None, :].to(tl.int64) * stride_om + cols[:, None],
                     acc.to(OUT.dtype.element_ty), mask=o_mask)

    @triton.jit
    def _dequant_kernel(QW, SC, ZP, OUT, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr,
                        BITS: tl.constexpr, ZERO_MODE: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        rows_c = tl.minimum(rows, N - 1).to(tl.int64)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if BITS == 4:
            packed = tl.load(QW + rows_c[:, None] * (K // 8)
                             + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :])
            q = (packed[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
            q = tl.reshape(q, (BLOCK_N, BLOCK_K)).to(tl.float32)
        else:
            q = tl.load(QW + rows_c[:, None] * K + offs_k[None, :]).to(tl.float32)
        g_off = rows_c[:, None] * (K // G) + (offs_k // G)[None, :]
        w = _widen(q, tl.load(SC + g_off), ZP + g_off, ZERO_MODE, BITS)
        tl.store(OUT + rows_c[:, None] * K + offs_k[None, :], w.to(OUT.dtype.element_ty),
                 mask=rows[:, None] < N)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


ZERO_NONE, ZERO_INT, ZERO_MIN = 0, 1, 2


def _check(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
           offsets: torch.Tensor | None, group_size: int, bits: int) -> tuple[int, int]:
    require_triton()
    if bits == 4:
        if codes.dtype != torch.int32:
            raise ValueError("4-bit codes come packed eight to an int32 [N, K / 8]")
        n, k = codes.shape[0], codes.shape[1] * 8
    elif bits == 8:
        if codes.dtype != torch.int8:
            raise ValueError("8-bit codes come as int8 [N, K]")
        n, k = codes.shape
    else:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if x is not None and (x.dim() != 2 or x.shape[1] != k or x.dtype not in _DTYPES):
        raise ValueError(f"the quantized matmul needs x [M, {k}] in fp16/bf16, got "
                         f"{tuple(x.shape)} {x.dtype}")
    if not codes.is_contiguous():
        raise ValueError("the codes must be contiguous")
    if k % group_size or scales.shape != (n, k // group_size) or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous [{n}, {k // group_size}], got "
                         f"{tuple(scales.shape)}")
    if offsets is not None and (offsets.shape != scales.shape or not offsets.is_contiguous()):
        raise ValueError("zeros / minimums must be shaped as the scales")
    return n, k


def zero_mode(zeros: torch.Tensor | None, mins: torch.Tensor | None) -> int:
    """The kernels' ZERO_MODE for a weight with these offsets (zero points, minimums, or
    neither: the symmetric form)."""
    if zeros is not None and mins is not None:
        raise ValueError("give zero points or minimums, not both")
    return ZERO_INT if zeros is not None else ZERO_MIN if mins is not None else ZERO_NONE


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None, group_size: int,
                bias: torch.Tensor | None = None, *, mins: torch.Tensor | None = None,
                bits: int = 4, pdl: bool = False, _config: dict | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x.dtype, accumulated in fp32; W as in the module
    docstring: `zeros` (form 1) or `mins` (form 2) or neither (form 0); `bits` 8 takes int8
    codes [N, K] in `packed`. One row of 4-bit codes runs kernels/int4_gemv.py (`pdl` is
    its programmatic dependent launch). `_config` (tests) forces one tile config past the
    autotuner (int4_gemv's when it names BLOCK_W)."""
    n, k = _check(x, packed, scales, zeros if zeros is not None else mins, group_size, bits)
    mode = zero_mode(zeros, mins)
    offsets = zeros if zeros is not None else mins
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if bits == 4 and m == 1 and int4_gemv.supported(k, group_size) and (
            _config is None or "BLOCK_W" in _config):
        # one row: the GEMV form (no tensor cores, no padding to 16 rows)
        return int4_gemv.int4_gemv(x, packed, scales, offsets, mode, group_size, bias, out,
                                   pdl=pdl, _config=_config)
    partials, counters = gemv._workspace(x.device)
    args = (x, packed, scales, offsets if offsets is not None else scales,
            bias if bias is not None else scales, out, partials, counters, m,
            x.stride(0), out.stride(0))
    meta = dict(N=n, K=k, M_BUCKET=_m_bucket(m), G=group_size, BITS=bits, ZERO_MODE=mode,
                HAS_BIAS=bias is not None)
    if _config is None:
        _int4_kernel[lambda c: (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),
                                c["SPLIT_K"])](*args, **meta)
    else:
        config = dict(_config)
        if config["SPLIT_K"] > 1 and (m > config["BLOCK_M"] or n > gemv._SPLIT_MAX_N
                                      or m > 16):
            raise ValueError(f"split-K config {config} exceeds the workspace")
        warps, stages = config.pop("num_warps", 4), config.pop("num_stages", 1)
        config.setdefault("DOT", 1)
        config.setdefault("UNPACK", 0)
        config.setdefault("CLASS", "forced")
        if not config["DOT"] and m != 1:
            raise ValueError("the elementwise (DOT 0) path takes one row")
        _int4_kernel.fn[(triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),
                         config["SPLIT_K"])](*args, **meta, **config, num_warps=warps,
                                             num_stages=stages)
    return out


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_size: int, dtype: torch.dtype, *, mins: torch.Tensor | None = None,
                    bits: int = 4) -> torch.Tensor:
    """W [N, K] in `dtype` (one pass over the codes)."""
    n, k = _check(None, packed, scales, zeros if zeros is not None else mins, group_size, bits)
    mode = zero_mode(zeros, mins)
    offsets = zeros if zeros is not None else mins
    out = torch.empty((n, k), dtype=dtype, device=packed.device)
    block_k = min(128, k)
    while k % block_k:
        block_k //= 2
    block_n = 16 if INTERPRET else 64
    _dequant_kernel[(triton.cdiv(n, block_n), k // block_k)](
        packed, scales, offsets if offsets is not None else scales, out, N=n, K=k,
        G=group_size, BITS=bits, ZERO_MODE=mode, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
