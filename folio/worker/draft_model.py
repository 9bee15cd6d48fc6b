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
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from folio.model.attention import AttentionMetadata
from folio.model.decoder import DecoderLM
from folio.model.host_copy import device_tensor
from folio.worker.input_batch import InputBatch


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

    def observe_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata) -> None:
        """Step 1: the step's tokens into the draft model's cache (its own copy of the
        metadata: backends keep per-model tensors in `cache`)."""
        self.model(input_ids, positions, self.kv_caches, dataclasses.replace(meta, cache={}))

    def propose(self, batch: InputBatch, req_ids: list[str], last_tokens: torch.Tensor,
                last_positions: list[int]) -> dict[str, list[int]]:
        """Step 2: up to k greedy drafts per request, from its newest token `last_tokens[i]`
        (a device tensor) at position `last_positions[i]`; a request near max_model_len gets
        fewer (its drafts must have positions below it)."""
        if not req_ids or self.k <= 0:
            return {}
        bs = self.block_size
        rows = np.asarray([batch.requests[rid].row for rid in req_ids], dtype=np.int64)
        start = np.asarray(last_positions, dtype=np.int64)
        # request i drafts while position + 1 < max_model_len
        steps = np.minimum(self.k, self.max_model_len - 1 - start).clip(min=0)
        tokens = last_tokens.to(self.device, torch.int64)
        drafted: list[torch.Tensor] = []
        active = np.arange(len(req_ids))
        for j in range(int(steps.max(initial=0))):
            keep = steps[active] > j
            if not keep.all():
                tokens = tokens[device_tensor(np.flatnonzero(keep).tolist(), self.device,
                                              torch.int64)]
                active = active[keep]
            pos = start[active] + j
            table = batch.block_table[rows[active]]
            blocks = pos // bs
            if (blocks >= batch.num_blocks[rows[active]]).any():
                raise RuntimeError("a draft position has no KV slot: the scheduler's "
                                   "lookahead did not cover the draft model's steps")
            slots = table[np.arange(len(active)), blocks].astype(np.int64) * bs + pos % bs
            width = int(blocks.max()) + 1
            meta = AttentionMetadata(
                slot_mapping=device_tensor(slots.tolist(), self.device, torch.int64),
                query_start_loc=list(range(len(active) + 1)),
                seq_lens=(pos + 1).tolist(), num_computed_tokens=pos.tolist(),
                block_tables=device_tensor(table[:, :width].astype(np.int64), self.device,
                                           torch.int64),
                block_size=bs)
            hidden = self.model(tokens, device_tensor(pos.tolist(), self.device, torch.int64),
                                self.kv_caches, meta)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1)
            full = torch.full((len(req_ids),), -1, dtype=torch.int64, device=self.device)
            full[device_tensor(active.tolist(), self.device, torch.int64)] = tokens
            drafted.append(full)
        if not drafted:
            return {rid: [] for rid in req_ids}
        table = torch.stack(drafted, dim=1).tolist()   # one copy to the host
        return {rid: [t for t in row if t >= 0] for rid, row in zip(req_ids, table)}
