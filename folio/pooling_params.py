"""Per-request pooling parameters and the names pooling models share (vLLM's `PoolingParams`,
pooling tasks and pooling types).

A pooling request runs its whole prompt through the model and returns a vector (or one per
token) instead of sampling. Torch-free: the front end, the scheduler and the worker all read
these. Every error message starts with the offending field's name, as SamplingParams' do.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from folio.sampling_params import RequestOutputKind


class PoolingType(str, enum.Enum):
    """How a sequence's final hidden states become one vector (vLLM's names): the mean over
    its tokens, the first token's (CLS), the last token's, or every token's (ALL)."""
    MEAN = "MEAN"
    CLS = "CLS"
    LAST = "LAST"
    ALL = "ALL"

    @classmethod
    def parse(cls, value: str, field_name: str = "pooling_type") -> "PoolingType":
        try:
            return cls(value.upper()) if isinstance(value, str) else cls(value)
        except ValueError:
            raise ValueError(f"{field_name} must be one of {[t.value for t in cls]}, got "
                             f"{value!r}") from None


class PoolingTask(str, enum.Enum):
    """What a pooling request asks for (vLLM's PoolingTask names):
    embed: one normalized vector per sequence; classify: class probabilities per sequence;
    score: a relevance score of a (query, document) pair (a cross-encoder's one logit after
    its activation, or the cosine of two embeddings); token_embed / token_classify: a vector
    or class probabilities per token (token_classify is what `LLM.reward` runs); encode: the
    model's own default task (embed or classify) with the same defaults: normalization and
    activation as the request's params or the model's defaults say."""
    EMBED = "embed"
    CLASSIFY = "classify"
    SCORE = "score"
    TOKEN_EMBED = "token_embed"
    TOKEN_CLASSIFY = "token_classify"
    ENCODE = "encode"

    @property
    def per_token(self) -> bool:
        return self in (PoolingTask.TOKEN_EMBED, PoolingTask.TOKEN_CLASSIFY)


# Pooling models' tasks by the kind of model (ModelConfig.pooling_kind): an embedding model
# (BertModel, a decoder run for its last hidden state) or a classifier (a
# *ForSequenceClassification head, a decoder reranker scoring yes/no tokens).
EMBED_TASKS = frozenset({PoolingTask.EMBED, PoolingTask.TOKEN_EMBED, PoolingTask.SCORE,
                         PoolingTask.ENCODE})
CLASSIFY_TASKS = frozenset({PoolingTask.CLASSIFY, PoolingTask.TOKEN_CLASSIFY,
                            PoolingTask.SCORE, PoolingTask.ENCODE})

RUNNERS = ("auto", "generate", "pooling")
# vLLM's --convert: what a model of another kind is turned into for the pooling runner.
CONVERTS = ("auto", "none", "embed", "classify", "reward")
# vLLM's older --task names, mapped onto (runner, convert).
TASK_ALIASES = {
    "auto": ("auto", "auto"), "generate": ("generate", "auto"),
    "embed": ("pooling", "embed"), "embedding": ("pooling", "embed"),
    "classify": ("pooling", "classify"), "score": ("pooling", "auto"),
    "reward": ("pooling", "reward"),
}
# The largest `dimensions` any request may ask for (models are far below it; the field sizes
# a vector, so it has a bound before the model's own is known).
MAX_DIMENSIONS = 1 << 16


