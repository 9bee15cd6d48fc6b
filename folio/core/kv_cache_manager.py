"""Per-request block tables on top of the block pool, with prefix-cache lookups."""
from __future__ import annotations

from dataclasses import dataclass

from folio.core.block_pool import BlockPool, KVCacheBlock
from folio.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0   # prompt tokens looked up
    hits: int = 0      # of those, tokens found in the cache
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same blocks' ids, kept in step with req_to_blocks: the model runner reads them
        # every step, and rebuilding the list per request per step was a hot spot.
        self.req_to_block_ids: dict[str, list[int]] = {}
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
        if not self.enable_caching or request.needs_prompt_logprobs:
            # prompt_logprobs needs logits for every prompt position, so nothing may be skipped.
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
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (and
        after `new_computed_blocks`, prefix-cache hits being attached now), plus
        `num_lookahead_tokens` slots past them that a draft model writes its drafts into
        (not cached: their tokens are not known yet). Returns the newly allocated blocks, or
        None when the pool cannot supply them (nothing is changed then)."""
        if not new_computed_blocks:
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
        block_ids = self.req_to_block_ids.setdefault(request.request_id, [])
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
            self._cache_full_blocks(request, blocks, total_tokens)
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

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids: the live list (grows as blocks are added; a freed
        request's list is dropped, never reused) — read it, do not change it."""
        return self.req_to_block_ids.get(request_id, [])

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
