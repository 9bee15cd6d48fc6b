"""The scheduler: one token budget per step, shared by running requests first, then waiting.

There is no prefill phase and no decode phase. Each request has `num_computed_tokens`, and each
step closes part of the gap to `num_tokens`. Chunked prefill (a partial gap), prefix-cache hits
(a gap that starts later) and decodes (a gap of one) all fall out of that rule.
"""
from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from folio.core.kv_connector import KVConnectorScheduler
from folio.core.kv_offload import HostKVTier, OffloadingConnectorScheduler
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.engine_core_outputs import (EngineCoreOutput, PromptLogprobsChunk, SampledTokenLogprobs,
                                SchedulerStats)
from folio.core.request import Request, RequestStatus
from folio.core.spec.policy import (AdaptiveDraftLength, BatchCappedDraftLength,
                                    FixedDraftLength)
from folio.core.step_messages import (CachedRequestData, LogprobsLists, ModelRunnerOutput,
                                      NewRequestData, SchedulerOutput)

logger = logging.getLogger(__name__)


class Drafter(Protocol):
    """A proposer of draft tokens (folio.core.spec): `receive` gets each step's drafts made
    by the worker (a draft model; host drafters have none), `propose` after a request's
    tokens were updated, `drop` when it is freed (finished, aborted). `lookahead`: KV slots
    each request needs past its step's tokens (a draft model writes its drafts there)."""

    lookahead: int

    def receive(self, drafts: dict[str, list[int]]) -> None: ...

    def propose(self, request: Request) -> list[int]: ...

    def drop(self, request: Request) -> None: ...


