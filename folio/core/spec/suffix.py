"""Suffix drafting (after SuffixDecoding, Oliaro et al. 2024): the draft continues the longest
suffix of the request's context that occurred before, either in the request itself or in the
outputs of recent requests, and drafts more the longer that match is.

Two indexes of context hashes, both keyed by (length, n-gram) for lengths 1..max_depth:
- per request: the position after the latest occurrence (as the n-gram proposer), so a match
  continues the request's own text;
- shared: for the outputs of the last `max_cached_requests` finished requests, how often each
  token followed each n-gram. A draft from it is extended token by token with the most
  frequent continuation while that token's share of the continuations stays at least
  `min_token_prob`, re-matching the context plus the draft so far.
The longer match wins (the request's own on a tie). A match of m tokens drafts at most
max_spec_factor · m tokens (and the step's k): a short, ambiguous match proposes little.
Hashes stand in for the n-grams: a collision only yields a wrong guess, which verification
rejects.
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque

from folio.core.spec.ngram_keys import BASE, LENGTHS, MOD, index_positions, key_table


class SuffixProposer:
    def __init__(self, max_depth: int = 24, max_cached_requests: int = 1000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        if max_depth < 1 or max_cached_requests < 0 or max_spec_factor <= 0 \
                or not 0 <= min_token_prob <= 1:
            raise ValueError("suffix proposer: bad parameters")
        self.max_depth = max_depth
        self.max_cached = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        # per request: its tokens, and hash -> position after the latest occurrence
        self._own: dict[str, tuple[list[int], dict[int, int]]] = {}
        # shared: hash -> Counter(next token), from the outputs of recent requests
        self._shared: dict[int, Counter] = {}
        self._cached: OrderedDict[str, list[int]] = OrderedDict()
        # finished requests' outputs not yet in the shared index
        self._pending: deque[tuple[str, list[int]]] = deque()

    # ---- the request's own context ------------------------------------------------------

    def _extend_own(self, request_id: str, token_ids: list[int]) -> tuple[list[int], dict[int, int]]:
        entry = self._own.get(request_id)
        if entry is None:
            entry = self._own[request_id] = ([], {})
        tokens, table = entry
        start = len(tokens)
        tokens.extend(token_ids[start:])
        index_positions(table, tokens, start, self.max_depth)
        return entry

    def _own_match(self, tokens: list[int], table: dict[int, int]) -> tuple[int, int]:
        """(match length, position after it) of the longest earlier occurrence."""
        best = (0, -1)
        end = len(tokens)
        h = 0
        for n in range(1, min(self.max_depth, end) + 1):   # keys_ending_at, stopping at a miss
            h = (h * BASE + tokens[end - n] + 1) % MOD
            pos = table.get(h * LENGTHS + n)
            if pos is None:
                break      # no longer n-gram can match where this one does not
            best = (n, pos)
        return best

    # ---- the shared index -----------------------------------------------------------------

    def _shared_walk(self, tokens: list[int], k: int, beat: int = 0) -> tuple[int, list[int]]:
        """(match length of the context, draft) from the shared index; no draft is walked
        when the match is not longer than `beat` > 0 (the request's own match, which wins
        ties: the walk, up to k re-matchings of max_depth keys, was most of a proposal's
        host time)."""
        context = list(tokens[-self.max_depth:])
        draft: list[int] = []
        match_len = -1
        while len(draft) < k:
            counts, n = None, 0
            end = len(context)
            h = 0
            for m in range(1, min(self.max_depth, end) + 1):   # keys_ending_at, stopping at a miss
                h = (h * BASE + context[end - m] + 1) % MOD
                found = self._shared.get(h * LENGTHS + m)
                if found is None:
                    break
                counts, n = found, m
            if match_len < 0:
                match_len = n
                if 0 < beat >= n:
                    break
            if counts is None:
                break
            token, count = counts.most_common(1)[0]
            if count < self.min_token_prob * sum(counts.values()):
                break
            draft.append(token)
            context.append(token)
            if len(context) > self.max_depth:
                context.pop(0)
        return max(match_len, 0), draft

    def _add_shared(self, tokens: list[int], sign: int) -> None:
        keys, positions = key_table(tokens, 1, self.max_depth)
        for key, p in zip(keys, positions):
            counts = self._shared.setdefault(key, Counter())
            counts[tokens[p]] += sign
            if counts[tokens[p]] <= 0:
                del counts[tokens[p]]
                if not counts:
                    del self._shared[key]

    # ---- the proposer -----------------------------------------------------------------------

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        if k <= 0 or len(token_ids) < 2:
            return []
        tokens, table = self._extend_own(request_id, token_ids)
        own_len, pos = self._own_match(tokens, table)
        shared_len, shared_draft = (self._shared_walk(tokens, k, own_len) if self._shared
                                    else (0, []))
        if own_len >= shared_len and own_len > 0:
            draft = tokens[pos:pos + k]
            match = own_len
        else:
            draft, match = shared_draft, shared_len
        return draft[:min(k, math.ceil(self.max_spec_factor * match))]

    def finish(self, request_id: str, output_token_ids: list[int]) -> None:
        """A request ended: its outputs are queued for the shared index (`index_pending`
        moves them in a few per step while proposals are made: 64 requests finishing in one
        step would otherwise spend ~0.1 s of one step's host time indexing, for nothing
        when no proposal follows), its own index is dropped."""
        self._own.pop(request_id, None)
        if self.max_cached == 0 or len(output_token_ids) < 2:
            return
        self._pending.append((request_id, list(output_token_ids)))
        while len(self._pending) > self.max_cached:
            self._pending.popleft()                 # never indexed: nothing to undo

    def index_pending(self, max_requests: int | None = None) -> None:
        """Move up to `max_requests` queued outputs (None: all) into the shared index (the
        oldest leave it past the cache size)."""
        count = len(self._pending) if max_requests is None else max_requests
        for _ in range(min(count, len(self._pending))):
            request_id, tokens = self._pending.popleft()
            self._cached[request_id] = tokens
            self._add_shared(tokens, +1)
            while len(self._cached) > self.max_cached:
                _, old = self._cached.popitem(last=False)
                self._add_shared(old, -1)
