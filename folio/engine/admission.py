"""Admission control in the server's front end (folio's own: vLLM and SGLang queue without
bound): at most `max_waiting_requests` requests wait for their first step; over that a new
request is refused with a RequestRejected carrying a Retry-After computed from how fast
waiting requests have been starting — unless it outranks a waiting one (a lower priority
value), which is then shed in its place. Requests that waited longer than max_queue_time are
expired by the engine core (Scheduler.expire_requests) and reach the client the same way.

Pure bookkeeping, no I/O: the AsyncLLM calls it as requests arrive, start and end."""
from __future__ import annotations

import math
from collections import deque

# The core's stop_reason for a request expired before its first step (max_queue_time), and
# for one past its own deadline; both finish with reason "timeout".
QUEUE_TIMEOUT = "max_queue_time"
DEADLINE = "deadline"
# How far back request starts are counted for the drain rate, and the Retry-After bounds.
_RATE_WINDOW_S = 30.0
_MIN_RETRY_S, _MAX_RETRY_S = 1, 600
# Retry-After before any request has started (no rate measured yet).
_DEFAULT_RETRY_S = 5


class RequestRejected(Exception):
    """Refused for load (HTTP 429): try again after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class AdmissionController:
    def __init__(self, max_waiting_requests: int | None) -> None:
        self.max_waiting = max_waiting_requests
        # request id -> priority, of requests sent to the engine that have not started
        self._waiting: dict[str, int] = {}
        self._starts: deque[float] = deque()
        self.num_rejected = 0
        self.num_shed = 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def retry_after(self, now: float) -> int:
        """Seconds until the waiting requests have drained at the measured start rate."""
        self._trim(now)
        if not self._starts:
            return _DEFAULT_RETRY_S
        span = max(now - self._starts[0], 1.0)
        rate = len(self._starts) / span
        seconds = math.ceil((len(self._waiting) + 1) / rate)
        return max(_MIN_RETRY_S, min(_MAX_RETRY_S, seconds))

    def admit(self, request_id: str, priority: int, now: float) -> str | None:
        """Count `request_id` as waiting, or raise RequestRejected. Returns the id of a
        waiting request shed to make room (the caller fails it with RequestRejected), else
        None. Under the limit everything is admitted."""
        if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
            shed = None
            if self._waiting:
                # the worst waiting request: highest priority value, latest among equals
                worst = max(self._waiting.items(), key=lambda item: item[1])
                if worst[1] > priority:
                    shed = worst[0]
            if shed is None:
                self.num_rejected += 1
                raise RequestRejected(
                    f"the server is overloaded: {len(self._waiting)} requests are waiting "
                    f"(--max-waiting-requests {self.max_waiting})", self.retry_after(now))
            del self._waiting[shed]
            self.num_shed += 1
            self._waiting[request_id] = priority
            return shed
        self._waiting[request_id] = priority
        return None

    def started(self, request_id: str, now: float) -> None:
        """Its first output arrived: it no longer waits (and counts toward the rate)."""
        if self._waiting.pop(request_id, None) is not None:
            self._starts.append(now)
            self._trim(now)

    def forget(self, request_id: str) -> None:
        """Finished, failed or aborted before starting."""
        self._waiting.pop(request_id, None)

    def _trim(self, now: float) -> None:
        while self._starts and self._starts[0] < now - _RATE_WINDOW_S:
            self._starts.popleft()
