"""Turns a SchedulerOutput into one forward pass over the flat batch, then samples."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from folio.core.outputs import ModelRunnerOutput, PromptLogprobsChunk
from folio.core.scheduler import ScheduledRequest, SchedulerOutput
from folio.model.attention import AttentionMetadata
from folio.model.decoder import DecoderLM
from folio.model.host_copy import device_tensor, to_host_async
from folio.worker.sampler import (LogprobsTensors, RowLogprobs, Sampler, SamplingState,
                                  token_logprobs_tensors)

if TYPE_CHECKING:
    from folio.core.request import Request
    from folio.worker.cuda_graphs import DecodeGraphRunner
    from folio.worker.mixed_graphs import MixedGraphRunner

# Given the sampling rows' requests in order: (int32 bitmask [rows, ceil(V/32)], the rows it
# constrains), or None when none is constrained. Filled on the CPU during the forward pass.
GrammarBitmaskFn = Callable[[list["Request"]], "tuple[torch.Tensor, list[int]] | None"]


class ModelRunner:
    def __init__(self, model: DecoderLM, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, graph_runner: DecodeGraphRunner | None = None) -> None:
        self.model = model
        # Replays captured CUDA graphs for pure-decode steps; None = always eager.
        self.graph_runner = graph_runner
        # Replays captured CUDA graphs for the other steps that fit its buffers; None = eager.
        self.mixed_graph_runner: MixedGraphRunner | None = None
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        # Per-request sampling generators, kept across steps (and preemptions) so a seeded
        # request draws the same stream whatever else runs beside it.
        self.generators: dict[str, torch.Generator] = {}
        # One SamplingState per running request, built once: it holds the request's live
        # token lists, so rebuilding it for every request every step was pure overhead.
        self.sampling_states: dict[str, SamplingState] = {}
        # The last launched step's sampled ids (on the device) and each sampling request's row
        # in them: the next step, scheduled before those ids reach the host, reads its
        # pending inputs from here.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}

    def _generator_for(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[request_id] = gen
        return gen

    def _build_inputs(self, scheduled: list[ScheduledRequest]):
        token_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        num_computed: list[int] = []
        pending_dst: list[int] = []
        pending_src: list[int] = []
        # Block tables from one flat list and one scatter: a tensor per request was most of a
        # mixed step's host time at 256 requests.
        block_counts = [len(s.block_ids) for s in scheduled]
        flat_blocks: list[int] = []
        for item in scheduled:
            flat_blocks.extend(item.block_ids)
        counts_np = np.array(block_counts, dtype=np.int64)
        row_of = np.repeat(np.arange(len(scheduled)), counts_np)
        col_of = np.arange(len(flat_blocks)) - np.repeat(np.cumsum(counts_np) - counts_np, counts_np)
        tables_np = np.zeros((len(scheduled), max(block_counts)), dtype=np.int64)
        tables_np[row_of, col_of] = flat_blocks
        tables = torch.from_numpy(tables_np)
        for item in scheduled:
            start, n = item.num_computed_tokens, item.num_new_tokens
            token_ids.extend(item.token_ids)
            if len(token_ids) < query_start_loc[-1] + n:
                # The last input is the token the step in flight is sampling.
                pending_dst.append(len(token_ids))
                pending_src.append(self._prev_rows[item.request_id])
                token_ids.append(0)
            positions.extend(range(start, start + n))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            num_computed.append(start)
        pos = torch.tensor(positions, dtype=torch.int64)
        pin = self.device.type == "cuda"
        counts = torch.tensor([s.num_new_tokens for s in scheduled])
        req_index = torch.repeat_interleave(torch.arange(len(scheduled)), counts)
        slots = tables[req_index, pos // self.block_size] * self.block_size + pos % self.block_size
        ids = torch.tensor(token_ids, dtype=torch.int64)
        if pin:
            # Pinned host buffers let the copies run asynchronously with the GPU's work.
            slots, tables, ids, pos = (t.pin_memory() for t in (slots, tables, ids, pos))
        to_device = lambda t: t.to(self.device, non_blocking=pin)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=to_device(slots), query_start_loc=query_start_loc,
            seq_lens=seq_lens, num_computed_tokens=num_computed,
            block_tables=to_device(tables), block_size=self.block_size)
        ids = to_device(ids)
        if pending_dst:
            self._fill_pending_inputs(ids, pending_dst, pending_src)
        return ids, to_device(pos), meta

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
            self.model.compute_logits(hidden[-1:])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

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
            self.sampler.sample(logits, [SamplingState(p, [0], [], None) for p in params])
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
        hidden = self.model(ids, positions, self.kv_caches, meta)
        rows = hidden[-1:].expand(num_seqs, -1)
        logits = self.model.compute_logits(rows)
        params = SamplingParams(temperature=1.0, top_p=0.9)
        self.sampler(logits, [SamplingState(params, [0], [], None) for _ in range(num_seqs)])

    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar_bitmask: GrammarBitmaskFn | None = None) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output, grammar_bitmask).get()

    @torch.inference_mode()
    def execute_model_async(self, scheduler_output: SchedulerOutput,
                            grammar_bitmask: GrammarBitmaskFn | None = None) -> PendingRunnerOutput:
        """Queue the step's forward pass and sampling; the sampled ids come to the host when
        the returned handle's get() is called, so the caller can schedule the next step
        meanwhile."""
        for rid in scheduler_output.finished_req_ids:
            self.generators.pop(rid, None)
            self.sampling_states.pop(rid, None)
        scheduled = scheduler_output.scheduled
        output = ModelRunnerOutput()
        if not scheduled:
            return PendingRunnerOutput(output)
        graphs = self.graph_runner
        if graphs is not None and graphs.can_run(scheduled):
            # Pure decode: one row per request, so request i's tokens are row i.
            dst = [i for i, item in enumerate(scheduled) if item.has_pending_input]
            fill = None
            if dst:
                src = [self._prev_rows[scheduled[i].request_id] for i in dst]
                fill = lambda ids: self._fill_pending_inputs(ids, dst, src)  # noqa: E731
            hidden = graphs.run(scheduled, fill)
            query_start_loc = list(range(len(scheduled) + 1))
        elif self.mixed_graph_runner is not None and self.mixed_graph_runner.can_run(scheduled):
            def fill_mixed(ids: torch.Tensor, dst: list[int], req: list[int]) -> None:
                src = [self._prev_rows[scheduled[i].request_id] for i in req]
                self._fill_pending_inputs(ids, dst, src)
            hidden, query_start_loc = self.mixed_graph_runner.run(scheduled, fill_mixed)
        else:
            input_ids, positions, meta = self._build_inputs(scheduled)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            query_start_loc = meta.query_start_loc

        # Prompt logprobs: row p scores prompt token p+1, for the prompt rows in this chunk.
        # Keyed by the prompt position of the first token scored: after a preemption the
        # prompt is recomputed and the front end must place, not append, these.
        prompt_logprobs: dict[str, tuple[int, LogprobsTensors]] = {}
        for i, item in enumerate(scheduled):
            request = item.request
            if not request.needs_prompt_logprobs:
                continue
            start = item.num_computed_tokens
            end = min(start + item.num_new_tokens, request.num_prompt_tokens - 1)
            if end <= start:
                continue
            rows = hidden[query_start_loc[i]:query_start_loc[i] + (end - start)]
            targets = device_tensor(request.prompt_token_ids[start + 1:end + 1], self.device,
                                    torch.int64)
            logits = self.model.compute_logits(rows)
            prompt_logprobs[request.request_id] = (start + 1, token_logprobs_tensors(
                logits, targets, request.sampling_params.prompt_logprobs))

        sampling = [(i, item) for i, item in enumerate(scheduled) if item.samples]
        if not sampling:
            self._prev_sampled, self._prev_rows = None, {}
            return PendingRunnerOutput(output, prompt_logprobs=prompt_logprobs)
        # The forward pass is queued on the GPU; the grammar masks are filled on the CPU now,
        # while it runs.
        mask = grammar_bitmask([item.request for _, item in sampling]) if grammar_bitmask else None
        if len(sampling) == len(scheduled) == hidden.shape[0]:
            # Every request decodes one token and samples: its row is its hidden state, so no
            # index tensor (a host-to-device copy) and no gather.
            logits = self.model.compute_logits(hidden)
        else:
            last_rows = device_tensor([query_start_loc[i + 1] - 1 for i, _ in sampling],
                                      self.device, torch.int64)
            logits = self.model.compute_logits(hidden[last_rows])
        if mask is not None:
            from folio.structured_output.masking import apply_token_bitmask
            bitmask, rows = mask
            apply_token_bitmask(logits, bitmask, rows)
        states = []
        cached_states = self.sampling_states
        for _, item in sampling:
            state = cached_states.get(item.request.request_id)
            if state is None:
                request = item.request
                params = request.sampling_params
                state = cached_states[request.request_id] = SamplingState(
                    params=params, prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    generator=self._generator_for(request.request_id, params.seed),
                    eos_token_ids=request.eos_token_ids)
            # Under async scheduling the latest token may still be on the device: penalties
            # and min_tokens find it in the previous step's sampled ids.
            state.pending_row = (self._prev_rows.get(item.request_id)
                                 if item.has_pending_input else None)
            states.append(state)
        sampled, logprobs = self.sampler.sample(logits, states, self._prev_sampled)
        request_ids = [item.request_id for _, item in sampling]
        self._prev_sampled = sampled
        self._prev_rows = {rid: j for j, rid in enumerate(request_ids)}
        return PendingRunnerOutput(output, request_ids, sampled, logprobs, prompt_logprobs)


class PendingRunnerOutput:
    """A step's output whose tensors may still be on their way from the device: sampled ids
    and any logprobs are copied behind the step's kernels into pinned memory, and get() waits
    only for those copies (one event), then builds the host-side output."""

    def __init__(self, output: ModelRunnerOutput, request_ids: list[str] | None = None,
                 sampled: torch.Tensor | None = None,
                 logprobs: RowLogprobs | None = None,
                 prompt_logprobs: dict[str, tuple[int, LogprobsTensors]] | None = None) -> None:
        self._output = output
        self._request_ids = request_ids or []
        self._logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs or {}
        self._event: torch.cuda.Event | None = None
        self._host = sampled
        self._done = False
        on_cuda = sampled.is_cuda if sampled is not None else any(
            t.tensors[0].is_cuda for _, t in self._prompt_logprobs.values())
        if on_cuda:
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
        if self._done:
            return self._output
        if self._event is not None:
            self._event.synchronize()
        output = self._output
        if self._host is not None:
            output.sampled_token_ids = dict(zip(self._request_ids, self._host.tolist()))
        if self._logprobs is not None:
            rids = [self._request_ids[i] for i in self._logprobs.rows]
            output.logprobs = dict(zip(rids, self._logprobs.tensors.entries()))
        for rid, (start, tensors) in self._prompt_logprobs.items():
            output.prompt_logprobs[rid] = PromptLogprobsChunk(start, tensors.entries())
        self._host = self._event = self._logprobs = None
        self._prompt_logprobs = {}
        self._done = True
        return output
