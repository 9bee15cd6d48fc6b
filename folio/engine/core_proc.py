"""The engine core in its own process: a busy loop of scheduler + model steps, fed over ZMQ.

The front end (API server) tokenizes and detokenizes; this process sees only token ids. It
exits when told to, when its parent dies, or on a fatal error (reported first, so the front
end can fail requests instead of hanging).
"""
from __future__ import annotations

import logging
import os
import signal
import time
import traceback

import zmq

from folio.config import EngineConfig
from folio.engine import messages as msg

logger = logging.getLogger(__name__)

# The EngineCore methods the front end may call remotely.
UTILITY_METHODS = {"reset_prefix_cache", "unpin_kv", "sleep", "wake_up", "is_sleeping",
                   "remove_lora", "list_loras"}

_IDLE_POLL_MS = 500


def run_engine_core(config: EngineConfig, input_address: str, output_address: str,
                    parent_pid: int, log_level: int = logging.WARNING,
                    spawned_at: float | None = None) -> None:
    """Process entry point (multiprocessing target). `spawned_at`: the front end's
    time.time() when it started this process, for the start-up timeline."""
    entered_at = time.time()
    _narrow_visible_devices(config)
    # Ctrl-C goes to the whole process group; the front end decides how to shut down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A spawned process starts with no logging set up: start-up progress (loading weights,
    # warming up, KV cache size) would be lost. Same level and format as the front end's.
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(output_address)
    core = None
    try:
        from folio.engine.engine_core import EngineCore
        from folio.engine.frontend import load_model_info
        imported_at = time.time()
        info = load_model_info(config, with_tokenizer=False)
        info_at = time.time()
        core = EngineCore(config, info.source, info.hf_config, info.tokenizer)
        logger.info("%s", startup_timeline(spawned_at or entered_at, entered_at, imported_at,
                                           info_at, time.time(), core.executor.timings))
        outbox.send_multipart(msg.encode(msg.READY, msg.ReadyInfo(
            core.num_blocks, config.cache.block_size, config.model.max_model_len, os.getpid(),
            config.scheduler.max_num_seqs, core.kv_capacity_tokens)))
        _busy_loop(core, inbox, outbox, parent_pid)
    except Exception as exc:  # report, then die: the front end fails requests with 500s
        detail = msg.fatal_detail(exc)
        # A ValueError is a bad setting or model, which the front end reports (it finds the
        # same while it reads the model beside this process): no traceback for it.
        logger.log(logging.DEBUG if isinstance(exc, ValueError) else logging.ERROR,
                   "engine core failed: %s\n%s", detail, traceback.format_exc())
        try:
            outbox.send_multipart(msg.encode(msg.FATAL, detail), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    finally:
        if core is not None:
            core.shutdown()  # drop queued grammar compiles rather than wait for them
        inbox.close(linger=0)
        outbox.close(linger=1000)
        context.term()


def _narrow_visible_devices(config: EngineConfig) -> None:
    """A data-parallel replica's engine core sees only its own GPUs (replica r: devices
    r*W ... r*W + W - 1 of those visible, W = TP x PP ranks), set before CUDA starts in this
    process."""
    parallel = config.parallel
    if parallel.data_parallel_size == 1 or config.model.device == "cpu":
        return
    tp = parallel.world_size
    first = parallel.data_parallel_rank * tp
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(first + tp)]
    mine = ids[first:first + tp]
    if len(mine) < tp:
        raise ValueError(f"data-parallel replica {parallel.data_parallel_rank} needs GPUs "
                         f"{first}..{first + tp - 1}, but only {len(ids)} are visible")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)


