"""The host-memory KV tier (`--kv-offloading-size GiB`), on the scheduler's side: which
prefix blocks the host pool holds, and the copies each step asks the workers for.

A full, prefix-cached device block that the block pool evicts (its slot handed to another
request) is saved to a host slot, keyed by its block hash (which covers the tokens before it,
the cache_salt and the LoRA adapter, so tenants stay apart here too). A request whose prompt
continues past its device prefix hit into blocks the host pool holds gets new device blocks
for them, filled from the host pool instead of recomputed.

Each step carries its copies (`SchedulerOutput.kv_saves`, `kv_loads`); a worker runs the
saves, then the loads, before the step's forward pass, all in stream order: a save reads a
block before this step may overwrite it (an evicted block is handed out in the same step),
and a load fills a block before the forward reads it. A host slot is used by one block
per step: a slot saved to, loaded from or read into in a step is not evicted until the next.

The host pool is LRU by default; `policy` is pluggable (`HostEvictionPolicy`).

With a disk tier (`--kv-disk-path DIR --kv-disk-size GiB`, `DiskKVIndex`) a block the host
pool evicts is spilled to a file named by its hash (in a directory of the model, dtype and
layout: another model never reads it), and files survive a restart. A prompt's blocks past
its host hits that the disk holds are read back into host slots first: the request waits a
step or more while the workers read and check the files (size, header, checksum) on a thread
of their own and report each read in a later step's output; a bad file is dropped and its
blocks are computed, never used. A step's file work is queued first on the worker, in this
order: spills, disk reads, saves, loads (a disk read fills another slot than any save of its
step, so the saves and loads can run as one pipeline); the slot a read fills stays the
read's until it is reported.

Torch-free, like the rest of folio/core.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from folio.core.block_hash import BlockHash


class HostEvictionPolicy(Protocol):
    """Which cached host slot gives way when the pool is full."""

    def touch(self, block_hash: BlockHash) -> None:
        """A block was saved or found again."""

    def forget(self, block_hash: BlockHash) -> None:
        """A block left the pool."""

    def victims(self):
        """Block hashes in the order they should be evicted."""


class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[BlockHash, None] = OrderedDict()

    def touch(self, block_hash: BlockHash) -> None:
        self._order[block_hash] = None
        self._order.move_to_end(block_hash)

    def forget(self, block_hash: BlockHash) -> None:
        self._order.pop(block_hash, None)

    def victims(self):
        return iter(list(self._order))


@dataclass
class HostTierStats:
    """Cumulative: blocks saved to and loaded from the host pool, prompt blocks looked up
    past the device prefix hit and found there (hits) or not (misses); with a disk tier,
    blocks spilled to it, read back from it, and its files found bad."""
    saved_blocks: int = 0
    loaded_blocks: int = 0
    hit_blocks: int = 0
    missed_blocks: int = 0
    disk_spilled_blocks: int = 0
    disk_read_blocks: int = 0
    disk_bad_blocks: int = 0


class DiskKVIndex:
    """Which block hashes the disk tier holds, least recently used first, at most
    `capacity` of them (a file per block)."""

    def __init__(self, capacity: int, existing: list[BlockHash] = ()) -> None:
        if capacity < 1:
            raise ValueError(f"the disk KV tier needs room for at least one block, got {capacity}")
        self.capacity = capacity
        self._order: OrderedDict[BlockHash, None] = OrderedDict()
        self.evicted: list[BlockHash] = []     # files to delete, taken with each step
        for block_hash in existing:           # oldest first (the files' modification times)
            self.add(block_hash)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._order

    def __len__(self) -> int:
        return len(self._order)

    def add(self, block_hash: BlockHash) -> None:
        self._order[block_hash] = None
        self._order.move_to_end(block_hash)
        while len(self._order) > self.capacity:
            old, _ = self._order.popitem(last=False)
            self.evicted.append(old)

    def touch(self, block_hash: BlockHash) -> None:
        if block_hash in self._order:
            self._order.move_to_end(block_hash)

    def remove(self, block_hash: BlockHash) -> None:
        self._order.pop(block_hash, None)


@dataclass
class StepCopies:
    """A step's tier work for the workers, in the order they run it."""
    spills: list[tuple[int, BlockHash]] = field(default_factory=list)   # host slot -> file
    saves: list[tuple[int, int]] = field(default_factory=list)          # device block -> slot
    disk_reads: list[tuple[BlockHash, int]] = field(default_factory=list)   # file -> slot
    loads: list[tuple[int, int]] = field(default_factory=list)          # slot -> device block
    disk_deletes: list[BlockHash] = field(default_factory=list)


