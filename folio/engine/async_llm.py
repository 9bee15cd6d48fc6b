"""The asynchronous front end used by the server: an engine-core process behind ZMQ, and one
output stream per request.

Threads: the event loop owns all front-end state (output processor, request queues) and the
sending socket; one receiver thread owns the receiving socket and hands each message to the
loop. The engine core runs in a separate process (spawned), so the model's compute never
blocks the loop.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, TypeVar

import zmq

from folio.config import EngineConfig
from folio.core.engine_core_outputs import SchedulerStats
from folio.engine import messages as msg
from folio.engine.admission import QUEUE_TIMEOUT, AdmissionController, RequestRejected
from folio.engine.core_proc import run_engine_core
from folio.engine.frontend import ModelInfo, RequestPreparer, default_sampling_params, load_model_info
from folio.engine.input_processor import PromptType
from folio.engine.output_processor import OutputProcessor
from folio.metrics.stats_logger import StatsLogger
from folio.lora.request import LoRARequest
from folio.pooling_params import PoolingParams
from folio.request_outputs import PoolingRequestOutput, RequestOutput
from folio.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often the stats line is logged while the engine is busy (vLLM's interval).
STATS_LOG_INTERVAL_S = 10.0
# Retry-After of a request refused while the engine sleeps: when the wake-up comes is the
# operator's call, so a short fixed wait.
ASLEEP_RETRY_AFTER_S = 5


class EngineDeadError(RuntimeError):
    """The engine-core process is gone (or shutting down); requests cannot be served."""


class EngineAsleep(Exception):
    """The engine sleeps (sleep mode) and requests are refused meanwhile
    (`--sleep-mode-requests reject`): HTTP 503, try again after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class AsyncLLM:
    def __init__(self, config: EngineConfig, *, metrics: Any | None = None,
                 ready_timeout_s: float = 900.0, log_stats: bool = False,
                 log_level: int | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.stats = SchedulerStats()
        self.stats_logger = StatsLogger() if log_stats else None
        self._stats_task: asyncio.Task | None = None
        # Tokenizing, chat templates, constraint checks and building large responses run here,
        # off the event loop, so /health and other streams never wait behind one request.
        # One thread: tokenizers and templates are then never used concurrently.
        self.preprocess_pool = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="folio-preprocess")
        self.errored: str | None = None
        # Load shedding (--max-waiting-requests): requests waiting for their first step.
        self.admission = AdmissionController(config.admission.max_waiting_requests)
        self._queues: dict[str, asyncio.Queue] = {}
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._draining: str | None = None  # set by begin_shutdown
        # The engine core's sleep state as the last sleep / wake_up / is_sleeping left it:
        # requests read it here, with no round trip to the core.
        self._asleep = False

        self._ipc_dir = tempfile.mkdtemp(prefix="folio-ipc-")
        input_address = f"ipc://{self._ipc_dir}/input"
        output_address = f"ipc://{self._ipc_dir}/output"
        self._context = zmq.Context()
        self._send_socket = self._context.socket(zmq.PUSH)
        self._send_socket.bind(input_address)
        self._recv_socket = self._context.socket(zmq.PULL)
        self._recv_socket.bind(output_address)
        ctx = multiprocessing.get_context("spawn")
        if log_level is None:
            log_level = logging.getLogger("folio").getEffectiveLevel()
        # The engine core starts first: its imports (torch, transformers) and model load run
        # while this process reads the model's config and tokenizer (on the 2-core CPU box a
        # server's second start went from 6.9 to ~4.5 s). It gets the config as given (spawn
        # pickles it now) and fills the model-dependent defaults itself, as this process does
        # below (load_model_info; the same inputs give the same values).
        self.process = ctx.Process(target=run_engine_core, name="folio-engine-core",
                                   args=(config, input_address, output_address, os.getpid(),
                                         log_level, time.time()),
                                   daemon=True)
        self.process.start()
        try:
            self.model_info: ModelInfo = load_model_info(config)
            self.preparer = RequestPreparer(self.model_info, config.structured_outputs.backend,
                                            config.limits, config.lora, config.kv_transfer,
                                            config.multimodal)
            self.output_processor = OutputProcessor(self.model_info.tokenizer)
            self.ready = self._wait_ready(ready_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.preparer.kv_capacity_tokens = self.ready.kv_capacity_tokens
        # The front end left it open with device "auto" (deciding needs torch); now it is known.
        config.scheduler.max_num_seqs = self.ready.max_num_seqs
        self._receiver = threading.Thread(target=self._receive_loop, name="folio-output-receiver",
                                          daemon=True)

    # ---- start-up and shutdown -----------------------------------------------------------

    def _wait_ready(self, timeout_s: float) -> msg.ReadyInfo:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._recv_socket.poll(500):
                kind, payload = msg.decode(self._recv_socket.recv_multipart())
                if kind == msg.READY:
                    return payload
                if kind == msg.FATAL:
                    raise msg.start_error(payload)
            elif not self.process.is_alive():
                raise RuntimeError(f"the engine core exited during start-up "
                                   f"(exit code {self.process.exitcode})")
        raise RuntimeError(f"the engine core was not ready after {timeout_s:.0f} s")

    def _ensure_started(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._receiver.start()
            if self.stats_logger is not None:
                self._stats_task = self._loop.create_task(self._log_stats_forever())

    async def _log_stats_forever(self) -> None:
        while not self._closed:
            await asyncio.sleep(STATS_LOG_INTERVAL_S)
            self.stats_logger.maybe_log(time.monotonic(), self.stats)

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run per-request work that can take long (tokenizing, templates, parsing
        constraints, building big responses) on the preprocessing thread."""
        return await asyncio.get_running_loop().run_in_executor(self.preprocess_pool, fn, *args)

    @property
    def num_open_requests(self) -> int:
        return len(self._queues)

    def num_tracked_requests(self) -> int:
        """Per-request state held here: open streams, the output processor's parents and
        children, pending utility calls. 0 once idle, or state is leaking."""
        return (len(self._queues) + len(self.output_processor.parents)
                + len(self.output_processor.children) + len(self.output_processor.pooling)
                + len(self._utility_futures))

    def abort_all(self, reason: str) -> None:
        """Fail every open request with EngineDeadError(reason) and abort it in the engine
        core (server shutdown: streams end with a clean error instead of being cut)."""
        for request_id in list(self._queues):
            self._abort_locally(request_id)
        self._fail_all(EngineDeadError(reason))

    def begin_shutdown(self, reason: str) -> None:
        """From a signal handler: refuse new requests (health goes 503) and fail the open
        ones on the event loop."""
        self._draining = reason
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.abort_all, reason)

    def shutdown(self, timeout_s: float = 4.0) -> None:
        """Stop the engine core (graceful, then forced) and release sockets. Idempotent.
        Bounded: at most timeout_s + 2 s, so a server stops within its 10 s promise."""
        if self._closed:
            return
        self._closed = True
        if self._stats_task is not None:
            self._stats_task.cancel()
        try:
            if self.process.is_alive():
                self._send_socket.send_multipart(msg.encode(msg.SHUTDOWN, None), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(1)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1)
        self._send_socket.close(linger=0)
        self._recv_socket.close(linger=0)
        self._context.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        self.preprocess_pool.shutdown(wait=False, cancel_futures=True)
        self._fail_all(EngineDeadError("the engine is shut down"))

    # ---- model facts the server needs ----------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.model_info.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.model_info.max_model_len

    def default_sampling_params(self) -> SamplingParams:
        return default_sampling_params(self.model_info)

    @property
    def is_healthy(self) -> bool:
        return (self.errored is None and self._draining is None and not self._closed
                and self.process.is_alive())

    # ---- requests ------------------------------------------------------------------------

    @property
    def unavailable_reason(self) -> str:
        return self.errored or self._draining or "the engine core is not running"

    def _unavailable(self) -> EngineDeadError:
        return EngineDeadError(self.unavailable_reason)

    @property
    def _core_reachable(self) -> bool:
        """The engine core can still take messages (also while draining for shutdown)."""
        return self.errored is None and not self._closed and self.process.is_alive()

    def _send(self, kind: bytes, payload: Any) -> None:
        if not self.is_healthy:
            raise self._unavailable()
        self._send_socket.send_multipart(msg.encode(kind, payload))

    async def _prepare(self, request_id: str | None, prepare: Callable[..., Any]) -> tuple[str, Any]:
        """A request's id (a fresh one if None) and `prepare(request_id=...)` run on the
        preprocessing thread; ValueError for an id in use, EngineDeadError when the engine is
        not there, EngineAsleep when it sleeps and refuses requests meanwhile (both checked
        again after the preparation, which may take a while)."""
        self._ensure_started()
        self._check_serving()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        prepared = await self.run_blocking(functools.partial(prepare, request_id=request_id))
        if request_id in self._queues:  # taken while this one was being prepared
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_serving()
        return request_id, prepared

    def _check_serving(self) -> None:
        if not self.is_healthy:
            raise self._unavailable()
        if self._asleep and self.config.admission.sleep_mode_requests == "reject":
            raise EngineAsleep("the engine is asleep (sleep mode): try again once it is woken "
                               "up", ASLEEP_RETRY_AFTER_S)

    async def generate(self, prompt: PromptType, params: SamplingParams,
                       request_id: str | None = None, *, priority: int = 0,
                       cache_salt: str | None = None,
                       lora_request: LoRARequest | None = None,
                       deadline: float | None = None,
                       kv_pin_ttl: float | None = None,
                       kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs for one request (as params.output_kind says). `deadline`: a
        time.monotonic() value past which the engine finishes it with reason "timeout".
        `kv_pin_ttl`: seconds its KV blocks stay pinned in the prefix cache once it
        finishes (`unpin_kv` ends that sooner).
        Raises ValueError for bad input before anything is queued, RequestRejected when the
        server is over its admission limits (then, or later if it is shed or waits past
        max_queue_time before its first step), EngineDeadError if the engine dies. Closing
        the stream early (client gone) aborts the request."""
        request_id, prepared = await self._prepare(
            request_id, functools.partial(self.preparer.prepare, prompt=prompt, params=params,
                                          priority=priority, cache_salt=cache_salt,
                                          lora_request=lora_request,
                                          kv_transfer_params=kv_transfer_params))
        shed = self.admission.admit(request_id, priority, time.monotonic())
        if shed is not None:
            self._reject(shed, "shed for a request of better priority")
        for core_request in prepared.core_requests:
            core_request.deadline = deadline
            core_request.kv_pin_ttl = kv_pin_ttl
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        arrival = prepared.core_requests[0].arrival_time
        self.output_processor.add_request(request_id, prepared.child_ids, prepared.prompt.prompt,
                                          prepared.prompt.prompt_token_ids, prepared.child_params,
                                          arrival)
        if self.metrics is not None:
            self.metrics.request_added(request_id, arrival, len(prepared.prompt.prompt_token_ids))
        finished = False
        try:
            for core_request in prepared.core_requests:
                self._send(msg.ADD, core_request)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            self.admission.forget(request_id)
            if not finished:
                self._abort_locally(request_id)

    def _reject(self, request_id: str, why: str) -> None:
        """Fail a waiting request with RequestRejected (HTTP 429) and abort it."""
        queue = self._queues.pop(request_id, None)
        self.admission.forget(request_id)
        self._abort_locally(request_id)
        if queue is not None:
            retry = self.admission.retry_after(time.monotonic())
            queue.put_nowait(RequestRejected(f"the server is overloaded: {why}", retry))

    async def encode(self, prompt: PromptType, params: PoolingParams,
                     request_id: str | None = None, *, pair: str | None = None,
                     priority: int = 0) -> PoolingRequestOutput:
        """One pooling request (embed, classify, score ...; `pair`: a cross-encoder's document
        beside the query `prompt`): its PoolingRequestOutput once the engine has run its
        prompt. ValueError for bad input before anything is queued; EngineDeadError if the
        engine dies; cancelling the call aborts the request."""
        request_id, prepared = await self._prepare(
            request_id, functools.partial(self.preparer.prepare_pooling, prompt=prompt,
                                          params=params, pair=pair, priority=priority))
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        core = prepared.core_requests[0]
        self.output_processor.add_pooling_request(request_id, prepared.prompt.prompt,
                                                  prepared.prompt.prompt_token_ids,
                                                  core.arrival_time, prepared.pooling_params.task)
        if self.metrics is not None:
            self.metrics.request_added(request_id, core.arrival_time,
                                       len(prepared.prompt.prompt_token_ids))
        finished = False
        try:
            self._send(msg.ADD, core)
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            finished = True
            return item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort_locally(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort_locally(request_id)
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(asyncio.CancelledError(f"request {request_id} aborted"))

    def _abort_locally(self, request_id: str) -> None:
        child_ids = self.output_processor.abort(request_id)
        if child_ids and self._core_reachable:
            self._send_socket.send_multipart(msg.encode(msg.ABORT, child_ids))
        if child_ids and self.metrics is not None:
            self.metrics.request_aborted(request_id, time.monotonic())

    async def reset_prefix_cache(self) -> bool:
        return await self._call_utility("reset_prefix_cache")

    async def unpin_kv(self, request_ids: list[str]) -> int:
        """End the KV pins of finished requests (those generated with kv_pin_ttl)."""
        return await self._call_utility("unpin_kv", request_ids)

    async def sleep(self, level: int = 1) -> dict[str, int]:
        """Sleep mode (the engine core's EngineCore.sleep); ValueError when it cannot."""
        freed = await self._call_utility("sleep", level)
        self._asleep = True
        return freed

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call_utility("wake_up", tags)
        await self.is_sleeping()    # woken in part (tags) is still asleep

    async def is_sleeping(self) -> bool:
        self._asleep = await self._call_utility("is_sleeping")
        return self._asleep

    async def remove_lora(self, lora_id: int) -> bool:
        """vLLM's remove_lora: the front end forgets the adapter's checked files and the
        engine core has the workers free its copies (EngineCore.remove_lora); False when
        nothing there held it."""
        self.preparer.lora.forget(lora_id)
        return await self._call_utility("remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        """The adapter ids the workers were given and not told to remove."""
        return set(await self._call_utility("list_loras"))

    async def _call_utility(self, method: str, *args: Any) -> Any:
        self._ensure_started()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        try:
            self._send(msg.UTILITY, msg.UtilityCall(call_id, method, list(args)))
            return await future
        finally:
            self._utility_futures.pop(call_id, None)

    # ---- outputs -------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        """Receiver thread: hand every message to the event loop; watch the process."""
        assert self._loop is not None
        while not self._closed:
            try:
                ready = self._recv_socket.poll(500)
            except zmq.ZMQError:
                return  # socket closed at shutdown
            if not ready:
                if not self.process.is_alive() and not self._closed:
                    self._loop.call_soon_threadsafe(
                        self._on_engine_dead, f"the engine core exited (code {self.process.exitcode})")
                    return
                continue
            try:
                kind, payload = msg.decode(self._recv_socket.recv_multipart())
            except zmq.ZMQError:
                return
            if kind == msg.FATAL:
                self._loop.call_soon_threadsafe(self._on_engine_dead, f"the engine core failed: {payload}")
                return
            self._loop.call_soon_threadsafe(self._on_message, kind, payload)

    def _on_message(self, kind: bytes, payload: Any) -> None:
        if kind == msg.OUTPUTS:
            self._on_step_outputs(payload)
        elif kind == msg.UTILITY_RESULT:
            future = self._utility_futures.get(payload.call_id)
            if future is not None and not future.done():
                if payload.error is not None:
                    future.set_exception(RuntimeError(payload.error))
                else:
                    future.set_result(payload.result)

    def _on_step_outputs(self, step: msg.StepOutputs) -> None:
        self.stats = step.stats
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.observe_scheduler_stats(step.stats)
            self._record_token_metrics(step, now)
        if self.stats_logger is not None:
            self._count_tokens(step)
        # Requests the core expired before their first step (max_queue_time): refused.
        expired = {out.request_id for out in step.outputs
                   if out.finish_reason == "timeout" and out.stop_reason == QUEUE_TIMEOUT}
        if expired:
            expired = {self.output_processor.parent_id(rid) for rid in expired}
        outputs, stopped = self.output_processor.process(step.outputs)
        if stopped and self._core_reachable:
            self._send_socket.send_multipart(msg.encode(msg.FINISH, stopped))
        for output in outputs:
            if output.request_id in expired and output.request_id in self._queues:
                self._reject(output.request_id, "it waited longer than --max-queue-time "
                             f"({self.config.admission.max_queue_time} s) for its first step")
                continue
            self.admission.started(output.request_id, now)
            if output.finished and self.metrics is not None:
                if isinstance(output, PoolingRequestOutput):
                    self.metrics.request_finished(output.request_id,
                                                  output.finish_reason or "stop", now,
                                                  len(output.prompt_token_ids), 0,
                                                  pooling_task=output.task)
                else:
                    completion = output.outputs[0] if output.outputs else None
                    self.metrics.request_finished(
                        output.request_id, completion.finish_reason if completion else "stop",
                        now, len(output.prompt_token_ids),
                        sum(len(c.token_ids) for c in output.outputs) if output.outputs else 0)
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    def _record_token_metrics(self, step: msg.StepOutputs, now: float) -> None:
        per_parent: dict[str, tuple[int, float | None]] = {}
        for out in step.outputs:
            child = self.output_processor.children.get(out.request_id)
            if child is None or not out.new_token_ids:
                continue
            parent_id = child.parent.request_id
            count, first = per_parent.get(parent_id, (0, None))
            per_parent[parent_id] = (count + len(out.new_token_ids), first or out.first_scheduled_time)
        for parent_id, (count, first_scheduled) in per_parent.items():
            self.metrics.tokens_generated(parent_id, count, now, first_scheduled)

    def _count_tokens(self, step: msg.StepOutputs) -> None:
        """Prompt tokens computed (counted at each child's first token, less its prefix-cache
        hit) and tokens generated, for the stats line."""
        prompt = generated = 0
        for out in step.outputs:
            if not out.new_token_ids:
                continue
            generated += len(out.new_token_ids)
            child = self.output_processor.children.get(out.request_id)
            if child is not None and not child.token_ids:
                prompt += len(child.parent.prompt_token_ids) - out.num_cached_tokens
        self.stats_logger.record(prompt, generated)

    def _on_engine_dead(self, reason: str) -> None:
        logger.error("%s", reason)
        self.errored = reason
        self._fail_all(EngineDeadError(reason))

    def _fail_all(self, error: BaseException) -> None:
        for queue in list(self._queues.values()):
            queue.put_nowait(error)
        for future in list(self._utility_futures.values()):
            if not future.done():
                future.set_exception(error)
