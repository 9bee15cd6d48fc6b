"""The mp executor (`--distributed-executor-backend mp`): workers in their own processes.

Each step message is encoded once and sent to every worker over its own ZMQ PUSH socket (ipc);
when the step has a grammar, its bitmask follows as a second message, filled by the engine's
matchers while the workers run the forward pass. Every worker runs every step (each holds
a whole replica, or its part of the model: a tensor-parallel slice, a pipeline stage's
layers); the output rank (rank 0, or the last pipeline stage's first) sends the output back,
tagged with the step's id, so a step's output can be waited for out of order (the engine
runs an empty step to drop finished requests while another is in flight).

Why ZMQ and not a shared-memory ring: see docs/benchmarks.md ("Step transport") — at the sizes
a step message has (well under a megabyte), ipc sockets cost tens of microseconds a round
trip, and they need no polling thread or size bound.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import zmq

from folio.config import EngineConfig
from folio.core.kv_cache_layout import KVCacheLayout
from folio.core.step_messages import GrammarBitmaskFn, ModelRunnerOutput, SchedulerOutput
from folio.executor import step_codec
from folio.executor import worker_proc as wp
from folio.model.discovery import ModelSource

logger = logging.getLogger(__name__)

_POLL_MS = 500
_SHUTDOWN_WAIT_S = 10.0


def _free_port() -> int:
    """A loopback port for torch.distributed's rendezvous (the ranks meet on this host)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class WorkerFailed(RuntimeError):
    """A worker process reported an error or died."""