@dataclass
class HostKVTier:
    num_host_blocks: int
    policy: HostEvictionPolicy = field(default_factory=LRUPolicy)
    disk: DiskKVIndex | None = None

    def __post_init__(self) -> None:
        if self.num_host_blocks < 1:
            raise ValueError(f"the host KV pool needs at least one block, got "
                             f"{self.num_host_blocks}")
        self.slot_of: dict[BlockHash, int] = {}
        self._free_slots = list(range(self.num_host_blocks - 1, -1, -1))
        self._step = StepCopies()
        # Host slots written or read this step (saved to, loaded from, read into): never
        # another block's slot in the same step, since the workers run each kind of copy
        # together (a spill of a slot saved this step would read it before the save).
        self._busy: set[int] = set()
        # Disk reads in flight: hash -> the host slot it is read into (kept from eviction
        # until the workers report the read).
        self._reading: dict[BlockHash, int] = {}
        # Blocks not saved on eviction (preempted requests left to recompute): hash -> how
        # many such requests hold it.
        self._skipped: dict[BlockHash, int] = {}
        self.stats = HostTierStats()

    @property
    def usage(self) -> float:
        return len(self.slot_of) / self.num_host_blocks

    def skip_saving(self, hashes: list[BlockHash]) -> None:
        """Blocks whose eviction saves nothing (a preempted request left to recompute)."""
        for h in hashes:
            self._skipped[h] = self._skipped.get(h, 0) + 1

    def save_again(self, hashes: list[BlockHash]) -> None:
        for h in hashes:
            n = self._skipped.get(h, 0) - 1
            if n > 0:
                self._skipped[h] = n
            else:
                self._skipped.pop(h, None)

    def free_slots(self) -> list[int]:
        return self._free_slots

    def on_evict(self, block_hash: BlockHash, block_id: int) -> None:
        """The device pool evicted cached block `block_id`: keep its K/V in a host slot
        (already there: it only counts as used again), unless it is skipped."""
        if block_hash in self._skipped:
            return
        if block_hash in self.slot_of:
            self.policy.touch(block_hash)
            return
        if block_hash in self._reading:
            return     # being read from disk into a slot already
        slot = self._take_slot()
        if slot is None:
            return     # every slot is being read this step: the block is lost, as without
        self.slot_of[block_hash] = slot
        self._busy.add(slot)
        self.policy.touch(block_hash)
        self._step.saves.append((block_id, slot))
        self.stats.saved_blocks += 1

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for victim in self.policy.victims():
            slot = self.slot_of[victim]
            if slot in self._busy:
                continue
            del self.slot_of[victim]
            self.policy.forget(victim)
            if self.disk is not None and victim not in self.disk:
                self._step.spills.append((slot, victim))   # to its file before reuse
                self.disk.add(victim)
                self.stats.disk_spilled_blocks += 1
            return slot
        return None

    def lookup(self, block_hashes: list[BlockHash]) -> list[int]:
        """The host slots of the longest run of `block_hashes` (a prompt's blocks after its
        device prefix hit) the pool holds."""
        slots = []
        for block_hash in block_hashes:
            slot = self.slot_of.get(block_hash)
            if slot is None:
                break
            slots.append(slot)
            # used: a disk read for the blocks after these must not take their slots
            self.policy.touch(block_hash)
        return slots

    def count_lookup(self, num_hits: int, num_looked_up: int) -> None:
        """Count a lookup once, when its request is scheduled."""
        self.stats.hit_blocks += num_hits
        self.stats.missed_blocks += max(num_looked_up - num_hits, 0)

    def load(self, slots: list[int], block_ids: list[int], block_hashes: list[BlockHash]) -> None:
        """Fill new device blocks from host slots this step (a prefix hit on the host)."""
        for slot, block_id, block_hash in zip(slots, block_ids, block_hashes):
            self._step.loads.append((slot, block_id))
            self._busy.add(slot)
            self.policy.touch(block_hash)
        self.stats.loaded_blocks += len(slots)

    # ---- the disk tier -------------------------------------------------------------------

    def disk_hits(self, block_hashes: list[BlockHash]) -> list[BlockHash]:
        """The longest run of `block_hashes` (a prompt's blocks past its host hits) on disk."""
        if self.disk is None:
            return []
        found = []
        for block_hash in block_hashes:
            if block_hash not in self.disk:
                break
            found.append(block_hash)
        return found

    def is_reading(self, block_hash: BlockHash) -> bool:
        return block_hash in self._reading

    def reads_in_flight(self) -> bool:
        return bool(self._reading)

    def read_from_disk(self, block_hashes: list[BlockHash]) -> int:
        """Have the workers read these blocks' files into host slots this step (each found
        in the host pool once its read is reported good). Returns how many were asked for
        (fewer when the host pool has no slot to spare)."""
        asked = 0
        for block_hash in block_hashes:
            if block_hash in self._reading or block_hash in self.slot_of:
                continue
            slot = self._take_slot()
            if slot is None:
                break
            self._reading[block_hash] = slot
            self._busy.add(slot)
            self._step.disk_reads.append((block_hash, slot))
            self.disk.touch(block_hash)
            asked += 1
        return asked

    def finish_disk_reads(self, results: list[tuple[BlockHash, bool]]) -> None:
        """The workers' reports: a good read puts the block in the host pool; a bad file is
        dropped (its blocks are computed instead)."""
        for block_hash, ok in results:
            slot = self._reading.pop(block_hash, None)
            if slot is None:
                continue
            if ok and block_hash in self.slot_of:
                self._free_slots.append(slot)      # saved again meanwhile: one copy is enough
            elif ok:
                self.slot_of[block_hash] = slot
                self.policy.touch(block_hash)
                self.stats.disk_read_blocks += 1
            else:
                self._free_slots.append(slot)
                self.disk.remove(block_hash)
                self._step.disk_deletes.append(block_hash)
                self.stats.disk_bad_blocks += 1

    def take_step_copies(self) -> StepCopies:
        """This step's copies, handed to the step message; the next step starts empty."""
        step, self._step = self._step, StepCopies()
        if self.disk is not None and self.disk.evicted:
            step.disk_deletes += self.disk.evicted
            self.disk.evicted = []
        self._busy = set(self._reading.values())
        return step

    def reset(self) -> None:
        """Forget every block of the host pool (the prefix cache was reset). Reads in flight
        keep their slots until reported; the disk tier's files stay (they are checked on
        every read)."""
        for block_hash in list(self.slot_of):
            self.policy.forget(block_hash)
        self.slot_of.clear()
        busy = set(self._reading.values())
        self._free_slots = [s for s in range(self.num_host_blocks - 1, -1, -1) if s not in busy]


