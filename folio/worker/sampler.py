"""Turns one step's logits into next tokens, vectorized over the batch.

Every per-request knob is gathered into a per-row tensor so that each
processing step is a handful of batched tensor ops, and a step is skipped
entirely when no row in the batch uses it. Order of processing (vLLM's):

    raw logprobs (of the unprocessed logits)
    allowed_token_ids -> logit_bias -> bad_words -> min_tokens -> penalties
    greedy rows: argmax
    random rows: temperature -> min_p -> top_k -> top_p -> exponential race
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from folio.core.engine_core_outputs import SampledTokenLogprobs
from folio.core.step_messages import LogprobsLists
from folio.model.host_copy import device_tensor, to_device, to_host_async
from folio.model.kernels.sampling import argmax_rows, gumbel_sample
from folio.sampling_params import SamplingParams
from folio.worker.sampling_columns import SamplingColumns


@dataclass
class SamplingState:
    """What one request's sampling needs that is not a column (folio.worker.sampling_columns):
    its params (the logit processors read their lists), its own generator and its eos ids."""

    params: SamplingParams
    # Set when params.seed is not None. Owned by the request and advanced only
    # by its own sampling, so its tokens do not depend on batch composition.
    generator: torch.Generator | None = None
    # Masked (together with params.stop_token_ids) until min_tokens is reached.
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]
    logprobs: list[SampledTokenLogprobs | None]  # None where params.logprobs is None


class SamplePath(enum.Enum):
    """How `Sampler.sample` samples a batch (chosen by `choose_path`)."""

    # Every row greedy: the argmax of the model's logits (no float32 copy).
    ARGMAX = enum.auto()
    # Every row needs only a temperature (CUDA, with Triton): the fused Gumbel-max kernel.
    GUMBEL = enum.auto()
    # Some row needs a logit processor, a top-k/top-p/min-p filter or its own seeded
    # generator: processors, then `_sample` on a float32 copy.
    GENERAL = enum.auto()


@dataclass
class RowLogprobs:
    """Logprobs of the batch rows that asked for them."""

    rows: list[int]          # their rows in the batch, ascending
    tensors: LogprobsTensors  # one entry per row of `rows`, in that order


_NEG_INF = float("-inf")
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class Sampler:
    def __init__(self) -> None:
        # Key of the fused kernel's random stream (drawn from torch's generator, which the
        # worker seeds with the engine seed), and a per-call counter that moves it on.
        self._seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        self._calls = 0

    def __call__(self, logits: torch.Tensor, states: list[SamplingState],
                 columns: SamplingColumns) -> SamplerOutput:
        sampled, logprobs = self.sample(logits, states, columns)
        out_logprobs: list[SampledTokenLogprobs | None] = [None] * len(states)
        if logprobs is not None:
            for i, row in zip(logprobs.rows, logprobs.tensors.entries()):
                out_logprobs[i] = row
        return SamplerOutput(sampled_token_ids=sampled.tolist(), logprobs=out_logprobs)

    def sample(self, logits: torch.Tensor, states: list[SamplingState], columns: SamplingColumns,
               prev_sampled: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, RowLogprobs | None]:
        """The sampled ids as a device tensor and, when some rows asked for logprobs, those
        rows with their logprobs as tensors — nothing here waits for the device. Row i of the
        logits is states[i]'s and columns' row i. `prev_sampled`: the previous step's sampled
        ids, where rows with a pending row find their latest token (penalties and min_tokens
        count it)."""
        if logits.dim() != 2 or logits.shape[0] != len(states) or len(columns) != len(states):
            raise ValueError(
                f"logits must have shape [len(states), vocab], got {tuple(logits.shape)} "
                f"for {len(states)} states and {len(columns)} column rows"
            )
        params = [s.params for s in states]
        path = choose_path(logits, columns)
        if path is not SamplePath.GENERAL:
            return self._sample_plain(logits, params, columns, path)
        # Always work on a float32 copy: we modify in place and must not touch
        # the caller's tensor (it may be reused, e.g. for prompt logprobs).
        logits = logits.to(torch.float32, copy=True)

        # Logprobs report the raw model distribution, so take them first.
        raw = _raw_logprobs(logits, params)
        self._apply_processors(logits, states, columns,
                               _PendingTokens.of(columns, prev_sampled))
        sampled = _sample(logits, states, columns)
        return sampled, _with_sampled(raw, sampled, params)

    def _sample_plain(self, logits: torch.Tensor, params: list[SamplingParams],
                      columns: SamplingColumns,
                      path: SamplePath) -> tuple[torch.Tensor, RowLogprobs | None]:
        """Rows that need nothing but a temperature: the argmax (ARGMAX), or Gumbel-max in two
        kernel launches (GUMBEL), read straight from the model's logits (no float32 copy)."""
        if path is SamplePath.ARGMAX:
            sampled = argmax_rows(logits)
        else:
            self._calls += 1
            temperatures = np.where(columns.greedy, 0.0, columns.temperature).tolist()
            sampled = gumbel_sample(logits, temperatures, self._seed + self._calls * 0x9E3779B1)
        return sampled, _with_sampled(_raw_logprobs(logits, params), sampled, params)

    def process_logits(self, logits: torch.Tensor, states: list[SamplingState],
                       columns: SamplingColumns,
                       prev_sampled: torch.Tensor | None = None) -> torch.Tensor:
        """The logits after every request-level processor (allowed ids, bias,
        bad words, min_tokens, penalties) but before temperature/filters, as a
        new float32 tensor. Exposed for tests and for debugging."""
        logits = logits.to(torch.float32, copy=True)
        self._apply_processors(logits, states, columns, _PendingTokens.of(columns, prev_sampled))
        return logits

    @staticmethod
    def _apply_processors(logits: torch.Tensor, states: list[SamplingState],
                          columns: SamplingColumns, pending: _PendingTokens | None = None) -> None:
        if not columns.any_processors:
            return
        _apply_allowed_token_ids(logits, states)
        _apply_logit_bias(logits, states)
        _apply_bad_words(logits, states, columns)
        _apply_min_tokens(logits, states, columns, pending)
        _apply_penalties(logits, columns, pending)


