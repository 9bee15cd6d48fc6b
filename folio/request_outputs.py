"""What the offline API returns, in vLLM's shape: RequestOutput, CompletionOutput, Logprob (what
the engine core passes out is folio/core/engine_core_outputs.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per position: token id -> Logprob (the top-k plus the sampled/actual token).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None   # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    # Disaggregated prefill: on a prefill server's finished output, where a decode server
    # fetches the prompt's KV (vLLM's RequestOutput.kv_transfer_params); None otherwise.
    kv_transfer_params: dict | None = None


# ---- pooling (vLLM's output types of LLM.encode / embed / classify / score / reward) ---------


@dataclass
class PoolingOutput:
    """A pooling request's raw result: an array (one row per token for the per-token tasks).
    The engine hands out a float32 numpy array; `LLM` turns it into a torch tensor, as vLLM's
    is."""
    data: Any


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    # "stop" when the result is there; "error" or "abort" when it never came (outputs None).
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    task: str | None = None            # the pooling task it ran


@dataclass
class EmbeddingOutput:
    """vLLM's: `embedding`, a list of floats. Built from the engine's array when first read
    (the property below replaces the field's plain attribute; the dataclass's __init__, eq,
    repr, fields, asdict and replace all go through it): 1,000 BERT-large embeddings cost 35
    ms of list building on the H100's host, a seventh of the pass, for callers that hand the
    vectors on as arrays or read a few."""
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.__dict__["_embedding"])


def _lazy_embedding(self: EmbeddingOutput) -> list[float]:
    data = self.__dict__["_embedding"]
    if not isinstance(data, list):
        data = self.__dict__["_embedding"] = _as_list(data)
    return data


def _set_embedding(self: EmbeddingOutput, value: Any) -> None:
    self.__dict__["_embedding"] = value


EmbeddingOutput.embedding = property(_lazy_embedding, _set_embedding)  # type: ignore[assignment]


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


def _as_list(data: Any) -> list:
    return data.tolist() if hasattr(data, "tolist") else list(data)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(out.request_id, EmbeddingOutput(out.outputs.data),
                   out.prompt_token_ids, out.finished)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(out.request_id, ClassificationOutput(_as_list(out.outputs.data)),
                   out.prompt_token_ids, out.finished)


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
