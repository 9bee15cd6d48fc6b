"""Batched multi-LoRA shrink / expand (folio/model/kernels/lora.py) on a CUDA GPU, bf16 at
Llama-3-8B's shapes: qkv 4096 -> 6144 in slices 4096/1024/1024 at rank 16 and the down
projection 14336 -> 4096 at rank 24 (not a power of two), 8 adapter slots, 1 to 4096 tokens
(both the per-token and the block variant), against a reference in float64. Also: tokens
with slot -1 keep y bit for bit, PDL gives the same bits, and the pair replays from a CUDA
graph with token_slots rewritten in place between replays. Skipped without a GPU; run
through the device tool.
"""
from __future__ import annotations

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


@pytest.mark.parametrize("kind", ["random", "runs"])
@pytest.mark.parametrize("t", [1, 8, 64, 512, 4096])
@pytest.mark.parametrize("layer", ["qkv", "down"])
def test_shrink_expand_match_reference(layer: str, t: int, kind: str) -> None:
    from folio.model.kernels.lora import lora_expand, lora_shrink
    x, a, b, y0, slots, slices, rank = _inputs(layer, t, kind)
    want_out, want_y = _reference(x, a, b, slots, y0, slices, rank)
    none = slots < 0
    out = torch.full((t, a.shape[1]), float("nan"), device=CUDA)
    lora_shrink(x, a, slots, out)
    assert torch.isfinite(out).all()
    assert (out[none] == 0).all()
    if (~none).any():
        # bf16 products are exact; the tensor cores' fp32 accumulation is not quite IEEE
        assert _rel(out[~none], want_out[~none]) < 1e-4
    y = y0.clone()
    lora_expand(want_out.float(), b, slots, y, slices, rank)
    assert torch.equal(y[none], y0[none])
    if (~none).any():
        # the same fp32 sum up to order, then one rounding: bf16 ties may flip by an ulp
        assert _rel(y[~none], want_y[~none]) < 1e-3
        assert (y[~none].float() - want_y[~none].float()).abs().max() \
            <= 2 * torch.finfo(torch.bfloat16).eps * want_y[~none].float().abs().max()
    # PDL changes when the kernels start, not what they compute
    out_pdl = torch.empty_like(out)
    lora_shrink(x, a, slots, out_pdl, pdl=True)
    y_pdl = y0.clone()
    lora_expand(want_out.float(), b, slots, y_pdl, slices, rank, pdl=True)
    assert torch.equal(out_pdl, out) and torch.equal(y_pdl, y)


@pytest.mark.parametrize("t", [8, 512])
def test_graph_replay_reads_slots_in_place(t: int) -> None:
    """Captured once; each replay follows token_slots as rewritten in place, all -1 included."""
    from folio.model.kernels.lora import lora_expand, lora_shrink
    x, a, b, y0, slots, slices, rank = _inputs("qkv", t, "random")
    static_slots = slots.clone()
    out = torch.empty(t, a.shape[1], device=CUDA)
    y = y0.clone()

    def step() -> None:
        y.copy_(y0)
        lora_shrink(x, a, static_slots, out)
        lora_expand(out, b, static_slots, y, slices, rank)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(t)
    for kind in ("runs", "random", "empty"):
        new = _slots(kind, t, gen) if kind != "empty" \
            else torch.full((t,), -1, dtype=torch.int32, device=CUDA)
        static_slots.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want_out, want_y = _reference(x, a, b, new, y0, slices, rank)
        none = new < 0
        assert (out[none] == 0).all() and torch.equal(y[none], y0[none]), kind
        if (~none).any():
            assert _rel(out[~none], want_out[~none]) < 1e-4, kind
            assert _rel(y[~none], want_y[~none]) < 1e-3, kind
