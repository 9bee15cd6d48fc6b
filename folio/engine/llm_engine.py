"""The synchronous engine: the front end (tokenize, detokenize, stop strings) around an
in-process engine core. The streaming interface of the offline API:
add_request / step / abort_request."""
from __future__ import annotations

import itertools
from typing import Any

from folio.config import EngineConfig
from folio.engine.engine_core import EngineCore
from folio.engine.frontend import RequestPreparer, default_sampling_params, load_model_info
from folio.engine.input_processor import PromptType
from folio.engine.output_processor import OutputProcessor
from folio.pooling_params import PoolingParams
from folio.lora.request import LoRARequest
from folio.request_outputs import PoolingRequestOutput, RequestOutput
from folio.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_info = load_model_info(config)
        self.engine_core = EngineCore(config, self.model_info.source, self.model_info.hf_config,
                                      self.model_info.tokenizer)
        self.preparer = RequestPreparer(self.model_info, config.structured_outputs.backend,
                                        config.limits, config.lora, config.kv_transfer,
                                        config.multimodal)
        self.preparer.kv_capacity_tokens = self.engine_core.kv_capacity_tokens
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        return cls(config)

    @property
    def tokenizer(self) -> Any:
        return self.model_info.tokenizer

    @property
    def model_source(self):
        return self.model_info.source

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.model_info.eos_token_ids

    def default_sampling_params(self) -> SamplingParams:
        return default_sampling_params(self.model_info)

    # ---- the streaming interface ---------------------------------------------------------

    def _new_request_id(self, request_id: str | None) -> str:
        """`request_id`, or a fresh one; ValueError if a request still uses it."""
        request_id = str(next(self._ids)) if request_id is None else request_id
        processor = self.output_processor
        if request_id in processor.parents or request_id in processor.pooling:
            raise ValueError(f"request id {request_id!r} is already in use")
        return request_id

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams,
                    *, arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None,
                    kv_transfer_params: dict | None = None) -> str:
        """Validate, tokenize and queue one request (`lora_request`: the LoRA adapter it runs
        with). Raises ValueError on bad input, with the engine untouched."""
        request_id = self._new_request_id(request_id)
        prepared = self.preparer.prepare(request_id, prompt, params, arrival_time=arrival_time,
                                         priority=priority, cache_salt=cache_salt,
                                         lora_request=lora_request,
                                         kv_transfer_params=kv_transfer_params)
        self.output_processor.add_request(
            request_id, prepared.child_ids, prepared.prompt.prompt,
            prepared.prompt.prompt_token_ids, prepared.child_params,
            prepared.core_requests[0].arrival_time)
        for core_request in prepared.core_requests:
            self.engine_core.add_request(core_request)
        return request_id

    def add_pooling_request(self, request_id: str | None, prompt: PromptType,
                            params: PoolingParams, *, pair: str | None = None,
                            arrival_time: float | None = None, priority: int = 0) -> str:
        """Validate, tokenize and queue one pooling request (`pair`: a cross-encoder's
        document beside the query `prompt`); its one output is a PoolingRequestOutput."""
        request_id = self._new_request_id(request_id)
        prepared = self.preparer.prepare_pooling(request_id, prompt, params, pair=pair,
                                                 arrival_time=arrival_time, priority=priority)
        core = prepared.core_requests[0]
        self.output_processor.add_pooling_request(request_id, prepared.prompt.prompt,
                                                  prepared.prompt.prompt_token_ids,
                                                  core.arrival_time, prepared.pooling_params.task)
        self.engine_core.add_request(core)
        return request_id

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
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
        return len(self.output_processor.parents) + len(self.output_processor.pooling)

    def shutdown(self) -> None:
        """Stop the engine core and its executor (worker processes with the mp executor);
        also done when the engine is garbage collected."""
        self.engine_core.shutdown()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def remove_lora(self, lora_id: int) -> bool:
        """vLLM's remove_lora: forget the adapter's checked files (the id may then name
        another adapter) and have the worker free its host copy and device slot with the next
        step, or once the requests using it finish. False when nothing held it."""
        self.preparer.lora.forget(lora_id)
        return self.engine_core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """The adapter ids the worker was given and not told to remove."""
        return set(self.engine_core.list_loras())

    def sleep(self, level: int = 1) -> dict[str, int]:
        return self.engine_core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()
