"""The worker's own state of the requests it runs: the persistent batch, updated from each step
message's diffs (folio.core.step_messages) and never from a scheduler object.

Each running request holds a row of the block table (a numpy array kept between steps, so a
step writes only the blocks that are new) and a `RequestState`: its tokens as the worker knows
them, its progress, and its sampling state (built once, with the request's own generator).
A preempted request gives its row back and keeps its state (its seeded generator goes on where
it stopped); a finished one is dropped.
"""
from __future__ import annotations

import numpy as np
import torch

from folio.core.step_messages import NewRequestData, SchedulerOutput
from folio.worker.sampler import SamplingState


class RequestState:
    """One request as the worker knows it."""

    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "output_token_ids",
                 "num_computed_tokens", "row", "sampling")

    def __init__(self, new: NewRequestData, generator: torch.Generator | None) -> None:
        self.req_id = new.req_id
        prompt = list(new.prompt_token_ids)
        # Prompt then output tokens, as far as the messages have told (under async scheduling
        # the latest sampled token may be missing: it is read on the device).
        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = new.num_computed_tokens
        self.row = -1
        # The sampler reads the same output list this state appends to.
        self.sampling = SamplingState(
            params=new.sampling_params, prompt_token_ids=prompt,
            output_token_ids=self.output_token_ids, generator=generator,
            eos_token_ids=tuple(new.eos_token_ids))

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.sampling.prompt_token_ids

    def append_tokens(self, token_ids: list[int]) -> None:
        if token_ids:
            self.token_ids.extend(token_ids)
            self.output_token_ids.extend(token_ids)


class InputBatch:
    """Rows of the running requests: `block_table[row, :num_blocks[row]]` are a request's
    blocks. Rows are reused as requests come and go."""

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, device: torch.device) -> None:
        self.device = device
        self.max_num_reqs = max_num_reqs
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.requests: dict[str, RequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def update(self, step: SchedulerOutput) -> None:
        """Apply one step's message: drop the finished, free the preempted rows, add the new
        requests, then the diffs of the others."""
        for rid in step.finished_req_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                self._release(state)
        for rid in step.preempted_req_ids:
            state = self.requests.get(rid)
            if state is not None:
                self._release(state)
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
                self.num_blocks[state.row] = 0
            self._append_blocks(state.row, diff.new_block_ids)
            state.append_tokens(diff.new_token_ids)
            state.num_computed_tokens = diff.num_computed_tokens

    def _assign_row(self, state: RequestState) -> None:
        if not self._free_rows:
            raise RuntimeError(f"more than {self.max_num_reqs} requests scheduled at once")
        state.row = self._free_rows.pop()
        self.num_blocks[state.row] = 0

    def _release(self, state: RequestState) -> None:
        if state.row >= 0:
            self._free_rows.append(state.row)
            state.row = -1

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            n = int(self.num_blocks[row])
            self.block_table[row, n:n + len(block_ids)] = block_ids
            self.num_blocks[row] = n + len(block_ids)
