"""LoRA adapters in the scheduler: running requests never hold more distinct adapters than
max_loras (the worker's slots); a request of one more adapter waits, keeps its place, and
runs once a slot's requests finish, while requests of adapters already running (and of the
base model) go ahead; the adapter crosses the step message to the worker; blocks of the same
prompt under different adapters are never shared; the stats name the adapters; a removed
adapter (remove_lora) rides the first step message once no request of it is left."""
from __future__ import annotations

import msgspec

from folio.core.kv_cache_manager import KVCacheManager
from folio.core.request import Request
from folio.core.scheduler import Scheduler
from folio.core.step_messages import ModelRunnerOutput
from folio.core.step_messages import SchedulerOutput as StepMessage
from folio.lora.request import LoRARequest
from folio.sampling_params import SamplingParams

BS = 4
A, B, C = (LoRARequest(n, i, f"/adapters/{n}") for i, n in ((1, "a"), (2, "b"), (3, "c")))


def request(rid: str, lora: LoRARequest | None, prompt=None, max_tokens: int = 2) -> Request:
    return Request(rid, prompt or list(range(10, 18)),
                   SamplingParams(max_tokens=max_tokens, temperature=0), (), block_size=BS,
                   max_model_len=64, lora_request=lora)


def scheduler(max_loras: int = 2, caching: bool = True) -> Scheduler:
    return Scheduler(kv_cache_manager=KVCacheManager(64, BS, caching), max_num_seqs=8,
                     max_num_batched_tokens=256, max_model_len=64, max_loras=max_loras)


def sample(step, token: int = 7) -> ModelRunnerOutput:
    rids = step.message.sampling_req_ids
    return ModelRunnerOutput(req_ids=list(rids), sampled_token_ids=[[token] for _ in rids])


def test_at_most_max_loras_adapters_run_and_the_next_waits_in_place():
    s = scheduler(max_loras=2)
    for rid, lora in (("a1", A), ("b1", B), ("c1", C), ("a2", A), ("base", None)):
        s.add_request(request(rid, lora))
    step = s.schedule()
    assert list(step.message.num_scheduled_tokens) == ["a1", "b1", "a2", "base"]
    new = {r.req_id: r for r in step.message.scheduled_new_reqs}
    assert new["a1"].lora_request == A and new["base"].lora_request is None
    # the adapter crosses a process boundary with the request
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(step.message), type=StepMessage)
    assert decoded == step.message
    assert [r.request_id for r in s.waiting] == ["c1"]
    stats = s.stats()
    assert stats.running_lora_adapters == ["a", "b"] and stats.waiting_lora_adapters == ["c"]
    assert stats.max_lora == 2
    # b1 finishes after two tokens (a1, a2 too): then c1 gets a slot
    s.update_from_output(step, sample(step))
    step = s.schedule()
    assert "c1" not in step.message.num_scheduled_tokens
    s.update_from_output(step, sample(step))
    step = s.schedule()
    assert list(step.message.num_scheduled_tokens) == ["c1"]
    assert set(step.message.finished_req_ids) == {"a1", "a2", "b1", "base"}
    assert s.stats().running_lora_adapters == ["c"]


def test_without_lora_limit_adapters_are_not_counted():
    s = scheduler(max_loras=0)
    for i, lora in enumerate((A, B, C)):
        s.add_request(request(f"r{i}", lora))
    assert len(s.schedule().message.num_scheduled_tokens) == 3


