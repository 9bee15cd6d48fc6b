"""The verification of draft tokens (worker/spec_verify.py): greedy keeps exactly what one
token per step would give; the sampled rule keeps the target's distribution, checked by a
chi-square test over many draws on a small vocabulary (fixed seeds, so the test is
deterministic)."""
from __future__ import annotations

import pytest
import torch

from folio.sampling_params import SamplingParams
from folio.worker.sampler import SamplingState
from folio.worker.sampling_columns import SamplingColumns
from folio.worker.spec_verify import sample_verified, target_probs, verify

# chi-square critical values at p = 0.001 by degrees of freedom
_CHI2_CRIT = {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _columns(params: SamplingParams) -> SamplingColumns:
    return SamplingColumns.from_params([params])


def test_greedy_keeps_the_matching_prefix_then_the_argmax() -> None:
    logits = torch.full((4, 10), -5.0)
    for pos, tok in enumerate([3, 4, 5, 6]):
        logits[pos, tok] = 5.0
    params = SamplingParams(temperature=0)
    state, cols = SamplingState(params), _columns(params)
    assert verify(logits, [3, 4, 5], state, cols, 0) == [3, 4, 5, 6]   # all accepted + bonus
    assert verify(logits, [3, 9, 5], state, cols, 0) == [3, 4]         # second draft rejected
    assert verify(logits, [1, 4, 5], state, cols, 0) == [3]
    assert verify(logits[:1], [], state, cols, 0) == [3]


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum().item()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the filtered support was emitted"
    expected = probs[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def _draws(params: SamplingParams, logits: torch.Tensor, drafts: list[int], n: int):
    """n verifications of the same step: the full path once, then the sampled rule on its
    distributions (what verify does after target_probs)."""
    gen = torch.Generator().manual_seed(1234)
    state, cols = SamplingState(params, generator=gen), _columns(params)
    first = verify(logits, drafts, state, cols, 0)
    probs = target_probs(logits, cols, 0)
    return [first] + [sample_verified(probs, drafts, gen) for _ in range(n - 1)]


def _assert_emitted_as_target(outs: list[list[int]], probs: torch.Tensor,
                              drafts: list[int]) -> None:
    """Answers of a two-draft verification: the first emitted token is distributed as p_0,
    whatever the draft; given the first draft was kept, the second as p_1; every answer is
    the kept drafts then one token, never longer than drafts + 1."""
    n, vocab = len(outs), probs.shape[1]
    first = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=vocab).double()
    stat, df = _chi2(first, probs[0].double())
    assert stat < _CHI2_CRIT[df], (stat, df)
    kept = [o for o in outs if o[0] == drafts[0]]
    assert abs(len(kept) / n - float(probs[0, drafts[0]])) < 0.02
    second = torch.bincount(torch.tensor([o[1] for o in kept]), minlength=vocab).double()
    stat, df = _chi2(second, probs[1].double())
    assert stat < _CHI2_CRIT[df], (stat, df)
    assert all(o[:len(o) - 1] == drafts[:len(o) - 1] and 1 <= len(o) <= 3 for o in outs)


def test_the_sampled_rule_keeps_the_target_distribution() -> None:
    torch.manual_seed(0)
    vocab, n = 8, 12000
    logits = torch.randn(3, vocab) * 1.5
    params = SamplingParams(temperature=0.9, seed=1)
    probs = target_probs(logits, _columns(params), 0)
    drafts = [int(probs[0].argsort()[-2]), int(probs[1].argmax())]   # a likely-ish guess
    outs = _draws(params, logits, drafts, n)
    _assert_emitted_as_target(outs, probs, drafts)


def test_the_sampled_rule_honours_top_k_and_top_p() -> None:
    torch.manual_seed(1)
    vocab, n = 8, 8000
    logits = torch.randn(2, vocab)
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3)
    probs = target_probs(logits, _columns(params), 0)
    assert (probs[0] == 0).sum() >= 3          # the filters removed some tokens
    draft = int(torch.nonzero(probs[0] == 0)[0])   # a draft the filters exclude: never kept
    outs = _draws(params, logits, [draft], n)
    assert all(o[0] != draft and len(o) == 1 for o in outs)
    first = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=vocab).double()
    stat, df = _chi2(first, probs[0].double())
    assert stat < _CHI2_CRIT[df], (stat, df)


def test_a_seed_gives_the_same_verification() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 16)
    params = SamplingParams(temperature=1.0, seed=7)
    a = _draws(params, logits, [1, 2], 50)
    b = _draws(params, logits, [1, 2], 50)
    assert a == b


def test_logit_bias_and_allowed_ids_apply_at_every_position() -> None:
    import numpy as np
    history = np.array([3, 3], dtype=np.int32)
    logits = torch.zeros(3, 10)
    logits[:, 4] = 2.0
    params = SamplingParams(temperature=0, logit_bias={7: 5.0})
    state, cols = SamplingState(params), _columns(params)
    assert verify(logits, [7, 7], state, cols, 0, history, 1) == [7, 7, 7]  # bias wins
    assert verify(logits, [4, 7], state, cols, 0, history, 1) == [7]
    params = SamplingParams(temperature=1.0, allowed_token_ids=[1, 2], seed=0)
    gen = torch.Generator().manual_seed(0)
    state, cols = SamplingState(params, generator=gen), _columns(params)
    for _ in range(50):
        assert all(t in (1, 2) for t in verify(logits, [1, 2], state, cols, 0, history, 1))
    with pytest.raises(ValueError, match="history"):
        verify(logits, [1, 2], state, cols, 0)


def test_penalties_count_the_drafts_before_each_position() -> None:
    """A repetition penalty at position j sees the drafts before j: a draft repeated is
    penalised at the next position as one-token-per-step decoding would penalise it."""
    import numpy as np
    logits = torch.zeros(3, 10)
    logits[:, 5] = 1.0        # 5 is the argmax unless penalised
    logits[:, 6] = 0.9
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    state, cols = SamplingState(params), _columns(params)
    history = np.array([1, 2, 3], dtype=np.int32)     # prompt 1, 2; output 3
    # position 0: 5 not seen yet -> 5; position 1: 5 seen (the draft) -> 1.0 / 2 < 0.9 -> 6
    assert verify(logits, [5, 5], state, cols, 0, history, 2) == [5, 6]
    # min_tokens masks EOS while the output (with the drafts) is short
    params = SamplingParams(temperature=0, min_tokens=3)
    state = SamplingState(params, eos_token_ids=(5,))
    assert verify(logits, [6, 6], state, _columns(params), 0, history, 2) == [6, 6, 5]


def test_the_unseeded_sampled_rule_draws_every_position_at_once() -> None:
    """Without a seed every position's race is drawn in one go (one copy to the host): the
    first emitted token is still distributed as p_0, the second (its draft kept) as p_1."""
    torch.manual_seed(5)
    vocab, n = 8, 12000
    logits = torch.randn(3, vocab) * 1.5
    probs = target_probs(logits, _columns(SamplingParams(temperature=0.8)), 0)
    drafts = [int(probs[0].argsort()[-2]), int(probs[1].argmax())]
    outs = [sample_verified(probs, drafts, None) for _ in range(n)]
    _assert_emitted_as_target(outs, probs, drafts)
