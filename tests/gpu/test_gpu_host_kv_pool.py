"""The host KV pool's copies on a CUDA GPU (folio/worker/host_kv_pool.py): a step's saves and
loads pipelined on two side streams (`transfer`) leave the host slots and device blocks as
the saves then the loads in order would, the loads landing in the very blocks the saves
read; work queued after the returned event sees every layer's blocks. Skipped without a GPU;
run through the device tool (tools/device_issue23.sh)."""
from __future__ import annotations

import pytest
import torch

from folio.worker.host_kv_pool import HostKVPool

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_pipelined_saves_and_loads_equal_the_two_in_order():
    gen = torch.Generator(device="cuda").manual_seed(0)
    # 8 layers of [planes, blocks, block size, heads, width]: large enough that the copies
    # of one layer are still running when the next layer's are queued
    caches = [torch.randn(2, 64, 16, 8, 128, generator=gen, device="cuda",
                          dtype=torch.bfloat16) for _ in range(8)]
    pool = HostKVPool(caches, num_slots=96)
    prefix_blocks = list(range(0, 40))
    pool.save(caches, [(b, 50 + b) for b in prefix_blocks])     # slots 50..89, a prefix
    pool.sync()
    prefix = [c[:, prefix_blocks].clone() for c in caches]
    for c in caches:     # those blocks reused since by other requests
        c[:, prefix_blocks] = torch.randn(c[:, prefix_blocks].shape, generator=gen,
                                          device="cuda", dtype=c.dtype)
    # this step: blocks 10..49 evicted (saved to slots 0..39, scattered order) and loaded
    # with the prefix
    targets = list(range(10, 50))
    old = [c[:, targets].clone() for c in caches]
    slots = list(range(40))
    slots = slots[::2] + slots[1::2]
    done = pool.transfer(caches, saves=list(zip(targets, slots)),
                         loads=[(50 + b, t) for b, t in zip(prefix_blocks, targets)])
    assert isinstance(done, torch.cuda.Event)
    torch.cuda.current_stream().wait_event(done)    # as the worker does before the forward
    pool.sync()
    for layer, cache in enumerate(caches):
        assert torch.equal(cache[:, targets], prefix[layer])
        saved = pool.host[layer][slots].transpose(0, 1).cuda()
        assert torch.equal(saved, old[layer])


def test_a_load_reads_what_an_earlier_steps_save_wrote():
    """A step's save into slots and the next step's load of those slots, with no sync between
    (a prefix evicted, then hit again at once): the load's copy waits for the save's."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    caches = [torch.randn(2, 96, 16, 8, 128, generator=gen, device="cuda",
                          dtype=torch.bfloat16) for _ in range(8)]
    pool = HostKVPool(caches, num_slots=48)
    want = [c[:, :48].clone() for c in caches]
    pool.save(caches, [(b, b) for b in range(48)])
    done = pool.load(caches, [(s, 48 + s) for s in range(48)])
    torch.cuda.current_stream().wait_event(done)
    for layer, cache in enumerate(caches):
        assert torch.equal(cache[:, 48:96], want[layer])
