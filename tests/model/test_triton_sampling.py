"""The Gumbel-max sampling kernel (folio/model/kernels/sampling.py) under the interpreter.

Like the other kernel tests, the cases run in a child process with TRITON_INTERPRET=1 and
report one JSON line each. Checked:
  * greedy rows (T = 0) equal torch.argmax, planted ties included (lowest id wins), in batches
    that mix greedy and random rows and across several vocabulary chunks;
  * random rows follow softmax(logits / T): a chi-square test over thousands of draws (the
    seed is fixed, so the test is deterministic), for one chunk and for several, fp32 and fp16;
  * the same seed gives the same tokens, another seed other tokens;
  * the argmax-only form (`argmax_rows` on CUDA) equals torch.argmax: ties across chunks, a
    NaN (ranked above everything), a row of -inf, rows of one chunk and of several.
"""
from __future__ import annotations

import pytest
from interpreter_harness import child_main, interpreter_results

CASES = [
    dict(name="greedy_ties_multichunk_fp32", kind="greedy", dtype="float32", V=5000, rows=6),
    dict(name="greedy_mixed_with_random_fp16", kind="greedy", dtype="float16", V=1500, rows=5),
    # The interpreter runs one program per row (and per chunk) at ~17 ms each: draws are few
    # but enough to tell a wrong temperature or a misplaced chunk by far.
    dict(name="distribution_one_chunk_fp32_t07", kind="dist", dtype="float32", V=37,
         rows=1200, T=0.7),
    dict(name="distribution_one_chunk_fp16_t1", kind="dist", dtype="float16", V=50, rows=1000,
         T=1.0),
    dict(name="distribution_multichunk_fp32_t13", kind="dist", dtype="float32", V=4100,
         rows=200, T=1.3, peaked=True),
    dict(name="seeds", kind="seeds", dtype="float32", V=300, rows=64),
    dict(name="argmax_only_multichunk_fp32", kind="argmax", dtype="float32", V=5000, rows=5),
    dict(name="argmax_only_fp16", kind="argmax", dtype="float16", V=700, rows=3),
]


def _run(case: dict) -> dict:
    import torch

    from folio.model.kernels.sampling import _chunked_argmax, gumbel_sample, num_chunks_for

    dtype = getattr(torch, case["dtype"])
    gen = torch.Generator().manual_seed(len(case["name"]))
    V, rows = case["V"], case["rows"]
    out: dict = {"name": case["name"], "chunks": num_chunks_for(rows, V)}
    if case["kind"] == "greedy":
        logits = torch.randn(rows, V, generator=gen).to(dtype)
        # Ties: row 0's maximum twice (lowest id wins), row 1's across two chunks.
        logits[0, 10] = logits[0, 700] = 9.0
        logits[1, 1100] = logits[1, V - 1] = 9.0
        temps = [0.0 if i % 2 == 0 else 0.8 for i in range(rows)]
        temps[1] = 0.0
        got = gumbel_sample(logits, temps, seed=5)
        ref = logits.float().argmax(dim=-1)
        greedy_rows = [i for i, t in enumerate(temps) if t == 0.0]
        out["greedy_equal"] = bool((got[greedy_rows] == ref[greedy_rows]).all())
        out["row0"], out["row1"] = int(got[0]), int(got[1])
        out["in_range"] = bool(((got >= 0) & (got < V)).all())
    elif case["kind"] == "argmax":
        logits = torch.randn(rows, V, generator=gen).to(dtype)
        logits[0, 10] = logits[0, V - 3] = 9.0             # a tie across chunks
        logits[1, V // 2] = float("nan")                    # NaN ranks first, as in torch
        logits[2] = float("-inf")                           # nothing finite: id 0, as torch
        got = _chunked_argmax(logits, None, 0, argmax_only=True)
        out["equal"] = got.tolist() == logits.argmax(dim=-1).tolist()
        out["got"] = got.tolist()
    elif case["kind"] == "dist":
        base = torch.randn(V, generator=gen) * 1.5
        if case.get("peaked"):  # most mass on ids in the first and the last chunk
            base[3] = base.max() + 2.0
            base[V - 2] = base.max() + 0.5
        logits = base.to(dtype).expand(rows, V).contiguous()
        T = case["T"]
        got = gumbel_sample(logits, [T] * rows, seed=1234)
        probs = torch.softmax(logits[0].double() / T, dim=-1)
        counts = torch.bincount(got, minlength=V).double()
        expected = probs * rows
        # Pool the categories expected fewer than 5 times into one (chi-square validity).
        small = expected < 5
        obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
        exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
        keep = exp > 0
        out["chi2"] = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        out["dof"] = int(keep.sum()) - 1
        out["in_range"] = bool(((got >= 0) & (got < V)).all())
    else:
        logits = torch.randn(rows, V, generator=gen).to(dtype)
        a = gumbel_sample(logits, [1.0] * rows, seed=77)
        b = gumbel_sample(logits, [1.0] * rows, seed=77)
        c = gumbel_sample(logits, [1.0] * rows, seed=78)
        out["same_seed_equal"] = bool(torch.equal(a, b))
        out["other_seed_differs"] = int((a != c).sum())
    return out


def _chi2_limit(dof: int) -> float:
    """Upper 0.1% point of chi-square(dof), Wilson-Hilferty approximation."""
    z = 3.09
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_gumbel_kernel(results: dict, case: dict) -> None:
    res = results.get(case["name"])
    assert res is not None, f"no result; child stderr:\n{results['_stderr']}"
    assert "error" not in res, res.get("error")
    if case["kind"] == "greedy":
        assert res["greedy_equal"] and res["in_range"], res
        if case["name"].startswith("greedy_ties"):
            assert res["chunks"] > 1, res
            assert (res["row0"], res["row1"]) == (10, 1100), res
    elif case["kind"] == "dist":
        assert res["in_range"], res
        assert res["chi2"] < _chi2_limit(res["dof"]), res
        if case.get("peaked"):
            assert res["chunks"] > 1, res
    elif case["kind"] == "argmax":
        assert res["equal"], res
        assert res["got"][:3] == [10, case["V"] // 2, 0], res
        if case["name"].endswith("multichunk_fp32"):
            assert res["chunks"] > 1, res
    else:
        assert res["same_seed_equal"], res
        assert res["other_seed_differs"] > case["rows"] // 2, res


if __name__ == "__main__":
    child_main(CASES, _run)
