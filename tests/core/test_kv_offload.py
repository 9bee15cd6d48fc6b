"""The host KV tier on the scheduler's side (folio/core/kv_offload.py), without a model:
evicted prefix blocks get host slots and save copies; a later prompt's blocks past its device
prefix hit are found there and loaded into new device blocks (counted as computed); LRU slots;
a slot being loaded is never overwritten in the same step; reset forgets everything."""
from __future__ import annotations

import pytest

from folio.core.kv_cache_manager import KVCacheManager
from folio.core.kv_offload import DiskKVIndex, HostKVTier
from folio.core.request import Request
from folio.core.scheduler import Scheduler
from folio.core.step_messages import ModelRunnerOutput
from folio.lora.request import LoRARequest
from folio.sampling_params import SamplingParams

BS = 4


def test_saves_lookups_and_lru() -> None:
    tier = HostKVTier(2)
    tier.on_evict("a", 5)
    tier.on_evict("b", 6)
    tier.on_evict("a", 9)                 # held already: only used again
    assert tier.take_step_copies().saves == [(5, 0), (6, 1)]
    assert tier.lookup(["a", "b", "c"]) == [0, 1] and tier.lookup(["c", "a"]) == []
    # full: the least recently used gives way; the lookup used "a" then "b", so "a"
    tier.on_evict("c", 7)
    assert tier.slot_of == {"b": 1, "c": 0} and tier.take_step_copies().saves == [(7, 0)]
    assert tier.usage == 1.0


def test_a_slot_being_loaded_is_not_overwritten_in_the_same_step() -> None:
    tier = HostKVTier(1)
    tier.on_evict("a", 3)
    tier.take_step_copies()
    tier.load([0], [8], ["a"])
    tier.on_evict("b", 4)                 # the only slot is read this step: "b" is dropped
    copies = tier.take_step_copies()
    assert (copies.saves, copies.loads) == ([], [(0, 8)]) and "b" not in tier.slot_of
    tier.on_evict("b", 4)                 # the next step it may take it
    assert tier.take_step_copies().saves == [(4, 0)]
    tier.reset()
    assert tier.slot_of == {} and tier.lookup(["b"]) == []
    with pytest.raises(ValueError, match="at least one block"):
        HostKVTier(0)


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1, temperature=0), (2,),
                   block_size=BS, max_model_len=256)


def _run_to_end(s: Scheduler, r: Request) -> list:
    """Schedule the request until it finishes (one token); the step messages."""
    s.add_request(r)
    messages = []
    while r.request_id in s.requests:
        step = s.schedule()
        messages.append(step.message)
        s.update_from_output(step, ModelRunnerOutput(req_ids=[r.request_id],
                                                     sampled_token_ids=[[50]]))
    return messages


def _evicting_scheduler() -> tuple[KVCacheManager, HostKVTier, Scheduler, list[int], list]:
    """A 9-block pool with a 16-slot host tier; prompt A (4 full blocks + 1 token) has run,
    then prompts B and C took its blocks (saved as they were evicted). Returns the manager,
    the tier, the scheduler, A's prompt and the saves made."""
    kv = KVCacheManager(9, BS, True)
    tier = HostKVTier(16)
    s = Scheduler(kv_cache_manager=kv, max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=256, host_tier=tier)
    prompt_a = list(range(100, 117))
    _run_to_end(s, _request("a", prompt_a))
    saves = []
    for rid, first in (("b", 200), ("c", 300)):
        saves += [pair for m in _run_to_end(s, _request(rid, list(range(first, first + 17))))
                  for pair in m.kv_saves]
    return kv, tier, s, prompt_a, saves


def test_an_evicted_prefix_comes_back_from_the_host() -> None:
    """Prompt A's evicted blocks, saved to the host, come back: 4 blocks loaded into new
    device blocks, 16 tokens counted as computed, one computed."""
    kv, tier, s, prompt_a, saves = _evicting_scheduler()
    assert len(saves) == 4 and tier.stats.saved_blocks == 4      # A's 4 full blocks
    messages = _run_to_end(s, _request("a2", prompt_a))
    first = messages[0]
    assert len(first.kv_loads) == 4
    assert {slot for slot, _ in first.kv_loads} == {slot for _, slot in saves}
    new = first.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 16 and first.num_scheduled_tokens == {"a2": 1}
    assert [block for _, block in first.kv_loads] == new.block_ids[0][:4]
    assert tier.stats.hit_blocks == 4 and tier.stats.loaded_blocks == 4
    kv.block_pool.check_invariants()


def test_a_salted_prompt_finds_nothing_of_another_tenant() -> None:
    _, _, s, prompt, _ = _evicting_scheduler()
    salted = Request("s", prompt, SamplingParams(max_tokens=1, temperature=0), (2,),
                     block_size=BS, max_model_len=256, cache_salt="tenant-2")
    messages = _run_to_end(s, salted)
    assert messages[0].kv_loads == [] and messages[0].num_scheduled_tokens == {"s": 17}



def test_an_adapters_prompt_finds_nothing_of_the_base_models() -> None:
    """A LoRA adapter is another tenant: its K/V differ from the base model's, so its blocks
    hash apart in the host tier too. The base model's prompt still finds its own."""
    _, _, s, prompt, _ = _evicting_scheduler()
    adapted = Request("l", prompt, SamplingParams(max_tokens=1, temperature=0), (2,),
                      block_size=BS, max_model_len=256,
                      lora_request=LoRARequest("a", 1, "/unused/adapter"))
    messages = _run_to_end(s, adapted)
    assert messages[0].kv_loads == [] and messages[0].num_scheduled_tokens == {"l": 17}
    messages = _run_to_end(s, _request("a2", prompt))
    assert len(messages[0].kv_loads) == 4 and messages[0].num_scheduled_tokens == {"a2": 1}

