"""Per-request sampling parameters.

`SamplingParams` mirrors the names, defaults and semantics of vLLM's public
`SamplingParams` so that OpenAI-style requests map onto it one-to-one. All
validation happens once, in `__post_init__`, so that the engine and the sampler
can trust every field afterwards; each error message starts with the name of
the offending field so that API layers can surface it to the client verbatim.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from folio.structured_output.params import StructuredOutputsParams

# Temperatures below this are treated as greedy decoding: dividing logits by
# such a small number would only amplify floating-point noise.
SAMPLING_EPS = 1e-5

# OpenAI's range for logit_bias values; larger magnitudes would not change the
# outcome anyway (they already force or forbid a token), so they are refused.
_MAX_LOGIT_BIAS = 100.0

# Seeds feed torch.Generator.manual_seed and msgspec's int64 on the wire; so do every other
# integer field (a larger top_k or truncate_prompt_tokens would fail to encode: a 500).
_INT64_RANGE = (-(2**63), 2**63 - 1)


class RequestOutputKind(enum.Enum):
    """How outputs are reported while a request is being generated."""

    # Every output carries the full text/tokens generated so far.
    CUMULATIVE = 0
    # Every output carries only what is new since the previous output.
    DELTA = 1
    # Nothing is reported until the request finishes.
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    """Which sampling path a request takes in the sampler."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


# ---------------------------------------------------------------------------
# Small type checkers. Each returns the (possibly converted) value or raises
# with the field name, so `__post_init__` reads as a flat list of rules.
# ---------------------------------------------------------------------------


def _int_text(value: int) -> str:
    """An int for an error message (str() refuses ints of more than 4,300 digits)."""
    return str(value) if value.bit_length() <= 256 else f"an integer of {value.bit_length()} bits"


def _check_int(name: str, value: Any, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    # bool is a subclass of int, but `max_tokens=True` is certainly a bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{name} must be an integer{' or None' if optional else ''}, "
            f"got {type(value).__name__} {value!r}"
        )
    if not _INT64_RANGE[0] <= value <= _INT64_RANGE[1]:
        raise ValueError(f"{name} must be a 64-bit signed integer "
                         f"[-2**63, 2**63 - 1], got {_int_text(value)}")
    return int(value)


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond float range (not printed: it may be huge)
        raise ValueError(f"{name} must be finite, got an integer of {value.bit_length()} "
                         "bits") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _check_int_list(name: str, value: Any) -> list[int]:
    # A bare string is iterable, so reject it explicitly instead of treating
    # "123" as [1, 2, 3].
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of integers, got {type(value).__name__}")
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            raise ValueError(
                f"{name} must contain only integers, got {type(item).__name__} {item!r}"
            )
        if not 0 <= item <= _INT64_RANGE[1]:
            raise ValueError(f"{name} must contain non-negative 64-bit token ids, "
                             f"got {_int_text(item)}")
        out.append(int(item))
    return out


def _check_str_list(name: str, value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"{name} must be a string or a list of strings, got {type(value).__name__}"
        )
    out = []
    for item in value:
        if not isinstance(item, str):
            raise ValueError(f"{name} must contain only strings, got {type(item).__name__} {item!r}")
        if item == "":
            raise ValueError(f"{name} must not contain empty strings")
        out.append(item)
    return out


