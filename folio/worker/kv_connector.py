"""The worker's side of a KV connector: it moves the bytes a step message asks for (the
scheduler's side, folio/core/kv_connector.py, decides what moves). Implementations:
`TierConnectorWorker` (here: the host and disk tiers' copies, in stream order before the
forward pass) and `P2PKVTransfer` (folio/worker/kv_p2p.py: disaggregated prefill's fetches
and the producer's server, in background threads, overlapping the steps).
"""
from __future__ import annotations

from typing import Protocol

import torch

from folio.core.step_messages import SchedulerOutput
from folio.worker.disk_kv_store import DiskKVStore
from folio.worker.host_kv_pool import HostKVPool


class KVConnectorWorker(Protocol):
    def start_load_kv(self, step: SchedulerOutput,
                      kv_caches: list[torch.Tensor]) -> torch.cuda.Event | None:
        """Before the step's forward pass: run, or start, its copies into and out of the KV
        cache. None: the loads are in place before the forward reads them (stream order);
        else an event the forward pass waits for (recorded once every load is in place)."""

    def get_finished(self, step: SchedulerOutput, pending) -> None:
        """Once the forward pass is queued: put what finished into the step's output
        (`pending`, a PendingRunnerOutput)."""


class TierConnectorWorker:
    """The host tier's pool and the disk tier's files (vLLM's OffloadingConnector)."""

    def __init__(self, host: HostKVPool, disk: DiskKVStore | None) -> None:
        self.host = host
        self.disk = disk
        self._read_results: list[tuple[bytes, bool]] = []

    def start_load_kv(self, step: SchedulerOutput,
                      kv_caches: list[torch.Tensor]) -> torch.cuda.Event | None:
        """The step's tier work, in the order the scheduler relies on: spills, disk reads,
        saves, loads (on a GPU, saves and loads pipelined and still in flight on return),
        then deletes; each read's result kept for the output. (Disk reads write other host
        slots than the step's saves: a slot serves one block a step; so they may come
        first, and the saves and loads run as one pipeline.)"""
        disk = self.disk
        if step.kv_spills or step.kv_disk_reads:
            self.host.sync()     # the CPU reads and writes host slots saved asynchronously
        for slot, block_hash in step.kv_spills:
            disk.spill(slot, block_hash)
        self._read_results = [(block_hash, disk.read(block_hash, slot))
                              for block_hash, slot in step.kv_disk_reads]
        loads = self.host.transfer(kv_caches, step.kv_saves, step.kv_loads)
        for block_hash in step.kv_disk_deletes:
            disk.delete(block_hash)
        return loads

    def get_finished(self, step: SchedulerOutput, pending) -> None:
        pending.kv_disk_read_results, self._read_results = self._read_results, []
