"""The one-row 4-bit GEMV's tensor-core form (kernels/int4_gemv.mma_ptx), checked without a
GPU in three parts:

1. Its PTX, run by a warp emulator here: 32 lanes in lockstep, mma.sync m16n8k16 by the PTX
   ISA's fragment tables (lane 4 g + c: a0 = A[g][2c, 2c+1], a1 = A[g+8][..], a2 = A[g][2c+8,
   2c+9], a3 = A[g+8][..]; b0 = B[2c, 2c+1][g], b1 = B[2c+8, 2c+9][g]; c0, c1 = D[g][2c,
   2c+1], c2, c3 = D[g+8][..]). The lanes are handed the words, rows and x as the kernel's
   layout places them (lane 4 g + c: words 4c..4c+3 of rows g, g + 8, ...), and every row's
   result must equal the float64 sum of (q - z) x s (+ m sum x), in all four lanes of its quad.
2. The layout that placement assumes, as the compiler chose it for every MMA config (sm_90,
   Triton's compiler here): the asm's operands in a blocked layout of [1, 4] a thread,
   [8, 4] threads a warp, order [1, 0], warps stacked on rows; and no layout conversion or
   barrier in the loop.
3. The kernel's tensor-core branch end to end under the interpreter (its plain-Triton form:
   addresses, groups, offsets, split-K, gate|up), against the dequantized reference.
"""
from __future__ import annotations

import os
import re
import struct
import sys

import numpy as np
import pytest
from interpreter_harness import child_main, interpreter_results, rel_err

if __name__ != "__main__":
    from folio.model.kernels.int4_gemv import mma_constraints, mma_ptx

_HERE = os.path.dirname(__file__)


# --- 1. the PTX on an emulated warp ------------------------------------------------------

def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", float(np.float32(value))))[0]


def _half(bits: int, f16: bool) -> float:
    """The 16-bit float in the low half of `bits`: fp16 or bf16."""
    b = bits & 0xFFFF
    if f16:
        return float(np.array([b], np.uint16).view(np.float16)[0])
    return _f32(b << 16)


def _imm(token: str) -> int:
    if token.startswith("0f"):
        return int(token[2:], 16)
    return int(token, 16) if token.startswith("0x") else int(token)


