"""Batched multi-LoRA kernels (folio/model/kernels/lora.py) on a CUDA GPU, bf16 at
Llama-3-8B's shapes: qkv 4096 -> 6144 in slices 4096/1024/1024 at rank 16 and the down
projection 14336 -> 4096 at rank 24 (not a power of two), 8 adapter slots, against a reference
in float64:
- lora_shrink + lora_expand at 1 to 4096 tokens (per-token and block variants), in flat-batch
  order and slot-sorted (token_order from a LoRABatch);
- lora_shrink_expand at 1 to 9 tokens (split over K, the down projection into 14 splits);
- tokens with slot -1 keep y bit for bit, PDL (weights read before the wait) gives the same
  bits, the split reductions give the same bits twice;
- a LoRAProjection's calls (fused at few tokens, sorted pair beyond) replay from a CUDA graph
  with the LoRABatch rewritten in place between replays, padded rows included.
Skipped without a GPU; run through the device tool.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
SLOTS = 8
LAYERS = {"qkv": (4096, (4096, 1024, 1024), 16), "down": (14336, (4096,), 24)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _slots(kind: str, t: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":   # decode-like: each token its own request, some without adapter
        slots = torch.randint(-1, SLOTS, (t,), generator=gen)
    else:                  # prefill-like: requests of random lengths, one slot each
        cuts = sorted(torch.randint(0, t + 1, (5,), generator=gen).tolist())
        slots = torch.empty(t, dtype=torch.int64)
        for lo, hi, s in zip([0, *cuts], [*cuts, t], (3, -1, 0, 7, 5, 1)):
            slots[lo:hi] = s
    return slots.to(torch.int32).to(CUDA)


def _reference(x, a, b, slots, y, slices, rank):
    """(shrink out fp32, expanded y): per slot, its tokens at once, in float64."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64, device=CUDA)
    y_new = y.clone()
    for s in range(a.shape[0]):
        rows = (slots == s).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        out[rows] = x[rows].double() @ a[s].double().t()
        off, deltas = 0, []
        for j, size in enumerate(slices):
            deltas.append(out[rows, j * rank:(j + 1) * rank] @ b[s, off:off + size].double().t())
            off += size
        y_new[rows] = (y[rows].double() + torch.cat(deltas, dim=1)).to(y.dtype)
    return out, y_new


def _inputs(layer: str, t: int, kind: str):
    k, slices, rank = LAYERS[layer]
    gen = torch.Generator().manual_seed(t * 7 + len(kind))
    n = sum(slices)
    x = torch.randn(t, k, device=CUDA, dtype=torch.bfloat16)
    a = (torch.randn(SLOTS, len(slices) * rank, k, device=CUDA) * k ** -0.5).to(torch.bfloat16)
    b = (torch.randn(SLOTS, n, rank, device=CUDA) * rank ** -0.5).to(torch.bfloat16)
    y = torch.randn(t, n, device=CUDA, dtype=torch.bfloat16)
    return x, a, b, y, _slots(kind, t, gen), slices, rank


def _maps(slots: torch.Tensor, order: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token_slots, token_order or None): "flat" passes none, "sorted" a LoRABatch's."""
    if order == "flat":
        return slots, None
    from folio.model.lora.projection import LoRABatch
    batch = LoRABatch(len(slots), CUDA)
    batch.set(slots.cpu().numpy())
    return batch.token_slots, batch.token_order


def _assert_update(y: torch.Tensor, want_y: torch.Tensor, y0: torch.Tensor,
                   none: torch.Tensor) -> None:
    assert torch.equal(y[none], y0[none])
    if (~none).any():
        # the same fp32 sum up to order, then one rounding: bf16 ties may flip by an ulp
        assert _rel(y[~none], want_y[~none]) < 1e-3
        assert (y[~none].float() - want_y[~none].float()).abs().max() \
            <= 2 * torch.finfo(torch.bfloat16).eps * want_y[~none].float().abs().max()


@pytest.mark.parametrize("order", ["flat", "sorted"])
@pytest.mark.parametrize("kind", ["random", "runs"])
@pytest.mark.parametrize("t", [1, 8, 64, 512, 4096])
@pytest.mark.parametrize("layer", ["qkv", "down"])
def test_shrink_expand_match_reference(layer: str, t: int, kind: str, order: str) -> None:
    from folio.model.kernels.lora import lora_expand, lora_shrink
    x, a, b, y0, slots, slices, rank = _inputs(layer, t, kind)
    slots, token_order = _maps(slots, order)
    want_out, want_y = _reference(x, a, b, slots, y0, slices, rank)
    none = slots < 0
    out = torch.full((t, a.shape[1]), float("nan"), device=CUDA)
    lora_shrink(x, a, slots, out, token_order=token_order)
    assert torch.isfinite(out).all()
    assert (out[none] == 0).all()
    if (~none).any():
        # bf16 products are exact; the tensor cores' fp32 accumulation is not quite IEEE
        assert _rel(out[~none], want_out[~none]) < 1e-4
    y = y0.clone()
    lora_expand(want_out.float(), b, slots, y, slices, rank, token_order=token_order)
    _assert_update(y, want_y, y0, none)
    # PDL changes when the kernels start, not what they compute
    out_pdl = torch.empty_like(out)
    lora_shrink(x, a, slots, out_pdl, token_order=token_order, pdl=True)
    y_pdl = y0.clone()
    lora_expand(want_out.float(), b, slots, y_pdl, slices, rank, token_order=token_order,
                pdl=True)
    assert torch.equal(out_pdl, out) and torch.equal(y_pdl, y)


