"""The disk tier's files on the worker (TierConnectorWorker): reads and writes run on a thread
of their own, in the order the steps asked for them, and a read reports in the output of the
first step that finds it done — never holding the step that asked for it."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from folio.worker.disk_kv_store import DiskKVStore
from folio.worker.host_kv_pool import HostKVPool
from folio.worker.kv_connector import TierConnectorWorker

H1, H2 = bytes(range(32)), bytes(range(1, 33))


def _worker(tmp_path):
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 8, 4, 2, 8, generator=gen) for _ in range(2)]
    pool = HostKVPool(caches, num_slots=6)
    pool.save(caches, [(0, 0), (1, 1)])
    disk = DiskKVStore(str(tmp_path), "ns", pool)
    return caches, pool, disk, TierConnectorWorker(pool, disk)


def _step(tokens: int = 0, spills=(), reads=(), deletes=()) -> SimpleNamespace:
    return SimpleNamespace(total_num_scheduled_tokens=tokens, kv_spills=list(spills),
                           kv_disk_reads=list(reads), kv_saves=[], kv_loads=[],
                           kv_disk_deletes=list(deletes))


def _finished(worker: TierConnectorWorker, tokens: int) -> list:
    pending = SimpleNamespace(kv_disk_read_results=[])
    worker.get_finished(_step(tokens), pending)
    return pending.kv_disk_read_results


def test_a_read_holds_no_step_and_reports_once_done(tmp_path, monkeypatch):
    caches, pool, disk, worker = _worker(tmp_path)
    disk.write(H1, disk.payload_of(0))
    release = threading.Event()
    read = disk.read
    monkeypatch.setattr(disk, "read", lambda h, s: release.wait(30) and read(h, s))
    worker.start_load_kv(_step(tokens=5, reads=[(H1, 4)]), caches)   # returns: not waiting
    assert _finished(worker, tokens=5) == []                         # still reading
    release.set()
    results = []
    for _ in range(400):                     # polls (steps that run nothing) wait 5 ms each
        results += _finished(worker, tokens=0)
        if results:
            break
    assert results == [(H1, True)]
    assert all(torch.equal(host[4], host[0]) for host in pool.host)
    assert _finished(worker, tokens=0) == []                         # reported once


def test_file_work_runs_in_step_order_and_a_spill_keeps_its_slots_bytes(tmp_path):
    caches, pool, disk, worker = _worker(tmp_path)
    before = [host[1].clone() for host in pool.host]
    # a spill, then in the next step a read of the same block and a spill deleted again
    worker.start_load_kv(_step(spills=[(1, H1), (0, H2)]), caches)
    for host in pool.host:
        host[1].zero_()                      # the slot reused right after the spill returned
    worker.start_load_kv(_step(reads=[(H1, 5)], deletes=[H2]), caches)
    results = []
    for _ in range(400):
        results += _finished(worker, tokens=0)
        if results:
            break
    assert results == [(H1, True)]
    assert all(torch.equal(host[5], old) for host, old in zip(pool.host, before))
    worker._files.submit(lambda: None).result()          # the delete after it has run too
    assert disk.existing() == [H1]
