"""Runs one step message over the flat batch: the worker's persistent batch is updated from the
message's diffs, the step's inputs built (eager, or into a CUDA graph's buffers), the forward
pass and the sampling queued."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch

from folio.core.step_messages import (GrammarBitmask, GrammarBitmaskFn, LogprobsLists,
                                      ModelRunnerOutput, PromptLogprobsLists, SchedulerOutput)
from folio.model.attention import AttentionMetadata
from folio.model.decoder import DecoderLM
from folio.model.host_copy import device_tensor, to_device, to_host_async
from folio.model.kernels.sampling import argmax_rows
from folio.worker.flat_batch import StepBuffers, build_flat_batch
from folio.worker.image_embeds import ImageEmbedder
from folio.worker.input_batch import InputBatch
from folio.worker.sampler import (LogprobsTensors, RowLogprobs, Sampler, SamplingState,
                                  token_logprobs_tensors)
from folio.worker.sampling_columns import SamplingColumns
from folio.worker.spec_verify import accept_greedy, needs_own_pass, verify

if TYPE_CHECKING:
    from folio.worker.cuda_graphs import DecodeGraphRunner
    from folio.worker.lora_manager import LoRAManager
    from folio.worker.pooling import PendingPooled, PoolingRunner
    from folio.worker.spec_propose import DraftProposer
    from folio.worker.mixed_graphs import MixedGraphRunner


class ModelRunner:
    def __init__(self, model: DecoderLM, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, *, max_num_seqs: int, max_model_len: int,
                 max_num_tokens: int, graph_runner: DecodeGraphRunner | None = None,
                 calculate_kv_scales: bool = False, num_kv_groups: int = 1) -> None:
        """`kv_caches`: one tensor per model layer (layers of different KV cache groups may
        share one: folio/core/kv_cache_layout.py); `num_kv_groups`: block tables per request."""
        self.model = model
        # Set until the first real step has run: that step, eager, sets each layer's FP8 KV
        # cache scales from its keys and values (--calculate-kv-scales); warm-up, profiling and
        # graph capture run dummy data and leave them alone.
        self.calculate_kv_scales = calculate_kv_scales
        # Replays captured CUDA graphs for pure-decode steps; None = always eager.
        self.graph_runner = graph_runner
        # Replays captured CUDA graphs for the other steps that fit its buffers; None = eager.
        self.mixed_graph_runner: MixedGraphRunner | None = None
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        # The requests this worker runs, as the step messages have described them.
        self.input_batch = InputBatch(max_num_seqs, self.max_blocks, device, max_model_len,
                                      num_kv_groups)
        self._pin = device.type == "cuda"
        self._eager_buffers = StepBuffers(max_num_tokens, max_num_seqs, self.max_blocks,
                                          pin=self._pin, num_kv_groups=num_kv_groups)
        # A draft proposer's inputs rebuilt after a graph replay (made on first use): two
        # buffers taken in turn, so that step N's rebuild waits only for step N - 2's copies
        # (its own buffer's). Step N - 1's sit behind that step's graph on the stream:
        # waiting for them would hold the host until step N - 1 had run.
        self._new_rebuild_buffer = functools.partial(
            StepBuffers, max_num_tokens, max_num_seqs, self.max_blocks, pin=self._pin,
            num_kv_groups=num_kv_groups)
        self._rebuild_buffers: list[StepBuffers | None] = [None, None]
        self._rebuild_turn = 0
        self._bitmask_host: torch.Tensor | None = None
        # The last launched step's sampled ids (on the device) and each sampling request's row
        # in them: the next step, scheduled before those ids reach the host, reads its
        # pending inputs from here.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        # Speculative decoding with a draft model or an EAGLE head (worker/spec_propose.py):
        # it sees every step and drafts after each sampling request's newest token.
        self.draft_proposer: DraftProposer | None = None
        # A pooling model's steps (worker/pooling.py): results instead of sampled tokens.
        self.pooling: PoolingRunner | None = None
        # LoRA adapters (None without --enable-lora): each step's tokens get their slots.
        self.lora: LoRAManager | None = None
        # An encoder takes its tokens' segment ids (BERT's token types) beside the ids.
        self.takes_token_types = bool(getattr(model.spec, "is_encoder", False))
        # A vision-language model's image embeddings (worker/image_embeds.py); None = text.
        self.images: ImageEmbedder | None = None
        self.encoder_profile_bytes: int | None = None   # set by a CUDA profile run
        # An M-RoPE model's (Qwen2-VL's) spatial merge size: requests with images take
        # positions in three rows (model/mrope.py); None = plain positions.
        self.mrope_merge: int | None = None

    def _eager_inputs(self, step: SchedulerOutput, buf: StepBuffers | None = None):
        buf = buf or self._eager_buffers
        buf.wait_for_copies()
        flat = build_flat_batch(step, self.input_batch, self._prev_rows, buf, self.block_size)
        T, B = flat.num_tokens, flat.num_reqs
        t = buf.tensors
        to_device = lambda x: x.to(self.device, non_blocking=self._pin)  # noqa: E731
        ids = to_device(t["input_ids"][:T])
        positions = to_device(t["positions"][:T])
        meta = AttentionMetadata(
            slot_mapping=to_device(t["slot_mapping"][:T]),
            query_start_loc=flat.query_start_loc, seq_lens=flat.seq_lens,
            num_computed_tokens=flat.num_computed_tokens,
            block_tables=to_device(t["block_tables"][:B, :max(flat.width, 1)]),
            block_size=self.block_size)
        if len(flat.widths) > 1:
            meta.groups = [meta] + [AttentionMetadata(
                slot_mapping=to_device(t[f"slot_mapping.{g}"][:T]),
                query_start_loc=flat.query_start_loc, seq_lens=flat.seq_lens,
                num_computed_tokens=flat.num_computed_tokens,
                block_tables=to_device(t[f"block_tables.{g}"][:B, :max(flat.widths[g], 1)]),
                block_size=self.block_size) for g in range(1, len(flat.widths))]
        buf.copies_queued()
        if flat.pending_dst:
            self._fill_pending_inputs(ids, flat.pending_dst, flat.pending_src)
        return ids, positions, meta

    def _rebuild_buffer(self) -> StepBuffers:
        """The next of the two buffers for a proposer's rebuilt inputs."""
        turn = self._rebuild_turn
        self._rebuild_turn = 1 - turn
        if self._rebuild_buffers[turn] is None:
            self._rebuild_buffers[turn] = self._new_rebuild_buffer()
        return self._rebuild_buffers[turn]

    def _token_types(self, step: SchedulerOutput, device: torch.device) -> torch.Tensor | None:
        """The step's tokens' segment ids, flat (None when every one is 0)."""
        requests = self.input_batch.requests
        states = [(requests[rid], n) for rid, n in step.num_scheduled_tokens.items()]
        if all(state.token_type_ids is None for state, _ in states):
            return None
        chunks = [np.zeros(n, np.int64) if state.token_type_ids is None else
                  state.token_type_ids[state.num_computed_tokens:state.num_computed_tokens + n]
                  for state, n in states]
        return to_device(torch.from_numpy(np.concatenate(chunks)), device)

    def _fill_pending_inputs(self, input_ids: torch.Tensor, dst: list[int],
                             src: list[int]) -> None:
        """input_ids[dst[j]] = the previous step's sampled token src[j], device to device
        (queued after that step on the same stream, so no host wait)."""
        prev = self._prev_sampled
        assert prev is not None, "a pending input without a step before it"
        k = len(dst)
        if dst == src and dst[-1] == k - 1:
            # Steady decode: the batch keeps its order, rows 0..k-1 feed rows 0..k-1.
            input_ids[:k].copy_(prev[:k])
            return
        index = torch.tensor([dst, src], dtype=torch.int64)
        if self.device.type == "cuda":
            index = index.pin_memory().to(self.device, non_blocking=True)
        input_ids.index_copy_(0, index[0], prev.index_select(0, index[1]))

    @torch.inference_mode()
    def warm_up(self, max_num_tokens: int) -> None:
        """Eager forward passes over dummy prefills of each shape bucket the attention kernel
        tunes for (short, medium and long queries; one and several requests), so that Triton
        compiles and autotunes at start-up rather than under the first requests. Writes
        nothing to the KV cache (every slot is padding)."""
        bs = self.block_size
        batches = [[5], [3, 9], [200], [120, 60], [max_num_tokens], [max_num_tokens // 2] * 2]
        for lens in batches:
            if sum(lens) > max_num_tokens or min(lens) < 1:
                continue
            total = sum(lens)
            width = -(-max(lens) // bs)
            meta = AttentionMetadata(
                slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=self.device),
                query_start_loc=[sum(lens[:i]) for i in range(len(lens) + 1)], seq_lens=lens,
                num_computed_tokens=[0] * len(lens),
                block_tables=torch.zeros((len(lens), width), dtype=torch.int64, device=self.device),
                block_size=bs)
            ids = torch.zeros(total, dtype=torch.int64, device=self.device)
            positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
            hidden = self.model(ids, positions, self.kv_caches, meta)
            if self.pooling is None:
                self.model.compute_logits(hidden[-1:])
        if self.pooling is None:
            self._warm_up_decode()
        self._warm_up_dense_prefill(max_num_tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # Decode steps the decode attention kernel tunes on, as (requests, context): one request
    # at a long context (the split-K variant) and a batch at a context of under two splits'
    # worth (the one-split variant, whatever the batch: triton_kernels.choose_num_splits).
    DECODE_WARM_UP = ((1, 2048), (64, 384))

    def _warm_up_decode(self) -> None:
        """Pure-decode dummy steps at real contexts, before the decode graphs are captured:
        the decode kernel's autotuner picks its tile once per variant, on its first call, and
        the capture's first calls run padding rows of one key each, so a tile chosen there is
        chosen on launch overhead alone (one H200 profile had the one-split kernel at 13.9 us
        a layer of a batch-1 step at a 192-token context, where the 16-split form took 7).
        Reads spread over distinct blocks (their contents do not matter); writes nothing
        (every slot is padding)."""
        bs = self.block_size
        num_blocks = min(c.shape[1] for c in self.kv_caches) if self.kv_caches else 1
        for reqs, ctx in self.DECODE_WARM_UP:
            reqs = max(1, min(reqs, self.max_num_seqs))
            ctx = max(1, min(ctx, self.max_model_len))
            width = -(-ctx // bs)
            tables = torch.arange(reqs * width, device=self.device) % max(1, num_blocks)
            meta = AttentionMetadata(
                slot_mapping=torch.full((reqs,), -1, dtype=torch.int64, device=self.device),
                query_start_loc=list(range(reqs + 1)), seq_lens=[ctx] * reqs,
                num_computed_tokens=[ctx - 1] * reqs,
                block_tables=tables.view(reqs, width), block_size=bs)
            ids = torch.zeros(reqs, dtype=torch.int64, device=self.device)
            positions = torch.full((reqs,), ctx - 1, dtype=torch.int64, device=self.device)
            self.model(ids, positions, self.kv_caches, meta)

    def _warm_up_dense_prefill(self, max_num_tokens: int) -> None:
        """The fused attention of long fresh prefills (attention/dense_prefill.py) plans each
        padded length on first use (~55 ms each on an H200): plan every length up to the step
        budget now, once per distinct layer shape that takes the path."""
        from folio.model.attention import dense_prefill
        from folio.model.layers import Attention
        from folio.worker.cuda_graphs import triton_backend_of
        backend = triton_backend_of(self.model)
        if backend is None or not backend.dense_prefill or not self.kv_caches:
            return
        dtype = next(self.model.parameters()).dtype
        done = set()
        for m in self.model.modules():
            if not isinstance(m, Attention):
                continue
            shape = (m.num_heads, m.num_kv_heads, m.head_dim, m.scale)
            if shape in done:
                continue
            probe = torch.empty((1, m.num_heads, m.head_dim), dtype=dtype, device=self.device)
            if not dense_prefill.layer_supported(
                    probe, probe, self.kv_caches[0], sliding_window=m.sliding_window,
                    logits_soft_cap=m.logits_soft_cap, sinks=m.sinks):
                continue
            done.add(shape)
            dense_prefill.warm_up(*shape, dtype, self.device, max_num_tokens)
        if not done:
            # No layer takes the path (sliding windows, an FP8 cache, ...): long prompts then
            # keep their captured graphs (MixedGraphRunner asks the backend).
            backend.dense_prefill = False

    @torch.inference_mode()
    def warm_up_sampling(self, num_seqs: int) -> None:
        """Logits and sampling at the largest batch, each way the sampler can go (greedy,
        one temperature, a temperature per row, filters), after the KV cache is allocated:
        Triton compiles the fused sampling kernel's variants here, and the device and pinned
        host allocators keep the blocks, so the first busy steps do not stop to grow them (a
        cudaMalloc or a pinned allocation waits for the device)."""
        from folio.sampling_params import SamplingParams
        hidden = torch.zeros((num_seqs, self.model.spec.hidden_size), device=self.device,
                             dtype=next(self.model.parameters()).dtype)
        rows = device_tensor(list(range(num_seqs)), self.device, torch.int64)
        logits = self.model.compute_logits(hidden[rows])
        greedy, plain = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
        per_row = [plain if i % 2 else greedy for i in range(num_seqs)]
        for params in ([greedy] * num_seqs, [plain] * num_seqs, per_row,
                       [SamplingParams(temperature=1.0, top_p=0.9, logprobs=1)] * num_seqs):
            self.sampler.sample(logits, [SamplingState(p) for p in params],
                                SamplingColumns.from_params(params))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """A dummy step at the largest size, for memory profiling: one prefill of num_tokens
        tokens, then logits and sampling for num_seqs rows (top-p, the sort path)."""
        from folio.sampling_params import SamplingParams
        bs = self.block_size
        num_blocks = -(-num_tokens // bs)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            query_start_loc=[0, num_tokens], seq_lens=[num_tokens], num_computed_tokens=[0],
            block_tables=torch.arange(num_blocks, device=self.device)[None, :], block_size=bs)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        # A vision-language model's encoder at its largest batch, its output held through
        # the decoder's pass as a real step holds it.
        held = self._profile_images() if self.images is not None else None
        hidden = self.model(ids, positions, self.kv_caches, meta)
        del held
        if self.pooling is not None or hidden is None:
            return   # no logits, no sampling (the pooler's heads are small; a pipeline
            #          stage before the last has none)
        rows = hidden[-1:].expand(num_seqs, -1)
        logits = self.model.compute_logits(rows)
        params = [SamplingParams(temperature=1.0, top_p=0.9)] * num_seqs
        self.sampler(logits, [SamplingState(p) for p in params],
                     SamplingColumns.from_params(params))

    def _mrope_positions(self, step: SchedulerOutput) -> torch.Tensor | None:
        """[3, T] positions of the step's tokens when it runs prompt tokens of a request with
        images on an M-RoPE model (its prompt's from the table, its later tokens offset by
        the table's delta; other requests' rows alike); None otherwise: a request past its
        prompt takes plain positions plus its `position_offset` (set here, with the table,
        on its first prompt step), so its decode steps keep their CUDA graphs."""
        from folio.model.mrope import mrope_positions
        requests = self.input_batch.requests
        # the common step (decodes, text prompts) builds nothing: one pass of checks
        if not any(state.mm_inputs and (state.mrope is None
                                        or state.num_computed_tokens < state.mrope[0].shape[1])
                   for state in map(requests.__getitem__, step.num_scheduled_tokens)):
            return None
        chunks = []
        needed = False
        for rid, n in step.num_scheduled_tokens.items():
            state = requests[rid]
            index = np.arange(state.num_computed_tokens, state.num_computed_tokens + n)
            if not state.mm_inputs:
                chunks.append(np.broadcast_to(index, (3, n)))
                continue
            if state.mrope is None:
                state.mrope = mrope_positions(
                    state.num_prompt_tokens,
                    [(m.offset, m.length, m.grid_thw, m.time_interval)
                     for m in state.mm_inputs],
                    self.mrope_merge)
                state.position_offset = state.mrope[1]
            table, delta = state.mrope
            needed = needed or state.num_computed_tokens < table.shape[1]
            inside = np.minimum(index, table.shape[1] - 1)
            chunks.append(np.where(index < table.shape[1], table[:, inside], index + delta))
        if not needed:
            return None
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(chunks, axis=1)))

    def _profile_images(self) -> torch.Tensor:
        """The image encoder's profile pass; on CUDA its own peak above what was allocated
        before it is kept in `encoder_profile_bytes` (for the start-up message)."""
        if self.device.type != "cuda":
            return self.images.profile()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        held = self.images.profile()
        torch.cuda.synchronize(self.device)
        self.encoder_profile_bytes = torch.cuda.max_memory_allocated(self.device) - before
        return held

    def execute_model(self, step: SchedulerOutput,
                      grammar_bitmask: GrammarBitmaskFn | None = None) -> ModelRunnerOutput:
        return self.execute_model_async(step, grammar_bitmask).get()

    @torch.inference_mode()
    def execute_model_async(self, step: SchedulerOutput,
                            grammar_bitmask: GrammarBitmaskFn | None = None
                            ) -> PendingRunnerOutput:
        """Apply the step's diffs, then queue its forward pass and sampling; the sampled ids
        come to the host when the returned handle's get() is called, so the caller can
        schedule the next step meanwhile."""
        batch = self.input_batch
        if self.draft_proposer is not None:
            # before the update drops their rows and block tables
            self.draft_proposer.release([*step.finished_req_ids, *step.preempted_req_ids],
                                        batch)
        batch.update(step)
        if step.removed_lora_ids and self.lora is not None:
            self.lora.remove(step.removed_lora_ids)   # first: this step may reuse their slots
        order = step.num_scheduled_tokens
        if not order:
            return PendingRunnerOutput()
        failed: dict[str, str] = {}
        if self.lora is not None:
            requests = batch.requests
            failed = self.lora.set_step([(rid, requests[rid].lora_request) for rid in order],
                                        list(order.values()))
        pending = self._run_step(step, batch, grammar_bitmask)
        pending.failed_req_ids = failed
        return pending

    def _run_step(self, step: SchedulerOutput, batch: InputBatch,
                  grammar_bitmask: GrammarBitmaskFn | None) -> PendingRunnerOutput:
        order = step.num_scheduled_tokens
        graphs, mixed = self.graph_runner, self.mixed_graph_runner
        if self.calculate_kv_scales:
            graphs = mixed = None  # the scales are set eagerly; the graphs only read them
        eager_inputs = None
        # a step that runs image placeholder tokens takes input embeddings: eager
        image_spans = (self.images.spans(step, self.input_batch.requests)
                       if self.images is not None else None)
        mrope = self._mrope_positions(step) if self.mrope_merge is not None else None
        if image_spans or mrope is not None:
            graphs = mixed = None
        if graphs is not None and graphs.can_run(step):
            hidden, query_start_loc = graphs.run(step, batch, self._prev_rows,
                                                 self._fill_pending_inputs)
        elif mixed is not None and mixed.can_run(step):
            hidden, query_start_loc = mixed.run(step, batch, self._prev_rows,
                                                self._fill_pending_inputs)
        else:
            eager_inputs = input_ids, positions, meta = self._eager_inputs(step)
            if mrope is not None:
                positions = mrope.to(positions.device, non_blocking=self._pin)
            meta.calculate_kv_scales = self.calculate_kv_scales
            self.calculate_kv_scales = False   # once
            if self.takes_token_types:
                hidden = self.model(input_ids, positions, self.kv_caches, meta,
                                    token_type_ids=self._token_types(step, input_ids.device))
            elif image_spans:
                hidden = self.model(input_ids, positions, self.kv_caches, meta,
                                    inputs_embeds=self.images.embeds(self.model, input_ids,
                                                                     image_spans))
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
            query_start_loc = meta.query_start_loc
        if hidden is None:
            return PendingRunnerOutput()   # a pipeline stage before the last: nothing sampled
        if eager_inputs is None and self.draft_proposer is not None:
            # The proposer reads the step's inputs unpadded (a graph's live in its buffers),
            # built again now: under async scheduling their rows fed by the previous step's
            # sampled tokens are filled from it, which sampling this step replaces below.
            eager_inputs = self._eager_inputs(step, self._rebuild_buffer())
        if self.pooling is not None:
            return PendingRunnerOutput(
                pooled=self.pooling.run(step, batch, hidden, query_start_loc))
        requests = batch.requests
        req_ids = list(order)

        # Prompt logprobs: row p scores prompt token p+1, for the prompt rows in this chunk.
        # Keyed by the prompt position of the first token scored: after a preemption the
        # prompt is recomputed and the front end must place, not append, these.
        prompt_logprobs: dict[str, tuple[int, LogprobsTensors]] = {}
        for i, rid in enumerate(req_ids):
            state = requests[rid]
            num_prompt = state.sampling.params.prompt_logprobs
            if num_prompt is None:
                continue
            start = state.num_computed_tokens
            end = min(start + order[rid], state.num_prompt_tokens - 1)
            if end <= start:
                continue
            rows = hidden[query_start_loc[i]:query_start_loc[i] + (end - start)]
            targets = device_tensor(batch.token_ids_of(state)[start + 1:end + 1], self.device,
                                    torch.int64)
            logits = self.model.compute_logits(rows)
            prompt_logprobs[rid] = (start + 1, token_logprobs_tensors(logits, targets, num_prompt))

        sampling = step.sampling_req_ids
        if not sampling:
            self._prev_sampled, self._prev_rows = None, {}
            if self.draft_proposer is not None:   # prompt chunks into the proposer's cache
                self._propose(step, eager_inputs, hidden, query_start_loc, [], [], [])
            return PendingRunnerOutput(prompt_logprobs=prompt_logprobs)
        if step.scheduled_spec_decode_tokens:
            return self._verify_step(step, hidden, query_start_loc, req_ids, prompt_logprobs,
                                     grammar_bitmask, eager_inputs)
        if len(sampling) == len(req_ids) == hidden.shape[0]:
            # Every request decodes one token and samples: its row is its hidden state, so no
            # index tensor (a host-to-device copy) and no gather.
            logits = self.model.compute_logits(hidden)
        else:
            index_of = {rid: i for i, rid in enumerate(req_ids)}
            last_rows = device_tensor([query_start_loc[index_of[rid] + 1] - 1 for rid in sampling],
                                      self.device, torch.int64)
            logits = self.model.compute_logits(hidden[last_rows])
        # The forward pass is queued on the device; the grammar masks are filled meanwhile.
        mask = grammar_bitmask() if step.has_grammar and grammar_bitmask is not None else None
        if mask is not None:
            self._apply_bitmask(logits, mask, sampling)
        sampled_states = [requests[rid] for rid in sampling]
        rows = np.fromiter((s.row for s in sampled_states), np.int64, len(sampled_states))
        columns = batch.sampling_columns(rows)
        if columns.any_processors and self._prev_sampled is not None:
            # Under async scheduling the latest token may still be on the device: penalties
            # and min_tokens find it in the previous step's sampled ids.
            ends = np.fromiter((s.num_computed_tokens + order[s.req_id] for s in sampled_states),
                               np.int64, len(sampled_states))
            for j in np.flatnonzero(ends > columns.num_tokens).tolist():
                columns.pending_row[j] = self._prev_rows.get(sampling[j], -1)
        sampled, logprobs = self.sampler.sample(
            logits, [s.sampling for s in sampled_states], columns, self._prev_sampled)
        self._prev_sampled = sampled
        self._prev_rows = {rid: j for j, rid in enumerate(sampling)}
        drafts = None
        if self.draft_proposer is not None:
            # the sampled ids stay on the device: a step that drafts nothing (the draft
            # length resting) then waits for none, so async scheduling overlaps it
            drafts = self._propose(step, eager_inputs, hidden, query_start_loc, list(sampling),
                                   [1] * len(sampling), sampled)
        return PendingRunnerOutput(list(sampling), sampled, logprobs, prompt_logprobs,
                                   draft_token_ids=drafts)

    def _verify_step(self, step: SchedulerOutput, hidden: torch.Tensor,
                     query_start_loc: list[int], req_ids: list[str],
                     prompt_logprobs: dict[str, tuple[int, LogprobsTensors]],
                     grammar_bitmask: GrammarBitmaskFn | None,
                     eager_inputs) -> PendingRunnerOutput:
        """A step carrying draft tokens (speculative decoding): logits at each drafting
        request's last token and after each of its drafts, verified (worker/spec_verify.py);
        the other sampling requests sample one token as usual. The kept tokens are decided on
        the host: here, or, when every request verifies greedily without logprobs, when the
        output is taken (the engine builds no step on it before then: its kept counts decide
        the next step's positions)."""
        spec = step.scheduled_spec_decode_tokens
        sampling = step.sampling_req_ids
        requests = self.input_batch.requests
        index_of = {rid: i for i, rid in enumerate(req_ids)}
        logit_rows: list[int] = []
        first_row: list[int] = []
        for rid in sampling:
            end = query_start_loc[index_of[rid] + 1]
            n = len(spec.get(rid, ())) + 1
            first_row.append(len(logit_rows))
            logit_rows.extend(range(end - n, end))
        if logit_rows == list(range(hidden.shape[0])):
            # Every row is verified, in order (e.g. batch 1): no index copy, no gather.
            logits = self.model.compute_logits(hidden)
        else:
            logits = self.model.compute_logits(
                hidden[device_tensor(logit_rows, self.device, torch.int64)])
        states = [requests[rid] for rid in sampling]
        rows = np.fromiter((s.row for s in states), np.int64, len(states))
        # The grammars' rows line up with the logits rows: one per position verified.
        mask = grammar_bitmask() if step.has_grammar and grammar_bitmask is not None else None
        if mask is not None:
            self._apply_bitmask(logits, mask, sampling)
        plain = [j for j, rid in enumerate(sampling) if rid not in spec]
        token_lists: list[list[int]] = [[] for _ in sampling]
        plain_ids = [sampling[j] for j in plain]
        columns = self.input_batch.sampling_columns(rows)
        # Greedy requests without logit processors share one argmax over every row and one
        # copy to the host, instead of a device round trip each; it is queued before the
        # plain rows are sampled, so their copy to the host waits for both at once.
        own_pass = [rid in spec and needs_own_pass(states[j].sampling, columns, j)
                    for j, rid in enumerate(sampling)]
        argmax_t = (argmax_rows(logits)
                    if any(rid in spec and not own for rid, own in zip(sampling, own_pass))
                    else None)
        if (argmax_t is not None and self.draft_proposer is None and not any(own_pass)
                and all(rid in spec and states[j].sampling.params.logprobs is None
                        for j, rid in enumerate(sampling))):
            # Every request greedy on drafts of its own, no logprobs, no draft model: the
            # kept tokens are decided on the host when the step's output is taken
            # (PendingRunnerOutput.get), so the step returns with its argmax still on the
            # device and the engine's work meanwhile overlaps the verify.
            self._prev_sampled, self._prev_rows = None, {}
            return PendingRunnerOutput(
                list(sampling), prompt_logprobs=prompt_logprobs,
                greedy_verify=(argmax_t, [(first_row[j], list(spec[rid]))
                                          for j, rid in enumerate(sampling)]))
        logprobs = None
        if plain:
            plain_logits = logits[device_tensor([first_row[j] for j in plain], self.device,
                                                torch.int64)]
            sampled, logprobs = self.sampler.sample(
                plain_logits, [states[j].sampling for j in plain],
                self.input_batch.sampling_columns(rows[plain]))
            for j, token in zip(plain, sampled.tolist()):
                token_lists[j] = [token]
        # Logprobs rows, one per emitted token: the plain rows' (from the sampler), then each
        # drafting request's at every position it kept (raw log-softmax, as the sampler's).
        lp_ids: list[str] = []
        lp_parts: list[LogprobsLists] = []
        if logprobs is not None:
            lp_ids += [plain_ids[i] for i in logprobs.rows]
            lp_parts.append(logprobs.tensors.lists())
        argmax = argmax_t.tolist() if argmax_t is not None else None
        for j, rid in enumerate(sampling):
            if rid in spec:
                drafts = spec[rid]
                first = first_row[j]
                num_top = states[j].sampling.params.logprobs
                if own_pass[j] or num_top is not None:
                    rows_j = logits[first:first + len(drafts) + 1]
                if own_pass[j]:
                    kept = verify(rows_j, drafts, states[j].sampling, columns, j,
                                  self.input_batch.token_ids_of(states[j]),
                                  states[j].num_prompt_tokens)
                else:
                    kept = accept_greedy(drafts, argmax[first:first + len(drafts) + 1])
                token_lists[j] = kept
                if num_top is not None:
                    targets = device_tensor(kept, self.device, torch.int64)
                    lp_parts.append(token_logprobs_tensors(rows_j[:len(kept)], targets,
                                                           num_top).lists())
                    lp_ids += [rid] * len(kept)
        self._prev_sampled, self._prev_rows = None, {}
        drafts = None
        if self.draft_proposer is not None:
            drafts = self._propose(step, eager_inputs, hidden, query_start_loc, list(sampling),
                                   [len(t) for t in token_lists], [t[-1] for t in token_lists])
        return PendingRunnerOutput(list(sampling), prompt_logprobs=prompt_logprobs,
                                   draft_token_ids=drafts, token_lists=token_lists,
                                   logprobs_lists=(lp_ids, _concat_lists(lp_parts))
                                   if lp_ids else None)

    def _propose(self, step: SchedulerOutput, eager_inputs, hidden: torch.Tensor,
                 query_start_loc: list[int], sampling: list[str], kept: list[int],
                 newest: torch.Tensor | list[int]) -> dict[str, list[int]]:
        """The draft proposer's turn after a step: sampling request `sampling[j]` got
        `kept[j]` tokens (one, or a verify step's kept drafts and one more), the last of them
        `newest[j]` (a device tensor of the sampled ids, or host ints)."""
        input_ids, positions, meta = eager_inputs
        spec = step.scheduled_spec_decode_tokens
        batch = self.input_batch
        req_ids = list(step.num_scheduled_tokens)
        of_sampling = {rid: j for j, rid in enumerate(sampling)}
        last_rows, last_positions, drafting = [], [], []
        tokens: list[int] = []       # host-known next tokens (prompt chunks'; 0 where sampled)
        sampled_at: list[tuple[int, int]] = []   # (index in the step, index in `sampling`)
        for i, rid in enumerate(req_ids):
            state = batch.requests[rid]
            start, end = query_start_loc[i], query_start_loc[i + 1]
            j = of_sampling.get(rid)
            if j is None:            # a prompt chunk: the next prompt token follows it
                row = end - 1
                tokens.append(int(batch.token_ids_of(state)[state.num_computed_tokens
                                                            + end - start]))
            else:                    # after the kept tokens; rejected drafts' rows beyond
                row = end - 1 - (len(spec.get(rid, ())) + 1 - kept[j])
                tokens.append(0)
                sampled_at.append((i, j))
            last_rows.append(row)
            last_positions.append(state.num_computed_tokens + row - start)
            drafting.append(j is not None and step.propose_drafts)
        next_tokens = _next_tokens(tokens, sampled_at, newest, self.device)
        from folio.worker.spec_propose import DraftInputs
        return self.draft_proposer.propose(
            DraftInputs(input_ids, positions, meta, hidden, req_ids, last_rows,
                        last_positions, next_tokens, drafting), batch)

    def _apply_bitmask(self, logits: torch.Tensor, mask: GrammarBitmask,
                       sampling: list[str]) -> None:
        """Mask the logits of the step's sampling rows (with drafts: of every verified
        position, as the message lays them out) with the grammar's bitmask."""
        from folio.structured_output.masking import apply_token_bitmask
        if mask.req_ids != sampling:
            raise ValueError("the grammar bitmask's rows are not the step's sampling rows")
        rows = len(mask.data) // (4 * mask.num_words)
        if rows != logits.shape[0]:
            raise ValueError(f"the grammar bitmask has {rows} rows for {logits.shape[0]} "
                             "logits rows")
        words = np.frombuffer(mask.data, dtype=np.int32).reshape(rows, mask.num_words)
        constrained = mask.constrained_rows
        host = self._bitmask_host
        if host is None or host.shape[0] < rows or host.shape[1] != mask.num_words:
            # Pinned (CUDA), so the copy to the device is asynchronous; kept between steps.
            host = self._bitmask_host = torch.empty(
                (max(rows, self.input_batch.max_num_reqs), mask.num_words), dtype=torch.int32,
                pin_memory=self._pin)
        # Rewriting it is safe: a constrained request makes the engine read the step before
        # (so wait for its event, after this buffer's last copy) before building this one.
        host[:rows].numpy()[:] = words
        apply_token_bitmask(logits, host[:rows], constrained)


def _next_tokens(tokens: list[int], sampled_at: list[tuple[int, int]],
                 newest: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    """Each request's newest token as one device tensor: `tokens` (host ints, in the step's
    order) with `newest[j]` put at index i for each (i, j) of `sampled_at`. Sampled ids still
    on the device are scattered there, not read: no wait for the step."""
    if not isinstance(newest, torch.Tensor):
        for i, j in sampled_at:
            tokens[i] = newest[j]
        return device_tensor(tokens, device, torch.int64)
    newest = newest.reshape(-1).to(torch.int64)
    if len(sampled_at) == len(tokens) and all(i == j for i, j in sampled_at):
        return newest
    out = device_tensor(tokens, device, torch.int64)
    if sampled_at:
        dst, src = zip(*sampled_at)
        out[device_tensor(list(dst), device, torch.int64)] = newest[
            device_tensor(list(src), device, torch.int64)]
    return out


def _concat_lists(parts: list[LogprobsLists]) -> LogprobsLists:
    return LogprobsLists(*([v for part in parts for v in getattr(part, name)]
                           for name in LogprobsLists.__struct_fields__))


class PendingRunnerOutput:
    """A step's output whose tensors may still be on their way from the device: sampled ids
    and any logprobs are copied behind the step's kernels into pinned memory, and get() waits
    only for those copies (one event), then builds the output message."""

    def __init__(self, request_ids: list[str] | None = None, sampled: torch.Tensor | None = None,
                 logprobs: RowLogprobs | None = None,
                 prompt_logprobs: dict[str, tuple[int, LogprobsTensors]] | None = None, *,
                 token_lists: list[list[int]] | None = None,
                 logprobs_lists: tuple[list[str], LogprobsLists] | None = None,
                 draft_token_ids: dict[str, list[int]] | None = None,
                 pooled: PendingPooled | None = None,
                 greedy_verify: tuple[torch.Tensor, list[tuple[int, list[int]]]] | None = None
                 ) -> None:
        # Requests this step could not run (their LoRA adapter failed to load): reason.
        self.failed_req_ids: dict[str, str] = {}
        # Expert parallelism's per-rank load since the last report (the worker sets it).
        self.expert_load: list[int] | None = None
        # The disk KV tier's reads of this step (the worker sets them).
        self.kv_disk_read_results: list[tuple[bytes, bool]] = []
        # Disaggregated prefill's transfers finished by this step (the worker sets them).
        self.kv_transfer_sent: list[str] = []
        self.kv_transfer_received: list[tuple[str, bool]] = []
        self._request_ids = request_ids or []
        self._pooled = pooled
        self._draft_token_ids = draft_token_ids or {}
        # A verify step's kept tokens per request, and its logprobs rows (a request's id
        # once per token it kept), already on the host.
        self._token_lists = token_lists
        self._logprobs_lists = logprobs_lists
        self._logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs or {}
        self._event: torch.cuda.Event | None = None
        self._host = sampled
        self._output: ModelRunnerOutput | None = None
        # A greedy verify step decided at get(): the argmax of every verified position, and
        # per request (its first row there, its drafts).
        self._verify_argmax: torch.Tensor | None = None
        self._verify_rows: list[tuple[int, list[int]]] = []
        if greedy_verify is not None:
            self._verify_argmax, self._verify_rows = greedy_verify
        on_cuda = sampled.is_cuda if sampled is not None else any(
            t.tensors[0].is_cuda for t in self._all_logprobs_tensors()) or (
            self._verify_argmax is not None and self._verify_argmax.is_cuda)
        if on_cuda:
            if self._verify_argmax is not None:
                self._verify_argmax = to_host_async(self._verify_argmax)
            if sampled is not None:
                self._host = to_host_async(sampled)
            for tensors in self._all_logprobs_tensors():
                tensors.to_host()
            self._event = torch.cuda.Event()
            self._event.record()

    def _all_logprobs_tensors(self) -> list[LogprobsTensors]:
        found = [t for _, t in self._prompt_logprobs.values()]
        if self._logprobs is not None:
            found.append(self._logprobs.tensors)
        return found

    def get(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        if self._event is not None:
            self._event.synchronize()
        if self._verify_argmax is not None:
            argmax = self._verify_argmax.tolist()
            self._token_lists = [accept_greedy(drafts, argmax[first:first + len(drafts) + 1])
                                 for first, drafts in self._verify_rows]
            self._verify_argmax = None
        output = ModelRunnerOutput()
        if self._host is not None:
            output.req_ids = self._request_ids
            output.sampled_token_ids = [[t] for t in self._host.tolist()]
        elif self._token_lists is not None:
            output.req_ids = self._request_ids
            output.sampled_token_ids = self._token_lists
        if self._logprobs_lists is not None:
            output.logprobs_req_ids, output.logprobs = self._logprobs_lists
        if self._logprobs is not None:
            output.logprobs_req_ids = [self._request_ids[i] for i in self._logprobs.rows]
            output.logprobs = self._logprobs.tensors.lists()
        output.prompt_logprobs = {rid: PromptLogprobsLists(start, tensors.lists())
                                  for rid, (start, tensors) in self._prompt_logprobs.items()}
        output.draft_token_ids = self._draft_token_ids
        output.failed_req_ids = self.failed_req_ids
        output.expert_load = self.expert_load
        output.kv_disk_read_results = self.kv_disk_read_results
        output.kv_transfer_sent = self.kv_transfer_sent
        output.kv_transfer_received = self.kv_transfer_received
        if self._pooled is not None:
            output.pooler_output = self._pooled.collect()
            self._pooled = None
        self._host = self._event = self._logprobs = self._token_lists = None
        self._logprobs_lists = None
        self._prompt_logprobs = {}
        self._output = output
        return output
