"""Disaggregated prefill on the scheduler's side (folio/core/kv_p2p.py), without a model: a
producer keeps a finished prompt's blocks until a consumer has fetched them (or the hold
expires); a consumer parks a request while its prompt's KV is fetched, then computes only the
last prompt token, and computes the whole prompt when the fetch fails or the params are wrong.
Step outputs are built by hand."""
from __future__ import annotations

import time

import msgspec
import pytest

from folio.config import KVTransferConfig
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.kv_p2p import P2PConnectorScheduler, parse_kv_transfer_params, tokens_hash
from folio.core.request import Request, RequestStatus
from folio.core.scheduler import Scheduler
from folio.core.step_messages import KVTransferHold, ModelRunnerOutput, SchedulerOutput
from folio.sampling_params import SamplingParams

BS = 4
PORT = 5555
PROMPT = list(range(100, 117))          # 17 tokens: 4 full blocks + 1 token


def _config(role: str, **extra) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="P2pConnector", kv_role=role,
                            kv_connector_extra_config=extra)


def _scheduler(role: str, num_blocks: int = 32, **extra) -> Scheduler:
    return Scheduler(kv_cache_manager=KVCacheManager(num_blocks, BS, True), max_num_seqs=8,
                     max_num_batched_tokens=256, max_model_len=256,
                     connector=P2PConnectorScheduler(_config(role, **extra), BS, PORT))


def _request(rid: str, prompt: list[int], params: dict | None = None,
             max_tokens: int = 1) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), (2,),
                   block_size=BS, max_model_len=256, kv_transfer_params=params)


