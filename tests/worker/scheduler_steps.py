"""Real scheduler steps for worker tests: random requests through a real Scheduler (prefix
caching, chunked prefill, preemption in a tight cache, sync or async scheduling), each step
yielded with what the scheduler knew when it built it, and a fake sampler's tokens."""
from __future__ import annotations

import random
from dataclasses import dataclass

from folio.core.kv_cache_layout import kv_cache_layout
from folio.core.kv_cache_manager import KVCacheManager, make_kv_cache_manager
from folio.core.request import Request
from folio.core.scheduler import ScheduledStep, Scheduler
from folio.core.step_messages import ModelRunnerOutput
from folio.sampling_params import SamplingParams


@dataclass
class StepCase:
    step: ScheduledStep
    # Per scheduled request: its tokens as the scheduler knew them when scheduling (the worker
    # must know the same), its blocks and computed count.
    known_tokens: dict[str, list[int]]
    block_ids: dict[str, list[int]]
    # The token each pending input will be (sampled by the step before), by request id.
    pending_tokens: dict[str, int]
    # Each sampling request's row in the previous step's sampled ids.
    prev_rows: dict[str, int]
    # Every KV cache group's block ids (block_ids: group 0's).
    group_block_ids: dict[str, list[list[int]]]


def scheduler_steps(seed: int, *, block_size: int, max_model_len: int, max_reqs: int,
                    budget: int, num_blocks: int, async_scheduling: bool, num_steps: int,
                    vocab: int = 90, windows: tuple[int | None, ...] = ()):
    """`windows`: a sliding window per model layer, for KV cache groups (empty: one group)."""
    rng = random.Random(seed)
    kv = (make_kv_cache_manager(kv_cache_layout(windows, len(windows)), num_blocks, block_size)
          if windows else KVCacheManager(num_blocks, block_size, True))
    sched = Scheduler(kv_cache_manager=kv,
                      max_num_seqs=max_reqs, max_num_batched_tokens=budget,
                      max_model_len=max_model_len, async_scheduling=async_scheduling)
    counter = 0
    in_flight: tuple[ScheduledStep, dict[str, int]] | None = None
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 3 * block_size))]
                for _ in range(3)]
    for _ in range(num_steps):
        if rng.random() < 0.6:
            counter += 1
            prompt = rng.choice(prefixes)[:] if rng.random() < 0.5 else []
            prompt += [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_model_len // 3))]
            sched.add_request(Request(f"r{counter}", prompt[:max_model_len - 2],
                                      SamplingParams(max_tokens=rng.randint(1, 30)),
                                      block_size=block_size, max_model_len=max_model_len))
        step = sched.schedule()
        if step.is_empty:
            # Still a message: it tells the workers which requests finished meanwhile.
            yield StepCase(step, {}, {}, {}, {}, {})
            if in_flight is not None:
                sched.update_from_output(in_flight[0], _output(in_flight[1]))
                in_flight = None
            continue
        prev_tokens = in_flight[1] if in_flight is not None else {}
        prev_rows = ({rid: j for j, rid in enumerate(in_flight[0].message.sampling_req_ids)}
                     if in_flight is not None else {})
        case = StepCase(step, {s.request_id: list(s.request.all_token_ids) for s in step.scheduled},
                        {s.request_id: list(s.block_ids[0]) for s in step.scheduled},
                        {s.request_id: prev_tokens[s.request_id] for s in step.scheduled
                         if s.has_pending_input}, prev_rows,
                        {s.request_id: [list(ids) for ids in s.block_ids] for s in step.scheduled})
        yield case
        sampled = {rid: rng.randrange(3, vocab) for rid in step.message.sampling_req_ids}
        if in_flight is not None:
            sched.update_from_output(in_flight[0], _output(in_flight[1]))
        in_flight = (step, sampled)
        if not async_scheduling:
            sched.update_from_output(step, _output(sampled))
            in_flight = None


def _output(sampled: dict[str, int]) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=list(sampled), sampled_token_ids=[[t] for t in sampled.values()])
