"""A watch on an engine's queued steps under async scheduling, for the speculative decoding
tests: which steps were queued while the one before was still in flight, and that none was
queued while a step whose drafts a draft model or head makes (`propose_drafts`) was."""
from __future__ import annotations


def watch_queued_steps(llm) -> list[bool]:
    """From now on, for each step the engine queues: whether a step was in flight then (the
    list returned, appended to). Asserts, as each is queued, that the step in flight (if any)
    makes no drafts: those come with its output, so the next step must wait for it."""
    core = llm.llm_engine.engine_core
    executor = core.executor
    overlapped: list[bool] = []
    queue = executor.execute_model_async

    def watching(message, fill=None):
        waiting = core._in_flight
        assert waiting is None or not waiting[0].message.propose_drafts, \
            "a step was queued while a drafting step was in flight"
        overlapped.append(waiting is not None)
        return queue(message, fill)

    executor.execute_model_async = watching
    return overlapped
