"""Plain data passed out of the engine core: the per-request outputs it returns (a worker's
per-step results are step messages, folio.core.step_messages). Dataclasses with exact types,
so msgspec can carry them between the engine-core process and the front end unchanged."""
from __future__ import annotations

from dataclasses import dataclass, field

from folio.core.step_messages import PooledData


@dataclass
class SampledTokenLogprobs:
    """Logprobs at one position: the chosen token (with its rank, 1 = most likely) and the
    top-k alternatives, best first."""
    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class PromptLogprobsChunk:
    """Logprobs of prompt tokens [start, start + len(entries)) computed in one step. Placed by
    position: after a preemption the prompt is recomputed and the same positions come again."""
    start: int
    entries: list[SampledTokenLogprobs]


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampledTokenLogprobs] = field(default_factory=list)
    new_prompt_logprobs: PromptLogprobsChunk | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    # A pooling request's result (it finishes with it, no tokens).
    pooling_output: PooledData | None = None
    # Disaggregated prefill: on a prefill server's finished request, where a decode server
    # fetches its prompt's KV (vLLM's kv_transfer_params of the response).
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    # Requests the scheduler holds state for (running, waiting, finished but not yet
    # reported): 0 once idle, or state is leaking.
    num_tracked_requests: int = 0
    # Blocks held by pins of finished requests (stored responses' KV, kept for a
    # continuation); counted in kv_cache_usage too, and given back before any preemption.
    num_pinned_blocks: int = 0
    # Speculative decoding, cumulative (zeros when off): verify steps with drafts, draft
    # tokens, accepted drafts, accepted drafts by position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # Expert parallelism, cumulative: (token, expert) pairs each tensor-parallel rank's
    # experts ran, summed over the MoE layers (empty without expert parallelism).
    expert_load_per_rank: list[int] = field(default_factory=list)
    # The host KV tier (--kv-offloading-size; zeros when off): the share of its pool in use;
    # cumulative prompt blocks found there / not found past the device prefix hit, and the
    # bytes copied each way (device to host: saves; host to device: loads).
    kv_offload_usage: float = 0.0
    kv_offload_hit_blocks: int = 0
    kv_offload_miss_blocks: int = 0
    kv_offload_saved_bytes: int = 0
    kv_offload_loaded_bytes: int = 0
    # The disk tier below it (--kv-disk-path), cumulative: blocks read back, files found bad.
    kv_disk_read_blocks: int = 0
    kv_disk_bad_blocks: int = 0
    # Preemptions with the host tier, cumulative: swapped (full blocks kept for the tier)
    # and left to recompute (priced cheaper, or no room).
    kv_swap_preemptions: int = 0
    kv_recompute_preemptions: int = 0
    # Disaggregated prefill (P2pConnector; zeros when off), cumulative: a prefill server's
    # prompts kept for decode servers and those fetched; a decode server's fetches done,
    # the prompt tokens they brought (not computed here), and fetches that failed or were
    # refused (computed instead).
    kv_transfer_held_requests: int = 0
    kv_transfer_sent_requests: int = 0
    kv_transfer_received_requests: int = 0
    kv_transfer_received_tokens: int = 0
    kv_transfer_failed_requests: int = 0
    # LoRA adapters (names) of the running and the waiting requests, and the most a step may
    # run (vLLM's lora_requests_info gauge); 0 = LoRA off.
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    max_lora: int = 0
