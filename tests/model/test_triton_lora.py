"""Batched multi-LoRA kernels (folio/model/kernels/lora.py) against plain per-token torch
loops, under the interpreter (fp32 and fp16: the interpreter's bf16 arithmetic is wrong).

Each case runs some of three paths on the same inputs:
- "pair": lora_shrink then lora_expand in flat-batch order. T in {1, 3, 16} takes the
  per-token variant, {17, 40, 70} the block one (16-row blocks under the interpreter).
- "sorted": the same with token_order, through a LoRABatch on the CPU set first with a longer
  step (its leftovers must be reset) and then with the case's slots but the last two tokens,
  so the kernels also see padded rows (slot -1, at the end of the order) as a CUDA graph's
  padded batch holds them. Blocks then straddle slot boundaries of the sorted order.
- "fused": lora_shrink_expand, one launch (32-column tiles, so the slices' tiles are ragged).
- "dense": lora_expand with u_slot_stride, reading each token's own slot's columns of a
  dense x @ A_all^T in x's dtype that sits, as a base GEMM against [W; A_all] leaves it,
  to the right of y in one wider row (so y and buf are both strided views); in flat order
  at 3 tokens (per-token) and slot-sorted at 40 (blocks).
- "ride": a Linear whose LoRAProjection rides its weight (ride_on: [W; A_all] one tensor, the
  weight and A views of it) against the same Linear with the projection's torch path; then
  untie (the torch path, the same values) and retie (the views share storage again).
A few cases force tiles: a split over K (ticket reduction, run twice: the same bits), each
variant of the pair at the other's token counts, the sorted block variant at 3 tokens, and
fused splits over K (ragged; with an empty last split, at 9 tokens and 64-column tiles).

Slot patterns: every token a random slot including -1 (mixed blocks), long runs of one slot
crossing block boundaries (uniform and straddling blocks, a run of -1), one slot for all, and
no adapter at all. Layers: a merged one with three unequal slices and a plain one, at rank 24
(not a power of two) and 8; K and N are ragged against the interpreter's tiles. shrink's out
is poisoned with NaN first, so unwritten elements show; tokens with slot -1 must get exact
zeros from shrink and keep y bit for bit through expand and the fused kernel.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from interpreter_harness import child_main, interpreter_results, rel_err

SLOTS = 4
LAYERS = {"qkv": dict(K=64, slices=(64, 24, 16)), "plain": dict(K=100, slices=(40,))}
PAIR_FUSED = ("pair", "fused")
PAIR_SORTED = ("pair", "sorted")

CASES: list[dict[str, Any]] = []
for _dt in ("float32", "float16"):
    for _t in (1, 3):
        for _layer, _rank in (("qkv", 24), ("plain", 8)):
            CASES.append(dict(dtype=_dt, T=_t, layer=_layer, rank=_rank, slots="random",
                              paths=PAIR_FUSED))
    CASES.append(dict(dtype=_dt, T=16, layer="qkv", rank=8, slots="random", paths=PAIR_FUSED))
    for _t in (3, 40):
        for _layer, _rank in (("qkv", 24), ("plain", 8)):
            CASES.append(dict(dtype=_dt, T=_t, layer=_layer, rank=_rank, slots="random",
                              paths=("dense",), name_suffix="_dense"))
    for _t in (3, 40):
        CASES.append(dict(dtype=_dt, T=_t, layer="qkv", rank=8, slots="random",
                          paths=("ride",), name_suffix="_ride"))
    for _t in (17, 40):
        for _layer, _rank in (("qkv", 24), ("plain", 8)):
            CASES.append(dict(dtype=_dt, T=_t, layer=_layer, rank=_rank, slots="random",
                              paths=PAIR_SORTED))
    for _t in (17, 70):
        for _layer, _rank in (("qkv", 8), ("plain", 24)):
            CASES.append(dict(dtype=_dt, T=_t, layer=_layer, rank=_rank, slots="runs",
                              paths=PAIR_SORTED))
    CASES += [dict(dtype=_dt, T=3, layer="qkv", rank=24, slots="empty", paths=PAIR_FUSED),
              dict(dtype=_dt, T=40, layer="qkv", rank=24, slots="empty", paths=PAIR_SORTED),
              dict(dtype=_dt, T=3, layer="plain", rank=8, slots="one", paths=PAIR_FUSED),
              dict(dtype=_dt, T=70, layer="plain", rank=8, slots="one", paths=PAIR_SORTED)]
# Forced tiles: split-K shrinks (three splits of K = 64 in 32-wide tiles: the last is empty;
# of K = 100: ragged), each variant at the other's token counts, and fused splits (K = 100 in
# 16-wide tiles: 7 tiles in splits of 3, 3 and 1; K = 64 in 32-wide ones: 1, 1 and none).
SPLIT_TOKEN = dict(shrink=(1, 4, 32, 3, 4))
SPLIT_BLOCK = dict(shrink=(16, 16, 32, 3, 4))
BLOCK_AT_3 = dict(shrink=(16, 16, 32, 1, 4), expand=(16, 16, 4))
TOKEN_AT_70 = dict(shrink=(1, 8, 32, 2, 4), expand=(1, 32, 4))
FUSED_SPLIT = dict(fused=(32, 16, 3, 4))
FUSED_WIDE = dict(fused=(64, 32, 3, 4))
for _dt in ("float32", "float16"):
    CASES += [dict(dtype=_dt, T=3, layer="qkv", rank=24, slots="random", paths=("pair",),
                   config=SPLIT_TOKEN),
              dict(dtype=_dt, T=70, layer="plain", rank=8, slots="runs", paths=PAIR_SORTED,
                   config=SPLIT_BLOCK),
              dict(dtype=_dt, T=3, layer="plain", rank=24, slots="random", paths=PAIR_SORTED,
                   config=BLOCK_AT_3),
              dict(dtype=_dt, T=3, layer="plain", rank=24, slots="random", paths=("fused",),
                   config=FUSED_SPLIT)]
CASES += [dict(dtype="float16", T=70, layer="qkv", rank=8, slots="random", paths=("pair",),
               config=TOKEN_AT_70),
          dict(dtype="float32", T=9, layer="qkv", rank=8, slots="random", paths=("fused",),
               config=FUSED_WIDE)]
_NAMES = {id(SPLIT_TOKEN): "split_token", id(SPLIT_BLOCK): "split_block",
          id(BLOCK_AT_3): "block", id(TOKEN_AT_70): "token", id(FUSED_SPLIT): "fused_split",
          id(FUSED_WIDE): "fused_wide"}
for _c in CASES:
    _c["name"] = f"{_c['dtype']}_t{_c['T']}_{_c['layer']}_r{_c['rank']}_{_c['slots']}"
    if "config" in _c:
        _c["name"] += "_" + _NAMES[id(_c["config"])]
    _c["name"] += _c.pop("name_suffix", "")


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


def _sorted_maps(slots: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_slots, token_order) [T] as a LoRABatch holds them for a step of the first T - 2
    tokens of `slots` (the last two: padding), after a longer step."""
    from folio.model.lora.projection import LoRABatch
    t = len(slots)
    batch = LoRABatch(t + 8, torch.device("cpu"))
    batch.set(torch.randint(-1, SLOTS, (t + 5,), generator=gen, dtype=torch.int32).numpy())
    batch.set(slots[:max(t - 2, 0)].numpy())
    return batch.token_slots[:t], batch.token_order[:t]


