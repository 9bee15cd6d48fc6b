"""The worker's own state of the requests it runs: the persistent batch, updated from each step
message's diffs (folio.core.step_messages) and never from a scheduler object.

Each running request holds a row of numpy arrays kept between steps (so a step writes only
what is new): its token ids as the worker knows them, its block-table row, and its sampling
parameters as columns (`sampling_columns` gathers a step's rows). A `RequestState` holds what
is not an array: the request's progress, its params and its seeded generator. A preempted
request gives its row back and keeps its tokens in its state (its generator goes on where it
stopped); a finished one is dropped.
"""
from __future__ import annotations

import numpy as np
import torch

from folio.core.step_messages import NewRequestData, SchedulerOutput
from folio.worker.sampler import SamplingState
from folio.worker.sampling_columns import (SCALAR_COLUMNS, SamplingColumns, needs_processors,
                                           row_values)


class RequestState:
    """One request as the worker knows it (its tokens live in its batch row while it has one)."""

    __slots__ = ("req_id", "num_prompt_tokens", "num_computed_tokens", "row", "sampling",
                 "parked_tokens", "pooling_params", "token_type_ids", "lora_request",
                 "mm_inputs", "mrope", "position_offset")

    def __init__(self, new: NewRequestData, generator: torch.Generator | None) -> None:
        self.req_id = new.req_id
        self.num_prompt_tokens = len(new.prompt_token_ids)
        self.num_computed_tokens = new.num_computed_tokens
        self.row = -1
        self.sampling = SamplingState(params=new.sampling_params, generator=generator,
                                      eos_token_ids=tuple(new.eos_token_ids))
        # The tokens while the request has no row (new, or preempted): prompt then outputs.
        self.parked_tokens: np.ndarray | None = np.asarray(new.prompt_token_ids, dtype=np.int32)
        # A pooling request's params, and its prompt's segment ids (None = all 0).
        self.pooling_params = new.pooling_params
        self.token_type_ids = (None if new.token_type_ids is None
                               else np.asarray(new.token_type_ids, dtype=np.int64))
        # Its LoRA adapter (None: the base model).
        self.lora_request = new.lora_request
        # Its images (None: none): their features go in at their placeholder tokens.
        self.mm_inputs = new.mm_inputs
        # M-RoPE models: its prompt's positions in three rows and the offset of the tokens
        # after them (ModelRunner._mrope_positions fills it on first use).
        self.mrope: tuple[np.ndarray, int] | None = None
        # Added to the rotary position of its tokens past the prompt (M-RoPE's delta: the
        # prompt's images take fewer positions than tokens); 0 for every other request.
        self.position_offset = 0


