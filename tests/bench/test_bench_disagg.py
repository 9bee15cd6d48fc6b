"""`folio bench disagg`'s stall timeline: gaps of the decoders' tokens, merged per event."""
import pytest

from folio.bench.disagg import stalls
from folio.bench.serve import RequestResult


def _result(send: float, ttft: float, itl: list[float]) -> RequestResult:
    return RequestResult(success=True, send_time=send, ttft=ttft, itl=itl,
                         output_tokens=len(itl) + 1)


def test_gaps_that_overlap_in_time_are_one_event_and_apart_two():
    a = _result(0.0, 0.1, [0.01, 0.2, 0.01, 0.1, 0.15])     # gaps 0.11-0.31, 0.42-0.57
    b = _result(0.0, 0.1, [0.01, 0.01, 0.25, 0.01])          # gap 0.12-0.37
    events = stalls([a, b], threshold=0.12)
    assert [(e["start_s"], e["end_s"], e["decoders"]) for e in events] == [
        (0.11, 0.37, 2), (0.42, 0.57, 1)]
    assert events[0]["longest_ms"] == 250.0
    assert events[1]["longest_ms"] == 150.0


def test_no_gap_over_the_threshold_is_no_event():
    assert stalls([_result(0.5, 0.1, [0.01] * 20)], threshold=0.05) == []


def test_mps_is_used_on_its_own_only_where_the_daemon_exists_and_not_on_the_cpu(monkeypatch):
    import argparse

    from folio.bench import disagg
    from folio.bench.mps import mps_control

    def args(mps: str, server_args: str = "") -> argparse.Namespace:
        return argparse.Namespace(mps=mps, server_args=server_args)
    monkeypatch.setattr(disagg, "mps_available", lambda: True)
    assert disagg._use_mps(args("auto"))
    assert not disagg._use_mps(args("auto", "--dtype float32 --device cpu"))
    assert not disagg._use_mps(args("auto", "--device=cpu"))
    assert disagg._use_mps(args("auto", "--device cuda"))
    assert not disagg._use_mps(args("off"))
    monkeypatch.setattr(disagg, "mps_available", lambda: False)
    assert not disagg._use_mps(args("auto"))
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ValueError, match="nvidia-cuda-mps-control"):
        mps_control()
    with pytest.raises(ValueError, match="nvidia-cuda-mps-control"):
        disagg._use_mps(args("on"))