class Warp:
    """32 lanes running straight-line PTX in lockstep (the few instructions mma_ptx uses),
    over a byte memory addressed from 0."""

    def __init__(self, memory: bytes, f16: bool) -> None:
        self.mem, self.f16 = memory, f16
        self.regs: list[dict[str, int]] = [{} for _ in range(32)]

    def _get(self, lane: int, token: str) -> int:
        if token[0] in "0123456789-":
            return _imm(token)
        return self.regs[lane][token]

    def _load(self, addr: int, size: int) -> int:
        return int.from_bytes(self.mem[addr:addr + size], "little")

    def run(self, asm: str) -> None:
        for raw in asm.splitlines():
            line = raw.strip().rstrip(";")
            if line in ("{", "}") or line.startswith(".reg"):
                continue
            op, rest = line.split(None, 1)
            if op.startswith("mma.sync"):
                self._mma(rest)
                continue
            for lane in range(32):
                self._step(lane, op, rest)

    def _step(self, lane: int, op: str, rest: str) -> None:
        r = self.regs[lane]
        if op.startswith("ld.global"):
            m = re.match(r"(\S+), \[(\S+?)(?:\+(\d+))?\]$", rest)
            dst, base, off = m.group(1), m.group(2), int(m.group(3) or 0)
            r[dst] = self._load(r[base] + off, 2 if op.endswith("b16") else 4)
            return
        args = [a.strip() for a in re.split(r",(?![^{]*\})", rest)]
        dst, srcs = args[0], args[1:]
        if op in ("mov.b32", "mov.f32", "mov.b16"):
            if srcs[0].startswith("{"):       # {lo, hi} of two 16-bit registers
                lo, hi = (t.strip() for t in srcs[0][1:-1].split(","))
                r[dst] = (r[lo] & 0xFFFF) | ((r[hi] & 0xFFFF) << 16)
            elif dst.startswith("{"):         # a 32-bit register into two 16-bit ones
                lo, hi = (t.strip() for t in dst[1:-1].split(","))
                v = self._get(lane, srcs[0])
                r[lo], r[hi] = v & 0xFFFF, (v >> 16) & 0xFFFF
            else:
                r[dst] = self._get(lane, srcs[0]) & 0xFFFFFFFF
        elif op == "prmt.b32":
            a, b, sel = self._get(lane, srcs[0]), self._get(lane, srcs[1]), _imm(srcs[2])
            pool = (a | (b << 32)).to_bytes(8, "little")
            r[dst] = int.from_bytes(bytes(pool[(sel >> (4 * i)) & 7] for i in range(4)),
                                    "little")
        elif op == "shr.u32":
            r[dst] = (self._get(lane, srcs[0]) & 0xFFFFFFFF) >> _imm(srcs[1])
        elif op == "lop3.b32":
            assert srcs[3] == "0xea"            # (a & b) | c
            r[dst] = (self._get(lane, srcs[0]) & _imm(srcs[1])) | _imm(srcs[2])
        elif op == "cvt.f32.f16":
            r[dst] = _bits(_half(r[srcs[0]], True))
        elif op == "sub.f32":
            r[dst] = _bits(_f32(self._get(lane, srcs[0])) - _f32(self._get(lane, srcs[1])))
        elif op == "fma.rn.f32":
            a, b, c = (_f32(self._get(lane, s)) for s in srcs)
            r[dst] = _bits(a * b + c)           # float64 then one rounding: fma's
        else:
            raise AssertionError(f"the emulator does not know {op}")

    def _mma(self, rest: str) -> None:
        groups = [[t.strip() for t in g.split(",")] for g in re.findall(r"\{([^}]*)\}", rest)]
        d, a, b, c = groups
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        C = np.zeros((16, 8))
        for lane in range(32):
            g, q = lane // 4, lane % 4
            get = lambda name: self._get(lane, name)  # noqa: E731
            for reg, row, col in ((a[0], g, 2 * q), (a[1], g + 8, 2 * q),
                                  (a[2], g, 2 * q + 8), (a[3], g + 8, 2 * q + 8)):
                v = get(reg)
                A[row, col], A[row, col + 1] = _half(v, self.f16), _half(v >> 16, self.f16)
            for reg, k in ((b[0], 2 * q), (b[1], 2 * q + 8)):
                v = get(reg)
                B[k, g], B[k + 1, g] = _half(v, self.f16), _half(v >> 16, self.f16)
            for reg, row, col in ((c[0], g, 2 * q), (c[1], g, 2 * q + 1),
                                  (c[2], g + 8, 2 * q), (c[3], g + 8, 2 * q + 1)):
                C[row, col] = _f32(get(reg))
        D = (A @ B + C).astype(np.float32)
        for lane in range(32):
            g, q = lane // 4, lane % 4
            for reg, row, col in ((d[0], g, 2 * q), (d[1], g, 2 * q + 1),
                                  (d[2], g + 8, 2 * q), (d[3], g + 8, 2 * q + 1)):
                self.regs[lane][reg] = _bits(D[row, col])


def _encode(values: np.ndarray, kind: str) -> bytes:
    if kind == "fp32":
        return values.astype(np.float32).tobytes()
    if kind == "fp16":
        return values.astype(np.float16).tobytes()
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _round(values: np.ndarray, kind: str) -> np.ndarray:
    """Values as `kind` holds them (bf16: the float32 truncated, as _encode stores it)."""
    if kind == "fp32":
        return values.astype(np.float32).astype(np.float64)
    if kind == "fp16":
        return values.astype(np.float16).astype(np.float64)
    bits = values.astype(np.float32).view(np.uint32) & 0xFFFF0000
    return bits.view(np.float32).astype(np.float64)