def _check_update(checks: dict, label: str, y: torch.Tensor, want: torch.Tensor,
                  y0: torch.Tensor, none: torch.Tensor) -> None:
    changed = ~none
    checks[label] = (rel_err(y[changed], want[changed]) if changed.any() else 0.0,
                     bool(torch.isfinite(y).all()))
    checks[label + "_none_untouched"] = (0.0, bool(torch.equal(y[none], y0[none])))


def _pair(checks: dict, label: str, x, a, b, y0, slots, slices, rank, config: dict,
          order: torch.Tensor | None) -> None:
    from folio.model.kernels.lora import lora_expand, lora_shrink
    t, r = x.shape[0], a.shape[1]
    none = slots < 0
    out = torch.full((t, r), float("nan"))
    lora_shrink(x, a, slots, out, token_order=order, _config=config.get("shrink"))
    want = lora_shrink_reference(x, a, slots)
    checks[label + "_shrink"] = (rel_err(out, want) if want.any() else 0.0,
                                 bool(torch.isfinite(out).all()))
    checks[label + "_shrink_none_zero"] = (0.0, bool((out[none] == 0).all()))
    # expand on shrink's own output, as the layer chains them
    y = y0.clone()
    lora_expand(out, b, slots, y, slices, rank, token_order=order,
                _config=config.get("expand"))
    _check_update(checks, label + "_expand", y,
                  lora_expand_reference(want, b, slots, y0, slices, rank), y0, none)
    if "shrink" in config and config["shrink"][3] > 1:
        again = torch.full((t, r), float("nan"))
        lora_shrink(x, a, slots, again, token_order=order, _config=config["shrink"])
        # the ticket counters were reset, and the split order fixes the bits
        checks[label + "_split_deterministic"] = (0.0, bool(torch.equal(again, out)))


