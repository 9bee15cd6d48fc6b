"""Engine-core outputs (token ids) to RequestOutputs (text, logprobs, finish reasons).

Detokenization and stop strings live here, in the front end: the core never sees text. A stop
string found here finishes the request; the caller tells the core to free it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from folio.core.engine_core_outputs import EngineCoreOutput
from folio.engine.detokenizer import IncrementalDetokenizer
from folio.core.step_messages import PooledData
from folio.request_outputs import (CompletionOutput, Logprob, PoolingOutput,
                                   PoolingRequestOutput, PositionLogprobs, RequestMetrics,
                                   RequestOutput)
from folio.sampling_params import RequestOutputKind, SamplingParams


class TokenTextCache:
    """Decoded text of single tokens, for logprob entries (decoding is slow; vocabularies are
    finite)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


def to_position_logprobs(entry: Any, token_text: TokenTextCache | None) -> PositionLogprobs:
    """SampledTokenLogprobs -> {token_id: Logprob}: the top-k, plus the chosen token."""
    def text(tid: int) -> str | None:
        return token_text(tid) if token_text is not None else None
    result: PositionLogprobs = {}
    for rank, (tid, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1):
        result[tid] = Logprob(lp, rank, text(tid))
    if entry.token_id not in result:
        result[entry.token_id] = Logprob(entry.logprob, entry.rank, text(entry.token_id))
    return result


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    children: list["ChildState"] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


@dataclass
class ChildState:
    request_id: str
    index: int
    parent: ParentState
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens_sent: int = 0
    updated: bool = False


@dataclass
class PoolingState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    task: str | None