class WorkerProcess:
    """A worker as a child process of this one (the mp executor's)."""

    def __init__(self, args: wp.WorkerArgs) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "folio.executor.worker_proc"],
                                     stdin=subprocess.PIPE)
        self.proc.stdin.write(pickle.dumps(args))
        self.proc.stdin.close()

    def exit_reason(self) -> str | None:
        """None while it runs; else why it stopped."""
        code = self.proc.poll()
        return None if code is None else f"exited with code {code}"

    def stop(self, timeout_s: float) -> None:
        """Wait for it to leave (it was told to), killing it after `timeout_s`."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class MultiprocExecutor:
    """Workers fed over ZMQ; `_spawn_workers` starts them (child processes here, Ray actors
    in the Ray executor, which reuses everything else)."""

    # Where the step and output sockets live: ipc on one host; the Ray executor uses TCP.
    transport = "ipc"

    def __init__(self, config: EngineConfig, source: ModelSource, hf_config: Any) -> None:
        self.num_workers = config.parallel.num_workers
        self._ipc_dir = tempfile.mkdtemp(prefix="folio-workers-")
        self._context = zmq.Context()
        self._outputs: dict[int, ModelRunnerOutput] = {}
        self._inbox = self._context.socket(zmq.PULL)
        output_address = self._bind(self._inbox, "out")
        self._step_sockets: list[zmq.Socket] = []
        self._procs: list[Any] = []
        # Every worker started, for tests and for liveness checks after shutdown.
        self._procs_started: list[Any] = []
        log_level = logging.getLogger("folio").getEffectiveLevel()
        try:
            arg_list = []
            for rank in range(self.num_workers):
                sock = self._context.socket(zmq.PUSH)
                address = self._bind(sock, f"step-{rank}")
                self._step_sockets.append(sock)
                arg_list.append(wp.WorkerArgs(rank, config, source, hf_config, address,
                                              output_address, os.getpid(), log_level))
            self._procs = self._spawn_workers(arg_list, config)
            self._procs_started = list(self._procs)
            infos = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        # The first rank's description (every rank builds the same layout and vocabulary).
        first = infos[0]
        self.device_type: str = first.device_type
        # Each rank sizes its cache from its own memory; the smallest decides for all.
        self.num_blocks: int = min(info.num_blocks for info in infos)
        self.vocab_size: int = first.vocab_size
        self.kv_cache_layout: KVCacheLayout = first.kv_cache_layout
        self.num_host_blocks: int = min(info.num_host_blocks for info in infos)
        self.host_block_bytes: int = sum(info.host_block_bytes for info in infos)
        self.disk_kv_hashes: list[bytes] = first.disk_kv_hashes
        self.kv_transfer_port: int = first.kv_transfer_port
        self.timings: dict[str, float] = dict(first.timings)
        logger.info("%d worker processes ready (%s)", self.num_workers, self.device_type)

    def _bind(self, sock: zmq.Socket, name: str) -> str:
        if self.transport == "ipc":
            address = f"ipc://{self._ipc_dir}/{name}"
            sock.bind(address)
            return address
        port = sock.bind_to_random_port(f"tcp://{self._host}")
        return f"tcp://{self._host}:{port}"

    def _spawn_workers(self, arg_list: list[wp.WorkerArgs], config: EngineConfig) -> list:
        if config.parallel.joins_process_group:
            dist_init = f"tcp://127.0.0.1:{_free_port()}"
            arg_list = [dataclasses.replace(a, dist_init_method=dist_init) for a in arg_list]
        return [WorkerProcess(args) for args in arg_list]

    def _wait_ready(self) -> list[wp.WorkerInfo]:
        infos: dict[int, wp.WorkerInfo] = {}
        while len(infos) < self.num_workers:
            kind, rank, _, payload = self._receive()
            if kind != wp.READY:
                raise WorkerFailed(f"worker {rank} sent {kind!r} before it was ready")
            infos[rank] = step_codec.msgspec_decode(payload, wp.WorkerInfo)
        return [infos[r] for r in range(self.num_workers)]

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self._procs):
            reason = proc.exit_reason()
            if reason is not None:
                raise WorkerFailed(f"worker {rank} {reason}")

    def _receive(self) -> tuple[bytes, int, int, bytes]:
        """The next frame from any worker; WorkerFailed on an error or a dead worker."""
        while not self._inbox.poll(_POLL_MS):
            self._check_alive()
        kind, rank, step_id, payload = self._inbox.recv_multipart()
        rank_i = int.from_bytes(rank, "little", signed=True)
        if kind == wp.ERROR:
            error = step_codec.msgspec_decode(payload, wp.WorkerError)
            if error.type_name == "ValueError":
                raise ValueError(error.message)
            raise WorkerFailed(f"worker {error.rank}: {error.type_name}: {error.message}")
        return kind, rank_i, int.from_bytes(step_id, "little", signed=True), payload

    def _broadcast(self, frames: list[bytes]) -> None:
        self._check_alive()
        for sock in self._step_sockets:
            # A PUSH socket whose peer is gone would block forever: wait in slices, and look
            # at the workers between them.
            while not sock.poll(_POLL_MS, zmq.POLLOUT):
                self._check_alive()
            sock.send_multipart(frames, copy=False)

    def execute_model(self, step: SchedulerOutput,
                      grammar_bitmask: GrammarBitmaskFn | None = None) -> ModelRunnerOutput:
        return self.execute_model_async(step, grammar_bitmask).get()

    def execute_model_async(self, step: SchedulerOutput,
                            grammar_bitmask: GrammarBitmaskFn | None = None) -> "_Pending":
        self._broadcast([wp.STEP, step_codec.encode(step)])
        if step.has_grammar:
            # Filled while the workers run the forward pass.
            mask = grammar_bitmask() if grammar_bitmask is not None else None
            self._broadcast([wp.BITMASK, b"" if mask is None else step_codec.encode(mask)])
        return _Pending(self, step.step_id)

    def _output_of(self, step_id: int) -> ModelRunnerOutput:
        # Every step, not only when rank 0 is late: a rank that died would otherwise be found
        # only once its part of the work (tensor parallelism) was missed. A waitpid each.
        self._check_alive()
        while step_id not in self._outputs:
            kind, _, got_id, payload = self._receive()
            if kind != wp.OUTPUT:
                raise WorkerFailed(f"unexpected {kind!r} from a worker while stepping")
            self._outputs[got_id] = step_codec.decode_output(payload)
        return self._outputs.pop(step_id)

    def shutdown(self) -> None:
        procs, self._procs = self._procs, []
        for sock in self._step_sockets:
            try:
                sock.send_multipart([wp.SHUTDOWN, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for proc in procs:
            proc.stop(_SHUTDOWN_WAIT_S)
        for sock in self._step_sockets:
            sock.close(linger=0)
        self._step_sockets = []
        if not self._inbox.closed:
            self._inbox.close(linger=0)
        self._context.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def __del__(self) -> None:
        if self._procs:
            self.shutdown()


class _Pending:
    def __init__(self, executor: MultiprocExecutor, step_id: int) -> None:
        self._executor = executor
        self._step_id = step_id
        self._output: ModelRunnerOutput | None = None

    def get(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._output_of(self._step_id)
        return self._output
