"""Which requests speculate, and how many draft tokens each step carries.

A request speculates when the verification step can honour everything its sampling asks for:
this first version verifies greedy and random sampling with temperature, top-k, top-p, min-p
and seeds; requests with logprobs, logit processors (penalties, logit bias, bad words,
allowed ids, min_tokens) or a grammar decode one token per step as before.
"""
from __future__ import annotations

from folio.sampling_params import SamplingParams


def speculation_supported(params: SamplingParams, has_grammar: bool) -> bool:
    if has_grammar or params.logprobs is not None:
        return False
    return not (params.allowed_token_ids is not None or params.logit_bias
                or params.bad_words_token_ids or params.min_tokens > 0
                or params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
                or params.presence_penalty != 0.0)
