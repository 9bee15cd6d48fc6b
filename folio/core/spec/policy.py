"""Which requests speculate, and how many draft tokens each step carries.

A request speculates when the verification step can honour everything its sampling asks for:
this first version verifies greedy and random sampling with temperature, top-k, top-p, min-p
and seeds; requests with logprobs, logit processors (penalties, logit bias, bad words,
allowed ids, min_tokens) or a grammar decode one token per step as before.
"""
from __future__ import annotations

from folio.sampling_params import SamplingParams


def speculation_supported(params: SamplingParams, has_grammar: bool) -> bool:
    if has_grammar or params.logprobs is not None:
        return False
    return not (params.allowed_token_ids is not None or params.logit_bias
                or params.bad_words_token_ids or params.min_tokens > 0
                or params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
                or params.presence_penalty != 0.0)


class AdaptiveDraftLength:
    """How many of a request's drafts a step verifies, from the measured cost of a step and
    the request's measured acceptance.

    A step of T tokens takes about t0 + t1·T (t0: reading the weights once, t1: each token's
    compute), fitted online from the steps' wall times. At a batch of B requests a token costs
    (t0 + t1·B) / B without speculation; a draft at position i costs t1 and is kept with
    probability a^i, a the request's acceptance rate (an EMA of accepted / drafted). It pays
    while a^i · (t0 + t1·B) / B > t1, i.e. a^i > t1·B / (t0 + t1·B): at batch 1 almost any
    draft pays, and as B grows the bar rises towards 1 and k falls to 0 — speculation steps
    aside where it would cost."""

    # Before any step is measured: a token's compute as a share of a step's fixed cost.
    PRIOR_T1_OVER_T0 = 1 / 64
    # A request's acceptance rate before its first verify step (optimistic, so it is tried).
    PRIOR_ACCEPTANCE = 0.7
    _DECAY = 0.98      # weight of the older steps in the fit
    _EMA = 0.3         # weight of a verify step in a request's acceptance rate

    def __init__(self) -> None:
        # decayed sums over measured steps: n, ΣT, ΣT², Σy, ΣTy
        self._sums = [0.0] * 5
        self.acceptance: dict[str, float] = {}

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        d = self._DECAY
        s = self._sums
        for i, value in enumerate((1.0, num_tokens, num_tokens * num_tokens, seconds,
                                   num_tokens * seconds)):
            s[i] = s[i] * d + value

    def cost_ratio(self) -> float:
        """t1 / t0 from the fit (the prior until steps of different sizes were seen)."""
        n, st, stt, sy, sty = self._sums
        var = n * stt - st * st
        if n < 8 or var <= 1e-9 * max(n * stt, 1.0):
            return self.PRIOR_T1_OVER_T0
        t1 = (n * sty - st * sy) / var
        t0 = (sy - t1 * st) / n
        if t0 <= 0:
            return 1.0          # no fixed cost seen: tokens cost all, speculation never pays
        return max(t1, 0.0) / t0

    def observe_acceptance(self, request_id: str, num_drafts: int, accepted: int) -> None:
        if num_drafts > 0:
            old = self.acceptance.get(request_id, self.PRIOR_ACCEPTANCE)
            self.acceptance[request_id] = (1 - self._EMA) * old + self._EMA * accepted / num_drafts

    def drop(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)

    def draft_length(self, request_id: str, batch_size: int, max_drafts: int) -> int:
        r = self.cost_ratio()
        bar = r * batch_size / (1.0 + r * batch_size)
        a = self.acceptance.get(request_id, self.PRIOR_ACCEPTANCE)
        k, kept = 0, 1.0
        while k < max_drafts:
            kept *= a
            if kept <= bar:
                break
            k += 1
        return k
