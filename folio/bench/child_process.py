"""Running a benchmark step in a fresh spawned process (`in_child`): its peak RSS is then its
own, and a crash, leak or hang there cannot disturb the benchmark process. A child that may be
killed at its timeout reports how far it got through a progress file (`Progress`,
`read_progress`)."""
from __future__ import annotations

import json
import math
import os
import pickle
import time
import traceback
from multiprocessing import get_context
from typing import Any, Callable


class ChildTimeout(TimeoutError):
    """`in_child` killed the child at its timeout."""

    def __init__(self, timeout: float) -> None:
        super().__init__(f"did not finish in {timeout:g} s")
        self.timeout = timeout


class ChildDied(RuntimeError):
    """The child died before answering (a crash: exitcode -N for signal N)."""

    def __init__(self, exitcode: int | None) -> None:
        super().__init__(f"the child process died (exit code {exitcode}) before returning a "
                         "result")
        self.exitcode = exitcode


class ChildTraceback(Exception):
    """The child's traceback, chained as the cause of the exception it raised."""


def in_child(fn: Callable[..., Any], *fn_args: Any, timeout: float | None = None) -> Any:
    """Run fn(*fn_args) in a fresh spawned process and return its result: its peak RSS is then
    its own, and a crash or leak there cannot disturb the benchmark process. An exception in the
    child is raised here (its traceback as the cause). With `timeout` (seconds), a child still
    running then is killed and ChildTimeout raised."""
    ctx = get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child_main, args=(sender, fn, fn_args), name="folio-bench-child")
    process.start()
    sender.close()  # the child holds the only write end: EOF here when it dies
    message = None
    answered = False
    try:
        if not receiver.poll(timeout):
            raise ChildTimeout(timeout)
        try:
            message = receiver.recv()
        except EOFError:
            pass
        answered = True
    finally:
        receiver.close()
        if answered:
            process.join(timeout=60)  # it exits right after answering
        if process.is_alive():
            process.kill()
        process.join()
    if message is None:
        raise ChildDied(process.exitcode)
    status, payload, child_tb = message
    if status == "ok":
        return payload
    raise payload from ChildTraceback(child_tb)


def _child_main(sender: Any, fn: Callable[..., Any], fn_args: tuple) -> None:
    try:
        message = ("ok", fn(*fn_args), None)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        child_tb = traceback.format_exc()
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:  # an exception that does not survive pickling: keep its text
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        message = ("error", exc, child_tb)
    try:
        sender.send(message)
    finally:
        sender.close()


class Progress:
    """A peer's progress, written as JSON to `path` (atomically, at most every `interval` s unless
    forced) so the parent can read how far a killed peer got. No-op without a path."""

    def __init__(self, path: str | None, interval: float = 0.5) -> None:
        self.path = path
        self.interval = interval
        self.state: dict[str, Any] = {}
        self._last = -math.inf

    def update(self, force: bool = False, **fields: Any) -> None:
        self.state.update(fields)
        now = time.monotonic()
        if self.path is None or (not force and now - self._last < self.interval):
            return
        self._last = now
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.state, f)
        os.replace(tmp, self.path)


def read_progress(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}
