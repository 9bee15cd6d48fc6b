"""A worker in its own process (the mp executor's): it loads the model, then runs every step
message that comes in, and rank 0 sends each step's output back.

Started with `python -m folio.executor.worker_proc`, its arguments pickled on stdin by the
executor (the engine core may itself be a daemonic process, which multiprocessing does not let
have children). Two threads: the main one receives a step and queues its forward pass; the
output thread waits for that step's sampled ids and sends them, while the main thread already
builds the next step (async scheduling keeps its overlap across the process boundary). The
worker's request state changes only from the messages, never from its own outputs, so the
threads share nothing but the queue between them.
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from folio.config import EngineConfig
from folio.core.kv_cache_layout import KVCacheLayout
from folio.executor import step_codec
from folio.model.discovery import ModelSource

logger = logging.getLogger(__name__)

# Executor -> worker frames: [kind, payload].
STEP = b"STEP"          # SchedulerOutput
BITMASK = b"MASK"       # GrammarBitmask of the step just sent (empty payload: none)
SHUTDOWN = b"STOP"
# Worker -> executor frames: [kind, rank, step id, payload].
READY = b"READY"        # WorkerInfo
OUTPUT = b"OUT"         # ModelRunnerOutput (the output rank only)
ERROR = b"ERR"          # WorkerError

_POLL_MS = 1000
_SWITCH_INTERVAL_S = 5e-5


@dataclass
class WorkerArgs:
    rank: int
    config: EngineConfig
    source: ModelSource
    hf_config: Any
    step_address: str
    output_address: str
    parent_pid: int | None   # the process whose exit ends the worker (None: Ray's actor)
    log_level: int
    # torch.distributed's rendezvous (tcp://127.0.0.1:PORT) when the workers are the ranks of
    # a tensor- or pipeline-parallel group; None for replicas.
    dist_init_method: str | None = None


class WorkerError(msgspec.Struct):
    """A worker's failure: the exception's type name (a ValueError — bad weights, a bad
    setting — stays a ValueError on the engine's side, as in process) and its message."""
    type_name: str
    message: str
    rank: int


def error_frame(exc: BaseException, rank: int) -> bytes:
    return step_codec.encode(WorkerError(type(exc).__name__, str(exc), rank))


class WorkerInfo(msgspec.Struct):
    device_type: str
    num_blocks: int
    vocab_size: int
    timings: dict[str, float]
    kv_cache_layout: KVCacheLayout
    num_host_blocks: int = 0
    host_block_bytes: int = 0
    disk_kv_hashes: list[bytes] = []
    kv_transfer_port: int = 0


def frame_int(value: int) -> bytes:
    return value.to_bytes(8, "little", signed=True)


def main() -> None:
    args: WorkerArgs = pickle.load(sys.stdin.buffer)  # written by our own executor
    run_worker(args)


def run_worker(args: WorkerArgs) -> None:
    # Ctrl-C reaches the whole process group; the executor decides how to shut down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(args.step_address)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(args.output_address)
    rank = frame_int(args.rank)
    try:
        worker = _start_worker(args)
        outbox.send_multipart([READY, rank, frame_int(-1), step_codec.encode(WorkerInfo(
            worker.device.type, worker.num_blocks, worker.arch_spec.vocab_size,
            dict(worker.timings), worker.kv_cache_layout,
            0 if worker.host_kv is None else worker.host_kv.num_slots,
            worker.host_block_bytes,
            [] if worker.disk_kv is None else worker.disk_kv.existing(),
            0 if worker.kv_p2p is None else worker.kv_p2p.port))])
        _serve(worker, args, inbox, outbox)
    except Exception as exc:
        detail = f"worker {args.rank}: {type(exc).__name__}: {exc}"
        logger.error("%s\n%s", detail, traceback.format_exc())
        try:
            outbox.send_multipart([ERROR, rank, frame_int(-1), error_frame(exc, args.rank)],
                                  flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        context.term()


def output_rank(config: EngineConfig) -> int:
    """The rank that sends each step's output: the last pipeline stage's first
    tensor-parallel rank (rank 0 without a pipeline)."""
    parallel = config.parallel
    return (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size


def _start_worker(args: WorkerArgs):
    import torch
    from folio.worker.worker import Worker, join_parallel, pipeline_stage, resolve_device
    device = resolve_device(args.config.model.device)
    if device.type == "cuda":
        torch.cuda.set_device(args.rank)
    else:
        # Replicas share the host's cores: each takes its part, or torch's threads fight.
        workers = args.config.parallel.num_workers
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    parallel = args.config.parallel
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    pp = pipeline_stage(args.rank, args.config, args.hf_config)
    tp = join_parallel(args.rank, tp_size, pp_size, args.dist_init_method, device,
                       parallel.enable_expert_parallel, parallel.distributed_single_rank)
    return Worker(args.config, args.source, args.hf_config, tp=tp, pp=pp)


def _serve(worker, args: WorkerArgs, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
    # The output thread wakes when a step's sampled ids land, often while the main thread is
    # building the next step in Python; with the default 5 ms switch interval it would wait
    # for the GIL until that build ends (up to the whole step's host time, added to every
    # step's latency). A short interval hands it over within tens of microseconds.
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    results: queue.Queue = queue.Queue()
    sender = threading.Thread(target=_send_outputs,
                              args=(results, outbox, args.rank,
                                    args.rank == output_rank(args.config)),
                              name="folio-worker-output", daemon=True)
    sender.start()
    try:
        while True:
            if not inbox.poll(_POLL_MS):
                if args.parent_pid is not None and os.getppid() != args.parent_pid:
                    logger.warning("worker %d: the engine core is gone; exiting", args.rank)
                    return
                continue
            kind, payload = inbox.recv_multipart()
            if kind == SHUTDOWN:
                return
            if kind != STEP:
                raise RuntimeError(f"unexpected message {kind!r} between steps")
            step = step_codec.decode_step(payload)
            asked = []

            def grammar_bitmask():
                asked.append(True)
                return _receive_bitmask(inbox)

            try:
                pending = worker.execute_model_async(step, grammar_bitmask if step.has_grammar
                                                     else None)
            except Exception as exc:
                results.put((step.step_id, exc))
                raise
            if step.has_grammar and not asked:
                _receive_bitmask(inbox)  # sent for the step either way: not left for the next
            results.put((step.step_id, pending))
    finally:
        results.put(None)
        sender.join(timeout=10)


def _receive_bitmask(inbox: zmq.Socket):
    kind, payload = inbox.recv_multipart()
    if kind != BITMASK:
        raise RuntimeError(f"expected the step's grammar bitmask, got {kind!r}")
    return step_codec.decode_bitmask(payload) if payload else None


def _send_outputs(results: queue.Queue, outbox: zmq.Socket, rank: int, sends: bool) -> None:
    """The output thread: each step's output, in step order, to the executor (`sends`: this
    is the output rank); the other ranks wait for theirs too, so an error on any rank is
    reported."""
    rank_frame = frame_int(rank)
    while True:
        item = results.get()
        if item is None:
            return
        step_id, pending = item
        try:
            if isinstance(pending, Exception):
                raise pending
            output = pending.get()
        except Exception as exc:
            detail = f"worker {rank}: {type(exc).__name__}: {exc}"
            logger.error("%s\n%s", detail, traceback.format_exc())
            outbox.send_multipart([ERROR, rank_frame, frame_int(step_id), error_frame(exc, rank)])
            return
        if sends:
            outbox.send_multipart([OUTPUT, rank_frame, frame_int(step_id),
                                   step_codec.encode(output)])


if __name__ == "__main__":
    main()
