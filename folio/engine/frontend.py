"""What every front end (the offline LLMEngine, the server's AsyncLLM) knows about the model
and does before the engine core sees a request: load config and tokenizer, validate and
tokenize, fan n>1 out into child requests."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from folio.config import (EngineConfig, KVTransferConfig, LoRAConfig, MultiModalConfig,
                          RequestLimitsConfig)
from folio.core.mm_inputs import ImageInputData
from folio.core.request import EngineCoreRequest
from folio.engine.lora_checks import LoRAChecker
from folio.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from folio.engine.request_limits import check_kv_fit, check_sampling_limits
from folio.engine.tokenizer import eos_token_ids, load_tokenizer
from folio.model.families import arch_spec_from_hf_config
from folio.model.discovery import ModelSource, load_hf_config, resolve_model_source
from folio.model.lora.adapter_files import check_lora_support
from folio.model.pooling_info import (ENCODER_ARCHS, resolve_pooling_info, resolve_runner,
                                      token_ids_of)
from folio.lora.request import LoRARequest
from folio.pooling_params import PoolerConfig, PoolingModelInfo, PoolingParams, PoolingTask
from folio.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"


def _load_generation_config(path: str) -> Any | None:
    """The directory's generation_config.json as attributes, None without one (the file is
    optional). Read as JSON rather than through transformers' GenerationConfig: importing
    transformers.generation pulls in scikit-learn and torch.distributed, seconds of every
    start for the five numbers read here."""
    try:
        with open(os.path.join(path, GENERATION_CONFIG_FILE), encoding="utf-8") as f:
            fields = json.load(f)
    except (OSError, ValueError):
        return None
    return SimpleNamespace(**fields) if isinstance(fields, dict) else None


@dataclass
class ModelInfo:
    source: ModelSource
    hf_config: Any
    tokenizer: Any
    generation_config: Any | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_model_len: int
    # The pooling runner's model; None = the generate runner.
    pooling: PoolingModelInfo | None = None


def _apply_hf_overrides(hf_config: Any, overrides: dict | None) -> None:
    for name, value in (overrides or {}).items():
        setattr(hf_config, name, value)


def _encoder_max_positions(hf_config: Any) -> int:
    """Positions an encoder can embed: RoBERTa-style models start counting after their
    padding index, so two of max_position_embeddings are never used."""
    total = getattr(hf_config, "max_position_embeddings", None) or 512
    if getattr(hf_config, "model_type", "") in ("roberta", "xlm-roberta"):
        total -= (getattr(hf_config, "pad_token_id", None) or 1) + 1
    return total


def load_model_info(config: EngineConfig, with_tokenizer: bool = True) -> ModelInfo:
    """Resolve the model, read its config and tokenizer, and fill the config's model-dependent
    defaults (max_model_len, the token budget). Raises ValueError for a bad model or setting.
    `with_tokenizer=False` (the engine core's process, which sees only token ids) leaves the
    tokenizer out unless the config needs it (a classifier scoring named tokens): loading it
    imports transformers, seconds of a start."""
    source = resolve_model_source(config.model.model, config.model.revision)
    hf_config, gguf_chat_template = load_hf_config(source)
    _apply_hf_overrides(hf_config, config.model.hf_overrides)
    model_dir = source.path if source.kind == "hf_dir" else None
    pooling = None
    if resolve_runner(config.model.runner, config.model.convert, hf_config,
                      model_dir) == "pooling":
        pooling = resolve_pooling_info(hf_config, model_dir, config.model.convert,
                                       PoolerConfig.from_dict(config.model.pooler_config))
    spec = arch_spec_from_hf_config(hf_config)  # fails early on an unsupported architecture
    if config.lora is not None:
        check_lora_support(spec)
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
    if pooling is not None and pooling.architecture in ENCODER_ARCHS:
        model_max = _encoder_max_positions(hf_config)
    if config.model.max_model_len is not None and config.model.max_model_len > model_max:
        raise ValueError(f"max_model_len={config.model.max_model_len} is larger than the "
                         f"model's max_position_embeddings={model_max}")
    default_len = model_max
    if pooling is not None and pooling.max_seq_length:
        # sentence-transformers' max_seq_length: what the model was trained and is served at
        default_len = min(model_max, pooling.max_seq_length)
    tokenizer = None
    if with_tokenizer or (pooling is not None and pooling.classifier_from_token):
        tokenizer = load_tokenizer(source, config.model.tokenizer, config.model.revision)
    if pooling is not None:
        if pooling.classifier_from_token:
            pooling = dataclasses.replace(pooling, classifier_token_ids=token_ids_of(
                tokenizer, pooling.classifier_from_token))
        config.set_pooling(pooling)
    config.finalize(default_len)
    if tokenizer is not None and gguf_chat_template and not getattr(tokenizer, "chat_template",
                                                                    None):
        tokenizer.chat_template = gguf_chat_template
    eos = eos_token_ids(tokenizer, hf_config, generation_config)
    eos += tuple(t for t in extra_eos if t not in eos)
    return ModelInfo(source, hf_config, tokenizer, generation_config, eos, spec.vocab_size,
                     config.model.max_model_len, pooling)


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
    pooling_params: PoolingParams | None = None


# A pooling request's placeholder sampling parameters: it never samples, but the core's request
# record and the worker's batch rows are shaped for them.
_POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


def check_pooling_params(params: PoolingParams, info: PoolingModelInfo | None) -> PoolingParams:
    """The request's params for this model, task filled in (its default), or a ValueError
    naming the field: a task the model has no head for, `dimensions` it cannot give."""
    if info is None:
        raise ValueError("task: this model runs the generate runner; pooling requests "
                         "(embeddings, scores, classification) need a pooling model "
                         "(--runner pooling)")
    task = params.pooling_task or info.default_task
    if task not in info.tasks:
        raise ValueError(f"task {task.value!r} is not supported by this model ({info.architecture},"
                         f" a{'n embedding' if info.kind == 'embed' else ' classification'} "
                         f"model); it supports {sorted(t.value for t in info.tasks)}")
    # Always a copy, validated again: the engine keeps it while the request runs, and a
    # caller may change its own object meanwhile (4-5 us a request).
    params = params.clone()
    params.task = task.value
    dims = params.dimensions
    if dims is not None:
        if info.kind != "embed" or task not in (PoolingTask.EMBED, PoolingTask.TOKEN_EMBED):
            raise ValueError("dimensions applies to embeddings only")
        if dims > info.hidden_size:
            raise ValueError(f"dimensions ({dims}) is larger than the model's embedding size "
                             f"({info.hidden_size})")
        if dims != info.hidden_size:
            if info.matryoshka_dimensions is None:
                raise ValueError("dimensions: this model does not support Matryoshka "
                                 "representation (its embeddings cannot be shortened)")
            if info.matryoshka_dimensions and dims not in info.matryoshka_dimensions:
                raise ValueError(f"dimensions must be one of {list(info.matryoshka_dimensions)} "
                                 f"for this model, got {dims}")
    return params


def _child_seed(seed: int, index: int) -> int:
    """Seed of the index-th of n samples: seed + index, wrapped into int64."""
    return (seed + index + 2**63) % 2**64 - 2**63


class RequestPreparer:
    def __init__(self, info: ModelInfo, structured_outputs_backend: str = "auto",
                 limits: RequestLimitsConfig | None = None,
                 lora: LoRAConfig | None = None,
                 kv_transfer: KVTransferConfig | None = None,
                 multimodal: MultiModalConfig | None = None) -> None:
        """`kv_transfer`: the engine's P2pConnector config (disaggregated prefill), which
        decides whether requests may carry kv_transfer_params. `multimodal`: a
        vision-language model's limits per prompt and processor settings."""
        self.info = info
        self.kv_transfer = kv_transfer
        self.multimodal = multimodal or MultiModalConfig()
        # A vision-language model's prompt processor (made now: a bad --mm-processor-kwargs
        # fails at start-up, not on the first image).
        self._images = self._make_image_processor()
        # LoRA adapters' checks (a LoRARequest refused with a ValueError when LoRA is off).
        self.lora = LoRAChecker(lora, info.hf_config)
        self.structured_outputs_backend = structured_outputs_backend
        self.limits = limits or RequestLimitsConfig()
        # Tokens the KV cache holds; set once the engine core has sized it.
        self.kv_capacity_tokens: int | None = None
        self.input_processor = InputProcessor(info.tokenizer, info.vocab_size, info.max_model_len)

    def prepare(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                arrival_time: float | None = None, priority: int = 0,
                cache_salt: str | None = None,
                lora_request: LoRARequest | None = None,
                kv_transfer_params: dict | None = None) -> PreparedRequest:
        """Validate and tokenize. Raises ValueError naming the problem; changes no state (but
        remembers a checked adapter)."""
        if self.info.pooling is not None:
            raise ValueError("this model runs the pooling runner: it returns embeddings, "
                             "scores or classes and does not generate text")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if not -(2**63) <= priority < 2**63:  # it crosses the wire to the core as int64
            raise ValueError(f"priority must be a 64-bit signed integer, got one of "
                             f"{priority.bit_length()} bits")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        if kv_transfer_params is not None:
            self._check_kv_transfer_params(kv_transfer_params, params)
        # Bounds first: everything after this point costs time or memory in proportion to them.
        check_sampling_limits(params, self.limits)
        if lora_request is not None:
            self.lora.check(lora_request)
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
        mm_inputs = None
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            prompt, mm_inputs = self._process_images(prompt)
        processed = self.input_processor.process(prompt, params)
        if mm_inputs is None:
            self._check_no_image_tokens(processed.prompt_token_ids)
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
                              arrival, priority, cache_salt, lora_request=lora_request,
                              kv_transfer_params=kv_transfer_params, mm_inputs=mm_inputs)
            for cid, p in zip(child_ids, child_params)]
        return PreparedRequest(request_id, processed, child_ids, child_params, core_requests)

    @property
    def image_processor(self):
        """A vision-language model's prompt processor; None for a text model."""
        return self._images

    def _make_image_processor(self):
        """The model's HF processor with --mm-processor-kwargs and the images allowed per
        prompt (None for a text model)."""
        vision = getattr(self.info.hf_config, "vision_language", None)
        if vision is None:
            return None
        from folio.multimodal.processing import ImagePromptProcessor
        return ImagePromptProcessor.from_pretrained(
            self.info.source.path, vision["image_token_index"], self.multimodal.limit("image"),
            self.multimodal.mm_processor_kwargs, kind=vision["kind"],
            max_videos=self.multimodal.limit("video"))

    def _process_images(self, prompt: dict) -> tuple[dict, list[ImageInputData]]:
        """A prompt dict with multi_modal_data ({"image": a PIL image or a list of them}) and
        its text as 'prompt' (through the model's processor, placeholders expanded) or as
        'prompt_token_ids' (a chat template's tokens: one image token per image, expanded
        here): the token ids, and the images as the engine carries them."""
        processor = self.image_processor
        if processor is None:
            raise ValueError("multi_modal_data: this model takes text only")
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or not data or set(data) - {"image", "video"}:
            raise ValueError("multi_modal_data must be {'image': an image or a list of "
                             "images, 'video': a list of frames or a list of such lists}")
        images = data.get("image", [])
        images = images if isinstance(images, list) else [images]
        if not all(hasattr(image, "convert") and hasattr(image, "size") for image in images):
            raise ValueError("multi_modal_data.image must be PIL images")
        images = [image.convert("RGB") for image in images]
        videos = data.get("video", [])
        if videos and not isinstance(videos, list):
            raise ValueError("multi_modal_data.video must be a list of PIL frames (or a list "
                             "of such lists)")
        if videos and not isinstance(videos[0], list):
            videos = [videos]                              # one video
        if videos and processor.video_token_id is None:
            raise ValueError("multi_modal_data.video: this model takes no video")
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of ints")
            token_ids, inputs = processor.process_tokens(ids, images, videos)
        elif isinstance(text, str) and videos:
            token_ids, inputs = processor.process_tokens(processor.tokenize(text), images,
                                                         videos)
        elif isinstance(text, str):
            token_ids, inputs = processor.process(text, images)
        else:
            raise ValueError("a prompt with multi_modal_data needs its text as 'prompt' (with "
                             "one placeholder per image or video) or 'prompt_token_ids'")
        mm = [ImageInputData(i.content_hash, i.offset, i.length, list(i.pixel_values.shape),
                             i.pixel_values.astype("<f4").tobytes(),
                             None if i.grid_thw is None else list(i.grid_thw),
                             float(i.time_interval))
              for i in inputs]
        return {"prompt": text, "prompt_token_ids": token_ids}, mm

    def _check_no_image_tokens(self, token_ids: list[int]) -> None:
        """A vision-language model's image placeholder token stands for an image's features:
        in a prompt without images it would be read as an ordinary embedding."""
        vision = getattr(self.info.hf_config, "vision_language", None)
        if vision is None:
            return
        if vision["image_token_index"] in token_ids:
            raise ValueError(f"prompt holds the image placeholder token (id "
                             f"{vision['image_token_index']}) but no image")
        video = self._images.video_token_id
        if video is not None and video in token_ids:
            raise ValueError(f"prompt holds the video placeholder token (id {video}) but no "
                             "video")

    def _check_kv_transfer_params(self, kv_transfer_params, params: SamplingParams) -> None:
        """A disaggregated-prefill request's kv_transfer_params: well formed, on an engine
        with a P2pConnector of the matching role, one sequence."""
        from folio.core.kv_p2p import parse_kv_transfer_params
        parsed = parse_kv_transfer_params(kv_transfer_params)
        transfer = self.kv_transfer
        if transfer is None:
            raise ValueError("kv_transfer_params: this engine has no KV connector for "
                             "disaggregated prefill (start it with a P2pConnector "
                             "--kv-transfer-config)")
        if parsed.do_remote_decode and not transfer.is_producer:
            raise ValueError("kv_transfer_params.do_remote_decode: this engine is a "
                             f"{transfer.kv_role}, not a prefill server (kv_producer)")
        if parsed.do_remote_prefill and not transfer.is_consumer:
            raise ValueError("kv_transfer_params.do_remote_prefill: this engine is a "
                             f"{transfer.kv_role}, not a decode server (kv_consumer)")
        if params.n != 1:
            raise ValueError("kv_transfer_params: disaggregated prefill runs one sequence per "
                             f"request (n=1), got n={params.n}")

    def prepare_pooling(self, request_id: str, prompt: PromptType, params: PoolingParams, *,
                        pair: str | None = None, arrival_time: float | None = None,
                        priority: int = 0) -> PreparedRequest:
        """A pooling request (embed, classify, score...): validated against the model's pooling
        heads and tokenized (`pair`: the document of a cross-encoder's (query, document)).
        Raises ValueError naming the field; changes no state."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got "
                             f"{type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool) \
                or not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must be a 64-bit signed int, got {priority!r}")
        params = check_pooling_params(params, self.info.pooling)
        processed = self.input_processor.process_pooling(prompt, params, pair)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        core = EngineCoreRequest(request_id, processed.prompt_token_ids, _POOLING_SAMPLING,
                                 [], arrival, priority, None, params,
                                 processed.token_type_ids)
        return PreparedRequest(request_id, processed, [request_id], [_POOLING_SAMPLING], [core],
                               pooling_params=params)
