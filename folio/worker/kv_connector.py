"""The worker's side of a KV connector: it moves the bytes a step message asks for (the
scheduler's side, folio/core/kv_connector.py, decides what moves). Implementations:
`TierConnectorWorker` (here: the host tier's copies, in stream order before the forward
pass, and the disk tier's files on a thread of their own) and `P2PKVTransfer`
(folio/worker/kv_p2p.py: disaggregated prefill's fetches and the producer's server, in
background threads, overlapping the steps).
"""
from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Protocol

import torch

from folio.core.step_messages import SchedulerOutput
from folio.worker.disk_kv_store import DiskKVStore
from folio.worker.host_kv_pool import HostKVPool

logger = logging.getLogger(__name__)


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
    """The host tier's pool and the disk tier's files (vLLM's OffloadingConnector).

    The disk tier's file work runs on one thread, in the order the steps ask for it (a read
    after a spill of the same block finds its file; a delete after its write removes it),
    so neither the forward pass nor the host's next step waits for the disk. A spill copies
    its host slot's bytes before it returns (the slot may be reused next step); a read
    writes a slot the scheduler keeps for it until the read is reported, in the output of
    the first step that finds it done (`has_pending_work` keeps steps coming meanwhile)."""

    def __init__(self, host: HostKVPool, disk: DiskKVStore | None) -> None:
        self.host = host
        self.disk = disk
        self._files = None if disk is None else ThreadPoolExecutor(
            1, thread_name_prefix="folio-kv-disk")
        self._reads: list[Future] = []

    def start_load_kv(self, step: SchedulerOutput,
                      kv_caches: list[torch.Tensor]) -> torch.cuda.Event | None:
        """The step's tier work, in the order the scheduler relies on: spills, disk reads,
        saves, loads (on a GPU, saves and loads pipelined and still in flight on return),
        then deletes. (Disk reads write other host slots than the step's saves: a slot
        serves one block a step; so they may come first, and the saves and loads run as one
        pipeline.)"""
        disk = self.disk
        if step.kv_spills or step.kv_disk_reads:
            self.host.sync()     # the CPU reads and writes host slots saved asynchronously
        for slot, block_hash in step.kv_spills:
            self._files.submit(disk.write, block_hash, disk.payload_of(slot))
        for block_hash, slot in step.kv_disk_reads:
            self._reads.append(self._files.submit(_read, disk, block_hash, slot))
        loads = self.host.transfer(kv_caches, step.kv_saves, step.kv_loads)
        for block_hash in step.kv_disk_deletes:
            self._files.submit(disk.delete, block_hash)
        return loads

    def get_finished(self, step: SchedulerOutput, pending) -> None:
        """The disk reads done by now. A step with nothing to run is the engine polling for
        them: wait a little for one rather than have the engine spin."""
        if not self._reads:
            return
        if not step.total_num_scheduled_tokens:
            wait(self._reads, timeout=_POLL_WAIT_S, return_when=FIRST_COMPLETED)
        done, running = [], []
        for future in self._reads:
            (done if future.done() else running).append(future)
        self._reads = running
        pending.kv_disk_read_results = [future.result() for future in done]


# How long a step that runs nothing waits for a disk read to finish.
_POLL_WAIT_S = 0.005


def _read(disk: DiskKVStore, block_hash: bytes, slot: int) -> tuple[bytes, bool]:
    """One block's file into its host slot on the files' thread: (hash, whether it was
    good). Anything unexpected is a failed read (the scheduler computes the block)."""
    try:
        return block_hash, disk.read(block_hash, slot)
    except Exception as exc:      # noqa: BLE001 - a failed read means recompute
        logger.warning("disk KV tier: reading block %s failed (%s): computed instead",
                       block_hash.hex()[:16], exc)
        return block_hash, False
