"""Sampling from plain temperature-scaled logits in two launches (the sampler's fast path).

The general sampler copies the logits to float32, takes a softmax, draws exponential noise and
divides: five passes over a [rows, vocab] float32 tensor, about 0.55 ms at 256 rows of
Qwen3's 151,936-token vocabulary on an H200. When no row needs a logit processor, a top-k/top-p/
min-p filter or its own seeded generator, the Gumbel-max trick gives the same distribution in
one pass over the logits as they are (bf16 included):

    token = argmax_i (logit_i / T + G_i),  G_i = -log(-log U_i),  U_i ~ Uniform(0, 1)

picks token i with probability softmax(logits / T)_i. The uniforms come from Philox inside the
kernel (`tl.rand`, keyed by a per-call seed, counted by row and token), so nothing but the logits
is read. Greedy rows (T = 0) take the plain argmax in the same launch, ties to the lowest id like
torch.argmax.

Launch 1: program (row, chunk) scans one chunk of the vocabulary and writes its best (score,
id); launch 2 reduces each row's chunks.
"""
from __future__ import annotations

import torch

from folio.model.host_copy import device_tensor
from folio.model.kernels._common import HAS_TRITON, require_triton, tl, triton

_BLOCK = 1024
_MAX_CHUNKS = 64  # also the reduce kernel's fixed width: one compiled variant for every batch

if HAS_TRITON:

    # The seed changes every call: not specialized on, or each new value that happens to be
    # 1 or a multiple of 16 would compile another variant.
    @triton.jit(do_not_specialize=["seed", "inv_temp"])
    def _gumbel_argmax_partial_kernel(
        LOGITS, INV_TEMP, PART_SCORE, PART_ID, stride_row, vocab, chunk_len, seed, inv_temp,
        PER_ROW: tl.constexpr, BLOCK: tl.constexpr, ARGMAX_ONLY: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        num_chunks = tl.num_programs(1)
        if not ARGMAX_ONLY:
            if PER_ROW:
                inv_t = tl.load(INV_TEMP + row)  # 0.0 marks a greedy row
            else:
                inv_t = inv_temp
            greedy = inv_t == 0.0
            scale = tl.where(greedy, 1.0, inv_t)
        base = LOGITS + row.to(tl.int64) * stride_row
        start = chunk * chunk_len
        end = tl.minimum(start + chunk_len, vocab)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_id = tl.zeros([BLOCK], tl.int32)
        for off in range(start, end, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            ok = cols < end
            x = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
            if ARGMAX_ONLY:
                # NaN ranks above everything, as in torch.argmax
                score = tl.where(x != x, float("inf"), x)
            else:
                u = tl.rand(seed, row * vocab + cols)
                gumbel = -tl.log(-tl.log(u))  # u = 0 gives -inf: that token cannot win
                score = tl.where(greedy, x, x * scale + gumbel)
            score = tl.where(ok, score, float("-inf"))
            better = score > best  # strict: the earlier column keeps a tie
            best = tl.where(better, score, best)
            best_id = tl.where(better, cols, best_id)
        top = tl.max(best, 0)
        top_id = tl.min(tl.where(best == top, best_id, 2147483647), 0)
        tl.store(PART_SCORE + row * num_chunks + chunk, top)
        tl.store(PART_ID + row * num_chunks + chunk, top_id)

    @triton.jit
    def _argmax_chunks_kernel(PART_SCORE, PART_ID, OUT, num_chunks, C_PAD: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, C_PAD)
        ok = c < num_chunks
        score = tl.load(PART_SCORE + row * num_chunks + c, mask=ok, other=float("-inf"))
        ids = tl.load(PART_ID + row * num_chunks + c, mask=ok, other=2147483647)
        top = tl.max(score, 0)
        # Chunks are in column order, so the lowest id among the maxima is the first.
        winner = tl.min(tl.where((score == top) & ok, ids, 2147483647), 0)
        tl.store(OUT + row, winner.to(tl.int64))


def num_chunks_for(rows: int, vocab: int) -> int:
    """Vocabulary chunks per row: about 1,024 programs in all (several waves of the SMs), no
    chunk shorter than one block."""
    by_rows = max(1, 1024 // max(1, rows))
    return max(1, min(_MAX_CHUNKS, by_rows, -(-vocab // _BLOCK)))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of [rows, vocab] logits, ties to the lowest id and NaN above
    everything as torch's. On CUDA through the chunked kernels below, two launches over
    ~1,024 programs: torch's reduction gives a row to one block, which took 37 us for a
    128,256-token row on the H100 (Llama-3's output; the bytes take ~0.1 us), once per
    greedy decode step (tools/gpu_kernel_census.py). Elsewhere, torch's."""
    rows, vocab = logits.shape
    if not (HAS_TRITON and logits.is_cuda) or logits.stride(1) != 1 or rows * vocab >= 2**31:
        return logits.argmax(dim=-1)
    return _chunked_argmax(logits, None, 0, argmax_only=True)


def gumbel_sample(logits: torch.Tensor, temperatures: list[float], seed: int) -> torch.Tensor:
    """One token id per row of logits [rows, vocab] (any float dtype): a draw from
    softmax(logits / T) for rows with T > 0, the argmax for rows with T == 0. `seed` keys the
    in-kernel random stream (the same seed and logits give the same tokens)."""
    require_triton()
    rows, vocab = logits.shape
    if len(temperatures) != rows:
        raise ValueError(f"{len(temperatures)} temperatures for {rows} rows")
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous")
    if rows * vocab >= 2**31:
        raise ValueError("more than 2**31 logits: the draw counter is 32-bit")
    return _chunked_argmax(logits, temperatures, seed, argmax_only=False)


def _chunked_argmax(logits: torch.Tensor, temperatures: list[float] | None, seed: int, *,
                    argmax_only: bool) -> torch.Tensor:
    """The two launches: per-(row, chunk) winners, then each row's (`temperatures` and
    `seed` unread where argmax_only)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = num_chunks_for(rows, vocab)
    chunk_len = -(-vocab // chunks)
    chunk_len = -(-chunk_len // _BLOCK) * _BLOCK  # whole blocks, so chunks do not overlap
    chunks = -(-vocab // chunk_len)
    part_score = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    part_id = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    inv_temp, scalar, per_row = part_score, 0.0, False   # unread where argmax_only
    if not argmax_only:
        first = temperatures[0]
        per_row = any(t != first for t in temperatures)
        if per_row:
            inv_temp = device_tensor([0.0 if t == 0.0 else 1.0 / t for t in temperatures],
                                     logits.device, torch.float32)
        else:
            scalar = 0.0 if first == 0.0 else 1.0 / first
    _gumbel_argmax_partial_kernel[(rows, chunks)](
        logits, inv_temp, part_score, part_id, logits.stride(0), vocab, chunk_len,
        seed & 0x7FFFFFFF, scalar, PER_ROW=per_row, BLOCK=_BLOCK, ARGMAX_ONLY=argmax_only,
        num_warps=4)
    _argmax_chunks_kernel[(rows,)](part_score, part_id, out, chunks, C_PAD=_MAX_CHUNKS,
                                   num_warps=1)
    return out

