import math

import pytest
import torch

from folio.sampling_params import SamplingParams
from folio.worker.sampler import SampledTokenLogprobs, SamplerOutput, compute_token_logprobs
from sampler_rows import Row, apply_min_p, apply_top_k_top_p
from sampler_rows import RowSampler as Sampler

NEG_INF = float("-inf")


def state(
    params: SamplingParams | None = None,
    prompt=(1, 2, 3),
    output=(),
    seed_gen: int | None = None,
    eos=(),
) -> Row:
    params = params or SamplingParams()
    gen = None
    if seed_gen is not None:
        gen = torch.Generator().manual_seed(seed_gen)
    return Row(params, list(prompt), list(output), gen, tuple(eos))


def rand_logits(b: int, v: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


# --------------------------------------------------------------------------
# Per-row python references
# --------------------------------------------------------------------------


def ref_process(row: torch.Tensor, st: Row) -> torch.Tensor:
    """Straightforward per-token version of the request-level processors."""
    x = row.float().clone()
    p = st.params
    out = st.output_token_ids
    if p.allowed_token_ids is not None:
        for t in range(x.numel()):
            if t not in p.allowed_token_ids:
                x[t] = NEG_INF
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for seq in p.bad_words_token_ids:
        prefix = seq[:-1]
        if len(prefix) <= len(out) and (not prefix or out[-len(prefix):] == prefix):
            x[seq[-1]] = NEG_INF
    if len(out) < p.min_tokens:
        for t in list(st.eos_token_ids) + list(p.stop_token_ids):
            x[t] = NEG_INF
    if p.repetition_penalty != 1.0:
        for t in set(st.prompt_token_ids) | set(out):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return x


def ref_allowed_after_filters(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """Tokens a random row may sample after temperature, min_p, top_k, top_p."""
    x = (row.double() / p.temperature).tolist()
    probs = torch.softmax(torch.tensor(x, dtype=torch.float64), -1).tolist()
    keep = {t for t in range(len(x)) if x[t] != NEG_INF}
    if p.min_p > 0:
        keep = {t for t in keep if probs[t] >= p.min_p * max(probs)}
    if p.top_k > 0:
        ranked = sorted(keep, key=lambda t: -x[t])
        keep = set(ranked[: p.top_k])
    if p.top_p < 1.0:
        masses = {t: math.exp(x[t]) for t in keep}
        total = sum(masses.values())
        ranked = sorted(keep, key=lambda t: -x[t])
        kept, before = set(), 0.0
        for t in ranked:
            # A token survives while the mass strictly above it is < top_p.
            if before / total < p.top_p:
                kept.add(t)
            before += masses[t]
        keep = kept
    return keep


# --------------------------------------------------------------------------
# Greedy and basic shapes
# --------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = rand_logits(8, 50)
    states = [state(SamplingParams(temperature=0.0)) for _ in range(8)]
    out = Sampler()(logits, states)
    assert isinstance(out, SamplerOutput)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_input_not_modified_and_low_precision_ok():
    logits = rand_logits(4, 32).to(torch.bfloat16)
    before = logits.clone()
    params = SamplingParams(temperature=0.0, logit_bias={3: 50.0}, repetition_penalty=1.3)
    out = Sampler()(logits, [state(params) for _ in range(4)])
    assert torch.equal(logits, before)
    assert out.sampled_token_ids == [3] * 4


def test_mixed_greedy_and_random_rows():
    logits = rand_logits(6, 40)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1)] * 3
    out = Sampler()(logits, [state(p) for p in params])
    # top_k=1 random rows must also give the argmax.
    assert out.sampled_token_ids == logits.argmax(-1).tolist()


def test_shape_mismatch_rejected():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(3, 10), [state()])


# --------------------------------------------------------------------------
# Each processor against the per-row reference
# --------------------------------------------------------------------------

V = 64