def startup_timeline(spawned_at: float, entered_at: float, imported_at: float, info_at: float,
                     ready_at: float, stages: dict[str, float]) -> str:
    """One log line: where the engine core's start went, in seconds (the worker's stages
    inside "engine"), and when it was ready after the front end spawned it."""
    from folio.core.startup_stages import STARTUP_STAGES
    engine_s = ready_at - info_at
    parts = [f"{label} {stages.get(key, 0.0):.1f}" for key, label in STARTUP_STAGES.items()
             if stages.get(key, 0.0) >= 0.05]
    parts.append(f"other {max(0.0, engine_s - sum(stages.values())):.1f}")
    return (f"start-up timeline: process start {entered_at - spawned_at:.1f} s, imports "
            f"{imported_at - entered_at:.1f} s, model config {info_at - imported_at:.1f} s, "
            f"engine {engine_s:.1f} s ({', '.join(parts)}); ready {ready_at - spawned_at:.1f} s "
            "after spawn")


# What the loop logs at DEBUG as slow: where a server's streams stall (bench disagg's stalls).
_SLOW_S = 0.04


def _log_if_slow(start: float, what: str, *args) -> None:
    took = time.perf_counter() - start
    if took > _SLOW_S and logger.isEnabledFor(logging.DEBUG):
        # the wall clock's end too, to set beside a client's timeline
        logger.debug("engine core: " + what + " took %.1f ms, ended at %.3f", *args,
                     1e3 * took, time.time())


def _poll_timeout_ms(core) -> int:
    """How long the loop may wait for messages before its next step: 0 with work queued
    (just drain what has arrived), long only when idle. Notifications for the workers count
    as work: a disaggregated prefill's hold goes out with the step after the request
    finished, and a consumer waits for it (idle, it waited a whole poll: +0.5 s of TTFT).
    Asleep, queued requests wait for wake_up: wait too."""
    busy = core.has_unfinished_requests() and not core.is_sleeping()
    return 0 if busy or core.has_pending_notifications() else _IDLE_POLL_MS


def _busy_loop(core, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> None:
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    last_parent_check = time.monotonic()
    last_stats = None
    while True:
        timeout = _poll_timeout_ms(core)
        while poller.poll(timeout):
            kind, payload = msg.decode(inbox.recv_multipart())
            if kind == msg.SHUTDOWN:
                return
            start = time.perf_counter()
            _handle(core, kind, payload, outbox)
            _log_if_slow(start, "handling a %s message", kind)
            timeout = 0
        now = time.monotonic()
        if now - last_parent_check > 1.0:
            last_parent_check = now
            if os.getppid() != parent_pid:
                logger.warning("front end process is gone; engine core exiting")
                return
        if (core.has_unfinished_requests() and not core.is_sleeping()) \
                or core.has_pending_notifications():
            start = time.perf_counter()
            outputs = core.step()
            _log_if_slow(start, "a step (%d outputs)", len(outputs))
            last_stats = core.stats()
            outbox.send_multipart(msg.encode(msg.OUTPUTS, msg.StepOutputs(
                outputs, last_stats)))
        else:
            # Idle after aborts or finishes that needed no step: the front end's gauges (KV
            # use, running, waiting) must not keep the last busy step's values.
            stats = core.stats()
            if stats != last_stats:
                last_stats = stats
                outbox.send_multipart(msg.encode(msg.OUTPUTS, msg.StepOutputs(
                    [], stats)))


def _handle(core, kind: bytes, payload, outbox: zmq.Socket) -> None:
    if kind == msg.ADD:
        core.add_request(payload)
    elif kind == msg.ABORT:
        core.abort_requests(payload)
    elif kind == msg.FINISH:
        core.finish_requests(payload)
    elif kind == msg.UTILITY:
        result = msg.UtilityResult(payload.call_id)
        if payload.method not in UTILITY_METHODS:
            result.error = f"unknown utility method {payload.method!r}"
        else:
            try:
                result.result = getattr(core, payload.method)(*payload.args)
            except Exception as exc:
                result.error = f"{type(exc).__name__}: {exc}"
        outbox.send_multipart(msg.encode(msg.UTILITY_RESULT, result))
