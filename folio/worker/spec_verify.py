"""Verification of draft tokens (speculative decoding): one request's target logits at its
last token and each draft, [k + 1, vocab], give the tokens it keeps.

- Greedy: the drafts up to the first that differs from the target's argmax, then that argmax
  (or, all accepted, the argmax after the last draft): token for token what decoding one
  token per step gives.
- Random: the drafting proposers here give no probabilities (n-gram lookup: a draft is a
  deterministic guess), so the rule is speculative sampling's with the proposal a point mass
  q = δ(d): draft d is accepted with probability min(1, p(d) / q(d)) = p(d), p the target's
  distribution after temperature, min-p, top-k and top-p (as `sampler._sample` computes
  it); on rejection the token is drawn from the residual max(p - q, 0), i.e. p without d,
  renormalised; all accepted, one more is drawn from p after the last draft. Each emitted
  token is then distributed exactly as one-token-per-step sampling would give it. A seeded
  request draws from its own generator.
"""
from __future__ import annotations

import numpy as np
import torch

from folio.worker.sampler import SamplingState, apply_min_p, apply_top_k_top_p
from folio.worker.sampling_columns import SamplingColumns

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def target_probs(logits: torch.Tensor, columns: SamplingColumns, row: int) -> torch.Tensor:
    """Softmax of `logits` [n, vocab] under sampling row `row`'s temperature and filters
    (float32), each of the n positions filtered on its own."""
    n = logits.shape[0]
    x = logits.to(torch.float32, copy=True)
    temperature = min(float(columns.temperature[row]), _FLOAT32_MAX)
    if temperature != 1.0:
        x.div_(temperature)
    apply_min_p(x, np.repeat(columns.min_p[row:row + 1], n))
    apply_top_k_top_p(x, np.repeat(columns.top_k[row:row + 1], n),
                      np.repeat(columns.top_p[row:row + 1], n))
    return torch.softmax(x, dim=-1)


def verify(logits: torch.Tensor, drafts: list[int], state: SamplingState,
           columns: SamplingColumns, row: int) -> list[int]:
    """The tokens one request keeps from a verify step: logits [len(drafts) + 1, vocab] (the
    target's at its last token, then after each draft); `columns` row `row` is its
    sampling row."""
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need {k + 1} rows of logits, got {logits.shape[0]}")
    if columns.greedy[row]:
        target = logits.argmax(dim=-1).tolist()
        out: list[int] = []
        for j, draft in enumerate(drafts):
            if draft != target[j]:
                break
            out.append(draft)
        out.append(target[len(out)])
        return out
    return sample_verified(target_probs(logits, columns, row), drafts, state.generator)


def sample_verified(probs: torch.Tensor, drafts: list[int],
                    gen: torch.Generator | None = None) -> list[int]:
    """The sampled rule on the target's distributions probs [len(drafts) + 1, vocab]."""
    k = len(drafts)
    device = probs.device
    draft_t = torch.tensor(drafts, dtype=torch.int64, device=device)
    p_draft = probs[torch.arange(k, device=device), draft_t] if k else probs[:0, 0]
    uniforms = torch.rand(k, generator=gen, device=device) if k else p_draft
    accepted = (uniforms < p_draft).tolist() if k else []
    out = []
    for j in range(k):
        if not accepted[j]:
            residual = probs[j].clone()
            residual[drafts[j]] = 0.0
            if float(residual.sum()) <= 0.0:   # p was all on the draft: it stands
                out.append(drafts[j])
                continue
            out.append(int(torch.multinomial(residual, 1, generator=gen).item()))
            return out
        out.append(drafts[j])
    out.append(int(torch.multinomial(probs[k], 1, generator=gen).item()))
    return out
