"""Prompt-lookup (n-gram) drafting: the tokens that followed the latest earlier occurrence of
the longest n-gram (max_n down to min_n tokens) that ends the request's tokens.

Each request gets an index kept up to date as its tokens grow, so a proposal costs a few dict
lookups instead of a scan of the context: for every n in [min_n, max_n], the key of each
n-gram (ngram_keys.py) maps to the position of the token that followed its latest
occurrence. An n-gram is indexed once its next token is known, so the n-gram ending the
context never finds itself. Many new tokens at once (a prompt, or the tokens of a rest
without proposals) are indexed with numpy.
"""
from __future__ import annotations

from folio.core.spec.ngram_keys import index_positions, keys_ending_at


class _Index:
    __slots__ = ("tokens", "next_pos")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        # hash((n,) + n-gram) -> position of the token after the n-gram's latest occurrence
        self.next_pos: dict[int, int] = {}


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, _Index] = {}

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens for a request whose tokens are `token_ids` (its prompt and
        outputs so far; the same list may be passed again as it grows)."""
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _Index()
        self._extend(index, token_ids)
        tokens = index.tokens
        end = len(tokens)
        keys = keys_ending_at(tokens, end, min(self.max_n, end - 1))
        for n in range(len(keys), self.min_n - 1, -1):
            pos = index.next_pos.get(keys[n - 1])
            if pos is not None:
                return tokens[pos:pos + k]
        return []

    def drop(self, request_id: str) -> None:
        """Forget a finished request."""
        self._indexes.pop(request_id, None)

    def _extend(self, index: _Index, token_ids: list[int]) -> None:
        tokens, table = index.tokens, index.next_pos
        start = len(tokens)
        if len(token_ids) < start or (start and token_ids[start - 1] != tokens[-1]):
            # Not a continuation (cannot happen for one request): start over.
            tokens.clear()
            table.clear()
            start = 0
        tokens.extend(token_ids[start:])
        # The token at position p completes the n-grams ending just before it (n-grams
        # shorter than min_n are indexed too: never looked up, cheaper than leaving out).
        index_positions(table, tokens, start, self.max_n)