def _run_tile(reps: int, zero_mode: int, x_f16: bool, s_kind: str, z_kind: str,
              seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = 8 * reps                                  # one warp: rows g + 8 r
    codes = rng.integers(0, 16, (rows, 128))
    x_kind = "fp16" if x_f16 else "bf16"
    x = _round(rng.standard_normal(128) * rng.choice([0.01, 1.0, 40.0]), x_kind)
    if seed % 3 == 0:
        x += _round(np.full(128, 3.0), x_kind)       # a nonzero mean: sum x matters
        x = _round(x, x_kind)
    s = _round(rng.uniform(0.001, 0.02, rows), s_kind)
    z = _round(rng.integers(0, 16, rows).astype(np.float64), z_kind)
    m = _round(-rng.uniform(0, 0.05, rows), z_kind)
    words = np.zeros((rows, 16), np.uint64)
    for i in range(8):
        words |= (codes[:, i::8].astype(np.uint64) << (4 * i))
    # memory: x, then the scales, then the offsets
    x_bytes, s_bytes = _encode(x, x_kind), _encode(s, s_kind)
    o_bytes = _encode(z if zero_mode == 1 else m, z_kind)
    s_base, o_base = len(x_bytes), len(x_bytes) + len(s_bytes)
    s_size, o_size = len(s_bytes) // rows, len(o_bytes) // rows
    warp = Warp(x_bytes + s_bytes + o_bytes, x_f16)
    asm = mma_ptx(reps, zero_mode, x_f16, s_kind, z_kind)
    constraints = mma_constraints(reps, zero_mode).split(",")
    p = 4 * reps
    x_base = (5 if zero_mode else 4) * p           # then four groups of x's int32s
    assert len(constraints) == x_base + 4 * p
    x_words = np.frombuffer(x_bytes, np.uint32).reshape(16, 4)   # word w: its 4 int32s
    acc0 = rng.standard_normal(rows).astype(np.float32)
    for lane in range(32):
        g, c = lane // 4, lane % 4
        regs = warp.regs[lane]
        for r in range(reps):
            row = g + 8 * r
            for j in range(4):
                e = 4 * r + j
                regs[f"${p + e}"] = int(words[row, 4 * c + j])                  # words
                regs[f"${2 * p + e}"] = _bits(acc0[row] if j == 0 else 0.0)     # acc
                regs[f"${3 * p + e}"] = s_base + row * s_size                   # scale
                if zero_mode:
                    regs[f"${4 * p + e}"] = o_base + row * o_size               # offset
                for i in range(4):                                              # x of word
                    regs[f"${x_base + i * p + e}"] = int(x_words[4 * c + j, i])
    warp.run(asm)
    xsum = x.sum()
    for row in range(rows):
        if zero_mode == 2:
            want = s[row] * (codes[row] * x).sum() + m[row] * xsum
        else:
            zp = 8.0 if zero_mode == 0 else z[row]
            want = s[row] * ((codes[row] - zp) * x).sum()
        want += acc0[row]
        g, r = row % 8, row // 8
        # eight float32 roundings of sums up to (BASE + 15) sum |x|, then the scale
        base = 1024.0 if x_f16 else 128.0
        tol = 16 * 6e-8 * (base + 16) * s[row] * np.abs(x).sum() + 1e-6 * abs(want)
        for c in range(4):
            regs = warp.regs[4 * g + c]
            got = _f32(regs[f"${4 * r}"])
            assert abs(got - want) <= tol, (row, c, got, want, tol)
            assert all(_f32(regs[f"${4 * r + j}"]) == 0.0 for j in (1, 2, 3))


@pytest.mark.parametrize("reps", [2, 4])
@pytest.mark.parametrize("zero_mode", [0, 1, 2])
@pytest.mark.parametrize("x_f16", [False, True])
def test_mma_ptx_on_an_emulated_warp(reps: int, zero_mode: int, x_f16: bool) -> None:
    kinds = [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32")]
    if zero_mode == 2:
        kinds = [(s, "fp32") for s, _ in kinds]          # GGUF's minimums are float32
    for seed, (s_kind, z_kind) in enumerate(kinds):
        _run_tile(reps, zero_mode, x_f16, s_kind, z_kind, seed + 10 * zero_mode)


def test_mma_ptx_wrong_pairing_is_caught() -> None:
    """The emulated check fails when the x pairs are swapped against the codes' (the
    columns of a2/b1 taken as those of a0/b0): the test can fail."""
    import folio.model.kernels.int4_gemv as ig
    real = ig.mma_ptx.fn if hasattr(ig.mma_ptx, "fn") else ig.mma_ptx

    def swapped(*args):
        return real(*args).replace("0x5410;", "0xTMP;").replace("0x7632;", "0x5410;") \
            .replace("0xTMP;", "0x7632;")

    global mma_ptx
    saved = mma_ptx
    mma_ptx = swapped
    try:
        with pytest.raises(AssertionError):
            _run_tile(2, 0, False, "bf16", "bf16", 1)
    finally:
        mma_ptx = saved


def test_mma_ptx_refuses_an_odd_row_count() -> None:
    with pytest.raises(ValueError, match="even number of rows"):
        mma_ptx(3, 0, False, "bf16", "bf16")


# --- 2. the layout the compiler chose ----------------------------------------------------

def _compile_mma(block_n: int, warps: int, split_k: int, zero_mode: int, gate_up: bool):
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__),
                                       "backends/nvidia/bin/cuobjdump")):
        pytest.skip("this triton has no NVIDIA backend tools")
    sys.path.insert(0, os.path.join(_HERE, "..", "..", "tools"))
    import sass_counts

    from folio.model.kernels import int4_gemv as ig
    kernel = sass_counts.compile_gemv4(block_n, ig.MMA_WORDS, split_k, warps, mma=True,
                                       zero_mode=zero_mode, gate_up=gate_up)
    return kernel, sass_counts


