"""The step messages: what the scheduler hands the workers for one step, and what a worker hands
back. Plain msgspec structs with no logic, imported by the scheduler, the executors and the
workers alike, so a step crosses a process boundary unchanged (msgpack) — or, in process, is
passed as it is.

A worker keeps its own state per request (tokens, block table, sampling state) and updates it
from these messages alone: a request is sent whole once (`NewRequestData`), then only as diffs
(`CachedRequestData`). Nothing here refers to a scheduler object, and no list in a message is
shared with one (the scheduler copies what it sends), so a message means the same after the
scheduler moves on.
"""
from __future__ import annotations

from typing import Callable

import msgspec

from folio.core.mm_inputs import ImageInputData
from folio.lora.request import LoRARequest
from folio.pooling_params import PoolingParams
from folio.sampling_params import SamplingParams

# array_like: encoded as msgpack arrays, not maps (smaller and faster for the per-step structs);
# gc=False: these hold no reference cycles, so the collector need not track them.


class NewRequestData(msgspec.Struct, array_like=True, gc=False):
    """A request the workers have not seen: everything needed to run it."""
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    # One list per KV cache group (folio/core/kv_cache_layout.py), in group order.
    block_ids: list[list[int]]
    # Tokens already in the KV cache (prefix-cache hits) before this step.
    num_computed_tokens: int
    # A pooling request (returns a PooledData once its prompt has run, never samples).
    pooling_params: PoolingParams | None = None
    # Segment ids of the prompt's tokens (BERT-style encoders: 0 for the query, 1 for the
    # document of a cross-encoder pair); None = all 0.
    token_type_ids: list[int] | None = None
    # The LoRA adapter it runs with (None = the base model); the worker loads it from
    # lora_path into a device slot before the step, keyed by lora_int_id.
    lora_request: LoRARequest | None = None
    # Its images (a vision-language model): their features replace the embeddings of their
    # placeholder tokens in the steps that run those tokens.
    mm_inputs: list[ImageInputData] | None = None


class CachedRequestData(msgspec.Struct, array_like=True, gc=False):
    """A request the workers hold, as a diff since the last step that scheduled it."""
    req_id: str
    # Blocks appended to its block table of each KV cache group; after a preemption, the
    # whole new tables. A sliding-window group's table may hold the null block where blocks
    # were freed out of its window; entries the worker holds are never rewritten (a freed
    # block's entry lies before the window, where no query reads).
    new_block_ids: list[list[int]]
    # Tokens appended to it since the workers last heard of it (the ones sampled by earlier
    # steps, which reach the scheduler one step later under async scheduling). Sent rather
    # than kept from the worker's own sampling, so a worker's state is a function of the
    # messages alone: replicas, and pipeline ranks that do not sample, stay in step.
    new_token_ids: list[int]
    num_computed_tokens: int
    # Preempted (blocks dropped) and scheduled again: `new_block_ids` replaces its table.
    resumed_from_preemption: bool = False


class KVTransferHold(msgspec.Struct, array_like=True, gc=False):
    """Disaggregated prefill, producer side: a finished prompt's blocks, kept for a consumer
    to fetch under `transfer_id` (a random token it must present) until released."""
    transfer_id: str
    block_ids: list[int]


class KVTransferLoad(msgspec.Struct, array_like=True, gc=False):
    """Disaggregated prefill, consumer side: fetch the KV of `remote_block_ids` from the
    producer's worker (rank r at host:port + r) into `local_block_ids`, in the background;
    the result is reported as (req_id, ok) in a later step's output."""
    req_id: str
    transfer_id: str
    host: str
    port: int
    remote_block_ids: list[int]
    local_block_ids: list[int]
    # The producer's engine id (a restart changes it): what a consumer keys the producer's
    # mapped GPU memory by (CUDA IPC).
    remote_engine_id: str = ""