def test_same_prompt_under_two_adapters_shares_no_block():
    s = scheduler(max_loras=3)
    prompt = list(range(100, 116))            # four full blocks
    s.add_request(request("base", None, prompt))
    step = s.schedule()
    s.update_from_output(step, sample(step))
    # the same prompt again: the base model's cache hits, an adapter's does not
    s.add_request(request("base2", None, prompt))
    s.add_request(request("a", A, prompt))
    s.add_request(request("a-again", A, prompt))
    step = s.schedule()
    hits = {item.request_id: item.num_computed_tokens for item in step.scheduled}
    assert hits["base2"] > 0 and hits["a"] == 0
    s.update_from_output(step, sample(step))
    # once a's blocks are cached, the same adapter hits them and another adapter does not
    s.add_request(request("a3", A, prompt))
    s.add_request(request("b", B, prompt))
    step = s.schedule()
    hits = {item.request_id: item.num_computed_tokens for item in step.scheduled}
    assert hits["a3"] > 0 and hits["b"] == 0
    blocks = {item.request_id: item.block_ids[0] for item in step.scheduled}
    assert not set(blocks["a3"][:hits["a3"] // BS]) & set(blocks["b"])


def test_block_hashes_depend_on_the_adapter():
    prompt = list(range(16))
    base, a, b = (request(r, l, prompt) for r, l in (("x", None), ("y", A), ("z", B)))
    a_again = request("w", A, prompt)
    assert a.block_hashes == a_again.block_hashes
    assert len({base.block_hashes[0], a.block_hashes[0], b.block_hashes[0]}) == 3


def decoded(message: StepMessage) -> StepMessage:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=StepMessage)


def test_a_removed_adapter_rides_the_next_step_message():
    s = scheduler()
    assert s.remove_lora(A.lora_int_id) is False    # never sent to a worker: nothing to free
    s.add_request(request("a1", A, max_tokens=1))
    step = s.schedule()
    assert step.message.removed_lora_ids == [] and s.list_loras() == {1}
    s.update_from_output(step, sample(step))        # a1 finishes
    assert s.remove_lora(1) is True and s.has_lora_removals()
    assert s.list_loras() == set()
    step = s.schedule()                             # nothing runnable: an empty step
    assert step.is_empty and decoded(step.message).removed_lora_ids == [1]
    assert not s.has_lora_removals()
    assert s.remove_lora(1) is False                # removed already
    assert s.schedule().message.removed_lora_ids == []
    # a request of the id that comes after the removal does not hold it up: the worker drops
    # the adapter before the step loads it, so reads its files again
    s.add_request(request("a2", A, max_tokens=1))
    step = s.schedule()
    s.update_from_output(step, sample(step))
    assert s.remove_lora(1) is True
    s.add_request(request("a3", A, max_tokens=1))
    message = decoded(s.schedule().message)
    assert message.removed_lora_ids == [1]
    assert [r.lora_request for r in message.scheduled_new_reqs] == [A]
    assert s.list_loras() == {1}                    # sent again with a3


def test_a_removal_waits_for_the_requests_of_the_adapter():
    s = scheduler()
    s.add_request(request("a1", A, max_tokens=3))
    s.add_request(request("b1", B, max_tokens=3))
    step = s.schedule()
    s.update_from_output(step, sample(step))
    # removed while a1 and b1 run: each removal waits for its own adapter's request
    assert s.remove_lora(1) and s.remove_lora(2) is True
    s.add_request(request("a2", A, max_tokens=1))   # after the removal: does not hold it up
    step = s.schedule()
    assert set(step.message.num_scheduled_tokens) == {"a1", "b1", "a2"}
    assert step.message.removed_lora_ids == []      # a1 and b1 still run
    s.update_from_output(step, sample(step))        # a2 finishes
    step = s.schedule()
    assert step.message.removed_lora_ids == []
    s.update_from_output(step, sample(step))        # a1 and b1 finish
    assert decoded(s.schedule().message).removed_lora_ids == [1, 2]


def test_a_removal_waits_for_a_queued_request_of_the_adapter():
    """A request of the adapter queued before the removal would load it again right after
    it: the removal waits for it too."""
    s = scheduler(max_loras=1)
    s.add_request(request("b1", B, max_tokens=1))
    s.add_request(request("a1", A, max_tokens=1))   # waits: one slot, b holds it
    step = s.schedule()
    assert list(step.message.num_scheduled_tokens) == ["b1"]
    assert s.remove_lora(1) is True                 # not sent yet, but a request holds it
    s.update_from_output(step, sample(step))
    step = s.schedule()
    assert list(step.message.num_scheduled_tokens) == ["a1"]
    assert step.message.removed_lora_ids == []
    s.update_from_output(step, sample(step))
    assert s.schedule().message.removed_lora_ids == [1]
