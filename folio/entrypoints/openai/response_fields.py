"""The engine's per-token and per-request numbers as OpenAI response fields: logprobs (the
legacy completions format, chat's, and vLLM's prompt_logprobs extra) and usage."""
from __future__ import annotations

import math
from typing import Any, Sequence

from folio.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionTopLogprob,
    CompletionLogProbs,
    PromptTokensDetails,
    UsageInfo,
)
from folio.request_outputs import Logprob, PositionLogprobs

# JSON has no -inf; OpenAI reports impossible tokens with this floor.
_MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float:
    if math.isnan(value):
        return _MIN_LOGPROB
    return max(value, _MIN_LOGPROB)


def token_text(tokenizer: Any, token_id: int, entry: Logprob | None = None) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id])


def _top_entries(position: PositionLogprobs, limit: int) -> list[tuple[int, Logprob]]:
    """The position's alternatives with rank <= limit, best first."""
    ranked = [(tid, lp) for tid, lp in position.items()
              if lp.rank is not None and lp.rank <= limit]
    ranked.sort(key=lambda item: item[1].rank)
    return ranked[:limit]


def completion_logprobs(token_ids: Sequence[int],
                        positions: Sequence[PositionLogprobs | None],
                        tokenizer: Any, *, num_top: int, initial_offset: int = 0
                        ) -> tuple[CompletionLogProbs, int]:
    """OpenAI's legacy completions format. A None position (the first prompt token, which
    has nothing to condition on) gets null logprobs, as OpenAI's echo does. Returns the
    logprobs and the text offset after the last token (for the next stream chunk)."""
    result = CompletionLogProbs()
    offset = initial_offset
    for tid, position in zip(token_ids, positions):
        entry = position.get(tid) if position is not None else None
        text = token_text(tokenizer, tid, entry)
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(text)
        if position is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(clamp_logprob(entry.logprob) if entry is not None else None)
        top: dict[str, float] = {}
        for alt_id, alt in _top_entries(position, num_top):
            top.setdefault(token_text(tokenizer, alt_id, alt), clamp_logprob(alt.logprob))
        if entry is not None:
            # OpenAI always lists the chosen token among the top alternatives.
            top.setdefault(text, clamp_logprob(entry.logprob))
        result.top_logprobs.append(top)
    return result, offset


def _chat_logprob(tokenizer: Any, tid: int, entry: Logprob | None) -> ChatCompletionTopLogprob:
    text = token_text(tokenizer, tid, entry)
    logprob = clamp_logprob(entry.logprob) if entry is not None else _MIN_LOGPROB
    return ChatCompletionTopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs] | None,
                  tokenizer: Any, *, num_top: int) -> ChatCompletionLogProbs:
    content: list[ChatCompletionLogProbsContent] = []
    for tid, position in zip(token_ids, positions or []):
        chosen = _chat_logprob(tokenizer, tid, position.get(tid))
        top = [_chat_logprob(tokenizer, alt_id, alt)
               for alt_id, alt in _top_entries(position, num_top)]
        content.append(ChatCompletionLogProbsContent(**chosen.model_dump(), top_logprobs=top))
    return ChatCompletionLogProbs(content=content)


def prompt_logprobs_json(prompt_logprobs: Sequence[PositionLogprobs | None] | None
                         ) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs extra: per prompt token None or {token_id: {logprob, rank,
    decoded_token}}."""
    if prompt_logprobs is None:
        return None
    out: list[dict[str, Any] | None] = []
    for position in prompt_logprobs:
        if position is None:
            out.append(None)
            continue
        out.append({str(tid): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                               "decoded_token": lp.decoded_token}
                    for tid, lp in position.items()})
    return out


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))
