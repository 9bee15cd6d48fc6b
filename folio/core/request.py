"""A request as the engine core sees it: token ids, progress, and its block hashes."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from folio.core.block_hash import BlockHash, hash_block_tokens
from folio.core.mm_inputs import ImageInputData
from folio.lora.request import LoRARequest
from folio.pooling_params import PoolingParams
from folio.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """A tokenized, validated request as the front end hands it to the engine core (in the
    same process, or over ZMQ to the engine-core process)."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    # A pooling request: runs its prompt and returns a pooled result instead of tokens
    # (sampling_params is then a placeholder of one token).
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None
    # The LoRA adapter (None = the base model).
    lora_request: LoRARequest | None = None
    # time.monotonic() after which it is finished with reason "timeout" (None = none).
    deadline: float | None = None
    # Seconds its cached KV blocks stay pinned once it finishes (a stored response, which a
    # continuation reuses: folio/core/kv_pins.py); None = freed as usual.
    kv_pin_ttl: float | None = None
    # Disaggregated prefill (vLLM's kv_transfer_params): {"do_remote_decode": true} on a
    # prefill server; on a decode server, what the prefill server's answer carried (where its
    # KV is). None = an ordinary request.
    kv_transfer_params: dict | None = None
    # Its images (a vision-language model); None = none.
    mm_inputs: list[ImageInputData] | None = None


class RequestStatus(enum.IntEnum):
    WAITING = 0
    # Waiting for its grammar to compile (off the busy loop); others are scheduled meanwhile.
    WAITING_FOR_GRAMMAR = 1
    RUNNING = 2
    PREEMPTED = 3
    # Its prompt's KV is being fetched from a prefill server (disaggregated prefill); its
    # blocks are allocated, and it is scheduled once the fetch is reported.
    WAITING_FOR_REMOTE_KVS = 4
    # Everything from here on is finished.
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8
    # Past its deadline, or waited longer than max_queue_time before its first step.
    FINISHED_TIMEOUT = 9

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_TIMEOUT: "timeout",
}


