"""Pooling requests in the scheduler: they run their prompt (whole, or in chunks for a causal
model), are named in pooling_req_ids on their last chunk instead of sampling, and finish with
the worker's PooledData; per-token tasks never skip prompt tokens through the prefix cache."""
from __future__ import annotations

import msgspec

from folio.core.kv_cache_manager import KVCacheManager
from folio.core.request import Request, RequestStatus
from folio.core.scheduler import Scheduler
from folio.core.step_messages import ModelRunnerOutput, PooledData
from folio.core.step_messages import SchedulerOutput as StepMessage
from folio.pooling_params import PoolingParams
from folio.sampling_params import SamplingParams

BS = 4


def pooling_request(rid: str, prompt_len: int, task: str = "embed", start: int = 100,
                    types: list[int] | None = None) -> Request:
    return Request(rid, list(range(start, start + prompt_len)),
                   SamplingParams(max_tokens=1, temperature=0), (), block_size=BS,
                   max_model_len=64, pooling_params=PoolingParams(task=task),
                   token_type_ids=types)


def scheduler(budget: int = 64, chunked: bool = True, caching: bool = True) -> Scheduler:
    return Scheduler(kv_cache_manager=KVCacheManager(64, BS, caching), max_num_seqs=8,
                     max_num_batched_tokens=budget, max_model_len=64,
                     enable_chunked_prefill=chunked)


def pooled(*rids: str) -> ModelRunnerOutput:
    data = PooledData([2], b"\x00\x00\x80\x3f\x00\x00\x00\x40")   # [1.0, 2.0]
    return ModelRunnerOutput(pooler_output={rid: data for rid in rids})


def test_whole_prompt_pools_and_finishes_with_the_result():
    s = scheduler()
    s.add_request(pooling_request("a", 10, types=[0] * 5 + [1] * 5))
    s.add_request(pooling_request("b", 7, start=300))
    step = s.schedule()
    msg = step.message
    assert msg.num_scheduled_tokens == {"a": 10, "b": 7}
    assert msg.pooling_req_ids == ["a", "b"] and msg.sampling_req_ids == []
    new = {r.req_id: r for r in msg.scheduled_new_reqs}
    assert new["a"].pooling_params.task == "embed"
    assert new["a"].token_type_ids == [0] * 5 + [1] * 5 and new["b"].token_type_ids is None
    # the message crosses a process unchanged
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=StepMessage) == msg
    outs = {o.request_id: o for o in s.update_from_output(step, pooled("a", "b"))}
    assert outs["a"].finish_reason == "stop" and outs["a"].new_token_ids == []
    assert outs["a"].pooling_output.shape == [2]
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 64   # every block back


def test_causal_prompt_in_chunks_pools_on_the_last():
    s = scheduler(budget=6)
    s.add_request(pooling_request("a", 14))
    seen = []
    while s.has_unfinished_requests():
        step = s.schedule()
        seen.append((step.message.num_scheduled_tokens["a"], step.message.pooling_req_ids))
        out = pooled("a") if step.message.pooling_req_ids else ModelRunnerOutput()
        s.update_from_output(step, out)
    assert seen == [(6, []), (6, []), (2, ["a"])]


def test_without_chunked_prefill_a_prompt_waits_for_room_rather_than_splitting():
    s = scheduler(budget=12, chunked=False)
    s.add_request(pooling_request("a", 8))
    s.add_request(pooling_request("b", 8, start=300))
    step = s.schedule()
    assert step.message.num_scheduled_tokens == {"a": 8}
    s.update_from_output(step, pooled("a"))
    step = s.schedule()
    assert step.message.num_scheduled_tokens == {"b": 8}


def test_missing_result_fails_the_request_instead_of_hanging():
    s = scheduler()
    s.add_request(pooling_request("a", 5))
    step = s.schedule()
    [out] = s.update_from_output(step, ModelRunnerOutput())
    assert out.finish_reason == "error" and out.pooling_output is None
    assert not s.has_unfinished_requests()


def test_prefix_cache_skips_tokens_only_for_sequence_tasks():
    s = scheduler()
    s.add_request(pooling_request("warm", 12))
    s.update_from_output(s.schedule(), pooled("warm"))
    s.add_request(pooling_request("seq", 12))
    step = s.schedule()
    assert step.message.num_scheduled_tokens == {"seq": 12 - 8}   # two cached blocks
    s.update_from_output(step, pooled("seq"))
    s.add_request(pooling_request("tok", 12, task="token_embed"))
    step = s.schedule()
    assert step.message.num_scheduled_tokens == {"tok": 12}       # every row is needed
    s.update_from_output(step, pooled("tok"))


def test_aborted_pooling_request_is_dropped():
    s = scheduler(budget=4)
    s.add_request(pooling_request("a", 10))
    step = s.schedule()
    s.abort_requests(["a"])
    assert s.update_from_output(step, ModelRunnerOutput()) == []
    assert s.requests == {} and s.schedule().message.finished_req_ids == ["a"]
    assert pooling_request("x", 3).status == RequestStatus.WAITING
