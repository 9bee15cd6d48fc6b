"""What every front end (the offline LLMEngine, the server's AsyncLLM) knows about the model
and does before the engine core sees a request: load config and tokenizer, validate and
tokenize, fan n>1 out into child requests."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from folio.config import EngineConfig, RequestLimitsConfig
from folio.core.request import EngineCoreRequest
from folio.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from folio.engine.request_limits import check_kv_fit, check_sampling_limits
from folio.engine.tokenizer import eos_token_ids, load_tokenizer
from folio.model.families import arch_spec_from_hf_config
from folio.model.discovery import ModelSource, load_hf_config, resolve_model_source
from folio.sampling_params import SamplingParams


def _load_generation_config(path: str) -> Any | None:
    try:
        from transformers import GenerationConfig
        return GenerationConfig.from_pretrained(path)
    except Exception:
        return None  # the file is optional


@dataclass
class ModelInfo:
    source: ModelSource
    hf_config: Any
    tokenizer: Any
    generation_config: Any | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_model_len: int


def load_model_info(config: EngineConfig) -> ModelInfo:
    """Resolve the model, read its config and tokenizer, and fill the config's model-dependent
    defaults (max_model_len, the token budget). Raises ValueError for a bad model or setting."""
    source = resolve_model_source(config.model.model, config.model.revision)
    hf_config, gguf_chat_template = load_hf_config(source)
    spec = arch_spec_from_hf_config(hf_config)  # fails early on an unsupported architecture
    generation_config = None
    if config.model.generation_config == "auto":
        if source.kind == "hf_dir":
            generation_config = _load_generation_config(source.path)
    elif config.model.generation_config not in ("folio", "vllm"):
        generation_config = _load_generation_config(config.model.generation_config)
        if generation_config is None:
            raise ValueError(f"generation_config: no generation_config.json in "
                             f"{config.model.generation_config!r}")
    extra_eos: list[int] = []
    if source.gguf_metadata is not None:
        extra_eos = list(source.gguf_metadata.extra_eos_token_ids)
    model_max = getattr(hf_config, "max_position_embeddings", None) or 2048
    if config.model.max_model_len is not None and config.model.max_model_len > model_max:
        raise ValueError(f"max_model_len={config.model.max_model_len} is larger than the "
                         f"model's max_position_embeddings={model_max}")
    config.finalize(model_max)
    tokenizer = load_tokenizer(source, config.model.tokenizer, config.model.revision)
    if gguf_chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = gguf_chat_template
    eos = eos_token_ids(tokenizer, hf_config, generation_config)
    eos += tuple(t for t in extra_eos if t not in eos)
    return ModelInfo(source, hf_config, tokenizer, generation_config, eos, spec.vocab_size,
                     config.model.max_model_len)


def default_sampling_params(info: ModelInfo) -> SamplingParams:
    """SamplingParams() with the model's generation_config.json sampling defaults (as vLLM
    does with --generation-config auto)."""
    overrides = {}
    gen = info.generation_config
    if gen is not None and getattr(gen, "do_sample", False):
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(gen, name, None)
            if value is not None:
                overrides[name] = value
    return SamplingParams(**overrides)


@dataclass
class PreparedRequest:
    request_id: str
    prompt: ProcessedPrompt
    child_ids: list[str]
    child_params: list[SamplingParams]
    core_requests: list[EngineCoreRequest]


def _child_seed(seed: int, index: int) -> int:
    """Seed of the index-th of n samples: seed + index, wrapped into int64."""
    return (seed + index + 2**63) % 2**64 - 2**63


class RequestPreparer:
    def __init__(self, info: ModelInfo, structured_outputs_backend: str = "auto",
                 limits: RequestLimitsConfig | None = None) -> None:
        self.info = info
        self.structured_outputs_backend = structured_outputs_backend
        self.limits = limits or RequestLimitsConfig()
        # Tokens the KV cache holds; set once the engine core has sized it.
        self.kv_capacity_tokens: int | None = None
        self.input_processor = InputProcessor(info.tokenizer, info.vocab_size, info.max_model_len)

    def prepare(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                arrival_time: float | None = None, priority: int = 0,
                cache_salt: str | None = None) -> PreparedRequest:
        """Validate and tokenize. Raises ValueError naming the problem; changes no state."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if not -(2**63) <= priority < 2**63:  # it crosses the wire to the core as int64
            raise ValueError(f"priority must be a 64-bit signed integer, got one of "
                             f"{priority.bit_length()} bits")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        # Bounds first: everything after this point costs time or memory in proportion to them.
        check_sampling_limits(params, self.limits)
        params = params.clone()
        if params.structured_outputs is not None:
            # A bad schema/regex/grammar is the caller's error (a 400), found here in well
            # under a millisecond, not a failed request later in the engine core.
            from folio.structured_output.validation import validate_constraint
            try:
                validate_constraint(params.structured_outputs, self.structured_outputs_backend)
            except ValueError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
            # The text must be what the grammar matched: no spaces inserted around added
            # tokens (e.g. Qwen's <tool_call>), which would break patterns and lengths.
            params.spaces_between_special_tokens = False
        processed = self.input_processor.process(prompt, params)
        check_kv_fit(len(processed.prompt_token_ids), params, self.info.max_model_len,
                     self.kv_capacity_tokens)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if params.n == 1:
            child_ids, child_params = [request_id], [params]
        else:
            # n samples are n core requests sharing the prompt's blocks via the prefix cache.
            child_ids, child_params = [], []
            for i in range(params.n):
                child = params.clone()
                child.n = 1
                if params.seed is not None:
                    child.seed = _child_seed(params.seed, i)
                child_ids.append(f"{request_id}-{i}")
                child_params.append(child)
        core_requests = [
            EngineCoreRequest(cid, processed.prompt_token_ids, p, list(self.info.eos_token_ids),
                              arrival, priority, cache_salt)
            for cid, p in zip(child_ids, child_params)]
        return PreparedRequest(request_id, processed, child_ids, child_params, core_requests)