def processor_cases():
    bad = SamplingParams(bad_words=["x"])
    bad.bad_words_token_ids = [[5], [7, 8, 9], [10, 11]]
    return [
        state(SamplingParams()),  # untouched row
        state(SamplingParams(allowed_token_ids=[0, 3, 17, 63])),
        state(SamplingParams(logit_bias={2: 5.0, 60: -100.0, 9: 0.5})),
        state(bad, output=[1, 7, 8]),  # [7,8,9] prefix matches, [10,11] does not
        state(bad, output=[10]),  # [10, 11] matches; [7,8,9] too short
        state(bad, output=[]),
        state(SamplingParams(min_tokens=3, stop_token_ids=[4, 6]), output=[1, 2], eos=(0,)),
        state(SamplingParams(min_tokens=2, stop_token_ids=[4]), output=[1, 2], eos=(0,)),
        state(SamplingParams(repetition_penalty=1.7), prompt=[1, 2, 3, 40], output=[3, 5, 5]),
        state(SamplingParams(repetition_penalty=0.6), prompt=[9, 10], output=[11]),
        state(SamplingParams(frequency_penalty=0.7), output=[4, 4, 4, 20, 21, 21]),
        state(SamplingParams(presence_penalty=-1.2), prompt=[30, 31], output=[4, 4, 20]),
        state(
            SamplingParams(
                presence_penalty=0.5,
                frequency_penalty=-0.3,
                repetition_penalty=1.2,
                logit_bias={"1": 2.0},
                allowed_token_ids=list(range(0, 64, 2)),
            ),
            prompt=[2, 4, 6],
            output=[8, 8, 1, 12],
        ),
    ]


def test_each_processor_matches_reference():
    states = processor_cases()
    logits = rand_logits(len(states), V, seed=1)
    processed = Sampler().process_logits(logits, states)
    for i, st in enumerate(states):
        torch.testing.assert_close(processed[i], ref_process(logits[i], st), msg=f"row {i}")


def test_each_processor_changes_only_its_tokens():
    states = processor_cases()
    logits = rand_logits(len(states), V, seed=2)
    processed = Sampler().process_logits(logits, states)
    changed = [set((processed[i] != logits[i]).nonzero().flatten().tolist()) for i in range(len(states))]
    assert changed[0] == set()
    assert changed[1] == set(range(V)) - {0, 3, 17, 63}
    assert changed[2] == {2, 60, 9}
    assert changed[3] == {5, 9}
    assert changed[4] == {5, 11}
    assert changed[5] == {5}
    assert changed[6] == {0, 4, 6}
    assert changed[7] == set()  # min_tokens reached
    assert changed[8] == {1, 2, 3, 40, 5}
    assert changed[9] == {9, 10, 11}
    assert changed[10] == {4, 20, 21}  # frequency: output tokens only
    assert changed[11] == {4, 20}  # presence: output tokens only, not the prompt


def test_processors_independent_of_batch_neighbours():
    states = processor_cases()
    logits = rand_logits(len(states), V, seed=3)
    batched = Sampler().process_logits(logits, states)
    for i, st in enumerate(states):
        alone = Sampler().process_logits(logits[i : i + 1], [st])
        assert torch.equal(alone[0], batched[i])


def test_min_tokens_blocks_eos_until_reached():
    logits = torch.zeros(1, 10)
    logits[0, 7] = 10.0  # eos is by far the most likely
    params = SamplingParams(temperature=0.0, min_tokens=2)
    sampler = Sampler()
    assert sampler(logits, [state(params, output=[1], eos=(7,))]).sampled_token_ids != [7]
    assert sampler(logits, [state(params, output=[1, 2], eos=(7,))]).sampled_token_ids == [7]


def test_out_of_range_ids_fail_with_field_name():
    with pytest.raises(ValueError, match="logit_bias"):
        Sampler()(torch.zeros(1, 10), [state(SamplingParams(logit_bias={12: 1.0}))])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        Sampler()(torch.zeros(1, 10), [state(SamplingParams(allowed_token_ids=[10]))])


# --------------------------------------------------------------------------
# Filters
# --------------------------------------------------------------------------

FILTER_PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=0.5, top_k=10, top_p=0.8),
    SamplingParams(top_k=3, min_p=0.05),
    SamplingParams(top_p=0.9, min_p=0.02, top_k=20),
    SamplingParams(top_k=1),
    SamplingParams(top_p=0.01),
]