def _fused(checks: dict, x, a, b, y0, slots, slices, rank, config: dict) -> None:
    from folio.model.kernels.lora import lora_shrink_expand
    y = y0.clone()
    lora_shrink_expand(x, a, b, slots, y, slices, rank, _config=config.get("fused"))
    want = lora_expand_reference(lora_shrink_reference(x, a, slots), b, slots, y0, slices,
                                 rank)
    _check_update(checks, "fused", y, want, y0, slots < 0)
    if "fused" in config and config["fused"][2] > 1:
        again = y0.clone()
        lora_shrink_expand(x, a, b, slots, again, slices, rank, _config=config["fused"])
        checks["fused_split_deterministic"] = (0.0, bool(torch.equal(again, y)))


def _dense(checks: dict, x, a, b, y0, slots, slices, rank, order) -> None:
    from folio.model.kernels.lora import lora_expand
    t, r, n = x.shape[0], a.shape[1], y0.shape[1]
    u_all = (x.float() @ a.reshape(-1, a.shape[2]).float().t()).to(x.dtype)
    row = torch.cat([y0, u_all], dim=1)
    y, buf = row[:, :n], row[:, n:]
    lora_expand(buf, b, slots, y, slices, rank, token_order=order, u_slot_stride=r)
    own = torch.stack([u_all[i, max(s, 0) * r:(max(s, 0) + 1) * r] for i, s in
                       enumerate(slots.tolist())]).float()
    _check_update(checks, "dense", y, lora_expand_reference(own, b, slots, y0, slices, rank),
                  y0, slots < 0)
    checks["dense_buf_untouched"] = (0.0, bool(torch.equal(buf, u_all)))


def _ride(checks: dict, x, a, b, slots, slices, rank, gen) -> None:
    """A Linear riding its LoRA (one product against [W; A_all], then the expand) against
    the projection's torch path on the same weights; untie and retie keep the values."""
    from folio.model.kernel_config import KernelConfig
    from folio.model.layers import Linear
    from folio.model.lora.projection import LoRABatch, LoRAProjection
    t, k = x.shape
    n = sum(slices)
    dtype = x.dtype
    linear = Linear(k, n, bias=False, dtype=dtype, kernels=KernelConfig())
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen).to(dtype) * k ** -0.5)
    batch = LoRABatch(t + 4, torch.device("cpu"))
    lora = LoRAProjection(k, slices, SLOTS, rank, dtype, torch.device("cpu"), batch,
                          KernelConfig())
    offsets = np.cumsum((0,) + slices[:-1])
    for slot in range(SLOTS):
        for j, (off, size) in enumerate(zip(offsets, slices)):
            # scaling 1: the CPU projection keeps B unscaled, the riding expand reads it as is
            lora.load_slice(slot, j, a[slot, j * rank:(j + 1) * rank],
                            b[slot, off:off + size], 1.0)
    linear.lora = lora
    batch.set(slots.numpy())
    torch_path = linear(x)                      # not riding: the projection's torch path
    weight_before = linear.weight.detach().clone()
    lora.ride_on(linear)
    checks["ride_weight_kept"] = (0.0, bool(torch.equal(linear.weight, weight_before)))
    checks["ride_views_share"] = (0.0, linear.weight.data_ptr() == lora.weight_cat.data_ptr()
                                  and lora.a.data_ptr() == lora.weight_cat[n:].data_ptr())
    riding = linear(x)
    checks["ride"] = (rel_err(riding, torch_path), bool(torch.isfinite(riding).all()))
    lora.untie()
    checks["ride_untied"] = (rel_err(linear(x), torch_path), True)
    lora.retie(linear)
    checks["ride_retied"] = (0.0, lora.weight_cat is not None
                             and linear.weight.data_ptr() == lora.weight_cat.data_ptr()
                             and bool(torch.equal(linear(x), riding)))