def _mma_configs() -> list[tuple[int, int, int]]:
    from folio.model.kernels import int4_gemv as ig
    return sorted({(bn, w, sk) for bn, bw, sk, w, st, mma in ig._CONFIGS if mma})


def test_mma_configs_compile_to_the_assumed_lane_layout() -> None:
    for block_n, warps, split_k in _mma_configs():
        for zero_mode, gate_up in ((0, False), (1, True)):
            kernel, sass_counts = _compile_mma(block_n, warps, split_k, zero_mode, gate_up)
            ttgir = kernel.asm["ttgir"]
            layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<\{[^}]*\}>)", ttgir, re.M))
            asm_ops = [line for line in ttgir.splitlines()
                       if "elementwise_inline_asm" in line and "mma.sync" in line]
            assert len(asm_ops) == 2, (block_n, warps)      # two tiles an iteration
            for op in asm_ops:
                enc = re.findall(r"tensor<\d+x16x\w+, (#\w+)>", op)
                assert enc and len(set(enc)) == 1, op[-300:]
                want = (f"sizePerThread = [1, 4], threadsPerWarp = [8, 4], "
                        f"warpsPerCTA = [{warps}, 1], order = [1, 0]")
                assert want in layouts[enc[0]], (block_n, warps, layouts[enc[0]])
            sass = sass_counts.sass_of(kernel)
            loop = _loop_text(sass)
            assert "BAR.SYNC" not in loop and "STS" not in loop and "LDS" not in loop, \
                (block_n, warps)
            ops = sass_counts.opcode_counts(loop)
            reps = block_n // (8 * warps)
            # per tile: two products a word, 8 for the sum of x
            assert ops["HMMA.16816.F32.BF16"] == 2 * (4 * reps + 8), ops


def _loop_text(sass: str) -> str:
    import sass_counts
    loops = sass_counts.loop_bodies(sass)
    assert len(loops) == 1
    return "\n".join(loops[0])


def test_mma_form_has_fewer_instructions_a_word_than_the_pair_form() -> None:
    """What the form is for: fewer instructions a code in the loop (SASS here; the GPU's
    time is the benchmark's). The pair form's main config, 32 rows x 128 words on 4 warps,
    against the MMA form at 8 rows a lane."""
    kernel, sass_counts = _compile_mma(128, 2, 1, 0, False)
    mma_loop = len(_loop_text(sass_counts.sass_of(kernel)).splitlines())
    per_word_mma = mma_loop / 2 / (8 * 4)          # two tiles, 8 rows x 4 words a lane
    assert per_word_mma < 13, per_word_mma         # the pair form: 18.6 (595 a tile)


# --- 3. the branch end to end under the interpreter ----------------------------------------

