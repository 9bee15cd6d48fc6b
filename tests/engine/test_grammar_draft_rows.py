"""The grammar's rows of a verify step (speculative decoding): one mask per draft position,
each the allowed tokens after the drafts before it; the matcher ends where it began; rows
after a forbidden draft allow everything (never read); with a reasoning parser the rows before
the end tag are unconstrained and those after it constrained from the grammar's start."""
from __future__ import annotations

from concurrent.futures import Future

import torch

from folio.engine.grammar_manager import ReasoningGate, RequestGrammar
from folio.structured_output.backend import allocate_bitmask
from folio.structured_output.masking import unpack_bitmask

VOCAB = 64


class CountingMatcher:
    """A grammar over ids < VOCAB: after t accepted tokens the next must be 10 + t (or the
    stop token 0 after three); keeps its accepted tokens so rollback is checkable."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def allowed(self) -> set[int]:
        t = len(self.tokens)
        return {10 + t} | ({0} if t >= 3 else set())

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self.allowed():
            return False
        self.tokens.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        assert 0 <= num_tokens <= len(self.tokens)
        del self.tokens[len(self.tokens) - num_tokens:]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        for token in self.allowed():
            word, bit = divmod(token, 32)
            bitmask[row, word] |= torch.tensor(1 << bit, dtype=torch.int32) if bit < 31 \
                else torch.tensor(-(1 << 31), dtype=torch.int32)


def _grammar(gate: ReasoningGate | None = None) -> RequestGrammar:
    grammar = RequestGrammar("r", Future(), gate)
    grammar.matcher = CountingMatcher()
    grammar.ready = True
    return grammar


def _allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    return set(torch.nonzero(unpack_bitmask(bitmask[row:row + 1], VOCAB)[0]).flatten().tolist())


def test_a_row_per_draft_position_and_the_matcher_unchanged() -> None:
    grammar = _grammar()
    grammar.matcher.accept_token(10)
    bitmask = allocate_bitmask(8, VOCAB)
    rows = grammar.fill_rows(bitmask, 2, [11, 12, 13])
    assert rows == [2, 3, 4, 5]
    assert [_allowed(bitmask, r) for r in rows] == [{11}, {12}, {0, 13}, {0, 14}]
    assert grammar.matcher.tokens == [10]                # rolled back over the drafts
    assert _allowed(bitmask, 0) == set(range(VOCAB))     # other requests' rows untouched


def test_rows_after_a_forbidden_draft_allow_everything() -> None:
    grammar = _grammar()
    bitmask = allocate_bitmask(4, VOCAB)
    rows = grammar.fill_rows(bitmask, 0, [10, 99 % VOCAB, 12])
    # the second draft is forbidden: its row masks it (verification rejects it there)
    assert rows == [0, 1] and _allowed(bitmask, 1) == {11}
    assert _allowed(bitmask, 2) == _allowed(bitmask, 3) == set(range(VOCAB))
    assert grammar.matcher.tokens == []


def test_the_reasoning_end_tag_inside_the_drafts() -> None:
    end = [7, 8]
    gate = ReasoningGate([5], end, prompt_ids=[1, 5])      # reasoning opened in the prompt
    grammar = _grammar(gate)
    bitmask = allocate_bitmask(6, VOCAB)
    rows = grammar.fill_rows(bitmask, 0, [3, 7, 8, 10, 11])
    # rows 0-2 come before the tag is complete; row 3 is the first answer position
    assert rows == [3, 4, 5]
    assert [_allowed(bitmask, r) for r in rows] == [{10}, {11}, {12}]
    assert all(_allowed(bitmask, r) == set(range(VOCAB)) for r in range(3))
    assert not gate.ended and grammar.matcher.tokens == []  # the gate itself did not move
    # the accepted tokens then reach the matcher through the gate, as before
    grammar.accept_tokens([3, 7, 8, 10])
    assert grammar.flush() and gate.ended and grammar.matcher.tokens == [10]
