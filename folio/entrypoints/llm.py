"""The offline API, in vLLM's shape: LLM(...).generate(...) and .chat(...)."""
from __future__ import annotations

from typing import Any, Sequence

from folio.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig,
                          RequestLimitsConfig, SchedulerConfig, SpeculativeConfig,
                          StructuredOutputsConfig, multimodal_config, offloading_size,
                          p2p_transfer)
from folio.engine.chat import render_chat
from folio.engine.llm_engine import LLMEngine
from folio.entrypoints.pooling_api import PoolingAPI
from folio.lora.request import LoRARequest
from folio.request_outputs import RequestOutput
from folio.sampling_params import RequestOutputKind, SamplingParams


class LLM(PoolingAPI):
    """An engine for offline batches.

    `LLM()` with no model runs the embedded default model (SmolLM2-135M-Instruct). A pooling
    model (an encoder such as all-MiniLM-L6-v2, a classifier, or any decoder with
    runner="pooling") answers `embed`, `classify`, `score`, `reward` and `encode`
    (entrypoints/pooling_api.py) instead of `generate`.
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 dtype: str = "auto", seed: int = 0, max_model_len: int | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 block_size: int = 16, kv_cache_memory_bytes: int | None = None,
                 kv_cache_dtype: str = "auto", calculate_kv_scales: bool = False,
                 num_gpu_blocks_override: int | None = None, scheduling_policy: str = "fcfs",
                 device: str = "auto", revision: str | None = None,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
                 cudagraph_mode: str = "full", quantization: str | None = None,
                 async_scheduling: bool | None = None,
                 structured_outputs_config: StructuredOutputsConfig | dict | None = None,
                 max_logprobs: int | None = None,
                 request_limits: RequestLimitsConfig | dict | None = None,
                 distributed_executor_backend: str | None = None,
                 num_workers: int = 1,
                 kv_offloading_size: float | None = None,
                 kv_transfer_config: dict | str | None = None,
                 kv_disk_path: str | None = None, kv_disk_size: float | None = None,
                 tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1,
                 pp_layer_partition: str | None = None,
                 data_parallel_size: int = 1,
                 enable_expert_parallel: bool = False,
                 distributed_single_rank: bool = False,
                 speculative_config: SpeculativeConfig | dict | str | None = None,
                 runner: str = "auto", convert: str = "auto", task: str | None = None,
                 pooler_config: dict | None = None,
                 hf_overrides: dict | None = None,
                 enable_sleep_mode: bool = False,
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None,
                 lora_config: LoRAConfig | dict | None = None,
                 limit_mm_per_prompt: dict | None = None,
                 mm_processor_kwargs: dict | None = None,
                 allowed_local_media_path: str | None = None,
                 allowed_media_domains: list[str] | None = None,
                 allow_private_media_urls: bool = False,
                 max_media_bytes: int | None = None,
                 media_fetch_timeout: float | None = None,
                 max_image_pixels: int | None = None,
                 disable_log_stats: bool = True) -> None:
        """`enable_lora` (or a `lora_config`): requests may run with a LoRA adapter
        (`lora_request=LoRARequest(name, id, path)` on generate / chat); up to `max_loras`
        adapters of rank up to `max_lora_rank` in one batch, `max_cpu_loras` kept in host
        memory. A vision-language model: `limit_mm_per_prompt` ({"image": n}),
        `mm_processor_kwargs` (the image processor's settings); chat image URLs are fetched
        under `allowed_local_media_path` (file://), `allowed_media_domains` and
        `allow_private_media_urls`, as the server's flags of those names.
        `disable_log_stats`: vLLM's switch for `get_metrics`; folio's scheduler counts either
        way, so `get_metrics` answers with it set too."""
        if isinstance(structured_outputs_config, dict):
            structured_outputs_config = StructuredOutputsConfig(**structured_outputs_config)
        # Bounds on what one request may ask for (vLLM's max_logprobs among them).
        if isinstance(request_limits, dict):
            request_limits = RequestLimitsConfig(**request_limits)
        request_limits = request_limits or RequestLimitsConfig()
        if max_logprobs is not None:
            request_limits.max_logprobs = max_logprobs
            request_limits.__post_init__()
        if data_parallel_size != 1:
            raise ValueError("data_parallel_size: data parallelism runs behind one API server "
                             "(folio serve --data-parallel-size N); offline, run one LLM per "
                             "replica")
        config = EngineConfig(
            model=ModelConfig(model=model, tokenizer=tokenizer, dtype=dtype, seed=seed,
                              max_model_len=max_model_len, revision=revision, device=device,
                              enforce_eager=enforce_eager, cudagraph_mode=cudagraph_mode,
                              quantization=quantization, runner=runner, convert=convert,
                              task=task, pooler_config=pooler_config,
                              hf_overrides=hf_overrides, enable_sleep_mode=enable_sleep_mode),
            cache=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                              kv_cache_memory_bytes=kv_cache_memory_bytes,
                              kv_offloading_size=offloading_size(kv_offloading_size,
                                                                 kv_transfer_config),
                              kv_disk_path=kv_disk_path, kv_disk_size=kv_disk_size,
                              cache_dtype=kv_cache_dtype,
                              calculate_kv_scales=calculate_kv_scales,
                              num_gpu_blocks_override=num_gpu_blocks_override,
                              gpu_memory_utilization=gpu_memory_utilization),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      enable_chunked_prefill=enable_chunked_prefill,
                                      policy=scheduling_policy,
                                      async_scheduling=async_scheduling),
            structured_outputs=structured_outputs_config or StructuredOutputsConfig(),
            limits=request_limits,
            parallel=ParallelConfig(distributed_executor_backend=distributed_executor_backend,
                                    num_workers=num_workers,
                                    tensor_parallel_size=tensor_parallel_size,
                                    pipeline_parallel_size=pipeline_parallel_size,
                                    pp_layer_partition=pp_layer_partition,
                                    enable_expert_parallel=enable_expert_parallel,
                                    distributed_single_rank=distributed_single_rank),
            speculative=SpeculativeConfig.from_json(speculative_config),
            lora=_lora_config(enable_lora, lora_config, max_loras, max_lora_rank,
                              max_cpu_loras),
            kv_transfer=p2p_transfer(kv_transfer_config),
            multimodal=multimodal_config(limit_mm_per_prompt, mm_processor_kwargs,
                                         allowed_local_media_path=allowed_local_media_path,
                                         allowed_media_domains=allowed_media_domains,
                                         allow_private_media_urls=allow_private_media_urls,
                                         max_media_bytes=max_media_bytes,
                                         media_fetch_timeout=media_fetch_timeout,
                                         max_image_pixels=max_image_pixels),
        )
        self.llm_engine = LLMEngine(config)
        self._request_counter = 0
        self._metrics: Any = None      # EngineMetrics, made by the first get_metrics

    def get_metrics(self) -> list:
        """vLLM's LLM.get_metrics: the engine's metrics now, as `folio.metrics.reader`'s
        Counter / Gauge / Vector / Histogram objects named as `/metrics` serves them
        (`folio:spec_decode_num_drafts`, `folio:spec_decode_num_accepted_tokens_per_pos` as a
        Vector by draft position, `folio:num_preemptions`, ...). Counters are cumulative
        since the engine started; the scheduler's metrics only (the per-request histograms
        are the server's)."""
        from folio.metrics import EngineMetrics
        from folio.metrics.reader import read_metrics
        if self._metrics is None:
            config = self.llm_engine.config
            self._metrics = EngineMetrics(str(config.model.model or "default"),
                                          self.llm_engine.max_model_len,
                                          cache_info=config.cache.metrics_info())
        self._metrics.observe_scheduler_stats(self.llm_engine.engine_core.stats())
        return read_metrics(self._metrics.registry)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> dict[str, int]:
        """vLLM's LLM.sleep (needs enable_sleep_mode=True): level 1 moves the weights to host
        memory and frees the KV cache, level 2 frees both. Returns the bytes freed of each."""
        return self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep freed (tags: "weights", "kv_cache"; None: all)."""
        self.llm_engine.wake_up(tags)

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True, priority: list[int] | None = None,
                 cache_salt: str | list[str | None] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """prompts: a string, a {"prompt_token_ids": [...]} dict, or a list of either.
        `lora_request`: one adapter for every prompt, or one (or None) per prompt. Outputs
        come back in the order of the prompts."""
        if self.llm_engine.is_sleeping():
            # offline nothing else could wake the engine: the call would wait forever
            raise ValueError("the engine is asleep: call wake_up() first")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        count = len(prompts)
        params_list = self._expand("sampling_params", sampling_params, count)
        priorities = self._expand("priority", priority, count, default=0)
        salts = self._expand("cache_salt", cache_salt, count, default=None)
        loras = self._expand("lora_request", lora_request, count, default=None)
        # Validate everything before queueing anything: a bad prompt fails the call cleanly.
        request_ids = []
        try:
            for prompt, params, prio, salt, lora in zip(prompts, params_list, priorities,
                                                        salts, loras):
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY
                request_ids.append(self._add(prompt, params, prio, salt, lora))
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None,
             ) -> list[RequestOutput]:
        """messages: one conversation (a list of {role, content}) or a list of them. On a
        vision-language model, content parts may be images: {"type": "image_url",
        "image_url": {"url": ...}} (data:, http(s) and file: URLs, fetched under the
        media settings) or {"type": "image_pil", "image_pil": a PIL image}."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a conversation or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        processor = self.llm_engine.preparer.image_processor
        prompts = []
        for conversation in conversations:
            rendered = render_chat(
                tokenizer, conversation, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                image_placeholder=None if processor is None else processor.chat_placeholder,
                max_images=None if processor is None else processor.max_images)
            # The template already holds the special tokens (BOS and so on).
            ids = tokenizer.encode(rendered.text, add_special_tokens=False)
            prompt = {"prompt": rendered.text, "prompt_token_ids": ids}
            if rendered.images:
                prompt["multi_modal_data"] = {"image": self._load_images(rendered.images)}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    # ---- helpers -------------------------------------------------------------------------

    def _load_images(self, refs: list) -> list:
        """A chat's images, URLs fetched under the engine's media settings (the same checks
        as the server's)."""
        import asyncio

        from folio.multimodal.media_fetch import MediaFetcher
        fetcher = MediaFetcher(self.llm_engine.config.multimodal.media)
        return asyncio.run(fetcher.load_images(refs))

    def _expand(self, name: str, value: Any, count: int, default: Any = ...) -> list:
        if value is None and default is ...:
            value = self.get_default_sampling_params()
        elif value is None:
            return [default] * count
        if isinstance(value, (list, tuple)):
            if len(value) != count:
                raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
            return list(value)
        return [value] * count

    def _next_request_id(self) -> str:
        request_id = str(self._request_counter)
        self._request_counter += 1
        return request_id

    def _add(self, prompt: Any, params: SamplingParams, priority: int, salt: str | None,
             lora_request: LoRARequest | None = None) -> str:
        return self.llm_engine.add_request(self._next_request_id(), prompt, params,
                                           priority=priority, cache_salt=salt,
                                           lora_request=lora_request)

    def _step(self, results: dict[str, Any], progress: Any = None) -> None:
        """One engine step; its finished outputs into `results`."""
        for output in self.llm_engine.step():
            if output.finished:
                results[output.request_id] = output
                if progress is not None:
                    progress.update(1)

    def _run(self, request_ids: list[str], use_tqdm: bool,
             results: dict[str, Any] | None = None) -> list[Any]:
        """Step until every request is done; outputs in `request_ids` order (`results`:
        outputs finished in steps run before)."""
        engine = self.llm_engine
        results = {} if results is None else results
        progress = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm.auto import tqdm
            progress = tqdm(total=len(request_ids), initial=len(results),
                            desc="Processed prompts", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                self._step(results, progress)
        finally:
            if progress is not None:
                progress.close()
        return [results[rid] for rid in request_ids]


def _lora_config(enable_lora: bool, config: LoRAConfig | dict | None, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int | None) -> LoRAConfig | None:
    """The LoRA settings LLM(...) was given: a LoRAConfig (or its dict), or enable_lora with
    the separate knobs; None = LoRA off."""
    if isinstance(config, dict):
        config = LoRAConfig(**config)
    if config is not None:
        return config
    if not enable_lora:
        return None
    return LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank,
                      max_cpu_loras=max_cpu_loras)
