"""The engine core: the scheduler and the executor, stepping together. It sees token ids only;
text is the front end's business."""
from __future__ import annotations

import gc
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from folio.config import FP8_KV_CACHE_DTYPES, EngineConfig
from folio.core.kv_cache_manager import make_kv_cache_manager
from folio.core.kv_connector import KVConnectorScheduler
from folio.core.kv_offload import DiskKVIndex, HostKVTier, OffloadingConnectorScheduler
from folio.core.kv_p2p import P2PConnectorScheduler
from folio.core.request import EngineCoreRequest, Request, RequestStatus
from folio.core.engine_core_outputs import EngineCoreOutput, SchedulerStats
from folio.core.scheduler import ScheduledStep, Scheduler
from folio.core.spec.drafter import make_drafter
from folio.engine.grammar_manager import StructuredOutputManager
from folio.engine.kv_scale_calibration import calibration_token_ids
from folio.executor import make_executor, resolve_device_type
from folio.executor.base import PendingOutput
from folio.model.discovery import ModelSource
from folio.sampling_params import SamplingParams

# The start-up request whose step sets an FP8 cache's computed scales (never a user's id: the
# front end's ids are its own counters and user strings, and this one runs before any).
_CALIBRATION_REQUEST_ID = "folio-kv-scale-calibration"

logger = logging.getLogger(__name__)


