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


def test_a_daemon_that_does_not_start_is_no_mps_on_auto_and_an_error_on_on(tmp_path,
                                                                           monkeypatch):
    import contextlib
    import os

    from folio.bench import disagg
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text("#!/bin/sh\nexit 1\n")
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with contextlib.ExitStack() as stack:
        assert disagg._start_mps(stack, "auto") is None
    with contextlib.ExitStack() as stack, pytest.raises(RuntimeError, match="did not start"):
        disagg._start_mps(stack, "on")


def test_the_daemon_gets_private_directories_and_is_told_to_quit(tmp_path, monkeypatch):
    import contextlib
    import os

    from folio.bench import disagg
    calls = tmp_path / "calls"
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text("#!/bin/sh\n"                  # -d: start; else a command on stdin
                       f'if [ "$1" = -d ]; then echo "-d $CUDA_MPS_PIPE_DIRECTORY" >> {calls}\n'
                       f'else echo "$(cat -) $CUDA_MPS_PIPE_DIRECTORY" >> {calls}; fi\n')
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with contextlib.ExitStack() as stack:
        env = disagg._start_mps(stack, "auto")
        assert env is not None and os.path.isdir(env["CUDA_MPS_PIPE_DIRECTORY"])
        assert os.path.isdir(env["CUDA_MPS_LOG_DIRECTORY"])
        started = calls.read_text().split()
        assert started[0] == "-d" and started[-1] == env["CUDA_MPS_PIPE_DIRECTORY"]
    stopped = calls.read_text().splitlines()[-1].split()
    assert stopped == ["quit", env["CUDA_MPS_PIPE_DIRECTORY"]]