def test_the_tier_needs_one_cached_group() -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        Scheduler(kv_cache_manager=KVCacheManager(8, BS, False), max_num_seqs=2,
                  max_num_batched_tokens=16, max_model_len=64, host_tier=HostKVTier(4))


def test_the_disk_tier_below_the_host_pool() -> None:
    """A host slot's victim is spilled to disk before its slot is reused; a block on disk is
    read into a host slot (kept from eviction until the read is reported), found on the
    host once good, dropped and its file deleted when bad; the disk keeps its newest blocks."""
    disk = DiskKVIndex(2, existing=["old"])
    tier = HostKVTier(1, disk=disk)
    tier.on_evict("a", 3)
    assert tier.take_step_copies().saves == [(3, 0)]
    tier.on_evict("b", 4)                 # "a" leaves the host pool: to its file first
    copies = tier.take_step_copies()
    assert copies.spills == [(0, "a")] and copies.saves == [(4, 0)]
    assert "a" in disk and "old" in disk and tier.disk_hits(["a", "x"]) == ["a"]
    assert tier.read_from_disk(["a"]) == 1 and tier.is_reading("a")
    copies = tier.take_step_copies()      # "b" is spilled to make room; "old" leaves the disk
    assert copies.spills == [(0, "b")] and copies.disk_reads == [("a", 0)]
    assert copies.disk_deletes == ["old"] and "old" not in disk
    tier.on_evict("c", 5)                 # the slot is being read: "c" finds no room
    assert tier.take_step_copies().saves == []
    tier.finish_disk_reads([("a", True)])
    assert tier.lookup(["a"]) == [0] and tier.stats.disk_read_blocks == 1
    # a bad file: dropped from the disk index, its file deleted, its slot free again
    disk2 = DiskKVIndex(4, existing=["z"])
    tier2 = HostKVTier(2, disk=disk2)
    tier2.read_from_disk(["z"])
    tier2.take_step_copies()
    tier2.finish_disk_reads([("z", False)])
    assert "z" not in disk2 and tier2.take_step_copies().disk_deletes == ["z"]
    assert tier2.lookup(["z"]) == [] and tier2.stats.disk_bad_blocks == 1


def test_a_slot_saved_this_step_is_not_spilled_in_the_same_step() -> None:
    """The workers run a step's spills before its saves: a slot saved to in this step and
    chosen again as a victim would be spilled before its save wrote it (a file of stale
    bytes: wrong answers after a restart). Such a slot is kept for the step; the block that
    finds no other slot is simply not kept."""
    tier = HostKVTier(2, disk=DiskKVIndex(8))
    tier.on_evict("a", 1)
    tier.on_evict("b", 2)
    tier.on_evict("c", 3)                # both slots were saved to this step: no room
    copies = tier.take_step_copies()
    assert copies.spills == [] and copies.saves == [(1, 0), (2, 1)]
    assert "c" not in tier.slot_of
    tier.on_evict("c", 3)                # the next step a slot gives way, spilled first
    copies = tier.take_step_copies()
    assert copies.spills == [(0, "a")] and copies.saves == [(3, 0)]


def test_swap_pricing_from_measured_steps() -> None:
    """Swap or recompute: before measurements, by the prompt's length; then by the load's
    measured cost against the recompute's; never into a tier without room."""
    from folio.core.kv_offload import SwapPricing
    p = SwapPricing()
    assert p.choose(8, 16, free_slots=100, pool_slots=100)[0] is True      # long: swap
    assert p.choose(2, 16, free_slots=100, pool_slots=100)[0] is False     # short
    assert p.choose(0, 16, free_slots=100, pool_slots=100)[0] is False
    swap, why = p.choose(40, 16, free_slots=10, pool_slots=100)            # no room
    assert swap is False and "10 free of 100" in why
    # a 512-token step took 51.2 ms: 0.1 ms per token; a 16-token step loading 8 blocks
    # took 1.6 + 4 ms: 0.5 ms per block (a block's recompute: 1.6 ms)
    p.observe_step(512, 0, 0.0512)
    p.observe_step(16, 8, 0.0016 + 0.004)
    assert abs(p.compute_s_per_token - 1e-4) < 1e-9
    assert abs(p.load_s_per_block - 5e-4) < 1e-9
    swap, why = p.choose(2, 16, free_slots=100, pool_slots=100)
    assert swap is True and "load 1.00 ms vs recompute 3.20 ms" in why
    # loads slower than compute (a slow host link): recompute
    for _ in range(30):
        p.observe_step(16, 1, 0.0016 + 0.01)
    assert p.choose(8, 16, free_slots=100, pool_slots=100)[0] is False


def test_blocks_left_to_recompute_are_not_saved_until_resumed() -> None:
    from folio.core.kv_offload import HostKVTier
    tier = HostKVTier(num_host_blocks=4)
    tier.skip_saving(["a", "b"])
    tier.on_evict("a", 3)
    tier.on_evict("c", 5)
    assert "a" not in tier.slot_of and "c" in tier.slot_of
    tier.save_again(["a", "b"])
    tier.on_evict("a", 3)
    assert "a" in tier.slot_of