@dataclass
class StepTimes:
    """Host seconds in each part of `EngineCore.step`, summed over steps; collected only when
    an engine's `step_times` is set (`folio bench latency --step-breakdown`)."""
    steps: int = 0
    schedule_s: float = 0.0   # the scheduler, the step message included
    launch_s: float = 0.0     # the executor: inputs built, forward and sampling queued
    wait_s: float = 0.0       # blocked on a step's sampled ids (device time not hidden)
    update_s: float = 0.0     # the scheduler taking the sampled ids in


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config: Any,
                 tokenizer: Any = None) -> None:
        self.config = config
        # Objects an earlier engine of this process froze (below) become collectable again;
        # on CUDA a dropped engine caught in a reference cycle is reclaimed before this one
        # sizes its KV cache from the free memory (a full collection: ~0.3 s).
        gc.unfreeze()
        # The device decides defaults the worker and the scheduler are built with (max_num_seqs);
        # the front end left them open with device "auto" (it does not import torch).
        device_type = resolve_device_type(config.model.device)
        config.finalize_device(device_type)
        on_cuda = device_type == "cuda"
        if on_cuda:
            gc.collect()
        self.executor = make_executor(config, source, hf_config)
        self.num_blocks = self.executor.num_blocks
        layout = self.executor.kv_cache_layout
        self.kv_cache_manager = make_kv_cache_manager(
            layout, self.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
            max_pinned_fraction=config.cache.kv_pin_max_fraction)
        # Tokens the cache surely holds, for the front end's check of n > 1 requests.
        self.kv_capacity_tokens = layout.token_capacity(self.num_blocks, config.cache.block_size)
        sched = config.scheduler
        drafter = make_drafter(config.speculative)
        # A verify step's kept count decides the next step's positions, and host drafters
        # need its tokens: the step after one is never built before it returns; nor is the
        # step after one whose drafts a draft model or head makes (they come with its
        # output). Steps without drafts still overlap (async scheduling), so speculation
        # that rests (the adaptive draft length's k = 0 at large batches) costs the overlap
        # nothing.
        async_scheduling = (sched.async_scheduling if sched.async_scheduling is not None
                            else self.executor.device_type == "cuda")
        self._drafts_on_worker = drafter is not None and bool(drafter.lookahead)
        if config.parallel.pipeline_parallel_size > 1:
            # pipelined steps overlap instead: each of other requests, one per stage
            async_scheduling = False
        self.async_scheduling = async_scheduling
        self.scheduler = Scheduler(
            kv_cache_manager=self.kv_cache_manager, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=config.model.max_model_len,
            enable_chunked_prefill=sched.enable_chunked_prefill, policy=sched.policy,
            async_scheduling=self.async_scheduling, drafter=drafter,
            adaptive_draft_length=(config.speculative is None
                                   or config.speculative.adaptive_draft_length),
            disable_by_batch_size=(None if config.speculative is None
                                   else config.speculative.disable_by_batch_size),
            max_loras=0 if config.lora is None else config.lora.max_loras,
            max_queue_time=config.admission.max_queue_time,
            pipelined=config.parallel.pipeline_parallel_size > 1,
            connector=_kv_connector(config, self.executor))
        # Sleep mode: 0 awake, else the level slept at (requests wait).
        self.sleep_level = 0
        # Async scheduling: the step queued on the device whose sampled ids are not yet read.
        self._in_flight: tuple[ScheduledStep, PendingOutput] | None = None
        # When the verify step in flight was scheduled (its cost for the draft length).
        self._in_flight_start = 0.0
        # Pipeline parallelism: up to one step per stage in flight, oldest first, each of
        # other requests (the scheduler leaves out those with a token still in flight).
        self._max_in_flight = config.parallel.pipeline_parallel_size
        self._pipeline: deque[tuple[ScheduledStep, PendingOutput]] = deque()
        # Speculative decoding sizes its drafts from measured step times, and the host tier
        # prices preemption by swap from them.
        self._time_steps = ((drafter is not None and config.speculative.adaptive_draft_length)
                            or self.scheduler.prices_swaps)
        # Set to a StepTimes to have each step's parts timed (benchmarks).
        self.step_times: StepTimes | None = None
        # The tokenizer is only needed for grammars; without one it is loaded on first use.
        self.structured_output = StructuredOutputManager(
            config.structured_outputs,
            (lambda: tokenizer) if tokenizer is not None else lambda: _load_tokenizer(config, source),
            vocab_size=self.executor.vocab_size, max_num_seqs=sched.max_num_seqs)
        if config.cache.calculate_kv_scales and config.cache.cache_dtype in FP8_KV_CACHE_DTYPES:
            try:
                if tokenizer is None:
                    tokenizer = _load_tokenizer(config, source)
            except ValueError as exc:
                logger.warning("FP8 KV cache: no tokenizer for the calibration text (%s); the "
                               "scales come from the first request's step", exc)
            else:
                self._calibrate_kv_scales(tokenizer)
        # Everything built so far (torch, transformers, the model's modules) lives as long as
        # the engine: move it out of the garbage collector's sight (as vLLM's engine core
        # does). Otherwise a full collection walks it all in the middle of serving (measured:
        # a 0.4 s stall in one step of the H200 throughput run). Frozen objects are still freed
        # by reference counting; `gc.unfreeze()` before `gc.collect()` reclaims cycles. On the
        # CPU the collection first is skipped: start-up there is short and often repeated
        # (tests), and garbage frozen with the rest is freed by the next engine's unfreeze.
        if on_cuda:
            gc.collect()
        gc.freeze()

    def _calibrate_kv_scales(self, tokenizer: Any) -> None:
        """Run the fixed calibration text as the engine's first step, so the FP8 cache's
        computed scales come from it rather than from whichever request comes first
        (kv_scale_calibration.py). Its output is dropped, its cached blocks released."""
        ids = calibration_token_ids(tokenizer)
        # one step, and never more than the cache holds (a request it cannot hold would wait
        # here for good)
        ids = ids[:max(1, min(len(ids), self.config.model.max_model_len - 1,
                              self.config.scheduler.max_num_batched_tokens,
                              self.kv_capacity_tokens - 1))]
        self.add_request(EngineCoreRequest(
            _CALIBRATION_REQUEST_ID, ids, SamplingParams(max_tokens=1, temperature=0.0)))
        while self.has_unfinished_requests():
            self.step()
        self.scheduler.reset_prefix_cache()

    def add_request(self, request: EngineCoreRequest | Request) -> None:
        if isinstance(request, EngineCoreRequest):
            request = Request.from_engine_core_request(
                request, block_size=self.config.cache.block_size,
                max_model_len=self.config.model.max_model_len,
                hash_blocks=self.config.cache.enable_prefix_caching)
        self.structured_output.add_request(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def finish_requests(self, request_ids: list[str]) -> None:
        """Stopped by the front end (a stop string): finished, not aborted."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and queue one step. With async scheduling the step's sampled tokens are
        returned by the next call (the previous step's are returned by this one), so the host
        schedules step N+1 while the device runs step N."""
        outputs = self._settle_grammars()
        outputs += self.scheduler.expire_requests(time.monotonic())
        if self.sleep_level:
            return outputs      # asleep: requests wait for wake_up
        if self._max_in_flight > 1:
            return outputs + self._step_pipelined()
        waiting = None if self._in_flight is None else self._in_flight[0]
        if waiting is not None and (_needs_tokens_first(waiting) or self._finished_first(waiting)
                                    or self.scheduler.next_step_drafts()):
            # A request in flight needs its new token on the host before its next step can be
            # built (penalties, a grammar's mask, drafts to verify, a verify step's kept
            # count, the drafts a draft model made in it): finish that step first.
            outputs += self._finish_in_flight()
            if self._time_steps and self._finished_first(waiting):
                # a verify step's cost (or a drafting step's), from its scheduling to its
                # tokens on the host
                self.scheduler.observe_step_time(waiting.total_num_scheduled_tokens,
                                                 time.perf_counter() - self._in_flight_start,
                                                 _verifies(waiting),
                                                 len(waiting.message.kv_loads))
        step_start = time.perf_counter()
        times = self.step_times
        if times is not None:
            start = time.perf_counter()
        step = self.scheduler.schedule()
        if times is not None:
            times.steps += 1
            times.schedule_s += time.perf_counter() - start
        if step.is_empty:
            if self._in_flight is not None:
                self._send_empty_step(step, outputs)
                return outputs + self._finish_in_flight()
            return self._send_empty_step(step, outputs)
        fill = self._grammar_fill(step)
        if times is not None:
            start = time.perf_counter()
        pending = self.executor.execute_model_async(step.message, fill)
        if times is not None:
            times.launch_s += time.perf_counter() - start
        overlapped = self._in_flight is not None
        if overlapped:
            outputs += self._finish_in_flight()
        self._in_flight = (step, pending)
        verify = _verifies(step)
        # Under async scheduling a verify step stays in flight too: the next call finishes it
        # before it schedules (above), so what the caller does with these outputs (the
        # front end's output processing) runs while the device verifies.
        finished = not self.async_scheduling
        finished_first = not finished and self._finished_first(step)
        if finished:
            outputs += self._finish_in_flight()
        elif finished_first:
            self._in_flight_start = step_start
        if self._time_steps and (finished or (overlapped and not finished_first)):
            # speculative decoding's cost model: what a step of this size took, from its
            # scheduling to the end of this call (overlapped: the wait for the step before
            # it; a step left in flight with none before it has no time yet)
            self.scheduler.observe_step_time(step.total_num_scheduled_tokens,
                                             time.perf_counter() - step_start, verify,
                                             len(step.message.kv_loads))
        return outputs

    def _finished_first(self, step: ScheduledStep) -> bool:
        """Whether the next call finishes this step before it schedules (async scheduling),
        timing it from its scheduling to its tokens on the host: a verify step, and a step
        whose drafts the worker makes. Both kinds are timed, so the draft length's plain
        curve knows the drafting steps without drafts too (untimed, it had only the verify
        curve, and kept drafting at any acceptance until its estimate decayed: 150 drafts
        of a random EAGLE head in six requests' first 64 tokens, against 12 synchronous)."""
        return _verifies(step) or (self._drafts_on_worker and step.message.propose_drafts)

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Pipeline parallelism: schedule and queue a step while up to one per stage is in
        flight, so that each stage works on a different step; the oldest is finished once
        the pipeline is full, or when there is nothing new to run."""
        outputs: list[EngineCoreOutput] = []
        if len(self._pipeline) >= self._max_in_flight:
            outputs += self._finish_oldest()
        step = self.scheduler.schedule()
        if step.is_empty:
            if self._pipeline:
                self._send_empty_step(step, outputs)
                return outputs + self._finish_oldest()
            return self._send_empty_step(step, outputs)
        self._pipeline.append((step, self.executor.execute_model_async(
            step.message, self._grammar_fill(step))))
        return outputs

    def _send_empty_step(self, step: ScheduledStep,
                         outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """A step that runs no request: the workers still get it when it tells them of
        requests finished meanwhile, adapters removed or KV tier copies to make. With
        nothing in flight and a grammar compiling, wait for it briefly rather than spin."""
        message = step.message
        if (message.finished_req_ids or message.preempted_req_ids or message.removed_lora_ids
                or message.kv_saves or message.kv_spills or message.kv_disk_deletes):
            self.executor.execute_model(message)
        if (self._in_flight is None and not self._pipeline and not outputs
              and self.structured_output.has_pending()):
            self.structured_output.wait_for_pending(timeout=0.01)
        return outputs

    def _grammar_fill(self, step: ScheduledStep):
        """How the workers get the step's grammar bitmask (None without a grammar)."""
        if not step.message.has_grammar:
            return None
        return lambda: self.structured_output.grammar_bitmask(step)

    def _finish_oldest(self) -> list[EngineCoreOutput]:
        step, pending = self._pipeline.popleft()
        return self.scheduler.update_from_output(step, pending.get())

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        step, pending = self._in_flight
        self._in_flight = None
        times = self.step_times
        if times is None:
            return self.scheduler.update_from_output(step, pending.get())
        start = time.perf_counter()
        output = pending.get()
        waited = time.perf_counter()
        outputs = self.scheduler.update_from_output(step, output)
        times.wait_s += waited - start
        times.update_s += time.perf_counter() - waited
        return outputs

    def _settle_grammars(self) -> list[EngineCoreOutput]:
        """Finished compiles become ready; a grammar that failed to compile finishes its
        request with an error (the front end validates first, so this is rare)."""
        if not self.structured_output.has_pending():
            return []
        outputs = []
        for request, error in self.structured_output.update():
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
            outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="error",
                                            stop_reason=error))
        return outputs

    def has_pending_notifications(self) -> bool:
        """Requests finished outside a step (aborts) whose worker state is still to drop,
        removed LoRA adapters the workers still hold, or KV pins past their expiry (while
        idle too: a step releases them)."""
        return (self.scheduler.has_finished_since_last_step()
                or self.scheduler.has_lora_removals()
                or self.scheduler.has_connector_work()
                or self.scheduler.has_expired_pins(time.monotonic()))

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self._in_flight is not None
                or bool(self._pipeline))

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def unpin_kv(self, request_ids: list[str]) -> int:
        """End the KV pins of finished requests (EngineCoreRequest.kv_pin_ttl)."""
        return self.scheduler.unpin_kv(request_ids)

    # ---- LoRA adapters (vLLM's remove_lora / list_loras) ----------------------------------

    def remove_lora(self, lora_id: int) -> bool:
        """Free adapter `lora_id` in the workers (host copy, device slot) with the next step
        message, or once the requests using it finish. False when nothing holds it. Its
        prefix-cache blocks stay, keyed by its id and name: a later adapter under the same id
        and name must have the same weights."""
        self._check_lora("remove_lora")
        return self.scheduler.remove_lora(lora_id)

    def list_loras(self) -> list[int]:
        """The adapters the workers were given and not told to remove, sorted."""
        self._check_lora("list_loras")
        return sorted(self.scheduler.list_loras())

    def _check_lora(self, method: str) -> None:
        if self.config.lora is None:
            raise ValueError(f"{method}: LoRA adapters are not enabled (start the engine "
                             "with enable_lora=True / --enable-lora)")

    # ---- sleep mode (--enable-sleep-mode) -------------------------------------------------

    def sleep(self, level: int = 1) -> dict[str, int]:
        """Free the device: level 1 moves the weights to host memory and drops the KV cache,
        level 2 drops both (waking reads the checkpoint again). Only when idle; requests
        that arrive while asleep wait for wake_up. Returns the bytes freed of each."""
        if not self.config.model.enable_sleep_mode:
            raise ValueError("sleep: start the engine with enable_sleep_mode "
                             "(--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        if self.sleep_level:
            raise ValueError(f"sleep: already asleep (level {self.sleep_level})")
        if self.has_unfinished_requests():
            raise ValueError(f"sleep: {len(self.scheduler.requests)} request(s) in flight; "
                             "sleep when the engine is idle")
        if not hasattr(self.executor, "sleep"):
            raise ValueError("sleep: sleep mode runs with --distributed-executor-backend uni")
        self.scheduler.reset_prefix_cache()      # the blocks' contents go
        freed = self.executor.sleep(level)
        self.sleep_level = level
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep freed (tags: "weights", "kv_cache"; None: everything)."""
        if not self.sleep_level:
            return
        self.executor.wake_up(tags)
        if not self.executor.sleep_level:
            self.sleep_level = 0

    def is_sleeping(self) -> bool:
        return bool(self.sleep_level)

    def shutdown(self) -> None:
        self._in_flight = None
        self._pipeline.clear()
        self.structured_output.shutdown()
        self.executor.shutdown()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()


def _kv_connector(config: EngineConfig, executor) -> KVConnectorScheduler | None:
    """The scheduler's side of the KV connector: the host (and disk) tier
    (--kv-offloading-size, or an OffloadingConnector --kv-transfer-config), or the
    P2pConnector of disaggregated prefill; None without one."""
    tier = _host_tier(config, executor)
    if tier is not None and config.kv_transfer is not None:
        raise ValueError("kv_transfer_config: one KV connector at a time (the host KV tier "
                         "or disaggregated prefill's P2pConnector)")
    if tier is not None:
        return OffloadingConnectorScheduler(tier, config.cache.block_size,
                                            executor.host_block_bytes)
    if config.kv_transfer is None:
        return None
    return P2PConnectorScheduler(config.kv_transfer, config.cache.block_size,
                                 executor.kv_transfer_port)


def _host_tier(config: EngineConfig, executor) -> HostKVTier | None:
    """The host KV tier (--kv-offloading-size) and the disk tier below it (--kv-disk-path),
    sized from the workers' pools; None without one."""
    cache = config.cache
    if cache.kv_offloading_size is None:
        return None
    disk = None
    if cache.kv_disk_path is not None:
        capacity = int(cache.kv_disk_size * 2**30) // max(executor.host_block_bytes, 1)
        disk = DiskKVIndex(capacity, executor.disk_kv_hashes)
    return HostKVTier(executor.num_host_blocks, disk=disk)


def _needs_tokens_first(step: ScheduledStep) -> bool:
    for item in step.scheduled:
        request = item.request
        if item.samples and (request.needs_host_history or request.structured_output is not None):
            return True
    return False


def _verifies(step: ScheduledStep) -> bool:
    """Whether the step checks drafts: its kept count decides the next step's positions."""
    return bool(step.message.scheduled_spec_decode_tokens)


def _load_tokenizer(config: EngineConfig, source: ModelSource) -> Any:
    from folio.engine.tokenizer import load_tokenizer
    return load_tokenizer(source, config.model.tokenizer, config.model.revision)