@pytest.mark.parametrize("kind", ["random", "runs"])
@pytest.mark.parametrize("t", [1, 2, 4, 9])
@pytest.mark.parametrize("layer", ["qkv", "down"])
def test_fused_matches_reference(layer: str, t: int, kind: str) -> None:
    from folio.model.kernels.lora import lora_shrink_expand
    x, a, b, y0, slots, slices, rank = _inputs(layer, t, kind)
    _, want_y = _reference(x, a, b, slots, y0, slices, rank)
    y = y0.clone()
    lora_shrink_expand(x, a, b, slots, y, slices, rank)
    _assert_update(y, want_y, y0, slots < 0)
    # the split-K tickets fix the order of the sums; PDL only when the kernel starts
    for pdl in (False, True):
        again = y0.clone()
        lora_shrink_expand(x, a, b, slots, again, slices, rank, pdl=pdl)
        assert torch.equal(again, y), pdl


@pytest.mark.parametrize("t", [2, 8, 64, 512])
def test_graph_replay_reads_batch_in_place(t: int) -> None:
    """A LoRAProjection's kernels (fused at few tokens, the sorted pair beyond; PDL on) are
    captured once, with no adapter in the batch, as the decode graphs are; each replay follows
    the LoRABatch as set() rewrites it in place: other slots, all -1, and fewer tokens than
    the graph's (padded rows: slot -1)."""
    from folio.model.kernel_config import KernelConfig
    from folio.model.lora.projection import LoRABatch, LoRAProjection
    x, a, b, y0, _, slices, rank = _inputs("qkv", t, "random")
    batch = LoRABatch(4096, CUDA)
    proj = LoRAProjection(x.shape[1], slices, SLOTS, rank, torch.bfloat16, CUDA, batch,
                          KernelConfig())
    proj.a.copy_(a)
    proj.b.copy_(b)
    y = y0.clone()

    def step() -> None:
        y.copy_(y0)
        proj(x, y)

    batch.set(np.zeros(0, dtype=np.int32))
    batch.force = True
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    batch.force = False
    gen = torch.Generator().manual_seed(t)
    for kind, n in (("runs", t), ("random", t), ("empty", t), ("random", t - 1)):
        new = _slots(kind, n, gen) if kind != "empty" \
            else torch.full((n,), -1, dtype=torch.int32, device=CUDA)
        batch.set(new.cpu().numpy())
        graph.replay()
        torch.cuda.synchronize()
        slots = batch.token_slots[:t]
        _, want_y = _reference(x, a, b, slots, y0, slices, rank)
        none = slots < 0
        assert torch.equal(y[none], y0[none]), (kind, n)
        if (~none).any():
            assert _rel(y[~none], want_y[~none]) < 1e-3, (kind, n)


@pytest.mark.parametrize("kind", ["random", "runs"])
@pytest.mark.parametrize("t", [1, 8, 64, 512])
def test_riding_linear_matches_reference(t: int, kind: str) -> None:
    """A Linear whose adapters ride its weight (one product against [W; A_all], then the
    expand reading each token's own slot's columns): the same as the base product plus the
    reference delta up to the bf16 rounding of the shrink (the GEMM's output dtype), tokens
    without adapter exactly the base product; captured in a CUDA graph and replayed after
    the batch changed in place, it follows the batch."""
    from folio.model.kernel_config import KernelConfig
    from folio.model.layers import Linear
    from folio.model.lora.projection import LoRABatch, LoRAProjection, can_ride
    x, a, b, _, slots, slices, rank = _inputs("qkv", t, kind)
    k, n = x.shape[1], sum(slices)
    linear = Linear(k, n, bias=False, device=CUDA, dtype=torch.bfloat16,
                    kernels=KernelConfig())
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, device=CUDA) * k ** -0.5)
    batch = LoRABatch(4096, CUDA)
    linear.lora = LoRAProjection(k, slices, SLOTS, rank, torch.bfloat16, CUDA, batch,
                                 KernelConfig())
    assert can_ride(linear, KernelConfig())
    assert not can_ride(linear, KernelConfig(lora="kernels"))
    linear.lora.ride_on(linear)
    linear.lora.a.copy_(a)
    linear.lora.b.copy_(b)
    base = torch.nn.functional.linear(x, linear.weight)

    def check(out: torch.Tensor, slots: torch.Tensor) -> None:
        none = slots < 0
        assert torch.equal(out[none], base[none])
        if (~none).any():
            _, want = _reference(x, a, b, slots, base, slices, rank)
            delta, want_delta = out[~none].double() - base[~none].double(), \
                want[~none].double() - base[~none].double()
            assert float((delta - want_delta).norm() / want_delta.norm()) < 2e-2

    batch.set(slots.cpu().numpy())
    check(linear(x), slots)
    out = torch.empty(t, n, device=CUDA, dtype=torch.bfloat16)
    batch.force = True
    out.copy_(linear(x))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(linear(x))
    batch.force = False
    gen = torch.Generator().manual_seed(t + 1)
    for new_kind in ("runs", "random"):
        new = _slots(new_kind, t, gen)
        batch.set(new.cpu().numpy())
        graph.replay()
        torch.cuda.synchronize()
        check(out, new)