@pytest.mark.parametrize("only_top_k", [False, True])
def test_filters_match_reference(only_top_k):
    params = [p for p in FILTER_PARAMS if not only_top_k or p.top_p == 1.0]
    logits = rand_logits(len(params), V, seed=4)
    x = logits / torch.tensor([p.temperature for p in params]).unsqueeze(1)
    apply_min_p(x, params)
    apply_top_k_top_p(x, params)  # top-k-only batch takes the no-sort path
    for i, p in enumerate(params):
        kept = set(torch.isfinite(x[i]).nonzero().flatten().tolist())
        assert kept == ref_allowed_after_filters(logits[i], p), f"row {i}: {p}"
        # Surviving logits are unchanged.
        torch.testing.assert_close(x[i][list(kept)], logits[i][list(kept)] / p.temperature)


def test_top_p_on_top_k_candidates_matches_reference():
    """A batch where every row has a top-k takes the candidates path (no full sort)."""
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.8),
              SamplingParams(top_k=20, top_p=0.95), SamplingParams(top_k=3, top_p=0.01),
              SamplingParams(top_k=40, top_p=1.0), SamplingParams(top_k=7, top_p=0.5, min_p=0.05)]
    logits = rand_logits(len(params), V, seed=7)
    x = logits / torch.tensor([p.temperature for p in params]).unsqueeze(1)
    apply_min_p(x, params)
    apply_top_k_top_p(x, params)
    for i, p in enumerate(params):
        kept = set(torch.isfinite(x[i]).nonzero().flatten().tolist())
        assert kept == ref_allowed_after_filters(logits[i], p), f"row {i}: {p}"
        torch.testing.assert_close(x[i][list(kept)], logits[i][list(kept)] / p.temperature)


def test_filtered_sampling_never_leaves_allowed_set():
    torch.manual_seed(0)
    draws = 2000
    logits = rand_logits(1, 24, seed=5) / 3  # flatter: many tokens near the boundary
    for p in FILTER_PARAMS[1:]:
        allowed = ref_allowed_after_filters(logits[0], p)
        out = Sampler()(logits.expand(draws, -1), [state(p) for _ in range(draws)])
        seen = set(out.sampled_token_ids)
        assert seen <= allowed, p
        assert len(seen) == len(allowed) or len(allowed) > 10  # the set is actually explored


def test_allowed_token_ids_never_violated():
    torch.manual_seed(1)
    allowed = [2, 5, 11]
    p = SamplingParams(allowed_token_ids=allowed, temperature=2.0)
    out = Sampler()(rand_logits(1000, 20, seed=6), [state(p) for _ in range(1000)])
    assert set(out.sampled_token_ids) == set(allowed)


# --------------------------------------------------------------------------
# Randomness: seeds and distribution
# --------------------------------------------------------------------------


def test_seeded_rows_reproducible_and_batch_independent():
    steps, v = 6, 100
    p = SamplingParams(temperature=1.0, seed=1234, top_p=0.95)
    sampler = Sampler()
    logits_alone = [rand_logits(1, v, seed=10 + s) for s in range(steps)]

    gen = torch.Generator().manual_seed(1234)
    alone = [
        sampler(lg, [Row(p, [1], [], gen)]).sampled_token_ids[0] for lg in logits_alone
    ]

    # Same request at row 2 of a batch of 5 with unseeded and differently seeded neighbours.
    gen = torch.Generator().manual_seed(1234)
    other = torch.Generator().manual_seed(99)
    torch.manual_seed(7)
    batched = []
    for s in range(steps):
        lg = rand_logits(5, v, seed=100 + s)
        lg[2] = logits_alone[s][0]
        states = [
            state(SamplingParams()),
            Row(SamplingParams(seed=99, top_k=5), [1], [], other),
            Row(p, [1], [], gen),
            state(SamplingParams(temperature=0.0)),
            state(SamplingParams(min_p=0.3)),
        ]
        batched.append(sampler(lg, states).sampled_token_ids[2])
    assert alone == batched

    # A different seed gives a different sequence (with overwhelming probability).
    gen = torch.Generator().manual_seed(4321)
    different = [
        sampler(lg, [Row(p, [1], [], gen)]).sampled_token_ids[0] for lg in logits_alone
    ]
    assert different != alone


