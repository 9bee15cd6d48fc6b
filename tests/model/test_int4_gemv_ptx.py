"""The one-row 4-bit GEMV's PTX (kernels/int4_gemv.dot_ptx), emulated on the CPU.

The Triton interpreter runs the kernel's plain-Triton form, never its inline PTX, so the PTX
that the GPU runs is checked here instruction by instruction: a small emulator executes the
text that the kernel compiles (fp16 arithmetic rounded once per instruction, as the f16x2
instructions round) and must agree bit for bit with an independent model of the intended
arithmetic, and closely with the float64 sum. A swapped operand, a wrong mask or a lost
word changes the result by the size of a product, far outside the tolerance.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from folio.model.kernels.int4_gemv import dot_constraints, dot_ptx

_LO_BASE, _HI_BASE = 0x6400, 0xD400   # fp16 bits of 1024 and of -64 (int4_gemv._subtrahends)


def _f16(bits: int) -> float:
    return float(np.array([bits & 0xFFFF], np.uint16).view(np.float16)[0])


def _bits(value: float) -> int:
    return int(np.array([value], np.float16).view(np.uint16)[0])


def _lanes(reg: int) -> tuple[float, float]:
    return _f16(reg), _f16(reg >> 16)


def _pack(lo: float, hi: float) -> int:
    """Each lane rounded once to fp16 (its exact float64 value in)."""
    return _bits(lo) | (_bits(hi) << 16)


def _run(ptx: str, operands: list[int]) -> float:
    """Execute the PTX block on 32-bit operands $1..; returns $0 (float32)."""
    regs: dict[str, int] = {f"${i + 1}": v for i, v in enumerate(operands)}

    def val(token: str) -> int:
        return int(token, 16) if token.startswith("0x") else regs[token]

    out = None
    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and "{" in rest:           # unpack to two f16 registers
            h0, h1, src = re.match(r"\{(\w+), (\w+)\}, (\w+)", rest).groups()
            regs[h0], regs[h1] = regs[src] & 0xFFFF, regs[src] >> 16
            continue
        args = [a.strip() for a in rest.split(",")]
        dst, src = args[0], args[1:]
        if op == "mov.b32":
            regs[dst] = val(src[0])
        elif op == "lop3.b32":
            assert src[3] == "0xea", "the emulator knows LUT 0xea, (a & b) | c"
            regs[dst] = (val(src[0]) & val(src[1])) | val(src[2])
        elif op == "shr.u32":
            regs[dst] = val(src[0]) >> int(src[1])
        elif op == "sub.f16x2":
            (a0, a1), (b0, b1) = _lanes(val(src[0])), _lanes(val(src[1]))
            regs[dst] = _pack(a0 - b0, a1 - b1)
        elif op == "mul.f16x2":
            (a0, a1), (b0, b1) = _lanes(val(src[0])), _lanes(val(src[1]))
            regs[dst] = _pack(a0 * b0, a1 * b1)
        elif op == "fma.rn.f16x2":
            (a0, a1), (b0, b1), (c0, c1) = (_lanes(val(s)) for s in src)
            regs[dst] = _pack(a0 * b0 + c0, a1 * b1 + c1)   # exact in float64, one rounding
        elif op == "add.f16":
            regs[dst] = _bits(_f16(val(src[0])) + _f16(val(src[1])))
        elif op == "cvt.f32.f16":
            assert dst == "$0"
            out = _f16(val(src[0]))
        else:
            raise AssertionError(f"the emulator does not know {op}")
    assert out is not None
    return out


def _model(words: list[int], x: np.ndarray, z: int) -> float:
    """The intended arithmetic, written independently: per word, lanes (nibble i, nibble
    i + 4) for i = 0, 1, 2, 3 in that order, (q - z) exact, each product added to the
    fp16 lane partial with one rounding; the lanes added in fp16 at the end."""
    acc = [0.0, 0.0]
    first = True
    for w, word in enumerate(words):
        for i in range(4):
            for lane in range(2):
                q = (word >> (4 * (i + 4 * lane))) & 0xF
                prod = (q - z) * float(np.float16(x[8 * w + i + 4 * lane]))
                acc[lane] = float(np.float16(prod if first else prod + acc[lane]))
            first = False
    return float(np.float16(acc[0] + acc[1]))


@pytest.mark.parametrize("words", [1, 4])
def test_dot_ptx_matches_the_intended_arithmetic(words: int) -> None:
    ptx = dot_ptx(words)
    assert dot_constraints(words).split(",").count("r") == 5 * words + 2
    rng = np.random.default_rng(words)
    for case in range(300):
        z = int(rng.integers(0, 64)) if case % 3 else 8     # zero points up to 63 are legal
        ws = [int(v) for v in rng.integers(0, 2 ** 32, words, dtype=np.uint64)]
        # x' as the kernel hands it: scaled so the largest lies in [1, 2), in fp16
        x = rng.standard_normal(8 * words)
        x = (x / 2.0 ** np.floor(np.log2(np.abs(x).max()))).astype(np.float16)
        pairs = []
        for w in range(words):
            pairs += [_pack(float(x[8 * w + i]), float(x[8 * w + i + 4])) for i in range(4)]
        lo, hi = _LO_BASE + z, _HI_BASE + 16 * z
        got = _run(ptx, ws + pairs + [lo | (lo << 16), hi | (hi << 16)])
        assert got == _model(ws, x.astype(np.float64), z), (case, z)
        exact = sum((((ws[w] >> (4 * j)) & 0xF) - z) * float(x[8 * w + j])
                    for w in range(words) for j in range(8))
        scale = sum(abs((((ws[w] >> (4 * j)) & 0xF) - z) * float(x[8 * w + j]))
                    for w in range(words) for j in range(8))
        assert abs(got - exact) <= 4e-3 * scale, (case, got, exact)