@dataclass
class _RawLogprobs:
    """The rows that asked for logprobs, with their raw (unprocessed) logprobs."""

    rows: list[int]
    index: torch.Tensor     # `rows` on the device (int64)
    logprobs: torch.Tensor  # [len(rows), vocab] float32 log-softmax


def _raw_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> _RawLogprobs | None:
    """Float32 log-softmax of the rows whose request asked for logprobs (None if none did)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    index = device_tensor(rows, logits.device, torch.int64)
    return _RawLogprobs(rows, index, torch.log_softmax(
        logits.index_select(0, index).to(torch.float32), dim=-1))


def _with_sampled(raw: _RawLogprobs | None, sampled: torch.Tensor, params: list[SamplingParams]
                  ) -> RowLogprobs | None:
    """Those rows' logprobs of the sampled tokens and their top alternatives, as tensors."""
    if raw is None:
        return None
    tensors = _logprobs_tensors(raw.logprobs, sampled.index_select(0, raw.index),
                                [params[i].logprobs for i in raw.rows])
    return RowLogprobs(raw.rows, tensors)


class _PendingTokens:
    """The latest tokens of the rows whose host history lacks them (async scheduling), on the
    device: `tokens[position[i]]` is row i's."""

    def __init__(self, position: dict[int, int], tokens: torch.Tensor) -> None:
        self.position = position
        self.tokens = tokens

    @classmethod
    def of(cls, columns: SamplingColumns, prev_sampled: torch.Tensor | None
           ) -> "_PendingTokens | None":
        if prev_sampled is None:
            return None
        has_pending = columns.pending_row >= 0
        if not (has_pending & columns.needs_processors).any():
            return None
        rows = np.flatnonzero(has_pending)
        src = _column_tensor(columns.pending_row[rows], prev_sampled.device)
        return cls({int(i): j for j, i in enumerate(rows)}, prev_sampled.index_select(0, src))

    def add_to(self, counts: torch.Tensor, rows: list[int]) -> None:
        """counts[k, latest token of rows[k]] += 1 for the listed rows that have one pending."""
        ks = [k for k, i in enumerate(rows) if i in self.position]
        if not ks:
            return
        device = counts.device
        which = device_tensor([self.position[rows[k]] for k in ks], device, torch.int64)
        counts.index_put_((device_tensor(ks, device, torch.int64),
                           self.tokens.index_select(0, which)),
                          torch.ones(len(ks), dtype=counts.dtype, device=device), accumulate=True)


