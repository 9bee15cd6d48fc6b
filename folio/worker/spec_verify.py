"""Verification of draft tokens (speculative decoding): one request's target logits at its
last token and each draft, [k + 1, vocab], give the tokens it keeps.

The logit processors (allowed ids, logit bias, bad words, min_tokens, penalties) run first,
the sampler's own, on one row per position whose history is the request's tokens and the
drafts before it.
- Greedy: the drafts up to the first that differs from the target's argmax, then that argmax
  (or, all accepted, the argmax after the last draft): token for token what decoding one
  token per step gives.
- Random: each position's token is drawn from p (the target's distribution after
  temperature, min-p, top-k and top-p, as `sampler._sample` computes it) exactly as the
  sampler draws it — an exponential race with the request's own generator if it is seeded —
  and the drafts are kept while they equal the drawn tokens. For a deterministic guess (the
  n-gram and suffix proposers give no probabilities) a draft d is then kept with probability
  p(d), what speculative sampling's accept/resample rule with a point-mass proposal gives,
  and every emitted token is an exact draw from p. One noise vector is drawn per emitted
  token, as without speculation, so a seeded request's tokens are the same with
  speculation on or off, whatever the number of drafts a step verified.
"""
from __future__ import annotations

import numpy as np
import torch

from folio.model.kernels.sampling import argmax_rows
from folio.worker.sampler import Sampler, SamplingState, apply_min_p, apply_top_k_top_p
from folio.worker.sampling_columns import SamplingColumns, needs_processors

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def target_probs(logits: torch.Tensor, columns: SamplingColumns, row: int) -> torch.Tensor:
    """Softmax of `logits` [n, vocab] under sampling row `row`'s temperature and filters
    (float32), each of the n positions filtered on its own."""
    n = logits.shape[0]
    x = logits.to(torch.float32, copy=True)
    temperature = min(float(columns.temperature[row]), _FLOAT32_MAX)
    if temperature != 1.0:   # divided by a float32 value, as the sampler's column divides
        x.div_(torch.tensor(temperature, dtype=torch.float32, device=x.device))
    apply_min_p(x, np.repeat(columns.min_p[row:row + 1], n))
    apply_top_k_top_p(x, np.repeat(columns.top_k[row:row + 1], n),
                      np.repeat(columns.top_p[row:row + 1], n))
    return torch.softmax(x, dim=-1)


def verify(logits: torch.Tensor, drafts: list[int], state: SamplingState,
           columns: SamplingColumns, row: int, history: np.ndarray | None = None,
           num_prompt_tokens: int = 0) -> list[int]:
    """The tokens one request keeps from a verify step: logits [len(drafts) + 1, vocab] (the
    target's at its last token, then after each draft); `columns` row `row` is its
    sampling row. A request with logit processors also needs its tokens so far (`history`,
    the first `num_prompt_tokens` of them the prompt)."""
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need {k + 1} rows of logits, got {logits.shape[0]}")
    params = state.params
    if needs_processors(params):
        if history is None:
            raise ValueError("a request with logit processors needs its token history")
        # Position j sees the request's tokens and the drafts before it: the sampler's own
        # processors run on one row per position, each with that history (penalties, bad
        # words and min_tokens count it), on a float32 copy.
        prompt = history[:num_prompt_tokens].tolist()
        outputs = history[num_prompt_tokens:].tolist()
        positions = SamplingColumns.from_params(
            [params] * (k + 1), token_lists=[(prompt, outputs + drafts[:j]) for j in range(k + 1)])
        logits = logits.to(torch.float32, copy=True)
        Sampler._apply_processors(logits, [state] * (k + 1), positions)
    if columns.greedy[row]:
        return accept_greedy(drafts, argmax_rows(logits).tolist())
    return sample_verified(target_probs(logits, columns, row), drafts, state.generator)


def needs_own_pass(state: SamplingState, columns: SamplingColumns, row: int) -> bool:
    """Whether a request's verification needs `verify` (random sampling or logit
    processors); the others are greedy on the logits as they are, and a whole step's argmax
    can serve them all at once (`accept_greedy`)."""
    return not columns.greedy[row] or needs_processors(state.params)


def accept_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """The greedy rule: `target` holds the argmax at the last token and after each draft;
    the drafts are kept up to the first that differs from it, then the argmax there."""
    out: list[int] = []
    for j, draft in enumerate(drafts):
        if draft != target[j]:
            break
        out.append(draft)
    out.append(target[len(out)])
    return out


def sample_verified(probs: torch.Tensor, drafts: list[int],
                    gen: torch.Generator | None = None) -> list[int]:
    """The sampled rule on the target's distributions probs [len(drafts) + 1, vocab]: each
    position's token is drawn as the sampler draws it (an exponential race, argmax of
    p / E with E ~ Exp(1) from the request's generator or the global one), one position at a
    time while the drafts match, so exactly as many noise vectors are consumed as tokens are
    emitted (a seeded request's tokens then equal its tokens without speculation; an
    unseeded one draws every position at once)."""
    k = len(drafts)
    vocab = probs.shape[1]
    tiny = torch.finfo(torch.float32).tiny
    if gen is None:
        # Unseeded: nothing to reproduce, so every position's race is drawn at once and
        # read in one copy (the loop below waits on the device once per emitted token);
        # each emitted token is still an exact draw from its position's p.
        noise = torch.empty_like(probs, dtype=torch.float32).exponential_().clamp_min_(tiny)
        return accept_greedy(drafts, (probs / noise).argmax(dim=-1).tolist())
    out: list[int] = []
    for j in range(k + 1):
        noise = torch.empty(vocab, device=probs.device).exponential_(generator=gen)
        token = int((probs[j] / noise.clamp_min_(tiny)).argmax())
        out.append(token)
        if j == k or token != drafts[j]:
            break
    return out
