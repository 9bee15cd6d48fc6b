"""How many draft tokens each step verifies (speculative decoding).

Every request speculates: verification honours every sampling option (greedy and random
sampling, temperature, top-k, top-p, min-p, seeds, the logit processors, logprobs) and the
structured-output grammar (a mask per draft position; worker/spec_verify.py and
engine/grammar_manager.py). What is left to decide is how far.
"""
from __future__ import annotations

import math
import statistics
from collections import deque


class StepCostCurve:
    """Measured seconds of steps by their tokens: one point per size bucket (powers of two),
    each the median of its last WINDOW steps' (tokens, seconds), read by linear
    interpolation. A step of 64 tokens and one of 64 + 56 share a bucket; the bucket is a
    point at its steps' typical size, not its lower edge (read there, the larger steps' times
    would make the smaller look dear). Past the largest point the cost grows in proportion
    to the tokens from there (flat when only one point is known: optimistic, so larger
    steps are tried and measured).

    Medians, not means: on the H200 a few plain steps of batch 64 took 20-40 ms (stalls
    outside the step: a collection, the host descheduled) among hundreds of 2.2 ms ones, and
    a moving average they dragged to several ms made speculation look worth it where it
    cost 1.4x."""

    WINDOW = 15

    def __init__(self, stale_after: int) -> None:
        # log2 bucket of the step's tokens -> its recent (tokens, seconds), and the point
        self.samples: dict[int, deque[tuple[int, float]]] = {}
        self.points: dict[int, tuple[float, float]] = {}
        self.timed_at: dict[int, int] = {}   # bucket -> the policy's step count when timed
        self.stale_after = stale_after

    @staticmethod
    def bucket(num_tokens: int) -> int:
        return max(num_tokens, 1).bit_length() - 1     # 1 -> 0, 2-3 -> 1, 4-7 -> 2, ...

    def observe(self, num_tokens: int, seconds: float, now: int) -> None:
        b = self.bucket(num_tokens)
        samples = self.samples.get(b)
        # A bucket not timed for a while is stale: its next time replaces it outright (a
        # probe must be able to overturn an old noisy figure in one step).
        if samples is None or now - self.timed_at[b] > self.stale_after:
            samples = self.samples[b] = deque(maxlen=self.WINDOW)
        self.timed_at[b] = now
        samples.append((num_tokens, seconds))
        self.points[b] = (statistics.median(n for n, _ in samples),
                          statistics.median(t for _, t in samples))

    def knows(self, num_tokens: int, now: int, max_age: int) -> bool:
        """Whether a step of this size was timed in the last max_age steps."""
        b = self.bucket(num_tokens)
        return b in self.points and now - self.timed_at[b] <= max_age

    def cost(self, num_tokens: int) -> float | None:
        if not self.points:
            return None
        pts = sorted(self.points.values())
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