def pooled_array(pooled: PooledData) -> np.ndarray:
    """The worker's float32 bytes as an array of their shape (a read-only view, no copy)."""
    return np.frombuffer(pooled.data, dtype="<f4").reshape(pooled.shape)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_text = TokenTextCache(tokenizer)
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, ChildState] = {}
        # Pooling requests: one result each, no children, no text.
        self.pooling: dict[str, PoolingState] = {}

    def add_pooling_request(self, request_id: str, prompt: str | None,
                            prompt_token_ids: list[int], arrival_time: float,
                            task: str | None = None) -> None:
        self.pooling[request_id] = PoolingState(request_id, prompt, prompt_token_ids,
                                                RequestMetrics(arrival_time), task)

    def _pooling_output(self, state: PoolingState, out: EngineCoreOutput,
                        now: float) -> PoolingRequestOutput:
        self.pooling.pop(state.request_id, None)
        metrics = state.metrics
        metrics.first_scheduled_time = out.first_scheduled_time
        metrics.first_token_time = metrics.last_token_time = metrics.finished_time = now
        data = None if out.pooling_output is None else PoolingOutput(
            pooled_array(out.pooling_output))
        return PoolingRequestOutput(state.request_id, data, state.prompt_token_ids, True,
                                    state.prompt, out.finish_reason, metrics,
                                    out.num_cached_tokens, state.task)

    def add_request(self, parent_id: str, child_ids: list[str], prompt: str | None,
                    prompt_token_ids: list[int], params: list[SamplingParams],
                    arrival_time: float) -> None:
        parent = ParentState(parent_id, prompt, prompt_token_ids, params[0],
                             RequestMetrics(arrival_time))
        if params[0].prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        for index, (child_id, child_params) in enumerate(zip(child_ids, params)):
            detok = None
            if child_params.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids,
                    skip_special_tokens=child_params.skip_special_tokens,
                    spaces_between_special_tokens=child_params.spaces_between_special_tokens,
                    stop=child_params.stop, include_stop_str_in_output=child_params.include_stop_str_in_output,
                    stream_holdback=child_params.output_kind == RequestOutputKind.DELTA,
                    min_tokens=child_params.min_tokens)
            child = ChildState(child_id, index, parent, child_params, detok,
                               logprobs=[] if child_params.logprobs is not None else None,
                               cumulative_logprob=0.0 if child_params.logprobs is not None else None)
            parent.children.append(child)
            self.children[child_id] = child
        self.parents[parent_id] = parent

    def parent_id(self, request_id: str) -> str:
        """The client's request id of a core request (a child of n > 1), else the id."""
        child = self.children.get(request_id)
        return request_id if child is None else child.parent.request_id

    def abort(self, parent_id: str) -> list[str]:
        """Forget a request; returns the child ids the core must abort."""
        if self.pooling.pop(parent_id, None) is not None:
            return [parent_id]
        parent = self.parents.pop(parent_id, None)
        if parent is None:
            return []
        ids = []
        for child in parent.children:
            self.children.pop(child.request_id, None)
            if child.finish_reason is None:
                ids.append(child.request_id)
        return ids

    def process(self, core_outputs: list[EngineCoreOutput]
                ) -> tuple[list[RequestOutput | PoolingRequestOutput], list[str]]:
        """Returns the request outputs to hand out and the child ids that a stop string
        finished (the core must free them)."""
        now = time.monotonic()
        stopped_by_text: list[str] = []
        touched: dict[str, ParentState] = {}
        pooled: list[PoolingRequestOutput] = []
        for out in core_outputs:
            child = self.children.get(out.request_id)
            if child is None:
                state = self.pooling.get(out.request_id)
                if state is not None and out.finish_reason is not None:
                    pooled.append(self._pooling_output(state, out, now))
                continue  # else aborted meanwhile
            parent = child.parent
            # A final-only request has nothing to hand out until a child finishes: skip the
            # per-step output building for it (at batch 256 that was most of this loop).
            if parent.params.output_kind is not RequestOutputKind.FINAL_ONLY or \
                    out.finish_reason is not None:
                touched[parent.request_id] = parent
            if out.new_prompt_logprobs is not None and parent.prompt_logprobs is not None:
                chunk = out.new_prompt_logprobs
                for offset, entry in enumerate(chunk.entries):
                    parent.prompt_logprobs[chunk.start + offset] = to_position_logprobs(entry, self.token_text)
            if out.first_scheduled_time is not None and parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time = out.first_scheduled_time
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.kv_transfer_params is not None:
                parent.kv_transfer_params = out.kv_transfer_params
            if not out.new_token_ids:
                if out.finish_reason is not None:
                    # Finished without a token (a grammar that failed to compile in the core).
                    child.updated = True
                    child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
                continue
            child.updated = True
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            parent.metrics.last_token_time = now
            new_ids, new_logprobs = out.new_token_ids, out.new_logprobs
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if child.detokenizer is not None:
                # An EOS/stop token that ended the request is not part of the text.
                ended_by_token = finish_reason == "stop" and not child.params.include_stop_str_in_output
                taken = len(child.detokenizer.output_token_ids)
                matched = child.detokenizer.update(new_ids, stop_terminated=ended_by_token)
                taken = len(child.detokenizer.output_token_ids) - taken
                if matched is not None and (finish_reason is None or taken < len(new_ids)):
                    # The stop string came first (before the core's own finish, or with
                    # tokens of the same step after it: kept drafts): the output ends at
                    # the token that completed it, as with one token a step.
                    finish_reason, stop_reason = "stop", matched
                    new_ids, new_logprobs = new_ids[:taken], new_logprobs[:taken]
                    if out.finish_reason is None:
                        stopped_by_text.append(child.request_id)
                    touched[parent.request_id] = parent
            child.token_ids.extend(new_ids)
            if child.logprobs is not None:
                for entry in new_logprobs:
                    child.logprobs.append(to_position_logprobs(entry, self.token_text))
                    child.cumulative_logprob += entry.logprob
            if finish_reason is not None:
                child.finish_reason, child.stop_reason = finish_reason, stop_reason
        outputs: list[RequestOutput | PoolingRequestOutput] = list(pooled)
        for parent in touched.values():
            output = self._make_output(parent, now)
            if output is not None:
                outputs.append(output)
        return outputs, stopped_by_text

    def _make_output(self, parent: ParentState, now: float) -> RequestOutput | None:
        finished = parent.finished
        kind = parent.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = []
        for child in parent.children:
            if delta and not child.updated and not (finished and child.num_tokens_sent == 0):
                continue
            completions.append(self._completion(child, delta))
            child.updated = False
        if finished:
            parent.metrics.finished_time = now
            self.parents.pop(parent.request_id, None)
            for child in parent.children:
                self.children.pop(child.request_id, None)
        if delta and not completions and not finished:
            return None
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, prompt_logprobs=parent.prompt_logprobs,
            outputs=completions, finished=finished, metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens,
            kv_transfer_params=parent.kv_transfer_params)

    def _completion(self, child: ChildState, delta: bool) -> CompletionOutput:
        finished = child.finish_reason is not None
        text = child.detokenizer.get_next_output_text(finished, delta) if child.detokenizer else ""
        start = child.num_tokens_sent if delta else 0
        child.num_tokens_sent = len(child.token_ids)
        return CompletionOutput(
            index=child.index, text=text, token_ids=child.token_ids[start:],
            cumulative_logprob=child.cumulative_logprob,
            logprobs=None if child.logprobs is None else child.logprobs[start:],
            finish_reason=child.finish_reason, stop_reason=child.stop_reason)
