"""A numpy emulator of the few PTX instructions the 4-bit GEMV's inline assembly uses
(kernels/int4_gemv.py), so its PTX can be checked on a CPU: the Triton interpreter runs
kernels' plain-Triton branches and never their inline assembly.

`run_ptx` executes one asm block elementwise over numpy arrays (32-bit registers; fp16
arithmetic rounded once per instruction, as the f16x2 instructions round: each result is
exact in float64 before its one rounding). `install_in_interpreter` makes the interpreter
hand `tl.inline_asm_elementwise` to it, so a kernel runs its real operand lists.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np


def _f16(bits: np.ndarray) -> np.ndarray:
    """The fp16 in the low 16 bits of each element, as float64."""
    return (np.asarray(bits) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)


def _bits16(values: np.ndarray) -> np.ndarray:
    """float64 values rounded once to fp16, as uint32 bit patterns."""
    return np.asarray(values).astype(np.float16).view(np.uint16).astype(np.uint32)


def _lanes(reg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _f16(reg), _f16(np.asarray(reg) >> 16)


def _pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return _bits16(lo) | (_bits16(hi) << 16)


def _as_u32(value: np.ndarray) -> np.ndarray:
    value = np.asarray(value)
    if value.dtype.itemsize == 4:
        return value.view(np.uint32)
    return value.astype(np.uint32)


def run_ptx(asm: str, constraints: str, operands: Sequence[np.ndarray]) -> np.ndarray:
    """Execute `asm` (one output, $0; inputs $1..) on broadcast numpy operands. A "=f"
    output comes back as float32, "=r" as uint32; "r" inputs are read as 32-bit patterns,
    "f" inputs as float32."""
    kinds = constraints.split(",")
    assert kinds[0] in ("=f", "=r") and not any(k.startswith("=") for k in kinds[1:]), \
        "the emulator knows blocks with one output"
    shape = np.broadcast_shapes(*(np.shape(v) for v in operands))
    regs: dict[str, np.ndarray] = {}
    for i, (kind, value) in enumerate(zip(kinds[1:], operands)):
        value = np.broadcast_to(np.asarray(value), shape)
        regs[f"${i + 1}"] = _as_u32(value) if kind == "r" else value.astype(np.float32)

    def val(token: str) -> np.ndarray:
        return np.uint32(int(token, 16)) if token.startswith("0x") else regs[token]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and "{" in rest:           # unpack into two f16 registers
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
            regs[dst] = val(src[0]) >> np.uint32(int(src[1]))
        elif op == "sub.f16x2":
            (a0, a1), (b0, b1) = _lanes(val(src[0])), _lanes(val(src[1]))
            regs[dst] = _pack(a0 - b0, a1 - b1)
        elif op == "mul.f16x2":
            (a0, a1), (b0, b1) = _lanes(val(src[0])), _lanes(val(src[1]))
            regs[dst] = _pack(a0 * b0, a1 * b1)
        elif op == "fma.rn.f16x2":
            (a0, a1), (b0, b1), (c0, c1) = (_lanes(val(s)) for s in src)
            regs[dst] = _pack(a0 * b0 + c0, a1 * b1 + c1)
        elif op == "add.f16":
            regs[dst] = _bits16(_f16(val(src[0])) + _f16(val(src[1])))
        elif op == "cvt.f32.f16":
            regs[dst] = _f16(val(src[0])).astype(np.float32)
        elif op == "cvt.rn.f16x2.f32":                 # d = (cvt(b) low, cvt(a) high)
            hi, lo = (np.asarray(regs[s], np.float32).astype(np.float64) for s in src)
            regs[dst] = _pack(lo, hi)
        else:
            raise AssertionError(f"the emulator does not know {op}")
    out = np.broadcast_to(regs["$0"], shape)     # a copy keeps a 0-d result 0-d
    return (out.astype(np.float32) if kinds[0] == "=f" else _as_u32(out)).copy()


def install_in_interpreter() -> None:
    """Make the Triton interpreter (TRITON_INTERPRET=1) run inline assembly through
    run_ptx (one element per asm instance)."""
    import triton.runtime.interpreter as interpreter

    def create_inline_asm(self: Any, asm: str, constraints: str, values: list, type: Any,
                          is_pure: bool, pack: int) -> Any:
        assert pack == 1, "the emulator runs one element per asm instance"
        result_type = type[0] if isinstance(type, (list, tuple)) else type
        data = run_ptx(asm, constraints, [v.data for v in values])
        handle = interpreter.TensorHandle(data, getattr(result_type, "scalar", result_type))

        class _Op:
            def get_result(self, index: int) -> Any:
                return handle
        return _Op()

    interpreter.InterpreterBuilder.create_inline_asm = create_inline_asm
