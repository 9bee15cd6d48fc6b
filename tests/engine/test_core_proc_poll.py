"""The engine core's loop waits for messages only when it has nothing to do: notifications
for the workers (a disaggregated prefill's hold) are something to do."""
from dataclasses import dataclass

from folio.engine.core_proc import _IDLE_POLL_MS, _poll_timeout_ms


@dataclass
class _Core:
    unfinished: bool = False
    sleeping: bool = False
    notifications: bool = False

    def has_unfinished_requests(self) -> bool:
        return self.unfinished

    def is_sleeping(self) -> bool:
        return self.sleeping

    def has_pending_notifications(self) -> bool:
        return self.notifications


def test_requests_to_run_do_not_wait():
    assert _poll_timeout_ms(_Core(unfinished=True)) == 0


def test_idle_waits_for_messages():
    assert _poll_timeout_ms(_Core()) == _IDLE_POLL_MS > 0


def test_notifications_for_the_workers_do_not_wait():
    # a prefill server's request just finished: its KV hold must reach the worker now, not
    # after an idle poll (the decode server's fetch waits for it)
    assert _poll_timeout_ms(_Core(notifications=True)) == 0


def test_asleep_queued_requests_wait_for_wake_up():
    assert _poll_timeout_ms(_Core(unfinished=True, sleeping=True)) == _IDLE_POLL_MS
