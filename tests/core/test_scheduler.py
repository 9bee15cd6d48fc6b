"""Scheduler, driven step by step with a fake model runner.

The fake runner also simulates the KV cache: every slot remembers which token prefix it was
computed for, and every step checks that the slots a request attends over hold its own prefix.
So a step that would read KV never written (a stale prefix-cache hit) or overwritten by another
request (a block handed out twice) fails here, not only as wrong text in an end-to-end test.
"""
from __future__ import annotations

import random
import subprocess
import sys
from typing import Callable

import msgspec
import pytest

from folio.core.kv_cache_layout import kv_cache_layout
from folio.core.kv_cache_manager import KVCacheManager, cdiv, make_kv_cache_manager
from folio.core.engine_core_outputs import EngineCoreOutput
from folio.core.request import Request, RequestStatus
from folio.core.scheduler import ScheduledStep, Scheduler
from folio.core.step_messages import ModelRunnerOutput
from folio.core.step_messages import SchedulerOutput as StepMessage
from folio.sampling_params import SamplingParams

BS = 4
EOS = 2

def sampled_output(tokens: dict[str, int]) -> ModelRunnerOutput:
    """A worker's reply sampling one token per listed request."""
    return ModelRunnerOutput(req_ids=list(tokens), sampled_token_ids=[[t] for t in tokens.values()])



def make_request(rid: str, prompt_len: int | list[int], *, max_model_len: int = 256,
                 priority: int = 0, arrival_time: float | None = None,
                 eos: tuple[int, ...] = (EOS,), **params) -> Request:
    prompt = (list(range(100, 100 + prompt_len)) if isinstance(prompt_len, int) else prompt_len)
    params.setdefault("max_tokens", 5)
    params.setdefault("temperature", 0)
    return Request(rid, prompt, SamplingParams(**params), eos, block_size=BS,
                   max_model_len=max_model_len, priority=priority, arrival_time=arrival_time)


def make_scheduler(*, num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64,
                   max_model_len: int = 256, chunked: bool = True, policy: str = "fcfs",
                   caching: bool = True, windows: tuple[int | None, ...] = ()) -> Scheduler:
    """`windows`: a sliding window per model layer (None: full attention), for KV cache groups;
    empty: today's one group."""
    kv = (make_kv_cache_manager(kv_cache_layout(windows, len(windows)), num_blocks, BS, caching)
          if windows else KVCacheManager(num_blocks, BS, caching))
    return Scheduler(kv_cache_manager=kv,
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len, enable_chunked_prefill=chunked, policy=policy)