_CASES = [
    dict(name="sym-g128", n=64, k=512, g=128, form="sym", split=1),
    dict(name="zeros-g256", n=64, k=512, g=256, form="zeros", split=1),
    dict(name="mins-g128", n=64, k=512, g=128, form="mins", split=1),
    dict(name="sym-split2", n=64, k=512, g=128, form="sym", split=2),
    dict(name="ragged-n", n=40, k=256, g=128, form="zeros", split=1),
    dict(name="gate-up", n=64, k=256, g=128, form="sym", split=1, gate_up=True),
    dict(name="fp16-zeros", n=32, k=256, g=128, form="zeros", split=1, dtype="fp16"),
]


def _run_case(case: dict) -> dict:
    import torch

    from folio.model.kernels import int4_gemv
    from folio.model.quant.formats import pack_rows
    torch.manual_seed(0)
    n, k, g = case["n"], case["k"], case["g"]
    dt = torch.float16 if case.get("dtype") == "fp16" else torch.bfloat16
    rows = 2 * n if case.get("gate_up") else n
    q = torch.randint(0, 16, (rows, k), dtype=torch.uint8)
    scales = (torch.rand(rows, k // g) * 0.02 + 0.001).to(dt)
    zeros = mins = None
    if case["form"] == "zeros":
        zeros = torch.randint(0, 16, (rows, k // g)).to(dt)
    if case["form"] == "mins":
        mins = -torch.rand(rows, k // g) * 0.05
        scales = scales.float()
    x = torch.randn(1, k).to(dt)
    zf = 8.0 if zeros is None else zeros.float().repeat_interleave(g, 1)
    deq = (q.float() - (0.0 if mins is not None else zf)) * scales.float().repeat_interleave(g, 1)
    if mins is not None:
        deq = deq + mins.repeat_interleave(g, 1)
    ref = x.double() @ deq.double().t()
    offsets = zeros if zeros is not None else mins
    mode = 1 if zeros is not None else 2 if mins is not None else 0
    outs = []
    for config in (dict(BLOCK_N=32, BLOCK_W=int4_gemv.MMA_WORDS, SPLIT_K=case["split"],
                        num_warps=2, num_stages=1, MMA=True),
                   dict(BLOCK_N=4, BLOCK_W=8, SPLIT_K=1, num_warps=4, num_stages=1)):
        out = torch.empty(1, n, dtype=dt)
        int4_gemv.int4_gemv(x, pack_rows(q), scales, offsets, mode, g, None, out,
                            gate_up=bool(case.get("gate_up")), _config=config)
        outs.append(out)
    if case.get("gate_up"):
        gate, up = ref[:, :n], ref[:, n:]
        ref = torch.nn.functional.silu(gate) * up
    # against the reference, and against the pair form's result (the same sums in float32
    # under the interpreter; gate|up's bf16 roundings of gate, up and the SiLU are alike)
    return {"name": case["name"], "err": rel_err(outs[0], ref),
            "vs_pairs": rel_err(outs[0], outs[1])}


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return interpreter_results(__file__)


@pytest.mark.parametrize("case", [c["name"] for c in _CASES])
def test_mma_branch_under_the_interpreter(interpreted: dict, case: str) -> None:
    res = interpreted.get(case)
    assert res is not None, interpreted["_stderr"]
    assert "error" not in res, res["error"]
    assert res["err"] < (2e-2 if "gate-up" in case else 1e-2), res
    assert res["vs_pairs"] < 1e-3, res


def test_mma_config_refused_where_it_does_not_fit() -> None:
    from folio.model.kernels import int4_gemv
    assert int4_gemv.fits(4096, 4096, 128, 128, 16, 1, mma_warps=4)
    assert not int4_gemv.fits(4096, 4096, 32, 128, 16, 1, mma_warps=4)    # groups of 32
    assert not int4_gemv.fits(4096, 4096, 128, 64, 16, 1, mma_warps=8)    # one row a lane
    assert not int4_gemv.fits(4096, 4096, 128, 128, 32, 1, mma_warps=4)   # tile of 32 words


def test_mma_operands_refused_where_the_asm_cannot_take_them() -> None:
    import torch

    from folio.model.kernels import int4_gemv
    assert not int4_gemv.mma_operands_ok(torch.zeros(1, 64))                    # float32
    assert not int4_gemv.mma_operands_ok(
        torch.zeros(1, 65, dtype=torch.bfloat16)[:, 1:])                       # misaligned


if __name__ == "__main__":
    child_main(_CASES, _run_case)