class InputBatch:
    """Rows of the running requests: `token_ids[row, :num_tokens[row]]` are a request's tokens
    (under async scheduling the latest sampled one may be missing: it is read on the device),
    `block_tables[g][row, :group_num_blocks[g][row]]` its blocks in KV cache group g
    (`block_table`, `num_blocks`: group 0's), and `columns[name][row]` its sampling knobs.
    Rows are reused as requests come and go."""

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, device: torch.device,
                 max_model_len: int, num_kv_groups: int = 1) -> None:
        self.device = device
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_tables = np.zeros((num_kv_groups, max_num_reqs, max_blocks_per_req),
                                     dtype=np.int32)
        self.group_num_blocks = np.zeros((num_kv_groups, max_num_reqs), dtype=np.int64)
        self.block_table = self.block_tables[0]
        self.num_blocks = self.group_num_blocks[0]
        # (table, counts) views per group, made once: every step appends blocks through them.
        self._group_views = list(zip(self.block_tables, self.group_num_blocks))
        self.columns = {name: np.zeros(max_num_reqs, dtype=dtype)
                        for name, dtype in SCALAR_COLUMNS.items()}
        self.seeded = np.zeros(max_num_reqs, dtype=bool)
        self.needs_processors = np.zeros(max_num_reqs, dtype=bool)
        self.requests: dict[str, RequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # The last step's sampling columns, reused while the same rows sample and no row has
        # been given to another request (`_layout_version` counts those hand-overs).
        self._layout_version = 0
        self._columns: SamplingColumns | None = None
        self._columns_key: tuple[int, bytes] | None = None

    def update(self, step: SchedulerOutput) -> None:
        """Apply one step's message: drop the finished, free the preempted rows, add the new
        requests, then the diffs of the others."""
        for rid in step.finished_req_ids:
            state = self.requests.pop(rid, None)
            if state is not None and state.row >= 0:
                self._free_rows.append(state.row)
        for rid in step.preempted_req_ids:
            state = self.requests.get(rid)
            if state is not None:
                self._park(state)
        for new in step.scheduled_new_reqs:
            seed = new.sampling_params.seed
            generator = None
            if seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(seed)
            state = self.requests[new.req_id] = RequestState(new, generator)
            self._assign_row(state)
            self._append_blocks(state.row, new.block_ids)
        for diff in step.scheduled_cached_reqs:
            state = self.requests[diff.req_id]
            if state.row < 0:
                self._assign_row(state)
            elif diff.resumed_from_preemption:
                self.group_num_blocks[:, state.row] = 0
            self._append_blocks(state.row, diff.new_block_ids)
            self._append_tokens(state.row, diff.new_token_ids)
            state.num_computed_tokens = diff.num_computed_tokens

    def token_ids_of(self, state: RequestState) -> np.ndarray:
        """The request's tokens as the worker knows them (a view while it has a row)."""
        if state.row < 0:
            return state.parked_tokens
        return self.token_ids[state.row, :self.num_tokens[state.row]]

    def sampling_columns(self, rows: np.ndarray) -> SamplingColumns:
        """The sampling columns of these batch rows, in this order (one step's sampling rows),
        with no pending tokens (the runner sets `pending_row` where a processor needs it).
        The same rows as the step before, with no row reassigned since, share that step's
        columns (steady decode gathers nothing but the token counts)."""
        key = rows.tobytes()
        no_pending = np.full(len(rows), -1, dtype=np.int64)
        cached = self._columns
        if cached is not None and self._columns_key == (self._layout_version, key):
            return cached.for_next_step(self.num_tokens[rows], no_pending)
        columns = self._columns = SamplingColumns(
            **{name: column[rows] for name, column in self.columns.items()},
            seeded=self.seeded[rows], needs_processors=self.needs_processors[rows],
            pending_row=no_pending, token_table=self.token_ids, token_rows=rows,
            num_prompt_tokens=self.num_prompt_tokens[rows], num_tokens=self.num_tokens[rows])
        self._columns_key = (self._layout_version, key)
        return columns

    def _assign_row(self, state: RequestState) -> None:
        if not self._free_rows:
            raise RuntimeError(f"more than {self.max_num_reqs} requests scheduled at once")
        row = state.row = self._free_rows.pop()
        self._layout_version += 1
        self.group_num_blocks[:, row] = 0
        tokens, state.parked_tokens = state.parked_tokens, None
        self.num_tokens[row] = 0
        self._append_tokens(row, tokens)
        self.num_prompt_tokens[row] = state.num_prompt_tokens
        params = state.sampling.params
        for name, value in row_values(params).items():
            self.columns[name][row] = value
        self.seeded[row] = state.sampling.generator is not None
        self.needs_processors[row] = needs_processors(params)

    def _park(self, state: RequestState) -> None:
        if state.row >= 0:
            state.parked_tokens = self.token_ids_of(state).copy()
            self._free_rows.append(state.row)
            state.row = -1

    def _append_tokens(self, row: int, token_ids) -> None:
        k = len(token_ids)
        if k:
            n = int(self.num_tokens[row])
            if n + k > self.max_model_len:
                raise ValueError(f"a request's tokens exceed max_model_len "
                                 f"({self.max_model_len})")
            self.token_ids[row, n:n + k] = token_ids
            self.num_tokens[row] = n + k

    def _append_blocks(self, row: int, group_block_ids: list[list[int]]) -> None:
        """Each KV cache group's new block ids, appended to the row's table of that group."""
        for (table, counts), block_ids in zip(self._group_views, group_block_ids):
            if block_ids:
                n = int(counts[row])
                table[row, n:n + len(block_ids)] = block_ids
                counts[row] = n + len(block_ids)
