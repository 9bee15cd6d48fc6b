"""Speculative decoding with an EAGLE / EAGLE-3 head (folio/model/eagle.py) on the worker: chain
drafting (one draft per step, no tree), greedy.

After each step:
1. Every row of the step goes through the head as the pair (the token after the row, the
   target's hidden state at the row) at the row's position, writing the head's KV cache
   there. The token after row r is the next row's input, except after each request's
   `last_rows` entry, where it is the newest token (sampled, kept by verification, or the
   next prompt token); rows past it (rejected drafts) are rewritten by later steps.
2. A drafting request's output at that row gives its first draft; k - 1 one-token steps
   then feed (draft, the head's own output state) at the positions after it.

The target's hidden state is its final normed one (EAGLE) or its residual streams entering
three layers (EAGLE-3, `DecoderLM.aux_hidden_layers`).

After a step where no request drafts (the adaptive draft length resting at k = 0) step 1 does
not run: its rows up to each request's `last_rows` entry (token after, position, the target's
state) are kept back (spec_propose.DeferredWrites) and go through the head as one batched
chunk per request before the next step that drafts (or when MAX_DEFERRED_ROWS are kept, or a
request leaves the batch), which writes the same cache entries. On the CPU the per-step pass
had cost 10-20 % of a plain SmolLM2 step, and the policy rests almost always where drafts
are poor. EAGLE-3's three streams are kept as they are and fused (`combine`) at the flush:
keeping them costs 3x the memory of the fused state, but fusing them is a matmul the
resting steps then skip.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np
import torch

from folio.model.attention import AttentionMetadata
from folio.model.decoder import DecoderLM
from folio.model.eagle import EagleHead
from folio.model.host_copy import device_tensor
from folio.model.kernels.sampling import argmax_rows
from folio.worker.input_batch import InputBatch
from folio.worker.spec_propose import (DeferredWrites, DraftInputs, drafting_requests,
                                       gather_drafts, one_token_meta)


class EagleProposer:
    def __init__(self, head: EagleHead, target: DecoderLM, kv_caches: list[torch.Tensor], *,
                 block_size: int, num_speculative_tokens: int, max_model_len: int,
                 device: torch.device) -> None:
        self.head = head
        self.target = target
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.device = device
        self.deferred = DeferredWrites(self._write, block_size, device)

    def _target_features(self, inputs: DraftInputs) -> torch.Tensor:
        """The target's state at each row before `combine` (EAGLE-3: its streams side by
        side)."""
        rows = inputs.input_ids.shape[0]
        if self.head.method == "eagle3":
            return torch.cat([s[:rows] for s in self.target.aux_hidden_states], dim=-1)
        return inputs.hidden[:rows]

    def _tokens_after(self, inputs: DraftInputs) -> torch.Tensor:
        """The token after each row: the next row's input, or after a request's last row its
        newest token."""
        newest = inputs.next_tokens.to(inputs.input_ids.dtype)
        if len(inputs.req_ids) == inputs.input_ids.shape[0]:   # one row each: the newest
            return newest
        shifted = torch.roll(inputs.input_ids, -1)
        shifted[device_tensor(inputs.last_rows, self.device, torch.int64)] = newest
        return shifted

    def _head_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """The H-wide state the head takes at each row: EAGLE-3 fuses its streams."""
        return self.head.combine(features) if self.head.method == "eagle3" else features

    def _write(self, tokens: torch.Tensor, positions: torch.Tensor,
               features: torch.Tensor | None, meta: AttentionMetadata) -> None:
        self.head(tokens, positions, self._head_hidden(features), self.kv_caches, meta)

    def release(self, req_ids: Iterable[str], batch: InputBatch) -> None:
        self.deferred.release(req_ids, batch)

    def propose(self, inputs: DraftInputs, batch: InputBatch) -> dict[str, list[int]]:
        # 1. every row as (the token after it, the target's state at it)
        shifted = self._tokens_after(inputs)
        if not any(inputs.drafting):
            self.deferred.add(inputs, shifted, self._target_features(inputs), batch)
            return {}
        self.deferred.flush(batch)   # the kept rows first: this step's rows attend to them
        out_logits, out_next = self.head(shifted, inputs.positions,
                                         self._head_hidden(self._target_features(inputs)),
                                         self.kv_caches,
                                         dataclasses.replace(inputs.meta, cache={}))
        d = drafting_requests(inputs, batch, self.k, self.max_model_len)
        if not d.req_ids or self.k <= 0:
            return {}
        # 2. the first draft from each request's newest row, then k - 1 chained steps
        req_ids, rows, newest, steps = d.req_ids, d.rows, d.newest, d.steps
        at = device_tensor([inputs.last_rows[i] for i in d.which], self.device, torch.int64)
        tokens = argmax_rows(self.head.compute_logits(out_logits[at]))
        hidden = out_next[at]
        active = np.flatnonzero(steps > 0)
        if len(active) < len(req_ids):
            index = device_tensor(active.tolist(), self.device, torch.int64)
            tokens, hidden = tokens[index], hidden[index]
        drafted: list[tuple[np.ndarray, torch.Tensor]] = [(active, tokens)] if len(active) \
            else []
        for j in range(1, int(steps.max(initial=0))):
            keep = steps[active] > j
            if not keep.all():
                index = device_tensor(np.flatnonzero(keep).tolist(), self.device, torch.int64)
                tokens, hidden = tokens[index], hidden[index]
                active = active[keep]
            # draft j at position newest + j - 1 + 1: its pair sits at newest + j - 1
            pos = newest[active] + j - 1
            meta = one_token_meta(batch, rows[active], pos, self.block_size, self.device)
            out_logits, hidden = self.head(tokens, device_tensor(pos.tolist(), self.device,
                                                                 torch.int64),
                                           hidden, self.kv_caches, meta)
            tokens = argmax_rows(self.head.compute_logits(out_logits))
            drafted.append((active, tokens))
        return gather_drafts(drafted, req_ids, self.device)
