"""One step's sampling parameters as columns: a numpy array per knob, one entry per sampling
row, gathered from the persistent batch's per-row arrays (`InputBatch.sampling_columns`) with
one fancy index each, so the sampler decides its path and builds its per-row tensors from
arrays instead of walking request objects.

Also the token history the penalties read: a table of token rows (the batch's own
`token_ids` array) and, per sampling row, which table row is its and how many of its tokens
are prompt and known. It is sliced only when some row has a penalty.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from folio.sampling_params import SAMPLING_EPS, SamplingParams

# Scalar knobs stored per row: name -> numpy dtype. The values are SamplingParams' own
# (top_k 0 or -1 = off; temperature 0 = greedy), kept at Python's width (float64, int64) so
# that a column compares exactly as the param does (top_p 0.99999999 is not 1.0) and no valid
# value overflows; tensors are built from them in the dtype each op wants.
SCALAR_COLUMNS: dict[str, type] = {
    "temperature": np.float64,
    "top_k": np.int64,
    "top_p": np.float64,
    "min_p": np.float64,
    "repetition_penalty": np.float64,
    "frequency_penalty": np.float64,
    "presence_penalty": np.float64,
}


def needs_processors(p: SamplingParams) -> bool:
    """Whether a request needs a logit processor (allowed ids, bias, bad words, min_tokens,
    penalties): each processor walks its rows in Python, so a batch where no row needs one
    skips them all."""
    return bool(p.allowed_token_ids is not None or p.logit_bias or p.bad_words_token_ids
                or p.min_tokens > 0 or p.repetition_penalty != 1.0
                or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)


def row_values(p: SamplingParams) -> dict[str, float | int]:
    """One request's entries of the scalar columns."""
    return {name: getattr(p, name) for name in SCALAR_COLUMNS}


@dataclass
class SamplingColumns:
    """The sampling rows of one step, as columns (row i = the step's i-th sampling request)."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    repetition_penalty: np.ndarray
    frequency_penalty: np.ndarray
    presence_penalty: np.ndarray
    # The request has its own seeded generator (its noise must not depend on the batch).
    seeded: np.ndarray
    needs_processors: np.ndarray
    # Async scheduling: the row's latest token is still on the device, in this row of the
    # previous step's sampled ids (-1: the host's token history is complete).
    pending_row: np.ndarray
    # Token history: row i's tokens are token_table[token_rows[i], :num_tokens[i]], the first
    # num_prompt_tokens[i] of them the prompt.
    token_table: np.ndarray
    token_rows: np.ndarray
    num_prompt_tokens: np.ndarray
    num_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.temperature)

    # Derived from the scalar columns only, so a copy for the next step of the same rows
    # (`for_next_step`) keeps them.
    @functools.cached_property
    def greedy(self) -> np.ndarray:
        """Rows sampled by argmax (SamplingParams.is_greedy)."""
        return self.temperature < SAMPLING_EPS

    @functools.cached_property
    def any_processors(self) -> bool:
        return bool(self.needs_processors.any())

    @functools.cached_property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())

    @functools.cached_property
    def any_filtered_random(self) -> bool:
        """Some random row needs more than a temperature: a top-k/top-p/min-p filter or its
        own generator."""
        filtered = (self.seeded | ((self.top_k != 0) & (self.top_k != -1))
                    | (self.top_p < 1.0) | (self.min_p > 0.0))
        return bool((filtered & ~self.greedy).any())

    def for_next_step(self, num_tokens: np.ndarray, pending_row: np.ndarray
                      ) -> "SamplingColumns":
        """The same rows one step on: new token counts and pending rows, the rest shared."""
        nxt = copy.copy(self)
        nxt.num_tokens = num_tokens
        nxt.pending_row = pending_row
        return nxt

    def history(self, rows: Sequence[int], outputs_only: bool, pad: int) -> np.ndarray:
        """[len(rows), width] token ids of those rows (all tokens, or the output tokens only),
        left-aligned and padded with `pad`."""
        sel = np.asarray(rows, dtype=np.int64)
        start = self.num_prompt_tokens[sel] if outputs_only else np.zeros(len(sel), np.int64)
        end = self.num_tokens[sel]
        width = int((end - start).max(initial=0))
        out = np.full((len(sel), max(width, 1)), pad, dtype=np.int64)
        if width:
            cols = start[:, None] + np.arange(width)[None, :]
            valid = cols < end[:, None]
            table_rows = self.token_rows[sel]
            gathered = self.token_table[table_rows[:, None], np.minimum(
                cols, self.token_table.shape[1] - 1)]
            out[:, :width] = np.where(valid, gathered, pad)
        return out

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams],
                    token_lists: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
                    seeded: Sequence[bool] | None = None,
                    pending_row: Sequence[int | None] | None = None) -> "SamplingColumns":
        """Columns built straight from requests (tests, warm-up): `token_lists` gives each
        row's (prompt, output) tokens."""
        n = len(params)
        scalars = {name: np.fromiter((getattr(p, name) for p in params), dtype, n)
                   for name, dtype in SCALAR_COLUMNS.items()}
        lists = token_lists or [((), ())] * n
        num_prompt = np.fromiter((len(pr) for pr, _ in lists), np.int64, n)
        num_tokens = num_prompt + np.fromiter((len(o) for _, o in lists), np.int64, n)
        table = np.zeros((n, max(int(num_tokens.max(initial=0)), 1)), dtype=np.int32)
        for i, (prompt, output) in enumerate(lists):
            table[i, :len(prompt)] = prompt
            table[i, len(prompt):num_tokens[i]] = output
        return cls(
            **scalars,
            seeded=np.asarray(seeded if seeded is not None else [False] * n, dtype=bool),
            needs_processors=np.fromiter((needs_processors(p) for p in params), bool, n),
            pending_row=np.fromiter(
                ((-1 if r is None else r) for r in (pending_row or [None] * n)), np.int64, n),
            token_table=table, token_rows=np.arange(n, dtype=np.int64),
            num_prompt_tokens=num_prompt, num_tokens=num_tokens)