def test_seeded_generator_advanced_only_by_own_row():
    gen = torch.Generator().manual_seed(5)
    state_before = gen.get_state()
    Sampler()(rand_logits(3, 10), [state(), state(), state(SamplingParams(temperature=0.0))])
    # Unseeded/greedy rows must not touch a generator they do not own.
    assert torch.equal(gen.get_state(), state_before)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_distribution_matches_softmax_with_temperature():
    torch.manual_seed(2024)
    v, draws, t = 6, 30000, 0.7
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 0.2]])
    out = Sampler()(logits.expand(draws, -1), [state(SamplingParams(temperature=t)) for _ in range(draws)])
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=v).float()
    probs = torch.softmax(logits[0] / t, -1)
    # df = 5: the 99.99th percentile is ~25.7, so this fails only on a real bias.
    assert chi_square(counts, probs) < 30.0


def test_distribution_of_seeded_rows_matches_softmax():
    v, draws = 5, 4000
    logits = torch.tensor([[0.3, -1.0, 1.2, 0.0, 0.8]])
    p = SamplingParams(seed=0)
    states = [Row(p, [], [], torch.Generator().manual_seed(i)) for i in range(draws)]
    out = Sampler()(logits.expand(draws, -1), states)
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=v).float()
    assert chi_square(counts, torch.softmax(logits[0], -1)) < 25.0  # df = 4


def test_distribution_after_top_p_is_renormalised():
    torch.manual_seed(3)
    draws = 20000
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    out = Sampler()(logits.expand(draws, -1), [state(SamplingParams(top_p=0.7)) for _ in range(draws)])
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=4).float()
    assert counts[2:].sum() == 0  # 0.5 + 0.25 >= 0.7: tokens 2 and 3 cut
    assert chi_square(counts[:2], torch.tensor([2 / 3, 1 / 3])) < 20.0


# --------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_ranks():
    torch.manual_seed(0)
    v = 30
    logits = rand_logits(4, v, seed=8)
    params = [
        SamplingParams(logprobs=3, temperature=0.5, logit_bias={0: 20.0}),
        SamplingParams(),  # no logprobs requested
        SamplingParams(logprobs=0, temperature=0.0, repetition_penalty=2.0),
        SamplingParams(logprobs=5, top_k=4),
    ]
    out = Sampler()(logits, [state(p, prompt=[1, 2]) for p in params])
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    for i in (0, 2, 3):
        lp = out.logprobs[i]
        assert isinstance(lp, SampledTokenLogprobs)
        tok = out.sampled_token_ids[i]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=1e-6)
        assert lp.rank == int((ref[i] > ref[i, tok]).sum()) + 1
        k = params[i].logprobs
        vals, ids = ref[i].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert lp.top_token_ids == ids.tolist()
        assert lp.top_logprobs == pytest.approx(vals.tolist(), abs=1e-6)
    assert out.logprobs[0].token_id == 0  # the bias forced it: rank under raw logits
    assert out.logprobs[2].top_token_ids == []


def test_logprobs_minus_one_returns_whole_vocab():
    v = 17
    logits = rand_logits(2, v, seed=9)
    out = Sampler()(logits, [state(SamplingParams(logprobs=-1)), state(SamplingParams(logprobs=2))])
    full = out.logprobs[0]
    assert len(full.top_token_ids) == v and sorted(full.top_token_ids) == list(range(v))
    assert full.top_logprobs == sorted(full.top_logprobs, reverse=True)
    assert math.isclose(sum(math.exp(x) for x in full.top_logprobs), 1.0, rel_tol=1e-5)
    assert len(out.logprobs[1].top_token_ids) == 2