def _params(prompt: list[int] = PROMPT, **change) -> dict:
    """A prefill server's answer for `prompt`, as a decode server gets it."""
    num_blocks = -(-len(prompt) // BS)
    params = dict(do_remote_prefill=True, do_remote_decode=False, remote_host="127.0.0.1",
                  remote_port=7000, remote_block_ids=list(range(200, 200 + num_blocks)),
                  remote_transfer_id="ab" * 16, remote_num_tokens=len(prompt),
                  remote_tokens_hash=tokens_hash(prompt), remote_block_size=BS,
                  remote_engine_id="e", remote_request_id="r", tp_size=1)
    params.update(change)
    return params


def _step(s: Scheduler, sent=(), received=()):
    """One step: every sampling request gets token 50; transfers reported as given.
    (the step, its outputs)."""
    step = s.schedule()
    rids = [item.request_id for item in step.scheduled if item.samples]
    outputs = s.update_from_output(step, ModelRunnerOutput(
        req_ids=rids, sampled_token_ids=[[50]] * len(rids), kv_transfer_sent=list(sent),
        kv_transfer_received=list(received)))
    return step, outputs


# ---- kv_transfer_params and the config ----------------------------------------------------

def test_good_params_parse_and_bad_ones_name_the_field() -> None:
    parsed = parse_kv_transfer_params(_params())
    assert parsed.do_remote_prefill and not parsed.do_remote_decode
    assert (parsed.remote_host, parsed.remote_port, parsed.remote_num_tokens) == ("127.0.0.1", 7000, 17)
    assert parsed.remote_block_ids == [200, 201, 202, 203, 204]
    assert parsed.remote_tokens_hash == tokens_hash(PROMPT) != tokens_hash(PROMPT[:-1])
    assert parse_kv_transfer_params({"do_remote_decode": True}).do_remote_decode
    assert not parse_kv_transfer_params({}).do_remote_prefill
    for bad, field in (([("do_remote_decode", True)], "must be an object"),
                       (_params(do_remote_decode=True), "exclude each other"),
                       (_params(remote_peer="x"), r"unknown keys \['remote_peer'\]")):
        with pytest.raises(ValueError, match=field):
            parse_kv_transfer_params(bad)


_MISSING = object()


@pytest.mark.parametrize("key, value", [
    ("do_remote_prefill", 1), ("do_remote_decode", "yes"), ("remote_port", 0),
    ("remote_port", 70000), ("remote_port", True), ("remote_port", "7000"),
    ("remote_block_ids", []), ("remote_block_ids", [1, -1]), ("remote_block_ids", [1, True]),
    ("remote_block_ids", "1"), ("remote_block_ids", [0] * ((1 << 20) + 1)),
    ("remote_transfer_id", _MISSING), ("remote_transfer_id", ""),
    ("remote_tokens_hash", "x" * 129), ("remote_host", ""), ("remote_host", "h" * 256),
    ("remote_num_tokens", 0), ("remote_block_size", 0)])
def test_malformed_params_name_the_field(key, value) -> None:
    params = _params(**{key: value})
    if value is _MISSING:
        del params[key]
    with pytest.raises(ValueError, match=rf"kv_transfer_params\.{key} "):
        parse_kv_transfer_params(params)


def test_p2p_config() -> None:
    for role in ("kv_producer", "kv_consumer", "kv_both"):
        config = _config(role)
        assert (config.is_producer, config.is_consumer) == (role != "kv_consumer",
                                                            role != "kv_producer")
    config = KVTransferConfig.from_json('{"kv_connector": "P2pConnector", "kv_role": "kv_consumer",'
                                        ' "kv_ip": "10.0.0.1"}')
    assert config.p2p_option("producer_hosts") == ["10.0.0.1"]
    assert config.p2p_option("transfer_timeout") == 30.0


@pytest.mark.parametrize("change, field", [
    ({"pull_timeout": 1}, "kv_connector_extra_config has keys"),
    ({"transfer_timeout": 0}, "transfer_timeout"), ({"hold_timeout": 3601}, "hold_timeout"),
    ({"hold_timeout": True}, "hold_timeout"), ({"producer_hosts": []}, "producer_hosts"),
    ({"producer_hosts": "a"}, "producer_hosts"), ({"kv_port": 65536}, "kv_port"),
    ({"kv_port": -1}, "kv_port"), ({"kv_port": True}, "kv_port"), ({"kv_ip": ""}, "kv_ip"),
    ({"kv_role": "kv_server"}, "kv_role")])
def test_p2p_config_errors_name_the_field(change, field) -> None:
    top = {k: v for k, v in change.items() if k.startswith("kv_")}
    extra = {k: v for k, v in change.items() if not k.startswith("kv_")}
    with pytest.raises(ValueError, match=field):
        KVTransferConfig.from_json({"kv_connector": "P2pConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": extra, **top})


def test_offloading_connector_still_needs_kv_both_and_its_size() -> None:
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig("OffloadingConnector", "kv_producer", {"cpu_bytes_to_use": 1})
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        KVTransferConfig("OffloadingConnector", "kv_both", {})
    assert KVTransferConfig("OffloadingConnector", "kv_both", {"cpu_bytes_to_use": 1 << 30}
                            ).offloading_size_gib() == 1.0


# ---- the producer --------------------------------------------------------------------------

def _produce(s: Scheduler) -> dict:
    s.add_request(_request("p", PROMPT, {"do_remote_decode": True}))
    _, outputs = _step(s)
    assert len(outputs) == 1 and outputs[0].finished
    return outputs[0].kv_transfer_params


def test_producer_holds_blocks_until_sent() -> None:
    s = _scheduler("kv_producer")
    free0 = s.kv.num_free_blocks
    params = _produce(s)
    assert len(params["remote_block_ids"]) == 5 and params["remote_num_tokens"] == 17
    assert params["remote_tokens_hash"] == tokens_hash(PROMPT)
    assert (params["remote_block_size"], params["remote_port"]) == (BS, PORT)
    assert parse_kv_transfer_params(params).do_remote_prefill   # a consumer takes it as is
    assert s.kv.num_free_blocks == free0 - 5 and "p" not in s.requests
    step, _ = _step(s)
    tid = params["remote_transfer_id"]
    assert step.message.kv_transfer_holds == [KVTransferHold(tid, params["remote_block_ids"])]
    assert step.polls and not step.is_empty and "p" in step.message.finished_req_ids
    for _ in range(3):                    # nothing reported: the blocks stay held
        step, _ = _step(s, sent=["unknown"])
        assert step.message.kv_transfer_holds == [] and step.message.kv_transfer_releases == []
    assert s.kv.num_free_blocks == free0 - 5 and s.has_connector_work()
    _step(s, sent=[tid])
    assert s.kv.num_free_blocks == free0 and not s.has_connector_work()
    stats = s.stats()
    assert (stats.kv_transfer_held_requests, stats.kv_transfer_sent_requests) == (1, 1)
    # the step messages' transfer fields survive the trip to a worker process and back
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(step.message),
                                  type=SchedulerOutput) == step.message
    reply = ModelRunnerOutput(kv_transfer_sent=[tid], kv_transfer_received=[("c", True)])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=ModelRunnerOutput) == reply