class SwapPricing:
    """Preemption by swap or by recompute (issue 23, item 5): what bringing a preempted
    request's full blocks back from the host tier would cost, against computing their tokens
    again, from the steps' measured times.

    Steps that load nothing price a token of compute (an EMA of seconds per token over steps
    of at least MIN_TOKENS tokens, where the weights' reading no longer dominates); steps
    that load host blocks price a block's load by what they took above their tokens' compute.
    Before both are measured a request swaps when it has at least PRIOR_MIN_BLOCKS full
    blocks (a long prompt). Either way the tier must have room: free slots, or at most a
    quarter of the pool (one request never flushes the tier)."""

    MIN_TOKENS = 64
    PRIOR_MIN_BLOCKS = 4
    _EMA = 0.2

    def __init__(self) -> None:
        self.compute_s_per_token: float | None = None
        self.load_s_per_block: float | None = None

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self._EMA) * old + self._EMA * new

    def observe_step(self, num_tokens: int, loaded_blocks: int, seconds: float) -> None:
        if seconds <= 0:
            return
        if loaded_blocks == 0:
            if num_tokens >= self.MIN_TOKENS:
                self.compute_s_per_token = self._ema(self.compute_s_per_token,
                                                     seconds / num_tokens)
        elif self.compute_s_per_token is not None:
            above = max(0.0, seconds - self.compute_s_per_token * num_tokens)
            self.load_s_per_block = self._ema(self.load_s_per_block, above / loaded_blocks)

    def choose(self, num_blocks: int, block_size: int, free_slots: int, pool_slots: int
               ) -> tuple[bool, str]:
        """(swap?, the reason, with the estimates) for a request with `num_blocks` full
        blocks computed."""
        if num_blocks == 0:
            return False, "no full block to keep"
        if num_blocks > free_slots and 4 * num_blocks > pool_slots:
            return False, (f"the host tier has {free_slots} free of {pool_slots} slots for "
                           f"{num_blocks} blocks")
        if self.compute_s_per_token is None or self.load_s_per_block is None:
            swap = num_blocks >= self.PRIOR_MIN_BLOCKS
            return swap, (f"{num_blocks} blocks, costs not measured yet: "
                          f"{'a long prompt' if swap else 'a short one'}")
        recompute = self.compute_s_per_token * num_blocks * block_size
        load = self.load_s_per_block * num_blocks
        return load < recompute, (f"{num_blocks} blocks: load {load * 1e3:.2f} ms vs "
                                  f"recompute {recompute * 1e3:.2f} ms")


