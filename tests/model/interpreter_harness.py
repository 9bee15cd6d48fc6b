"""Shared harness of the Triton kernel tests: a test module's cases run in a child process
with TRITON_INTERPRET=1 (it must be set before triton is imported, and this process may
already have imported it), each reporting one JSON line; the parent's tests read them."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from typing import Any, Callable, Iterator

import pytest


def rel_err(out: Any, ref: Any) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@contextlib.contextmanager
def calls_with_norm(module: Any, name: str) -> Iterator[list[bool]]:
    """While open, `module.<name>` records per call whether it was given a norm epilogue
    (its `norm` keyword), then runs as before: the list it yields."""
    calls: list[bool] = []
    real = getattr(module, name)

    def recording(*args, **kwargs):
        calls.append(kwargs.get("norm") is not None)
        return real(*args, **kwargs)

    setattr(module, name, recording)
    try:
        yield calls
    finally:
        setattr(module, name, real)


def child_main(cases: list[dict], run_case: Callable[[dict], dict]) -> None:
    """The child's entry point: run every case, one `RESULT {json}` line each; an exception
    becomes that case's "error" and the others still run."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for case in cases:
        try:
            res = run_case(case)
        except Exception as exc:  # report, keep going
            import traceback
            res = {"name": case["name"], "error": f"{exc!r}\n{traceback.format_exc()}"}
        print("RESULT " + json.dumps(res), flush=True)


def interpreter_results(test_file: str, timeout: int = 300) -> dict[str, dict]:
    """Run `test_file` as a script under the interpreter; its results by case name, plus the
    tail of its stderr under "_stderr" for failure messages."""
    pytest.importorskip("triton")
    test_file = os.path.abspath(test_file)
    root = os.path.dirname(os.path.dirname(os.path.dirname(test_file)))
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, test_file], env=env, cwd=root,
                          capture_output=True, text=True, timeout=timeout)
    parsed: dict[str, Any] = {"_stderr": proc.stderr[-4000:]}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT "):])
            parsed[res["name"]] = res
    return parsed