class GrammarState(Protocol):
    """A constrained request's grammar as the core sees it (the engine layer implements it:
    compiling, matching and masks need libraries the torch-free core must not import)."""

    # Set by the engine layer once the grammar has compiled (or failed to) — never by a
    # background thread — so one scheduling pass sees one consistent answer.
    ready: bool

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Hand over sampled tokens (the engine layer may advance its matcher later, off the
        critical path); False if the grammar rejected one."""
        ...


class Request:
    """One sequence to generate. A request with n>1 is fanned out into n of these upstream."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        *,
        block_size: int,
        max_model_len: int,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        extra_hash_keys: tuple[Any, ...] = (),
        pooling_params: PoolingParams | None = None,
        token_type_ids: list[int] | None = None,
        hash_blocks: bool = True,
        lora_request: LoRARequest | None = None,
        deadline: float | None = None,
        kv_pin_ttl: float | None = None,
        kv_transfer_params: dict | None = None,
        mm_inputs: list[ImageInputData] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.deadline = deadline
        self.kv_pin_ttl = kv_pin_ttl
        self.kv_transfer_params = kv_transfer_params
        self.mm_inputs = mm_inputs
        # The images join the first block's hash (so every block of the prompt): two prompts
        # with the same text and different images never share KV. (Coarser than needed: a
        # text prefix before the first image is not shared across images either.)
        if mm_inputs:
            extra_hash_keys = tuple(extra_hash_keys) + tuple(
                "image:" + m.content_hash for m in mm_inputs)
        # Prompt tokens whose KV a connector supplied (fetched from a prefill server): they
        # count as computed; 0 = none.
        self.num_external_computed_tokens = 0
        # While a connector loads its KV: the key its blocks and the load are known by.
        self.kv_load_key: str | None = None
        # The adapter joins the first block's hash: the same prompt under two adapters (or
        # under one and the base model) has different KV and must not share blocks.
        if lora_request is not None:
            extra_hash_keys = (lora_request.cache_key(),) + tuple(extra_hash_keys)
        self.extra_hash_keys = extra_hash_keys
        self.block_size = block_size
        self.pooling_params = pooling_params
        self.token_type_ids = token_type_ids

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Output tokens being sampled by a step still in flight (async scheduling): scheduled
        # as the next step's input before their values are known; their ids reach the model
        # on the device. 0 or 1.
        self.num_pending_tokens = 0
        # Needs its own latest token on the host before its next step can be built (bad
        # words; grammars are checked apart): the engine then waits for the step in flight.
        # Penalties and min_tokens do not: the sampler counts a token still on the device.
        self.needs_host_history = _needs_host_history(sampling_params)
        # Prompt tokens served from the prefix cache when first scheduled (-1 = not yet scheduled).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # The number of output tokens this request may produce, bounded by the context window.
        room = max_model_len - len(self.prompt_token_ids)
        self.max_tokens = room if sampling_params.max_tokens is None else min(
            sampling_params.max_tokens, room)
        self.block_hashes: list[BlockHash] = []
        # False when the engine keeps no prefix cache: nothing would look the hashes up (an
        # encoder's thousands of short inputs spent a seventh of their host time hashing).
        self.hash_blocks = hash_blocks
        self._update_block_hashes()
        # Draft tokens proposed for this request's next step (speculative decoding).
        self.spec_token_ids: list[int] = []
        # Constrained decoding state; None = unconstrained.
        self.structured_output: GrammarState | None = None
        # What the workers hold of this request (the step messages send only what is new):
        # whether it was ever sent, how many of its tokens and of its current blocks (per KV
        # cache group).
        self.sent_to_workers = False
        self.num_sent_tokens = 0
        self.num_sent_blocks: list[int] = []

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, *, block_size: int,
                                 max_model_len: int, hash_blocks: bool = True) -> "Request":
        return cls(req.request_id, req.prompt_token_ids, req.sampling_params,
                   tuple(req.eos_token_ids), block_size=block_size, max_model_len=max_model_len,
                   arrival_time=req.arrival_time, priority=req.priority, cache_salt=req.cache_salt,
                   pooling_params=req.pooling_params, token_type_ids=req.token_type_ids,
                   hash_blocks=hash_blocks, lora_request=req.lora_request,
                   deadline=req.deadline, kv_pin_ttl=req.kv_pin_ttl,
                   kv_transfer_params=req.kv_transfer_params, mm_inputs=req.mm_inputs)

    # Ordering for the priority policy: lower priority value first, then earlier arrival.
    def sort_key(self) -> tuple[int, float, str]:
        return (self.priority, self.arrival_time, self.request_id)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id; 0 = the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def needs_every_prompt_token(self) -> bool:
        """No prefix-cache hit may skip prompt tokens: prompt logprobs need logits at every
        position, a per-token pooling task every position's hidden state."""
        if self.pooling_params is not None:
            task = self.pooling_params.pooling_task
            return task is not None and task.per_token
        return self.sampling_params.prompt_logprobs is not None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        # Per token per step: only call into the hashing when a block just filled up.
        if self.hash_blocks and \
                len(self.all_token_ids) >= (len(self.block_hashes) + 1) * self.block_size:
            self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        """Hash every block that became full. Hashes chain, so block i's hash names the whole
        prefix up to it; extra keys (tenant salt, adapter, media) go into the first block."""
        if not self.hash_blocks:
            return
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self.all_token_ids):
            index = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            extra: tuple[Any, ...] = ()
            if index == 0:
                extra = (self.cache_salt,) + tuple(self.extra_hash_keys)
            tokens = self.all_token_ids[index * bs:(index + 1) * bs]
            self.block_hashes.append(hash_block_tokens(parent, tokens, extra))


def _needs_host_history(params: SamplingParams) -> bool:
    return bool(params.bad_words_token_ids)
