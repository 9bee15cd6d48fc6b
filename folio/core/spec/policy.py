"""How many draft tokens each step verifies (speculative decoding).

Every request speculates: verification honours every sampling option (greedy and random
sampling, temperature, top-k, top-p, min-p, seeds, the logit processors, logprobs) and the
structured-output grammar (a mask per draft position; worker/spec_verify.py and
engine/grammar_manager.py). What is left to decide is how far.
"""
from __future__ import annotations


class AdaptiveDraftLength:
    """How many drafts each request verifies this step: the k that maximises the expected
    tokens per second of the step, from the measured cost of steps by size and each
    request's measured acceptance.

    A step's cost is not linear in its tokens: up to some size the weights' reading dominates
    and extra tokens are nearly free (a 5-token step cost 1.04x a 1-token one on the CPU),
    beyond it they cost their compute. So step times are kept per size bucket (powers of
    two, an exponential moving average each) and read by linear interpolation; past the
    largest bucket measured, the cost grows in proportion to the tokens from there, and with
    nothing measured beyond one size the curve is flat (optimistic: speculation is tried, its
    steps measured, and the choice corrected).

    With B requests able to draft, request r keeping its i-th draft with probability a_r^i
    (a_r an EMA of its accepted / drafted), a step with k drafts each yields
    Σ_r (1 + a_r + ... + a_r^k) tokens, plus one for every request that does not draft; the
    chosen k maximises that over cost(T) for the step's tokens T. k = 0 whenever drafting
    would lower the rate (large batches past the knee, low acceptance): speculation steps
    aside where it would cost.

    A k = 0 verdict rests on measurements that may be stale or noisy (a step timed while
    another process held the core); with k = 0 no verify step is timed again, so the
    verdict would stand for good. So after `probe_after` steps of k = 0 while drafts were
    on offer, one step drafts in full to measure again; each probe that confirms k = 0
    doubles the wait (up to MAX_PROBE_AFTER steps, where a probe costs a large batch well
    under a per cent), and a step that chooses to draft resets it."""

    # A request's acceptance rate before its first verify step (optimistic, so it is tried).
    PRIOR_ACCEPTANCE = 0.7
    _EMA_STEP = 0.2    # weight of a new step time in its bucket
    _EMA_ACCEPT = 0.3  # weight of a verify step in a request's acceptance rate
    MIN_PROBE_AFTER = 16
    MAX_PROBE_AFTER = 1024

    # A bucket not timed for this many steps is stale: its next time replaces it outright
    # (a probe must be able to overturn an old noisy figure in one step).
    STALE_AFTER_STEPS = 64

    def __init__(self) -> None:
        # log2 bucket of the step's tokens -> (mean tokens, mean seconds) of its steps, EMAs:
        # each bucket is a measured point of the cost curve where its steps actually were
        # (a step of 64 tokens and one of 64 + 56 drafts share a bucket; read at its lower
        # edge, the drafting steps' times would make plain steps look dear and drafts free)
        self.bucket_points: dict[int, tuple[float, float]] = {}
        self._bucket_timed_at: dict[int, int] = {}   # log2 bucket -> step count when last timed
        self._steps_timed = 0
        self.acceptance: dict[str, float] = {}
        self.probe_after = self.MIN_PROBE_AFTER
        self._steps_without_drafts = 0

    @staticmethod
    def _bucket(num_tokens: int) -> int:
        return max(num_tokens, 1).bit_length() - 1     # 1 -> 0, 2-3 -> 1, 4-7 -> 2, ...

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        b = self._bucket(num_tokens)
        self._steps_timed += 1
        old = self.bucket_points.get(b)
        if old is not None and self._steps_timed - self._bucket_timed_at[b] > self.STALE_AFTER_STEPS:
            old = None
        self._bucket_timed_at[b] = self._steps_timed
        if old is None:
            self.bucket_points[b] = (float(num_tokens), seconds)
        else:
            w = self._EMA_STEP
            self.bucket_points[b] = ((1 - w) * old[0] + w * num_tokens,
                                     (1 - w) * old[1] + w * seconds)

    def cost(self, num_tokens: int) -> float | None:
        """The expected seconds of a step of num_tokens tokens (None before any step)."""
        if not self.bucket_points:
            return None
        pts = sorted(self.bucket_points.values())
        x = max(num_tokens, 1)
        if x <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
        x_last, y_last = pts[-1]
        if len(pts) == 1:
            return y_last                              # nothing known past it: flat
        return y_last * max(1.0, x / x_last) if y_last > pts[-2][1] else y_last

    def observe_acceptance(self, request_id: str, num_drafts: int, accepted: int) -> None:
        if num_drafts > 0:
            old = self.acceptance.get(request_id, self.PRIOR_ACCEPTANCE)
            self.acceptance[request_id] = ((1 - self._EMA_ACCEPT) * old
                                           + self._EMA_ACCEPT * accepted / num_drafts)

    def drop(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)

    def choose(self, drafting: dict[str, int], other_tokens: int) -> int:
        """The draft length for this step: `drafting` maps each request that has drafts to
        how many it has, `other_tokens` counts the step's other tokens (one per request that
        decodes without drafts, and each drafting request's own token is added here)."""
        if not drafting:
            return 0
        max_k = max(drafting.values())
        best_k = self._best_k(drafting, other_tokens, max_k)
        if best_k > 0:
            self.probe_after = self.MIN_PROBE_AFTER
            self._steps_without_drafts = 0
            return best_k
        self._steps_without_drafts += 1
        if self._steps_without_drafts < self.probe_after:
            return 0
        self._steps_without_drafts = 0
        self.probe_after = min(2 * self.probe_after, self.MAX_PROBE_AFTER)
        return max_k

    def _best_k(self, drafting: dict[str, int], other_tokens: int, max_k: int) -> int:
        rates = [self.acceptance.get(rid, self.PRIOR_ACCEPTANCE) for rid in drafting]
        base = other_tokens + len(drafting)
        best_k, best_rate = 0, None
        for k in range(max_k + 1):
            tokens = base + sum(min(k, n) for n in drafting.values())
            cost = self.cost(tokens)
            if cost is None:
                return max_k                     # nothing measured yet: try it
            gain = other_tokens
            for a, n in zip(rates, drafting.values()):
                kk = min(k, n)
                gain += (1 - a ** (kk + 1)) / (1 - a) if a < 1 else kk + 1
            rate = gain / cost
            if best_rate is None or rate > best_rate * 1.0001:
                best_k, best_rate = k, rate
        return best_k


class FixedDraftLength:
    """Every request verifies all the drafts its proposer gave (speculative_config's
    adaptive_draft_length false): reproducible step shapes, for benchmarks and tests."""

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Nothing to learn: the length is fixed."""

    def observe_acceptance(self, request_id: str, num_drafts: int, accepted: int) -> None:
        """Nothing to learn: the length is fixed."""

    def drop(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def choose(self, drafting: dict[str, int], other_tokens: int) -> int:
        return max(drafting.values(), default=0)