def _run(case: dict) -> dict:
    import zlib

    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    dtype = getattr(torch, case["dtype"])
    t, rank = case["T"], case["rank"]
    k, slices = LAYERS[case["layer"]]["K"], LAYERS[case["layer"]]["slices"]
    r, n = len(slices) * rank, sum(slices)
    slots = _slots(case["slots"], t, gen)
    # A strided row view, as a slice of a wider activation would be.
    x = torch.randn(t, k + 8, generator=gen).to(dtype)[:, 3:k + 3]
    a = (torch.randn(SLOTS, r, k, generator=gen) * k ** -0.5).to(dtype)
    b = (torch.randn(SLOTS, n, rank, generator=gen) * rank ** -0.5).to(dtype)
    y0 = torch.randn(t, n, generator=gen).to(dtype)
    config = case.get("config", {})
    checks: dict[str, tuple[float, bool]] = {}
    if "pair" in case["paths"]:
        _pair(checks, "pair", x, a, b, y0, slots, slices, rank, config, None)
    if "sorted" in case["paths"]:
        sorted_slots, order = _sorted_maps(slots, gen)
        _pair(checks, "sorted", x, a, b, y0, sorted_slots, slices, rank, config, order)
    if "fused" in case["paths"]:
        _fused(checks, x, a, b, y0, slots, slices, rank, config)
    if "ride" in case["paths"]:
        _ride(checks, x.contiguous(), a, b, slots, slices, rank, gen)
    if "dense" in case["paths"]:
        if t > 16:
            dense_slots, order = _sorted_maps(slots, gen)
        else:
            dense_slots, order = slots, None
        _dense(checks, x, a, b, y0, dense_slots, slices, rank, order)
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


def test_lora_batch_orders_tokens_by_slot() -> None:
    """token_order: a stable sort by slot, tokens without adapter after the others, then the
    rows past the step in order (a shorter step resets a longer one's); token_slots -1 past
    the step; the torch path's groups as before."""
    from folio.model.lora.projection import LoRABatch
    batch = LoRABatch(10, torch.device("cpu"))
    assert batch.token_order.tolist() == list(range(10))
    batch.set(np.array([3, -1, 0, 3, 0, 1, -1, 2], dtype=np.int32))
    assert batch.token_order.dtype == torch.int32
    assert batch.token_order.tolist() == [2, 4, 5, 7, 0, 3, 1, 6, 8, 9]
    assert batch.token_slots.tolist() == [3, -1, 0, 3, 0, 1, -1, 2, -1, -1]
    assert batch.active
    batch.set(np.array([-1, 1, 1], dtype=np.int32))
    assert batch.token_order.tolist() == [1, 2, 0, 3, 4, 5, 6, 7, 8, 9]
    assert batch.token_slots.tolist() == [-1, 1, 1] + [-1] * 7
    assert batch.groups == [(1, slice(1, 3))]
    batch.set(np.zeros(0, dtype=np.int32))
    assert batch.token_order.tolist() == list(range(10))
    assert batch.token_slots.tolist() == [-1] * 10
    assert not batch.active


def test_wrong_shapes_are_refused() -> None:
    pytest.importorskip("triton")
    from folio.model.kernels.lora import lora_expand, lora_shrink, lora_shrink_expand
    x = torch.zeros(3, 64)
    slots = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        lora_shrink(x, torch.zeros(2, 16, 64), slots.long(), torch.zeros(3, 16))
    with pytest.raises(ValueError, match="token_order"):
        lora_shrink(x, torch.zeros(2, 16, 64), slots, torch.zeros(3, 16),
                    token_order=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="float32"):
        lora_shrink(x, torch.zeros(2, 16, 64), slots, torch.zeros(3, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="b \\[S, 96, 8\\]"):
        lora_expand(torch.zeros(3, 24), torch.zeros(2, 96, 16), slots, torch.zeros(3, 96),
                    (64, 16, 16), 8)
    with pytest.raises(ValueError, match="u_slot_stride"):
        lora_expand(torch.zeros(3, 48), torch.zeros(2, 96, 8), slots, torch.zeros(3, 96),
                    (64, 16, 16), 8, u_slot_stride=16)
    with pytest.raises(ValueError, match=">= 48"):
        lora_expand(torch.zeros(3, 40), torch.zeros(2, 96, 8), slots, torch.zeros(3, 96),
                    (64, 16, 16), 8, u_slot_stride=24)
    with pytest.raises(ValueError, match="a \\[S, 24, K\\]"):
        lora_shrink_expand(x, torch.zeros(2, 16, 64), torch.zeros(2, 96, 8), slots,
                           torch.zeros(3, 96), (64, 16, 16), 8)


if __name__ == "__main__":
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    child_main(CASES, _run)