@dataclass
class SamplingParams:
    """Sampling parameters for one request (see vLLM's `SamplingParams`)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # Constrained decoding (JSON schema, regex, choice, grammar, structural tag).
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    # Filled by `update_from_tokenizer`: each bad word as token-id sequences.
    bad_words_token_ids: list[list[int]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._verify_types_and_normalise()
        self._verify_ranges()
        if self.is_greedy:
            # Filters are meaningless for argmax; resetting them lets the
            # sampler skip work for greedy rows (same as vLLM).
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}")

    # -- validation --------------------------------------------------------

    def _verify_types_and_normalise(self) -> None:
        self.n = _check_int("n", self.n)
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty)
        self.frequency_penalty = _check_float("frequency_penalty", self.frequency_penalty)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        self.temperature = _check_float("temperature", self.temperature)
        self.top_p = _check_float("top_p", self.top_p)
        self.top_k = _check_int("top_k", self.top_k)
        self.min_p = _check_float("min_p", self.min_p)
        self.seed = _check_int("seed", self.seed, optional=True)  # int64, as all int fields
        self.max_tokens = _check_int("max_tokens", self.max_tokens, optional=True)
        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        self.logprobs = _check_int("logprobs", self.logprobs, optional=True)
        self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs, optional=True)
        self.truncate_prompt_tokens = _check_int(
            "truncate_prompt_tokens", self.truncate_prompt_tokens, optional=True
        )
        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            setattr(self, name, _check_bool(name, getattr(self, name)))

        # Normalised to lists (or empty lists) so consumers need no None checks.
        self.stop = [] if self.stop is None else _check_str_list("stop", self.stop)
        self.stop_token_ids = (
            [] if self.stop_token_ids is None else _check_int_list("stop_token_ids", self.stop_token_ids)
        )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_int_list("allowed_token_ids", self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = _check_str_list("bad_words", self.bad_words)
        if self.logit_bias is not None:
            self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(
                f"output_kind must be a RequestOutputKind, got {type(self.output_kind).__name__}"
            )
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
            try:
                self.structured_outputs.validate()
            except ValueError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        if self.top_k == -1:
            # -1 is the legacy spelling of "disabled"; keep a single spelling.
            self.top_k = 0

    @staticmethod
    def _normalise_logit_bias(bias: Any) -> dict[int, float]:
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id to bias, got {type(bias).__name__}")
        out: dict[int, float] = {}
        for key, value in bias.items():
            # JSON object keys are always strings, so "50256" must be accepted.
            if isinstance(key, str):
                try:
                    token_id = int(key.strip())
                except ValueError:
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            elif isinstance(key, int) and not isinstance(key, bool):
                token_id = int(key)
            else:
                raise ValueError(f"logit_bias keys must be token ids, got {type(key).__name__} {key!r}")
            if not 0 <= token_id <= _INT64_RANGE[1]:
                raise ValueError(f"logit_bias keys must be non-negative 64-bit token ids, "
                                 f"got {_int_text(token_id)}")
            value = _check_float("logit_bias", value)
            if not -_MAX_LOGIT_BIAS <= value <= _MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} "
                                 f"for token {token_id}")
            out[token_id] = value
        return out

    def _verify_ranges(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < -1:
                raise ValueError(f"{name} must be non-negative or -1 (whole vocabulary), got {value}")
        if self.truncate_prompt_tokens is not None and (
            self.truncate_prompt_tokens == 0 or self.truncate_prompt_tokens < -1
        ):
            raise ValueError(
                f"truncate_prompt_tokens must be at least 1 or -1 (up to max_model_len), "
                f"got {self.truncate_prompt_tokens}"
            )
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if self.stop and not self.detokenize:
            # Stop strings are matched against generated text, which does not
            # exist when detokenization is off.
            raise ValueError("stop strings are only supported when detokenize is True")

    # -- derived properties ------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def output_text_buffer_length(self) -> int:
        """Characters the detokenizer must hold back from streaming.

        A stop string may be split across tokens; until we know whether the
        tail of the text completes one, we cannot show it to the client.
        """
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    # -- helpers -----------------------------------------------------------

    def clone(self) -> "SamplingParams":
        """A deep copy, so that per-sequence tweaks (e.g. seeds for n > 1)
        do not leak into the caller's object."""
        return copy.deepcopy(self)

    def update_from_tokenizer(self, tokenizer: Any, vocab_size: int) -> None:
        """Check token ids against the model vocabulary and tokenize bad words.

        Done here rather than in `__post_init__` because the params are built
        before the API layer knows which model/tokenizer will serve them.
        """
        self._check_ids_in_vocab("logit_bias", list(self.logit_bias or ()), vocab_size)
        self._check_ids_in_vocab("allowed_token_ids", self.allowed_token_ids or [], vocab_size)
        self._check_ids_in_vocab("stop_token_ids", self.stop_token_ids or [], vocab_size)

        sequences: list[list[int]] = []
        for word in self.bad_words or []:
            # A BPE tokenizer encodes a word differently at the start of text
            # and after a space; ban both spellings.
            for prefix in ("", " "):
                ids = list(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        flat = [t for seq in sequences for t in seq]
        self._check_ids_in_vocab("bad_words", flat, vocab_size)
        self.bad_words_token_ids = sequences

    @staticmethod
    def _check_ids_in_vocab(name: str, ids: list[int], vocab_size: int) -> None:
        bad = sorted({t for t in ids if not 0 <= t < vocab_size})
        if bad:
            raise ValueError(
                f"{name} contains token ids outside the vocabulary [0, {vocab_size}): {bad}"
            )
