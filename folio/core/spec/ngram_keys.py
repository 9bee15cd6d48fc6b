"""Keys of n-grams for the host drafters' indexes (ngram.py, suffix.py): polynomial hashes
built from an n-gram's last token backwards, so the keys of every n = 1..max_depth ending at
one position cost max_depth steps, not the max_depth² that hashing each n-gram's tuple took.
A context's keys are computed with numpy, one vector per n over all positions (at batch 64 a
proposal after a rest indexes a whole 200-token prompt: the Python loop took ~0.1-0.3 ms a
request on the H200's host, the vectors a few tens of µs). The modulus keeps h * BASE inside
int64; `LENGTHS` keeps n-grams of different lengths apart. A collision only yields a wrong
guess, which verification rejects.
"""
from __future__ import annotations

import numpy as np

MOD = (1 << 31) - 1
BASE = 1_000_003
LENGTHS = 4096      # key = hash * LENGTHS + n: n-grams of different lengths never share one


def keys_ending_at(tokens: list[int], end: int, max_depth: int) -> list[int]:
    """Keys of the n-grams ending at `end` (exclusive), n = 1..max_depth (shortest first)."""
    keys = []
    h = 0
    for n in range(1, min(max_depth, end) + 1):
        h = (h * BASE + tokens[end - n] + 1) % MOD
        keys.append(h * LENGTHS + n)
    return keys


def key_table(tokens: list[int], start: int, max_depth: int) -> tuple[list[int], list[int]]:
    """(keys, positions) of the n-grams ending at every position p in [max(start, 1),
    len(tokens)) (n = 1..min(max_depth, p)), grouped by n and by p ascending within a group:
    inserting them in this order leaves each key at its latest position."""
    t = np.asarray(tokens, dtype=np.int64) + 1
    ends = np.arange(max(start, 1), len(tokens), dtype=np.int64)
    keys, positions = [], []
    h = np.zeros(len(ends), dtype=np.int64)
    for n in range(1, max_depth + 1):
        ok = ends >= n
        if not ok.any():
            break
        if not ok.all():             # positions too early for this n: dropped for good
            ends, h = ends[ok], h[ok]
        h = (h * BASE + t[ends - n]) % MOD
        keys.append(h * LENGTHS + n)
        positions.append(ends)
    if not keys:
        return [], []
    return np.concatenate(keys).tolist(), np.concatenate(positions).tolist()


def index_positions(table: dict[int, int], tokens: list[int], start: int,
                    max_depth: int) -> None:
    """Point the keys of the n-grams ending at each position p >= start (n = 1..max_depth)
    at p, the later position winning: many new tokens (a prompt, or those of a rest without
    proposals) with numpy, a step's few with the loop, which is cheaper there."""
    if len(tokens) - start > 8:
        table.update(zip(*key_table(tokens, start, max_depth)))
        return
    for p in range(max(start, 1), len(tokens)):
        for key in keys_ending_at(tokens, p, max_depth):
            table[key] = p