def test_producer_without_do_remote_decode_or_as_consumer_frees_at_once() -> None:
    for role, params in (("kv_producer", None), ("kv_producer", {"do_remote_decode": False}),
                         ("kv_consumer", {"do_remote_decode": True})):
        s = _scheduler(role)
        free0 = s.kv.num_free_blocks
        s.add_request(_request("p", PROMPT, params))
        _, outputs = _step(s)
        assert outputs[0].finished and outputs[0].kv_transfer_params is None
        assert s.kv.num_free_blocks == free0 and not s.has_connector_work()


def test_expired_hold_is_released_and_freed_once_reported() -> None:
    s = _scheduler("kv_producer", hold_timeout=0.05)
    free0 = s.kv.num_free_blocks
    tid = _produce(s)["remote_transfer_id"]
    time.sleep(0.1)
    releases = []
    for _ in range(3):
        step, _ = _step(s)
        releases += step.message.kv_transfer_releases
    assert releases == [tid]             # released once, not every step
    assert s.kv.num_free_blocks == free0 - 5
    _step(s, sent=[tid])
    assert s.kv.num_free_blocks == free0 and not s.has_connector_work()
    assert s.stats().kv_transfer_sent_requests == 0      # released, not fetched


# ---- the consumer --------------------------------------------------------------------------

def _start_load(s: Scheduler, prompt: list[int] = PROMPT, **change):
    """A do_remote_prefill request added and its fetch started; (its request, the load)."""
    request = _request("c", prompt, _params(prompt, **change), max_tokens=4)
    s.add_request(request)
    step, outputs = _step(s)
    assert step.scheduled == [] and step.message.num_scheduled_tokens == {} and outputs == []
    assert step.polls and not step.is_empty
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = step.message.kv_transfer_loads
    return request, load


def _warm_prefix(s: Scheduler, prompt: list[int]) -> list[int]:
    """Run a plain request for `prompt` on `s`; the block ids it leaves cached."""
    s.add_request(_request("warm", prompt))
    step, outputs = _step(s)
    assert outputs[0].finished
    return list(step.scheduled[0].block_ids[0])