def _column_tensor(values: np.ndarray, device: torch.device,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """A column (or a slice of one) on the device, through pinned memory on CUDA."""
    host = torch.from_numpy(np.ascontiguousarray(values))
    if dtype is not None:
        host = host.to(dtype)
    return to_device(host, device)


# ---------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------


def compute_token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> list[SampledTokenLogprobs]:
    """Logprob and rank of token_ids[i] under row i of logits, plus the top
    `num_top` alternatives (-1 = whole vocabulary). Also used for prompt
    logprobs, where row i scores prompt token i + 1."""
    return token_logprobs_tensors(logits, token_ids, num_top).entries()


def token_logprobs_tensors(logits: torch.Tensor, token_ids: torch.Tensor,
                           num_top: int) -> LogprobsTensors:
    """`compute_token_logprobs`, left as tensors (see LogprobsTensors)."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return _logprobs_tensors(logprobs, token_ids.to(logits.device), [num_top] * logits.shape[0])


class LogprobsTensors:
    """Logprobs of some rows, still as tensors: the chosen tokens' logprobs and ranks and the
    top-k alternatives. `to_host()` queues their copies to pinned memory (no host wait), and
    `entries()` builds the per-row results once the copies are done — so a step that reports
    logprobs does not stop the host until its output is read."""

    def __init__(self, token_ids: torch.Tensor, token_logprobs: torch.Tensor,
                 ranks: torch.Tensor, top_logprobs: torch.Tensor | None,
                 top_ids: torch.Tensor | None, num_tops: list[int]) -> None:
        self.tensors = [token_ids, token_logprobs, ranks, top_logprobs, top_ids]
        self.num_tops = num_tops

    def to_host(self) -> None:
        """Queue device-to-host copies into pinned memory (CUDA); the caller records an
        event after them and waits for it before `entries()`."""
        self.tensors = [None if t is None else to_host_async(t) for t in self.tensors]

    def lists(self) -> LogprobsLists:
        """The rows as columns of host lists (the step message's form), once the copies are
        done: one conversion per tensor instead of one per element."""
        token_ids, token_lp, ranks, top_lp, top_ids = self.tensors
        token_list = token_ids.view(-1).tolist()
        rows = len(token_list)
        ks = self.num_tops
        if top_lp is not None:
            top_lp_list = [row[:k] for row, k in zip(top_lp.tolist(), ks)]
            top_ids_list = [row[:k] for row, k in zip(top_ids.tolist(), ks)]
        else:
            top_lp_list = [[] for _ in range(rows)]
            top_ids_list = [[] for _ in range(rows)]
        return LogprobsLists(token_list, token_lp.view(-1).tolist(), ranks.tolist(),
                             top_ids_list, top_lp_list)

    def entries(self) -> list[SampledTokenLogprobs]:
        lists = self.lists()
        return [SampledTokenLogprobs(*row) for row in zip(
            lists.token_ids, lists.logprobs, lists.ranks, lists.top_token_ids,
            lists.top_logprobs)]


def _logprobs_tensors(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_tops: list[int]
) -> LogprobsTensors:
    vocab = logprobs.shape[1]
    token_ids = token_ids.long().view(-1, 1)
    token_lp = logprobs.gather(1, token_ids)
    # Rank = 1 + number of tokens strictly more likely (ties share the rank).
    ranks = (logprobs > token_lp).sum(dim=-1) + 1
    ks = [vocab if k == -1 else min(k, vocab) for k in num_tops]
    k_max = max(ks, default=0)
    top_lp = top_ids = None
    if k_max > 0:
        top_lp, top_ids = logprobs.topk(k_max, dim=-1)  # sorted, best first
    return LogprobsTensors(token_ids, token_lp, ranks, top_lp, top_ids, ks)


# ---------------------------------------------------------------------------
# Logit processing (all in place on float32 logits)
# ---------------------------------------------------------------------------


def _index_fill(logits: torch.Tensor, rows: list[int], cols: list[int], value: float) -> None:
    """logits[rows[j], cols[j]] = value for all j, as one scatter."""
    if rows:
        device = logits.device
        logits.index_put_(
            (device_tensor(rows, device, torch.int64), device_tensor(cols, device, torch.int64)),
            torch.full((), value, dtype=logits.dtype, device=device),
        )


def _apply_allowed_token_ids(logits: torch.Tensor, states: list[SamplingState]) -> None:
    rows = [i for i, s in enumerate(states) if s.params.allowed_token_ids is not None]
    if not rows:
        return
    # Ban everything in the restricted rows, then un-ban the allowed ids.
    banned = torch.zeros_like(logits, dtype=torch.bool)
    banned[rows] = True
    r = [i for i in rows for _ in states[i].params.allowed_token_ids]
    c = [t for i in rows for t in states[i].params.allowed_token_ids]
    _check_cols(c, logits.shape[1], "allowed_token_ids")
    _index_fill(banned, r, c, False)
    logits.masked_fill_(banned, _NEG_INF)


def _apply_logit_bias(logits: torch.Tensor, states: list[SamplingState]) -> None:
    r, c, v = [], [], []
    for i, s in enumerate(states):
        for tok, bias in (s.params.logit_bias or {}).items():
            r.append(i)
            c.append(tok)
            v.append(bias)
    if not r:
        return
    _check_cols(c, logits.shape[1], "logit_bias")
    device = logits.device
    logits.index_put_(
        (device_tensor(r, device, torch.int64), device_tensor(c, device, torch.int64)),
        device_tensor(v, device, logits.dtype),
        accumulate=True,
    )


def _apply_bad_words(logits: torch.Tensor, states: list[SamplingState],
                     columns: SamplingColumns) -> None:
    # Deciding which tokens to ban depends on each row's recent history, which
    # is plain Python; the ban itself is one scatter for the whole batch. (A request with bad
    # words is never scheduled ahead of its sampled token: its host history is complete.)
    r, c = [], []
    for i, s in enumerate(states):
        words = s.params.bad_words_token_ids
        if not words:
            continue
        out = columns.history([i], outputs_only=True, pad=-1)[0]
        out = out[:columns.num_tokens[i] - columns.num_prompt_tokens[i]].tolist()
        for seq in words:
            prefix_len = len(seq) - 1
            if prefix_len > len(out):
                continue
            if prefix_len == 0 or out[len(out) - prefix_len :] == seq[:-1]:
                r.append(i)
                c.append(seq[-1])
    _check_cols(c, logits.shape[1], "bad_words")
    _index_fill(logits, r, c, _NEG_INF)


def _apply_min_tokens(logits: torch.Tensor, states: list[SamplingState],
                      columns: SamplingColumns, pending: _PendingTokens | None = None) -> None:
    vocab = logits.shape[1]
    num_output = (columns.num_tokens - columns.num_prompt_tokens).tolist()
    r, c = [], []
    for i, s in enumerate(states):
        if s.params.min_tokens <= 0:
            continue
        n = num_output[i] + (1 if pending and i in pending.position else 0)
        if n < s.params.min_tokens:
            for tok in {*s.eos_token_ids, *(s.params.stop_token_ids or ())}:
                if 0 <= tok < vocab:  # eos ids of padded vocabs may be out of range
                    r.append(i)
                    c.append(tok)
    _index_fill(logits, r, c, _NEG_INF)


def _token_counts(history: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] occurrence counts of a padded history, built with one scatter_add.

    Rows are padded with the id `vocab`, which lands in a spare column that is dropped
    afterwards, so no masking of padding is needed.
    """
    padded = _column_tensor(history, device, torch.int64)
    counts = torch.zeros(history.shape[0], vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def _apply_penalties(logits: torch.Tensor, columns: SamplingColumns,
                     pending: _PendingTokens | None = None) -> None:
    vocab, device = logits.shape[1], logits.device

    rep_rows = np.flatnonzero(columns.repetition_penalty != 1.0).tolist()
    if rep_rows:
        seen_counts = _token_counts(columns.history(rep_rows, False, vocab), vocab, device)
        if pending is not None:
            pending.add_to(seen_counts, rep_rows)
        seen = seen_counts > 0
        penalty = _column_tensor(columns.repetition_penalty[rep_rows], device,
                                 torch.float32).unsqueeze(1)
        sub = logits[rep_rows]
        # Dividing a positive logit / multiplying a negative one both make the
        # token less likely when penalty > 1 (more likely when < 1).
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[rep_rows] = torch.where(seen, penalised, sub)

    add_rows = np.flatnonzero((columns.frequency_penalty != 0.0)
                              | (columns.presence_penalty != 0.0)).tolist()
    if add_rows:
        counts = _token_counts(columns.history(add_rows, True, vocab), vocab, device)
        if pending is not None:
            pending.add_to(counts, add_rows)
        freq = _column_tensor(columns.frequency_penalty[add_rows], device, torch.float32)
        pres = _column_tensor(columns.presence_penalty[add_rows], device, torch.float32)
        logits[add_rows] -= freq.unsqueeze(1) * counts + pres.unsqueeze(1) * (counts > 0).float()


def _check_cols(cols: list[int], vocab: int, name: str) -> None:
    # update_from_tokenizer validates against the tokenizer vocab; the model's
    # logits may be narrower, and an out-of-range index would crash the step
    # with an opaque indexing error, so fail with the field name instead.
    if cols and (max(cols) >= vocab or min(cols) < 0):
        raise ValueError(f"{name} contains token ids outside the logits vocabulary [0, {vocab})")


# ---------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------


def choose_path(logits: torch.Tensor, columns: SamplingColumns) -> SamplePath:
    """ARGMAX when every row is greedy, GUMBEL when every row only needs a temperature (on
    CUDA, with Triton), GENERAL when some row needs a logit processor, a top-k/top-p/min-p
    filter, or its own seeded generator (whose stream must not depend on the batch)."""
    if columns.any_processors:
        return SamplePath.GENERAL
    if columns.all_greedy:
        return SamplePath.ARGMAX
    plain = not columns.any_filtered_random
    # The kernel numbers its random draws row * vocab + token in 32 bits.
    if plain and logits.is_cuda and _has_triton() and logits.shape[0] * logits.shape[1] < 2**31:
        return SamplePath.GUMBEL
    return SamplePath.GENERAL


def _has_triton() -> bool:
    from folio.model.kernels._common import HAS_TRITON
    return HAS_TRITON


def _sample(logits: torch.Tensor, states: list[SamplingState],
            columns: SamplingColumns) -> torch.Tensor:
    vocab = logits.shape[1]
    device = logits.device
    greedy = columns.greedy

    if columns.all_greedy:
        return argmax_rows(logits)
    sampled = argmax_rows(logits) if greedy.any() else None

    random_rows = np.flatnonzero(~greedy)
    all_random = sampled is None
    random_index = None if all_random else _column_tensor(random_rows, device, torch.int64)
    # Every row random (the common batch): work on the logits themselves, no gather.
    sub = logits if all_random else logits.index_select(0, random_index)
    # At most float32's largest value: an infinite divisor would turn the banned tokens'
    # -inf into NaN (and the draw into token 0, banned or not).
    temperature = np.minimum(columns.temperature[random_rows], _FLOAT32_MAX)
    if (temperature != 1.0).any():
        sub.div_(_column_tensor(temperature, device, torch.float32).unsqueeze(1))
    apply_min_p(sub, columns.min_p[random_rows])
    apply_top_k_top_p(sub, columns.top_k[random_rows], columns.top_p[random_rows])
    probs = torch.softmax(sub, dim=-1)

    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with
    # probability p_i, and lets each row draw its noise from its own generator.
    noise = torch.empty_like(probs)
    seeded = columns.seeded[random_rows]
    if not seeded.any():
        noise.exponential_()
    else:
        unseeded = np.flatnonzero(~seeded).tolist()
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), vocab, device=device).exponential_()
        for j in np.flatnonzero(seeded).tolist():
            gen = states[int(random_rows[j])].generator
            noise[j] = torch.empty(vocab, device=device).exponential_(generator=gen)
    # exponential_ can in principle return 0; keep the division finite.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    random_tokens = (probs / noise).argmax(dim=-1)

    if sampled is None:
        return random_tokens
    sampled.index_copy_(0, random_index, random_tokens)
    return sampled


def apply_min_p(logits: torch.Tensor, min_p: np.ndarray) -> None:
    """In place: drop tokens whose probability is below min_p[i] times row i's top
    probability."""
    if not (min_p > 0.0).any():
        return
    threshold_scale = _column_tensor(min_p, logits.device, torch.float32)
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1) * threshold_scale
    logits.masked_fill_(probs < threshold.unsqueeze(1), _NEG_INF)


