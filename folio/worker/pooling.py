"""A pooling step's results: the hidden states of each pooling request whose prompt ends in the
step go through the model's pooler (folio/model/pooler.py), and the results leave as
PooledData (float32 bytes). A causal model's prompt may run in several chunks: the rows of the
earlier chunks are kept here until the last one (only the last row, with a LAST pooler — the
only case where prefix-cache hits may skip rows)."""
from __future__ import annotations

import torch

from folio.core.step_messages import PooledData, SchedulerOutput
from folio.pooling_params import PoolingTask, PoolingType
from folio.worker.input_batch import InputBatch


class PoolingRunner:
    def __init__(self, pooler: torch.nn.Module, pooling_type: PoolingType) -> None:
        self.pooler = pooler
        self.pooling_type = pooling_type
        # Hidden rows of earlier chunks, per request still in its prompt.
        self._partial: dict[str, list[torch.Tensor]] = {}

    def drop(self, req_ids) -> None:
        """Forget requests finished, aborted or preempted (a preempted one runs its prompt
        again from its first uncached token)."""
        for rid in req_ids:
            self._partial.pop(rid, None)

    def _keep(self, rid: str, rows: torch.Tensor, task: PoolingTask) -> None:
        if self.pooling_type == PoolingType.LAST and not task.per_token:
            rows = rows[-1:]
            self._partial[rid] = [rows.clone()]
        else:
            self._partial.setdefault(rid, []).append(rows.clone())

    def run(self, step: SchedulerOutput, batch: InputBatch, hidden: torch.Tensor,
            query_start_loc: list[int]) -> "PendingPooled":
        """Keep the rows of unfinished prompts; pool the finished ones (batch order)."""
        self.drop(step.finished_req_ids)
        self.drop(step.preempted_req_ids)
        finishing = set(step.pooling_req_ids)
        parts: list[torch.Tensor] = []
        starts = [0]
        ids, tasks, params = [], [], []
        for i, rid in enumerate(step.num_scheduled_tokens):
            state = batch.requests[rid]
            pooling = state.pooling_params
            task = PoolingTask(pooling.task)
            rows = hidden[query_start_loc[i]:query_start_loc[i + 1]]
            if rid not in finishing:
                self._keep(rid, rows, task)
                continue
            earlier = self._partial.pop(rid, [])
            if earlier:
                rows = torch.cat(earlier + [rows])
            parts.append(rows)
            starts.append(starts[-1] + rows.shape[0])
            ids.append(rid)
            tasks.append(task)
            params.append(pooling)
        if not ids:
            return PendingPooled([], [])
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        results = self.pooler(flat, starts, tasks, params)
        return PendingPooled(ids, [r.float() for r in results])


class PendingPooled:
    """Pooled results on the device; `collect` brings them to the host as PooledData."""

    def __init__(self, req_ids: list[str], tensors: list[torch.Tensor]) -> None:
        self.req_ids = req_ids
        self.tensors = tensors

    def collect(self) -> dict[str, PooledData]:
        """One device-to-host copy for the whole step: one per request (1,000 small copies,
        each waiting for the device) took a fifth of an embeddings pass on an H100."""
        if not self.tensors:
            return {}
        flat = torch.cat([t.detach().reshape(-1) for t in self.tensors])
        host = flat.to("cpu").numpy().astype("<f4", copy=False)
        out, start = {}, 0
        for rid, tensor in zip(self.req_ids, self.tensors):
            end = start + tensor.numel()
            out[rid] = PooledData(list(tensor.shape), host[start:end].tobytes())
            start = end
        return out
