"""Speculative decoding's draft model on the worker: a second, smaller model with the target's
vocabulary proposes each sampling request's next k tokens, greedily, at the end of every step.

Its KV cache has the target's layout in blocks and is addressed through the target's block
table and slot mapping, so it needs no bookkeeping of its own:

1. The step's tokens (prompt chunks, decode tokens, a verify step's drafts) run through the
   draft model with the step's own metadata: its cache then holds every position the
   target's does. A rejected draft's entry is overwritten in step 2 or by the next step.
2. From each sampling request's newest token (the sampled one, or a verify step's last kept
   one) at position p, k single-token steps write positions p .. p+k-1 and propose the tokens
   after them. The scheduler allocated slots up to there (`Drafter.lookahead`); the next step
   verifies those drafts and, through step 1, rewrites the same positions.

After a step where no request drafts (the adaptive draft length resting at k = 0) step 1 is
kept back and written in one batched pass later (spec_propose.DeferredWrites, as for an
EAGLE head): the draft model's pass over each step cost a resting engine every step.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np
import torch

from folio.model.attention import AttentionMetadata
from folio.model.decoder import DecoderLM
from folio.model.host_copy import device_tensor
from folio.model.kernels.sampling import argmax_rows
from folio.worker.input_batch import InputBatch
from folio.worker.spec_propose import (DeferredWrites, DraftInputs, drafting_requests,
                                       gather_drafts, one_token_meta)


class DraftModelProposer:
    def __init__(self, model: DecoderLM, kv_caches: list[torch.Tensor], *, block_size: int,
                 num_speculative_tokens: int, max_model_len: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.device = device
        self.deferred = DeferredWrites(self._write, block_size, device)

    def _write(self, tokens: torch.Tensor, positions: torch.Tensor,
               features: torch.Tensor | None, meta: AttentionMetadata) -> None:
        self.model(tokens, positions, self.kv_caches, meta)

    def release(self, req_ids: Iterable[str], batch: InputBatch) -> None:
        self.deferred.release(req_ids, batch)

    def propose(self, inputs: DraftInputs, batch: InputBatch) -> dict[str, list[int]]:
        if not any(inputs.drafting):
            self.deferred.add(inputs, inputs.input_ids, None, batch)
            return {}
        self.deferred.flush(batch)   # the kept rows first: this step's rows attend to them
        # 1. the step's tokens into the draft model's cache (its own copy of the metadata:
        # backends keep per-model tensors in `cache`)
        self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                   dataclasses.replace(inputs.meta, cache={}))
        # 2. k greedy steps from each drafting request's newest token
        d = drafting_requests(inputs, batch, self.k, self.max_model_len)
        if not d.req_ids or self.k <= 0:
            return {}
        req_ids, rows, start, steps = d.req_ids, d.rows, d.newest, d.steps
        tokens = inputs.next_tokens
        if len(d.which) < len(inputs.req_ids):
            tokens = tokens[device_tensor(d.which, self.device, torch.int64)]
        active = np.arange(len(req_ids))
        drafted: list[tuple[np.ndarray, torch.Tensor]] = []
        for j in range(int(steps.max(initial=0))):
            keep = steps[active] > j
            if not keep.all():
                tokens = tokens[device_tensor(np.flatnonzero(keep).tolist(), self.device,
                                              torch.int64)]
                active = active[keep]
            pos = start[active] + j
            meta = one_token_meta(batch, rows[active], pos, self.block_size, self.device)
            hidden = self.model(tokens, device_tensor(pos.tolist(), self.device, torch.int64),
                                self.kv_caches, meta)
            tokens = argmax_rows(self.model.compute_logits(hidden))
            drafted.append((active, tokens))
        return gather_drafts(drafted, req_ids, self.device)
