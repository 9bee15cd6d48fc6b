"""Per-request block tables on top of the block pool, with prefix-cache lookups.

`KVCacheManager` is the one-group case (every layer full attention: one block table per
request, every block kept); `HybridKVCacheManager` runs several KV cache groups
(folio/core/kv_cache_layout.py), or one sliding-window group, from the same pool. Both hand
the scheduler a request's block ids as one list per group.
"""
from __future__ import annotations

from dataclasses import dataclass

from folio.core.block_hash import BlockHash
from folio.core.block_pool import BlockPool, KVCacheBlock
from folio.core.kv_cache_layout import KVCacheLayout, cdiv
from folio.core.kv_pins import KVPins
from folio.core.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0   # prompt tokens looked up
    hits: int = 0      # of those, tokens found in the cache
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, *,
                 null_block: bool = False, max_pinned_fraction: float = 0.0) -> None:
        """`max_pinned_fraction`: the share of the usable blocks that pins of finished
        requests may hold (folio/core/kv_pins.py); 0 = no pins."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, null_block)
        self.pins = KVPins(self.block_pool,
                           int(max_pinned_fraction * self.block_pool.num_usable_blocks))
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same blocks' ids, kept in step with req_to_blocks, as the one group's list: the
        # model runner reads them every step, and rebuilding the list per request per step
        # was a hot spot.
        self.req_to_block_ids: dict[str, tuple[list[int]]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, as blocks and a token count."""
        if not self.enable_caching or request.needs_every_prompt_token:
            # prompt logprobs (and per-token pooling) need every prompt position: no skipping.
            return [], 0
        # The last token is always recomputed so there are logits to sample from.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count a lookup once, when the request is actually scheduled (a request that waits
        for blocks is looked up again each step and must not inflate the counters)."""
        self.stats.requests += 1
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None, *,
                       num_lookahead_tokens: int = 0,
                       cache: bool = True) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (and
        after `new_computed_blocks`, prefix-cache hits being attached now), plus
        `num_lookahead_tokens` slots past them that a draft model writes its drafts into
        (not cached: their tokens are not known yet). Returns the newly allocated blocks, or
        None when the pool cannot supply them (nothing is changed then). `cache=False`: the
        new tokens' K/V arrives from elsewhere later (a KV connector's fetch), so their blocks
        are indexed only when the request is next given slots, after the fetch."""
        if not new_computed_blocks and cache:
            # Fast path (every decode step of every running request): room in the last block.
            blocks = self.req_to_blocks.get(request.request_id)
            if blocks is not None:
                total_tokens = request.num_computed_tokens + num_new_tokens
                if total_tokens + num_lookahead_tokens <= len(blocks) * self.block_size:
                    if self.enable_caching and total_tokens // self.block_size > \
                            self.num_cached_blocks.get(request.request_id, 0):
                        self._cache_full_blocks(request, blocks, total_tokens)
                    return []
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        block_ids, = self.req_to_block_ids.setdefault(request.request_id, ([],))
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_needed = (cdiv(total_tokens + num_lookahead_tokens, self.block_size) - len(blocks)
                      - len(new_computed_blocks))
        # Hits on free blocks leave the free queue, so they count against what is available.
        num_hits_on_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_needed, 0) > self.block_pool.num_free_blocks - num_hits_on_free:
            if not blocks:
                del self.req_to_blocks[request.request_id]
                del self.req_to_block_ids[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_needed) if num_needed > 0 else []
        blocks.extend(new_blocks)
        block_ids.extend(b.block_id for b in new_computed_blocks)
        block_ids.extend(b.block_id for b in new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, total_tokens if cache else num_computed)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Index the blocks that will be full once this step's tokens are written. Their K/V
        is written before any attention reads it in the same forward pass, so a request
        scheduled later in the same step may already reuse them."""
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.block_pool.cache_full_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def uncache_unwritten_blocks(self, request: Request, num_written_tokens: int) -> None:
        """Un-index the blocks holding positions at or past `num_written_tokens`. For a step
        that was scheduled and then undone (its request preempted later in the same step):
        allocate_slots indexed the blocks that step would have filled, but it never runs."""
        first = num_written_tokens // self.block_size
        for block in self.req_to_blocks.get(request.request_id, [])[first:]:
            self.block_pool.uncache_block(block)

    def pin(self, request: Request, expiry: float) -> int:
        """Pin the prefix-cache blocks of the request's full blocks until `expiry` (call it
        before `free`, while the request still holds them). Returns the blocks pinned."""
        if not self.enable_caching:
            return 0
        return self.pins.pin(request.request_id, self._pinnable_blocks(request), expiry)

    def _pinnable_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The blocks the prefix cache finds for the request's indexed blocks, in prefix
        order: looked up by hash, since an equal block computed by another request at the
        same time may be the one indexed instead of the request's own."""
        cached = self.block_pool.cached_blocks
        blocks = []
        for block_hash in request.block_hashes[:self.num_cached_blocks.get(request.request_id, 0)]:
            block = cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def free(self, request: Request) -> None:
        self.free_key(request.request_id)

    def free_key(self, key: str) -> None:
        """Free the blocks held under `key` (a request id, or the key `rekey` moved them to)."""
        blocks = self.req_to_blocks.pop(key, [])
        self.req_to_block_ids.pop(key, None)
        self.num_cached_blocks.pop(key, None)
        self.block_pool.free_blocks(reversed(blocks))

    def rekey(self, request_id: str, key: str) -> None:
        """Hold a finished request's blocks under `key` instead of its id, so the id may be
        used again while they are still in use (a KV transfer reading or writing them)."""
        for table in (self.req_to_blocks, self.req_to_block_ids, self.num_cached_blocks):
            if request_id in table:
                table[key] = table.pop(request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per KV cache group: the live lists (they grow as
        blocks are added; a freed request's are dropped, never reused) — read them, do not
        change them."""
        return self.req_to_block_ids.get(request_id, _NO_BLOCKS)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, pins first (they hold blocks; refused while requests
        do, with the pins gone all the same)."""
        self.pins.clear()
        return self.block_pool.reset_prefix_cache()


_NO_BLOCKS: tuple[list[int]] = ([],)


class HybridKVCacheManager(KVCacheManager):
    """Block tables for several KV cache groups (or one sliding-window group), one per group
    per request, all from one pool.

    A sliding group's blocks that fall wholly before its window (before position
    num_computed_tokens - w + 1, the oldest key the step's first query sees) are freed as the
    request moves on, keeping their hashes for the prefix cache like any freed block; the
    null block takes their place in the table, so a table's index is still a block index. A
    long sequence then holds about w / block_size + 1 blocks per sliding group.

    The prefix cache indexes each group's blocks apart (a block hash names the same tokens in
    every group, but each group has its own block for them): group g > 0's key is the hash
    with g appended.
    """

    def __init__(self, layout: KVCacheLayout, num_blocks: int, block_size: int,
                 enable_caching: bool = True, *, max_pinned_fraction: float = 0.0) -> None:
        super().__init__(num_blocks, block_size, enable_caching,
                         null_block=layout.num_reserved_blocks > 0,
                         max_pinned_fraction=max_pinned_fraction)
        self.layout = layout
        self.windows = [g.sliding_window for g in layout.groups]
        self.full_groups = [g for g, w in enumerate(self.windows) if w is None]
        self.sliding_groups = [g for g, w in enumerate(self.windows) if w is not None]
        self._tags = [b""] + [g.to_bytes(2, "little") for g in range(1, len(self.windows))]
        # Per request: the per-group block lists live in req_to_blocks / req_to_block_ids
        # (lists of lists), the cached-block counts per group in num_cached_blocks, and here
        # how many leading entries of each sliding group's table are already the null block.
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}  # type: ignore[assignment]
        self.req_to_block_ids: dict[str, tuple[list[int], ...]] = {}
        self.num_cached_blocks: dict[str, list[int]] = {}  # type: ignore[assignment]
        self.num_nulled_blocks: dict[str, list[int]] = {}
        self._no_blocks: tuple[list[int], ...] = tuple([] for _ in self.windows)

    def _key(self, group: int, block_hash: BlockHash) -> BlockHash:
        return block_hash + self._tags[group] if group else block_hash

    def _first_needed_block(self, group: int, num_computed: int) -> int:
        """The first block a step starting at token `num_computed` reads in this group."""
        w = self.windows[group]
        return 0 if w is None else max(0, num_computed - w + 1) // self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """The longest cached prefix of L tokens such that every full group holds the blocks of
        [0, L) and every sliding group the blocks its window reads from [0, L) (those before
        are the null block). Per-group block lists and L."""
        if not self.enable_caching or request.needs_every_prompt_token:
            return [], 0
        hashes = request.block_hashes
        cached = self.block_pool.cached_blocks
        # Full groups: the longest prefix all of them hold.
        num = min((request.num_tokens - 1) // self.block_size, len(hashes))
        for i in range(num):
            if any(self._key(g, hashes[i]) not in cached for g in self.full_groups):
                num = i
                break
        # Sliding groups: shrink the prefix until every window's blocks are there. Past a
        # missing block i no prefix m > i can work (its window starts at or before i, since a
        # window's start grows with m), so the next candidate is i.
        while num > 0:
            miss = -1
            for g in self.sliding_groups:
                for i in range(num - 1, self._first_needed_block(g, num * self.block_size) - 1, -1):
                    if self._key(g, hashes[i]) not in cached:
                        miss = max(miss, i)
                        break
            if miss < 0:
                break
            num = miss
        if num == 0:
            return [], 0
        null = self.block_pool.null_block
        hits = []
        for g in range(len(self.windows)):
            first = self._first_needed_block(g, num * self.block_size)
            hits.append([null] * first + [cached[self._key(g, hashes[i])]
                                          for i in range(first, num)])
        return hits, num * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[list[KVCacheBlock]] | None = None, *,
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """As KVCacheManager.allocate_slots, for every group: room for the step's tokens (and
        the lookahead) in each group's table, all from the pool or none. Blocks a sliding
        group no longer sees are freed first (whatever becomes of this step: a later step
        starts later still)."""
        rid = request.request_id
        bs = self.block_size
        tables = self.req_to_blocks.get(rid)
        num_hit = len(new_computed_blocks[0]) if new_computed_blocks else 0
        num_computed = request.num_computed_tokens + num_hit * bs
        total_tokens = num_computed + num_new_tokens
        num_blocks = cdiv(total_tokens + num_lookahead_tokens, bs)
        if tables is not None:
            self._free_out_of_window(rid, tables, num_computed)
            if not new_computed_blocks and all(len(t) >= num_blocks for t in tables):
                # A decode step that fits every group's last block.
                if self.enable_caching:
                    self._cache_full_blocks(request, tables, total_tokens)
                return []
        hits = new_computed_blocks or [[] for _ in self.windows]
        lengths = [len(t) for t in tables] if tables is not None else [0] * len(self.windows)
        needed = [max(0, num_blocks - n - len(h)) for n, h in zip(lengths, hits)]
        # Hits on free blocks leave the free queue (the null block is never free).
        num_hits_on_free = sum(1 for h in hits for b in h if b.ref_cnt == 0)
        if sum(needed) > self.block_pool.num_free_blocks - num_hits_on_free:
            return None
        null = self.block_pool.null_block
        if tables is None:
            tables = self.req_to_blocks[rid] = [[] for _ in self.windows]
            self.req_to_block_ids[rid] = tuple([] for _ in self.windows)
            self.num_cached_blocks[rid] = [0] * len(self.windows)
            # Leading nulls of a hit: those blocks are out of the window already.
            self.num_nulled_blocks[rid] = [sum(1 for b in h if b is null) for h in hits]
        self.block_pool.touch(b for h in hits for b in h if b is not null)
        new_blocks = self.block_pool.get_new_blocks(sum(needed))
        ids = self.req_to_block_ids[rid]
        start = 0
        for table, table_ids, h, n in zip(tables, ids, hits, needed):
            added = h + new_blocks[start:start + n]
            start += n
            table.extend(added)
            table_ids.extend(b.block_id for b in added)
        if self.enable_caching:
            self._cache_full_blocks(request, tables, total_tokens)
        return new_blocks

    def _free_out_of_window(self, rid: str, tables: list[list[KVCacheBlock]],
                            num_computed: int) -> None:
        nulled = self.num_nulled_blocks[rid]
        null = self.block_pool.null_block
        for g in self.sliding_groups:
            first = min(self._first_needed_block(g, num_computed), len(tables[g]))
            if first <= nulled[g]:
                continue
            table, ids = tables[g], self.req_to_block_ids[rid][g]
            gone = [b for b in table[nulled[g]:first] if b is not null]
            table[nulled[g]:first] = [null] * (first - nulled[g])
            ids[nulled[g]:first] = [null.block_id] * (first - nulled[g])
            nulled[g] = first
            self.block_pool.free_blocks(reversed(gone))

    def _cache_full_blocks(self, request: Request, tables: list[list[KVCacheBlock]],
                           num_tokens: int) -> None:
        counts = self.num_cached_blocks[request.request_id]
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        if end <= min(counts):
            return
        null = self.block_pool.null_block
        hashes = request.block_hashes
        for g, table in enumerate(tables):
            for i in range(counts[g], end):
                if table[i] is not null:
                    self.block_pool.cache_full_block(table[i], self._key(g, hashes[i]))
            counts[g] = max(counts[g], end)

    def uncache_unwritten_blocks(self, request: Request, num_written_tokens: int) -> None:
        first = num_written_tokens // self.block_size
        null = self.block_pool.null_block
        for table in self.req_to_blocks.get(request.request_id, []):
            for block in table[first:]:
                if block is not null:
                    self.block_pool.uncache_block(block)

    def _pinnable_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Every group's indexed blocks the request still holds (a sliding group's are those
        of its last window), position by position, looked up under each group's key."""
        rid = request.request_id
        tables = self.req_to_blocks.get(rid)
        if tables is None:
            return []
        counts = self.num_cached_blocks[rid]
        cached = self.block_pool.cached_blocks
        null = self.block_pool.null_block
        hashes = request.block_hashes
        blocks = []
        for i in range(max(counts)):
            for g, table in enumerate(tables):
                if i < counts[g] and table[i] is not null:
                    block = cached.get(self._key(g, hashes[i]))
                    if block is None:
                        return blocks
                    blocks.append(block)
        return blocks

    def free(self, request: Request) -> None:
        rid = request.request_id
        tables = self.req_to_blocks.pop(rid, [])
        self.req_to_block_ids.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        self.num_nulled_blocks.pop(rid, None)
        null = self.block_pool.null_block
        for table in tables:
            self.block_pool.free_blocks(b for b in reversed(table) if b is not null)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.req_to_block_ids.get(request_id, self._no_blocks)


def make_kv_cache_manager(layout: KVCacheLayout, num_blocks: int, block_size: int,
                          enable_caching: bool = True, *,
                          max_pinned_fraction: float = 0.0) -> KVCacheManager:
    """The manager for this layout: the one-group manager for today's layout (no per-step
    cost of groups), the hybrid one otherwise."""
    if layout.is_single_full:
        return KVCacheManager(num_blocks, block_size, enable_caching,
                              max_pinned_fraction=max_pinned_fraction)
    return HybridKVCacheManager(layout, num_blocks, block_size, enable_caching,
                                max_pinned_fraction=max_pinned_fraction)