def test_compute_token_logprobs_for_prompt():
    logits = rand_logits(5, 12, seed=11).to(torch.float16)
    targets = torch.tensor([3, 0, 11, 7, 7])
    rows = compute_token_logprobs(logits, targets, num_top=2)
    ref = torch.log_softmax(logits.float(), -1)
    assert len(rows) == 5
    for i, r in enumerate(rows):
        t = int(targets[i])
        assert r.token_id == t
        assert r.logprob == pytest.approx(ref[i, t].item(), abs=1e-6)
        assert r.rank == int((ref[i] > ref[i, t]).sum()) + 1
        assert r.top_token_ids == ref[i].topk(2).indices.tolist()
    assert [r.rank for r in compute_token_logprobs(logits, logits.argmax(-1), 0)] == [1] * 5
    assert all(len(r.top_token_ids) == 12 for r in compute_token_logprobs(logits, targets, -1))


# --------------------------------------------------------------------------
# The plain fast paths (no logit processor, no filter, no seeded generator)
# --------------------------------------------------------------------------


def test_path_choice():
    from folio.worker.sampler import SamplePath
    from sampler_rows import choose_path
    cpu = rand_logits(2, 10)
    greedy = SamplingParams(temperature=0.0)
    plain = SamplingParams(temperature=0.8)
    assert choose_path(cpu, [state(greedy), state(greedy)]) is SamplePath.ARGMAX
    # A processor on any row sends the whole batch down the general path.
    assert choose_path(cpu, [state(greedy), state(SamplingParams(temperature=0.0,
                                                                  min_tokens=2))]) is SamplePath.GENERAL
    # Random rows: the fused kernel is CUDA-only; on the CPU the general path samples.
    assert choose_path(cpu, [state(greedy), state(plain)]) is SamplePath.GENERAL
    # On CUDA (only `is_cuda` is read to choose): plain temperature rows take the kernel.
    from types import SimpleNamespace
    from folio.model.kernels._common import HAS_TRITON
    on_cuda = SimpleNamespace(is_cuda=True, shape=(2, 10))
    assert choose_path(on_cuda, [state(greedy), state(plain)]) is (
        SamplePath.GUMBEL if HAS_TRITON else SamplePath.GENERAL)
    # Past 2**31 draws the kernel's 32-bit draw counter would repeat: the general path.
    huge = SimpleNamespace(is_cuda=True, shape=(20_000, 151_936))
    assert choose_path(huge, [state(plain)] * 2) is SamplePath.GENERAL
    for blocked in (SamplingParams(temperature=0.8, top_k=5),
                    SamplingParams(temperature=0.8, top_p=0.9),
                    SamplingParams(temperature=0.8, min_p=0.1),
                    SamplingParams(temperature=0.8, repetition_penalty=1.1)):
        assert choose_path(on_cuda, [state(plain), state(blocked)]) is SamplePath.GENERAL, blocked
    assert choose_path(on_cuda, [state(plain), state(plain, seed_gen=3)]) is SamplePath.GENERAL


def test_greedy_fast_path_matches_general_path_and_keeps_logits():
    logits = rand_logits(5, 64, seed=3).to(torch.bfloat16)
    logits[2, 7] = logits[2, 40] = 50.0  # a tie: the lowest id wins, as torch.argmax
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, logprobs=2 if i % 2 else None) for i in range(5)]
    sampled, logprobs = Sampler().sample(logits, [state(p) for p in params])
    assert torch.equal(logits, before)
    assert sampled.tolist() == logits.float().argmax(dim=-1).tolist()
    assert sampled[2].item() == 7
    assert logprobs.rows == [1, 3]
    ref = torch.log_softmax(logits.float(), dim=-1)
    for row, entry in zip(logprobs.rows, logprobs.tensors.entries()):
        assert entry.token_id == sampled[row].item() and entry.rank == 1
        assert math.isclose(entry.logprob, ref[row, sampled[row]].item(), rel_tol=1e-5)


def test_huge_temperature_keeps_banned_tokens_banned():
    """A temperature past float32's range flattens the distribution over the allowed tokens;
    it must not turn the banned ones' -inf into NaN (whose argmax is token 0)."""
    logits = rand_logits(4, 30, seed=9)
    params = SamplingParams(temperature=1e300, allowed_token_ids=[1, 7])
    out = Sampler()(logits, [state(params) for _ in range(4)])
    assert set(out.sampled_token_ids) <= {1, 7}