class SchedulerOutput(msgspec.Struct, gc=False):
    """One step. `num_scheduled_tokens` is in batch order: the order of the flat batch's
    requests. A request's last scheduled input may be the token the step before is still
    sampling (async scheduling): when `num_computed_tokens + num_scheduled_tokens` runs one
    past the tokens the worker holds, that input comes from the previous step's sampled ids on
    the device."""
    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests whose step ends at their last token, so one is sampled (batch order).
    sampling_req_ids: list[str]
    # Requests finished or aborted since the previous step: the workers drop their state.
    finished_req_ids: list[str]
    # Requests preempted by this step: the workers drop their rows (and keep their state).
    preempted_req_ids: list[str]
    # A GrammarBitmask for this step follows (sent after the step, so the grammar matchers
    # fill it while the forward pass runs).
    has_grammar: bool = False
    # Draft tokens per request for speculative decoding (empty until it lands).
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # Whether the worker's proposer (a draft model, an EAGLE head) drafts after this step.
    # False while the adaptive draft length rests at k = 0: its drafts would be dropped, and
    # an EAGLE head's drafting cost more than the step on the CPU. The proposer still writes
    # the step's positions into its own cache, so drafting can resume at any step.
    propose_drafts: bool = True
    # Pooling requests whose prompt ends in this step: each gets a PooledData (batch order).
    pooling_req_ids: list[str] = []
    # LoRA adapters (lora_int_id) the engine removed (remove_lora): the workers drop their
    # host copies, free their device slots and forget a failed load, before this step's
    # adapters are loaded. Sent once no running request uses the adapter.
    removed_lora_ids: list[int] = []
    # The host and disk KV tiers' work (folio/core/kv_offload.py), run before the forward
    # pass in this order: host slots spilled to their block's file (slot, block hash),
    # device blocks saved to host slots (block, slot), files read into host slots (hash,
    # slot; each reported in the reply), host slots loaded into device blocks (slot, block);
    # then files deleted (hashes).
    kv_spills: list[tuple[int, bytes]] = []
    kv_saves: list[tuple[int, int]] = []
    kv_disk_reads: list[tuple[bytes, int]] = []
    kv_loads: list[tuple[int, int]] = []
    kv_disk_deletes: list[bytes] = []
    # Disaggregated prefill (folio/core/kv_p2p.py): prompts' blocks a producer now keeps for
    # consumers, holds it drops (fetched, or their time ran out), and fetches a consumer
    # starts.
    kv_transfer_holds: list[KVTransferHold] = []
    kv_transfer_releases: list[str] = []
    kv_transfer_loads: list[KVTransferLoad] = []


class GrammarBitmask(msgspec.Struct, array_like=True, gc=False):
    """Allowed next tokens of a step's sampling rows: int32 words [rows, num_words], bit b
    of word w allows token 32*w + b. Each request of `req_ids` (the order of
    `sampling_req_ids`) has 1 + len(its drafts in scheduled_spec_decode_tokens) rows: the
    allowed tokens at its next position and after each prefix of its drafts (one row without
    drafts). Rows outside `constrained_rows` are all ones."""
    req_ids: list[str]
    constrained_rows: list[int]
    num_words: int
    # Little-endian int32 rows; in process a buffer over the host mask (no copy).
    data: bytes


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of several positions, as columns: the chosen token (its logprob and rank, 1 =
    most likely) and its top alternatives, best first."""
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


class PromptLogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of prompt tokens [start, start + len(lists.token_ids)) scored in one step."""
    start: int
    lists: LogprobsLists


class PooledData(msgspec.Struct, array_like=True, gc=False):
    """A pooling request's result: a float32 array of `shape` ([dims] for a sequence, [tokens,
    dims] per token), little-endian bytes (compact on the wire; numpy reads it without a
    copy)."""
    shape: list[int]
    data: bytes


class ModelRunnerOutput(msgspec.Struct, gc=False):
    """A step's result from rank 0. `sampled_token_ids[i]` are the tokens of `req_ids[i]` (one
    per step today; several once speculative decoding accepts drafts)."""
    req_ids: list[str] = []
    sampled_token_ids: list[list[int]] = []
    # Rows of `req_ids` that asked for logprobs, and theirs (one position each).
    logprobs_req_ids: list[str] = []
    logprobs: LogprobsLists | None = None
    prompt_logprobs: dict[str, PromptLogprobsLists] = {}
    # Draft tokens for each sampling request's next step, made by a draft model in this
    # step (speculative decoding with a model on the worker; empty otherwise).
    draft_token_ids: dict[str, list[int]] = {}
    # Pooling requests of `pooling_req_ids`: their results.
    pooler_output: dict[str, PooledData] = {}
    # Requests the worker could not run (a LoRA adapter whose files no longer load), with
    # the reason: the scheduler finishes them with an error; their other results are void.
    failed_req_ids: dict[str, str] = {}
    # Expert parallelism: (token, expert) pairs each tensor-parallel rank's experts ran since
    # the last report, summed over the MoE layers, in rank order (None: no report this step).
    expert_load: list[int] | None = None
    # The disk KV tier's reads of this step: (block hash, whether the file was good).
    kv_disk_read_results: list[tuple[bytes, bool]] = []
    # Disaggregated prefill: transfer ids a consumer has fetched (the producer may free
    # their blocks), and fetches finished since the last report, (req_id, whether the KV
    # arrived whole).
    kv_transfer_sent: list[str] = []
    kv_transfer_received: list[tuple[str, bool]] = []


# How a worker gets a step's GrammarBitmask, once the step's forward pass is queued: in process
# the engine's grammar matchers fill it then (while the device runs); in a worker process it is
# the message that follows the step.
GrammarBitmaskFn = Callable[[], "GrammarBitmask | None"]
