"""Batched multi-LoRA shrink / expand (folio/model/kernels/lora.py) against plain per-token
torch loops, under the interpreter (fp32 and fp16: the interpreter's bf16 arithmetic is wrong).

T in {1, 3, 16} takes the per-token variant and {17, 70} the block one (the interpreter's
threshold and 16-token blocks); a few cases force the other variant, or a split over K
(ticket reduction, run twice: the same bits). Slot patterns: every token a random slot
including -1 (mixed blocks), long runs of one slot crossing block boundaries (uniform and
straddling blocks, a run of -1), one slot for all, and no adapter at all. Layers: a merged
one with three unequal slices and a plain one, at rank 24 (not a power of two) and 8; K and N
are ragged against the interpreter's tiles for the plain layer. shrink's out is poisoned with
NaN first, so unwritten elements show; tokens with slot -1 must get exact zeros from shrink
and keep y bit for bit through expand.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from interpreter_harness import child_main, interpreter_results, rel_err

SLOTS = 4
LAYERS = {"qkv": dict(K=64, slices=(64, 16, 16)), "plain": dict(K=100, slices=(40,))}

CASES: list[dict[str, Any]] = []
for _dt in ("float32", "float16"):
    for _t in (1, 3, 16, 17, 70):
        for _layer, _rank in (("qkv", 24), ("plain", 8)):
            CASES.append(dict(dtype=_dt, T=_t, layer=_layer, rank=_rank, slots="random"))
    for _t in (17, 70):
        for _layer, _rank in (("qkv", 8), ("plain", 24)):
            CASES.append(dict(dtype=_dt, T=_t, layer=_layer, rank=_rank, slots="runs"))
    for _t in (3, 70):
        CASES.append(dict(dtype=_dt, T=_t, layer="qkv", rank=24, slots="empty"))
        CASES.append(dict(dtype=_dt, T=_t, layer="plain", rank=8, slots="one"))
# Forced tiles: split-K shrinks (three splits of K = 64 in 32-wide tiles: the last is empty;
# of K = 100: ragged), and each variant at the other's token counts.
SPLIT_TOKEN = dict(shrink=(1, 4, 32, 3, 4))
SPLIT_BLOCK = dict(shrink=(16, 16, 32, 3, 4))
BLOCK_AT_3 = dict(shrink=(16, 16, 32, 1, 4), expand=(16, 16, 4))
TOKEN_AT_70 = dict(shrink=(1, 8, 32, 2, 4), expand=(1, 32, 4))
for _dt in ("float32", "float16"):
    CASES += [dict(dtype=_dt, T=3, layer="qkv", rank=24, slots="random", config=SPLIT_TOKEN),
              dict(dtype=_dt, T=70, layer="plain", rank=8, slots="runs", config=SPLIT_BLOCK),
              dict(dtype=_dt, T=3, layer="plain", rank=24, slots="random", config=BLOCK_AT_3)]
CASES.append(dict(dtype="float16", T=70, layer="qkv", rank=8, slots="random",
                  config=TOKEN_AT_70))
_NAMES = {id(SPLIT_TOKEN): "split_token", id(SPLIT_BLOCK): "split_block",
          id(BLOCK_AT_3): "block", id(TOKEN_AT_70): "token"}
for _c in CASES:
    _c["name"] = f"{_c['dtype']}_t{_c['T']}_{_c['layer']}_r{_c['rank']}_{_c['slots']}"
    if "config" in _c:
        _c["name"] += "_" + _NAMES[id(_c["config"])]


def lora_shrink_reference(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """out[t] = a[slot[t]] @ x[t] in fp32, 0 for slot -1."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] = a[s].float() @ x[t].float()
    return out


def lora_expand_reference(buf: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                          y: torch.Tensor, slice_sizes: tuple[int, ...], rank: int
                          ) -> torch.Tensor:
    """A new y: per token and slice, y += b[slot][slice rows] @ buf[slice's rank columns] in
    fp32, rounded once to y's dtype; tokens with slot -1 unchanged."""
    y = y.clone()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        off = 0
        for j, size in enumerate(slice_sizes):
            delta = b[s, off:off + size].float() @ buf[t, j * rank:(j + 1) * rank]
            y[t, off:off + size] = (y[t, off:off + size].float() + delta).to(y.dtype)
            off += size
    return y


