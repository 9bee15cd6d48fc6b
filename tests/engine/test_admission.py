"""Admission control: the front end's bookkeeping (AdmissionController) and the core's
expiry of requests past max_queue_time or their deadline (Scheduler.expire_requests)."""
from __future__ import annotations

import pytest

from folio.core.kv_cache_manager import KVCacheManager
from folio.core.request import Request, RequestStatus
from folio.core.scheduler import Scheduler
from folio.core.step_messages import ModelRunnerOutput
from folio.engine.admission import AdmissionController, RequestRejected
from folio.sampling_params import SamplingParams


def test_admits_under_the_limit_and_refuses_over_it_with_a_retry_after():
    adm = AdmissionController(max_waiting_requests=2)
    assert adm.admit("a", 0, now=0.0) is None and adm.admit("b", 0, now=0.0) is None
    with pytest.raises(RequestRejected) as info:
        adm.admit("c", 0, now=0.0)
    assert info.value.retry_after == 5          # no start measured yet: the default
    assert "--max-waiting-requests 2" in str(info.value)
    # two starts in 10 s: 0.2 per second; two waiting + this one drain in 15 s
    adm.started("a", now=0.0)
    adm.admit("c", 0, now=0.0)
    adm.started("b", now=10.0)
    adm.admit("d", 0, now=10.0)
    with pytest.raises(RequestRejected) as info:
        adm.admit("e", 0, now=10.0)
    assert info.value.retry_after == 15
    assert adm.num_rejected == 2 and adm.num_waiting == 2


def test_a_better_priority_sheds_the_worst_waiting_request():
    adm = AdmissionController(max_waiting_requests=2)
    adm.admit("low", 5, now=0.0)
    adm.admit("mid", 1, now=0.0)
    assert adm.admit("urgent", 0, now=0.0) == "low"   # lower value = better
    with pytest.raises(RequestRejected):
        adm.admit("same", 1, now=0.0)                   # ties are not shed
    adm.forget("mid")
    assert adm.admit("next", 9, now=0.0) is None and adm.num_shed == 1


def test_no_limit_admits_everything():
    adm = AdmissionController(None)
    for i in range(1000):
        assert adm.admit(str(i), 0, now=0.0) is None


def _request(rid: str, arrival: float, deadline: float | None = None) -> Request:
    return Request(rid, list(range(8)), SamplingParams(max_tokens=50, temperature=0), (),
                   block_size=4, max_model_len=64, arrival_time=arrival, deadline=deadline)


def test_scheduler_expires_waiting_past_queue_time_and_any_past_its_deadline():
    s = Scheduler(kv_cache_manager=KVCacheManager(64, 4, True), max_num_seqs=1,
                  max_num_batched_tokens=64, max_model_len=64, max_queue_time=5.0)
    s.add_request(_request("running", arrival=0.0, deadline=100.0))
    s.add_request(_request("queued", arrival=0.0))
    s.add_request(_request("fresh", arrival=96.0))
    step = s.schedule()                     # one seat: "running" starts, the others wait
    assert list(step.message.num_scheduled_tokens) == ["running"]
    s.update_from_output(step, ModelRunnerOutput(req_ids=["running"], sampled_token_ids=[[1]]))
    outs = s.expire_requests(now=10.0)
    assert [(o.request_id, o.finish_reason, o.stop_reason) for o in outs] == [
        ("queued", "timeout", "max_queue_time")]
    assert s.expire_requests(now=50.0) == []   # "running" started: no queue limit on it
    outs = s.expire_requests(now=100.0)
    assert [(o.request_id, o.stop_reason) for o in outs] == [("running", "deadline")]
    assert s.stats().num_running == 0 and s.num_expired == 2
    # its blocks are back and the next request runs
    assert list(s.schedule().message.num_scheduled_tokens) == ["fresh"]
    assert RequestStatus.FINISHED_TIMEOUT.finish_reason == "timeout"


def test_scheduler_without_limits_never_scans():
    s = Scheduler(kv_cache_manager=KVCacheManager(64, 4, True), max_num_seqs=1,
                  max_num_batched_tokens=64, max_model_len=64)
    s.add_request(_request("a", arrival=0.0))
    assert s.expire_requests(now=1e9) == []