class FakeRunner:
    """Samples `next_token(request)` for each request whose step reaches its last token."""

    def __init__(self, next_token: Callable[[Request], int] | None = None,
                 max_steps: int = 500, windows: tuple[int | None, ...] = (None,),
                 null_block_id: int | None = None) -> None:
        # Never EOS by default: 1000 + the index of the output token.
        self.next_token = next_token or (lambda req: 1000 + req.num_output_tokens)
        # Tests loop "until done"; a scheduler that stops making progress fails, not hangs.
        self.max_steps = max_steps
        self.num_steps = 0
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        # Which requests sampled in the last step (`samples` is read live, so tests cannot ask
        # it after update_from_output has appended the token).
        self.sampled: set[str] = set()
        self.worker = MessageMirror(null_block_id)
        # The sliding window of each KV cache group (None = full attention): a group's reads
        # are checked inside its window only, where its blocks must still be its own.
        self.windows = windows

    def execute(self, out: ScheduledStep) -> ModelRunnerOutput:
        self.num_steps += 1
        assert self.num_steps <= self.max_steps, "no progress"
        self.worker.apply(out)
        # All of a step's K/V is written before attention reads any of it.
        # Block ids come from one pool for every group, so a slot is keyed by block id alone:
        # a group reading a block another group (or request) took over fails too.
        for item in out.scheduled:
            tokens = item.request.all_token_ids
            end = item.num_computed_tokens + item.num_new_tokens
            assert end <= item.request.num_tokens
            assert len(item.block_ids) == len(self.windows)
            for ids in item.block_ids:
                assert len(ids) >= cdiv(end, BS), "not enough blocks for the step"
                for pos in range(item.num_computed_tokens, end):
                    self.slots[(ids[pos // BS], pos % BS)] = tuple(tokens[:pos + 1])
        sampled: dict[str, int] = {}
        self.sampled = {s.request_id for s in out.scheduled if s.samples}
        for item in out.scheduled:
            tokens = item.request.all_token_ids
            for ids, window in zip(item.block_ids, self.windows):
                first = 0 if window is None else max(0, item.num_computed_tokens - window + 1)
                for pos in range(first, item.num_computed_tokens + item.num_new_tokens):
                    slot = (ids[pos // BS], pos % BS)
                    assert self.slots.get(slot) == tuple(tokens[:pos + 1]), (
                        f"{item.request_id} reads stale KV at position {pos} (block {slot[0]})")
            if item.samples:
                sampled[item.request_id] = self.next_token(item.request)
        return sampled_output(sampled)


class MessageMirror:
    """A worker's view built from the step messages alone (through msgpack), checked against
    the scheduler's own records every step: the diffs must add up to the whole."""

    def __init__(self, null_block_id: int | None = None) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[list[int]]] = {}
        # Where the scheduler's table holds the null block (freed out of a window), the
        # worker keeps the id it was sent: nobody reads there.
        self.null_block_id = null_block_id

    def apply(self, out: ScheduledStep) -> None:
        message = msgspec.msgpack.decode(msgspec.msgpack.encode(out.message), type=StepMessage)
        assert message == out.message
        for rid in message.finished_req_ids:
            self.tokens.pop(rid, None)
            self.blocks.pop(rid, None)
        for rid in message.preempted_req_ids:
            self.blocks[rid] = []
        computed = {}
        for new in message.scheduled_new_reqs:
            assert new.req_id not in self.tokens, "sent whole twice"
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.blocks[new.req_id] = [list(ids) for ids in new.block_ids]
            computed[new.req_id] = new.num_computed_tokens
        for diff in message.scheduled_cached_reqs:
            if diff.resumed_from_preemption or not self.blocks[diff.req_id]:
                self.blocks[diff.req_id] = [[] for _ in diff.new_block_ids]
            for held, ids in zip(self.blocks[diff.req_id], diff.new_block_ids):
                held += ids
            self.tokens[diff.req_id] += diff.new_token_ids
            computed[diff.req_id] = diff.num_computed_tokens
        assert list(message.num_scheduled_tokens) == [s.request_id for s in out.scheduled]
        assert message.sampling_req_ids == [s.request_id for s in out.scheduled if s.samples]
        for item in out.scheduled:
            rid = item.request_id
            null = self.null_block_id
            assert [[b for b, ours in zip(held, ids) if ours != null] for held, ids in
                    zip(self.blocks[rid], item.block_ids)] == \
                [[b for b in ids if b != null] for ids in item.block_ids]
            assert [len(held) for held in self.blocks[rid]] == [len(ids) for ids in item.block_ids]
            assert self.tokens[rid] == item.request.all_token_ids
            assert computed[rid] == item.num_computed_tokens
            assert message.num_scheduled_tokens[rid] == item.num_new_tokens


def check_step(sched: Scheduler, out: ScheduledStep) -> None:
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(out.scheduled) <= sched.max_num_seqs
    assert len(sched.running) <= sched.max_num_seqs
    assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
    assert all(s.num_new_tokens > 0 for s in out.scheduled)
    sched.kv.block_pool.check_invariants()


def step(sched: Scheduler, runner: FakeRunner) -> tuple[ScheduledStep, list[EngineCoreOutput]]:
    out = sched.schedule()
    check_step(sched, out)
    outputs = sched.update_from_output(out, runner.execute(out))
    sched.kv.block_pool.check_invariants()
    return out, outputs


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000
                      ) -> dict[str, EngineCoreOutput]:
    """Step until idle; returns each request's final output."""
    finished: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        _, outputs = step(sched, runner)
        for o in outputs:
            if o.finished:
                finished[o.request_id] = o
    assert not sched.has_unfinished_requests(), "did not finish"
    assert_all_free(sched)
    return finished


def assert_all_free(sched: Scheduler) -> None:
    pool = sched.kv.block_pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert sched.kv.req_to_blocks == {}
    assert sched.running == [] and len(sched.waiting) == 0


def held_blocks(tables: list, null: object) -> list:
    """A request's blocks in the manager's record: one list (one group) or one per group,
    without the null block."""
    if tables and isinstance(tables[0], list):
        return [b for table in tables for b in table if b is not null]
    return list(tables)


def num_new(out: ScheduledStep) -> dict[str, int]:
    return {s.request_id: s.num_new_tokens for s in out.scheduled}


# ---- the core stays torch-free -----------------------------------------------------------

def test_core_does_not_import_torch():
    code = ("import sys; import folio.core.scheduler, folio.core.kv_cache_manager; "
            "assert 'torch' not in sys.modules, 'folio.core pulled in torch'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ---- budgets -----------------------------------------------------------------------------

def test_single_request_lifecycle():
    sched = make_scheduler()
    runner = FakeRunner()
    req = make_request("a", 6, max_tokens=3)
    sched.add_request(req)
    out, outputs = step(sched, runner)
    assert num_new(out) == {"a": 6} and runner.sampled == {"a"}
    assert outputs[0].new_token_ids == [1000] and not outputs[0].finished
    assert req.status == RequestStatus.RUNNING and req.num_cached_tokens == 0
    out, _ = step(sched, runner)
    assert num_new(out) == {"a": 1} and out.scheduled[0].token_ids == [1000]
    out, outputs = step(sched, runner)
    assert outputs[0].finish_reason == "length"
    assert req.output_token_ids == [1000, 1001, 1002]
    assert_all_free(sched)
    # The worker is told once, on the next step.
    assert sched.schedule().finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()


def test_token_budget_and_max_num_seqs_respected():
    sched = make_scheduler(budget=16, max_num_seqs=3, num_blocks=64)
    runner = FakeRunner()
    for i in range(8):
        sched.add_request(make_request(f"r{i}", 5 + 3 * i, max_tokens=4))
    finished = {}
    peak = 0
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out, outputs = step(sched, runner)
        peak = max(peak, len(out.scheduled))
        finished.update({o.request_id: o for o in outputs if o.finished})
    assert peak == 3
    assert len(finished) == 8
    assert_all_free(sched)


def test_duplicate_request_id_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError):
        sched.add_request(make_request("a", 4))


# ---- chunked prefill ---------------------------------------------------------------------

def test_chunked_prefill_splits_long_prompt_while_decode_continues():
    sched = make_scheduler(budget=10)
    runner = FakeRunner()
    decoder = make_request("dec", 3, max_tokens=20)
    sched.add_request(decoder)
    step(sched, runner)                          # decoder prefilled, now decoding
    long = make_request("long", 40, max_tokens=2)
    sched.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        before = decoder.num_output_tokens
        out, _ = step(sched, runner)
        sizes = num_new(out)
        assert sizes["dec"] == 1                 # a token every step
        assert decoder.num_output_tokens == before + 1
        assert sum(sizes.values()) <= 10
        chunks.append(sizes["long"])
        assert ("long" in runner.sampled) == (long.num_output_tokens == 1)
    assert chunks == [9, 9, 9, 9, 4]
    run_to_completion(sched, runner)


def test_without_chunked_prefill_a_prompt_waits_for_budget():
    sched = make_scheduler(budget=10, chunked=False)
    runner = FakeRunner()
    decoder = make_request("dec", 3, max_tokens=4)
    sched.add_request(decoder)
    step(sched, runner)
    big = make_request("big", 10, max_tokens=1)
    sched.add_request(big)
    # 9 tokens left after the decode: the 10-token prompt must not be split.
    while decoder.num_output_tokens < 4:
        out, _ = step(sched, runner)
        assert "big" not in num_new(out)
        assert big.status == RequestStatus.WAITING
    out, _ = step(sched, runner)
    assert num_new(out) == {"big": 10}
    assert big.is_finished
    assert_all_free(sched)


def test_chunked_prefill_of_a_single_huge_prompt():
    sched = make_scheduler(budget=8, num_blocks=32)
    runner = FakeRunner()
    req = make_request("a", 30, max_tokens=2)
    sched.add_request(req)
    sizes = []
    while not req.is_finished:
        out, _ = step(sched, runner)
        sizes.append(num_new(out)["a"])
    assert sizes == [8, 8, 8, 6, 1]
    assert_all_free(sched)


# ---- prefix caching through the scheduler ------------------------------------------------

def test_prefix_cache_hit_skips_computed_tokens():
    sched = make_scheduler()
    runner = FakeRunner()
    sched.add_request(make_request("a", 10, max_tokens=1))
    run_to_completion(sched, runner)
    b = make_request("b", 10, max_tokens=1)
    sched.add_request(b)
    out, outputs = step(sched, runner)
    assert out.scheduled[0].num_computed_tokens == 8 and num_new(out) == {"b": 2}
    assert b.num_cached_tokens == 8 and outputs[0].num_cached_tokens == 8
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)
    assert_all_free(sched)


def test_same_step_prefix_reuse_is_safe():
    # Two identical prompts in one step: the second may hit the first's blocks, cached as this
    # step writes them. The KV oracle in the runner checks that nothing stale is read.
    sched = make_scheduler()
    runner = FakeRunner()
    sched.add_request(make_request("a", 13, max_tokens=3))
    sched.add_request(make_request("b", 13, max_tokens=3))
    out, _ = step(sched, runner)
    assert num_new(out) == {"a": 13, "b": 1}
    run_to_completion(sched, runner)


# ---- preemption --------------------------------------------------------------------------

def test_fcfs_preempts_latest_running_and_it_resumes():
    # 6 blocks of 4 tokens. Three 7-token prompts take 2 blocks each: the pool is full, and the
    # first decode that crosses a block boundary must preempt someone.
    sched = make_scheduler(num_blocks=6, budget=64)
    runner = FakeRunner()
    reqs = [make_request(f"r{i}", [10 * i + j for j in range(7)], max_tokens=6)
            for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    step(sched, runner)                      # all three prefilled: 7 tokens + 1 sampled
    assert sched.kv.num_free_blocks == 0
    out, _ = step(sched, runner)             # 8 tokens fit in 2 blocks
    assert out.preempted_req_ids == []
    out, _ = step(sched, runner)             # the ninth needs a third block
    assert out.preempted_req_ids == ["r2"]
    assert reqs[2].status == RequestStatus.PREEMPTED and reqs[2].num_computed_tokens == 0
    assert reqs[2].num_preemptions == 1 and sched.stats().num_preemptions == 1
    assert set(num_new(out)) == {"r0", "r1"}  # r2's blocks went to r0 and r1
    assert [r.request_id for r in sched.waiting][0] == "r2"
    finished = run_to_completion(sched, runner)
    for r in reqs:
        assert r.output_token_ids == [1000 + i for i in range(6)]
        assert finished[r.request_id].finish_reason == "length"


def test_fcfs_preempted_request_goes_back_to_the_front():
    sched = make_scheduler(num_blocks=4, max_num_seqs=2)
    runner = FakeRunner()
    sched.add_request(make_request("a", 7, max_tokens=6))
    sched.add_request(make_request("b", 7, max_tokens=6))
    step(sched, runner)
    sched.add_request(make_request("c", 3, max_tokens=1))
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.preempted_req_ids == ["b"]
    # b was preempted, so it is ahead of c, which arrived later.
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    run_to_completion(sched, runner)


def test_priority_preempts_lowest_priority_and_it_resumes():
    sched = make_scheduler(num_blocks=6, policy="priority")
    runner = FakeRunner()
    low = make_request("low", [1, 2, 3, 4, 5, 6, 7], priority=5, max_tokens=6)
    hi1 = make_request("hi1", [11, 12, 13, 14, 15, 16, 17], priority=0, max_tokens=6)
    hi2 = make_request("hi2", [21, 22, 23, 24, 25, 26, 27], priority=1, max_tokens=6)
    # low runs first, so it is not the last of the running list when blocks run out.
    sched.add_request(low)
    step(sched, runner)
    sched.add_request(hi1)
    sched.add_request(hi2)
    out, _ = step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["low", "hi1", "hi2"]
    preempted = []
    while not (hi1.is_finished and hi2.is_finished):
        out, _ = step(sched, runner)
        preempted += out.preempted_req_ids
        # When low preempts itself, the higher-priority requests after it must still run.
        still_running = {r.request_id for r in (hi1, hi2) if r.status == RequestStatus.RUNNING}
        assert still_running <= set(num_new(out))
    assert preempted and set(preempted) == {"low"}
    assert low.num_preemptions >= 1 and hi1.num_preemptions == hi2.num_preemptions == 0
    run_to_completion(sched, runner)
    for r in (low, hi1, hi2):
        assert r.output_token_ids == [1000 + i for i in range(6)]


def test_undoing_a_scheduled_victim_does_not_skip_the_next_request():
    sched = make_scheduler(num_blocks=5, policy="priority")
    runner = FakeRunner()
    low = make_request("low", 6, priority=5, max_tokens=8)
    sched.add_request(low)
    step(sched, runner)
    sched.add_request(make_request("hi1", [11, 12, 13, 14], priority=0, max_tokens=8))
    sched.add_request(make_request("hi2", [21, 22, 23, 24, 25], priority=1, max_tokens=8))
    step(sched, runner)
    assert sched.kv.num_free_blocks == 0
    # low (scheduled first, no new block needed) is undone when hi1 needs a block; hi2, after
    # hi1 in the running list, must still get its token.
    out, _ = step(sched, runner)
    assert out.preempted_req_ids == ["low"]
    assert num_new(out) == {"hi1": 1, "hi2": 1}
    run_to_completion(sched, runner)


def _undone_step_scenario() -> tuple[Scheduler, FakeRunner, Request]:
    """Priority policy; `w` is scheduled first in a step, then preempted by `r` in the same
    step, so that step never runs. Returns right after that step.

    `v` and `w` share an 8-token prompt and start together: `w` hits `v`'s block 0, and its
    own block 1 duplicates `v`'s, so it is left out of the index. That uncached block is
    handed out first when `w` is freed, which keeps `w`'s last block alive in the free queue.
    """
    sched = make_scheduler(num_blocks=5, policy="priority")
    runner = FakeRunner()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    sched.add_request(make_request("v", prompt, priority=0, max_tokens=1))
    w = make_request("w", prompt, priority=2, max_tokens=10)
    sched.add_request(w)
    for _ in range(3):
        step(sched, runner)                  # v done; w decodes up to 11 tokens
    sched.add_request(make_request("r", prompt + [20, 21, 22, 23], priority=0, max_tokens=2))
    step(sched, runner)                      # r prefills; the pool is full
    assert sched.kv.num_free_blocks == 0
    # w's decode (position 11) completes its block 2; r's needs a new block, so w, lower
    # priority and already scheduled this step, is preempted and never computes position 11.
    out, _ = step(sched, runner)
    assert out.preempted_req_ids == ["w"] and num_new(out) == {"r": 1}
    assert w.num_tokens == 12
    return sched, runner, w


def test_preempted_in_the_same_step_leaves_no_unwritten_block_cached():
    sched, _, w = _undone_step_scenario()
    block = sched.kv.block_pool.get_cached_block(w.block_hashes[2])
    assert block is None, f"{block} is indexed, but position 11 of it was never computed"


def test_preempted_in_the_same_step_then_prefix_reuse_reads_no_stale_kv():
    # The observable effect: a follow-up whose prompt extends w's tokens (a next chat turn)
    # must not attend over the slot w never wrote. The runner's KV oracle checks that.
    sched, runner, w = _undone_step_scenario()
    follow_up = make_request("next", w.all_token_ids + [9, 9], priority=0, max_tokens=1)
    sched.add_request(follow_up)
    run_to_completion(sched, runner)
    assert follow_up.num_output_tokens == 1 and w.num_output_tokens == 10


def test_preempted_request_recomputes_outputs_too():
    # After preemption the request recomputes prompt and already-sampled tokens, and only
    # samples once it reaches the end of them.
    sched = make_scheduler(num_blocks=4, caching=False)
    runner = FakeRunner()
    a = make_request("a", 7, max_tokens=6)
    b = make_request("b", 7, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.preempted_req_ids == ["b"]
    tokens_before = b.num_tokens
    while "b" not in {s.request_id for s in out.scheduled}:
        out, _ = step(sched, runner)
    item = next(s for s in out.scheduled if s.request_id == "b")
    assert item.num_computed_tokens == 0 and item.num_new_tokens == tokens_before
    assert "b" in runner.sampled
    run_to_completion(sched, runner)
    assert b.output_token_ids == [1000 + i for i in range(6)]


# ---- priority ordering -------------------------------------------------------------------

def test_priority_policy_schedules_lower_values_first():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    runner = FakeRunner()
    for rid, prio, t in [("p3", 3, 1.0), ("p1", 1, 2.0), ("p2a", 2, 3.0), ("p2b", 2, 0.5)]:
        sched.add_request(make_request(rid, 4, priority=prio, arrival_time=t, max_tokens=1))
    order = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        order += [s.request_id for s in out.scheduled]
    # Same priority: earlier arrival first.
    assert order == ["p1", "p2b", "p2a", "p3"]


def test_fcfs_policy_ignores_priority():
    sched = make_scheduler(policy="fcfs", max_num_seqs=1)
    runner = FakeRunner()
    for rid, prio in [("a", 3), ("b", 1), ("c", 2)]:
        sched.add_request(make_request(rid, 4, priority=prio, max_tokens=1))
    order = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        order += [s.request_id for s in out.scheduled]
    assert order == ["a", "b", "c"]


# ---- abort -------------------------------------------------------------------------------

def test_abort_waiting_request():
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner()
    sched.add_request(make_request("a", 4, max_tokens=3))
    waiting = make_request("w", 4)
    sched.add_request(waiting)
    step(sched, runner)
    assert [r.request_id for r in sched.abort_requests(["w"])] == ["w"]
    assert waiting.status == RequestStatus.FINISHED_ABORTED
    assert [r.request_id for r in sched.waiting] == []
    assert "w" in sched.schedule().finished_req_ids
    sched.abort_requests(["a"])
    assert_all_free(sched)


def test_abort_running_mid_prefill():
    sched = make_scheduler(budget=8)
    runner = FakeRunner()
    req = make_request("a", 30)
    sched.add_request(req)
    step(sched, runner)
    assert 0 < req.num_computed_tokens < req.num_prompt_tokens
    assert sched.kv.num_free_blocks < sched.kv.block_pool.num_blocks
    sched.abort_requests(["a"])
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert_all_free(sched)


def test_abort_running_decode():
    sched = make_scheduler()
    runner = FakeRunner()
    req = make_request("a", 6, max_tokens=10)
    other = make_request("b", 6, max_tokens=3)
    sched.add_request(req)
    sched.add_request(other)
    step(sched, runner)
    step(sched, runner)
    sched.abort_requests(["a"])
    assert "a" not in sched.kv.req_to_blocks
    sched.kv.block_pool.check_invariants()
    out, _ = step(sched, runner)
    assert "a" in out.finished_req_ids and "a" not in num_new(out)
    run_to_completion(sched, runner)
    assert other.num_output_tokens == 3


def test_abort_between_schedule_and_update():
    sched = make_scheduler()
    runner = FakeRunner()
    req = make_request("a", 6)
    sched.add_request(req)
    out = sched.schedule()
    runner_out = runner.execute(out)
    sched.abort_requests(["a"])
    assert sched.update_from_output(out, runner_out) == []
    assert req.output_token_ids == []
    assert_all_free(sched)


def test_abort_finished_or_unknown_is_a_no_op():
    sched = make_scheduler()
    runner = FakeRunner()
    req = make_request("a", 4, max_tokens=1)
    sched.add_request(req)
    run_to_completion(sched, runner)
    assert sched.abort_requests(["a", "nope"]) == []
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_free(sched)


def test_finish_requests_sets_the_given_status():
    sched = make_scheduler()
    runner = FakeRunner()
    req = make_request("a", 4, max_tokens=10)
    sched.add_request(req)
    step(sched, runner)
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert_all_free(sched)


# ---- stop conditions ---------------------------------------------------------------------

def scripted(tokens: list[int]) -> FakeRunner:
    """A runner that samples the given tokens in order (same list for every request)."""
    return FakeRunner(lambda req: tokens[req.num_output_tokens])


def finish(req: Request, runner: FakeRunner, **sched_kw) -> EngineCoreOutput:
    sched = make_scheduler(**sched_kw)
    sched.add_request(req)
    finished = run_to_completion(sched, runner)
    return finished[req.request_id]


def test_eos_stops():
    req = make_request("a", 4, max_tokens=10)
    out = finish(req, scripted([7, 8, EOS, 9, 9]))
    assert req.output_token_ids == [7, 8, EOS]
    assert out.finish_reason == "stop" and out.stop_reason is None


def test_ignore_eos_keeps_going():
    req = make_request("a", 4, max_tokens=5, ignore_eos=True)
    out = finish(req, scripted([7, EOS, EOS, 8, 9, 10]))
    assert req.output_token_ids == [7, EOS, EOS, 8, 9]
    assert out.finish_reason == "length"


def test_stop_token_ids_stop_with_reason():
    req = make_request("a", 4, max_tokens=10, stop_token_ids=[42, 43])
    out = finish(req, scripted([7, 43, 9]))
    assert req.output_token_ids == [7, 43]
    assert out.finish_reason == "stop" and out.stop_reason == 43
    # stop_token_ids work with ignore_eos too.
    req = make_request("b", 4, max_tokens=10, stop_token_ids=[42], ignore_eos=True)
    assert finish(req, scripted([EOS, 42, 9])).stop_reason == 42


def test_max_tokens_caps_length():
    req = make_request("a", 4, max_tokens=3)
    out = finish(req, FakeRunner())
    assert req.num_output_tokens == 3 and out.finish_reason == "length"


def test_max_model_len_caps_length():
    req = make_request("a", 6, max_model_len=9, max_tokens=None)
    assert req.max_tokens == 3
    out = finish(req, FakeRunner(), max_model_len=9)
    assert req.num_tokens == 9 and out.finish_reason == "length"


def test_min_tokens_suppresses_eos_and_stop_tokens():
    req = make_request("a", 4, max_tokens=10, min_tokens=3, stop_token_ids=[42])
    out = finish(req, scripted([EOS, 42, 7, EOS, 9]))
    # Outputs 1 and 2 are under min_tokens; output 4 is an EOS past it.
    assert req.output_token_ids == [EOS, 42, 7, EOS]
    assert out.finish_reason == "stop"
    req = make_request("b", 4, max_tokens=10, min_tokens=2, stop_token_ids=[42])
    out = finish(req, scripted([42, 42, 9]))
    assert req.output_token_ids == [42, 42] and out.stop_reason == 42


def test_max_tokens_wins_over_min_tokens_bound_eos():
    req = make_request("a", 4, max_tokens=2, min_tokens=2)
    out = finish(req, scripted([EOS, EOS, EOS]))
    assert req.output_token_ids == [EOS, EOS]
    assert out.finish_reason == "stop"


def test_outputs_carry_one_token_per_step():
    sched = make_scheduler()
    runner = FakeRunner()
    sched.add_request(make_request("a", 5, max_tokens=3))
    seen = []
    while sched.has_unfinished_requests():
        _, outputs = step(sched, runner)
        for o in outputs:
            assert len(o.new_token_ids) == 1
            assert o.first_scheduled_time is not None
            seen += o.new_token_ids
    assert seen == [1000, 1001, 1002]


# ---- randomized stress -------------------------------------------------------------------

# KV cache layouts for the stress test: (per-layer windows, blocks). One group of full
# attention; one sliding group; a full group and two sliding ones (a sequence of 64 tokens
# then holds 16 + 2 x 8 blocks, with a step of 24 tokens).
STRESS_LAYOUTS = {"full": ((), 20), "sliding": ((6, 6), 12), "hybrid": ((6, None, 6), 40)}


@pytest.mark.parametrize("layout", sorted(STRESS_LAYOUTS))
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_stress(policy: str, chunked: bool, seed: int, layout: str):
    rng = random.Random(seed)
    # Without chunked prefill the config requires budget >= max_model_len: a preempted request
    # must be able to recompute all its tokens in one step.
    budget, max_model_len = (24, 64) if chunked else (32, 32)
    windows, num_blocks = STRESS_LAYOUTS[layout]
    sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=6, budget=budget, policy=policy,
                           chunked=chunked, max_model_len=max_model_len, windows=windows)
    null = sched.kv.block_pool.null_block
    group_windows = (tuple(g.sliding_window for g in sched.kv.layout.groups) if windows
                     else (None,))
    # Random tokens from a small vocabulary: prompts share prefixes often enough to hit.
    runner = FakeRunner(lambda req: rng.choice([EOS] + [5] * 15 + [6] * 15 + [7] * 15),
                        max_steps=5000, windows=group_windows,
                        null_block_id=None if null is None else null.block_id)
    expected: dict[str, Request] = {}
    aborted: set[str] = set()
    finished: dict[str, EngineCoreOutput] = {}
    next_id = 0
    for step_no in range(runner.max_steps):
        if step_no < 200 and rng.random() < 0.3:
            for _ in range(rng.randint(1, 3)):
                length = rng.randint(1, 40 if chunked else 24)
                prefix = [1, 2, 3, 4, 5, 6, 7, 8][:rng.randint(0, 8)]
                if expected and rng.random() < 0.3:
                    # A next turn or a parallel sample: another request's tokens so far.
                    prefix = rng.choice(list(expected.values())).all_token_ids[:length]
                prompt = (prefix + [rng.randint(10, 14) for _ in range(length)])[:length]
                req = make_request(f"r{next_id}", prompt, priority=rng.randint(0, 3),
                                   max_tokens=(n := rng.randint(1, 12)),
                                   max_model_len=max_model_len,
                                   min_tokens=min(n, rng.choice([0, 0, 2])))
                next_id += 1
                expected[req.request_id] = req
                sched.add_request(req)
        if rng.random() < 0.1 and expected:
            victim = rng.choice(sorted(expected))
            if sched.abort_requests([victim]):
                aborted.add(victim)
        out = sched.schedule()
        check_step(sched, out)
        runner_out = runner.execute(out)
        if rng.random() < 0.05 and out.scheduled:   # abort while the step "runs"
            victim = rng.choice(out.scheduled).request_id
            if sched.abort_requests([victim]):
                aborted.add(victim)
        for o in sched.update_from_output(out, runner_out):
            if o.finished:
                finished[o.request_id] = o
        pool = sched.kv.block_pool
        pool.check_invariants()
        held = sum(len(held_blocks(b, null)) for b in sched.kv.req_to_blocks.values())
        assert pool.num_usable_blocks - pool.num_free_blocks <= held
        if step_no >= 200 and not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests()
    assert_all_free(sched)
    assert set(finished) | aborted == set(expected)
    assert not set(finished) & aborted
    for rid, o in finished.items():
        req = expected[rid]
        assert 1 <= req.num_output_tokens <= req.max_tokens
        if o.finish_reason == "length":
            assert req.num_output_tokens == req.max_tokens
        else:
            assert o.finish_reason == "stop" and req.output_token_ids[-1] == EOS
            assert req.num_output_tokens >= req.sampling_params.min_tokens
    # The run exercised what it is meant to: prefix hits and preemption.
    assert sched.kv.stats.hits > 0
    assert sched.num_preemptions > 0
    print(f"steps={step_no} requests={len(expected)} aborted={len(aborted)} "
          f"preemptions={sched.num_preemptions} hits={sched.kv.stats.hits}")
