"""The synchronous engine: front end (tokenize, detokenize, stop strings) around the engine
core. This is the streaming interface the offline API and the server use:
add_request / step / abort_request."""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from folio.config import EngineConfig
from folio.core.request import Request
from folio.engine.engine_core import EngineCore
from folio.engine.input_processor import InputProcessor, PromptType
from folio.engine.output_processor import OutputProcessor
from folio.engine.tokenizer import eos_token_ids, load_tokenizer
from folio.model.loader import load_hf_config, resolve_model_source
from folio.outputs import RequestOutput
from folio.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _load_generation_config(path: str) -> Any | None:
    try:
        from transformers import GenerationConfig
        return GenerationConfig.from_pretrained(path)
    except Exception:
        return None  # optional file


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = resolve_model_source(config.model.model, config.model.revision)
        self.model_source = source
        self.hf_config, gguf_chat_template = load_hf_config(source)
        self.generation_config = _load_generation_config(source.path) if source.kind == "hf_dir" else None
        extra_eos: list[int] = []
        if source.gguf_checkpoint is not None:
            extra_eos = list(source.gguf_checkpoint.extra.get("extra_eos_token_ids", []))
        model_max = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        if config.model.max_model_len is not None and config.model.max_model_len > model_max:
            raise ValueError(f"max_model_len={config.model.max_model_len} is larger than the "
                             f"model's max_position_embeddings={model_max}")
        config.finalize(model_max)
        self.tokenizer = load_tokenizer(source, config.model.tokenizer, config.model.revision)
        if gguf_chat_template and not getattr(self.tokenizer, "chat_template", None):
            self.tokenizer.chat_template = gguf_chat_template
        self.engine_core = EngineCore(config, source, self.hf_config)
        self.vocab_size = self.engine_core.executor.worker.spec.vocab_size
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.hf_config, self.generation_config)
        self.eos_token_ids += tuple(t for t in extra_eos if t not in self.eos_token_ids)
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size,
                                              config.model.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        return cls(config)

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults applied (as vLLM
        does with --generation-config auto)."""
        overrides = {}
        gen = self.generation_config
        if gen is not None and getattr(gen, "do_sample", False):
            for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
                value = getattr(gen, name, None)
                if value is not None:
                    overrides[name] = value
        return SamplingParams(**overrides)

    # ---- the streaming interface ---------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams,
                    *, arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> str:
        """Validate, tokenize and queue one request. Raises ValueError on bad input, with the
        engine untouched."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params.clone()
        processed = self.input_processor.process(prompt, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        child_params = [params]
        if params.n > 1:
            # n samples are n requests sharing the prompt's blocks through the prefix cache.
            child_params = []
            for i in range(params.n):
                child = params.clone()
                child.n = 1
                if params.seed is not None:
                    child.seed = params.seed + i
                child_params.append(child)
        child_ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        block_size = self.config.cache.block_size
        requests = [Request(cid, processed.prompt_token_ids, p, self.eos_token_ids,
                            block_size=block_size, max_model_len=self.max_model_len,
                            arrival_time=arrival, priority=priority, cache_salt=cache_salt)
                    for cid, p in zip(child_ids, child_params)]
        self.output_processor.add_request(request_id, child_ids, processed.prompt,
                                          processed.prompt_token_ids, child_params, arrival)
        for request in requests:
            self.engine_core.add_request(request)
        return request_id

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.engine_core.finish_requests(stopped)
        return outputs

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self.engine_core.abort_requests(self.output_processor.abort(rid))

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()
