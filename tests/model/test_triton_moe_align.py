"""The one-launch MoE block alignment (folio/model/kernels/moe_align.py) against the torch
form, under the interpreter: the same padded rows and block experts, exactly, for routes that
are random, skewed (one expert spanning several blocks) and sparse, up to MAX_PAIRS pairs."""
from __future__ import annotations

import pytest
from interpreter_harness import child_main, interpreter_results

CASES = [dict(name=f"t{t}_k{k}_e{e}_bm{bm}_{routes}", T=t, k=k, E=e, BM=bm, routes=routes)
         for t, k, e, bm in [(1, 8, 128, 16), (1, 2, 4, 16), (3, 6, 64, 16), (21, 2, 8, 4),
                             (32, 8, 128, 16), (13, 2, 5, 32)]
         for routes in ("random", "skewed", "sparse")]


def _run(case: dict) -> dict:
    import torch

    from folio.model.kernels.moe_align import align_small
    from folio.model.moe import dispatch
    from moe_reference import make_routes

    gen = torch.Generator().manual_seed(case["T"] * 31 + case["E"])
    ids = make_routes(case["routes"], case["T"], case["k"], case["E"], gen)
    flat = ids.reshape(-1).to(torch.int64)
    rows = dispatch.max_padded_rows(flat.numel(), case["E"], case["BM"])
    got_pairs, got_blocks = align_small(flat, case["E"], case["BM"], rows)
    # the torch form: forced by going over the kernel's pair limit's check
    dispatch_max, dispatch.MAX_PAIRS = dispatch.MAX_PAIRS, -1
    try:
        want = dispatch.align_to_blocks(ids, case["E"], case["BM"])
    finally:
        dispatch.MAX_PAIRS = dispatch_max
    return {"name": case["name"],
            "pairs_equal": got_pairs.tolist() == want.sorted_pairs.tolist(),
            "blocks_equal": got_blocks.tolist() == want.block_expert.tolist(),
            "used_blocks": int((want.block_expert >= 0).sum())}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_one_launch_alignment_equals_torch(results: dict, case: dict) -> None:
    res = results.get(case["name"])
    assert res is not None, f"no result; child stderr:\n{results['_stderr']}"
    assert "error" not in res, res.get("error")
    assert res["used_blocks"] > 0
    assert res["pairs_equal"] and res["blocks_equal"]


def test_more_pairs_than_the_kernel_takes_are_refused() -> None:
    torch = pytest.importorskip("torch")
    from folio.model.kernels.moe_align import MAX_PAIRS, align_small
    with pytest.raises(ValueError, match="at most"):
        align_small(torch.zeros(MAX_PAIRS + 1, dtype=torch.int64), 8, 16, 1024)


if __name__ == "__main__":
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    child_main(CASES, _run)
