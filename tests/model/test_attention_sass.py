"""What the attention kernels compile to on sm_90, checked here without a GPU (Triton's
compiler and the ptxas it ships: tools/sass_counts.py). An FP8 cache read as float8 tiles
crosses shared memory a byte at a time for the transposed K operand of a register product
(LDS.U8); read as int16 pairs (`_attend_tile`'s PAIRS) it takes the 16-bit path (ldmatrix)
and no byte-wide loads, which made the decode kernel 1.2-1.27x faster on an H100
(docs/benchmarks.md, session 30). The varlen kernel's large tiles keep float8 tiles."""
from __future__ import annotations

import os
import sys

import pytest

triton = pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
sass_counts = pytest.importorskip("sass_counts")

if not os.path.exists(os.path.join(os.path.dirname(triton.__file__),
                                   "backends/nvidia/bin/cuobjdump")):
    pytest.skip("this triton has no NVIDIA backend tools", allow_module_level=True)


def _decode_sass(pairs: bool) -> str:
    from folio.model.attention import triton_kernels as tk
    consts = dict(G=4, G_M=16, D=128, D_PAD=128, BLOCK_SIZE=16, SLIDING=False,
                  DOT_PREC="tf32", SOFTCAP=False, HAS_SINKS=False, FP8=True, BLOCK_N=32,
                  USE_SPLITS=False, FUSED_MERGE=False, G_P=4, S_CHUNK=16, USE_PDL=True,
                  PAIRS=pairs, CVT_ASM=pairs, E5M2=False)
    kernel = sass_counts.compile_sm90(tk._decode_kernel.fn, consts,
                                      "*fp8e4nv", 2, 2)
    return sass_counts.sass_of(kernel)


def test_fp8_pairs_take_the_16_bit_shared_memory_path() -> None:
    sass_bytes, sass_pairs = _decode_sass(False), _decode_sass(True)
    bytes_wide, pairs = (sass_counts.opcode_counts(s) for s in (sass_bytes, sass_pairs))
    assert bytes_wide["LDS.U8"] > 0          # the float8 tile: byte-wide shared loads
    assert pairs["LDS.U8"] == 0
    assert pairs["LDSM.16.MT88.4"] > 0       # ldmatrix (transposed) for the K pairs
    # one conversion per pair of elements in both: the pairs widen as many values
    assert pairs["F2FP.F16.E4M3.UNPACK_B"] == bytes_wide["F2FP.F16.E4M3.UNPACK_B"]
    # per tile: the decode kernel's two loops (tiles without and with masks), each shorter
    loops_bytes, loops_pairs = (sass_counts.loop_lengths(s) for s in (sass_bytes, sass_pairs))
    assert len(loops_pairs) == len(loops_bytes) == 2
    assert all(p < b for p, b in zip(loops_pairs, loops_bytes)), (loops_pairs, loops_bytes)


def _varlen_sass(pairs: bool, block_m: int, warps: int) -> str:
    from folio.model.attention import triton_kernels as tk
    consts = dict(G=4, G_PAD=4, D=128, D_PAD=128, BLOCK_SIZE=16, SLIDING=False,
                  DOT_PREC="tf32", SOFTCAP=False, HAS_SINKS=False, FP8=True, HAS_SKIP=False,
                  BLOCK_M=block_m, BLOCK_N=64, PAIRS=pairs, CVT_ASM=pairs, E5M2=False)
    return sass_counts.sass_of(sass_counts.compile_sm90(tk._varlen_kernel.fn, consts,
                                                        "*fp8e4nv", warps, 2))


def test_varlen_reads_pairs_in_its_register_product_tiles_only() -> None:
    # 32 rows (mma.sync): the float8 tile's byte-wide loads, gone with pairs
    small_bytes, small_pairs = _varlen_sass(False, 32, 4), _varlen_sass(True, 32, 4)
    assert sass_counts.opcode_counts(small_bytes)["LDS.U8"] > 0
    assert sass_counts.opcode_counts(small_pairs)["LDS.U8"] == 0
    # the tile loops (without and with masks; the first loop is the request search)
    tiles_pairs, tiles_bytes = (sass_counts.loop_lengths(s)[-2:] for s in (small_pairs,
                                                                          small_bytes))
    assert all(p < b for p, b in zip(tiles_pairs, tiles_bytes)), (tiles_pairs, tiles_bytes)
    # 128 rows (Hopper's shared-memory products): float8 tiles either way
    assert _varlen_sass(True, 128, 8) == _varlen_sass(False, 128, 8)
