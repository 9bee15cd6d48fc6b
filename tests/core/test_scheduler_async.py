"""The scheduler under async scheduling, driven like EngineCore drives it: step N+1 is scheduled
before step N's update, so a running request's next input is a token whose value the host does
not know yet (pending). A fake runner checks the KV each step reads (as in test_scheduler.py,
with the pending token supplied from its own previous step, as the GPU runner does), and every
request's tokens and finish reason must equal the synchronous schedule's, through EOS stops,
length caps, chunked prefill and preemption."""
from __future__ import annotations

import random

import pytest

from folio.core.kv_cache_layout import kv_cache_layout
from folio.core.kv_cache_manager import KVCacheManager, cdiv, make_kv_cache_manager
from folio.core.step_messages import ModelRunnerOutput
from folio.core.request import Request
from folio.core.scheduler import ScheduledStep, Scheduler
from folio.sampling_params import SamplingParams

BS = 4
EOS = 2

def sampled_output(tokens: dict[str, int]) -> ModelRunnerOutput:
    """A worker's reply sampling one token per listed request."""
    return ModelRunnerOutput(req_ids=list(tokens), sampled_token_ids=[[t] for t in tokens.values()])



class CountingRunner:
    """Token k of a request is 1000 + k, or EOS at the request's chosen index; checks that
    every position a step attends over holds the request's own prefix."""

    def __init__(self, eos_at: dict[str, int], windows: tuple[int | None, ...] = (None,)) -> None:
        self.eos_at = eos_at
        # Each KV cache group's sliding window (None: full): its reads are checked inside it.
        self.windows = windows
        self.count: dict[str, int] = {}
        self.last: dict[str, int] = {}      # the previous step's sample per request
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def execute(self, out: ScheduledStep) -> ModelRunnerOutput:
        inputs = {}
        for item in out.scheduled:
            tokens = list(item.request.all_token_ids)
            if item.has_pending_input:
                tokens.append(self.last[item.request_id])   # on the GPU: a device copy
            end = item.num_computed_tokens + item.num_new_tokens
            assert end == len(tokens) or not item.samples
            inputs[item.request_id] = tokens
            for ids in item.block_ids:
                assert len(ids) >= cdiv(end, BS)
                for pos in range(item.num_computed_tokens, end):
                    self.slots[(ids[pos // BS], pos % BS)] = tuple(tokens[:pos + 1])
        sampled: dict[str, int] = {}
        for item in out.scheduled:
            tokens = inputs[item.request_id]
            for ids, window in zip(item.block_ids, self.windows):
                first = 0 if window is None else max(0, item.num_computed_tokens - window + 1)
                for pos in range(first, item.num_computed_tokens + item.num_new_tokens):
                    slot = (ids[pos // BS], pos % BS)
                    assert self.slots.get(slot) == tuple(tokens[:pos + 1]), (
                        f"{item.request_id} reads stale KV at position {pos}")
            if item.samples:
                rid = item.request_id
                k = self.count.get(rid, 0)
                self.count[rid] = k + 1
                token = EOS if self.eos_at.get(rid) == k else 1000 + k
                self.last[rid] = token
                sampled[rid] = token
        return sampled_output(sampled)


def _requests(seed: int, n: int) -> tuple[list[Request], dict[str, int]]:
    rng = random.Random(seed)
    requests, eos_at = [], {}
    for i in range(n):
        rid = f"r{i}"
        prompt = [rng.randrange(100, 200) for _ in range(rng.randint(1, 30))]
        max_tokens = rng.randint(1, 12)
        if rng.random() < 0.4:
            eos_at[rid] = rng.randrange(0, max_tokens)
        requests.append(Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens),
                                (EOS,), block_size=BS, max_model_len=48))
    return requests, eos_at


def _run(seed: int, *, async_scheduling: bool, num_blocks: int, budget: int, n: int = 24,
         windows: tuple[int | None, ...] = ()):
    """`windows`: a sliding window per model layer, for KV cache groups (empty: one group)."""
    requests, eos_at = _requests(seed, n)
    kv = (make_kv_cache_manager(kv_cache_layout(windows, len(windows)), num_blocks, BS)
          if windows else KVCacheManager(num_blocks, BS, True))
    sched = Scheduler(kv_cache_manager=kv, max_num_seqs=8,
                      max_num_batched_tokens=budget, max_model_len=48,
                      async_scheduling=async_scheduling)
    for r in requests:
        sched.add_request(r)
    runner = CountingRunner(eos_at, tuple(g.sliding_window for g in kv.layout.groups)
                            if windows else (None,))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons: dict[str, str] = {}
    in_flight = None

    def update(out, runner_out):
        for o in sched.update_from_output(out, runner_out):
            assert o.request_id not in reasons, "output after finishing"
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        # A request finished while preempted must not stay queued.
        assert not any(r.is_finished for r in sched.waiting)
        sched.kv.block_pool.check_invariants()

    for _ in range(2000):
        out = sched.schedule()
        if out.is_empty:
            if in_flight is None:
                if not sched.has_unfinished_requests():
                    break
                continue
            update(*in_flight)
            in_flight = None
            continue
        runner_out = runner.execute(out)
        if in_flight is not None:
            update(*in_flight)
        in_flight = (out, runner_out)
        if not async_scheduling:
            update(*in_flight)
            in_flight = None
    else:
        pytest.fail("no progress")
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.block_pool.num_usable_blocks
    return tokens, reasons, sched.num_preemptions


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("num_blocks,budget", [(200, 64), (200, 7), (14, 32)])
def test_async_matches_sync(seed, num_blocks, budget):
    expected = _run(seed, async_scheduling=False, num_blocks=num_blocks, budget=budget)
    got = _run(seed, async_scheduling=True, num_blocks=num_blocks, budget=budget)
    assert got[0] == expected[0]
    assert got[1] == expected[1]
    assert set(expected[1].values()) <= {"stop", "length"}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks,budget", [(200, 7), (40, 32)])
def test_async_matches_sync_with_sliding_window_groups(seed, num_blocks, budget):
    """A full group and two sliding ones (window 6): blocks freed out of the window while a
    step is in flight are reused only by later steps, and the tokens are the synchronous
    schedule's."""
    windows = (6, None, 6)
    expected = _run(seed, async_scheduling=False, num_blocks=num_blocks, budget=budget,
                    windows=windows)
    got = _run(seed, async_scheduling=True, num_blocks=num_blocks, budget=budget,
               windows=windows)
    assert got[:2] == expected[:2]


def test_tight_cache_preempts():
    """The (14 blocks, budget 32) case really preempts, so the pending-token paths of
    preemption are exercised above."""
    assert sum(_run(seed, async_scheduling=True, num_blocks=14, budget=32)[2]
               for seed in range(12)) > 0


def test_pending_token_that_ends_a_request_is_not_scheduled_past():
    sched = Scheduler(kv_cache_manager=KVCacheManager(32, BS, True), max_num_seqs=4,
                      max_num_batched_tokens=64, max_model_len=48, async_scheduling=True)
    one = Request("one", [101, 102, 103], SamplingParams(temperature=0, max_tokens=1), (EOS,),
                  block_size=BS, max_model_len=48)
    two = Request("two", [104, 105], SamplingParams(temperature=0, max_tokens=3), (EOS,),
                  block_size=BS, max_model_len=48)
    sched.add_request(one)
    sched.add_request(two)
    first = sched.schedule()
    assert [s.request_id for s in first.scheduled] == ["one", "two"]
    assert all(s.samples for s in first.scheduled)
    assert one.num_pending_tokens == two.num_pending_tokens == 1
    # Before the first step's update: "one" has its only token in flight, "two" decodes it.
    second = sched.schedule()
    assert [s.request_id for s in second.scheduled] == ["two"]
    item = second.scheduled[0]
    assert item.has_pending_input and item.token_ids == [] and item.num_new_tokens == 1
    out = sampled_output({"one": 7, "two": 8})
    finished = [o for o in sched.update_from_output(first, out) if o.finished]
    assert [o.request_id for o in finished] == ["one"]
    assert two.all_token_ids == [104, 105, 8] and two.num_pending_tokens == 1
    sched.update_from_output(second, sampled_output({"two": 9}))
    assert two.output_token_ids == [8, 9] and two.num_pending_tokens == 0
