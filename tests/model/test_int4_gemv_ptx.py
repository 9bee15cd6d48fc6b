"""The one-row 4-bit GEMV's PTX (kernels/int4_gemv.dot_ptx), emulated on the CPU.

The Triton interpreter runs the kernel's plain-Triton form, never its inline PTX, so the PTX
that the GPU runs is checked here instruction by instruction: a small emulator executes the
text that the kernel compiles (fp16 arithmetic rounded once per instruction, as the f16x2
instructions round) and must agree bit for bit with an independent model of the intended
arithmetic, and closely with the float64 sum. A swapped operand, a wrong mask or a lost
word changes the result by the size of a product, far outside the tolerance.

The second test runs the whole kernel under the interpreter with its inline assembly handed
to the same emulator (ptx_emulator.install_in_interpreter), so the operand lists the kernel
passes (x pairs, words, subtrahends, and _half2's packing) are the GPU's: every group size's
path (four words at a time, or one for groups of 16 columns), every offset form, gate|up,
split-K, and x past fp16's range.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from interpreter_harness import child_main, interpreter_results, rel_err
from ptx_emulator import install_in_interpreter, run_ptx

from folio.model.kernels.int4_gemv import dot_constraints, dot_ptx

_LO_BASE, _HI_BASE = 0x6400, 0xD400   # fp16 bits of 1024 and of -64 (int4_gemv._subtrahends)


def _bits(value: float) -> int:
    return int(np.array([value], np.float16).view(np.uint16)[0])


def _pack(lo: float, hi: float) -> int:
    return _bits(lo) | (_bits(hi) << 16)


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
    ptx, constraints = dot_ptx(words), dot_constraints(words)
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
        operands = [np.uint32(v) for v in ws + pairs + [lo | (lo << 16), hi | (hi << 16)]]
        got = float(run_ptx(ptx, constraints, operands))
        assert got == _model(ws, x.astype(np.float64), z), (case, z)
        exact = sum((((ws[w] >> (4 * j)) & 0xF) - z) * float(x[8 * w + j])
                    for w in range(words) for j in range(8))
        scale = sum(abs((((ws[w] >> (4 * j)) & 0xF) - z) * float(x[8 * w + j]))
                    for w in range(words) for j in range(8))
        assert abs(got - exact) <= 4e-3 * scale, (case, got, exact)


# The kernel with its PTX (child process, TRITON_INTERPRET=1): shapes, group sizes, offset
# forms ("sym", "zeros" up to 63, "mins"), gate|up, forced configs incl. split-K.
CASES: list[dict[str, Any]] = []
for _g in (16, 32, 64, 128):
    for _form in ("sym", "zeros", "mins"):
        CASES.append(dict(name=f"g{_g}_{_form}", N=12, K=256, G=_g, form=_form,
                          config=dict(BLOCK_N=4, BLOCK_W=8, SPLIT_K=1)))
CASES += [
    dict(name="g32_zeros_split2", N=12, K=256, G=32, form="zeros",
         config=dict(BLOCK_N=4, BLOCK_W=8, SPLIT_K=2)),
    dict(name="g64_sym_three_tiles", N=10, K=192, G=64, form="sym",
         config=dict(BLOCK_N=4, BLOCK_W=8, SPLIT_K=1)),
    dict(name="g32_mins_gate_up", N=32, K=128, G=32, form="mins", gate_up=True,
         config=dict(BLOCK_N=4, BLOCK_W=8, SPLIT_K=1)),
    dict(name="g128_zeros_gate_up_split2", N=32, K=256, G=128, form="zeros", gate_up=True,
         config=dict(BLOCK_N=4, BLOCK_W=8, SPLIT_K=2)),
    dict(name="g64_zeros_wide_x", N=12, K=256, G=64, form="zeros", wide_x=True,
         config=dict(BLOCK_N=4, BLOCK_W=8, SPLIT_K=1)),
]


def _run_kernel(case: dict) -> dict:
    import triton.language as tl

    from folio.model.kernels import int4_gemv
    from folio.model.quant.formats import pack_rows
    int4_gemv._ASM = tl.constexpr(True)        # the PTX branch, run by the emulator
    torch.manual_seed(len(case["name"]))
    n, k, g, form = case["N"], case["K"], case["G"], case["form"]
    rows = 2 * n if case.get("gate_up") else n
    q = torch.randint(0, 16, (rows, k), dtype=torch.uint8)
    s = torch.rand(rows, k // g) * 0.01 + 0.001
    grid = lambda t: t.repeat_interleave(g, 1)   # noqa: E731
    if form == "zeros":
        offsets, mode = torch.randint(0, 64, (rows, k // g)).float(), 1
        deq = (q.double() - grid(offsets).double()) * grid(s).double()
    elif form == "mins":
        offsets, mode = -torch.rand(rows, k // g) * 0.02, 2
        deq = q.double() * grid(s).double() + grid(offsets).double()
    else:
        offsets, mode = None, 0
        deq = (q.double() - 8) * grid(s).double()
    # fp16 activations (the rounding of gate, up and the product stays far below the bound),
    # bf16 where x passes fp16's range (the kernel scales each block of words into it)
    x, dtype = torch.randn(1, k), torch.float16
    if case.get("wide_x"):
        x, dtype = x * 10 ** (torch.rand(1, k) * 12 - 6), torch.bfloat16
    x = x.to(dtype)
    ref = x.double() @ deq.t()
    if case.get("gate_up"):
        gate, up = ref.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
    out = torch.empty(1, n, dtype=dtype)
    int4_gemv.int4_gemv(x, pack_rows(q), s, offsets, mode, g, None, out,
                        gate_up=bool(case.get("gate_up")), _config=case["config"])
    return {"name": case["name"], "err": rel_err(out, ref)}


@pytest.fixture(scope="module")
def kernel_results() -> dict[str, dict]:
    return interpreter_results(__file__)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_kernel_with_its_ptx(case: dict, kernel_results: dict[str, dict]) -> None:
    res = kernel_results.get(case["name"])
    assert res is not None, kernel_results["_stderr"]
    assert "error" not in res, res["error"]
    assert res["err"] < 5e-3, res


if __name__ == "__main__":
    install_in_interpreter()
    child_main(CASES, _run_kernel)