@pytest.mark.parametrize("prompt_len", [15, 17])
def test_consumer_loads_then_computes_the_last_token(prompt_len) -> None:
    prompt = PROMPT[:prompt_len]
    s = _scheduler("kv_consumer")
    free0 = s.kv.num_free_blocks
    request, load = _start_load(s, prompt)
    # the load goes by a key of its own (the id may be used again while it runs)
    assert load.req_id.startswith("c#") and load.req_id == request.kv_load_key
    assert (load.transfer_id, load.host, load.port) == ("ab" * 16, "127.0.0.1", 7000)
    assert load.local_block_ids == s.kv.get_block_ids("c")[0] and len(load.local_block_ids) == 4
    assert load.remote_block_ids == [200, 201, 202, 203]
    assert s.has_unfinished_requests()
    for _ in range(3):                          # waiting: never scheduled, never fetched again
        step, _ = _step(s)
        assert step.scheduled == [] and step.message.kv_transfer_loads == [] and step.polls
    _step(s, received=[(load.req_id, True)])
    step, outputs = _step(s)
    assert step.message.num_scheduled_tokens == {"c": 1}
    assert step.scheduled[0].num_computed_tokens == prompt_len - 1 and step.scheduled[0].samples
    (new,) = step.message.scheduled_new_reqs
    assert new.num_computed_tokens == prompt_len - 1
    assert new.block_ids[0][:4] == load.local_block_ids
    assert outputs[0].new_token_ids == [50] and outputs[0].num_cached_tokens == prompt_len - 1
    stats = s.stats()
    assert (stats.kv_transfer_received_requests, stats.kv_transfer_received_tokens,
            stats.kv_transfer_failed_requests) == (1, prompt_len - 1, 0)
    while "c" in s.requests:
        step, _ = _step(s)
        assert step.message.num_scheduled_tokens == {"c": 1}
    assert s.kv.num_free_blocks == free0 and not s.has_connector_work()


def test_consumer_loads_only_past_a_device_prefix_hit() -> None:
    s = _scheduler("kv_consumer")
    warm = _warm_prefix(s, PROMPT[:9])          # caches the prompt's first 2 blocks
    request, load = _start_load(s)
    blocks = s.kv.get_block_ids("c")[0]
    assert blocks[:2] == warm[:2]
    assert load.remote_block_ids == [202, 203] and load.local_block_ids == blocks[2:4]
    _step(s, received=[(load.req_id, True)])
    step, _ = _step(s)
    assert step.message.num_scheduled_tokens == {"c": 1}
    assert s.stats().kv_transfer_received_tokens == 8


def test_a_plain_request_does_not_hit_blocks_being_loaded() -> None:
    s = _scheduler("kv_consumer")
    _, load = _start_load(s)
    s.add_request(_request("other", PROMPT))
    step, outputs = _step(s)
    (item,) = step.scheduled
    assert (item.request_id, item.num_computed_tokens, item.num_new_tokens) == ("other", 0, 17)
    assert not set(item.block_ids[0]) & set(load.local_block_ids) and outputs[0].finished


def test_loading_blocks_are_cached_only_after_the_request_runs() -> None:
    s = _scheduler("kv_consumer")
    _, load = _start_load(s)

    def hits() -> int:
        return s.kv.get_computed_blocks(_request("probe", PROMPT))[1]
    assert hits() == 0
    _step(s, received=[(load.req_id, True)])
    assert hits() == 0
    s.add_request(_request("other", PROMPT))    # a plain request for the same prompt
    step, _ = _step(s)
    scheduled = {item.request_id: item for item in step.scheduled}
    assert scheduled["c"].num_new_tokens == 1
    assert scheduled["other"].num_computed_tokens == 16     # c's blocks, now indexed
    assert hits() == 16


def test_a_load_waits_for_room_in_the_pool() -> None:
    s = _scheduler("kv_consumer", num_blocks=6)
    s.add_request(_request("big", list(range(300, 317)), max_tokens=3))   # 5 blocks
    s.add_request(_request("c", PROMPT, _params(), max_tokens=4))
    loads = []
    while "big" in s.requests:
        step, _ = _step(s)
        loads += step.message.kv_transfer_loads
        assert [item.request_id for item in step.scheduled] == ["big"]
    assert loads == [] and s.requests["c"].status == RequestStatus.WAITING
    step, _ = _step(s)
    assert [load.req_id.split("#")[0] for load in step.message.kv_transfer_loads] == ["c"]
    assert s.stats().kv_transfer_failed_requests == 0