class OffloadingConnectorScheduler:
    """The host tier (and the disk tier below it) as the scheduler's KV connector (vLLM's
    OffloadingConnector; the protocol is folio/core/kv_connector.py).

    Its tokens arrive within the step that needs them (a load runs before the forward
    pass), so it never parks a request; a request whose blocks are on disk waits a step
    (None tokens: asked again) while the workers read them into host slots, which they
    report in a later step's output."""

    # Preempted requests' full blocks stay cached and go to the host tier when the device
    # evicts them: preemption is a swap for them (the scheduler logs it so).
    keeps_evicted_blocks = True

    def __init__(self, tier: HostKVTier, block_size: int, block_bytes: int = 0) -> None:
        """`block_bytes`: one block's K/V bytes over the workers (the byte counters)."""
        self.tier = tier
        self.block_size = block_size
        self.block_bytes = block_bytes
        # request id -> (host slots found past its device prefix hit, blocks looked up),
        # from the lookup to the allocation
        self._lookups: dict[str, tuple[list[int], int]] = {}
        # requests that have had their disk-tier blocks read once (a failed read is computed)
        self._disk_tried: set[str] = set()
        # preemption: swap (keep the blocks in the host tier when the device evicts them)
        # or recompute (their eviction saves nothing), priced from the measured steps
        self.pricing = SwapPricing()
        # request id -> hashes of its blocks that the tier does not save (recompute)
        self._not_saved: dict[str, list[BlockHash]] = {}
        self.swap_preemptions = 0
        self.recompute_preemptions = 0

    def on_block_evicted(self, block_hash: BlockHash, block_id: int) -> None:
        self.tier.on_evict(block_hash, block_id)

    def on_preempt(self, request, num_full_blocks: int) -> tuple[bool, str]:
        """A running request is preempted with `num_full_blocks` computed full blocks: swap
        them (the tier keeps them when the device evicts them; they load back on resume) or
        leave them to be recomputed. Returns (swap?, why)."""
        tier = self.tier
        swap, why = self.pricing.choose(num_full_blocks, self.block_size,
                                        len(tier.free_slots()), tier.num_host_blocks)
        if swap:
            self.swap_preemptions += 1
        else:
            self.recompute_preemptions += 1
            hashes = list(request.block_hashes[:num_full_blocks])
            self._not_saved[request.request_id] = hashes
            tier.skip_saving(hashes)
        return swap, why

    def observe_step(self, num_tokens: int, loaded_blocks: int, seconds: float) -> None:
        self.pricing.observe_step(num_tokens, loaded_blocks, seconds)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if request.needs_every_prompt_token:
            return 0, False
        bs = self.block_size
        first = num_computed_tokens // bs
        max_blocks = (request.num_tokens - 1) // bs      # one token is always computed
        wanted = request.block_hashes[first:max_blocks]
        slots = self.tier.lookup(wanted)
        self._lookups[request.request_id] = (slots, len(wanted))
        if self._waits_for_disk(request, first + len(slots), max_blocks):
            return None, False
        return len(slots) * bs, False

    def _waits_for_disk(self, request, num_hits: int, max_blocks: int) -> bool:
        """Whether the request's next prompt blocks are on the disk tier: their reads are
        asked for (this step) or still in flight, and the request waits for them. Blocks on
        disk are read once: after a read fails or the pool has no room, it computes them."""
        tier = self.tier
        if tier.disk is None:
            return False
        wanted = tier.disk_hits(request.block_hashes[num_hits:max_blocks])
        if not wanted:
            return False
        if any(tier.is_reading(h) for h in wanted):
            return True
        if request.request_id in self._disk_tried:
            return False
        self._disk_tried.add(request.request_id)
        return tier.read_from_disk(wanted) > 0

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int,
                                 key: str) -> None:
        skipped = self._not_saved.pop(request.request_id, None)
        if skipped:
            self.tier.save_again(skipped)    # resumed: its blocks are ordinary ones again
        slots, looked_up = self._lookups.pop(request.request_id, ([], 0))
        if num_external_tokens and slots:
            # the first new blocks take the host tier's copies, before the forward pass
            first = request.num_computed_tokens // self.block_size
            n = len(slots)
            self.tier.load(slots, block_ids[first:first + n], request.block_hashes[first:first + n])
        self.tier.count_lookup(len(slots) if num_external_tokens else 0, looked_up)

    def build_connector_meta(self) -> dict:
        copies = self.tier.take_step_copies()
        return dict(kv_spills=copies.spills, kv_saves=copies.saves,
                    kv_disk_reads=copies.disk_reads, kv_loads=copies.loads,
                    kv_disk_deletes=copies.disk_deletes)

    def update_connector_output(self, output) -> tuple[list[str], list[tuple[str, bool]]]:
        if output.kv_disk_read_results:
            self.tier.finish_disk_reads(output.kv_disk_read_results)
        return [], []

    def request_finished(self, request, block_ids: list[int], key: str
                         ) -> tuple[bool, dict | None]:
        return False, None

    def expired_holds(self, now: float) -> None:
        """The tiers keep no finished request's blocks: nothing expires."""

    def forget(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)
        self._disk_tried.discard(request_id)
        skipped = self._not_saved.pop(request_id, None)
        if skipped:
            self.tier.save_again(skipped)

    def has_pending_work(self) -> bool:
        # disk reads report in the output of a later step (the workers read files on a
        # thread): steps must keep coming while one is in flight
        return self.tier.reads_in_flight()

    def reset(self) -> None:
        self.tier.reset()

    def stats(self) -> dict:
        tier, size = self.tier, self.block_bytes
        return dict(kv_offload_usage=tier.usage, kv_offload_hit_blocks=tier.stats.hit_blocks,
                    kv_offload_miss_blocks=tier.stats.missed_blocks,
                    kv_offload_saved_bytes=tier.stats.saved_blocks * size,
                    kv_offload_loaded_bytes=tier.stats.loaded_blocks * size,
                    kv_disk_read_blocks=tier.stats.disk_read_blocks,
                    kv_disk_bad_blocks=tier.stats.disk_bad_blocks,
                    kv_swap_preemptions=self.swap_preemptions,
                    kv_recompute_preemptions=self.recompute_preemptions)