def _slots(kind: str, t: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randint(-1, SLOTS, (t,), generator=gen, dtype=torch.int32)
    if kind == "empty":
        return torch.full((t,), -1, dtype=torch.int32)
    if kind == "one":
        return torch.full((t,), 2, dtype=torch.int32)
    # runs: cut points at fractions of t that fall inside blocks; one run has no adapter
    cuts = [0, *(int(t * f) for f in (0.3, 0.4, 0.85)), t]
    slots = torch.empty(t, dtype=torch.int32)
    for (lo, hi), s in zip(zip(cuts, cuts[1:]), (1, -1, 3, 0)):
        slots[lo:hi] = s
    return slots


def _run(case: dict) -> dict:
    import zlib

    from folio.model.kernels.lora import lora_expand, lora_shrink

    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    dtype = getattr(torch, case["dtype"])
    t, rank = case["T"], case["rank"]
    k, slices = LAYERS[case["layer"]]["K"], LAYERS[case["layer"]]["slices"]
    r, n = len(slices) * rank, sum(slices)
    slots = _slots(case["slots"], t, gen)
    none = slots < 0
    # A strided row view, as a slice of a wider activation would be.
    x = torch.randn(t, k + 8, generator=gen).to(dtype)[:, 3:k + 3]
    a = (torch.randn(SLOTS, r, k, generator=gen) * k ** -0.5).to(dtype)
    b = (torch.randn(SLOTS, n, rank, generator=gen) * rank ** -0.5).to(dtype)
    y0 = torch.randn(t, n, generator=gen).to(dtype)
    checks: dict[str, tuple[float, bool]] = {}

    config = case.get("config", {})
    out = torch.full((t, r), float("nan"))
    lora_shrink(x, a, slots, out, _config=config.get("shrink"))
    want = lora_shrink_reference(x, a, slots)
    checks["shrink"] = (rel_err(out, want) if want.any() else 0.0,
                        bool(torch.isfinite(out).all()))
    checks["shrink_none_zero"] = (0.0, bool((out[none] == 0).all()))

    # expand on shrink's own output, as the layer chains them
    y = y0.clone()
    lora_expand(out, b, slots, y, slices, rank, _config=config.get("expand"))
    want_y = lora_expand_reference(want, b, slots, y0, slices, rank)
    changed = ~none
    checks["expand"] = (rel_err(y[changed], want_y[changed]) if changed.any() else 0.0,
                        bool(torch.isfinite(y).all()))
    checks["expand_none_untouched"] = (0.0, bool(torch.equal(y[none], y0[none])))
    if "shrink" in config and config["shrink"][3] > 1:
        again = torch.full((t, r), float("nan"))
        lora_shrink(x, a, slots, again, _config=config["shrink"])
        # the ticket counters were reset, and the split order fixes the bits
        checks["split_deterministic"] = (0.0, bool(torch.equal(again, out)))
    return {"name": case["name"], "checks": checks}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_lora_kernels_match_per_token_loop(results: dict, case: dict) -> None:
    res = results.get(case["name"])
    assert res is not None, f"no result; child stderr:\n{results['_stderr']}"
    assert "error" not in res, res.get("error")
    # fp16: the same products in fp32 as the reference, in another order, then one rounding
    tol = 1e-5 if case["dtype"] == "float32" else 1e-3
    for label, (err, ok) in res["checks"].items():
        assert ok, f"{label}: failed (unwritten/NaN elements, or the property does not hold)"
        assert err < tol, f"{label}: rel err {err:.2e} >= {tol}"


def test_wrong_shapes_are_refused() -> None:
    pytest.importorskip("triton")
    from folio.model.kernels.lora import lora_expand, lora_shrink
    x = torch.zeros(3, 64)
    slots = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        lora_shrink(x, torch.zeros(2, 16, 64), slots.long(), torch.zeros(3, 16))
    with pytest.raises(ValueError, match="float32"):
        lora_shrink(x, torch.zeros(2, 16, 64), slots, torch.zeros(3, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="b \\[S, 96, 8\\]"):
        lora_expand(torch.zeros(3, 24), torch.zeros(2, 96, 16), slots, torch.zeros(3, 96),
                    (64, 16, 16), 8)


if __name__ == "__main__":
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    child_main(CASES, _run)