@dataclass
class SpecDecodingStats:
    """Cumulative speculative-decoding counts (vLLM's spec_decode metrics): verify steps with
    drafts, draft tokens, accepted tokens, and accepted tokens by draft position."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_drafts: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos.extend([0] * (num_drafts - len(self.accepted_per_pos)))
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: the accepted drafts plus the one sampled after them (1.0
        before any draft: a step without drafts still gives its one token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class ScheduledRequest:
    """The scheduler's own record of one request in a step (never sent to a worker)."""
    request: Request
    num_computed_tokens: int      # tokens already in the KV cache before this step
    num_new_tokens: int           # tokens computed this step
    block_ids: tuple[list[int], ...]   # one list per KV cache group
    # The step reaches the end of the request's tokens, so a new one is sampled. Set when
    # scheduled (the request's token count moves on before the step's output is read under
    # async scheduling).
    samples: bool = False
    # A pooling request's step that reaches the end of its prompt: it returns the pooled
    # result (and never samples).
    pools: bool = False
    # Scheduled again after a preemption.
    resumed: bool = False
    # Draft tokens verified by this step (speculative decoding): inputs after the request's
    # last token, counted in num_new_tokens.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        """The step's input ids known on the host. Shorter than num_new_tokens by one when
        the last input is a token still being sampled by the step in flight (async
        scheduling)."""
        start = self.num_computed_tokens
        return self.request.all_token_ids[start:start + self.num_new_tokens]

    @property
    def has_pending_input(self) -> bool:
        return self.num_computed_tokens + self.num_new_tokens > len(self.request.all_token_ids)


@dataclass
class ScheduledStep:
    """A scheduled step as the engine core keeps it: the scheduler's records of its requests
    (for `update_from_output`) and the message the workers get."""
    scheduled: list[ScheduledRequest]
    message: SchedulerOutput
    # Requests finished or aborted since the previous step: the workers drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return self.message.total_num_scheduled_tokens

    # A KV connector has work on the workers to hear back about (transfers in flight): the
    # step goes to them even when it runs no request.
    polls: bool = False

    @property
    def is_empty(self) -> bool:
        """Nothing to run and nothing to hear back (disk-tier reads and KV transfers report in
        the reply)."""
        return not self.scheduled and not self.message.kv_disk_reads and not self.polls


_FIRST_FINISHED = RequestStatus.FINISHED_STOPPED
# The finishes whose blocks a request's kv_pin_ttl pins: those of a complete output (an
# aborted, failed or timed-out request is not stored for a continuation).
_PINNED_ON = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
_FINISH_REASON_OF = {status: status.finish_reason for status in RequestStatus
                     if status.finish_reason is not None}


class WaitingQueue:
    """FCFS: a deque, preempted requests back at the front. Priority: a heap on
    (priority, arrival), so a preempted request regains its place by its own key."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[tuple, Request]] = []

    def __len__(self) -> int:
        return len(self._deque) if self.policy == "fcfs" else len(self._heap)

    def add(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._deque.append(request)
        else:
            heapq.heappush(self._heap, (request.sort_key(), request))

    def add_preempted(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._deque.appendleft(request)
        else:
            self.add(request)

    def peek(self) -> Request:
        return self._deque[0] if self.policy == "fcfs" else self._heap[0][1]

    def pop(self) -> Request:
        return self._deque.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[1]

    def remove(self, requests: set[Request]) -> None:
        if self.policy == "fcfs":
            self._deque = deque(r for r in self._deque if r not in requests)
        else:
            self._heap = [item for item in self._heap if item[1] not in requests]
            heapq.heapify(self._heap)

    def __iter__(self):
        return iter(self._deque) if self.policy == "fcfs" else (r for _, r in sorted(self._heap))


class Scheduler:
    def __init__(self, *, kv_cache_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs",
                 async_scheduling: bool = False, drafter: Drafter | None = None,
                 adaptive_draft_length: bool = True,
                 disable_by_batch_size: int | None = None, max_loras: int = 0,
                 max_queue_time: float | None = None, pipelined: bool = False,
                 host_tier: HostKVTier | None = None,
                 connector: KVConnectorScheduler | None = None) -> None:
        """`max_loras`: the most distinct LoRA adapters among running requests (the worker's
        device slots); 0 = LoRA off. `max_queue_time`: seconds a request may wait for its
        first step before it is finished with reason "timeout" (None = forever).
        `pipelined`: several steps are in flight at once (pipeline parallelism), each of other
        requests: a request whose sampled token is still in flight sits out the step.
        `connector`: a KV connector (folio/core/kv_connector.py; None = none) that supplies
        prompts' KV from elsewhere (the host and disk tiers, a prefill server) or keeps
        finished requests' KV for others. `host_tier`: the host-memory KV tier
        (--kv-offloading-size), run as its connector (OffloadingConnectorScheduler)."""
        if pipelined and async_scheduling:
            raise ValueError("pipelined steps and async_scheduling exclude each other: a "
                             "request's token in flight makes it sit out, not run ahead")
        self.kv = kv_cache_manager
        if host_tier is not None:
            if connector is not None:
                raise ValueError("one KV connector at a time: the host KV tier or another")
            connector = OffloadingConnectorScheduler(host_tier, kv_cache_manager.block_size)
        self.connector = connector
        # The host tier, when the connector is it (its stats and contents, for tests).
        self.host_tier = getattr(connector, "tier", None)
        if connector is not None and not isinstance(kv_cache_manager, KVCacheManager):
            raise ValueError("a KV connector (the host KV tier, disaggregated prefill) runs "
                             "with one full-attention KV cache group")
        if hasattr(connector, "on_block_evicted"):
            if not kv_cache_manager.enable_caching:
                raise ValueError("the host KV tier (kv_offloading_size) needs prefix caching")
            # evicted prefix blocks go to the tier
            kv_cache_manager.block_pool.on_evict = connector.on_block_evicted
        # Requests whose prompt KV the connector is loading (their blocks allocated), and
        # finished requests whose blocks it keeps (a prefill server's, for a decode server).
        # Both by a key of their own (`_owner_key`), not the request id: a client may use an
        # id again (a retry) while these blocks are still being read or written.
        self._remote_waiting: dict[str, Request] = {}
        self._held: set[str] = set()
        self._num_owner_keys = 0
        # Speculative decoding: proposes each running request's draft tokens after its
        # tokens are updated (None = off).
        self.drafter = drafter
        # How many of its drafts each request verifies per step (spec/policy.py).
        self.draft_length = None if drafter is None else (
            AdaptiveDraftLength() if adaptive_draft_length else FixedDraftLength())
        if self.draft_length is not None and disable_by_batch_size is not None:
            self.draft_length = BatchCappedDraftLength(self.draft_length, disable_by_batch_size)
        # Whether the last update made proposals: while the draft length rests (none made),
        # drafts left on a request are never verified (k = 0 drops them), so the per-step
        # questions about drafts skip their pass over the running requests (at batch 64 on
        # the H200 the engine is host-bound, and every step paid for two such passes).
        self._proposed = True
        self.spec_stats = SpecDecodingStats()
        # Expert parallelism: (token, expert) pairs each rank's experts ran, cumulative.
        self.expert_load_per_rank: list[int] = []
        # Schedule the next step before the step in flight has returned its tokens: running
        # requests then also decode the token still being sampled (see Request.num_pending_tokens).
        self.async_scheduling = async_scheduling
        self.pipelined = pipelined
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.max_loras = max_loras
        self.max_queue_time = max_queue_time
        # Requests with a deadline, so expire_requests scans only when there are some.
        self._num_deadlines = 0
        self.num_expired = 0
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self._first_scheduled: dict[str, float] = {}
        self.num_preemptions = 0
        self._step_id = 0
        # LoRA adapters (lora_int_id) the workers were sent, so may hold; and those removed
        # (remove_lora), each with the requests that had it then and must finish first.
        self._sent_loras: set[int] = set()
        self._loras_to_remove: dict[int, set[str]] = {}

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if request.deadline is not None:
            self._num_deadlines += 1
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        """Finish these requests now, with `status` (set before their blocks are freed:
        whether they are pinned depends on it)."""
        aborted = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            aborted.append(request)
        if not aborted:
            return []
        aborted_set = set(aborted)
        self.running = [r for r in self.running if r not in aborted_set]
        self.waiting.remove(aborted_set)
        for request in aborted:
            request.status = status
            self._free(request)
        return aborted

    def _free(self, request: Request) -> None:
        if request.deadline is not None and request.request_id in self.requests:
            self._num_deadlines -= 1
        if self.drafter is not None:
            self.drafter.drop(request)
            self.draft_length.drop(request.request_id)
        if request.kv_pin_ttl and request.status in _PINNED_ON:
            self.kv.pin(request, time.monotonic() + request.kv_pin_ttl)
        if self.connector is not None:
            self.connector.forget(request.request_id)
        # Blocks a load is writing into are freed when the load reports (kept under the
        # load's key, so the id may be used again); blocks the connector keeps were moved to
        # their own key already.
        if request.kv_load_key is not None:
            self.kv.rekey(request.request_id, request.kv_load_key)
        else:
            self.kv.free(request)
        self.requests.pop(request.request_id, None)
        self._first_scheduled.pop(request.request_id, None)
        self._finished_since_last_step.add(request.request_id)

    def has_finished_since_last_step(self) -> bool:
        return bool(self._finished_since_last_step)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or any(
            not r.is_finished for r in self._remote_waiting.values())

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        self.kv.pins.expire(time.monotonic())   # one comparison while no pin is due
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[Request] = []

        # Speculative decoding: how many drafts the decoding requests verify this step.
        draft_k = self._choose_draft_length() if self.draft_length is not None else 0

        # Running requests first: they hold blocks already, and finishing them frees blocks.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self.pipelined and request.num_pending_tokens:
                index += 1     # its token is in a step still in flight
                continue
            pending = request.num_pending_tokens if self.async_scheduling else 0
            num_new = min(len(request.all_token_ids) + pending - request.num_computed_tokens,
                          budget)
            if pending and (len(request.output_token_ids) + pending >= request.max_tokens
                            or len(request.all_token_ids) + pending >= self.max_model_len):
                num_new = 0  # the token in flight is its last: it finishes on that update
            if num_new <= 0:
                index += 1
                continue
            drafts = request.spec_token_ids
            if drafts:
                request.spec_token_ids = []
                # A request whose latest token is still in flight has drafts made before
                # it: they are stale (the engine finishes that step first when it drafts).
                if num_new == 1 and not pending:   # a decode step: verify the drafts that pay and fit
                    room = min(budget - 1, request.max_tokens - len(request.output_token_ids) - 1,
                               self.max_model_len - len(request.all_token_ids) - 1, draft_k)
                    drafts = drafts[:max(room, 0)]
                    num_new += len(drafts)
                else:
                    drafts = []
            while True:
                new_blocks = self.kv.allocate_slots(request, num_new,
                                                    num_lookahead_tokens=self._lookahead(
                                                        request.num_computed_tokens + num_new))
                if new_blocks is not None:
                    break
                if self.kv.pins.release_oldest():
                    continue    # pins give way before any running request does
                victim = self._pick_victim()
                undone = scheduled.pop(victim.request_id, None)
                if undone is not None:
                    # Scheduled earlier in this step (priority policy): that step never runs,
                    # so the blocks it would have filled must not stay in the prefix cache.
                    self.kv.uncache_unwritten_blocks(victim, undone.num_computed_tokens)
                    budget += undone.num_new_tokens
                    index -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                # The request preempted itself and left the running list, so `index` already
                # names the next one. Under fcfs it was the last; under priority the ones after
                # it rank higher and may fit in the blocks it just gave back.
                continue
            scheduled[request.request_id] = ScheduledRequest(
                request, request.num_computed_tokens, num_new, (), spec_token_ids=drafts)
            budget -= num_new
            index += 1

        # Then waiting requests, unless this step had to preempt (no room to grow). Requests
        # whose grammar is still compiling step aside, and so do requests of a LoRA adapter
        # that would be one more than the worker's slots hold; they keep their place in the
        # queue.
        not_ready: list[Request] = []
        running_loras = {r.lora_int_id for r in self.running if r.lora_request is not None} \
            if self.max_loras else set()
        while (not preempted and len(self.waiting) > 0 and budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting.peek()
            if (self.async_scheduling or self.pipelined) and request.num_pending_tokens:
                # Preempted with a token in flight: it resumes once that token is known.
                break
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                if not (request.structured_output is not None and request.structured_output.ready):
                    not_ready.append(self.waiting.pop())
                    continue
                request.status = RequestStatus.WAITING
            if request.lora_request is not None and self.max_loras \
                    and request.lora_int_id not in running_loras \
                    and len(running_loras) >= self.max_loras:
                not_ready.append(self.waiting.pop())
                continue
            num_loaded = 0     # past the device prefix hit: tokens the connector supplies
            if request.num_external_computed_tokens:
                # Its prompt's KV was fetched into the blocks it holds: only the rest runs.
                hit_blocks, num_hit_tokens = [], request.num_computed_tokens
            else:
                hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
                if self.connector is not None:
                    num_loaded, load_async = self.connector.get_num_new_matched_tokens(
                        request, num_hit_tokens)
                    if num_loaded is None:
                        not_ready.append(self.waiting.pop())   # asked again next step
                        continue
                    if load_async:
                        if not self._start_remote_load(request, hit_blocks, num_hit_tokens,
                                                       num_loaded):
                            break
                        continue
            num_device_hits = num_hit_tokens
            num_hit_tokens += num_loaded
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            while True:
                new_blocks = self.kv.allocate_slots(
                    request, num_loaded + num_new, hit_blocks,
                    num_lookahead_tokens=self._lookahead(num_hit_tokens + num_new))
                # Pins give way to a waiting request too (a released pin's blocks stay
                # cached, so the hits found above still hold).
                if new_blocks is not None or not self.kv.pins.release_oldest():
                    break
            if new_blocks is None:
                break
            self.waiting.pop()
            if self.connector is not None and not request.num_external_computed_tokens:
                # (its tokens go into the blocks after the device prefix hit, this step)
                request.num_computed_tokens = num_device_hits
                self.connector.update_state_after_alloc(
                    request, self.kv.get_block_ids(request.request_id)[0], num_loaded,
                    request.request_id)
            resumed = request.status == RequestStatus.PREEMPTED
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.num_external_computed_tokens:
                request.num_external_computed_tokens = 0     # scheduled: the blocks are its own
            elif self.kv.enable_caching and not request.needs_every_prompt_token:
                self.kv.record_lookup(request, num_hit_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.lora_request is not None:
                running_loras.add(request.lora_int_id)
            self._first_scheduled.setdefault(request.request_id, time.monotonic())
            scheduled[request.request_id] = ScheduledRequest(request, num_hit_tokens, num_new, (),
                                                             resumed=resumed)
            budget -= num_new

        for request in reversed(not_ready):
            self.waiting.add_preempted(request)  # back at the front, in their old order

        items = list(scheduled.values())
        for item in items:
            request = item.request
            item.block_ids = self.kv.get_block_ids(item.request_id)
            end = item.num_computed_tokens + item.num_new_tokens
            request.num_computed_tokens = end
            if end >= len(request.all_token_ids) + request.num_pending_tokens:
                if request.pooling_params is not None:
                    item.pools = True
                else:
                    item.samples = True
                    request.num_pending_tokens += 1

        step = ScheduledStep(items, self._message(items, preempted),
                             finished_req_ids=self._finished_since_last_step,
                             preempted_req_ids=[r.request_id for r in preempted],
                             polls=self.has_connector_work())
        self._finished_since_last_step = set()
        return step

    def _start_remote_load(self, request: Request, hit_blocks: list, num_hit_tokens: int,
                           num_external: int) -> bool:
        """Allocate blocks for the prompt tokens the connector supplies after the device
        prefix hit, and park the request until its load is reported. False when the pool
        has no room (the request keeps its place)."""
        while True:
            # not indexed in the prefix cache until their K/V has arrived
            new_blocks = self.kv.allocate_slots(request, num_external, hit_blocks, cache=False)
            if new_blocks is not None or not self.kv.pins.release_oldest():
                break
        if new_blocks is None:
            return False
        self.waiting.pop()
        request.num_computed_tokens = num_hit_tokens
        key = self._owner_key(request)
        self.connector.update_state_after_alloc(
            request, list(self.kv.get_block_ids(request.request_id)[0]), num_external, key)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.kv_load_key = key
        self._remote_waiting[key] = request
        return True

    def _owner_key(self, request: Request) -> str:
        self._num_owner_keys += 1
        return f"{request.request_id}#{self._num_owner_keys}"

    def _finish_remote_loads(self, results: list[tuple[str, bool]]) -> None:
        """Loads the workers finished: a request whose KV arrived is scheduled from its last
        prompt token; one whose load failed computes its prompt (its blocks are dropped,
        never indexed). Back at the front of the queue either way."""
        for key, ok in results:
            request = self._remote_waiting.pop(key, None)
            if request is None:
                continue
            request.kv_load_key = None
            if request.is_finished:      # aborted while loading: its blocks are free now
                self.kv.free_key(key)
                continue
            if ok:
                request.num_computed_tokens = request.num_prompt_tokens - 1
                request.num_external_computed_tokens = request.num_computed_tokens
            else:
                self.kv.free(request)
                request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.add_preempted(request)

    def _connector_finished(self, request: Request) -> dict | None:
        """A request finished with tokens: the connector may keep its blocks (freed when it
        says) and gives the kv_transfer_params of its response."""
        if self.connector is None:
            return None
        key = self._owner_key(request)
        keep, params = self.connector.request_finished(
            request, list(self.kv.get_block_ids(request.request_id)[0]), key)
        if keep:
            self.kv.rekey(request.request_id, key)    # freed (free_key) when the connector says
            self._held.add(key)
        return params

    def has_connector_work(self) -> bool:
        """The KV connector has transfers to tell the workers of or hear back about."""
        return self.connector is not None and self.connector.has_pending_work()

    def _message(self, items: list[ScheduledRequest], preempted: list[Request]) -> SchedulerOutput:
        """The step as the workers get it: new requests whole, the others as diffs since they
        were last sent. Every list is a copy: the request's own lists go on changing."""
        # First: a new request of this step may send a removed adapter again.
        removed_loras = self._take_lora_removals()
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        num_scheduled: dict[str, int] = {}
        sampling: list[str] = []
        pooling: list[str] = []
        spec: dict[str, list[int]] = {}
        for item in items:
            request = item.request
            rid = request.request_id
            num_scheduled[rid] = item.num_new_tokens
            if item.spec_token_ids:
                spec[rid] = list(item.spec_token_ids)
            if item.samples:
                sampling.append(rid)
            elif item.pools:
                pooling.append(rid)
            blocks = item.block_ids
            tokens = request.all_token_ids
            if not request.sent_to_workers:
                request.sent_to_workers = True
                new_reqs.append(NewRequestData(
                    rid, request.prompt_token_ids, request.sampling_params,
                    list(request.eos_token_ids), [list(ids) for ids in blocks],
                    item.num_computed_tokens, request.pooling_params, request.token_type_ids,
                    request.lora_request, request.mm_inputs))
                if request.lora_request is not None:
                    self._sent_loras.add(request.lora_int_id)
                # The prompt is all a new request has (its output starts empty).
                request.num_sent_tokens = len(tokens)
            else:
                if item.resumed:
                    new_blocks = [list(ids) for ids in blocks]
                else:
                    new_blocks = [ids[n:] for ids, n in zip(blocks, request.num_sent_blocks)]
                cached_reqs.append(CachedRequestData(
                    rid, new_blocks, tokens[request.num_sent_tokens:],
                    item.num_computed_tokens, item.resumed))
                request.num_sent_tokens = len(tokens)
            request.num_sent_blocks = [len(ids) for ids in blocks]
        self._step_id += 1
        if self.connector is not None:
            self.connector.expired_holds(time.monotonic())
        connector_meta = self.connector.build_connector_meta() if self.connector else {}
        return SchedulerOutput(
            step_id=self._step_id, scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()), sampling_req_ids=sampling,
            finished_req_ids=sorted(self._finished_since_last_step),
            preempted_req_ids=[r.request_id for r in preempted],
            has_grammar=any(item.samples and item.request.structured_output is not None
                            for item in items),
            scheduled_spec_decode_tokens=spec,
            propose_drafts=self.draft_length is None or self.draft_length.wants_proposals(),
            pooling_req_ids=pooling, removed_lora_ids=removed_loras, **connector_meta)

    def _take_lora_removals(self) -> list[int]:
        """The removed adapters whose requests from before the removal have all finished,
        taken for the step message. Requests of the id that came after it do not hold it up:
        the worker drops the adapter before the step's adapters load, so they read its files
        again."""
        if not self._loras_to_remove:
            return []
        removed = []
        for lora_id, holders in self._loras_to_remove.items():
            holders.intersection_update(self.requests)    # the unfinished ones
            if not holders:
                removed.append(lora_id)
        for lora_id in removed:
            del self._loras_to_remove[lora_id]
            self._sent_loras.discard(lora_id)
        return sorted(removed)

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=Request.sort_key)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the request's blocks; it rejoins the waiting queue and
        later recomputes its tokens, mostly from the prefix cache."""
        self.running.remove(request)
        if getattr(self.connector, "keeps_evicted_blocks", False):
            # With the host tier the preemption may be a swap for the full blocks: they stay
            # cached, go to the host when the device evicts them, and load back on resume;
            # or, where loading them would cost more than computing them (a short prompt,
            # a full tier), a recompute: their eviction saves nothing.
            computed = request.num_computed_tokens
            blocks = min(computed // self.kv.block_size, len(request.block_hashes))
            swap, why = self.connector.on_preempt(request, blocks)
            kept = blocks * self.kv.block_size if swap else 0
            logger.info("preempted %s: %s (%s); %d of its %d computed tokens kept in full "
                        "blocks%s, %d recomputed on resume", request.request_id,
                        "swap" if swap else "recompute", why, kept, computed,
                        " (device, then host tier: a swap)" if swap else "", computed - kept)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(request)

    def _lookahead(self, end: int) -> int:
        """KV slots past a step that ends at token `end` that the drafter writes into (a
        draft model's drafts), up to max_model_len."""
        if self.drafter is None or not self.drafter.lookahead:
            return 0
        return max(0, min(self.drafter.lookahead, self.max_model_len - end))

    def update_from_output(self, scheduler_output: ScheduledStep,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        # Runs for every request every step: locals and plain comparisons instead of
        # properties (at batch 256 this loop was a millisecond-scale part of each step).
        outputs: list[EngineCoreOutput] = []
        if runner_output.expert_load is not None:
            self._add_expert_load(runner_output.expert_load)
        if self.connector is not None:
            freed, loaded = self.connector.update_connector_output(runner_output)
            for key in freed:
                if key in self._held:
                    self._held.discard(key)
                    self.kv.free_key(key)
            self._finish_remote_loads(loaded)
        if self.drafter is not None:
            self.drafter.receive(runner_output.draft_token_ids)
        # Drafts for the next step, unless the draft length rests at k = 0 (then making them
        # would only cost the host).
        propose = self.drafter is not None and self.draft_length.wants_proposals(
            len(self.running))
        self._proposed = propose
        if self.drafter is not None:
            # (a resting drafter skips what only future drafts would use)
            self.drafter.active = propose
            if propose:
                self.drafter.begin_proposals()
        # One token per request per step, or with drafts the accepted ones and one more.
        sampled = {rid: tokens for rid, tokens in
                   zip(runner_output.req_ids, runner_output.sampled_token_ids) if tokens}
        all_prompt_logprobs = ({rid: PromptLogprobsChunk(chunk.start, logprobs_entries(chunk.lists))
                                for rid, chunk in runner_output.prompt_logprobs.items()}
                               if runner_output.prompt_logprobs else None)
        # A request's logprobs rows, one per token it got (several after a verify step).
        all_logprobs: dict[str, list[SampledTokenLogprobs]] | None = None
        if runner_output.logprobs is not None:
            all_logprobs = {}
            for rid, entry in zip(runner_output.logprobs_req_ids,
                                  logprobs_entries(runner_output.logprobs)):
                all_logprobs.setdefault(rid, []).append(entry)
        first_scheduled = self._first_scheduled
        finished: list[Request] = []
        failed = runner_output.failed_req_ids
        for item in scheduler_output.scheduled:
            request = item.request
            if item.samples:
                request.num_pending_tokens -= 1
            if request.status >= _FIRST_FINISHED:
                continue  # aborted while the step ran, or finished by the step before
            request_id = request.request_id
            if failed and request_id in failed:
                logger.warning("request %s failed on the worker: %s", request_id,
                               failed[request_id])
                request.status = RequestStatus.FINISHED_ERROR
                outputs.append(EngineCoreOutput(
                    request_id, [], finish_reason=request.status.finish_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    first_scheduled_time=first_scheduled.get(request_id)))
                finished.append(request)
                continue
            if item.pools:
                # The worker pools every request of pooling_req_ids; one without a result
                # fails rather than waiting forever.
                pooled = runner_output.pooler_output.get(request_id)
                request.status = (RequestStatus.FINISHED_STOPPED if pooled is not None
                                  else RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput(
                    request_id, [], finish_reason=request.status.finish_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    first_scheduled_time=first_scheduled.get(request_id),
                    pooling_output=pooled))
                finished.append(request)
                continue
            prompt_logprobs = all_prompt_logprobs.get(request_id) if all_prompt_logprobs else None
            token_ids = sampled.get(request_id)
            if token_ids is None:
                if prompt_logprobs:
                    outputs.append(EngineCoreOutput(request_id, [],
                                                    new_prompt_logprobs=prompt_logprobs,
                                                    num_cached_tokens=max(request.num_cached_tokens, 0)))
                continue
            if item.spec_token_ids:
                token_ids = self._take_verified(item, token_ids)
            for n, token_id in enumerate(token_ids, 1):
                request.append_output_token(token_id)
                if request.structured_output is not None:
                    # The mask allowed only grammar tokens, so a rejection means a bug
                    # upstream; the token stands (it was sampled) and the matcher keeps its
                    # state.
                    request.structured_output.accept_tokens([token_id])
                self._check_stop(request, token_id)
                if request.status >= _FIRST_FINISHED:
                    token_ids = token_ids[:n]   # tokens after a stop are dropped
                    break
            logprobs = all_logprobs.get(request_id, []) if all_logprobs else []
            status = request.status
            is_finished = status >= _FIRST_FINISHED
            if not is_finished and propose:
                request.spec_token_ids = self.drafter.propose(request)
            outputs.append(EngineCoreOutput(
                request_id, list(token_ids), logprobs[:len(token_ids)],
                prompt_logprobs, _FINISH_REASON_OF.get(status) if is_finished else None,
                request.stop_reason, max(request.num_cached_tokens, 0),
                first_scheduled.get(request_id),
                kv_transfer_params=self._connector_finished(request) if is_finished else None))
            if is_finished:
                finished.append(request)
        if finished:
            done = set(finished)
            self.running = [r for r in self.running if r not in done]
            # Under async scheduling a request can be preempted while its last token is in
            # flight: it finishes from the waiting queue.
            if any(r.num_preemptions for r in finished):
                self.waiting.remove(done)
            for request in finished:
                self._free(request)
        return outputs

    def _take_verified(self, item: ScheduledRequest, token_ids: list[int]) -> list[int]:
        """A verify step's tokens (the accepted drafts, then one sampled after them): the KV
        slots of the rejected drafts are given back to the request's future tokens (its
        computed count steps back; their blocks stay allocated and are overwritten), and
        the acceptance is counted."""
        num_drafts = len(item.spec_token_ids)
        accepted = len(token_ids) - 1
        if not 0 <= accepted <= num_drafts or token_ids[:accepted] != item.spec_token_ids[:accepted]:
            raise RuntimeError(f"request {item.request_id}: a verify step returned {token_ids} "
                               f"for drafts {item.spec_token_ids}")
        item.request.num_computed_tokens -= num_drafts - accepted
        self.spec_stats.observe(num_drafts, accepted)
        self.draft_length.observe_acceptance(item.request_id, num_drafts, accepted)
        return token_ids

    def _decoding_drafts(self) -> tuple[dict[str, int], int]:
        """The running requests that decode one token next: {request id: drafts on offer}
        for those with drafts, and the count of the others. Under async scheduling a
        request's token in flight counts as known (its drafts, made a token earlier, stand
        for what it will have). With no proposals made by the last update, none are on
        offer, and the count of the others is the running requests' (it is only compared
        with zero then: a prefill step counts as a step without drafts)."""
        if not self._proposed:
            return {}, len(self.running)
        drafting: dict[str, int] = {}
        others = 0
        for request in self.running:
            pending = request.num_pending_tokens if self.async_scheduling else 0
            if len(request.all_token_ids) + pending - request.num_computed_tokens == 1:
                if request.spec_token_ids:
                    drafting[request.request_id] = len(request.spec_token_ids)
                else:
                    others += 1
        return drafting, others

    def _choose_draft_length(self) -> int:
        return self.draft_length.choose(*self._decoding_drafts())

    def next_step_drafts(self) -> bool:
        """Whether the next `schedule()` would verify drafts, as it stands (no state
        changes): the engine then finishes the step in flight first, since drafts need every
        token on the host, and runs that step synchronously."""
        if self.draft_length is None:
            return False
        return self.draft_length.will_draft(*self._decoding_drafts())

    @property
    def prices_swaps(self) -> bool:
        """Whether the connector prices preemption by swap from the steps' times (the host
        tier): the engine then reports each step's time."""
        return hasattr(self.connector, "observe_step")

    def observe_step_time(self, num_tokens: int, seconds: float, verify: bool,
                          loaded_blocks: int = 0) -> None:
        """A step's wall time (`verify`: it carried drafts; `loaded_blocks`: host-tier blocks
        it loaded): the cost models the adaptive draft length and swap pricing decide by."""
        if self.draft_length is not None:
            self.draft_length.observe_step(num_tokens, seconds, verify)
        observe = getattr(self.connector, "observe_step", None)
        if observe is not None:
            observe(num_tokens, loaded_blocks, seconds)

    def _check_stop(self, request: Request, token_id: int) -> None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return
        if num_output >= request.max_tokens or len(request.all_token_ids) >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED

    def expire_requests(self, now: float) -> list[EngineCoreOutput]:
        """Finish, with reason "timeout", the requests past their deadline and those that
        waited longer than max_queue_time for a first step (stop_reason says which: the
        front end turns the second into a retry-later refusal)."""
        if self.max_queue_time is None and not self._num_deadlines:
            return []
        expired: dict[str, str] = {}
        oldest = None if self.max_queue_time is None else now - self.max_queue_time
        for request in self.requests.values():
            if request.is_finished:
                continue
            if request.deadline is not None and now >= request.deadline:
                expired[request.request_id] = "deadline"
            elif oldest is not None and request.num_cached_tokens < 0 \
                    and request.arrival_time < oldest:
                expired[request.request_id] = "max_queue_time"
        if not expired:
            return []
        self.finish_requests(expired, RequestStatus.FINISHED_TIMEOUT)
        self.num_expired += len(expired)
        return [EngineCoreOutput(rid, [], finish_reason="timeout", stop_reason=reason)
                for rid, reason in expired.items()]

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests for a reason found outside the core (a stop string in the text)."""
        self.abort_requests(request_ids, status)

    def unpin_kv(self, request_ids: list[str]) -> int:
        """End the pins of these finished requests (a stored response deleted or evicted);
        returns how many there were."""
        return self.kv.pins.unpin(request_ids)

    def has_expired_pins(self, now: float) -> bool:
        """A pin is past its expiry: a step (even an empty one) releases it."""
        return self.kv.pins.has_expired(now)

    def reset_prefix_cache(self) -> bool:
        done = self.kv.reset_prefix_cache()
        if done and self.connector is not None:
            self.connector.reset()
        return done

    def remove_lora(self, lora_id: int) -> bool:
        """Tell the workers to drop the adapter's host copy and device slot, in the next step
        message once the requests that have it now (running or queued) finish. False when
        neither a worker nor a request holds it (never used, or removed already)."""
        holders = {rid for rid, r in self.requests.items() if r.lora_int_id == lora_id}
        if lora_id not in self._sent_loras and not holders:
            return False
        self._loras_to_remove[lora_id] = holders
        return True

    def list_loras(self) -> set[int]:
        """The adapters the workers were sent and not told to remove (a worker's host LRU
        may have let some go already)."""
        return self._sent_loras - self._loras_to_remove.keys()

    def has_lora_removals(self) -> bool:
        return bool(self._loras_to_remove)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage, num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.stats.queries, prefix_cache_hits=self.kv.stats.hits,
            num_blocks=self.kv.block_pool.num_blocks, num_free_blocks=self.kv.num_free_blocks,
            num_tracked_requests=len(self.requests),
            num_pinned_blocks=self.kv.pins.num_pinned_blocks,
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_stats.accepted_per_pos),
            expert_load_per_rank=list(self.expert_load_per_rank),
            **(self._lora_stats() if self.max_loras else {}),
            **(self.connector.stats() if self.connector is not None else {}))

    def _add_expert_load(self, load: list[int]) -> None:
        """A worker's report of each rank's expert load since its last one (expert
        parallelism), added to the cumulative counts."""
        totals = self.expert_load_per_rank
        if len(totals) < len(load):
            totals.extend([0] * (len(load) - len(totals)))
        for rank, count in enumerate(load):
            totals[rank] += count

    def _lora_stats(self) -> dict:
        def names(requests) -> list[str]:
            return sorted({r.lora_request.lora_name for r in requests
                           if r.lora_request is not None})
        return {"running_lora_adapters": names(self.running),
                "waiting_lora_adapters": names(self.waiting), "max_lora": self.max_loras}


def logprobs_entries(lists: LogprobsLists) -> list[SampledTokenLogprobs]:
    """The per-position objects the front end reads, from a worker's logprob columns."""
    return [SampledTokenLogprobs(*row) for row in zip(
        lists.token_ids, lists.logprobs, lists.ranks, lists.top_token_ids, lists.top_logprobs)]