def test_failed_fetch_computes_the_prompt_and_is_never_retried() -> None:
    s = _scheduler("kv_consumer")
    _warm_prefix(s, PROMPT[:9])
    free0 = s.kv.num_free_blocks
    _, load = _start_load(s)
    _step(s, received=[(load.req_id, False)])
    step, _ = _step(s)
    assert step.message.num_scheduled_tokens == {"c": 9}
    assert step.scheduled[0].num_computed_tokens == 8      # the device prefix hit only
    assert step.message.kv_transfer_loads == []
    assert s.stats().kv_transfer_failed_requests == 1
    assert s.stats().kv_transfer_received_requests == 0
    while "c" in s.requests:
        step, _ = _step(s)
        assert step.message.kv_transfer_loads == []
    assert s.kv.num_free_blocks == free0


@pytest.mark.parametrize("change", [
    {"remote_tokens_hash": tokens_hash(PROMPT[::-1])}, {"remote_num_tokens": 16},
    {"remote_block_size": 8}, {"remote_host": "10.9.9.9"}, {"remote_block_ids": [200]},
    {"remote_port": 0},
])
def test_wrong_params_are_computed_not_fetched(change) -> None:
    s = _scheduler("kv_consumer")
    s.add_request(_request("c", PROMPT, _params(**change)))
    step, outputs = _step(s)
    assert step.message.kv_transfer_loads == [] and step.message.num_scheduled_tokens == {"c": 17}
    assert outputs[0].finished and s.stats().kv_transfer_failed_requests == 1
    if "remote_host" in change:           # the same host allowed: fetched
        s = _scheduler("kv_consumer", producer_hosts=["10.9.9.9"])
        assert _start_load(s, **change)[1].host == "10.9.9.9"


@pytest.mark.parametrize("ok", [True, False])
def test_abort_while_loading_frees_blocks_once_reported(ok) -> None:
    s = _scheduler("kv_consumer")
    free0 = s.kv.num_free_blocks
    _, load = _start_load(s)
    assert [r.request_id for r in s.abort_requests(["c"])] == ["c"]
    assert s.kv.num_free_blocks == free0 - 4 and "c" not in s.requests
    step, _ = _step(s)
    assert "c" in step.message.finished_req_ids and step.polls
    assert s.kv.num_free_blocks == free0 - 4             # the fetch may still write them
    _step(s, received=[(load.req_id, ok)])
    assert s.kv.num_free_blocks == free0
    assert not s.has_connector_work() and not s.has_unfinished_requests()
    step, _ = _step(s)
    assert step.scheduled == [] and step.is_empty


# ---- a request id used again while the first request's blocks are still kept ---------------
# (a client's X-Request-Id makes the id; a retry reuses it): the kept blocks go by a key of
# their own.


def test_reused_id_on_a_producer_keeps_the_second_hold() -> None:
    s = _scheduler("kv_producer")
    free0 = s.kv.num_free_blocks
    first = _produce(s)
    try:
        second = _produce(s)
    except ValueError:
        return
    assert len(second["remote_block_ids"]) == 5
    _step(s, sent=[first["remote_transfer_id"]])
    # the second hold is outstanding: its 5 blocks must not be free
    assert s.kv.num_free_blocks == free0 - 5


def test_reused_id_on_a_consumer_does_not_take_the_aborted_fetch() -> None:
    s = _scheduler("kv_consumer")
    free0 = s.kv.num_free_blocks
    _, first = _start_load(s)
    s.abort_requests(["c"])
    _step(s)
    try:
        _, second = _start_load(s)
    except ValueError:
        return
    assert not set(first.local_block_ids) & set(second.local_block_ids)
    _step(s, received=[(first.req_id, False)])     # the aborted request's fetch ends
    step, _ = _step(s)
    # the new request still waits for its own fetch, which writes into its blocks
    assert step.scheduled == [] and s.kv.num_free_blocks == free0 - 4
