"""Which data-parallel replica takes a request (`--data-parallel-size N`): prefix-aware, then
least loaded.

A replica that served a prompt holds its KV blocks in its prefix cache; a later prompt that
starts the same way is cheaper there. So the router remembers, for the leading full blocks of
each prompt it routed, which replica took them (a chained hash per block, as the prefix cache
keys blocks, with the request's cache salt and adapter in the first link), and sends a prompt
to the replica holding its longest remembered prefix — unless that replica is overloaded next
to the least loaded one. Otherwise the least loaded replica wins: fewest open requests, then
the least KV use its last step reported. Torch-free: plain Python over token ids.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ReplicaLoad:
    alive: bool
    open_requests: int
    kv_cache_usage: float


@dataclass(frozen=True)
class Route:
    replica: int
    # leading tokens of the prompt the chosen replica is known to have seen (0: routed by load)
    prefix_tokens: int


class PrefixAwareRouter:
    def __init__(self, block_size: int, max_blocks_per_prompt: int = 256,
                 max_entries: int = 1 << 17, overload_slack: int = 8) -> None:
        """`max_entries`: remembered block hashes (LRU); `overload_slack`: how many more open
        requests than the least loaded replica the prefix holder may have and still win."""
        self.block_size = block_size
        self.max_blocks = max_blocks_per_prompt
        self.max_entries = max_entries
        self.overload_slack = overload_slack
        self._owner: OrderedDict[int, int] = OrderedDict()

    def _block_hashes(self, token_ids: Sequence[int], salt: object) -> list[int]:
        out, previous = [], hash(("folio-dp", salt))
        n = min(len(token_ids) // self.block_size, self.max_blocks)
        for i in range(n):
            previous = hash((previous, tuple(token_ids[i * self.block_size:
                                                      (i + 1) * self.block_size])))
            out.append(previous)
        return out

    def choose(self, token_ids: Sequence[int], loads: Sequence[ReplicaLoad],
               salt: object = None) -> Route:
        """The replica for a prompt; ValueError when none is alive."""
        alive = [i for i, load in enumerate(loads) if load.alive]
        if not alive:
            raise ValueError("no data-parallel replica is alive")
        least = min(alive, key=lambda i: (loads[i].open_requests, loads[i].kv_cache_usage, i))
        hashes = self._block_hashes(token_ids, salt)
        for depth in range(len(hashes), 0, -1):
            owner = self._owner.get(hashes[depth - 1])
            if owner is None or not loads[owner].alive:
                continue
            limit = 2 * loads[least].open_requests + self.overload_slack
            if loads[owner].open_requests <= limit:
                return Route(owner, depth * self.block_size)
            break
        return Route(least, 0)

    def record(self, token_ids: Sequence[int], replica: int, salt: object = None) -> None:
        """Remember that `replica` took this prompt (its blocks are in that replica's cache)."""
        for h in self._block_hashes(token_ids, salt):
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def forget_replica(self, replica: int) -> None:
        """A replica died: its cache is gone."""
        for h in [h for h, owner in self._owner.items() if owner == replica]:
            del self._owner[h]