# Largest top_k for which top-p runs on the top-k candidates instead of a full sort.
_SUBSET_TOP_P_MAX_K = 4096


def _top_k_top_p_on_candidates(logits: torch.Tensor, ks: np.ndarray, top_ps: np.ndarray,
                               k_max: int) -> None:
    """In place, every row with a top-k: the same set as the full-sort path — the top k_i
    logits (ties with the k-th kept), then the smallest high-probability set of those whose
    mass reaches top_p — found among the row's top k_max values. The result is applied as a
    threshold on the whole row (tokens below the lowest kept value are dropped)."""
    device = logits.device
    values = logits.topk(k_max, dim=-1).values  # descending
    k = _column_tensor(ks, device, torch.int64).unsqueeze(1)
    kth = values.gather(1, k - 1)
    ascending = values.flip(-1)
    ascending = ascending.masked_fill(ascending < kth, _NEG_INF)  # top-k, ties kept
    top_p = _column_tensor(top_ps, device, torch.float32).unsqueeze(1)
    cum = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
    drop = cum <= 1.0 - top_p
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, _NEG_INF)
    lowest_kept = torch.where(torch.isinf(ascending), torch.inf, ascending).amin(-1, keepdim=True)
    logits.masked_fill_(logits < lowest_kept, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray) -> None:
    """In place: keep each row's top_k[i] logits (ties kept; 0 or -1 = off), then the
    smallest high-probability set whose mass reaches top_p[i]."""
    vocab = logits.shape[1]
    device = logits.device
    # top_k off (0 or -1) or >= vocab keeps everything: treat as k = vocab.
    ks = np.where((top_k > 0) & (top_k < vocab), top_k, vocab).astype(np.int64)
    need_k = bool((ks < vocab).any())
    need_p = bool((top_p < 1.0).any())
    if not need_k and not need_p:
        return

    k_max = int(ks.max())
    if not need_p:
        # Only top-k: a partial topk is much cheaper than a full sort.
        top_vals = logits.topk(k_max, dim=-1).values  # best first
        k_idx = _column_tensor(ks - 1, device, torch.int64).unsqueeze(1)
        kth = top_vals.gather(1, k_idx)
        # Ties with the k-th value are kept; rows without top-k use k = vocab,
        # whose k-th value is the row minimum, so nothing is removed there.
        logits.masked_fill_(logits < kth, _NEG_INF)
        return

    if need_k and k_max < vocab and k_max <= _SUBSET_TOP_P_MAX_K:
        # Every row has a top-k (Qwen3's and many models' defaults: top_k 20, top_p 0.95):
        # top-p only ever looks at those k candidates, so sort k_max values, not the vocabulary.
        _top_k_top_p_on_candidates(logits, ks, top_p, k_max)
        return

    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if need_k:
        k = _column_tensor(ks, device, torch.int64).unsqueeze(1)
        kth = sorted_logits.gather(1, vocab - k)
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    top_p_t = _column_tensor(top_p, device, torch.float32).unsqueeze(1)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # Drop the low tail whose total mass is at most 1 - top_p; the most likely
    # token is always kept so the row can never be emptied.
    drop = cum <= 1.0 - top_p_t
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    logits.scatter_(1, order, sorted_logits)