class AdaptiveDraftLength:
    """How many drafts each request verifies this step: the k that maximises the expected
    tokens per second of the step, from the measured cost of steps by size and each
    request's measured acceptance.

    A step's cost is not linear in its tokens: up to some size the weights' reading dominates
    and extra tokens are nearly free (a 5-token step cost 1.04x a 1-token one on the CPU),
    beyond it they cost their compute. Steps that verify drafts also carry costs of their
    own that plain steps do not: the engine runs them synchronously (the next step needs
    their kept tokens), so the host's scheduling is no longer hidden behind the device's
    work, and the verification itself. At batch 64 on a GPU a plain step of a small model
    took 2.4 ms and a verify step twice as long, whatever its drafts. So plain steps and
    verify steps keep separate cost curves (StepCostCurve), and k = 0 is priced on the plain
    one. A plain size never timed (or not for MAX_PROBE_AFTER steps) is measured first:
    one step without drafts.

    With B requests able to draft, request r keeping its i-th draft with probability a_r^i
    (a_r an EMA of its accepted / drafted), a step with k drafts each yields
    Σ_r (1 + a_r + ... + a_r^k) tokens, plus one for every request that does not draft; the
    chosen k maximises that over cost(T) for the step's tokens T. k = 0 whenever drafting
    would lower the rate (large batches past the knee, low acceptance): speculation steps
    aside where it would cost, and the engine goes back to overlapping steps.

    A k = 0 verdict rests on measurements that may be stale or noisy (a step timed while
    another process held the core); with k = 0 no verify step is timed again, so the
    verdict would stand for good. So after `probe_after` steps of k = 0 while drafts were
    on offer, one step drafts in full to measure again; each probe that confirms k = 0
    doubles the wait (up to MAX_PROBE_AFTER steps), and a step that chooses to draft resets
    it. A probe is also priced: it waits until its expected extra time (the verify step's
    cost over the plain step's, from the curves) is at most PROBE_SHARE of the plain steps
    rested since the last one, up to PRICED_WAIT_FACTOR times probe_after. At batch 64 on the
    H200 a verify step of a small model took ~20 ms against 2.1 ms for a plain one, so
    probing after 32, 64, 128... steps cost that batch ~10 % of its decode time (issue 17's
    batch-64 runs); priced, the waits are 256, 512, then ~860 steps."""

    # A request's acceptance rate before its first verify step (optimistic, so it is tried).
    PRIOR_ACCEPTANCE = 0.7
    _EMA_ACCEPT = 0.3  # weight of a verify step in a request's acceptance rate
    MIN_PROBE_AFTER = 32
    MAX_PROBE_AFTER = 1024
    PROBE_SHARE = 0.01
    # A priced wait is at most this many times probe_after: a noisy figure that makes the
    # verify steps look dear must still be measured again, only later.
    PRICED_WAIT_FACTOR = 8
    HALVED_STEPS = 16

    # A bucket not timed for this many steps is stale: its next time replaces it outright.
    STALE_AFTER_STEPS = 64

    def __init__(self) -> None:
        self.plain = StepCostCurve(self.STALE_AFTER_STEPS)
        self.verify = StepCostCurve(self.STALE_AFTER_STEPS)
        self._steps_timed = 0
        self.acceptance: dict[str, float] = {}
        self.probe_after = self.MIN_PROBE_AFTER
        self._probe_wait = self.MIN_PROBE_AFTER   # probe_after, or longer where probes cost
        self._steps_without_drafts = 0
        # Resting: the last verdict was k = 0 with drafts on offer. Proposals are then not
        # made (the scheduler asks `wants_proposals`), since at a large batch making them
        # costs the host more than the step it would speed up; they are made again for a
        # probe and for the verdict right after it.
        self._resting = False
        self._rest_batch = 0     # the step's requests at the last k = 0 verdict
        self._halved_steps = 0   # consecutive steps at half that batch or less
        self._judge_next = False

    def wants_proposals(self, batch_size: int | None = None) -> bool:
        """Whether the drafter should propose after this step (for the next one).
        `batch_size`: the requests decoding now (given once per step); resting ends when it
        has stayed at half the k = 0 verdict's batch or less for HALVED_STEPS steps
        (speculation may pay at the smaller batch: judge it again, rather than wait for the
        next probe; a batch finishing together passes through half in a few steps, and
        drafting for those last steps costs more than it gains)."""
        if batch_size is not None:
            halved = self._resting and 2 * batch_size <= self._rest_batch
            self._halved_steps = self._halved_steps + 1 if halved else 0
        # (a halved batch counts until its verdict, also for a caller without the batch:
        # the step message's propose_drafts, for a worker's proposer)
        return (not self._resting or self._judge_next or self._halved_steps >= self.HALVED_STEPS
                or self._steps_without_drafts + 1 >= self._probe_wait)

    def observe_step(self, num_tokens: int, seconds: float, verify: bool) -> None:
        """A step's wall time; `verify`: it carried drafts."""
        if num_tokens <= 0 or seconds <= 0:
            return
        self._steps_timed += 1
        (self.verify if verify else self.plain).observe(num_tokens, seconds, self._steps_timed)

    def cost(self, num_tokens: int, verify: bool = True) -> float | None:
        """The expected seconds of a step of num_tokens tokens (None before any step); a plain
        step's from the verify steps' curve until a plain step is timed."""
        if verify:
            return self.verify.cost(num_tokens)
        plain = self.plain.cost(num_tokens)
        return plain if plain is not None else self.verify.cost(num_tokens)

    def observe_acceptance(self, request_id: str, num_drafts: int, accepted: int) -> None:
        if num_drafts > 0:
            old = self.acceptance.get(request_id, self.PRIOR_ACCEPTANCE)
            self.acceptance[request_id] = ((1 - self._EMA_ACCEPT) * old
                                           + self._EMA_ACCEPT * accepted / num_drafts)

    def drop(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)

    def will_draft(self, drafting: dict[str, int], other_tokens: int) -> bool:
        """Whether `choose` with these arguments would draft (no state changes): the engine
        asks before scheduling, to run the step synchronously if so."""
        return self._plan(drafting, other_tokens)[0] > 0

    def choose(self, drafting: dict[str, int], other_tokens: int) -> int:
        """The draft length for this step: `drafting` maps each request that has drafts to
        how many it has, `other_tokens` counts the step's other tokens (one per request that
        decodes without drafts, and each drafting request's own token is added here)."""
        if not drafting:
            if self._resting and other_tokens > 0 and not self.wants_proposals():
                self._steps_without_drafts += 1    # a k = 0 step: proposals were skipped
            return 0
        k, probe = self._plan(drafting, other_tokens)
        self._judge_next = probe       # the probe's time is judged with fresh proposals
        if probe:
            self._steps_without_drafts = 0
            self.probe_after = min(2 * self.probe_after, self.MAX_PROBE_AFTER)
        elif k > 0:
            self.probe_after = self.MIN_PROBE_AFTER
            self._steps_without_drafts = 0
            self._resting = False
        else:
            self._steps_without_drafts += 1
            self._resting = True
            self._rest_batch = len(drafting) + other_tokens
            self._halved_steps = 0           # halved from this verdict's batch, from now
            self._probe_wait = self._priced_wait(drafting, other_tokens)
        return k

    def _priced_wait(self, drafting: dict[str, int], other_tokens: int) -> int:
        """Resting steps before the next probe: probe_after, or more where the probe's extra
        time over a plain step would exceed PROBE_SHARE of the plain steps waited."""
        base = other_tokens + len(drafting)
        max_k = max(drafting.values())
        plain = self.cost(base, verify=False)
        verify = self.verify.cost(base + sum(min(max_k, n) for n in drafting.values()))
        if not plain or verify is None:
            return self.probe_after
        priced = math.ceil(max(0.0, verify - plain) / (self.PROBE_SHARE * plain))
        return max(self.probe_after, min(priced, self.PRICED_WAIT_FACTOR * self.probe_after))

    def _plan(self, drafting: dict[str, int], other_tokens: int) -> tuple[int, bool]:
        """(k, whether k is a probe of a k = 0 verdict)."""
        if not drafting:
            return 0, False
        max_k = max(drafting.values())
        best_k = self._best_k(drafting, other_tokens, max_k)
        if best_k > 0:
            return best_k, False
        if self._steps_without_drafts + 1 < self._probe_wait:
            return 0, False
        return max_k, True

    def _best_k(self, drafting: dict[str, int], other_tokens: int, max_k: int) -> int:
        base = other_tokens + len(drafting)
        if self.verify.cost(base) is None:
            return max_k                         # no verify step measured yet: try it
        if self.plain.points and not self.plain.knows(base, self._steps_timed,
                                                      self.MAX_PROBE_AFTER):
            return 0                             # time a plain step of this size first
        rates = [self.acceptance.get(rid, self.PRIOR_ACCEPTANCE) for rid in drafting]
        best_k, best_rate = 0, None
        for k in range(max_k + 1):
            tokens = base + sum(min(k, n) for n in drafting.values())
            cost = self.cost(tokens, verify=k > 0)
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

    def observe_step(self, num_tokens: int, seconds: float, verify: bool) -> None:
        """Nothing to learn: the length is fixed."""

    def observe_acceptance(self, request_id: str, num_drafts: int, accepted: int) -> None:
        """Nothing to learn: the length is fixed."""

    def drop(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def will_draft(self, drafting: dict[str, int], other_tokens: int) -> bool:
        return bool(drafting)

    def wants_proposals(self, batch_size: int | None = None) -> bool:
        return True

    def choose(self, drafting: dict[str, int], other_tokens: int) -> int:
        return max(drafting.values(), default=0)


class BatchCappedDraftLength:
    """vLLM's `disable_by_batch_size` over another length policy: while `limit` or more
    requests run, no proposals are made and no step verifies drafts; below it, `inner`
    decides. The running batch is the one the scheduler gives `wants_proposals` once a step
    (after its update), or the step's decoding requests, whichever is larger: drafts made at
    a smaller batch are dropped once the batch reaches the limit."""

    def __init__(self, inner: AdaptiveDraftLength | FixedDraftLength, limit: int) -> None:
        self.inner = inner
        self.limit = limit
        self._batch = 0

    def _capped(self, batch: int = 0) -> bool:
        return max(batch, self._batch) >= self.limit

    def observe_step(self, num_tokens: int, seconds: float, verify: bool) -> None:
        self.inner.observe_step(num_tokens, seconds, verify)

    def observe_acceptance(self, request_id: str, num_drafts: int, accepted: int) -> None:
        self.inner.observe_acceptance(request_id, num_drafts, accepted)

    def drop(self, request_id: str) -> None:
        self.inner.drop(request_id)

    def wants_proposals(self, batch_size: int | None = None) -> bool:
        if batch_size is not None:
            self._batch = batch_size
        return not self._capped() and self.inner.wants_proposals(batch_size)

    def will_draft(self, drafting: dict[str, int], other_tokens: int) -> bool:
        return (not self._capped(len(drafting) + other_tokens)
                and self.inner.will_draft(drafting, other_tokens))

    def choose(self, drafting: dict[str, int], other_tokens: int) -> int:
        if self._capped(len(drafting) + other_tokens):
            return 0
        return self.inner.choose(drafting, other_tokens)