def _optional_bool(value: Any, field_name: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{field_name} must be a bool or None, got {value!r}")
    return value


@dataclass
class PoolingParams:
    """vLLM's PoolingParams. `truncate_prompt_tokens`: keep only the last k prompt tokens (-1:
    the model's maximum length; None: a longer prompt is an error). `dimensions`: Matryoshka
    truncation of an embedding to its first `dimensions` values, before normalizing (only for
    models trained for it: PoolingModelInfo.matryoshka_dimensions). `normalize`: L2-normalize
    embeddings (None: the model's default, True for embedding models). `use_activation`
    (`activation` is vLLM's older name): apply the classifier's activation, softmax or sigmoid
    (None: True). `task`: set by the entry point (LLM.embed, /v1/embeddings ...)."""
    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    activation: bool | None = None
    task: str | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int)
                              or (t < 1 and t != -1) or t > 2**31):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive int, got {t!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1
                              or d > MAX_DIMENSIONS):
            raise ValueError(f"dimensions must be a positive int of at most {MAX_DIMENSIONS}, "
                             f"got {d!r}")
        self.normalize = _optional_bool(self.normalize, "normalize")
        self.use_activation = _optional_bool(self.use_activation, "use_activation")
        self.activation = _optional_bool(self.activation, "activation")
        if self.use_activation is None:
            self.use_activation = self.activation
        if self.task is not None:
            try:
                self.task = PoolingTask(self.task).value
            except ValueError:
                raise ValueError(f"task must be one of {[t.value for t in PoolingTask]}, got "
                                 f"{self.task!r}") from None

    @property
    def pooling_task(self) -> PoolingTask | None:
        return None if self.task is None else PoolingTask(self.task)

    def clone(self) -> "PoolingParams":
        return PoolingParams(**{name: getattr(self, name)
                                for name in self.__dataclass_fields__})


@dataclass(frozen=True)
class PoolerConfig:
    """--pooler-config (vLLM's names): overrides of what the model's files say."""
    pooling_type: str | None = None
    normalize: bool | None = None
    use_activation: bool | None = None

    @classmethod
    def from_dict(cls, raw: dict | None) -> "PoolerConfig":
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError(f"pooler_config must be a JSON object, got {raw!r}")
        known = {"pooling_type", "normalize", "use_activation", "activation"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"pooler_config: unknown fields {unknown}; known: {sorted(known)}")
        pooling_type = raw.get("pooling_type")
        if pooling_type is not None:
            pooling_type = PoolingType.parse(pooling_type, "pooler_config.pooling_type").value
        for name in ("normalize", "use_activation", "activation"):
            if raw.get(name) is not None and not isinstance(raw[name], bool):
                raise ValueError(f"pooler_config.{name} must be a bool, got {raw[name]!r}")
        activation = raw.get("use_activation", raw.get("activation"))
        return cls(pooling_type, raw.get("normalize"), activation)


@dataclass(frozen=True)
class PoolingModelInfo:
    """What a pooling model does. kind "embed": vectors (normalized by default); "classify":
    `num_labels` logits per sequence from a classifier head, turned into probabilities by
    `activation` ("sigmoid" for one label or multi-label problems, else "softmax")."""
    kind: str
    architecture: str                  # the one that is built (after conversion)
    pooling_type: PoolingType
    is_causal: bool                    # False: an encoder (bidirectional attention)
    normalize: bool = True
    use_activation: bool = True
    num_labels: int = 0
    activation: str = "softmax"
    labels: tuple[str, ...] = ()
    # A decoder reranker's classifier made from the language-model head's rows of these
    # tokens (vLLM's classifier_from_token): two tokens ("no", "yes") give one logit,
    # logit(yes) - logit(no), so that sigmoid of it is softmax([no, yes])[yes].
    classifier_from_token: tuple[str, ...] = ()
    # Their ids in the model's vocabulary (the front end fills them from the tokenizer).
    classifier_token_ids: tuple[int, ...] = ()
    # sentence-transformers' max_seq_length: the default max_model_len when it is smaller.
    max_seq_length: int | None = None
    # Matryoshka: None = `dimensions` other than the full size is refused; () = any size up to
    # the hidden size; else the sizes the model was trained for.
    matryoshka_dimensions: tuple[int, ...] | None = None
    hidden_size: int = 0

    @property
    def tasks(self) -> frozenset[PoolingTask]:
        tasks = EMBED_TASKS if self.kind == "embed" else CLASSIFY_TASKS
        if self.kind == "classify" and self.num_labels != 1:
            tasks = tasks - {PoolingTask.SCORE}   # a score is one logit per pair
        return tasks

    @property
    def default_task(self) -> PoolingTask:
        return PoolingTask.EMBED if self.kind == "embed" else PoolingTask.CLASSIFY

    @property
    def prefix_caching(self) -> bool:
        """Whether a prefix-cache hit can skip tokens: only for causal models pooling the last
        token (the hidden states of skipped tokens are not kept, and an encoder's keys depend on
        the whole input)."""
        return self.is_causal and self.pooling_type == PoolingType.LAST
