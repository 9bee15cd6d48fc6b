"""Engine configuration, grouped by concern and validated once at construction.

No torch import here: the core (scheduler, KV cache manager) reads these configs and must stay
importable without torch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from folio.pooling_params import (CONVERTS, RUNNERS, TASK_ALIASES, PoolerConfig,
                                  PoolingModelInfo)
from folio.reasoning import REASONING_FORMATS

_VALID_DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32")
_CUDAGRAPH_MODES = ("full", "full_decode_only")
DEFAULT_MAX_NUM_SEQS_CUDA = 256
DEFAULT_MAX_NUM_SEQS_CPU = 128
# The pooling runner's default token budget per step (vLLM's offline default on GPUs).
POOLING_MAX_NUM_BATCHED_TOKENS = 16384
_VALID_POLICIES = ("fcfs", "priority")
# KV cache dtypes (vLLM's --kv-cache-dtype): "auto" = the model's dtype. The aliases --dtype
# accepts name the same three float dtypes, and are normalized to these names. The FP8 names
# are vLLM's and stay as given: "fp8" is e4m3 (float8_e4m3fn), as vLLM makes it on CUDA.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", *FP8_KV_CACHE_DTYPES)
_KV_CACHE_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16",
                           "half": "float16", "fp16": "float16"}
# How weights are kept (vLLM's --quantization names): "gguf" = a GGUF file's quantized
# matrices stay packed and the matmuls run on them (CPU: all of them; CUDA: the projections); "int8" = any checkpoint's projections
# and output matrix quantized on load to int8 per output channel (CPU); "fp8" = an FP8
# checkpoint, or a float one whose projections are quantized to FP8 on load;
# "compressed-tensors", "awq", "gptq" = checkpoints quantized in those formats (read from
# config.json's quantization_config, which also picks them when the field is None); "none" =
# every weight dequantized to the model dtype (the reference path). None = the checkpoint's
# method, else "gguf" for a GGUF model, else "none". vLLM's kernel-specific names
# awq_marlin and gptq_marlin are accepted for awq and gptq, fbgemm_fp8 for fp8.
QUANTIZATION_METHODS = ("none", "gguf", "int8", "fp8", "compressed-tensors", "awq", "gptq")
QUANTIZATION_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq",
                        "compressed_tensors": "compressed-tensors", "fbgemm_fp8": "fp8"}


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{field_name} {message}")


def normalize_kv_cache_dtype(value: object) -> str:
    """One of KV_CACHE_DTYPES for `value` (case-insensitive; "bf16", "fp16", "half", "float",
    "fp32" become the full names), or a ValueError naming the field. vLLM's other FP8 cache
    names (fp8_inc, fp8_ds_mla: other hardware, other layouts) get their own message."""
    name = value.lower() if isinstance(value, str) else value
    if isinstance(name, str) and name.startswith("fp8") and name not in FP8_KV_CACHE_DTYPES:
        raise ValueError(f"cache_dtype {value!r} is not supported: the FP8 KV cache dtypes are "
                         f"{list(FP8_KV_CACHE_DTYPES)}")
    name = _KV_CACHE_DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name
    _require(name in KV_CACHE_DTYPES, "cache_dtype",
             f"must be one of {list(KV_CACHE_DTYPES)} (or an alias: "
             f"{list(_KV_CACHE_DTYPE_ALIASES)}), got {value!r}")
    return name


@dataclass
class ModelConfig:
    """Which weights to run and how to read them."""

    model: str | None = None          # HF directory, hub id or .gguf file; None = embedded default
    tokenizer: str | None = None      # defaults to the model's own tokenizer
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    revision: str | None = None
    device: str = "auto"
    # Sampling defaults: "auto" reads the model's generation_config.json, "folio" (or "vllm")
    # ignores it, anything else is a directory holding a generation_config.json.
    generation_config: str = "auto"
    # True = always run the model eagerly; False = replay CUDA graphs (on CUDA with the Triton
    # attention backend only; other devices always run eagerly).
    enforce_eager: bool = False
    # vLLM's --enable-sleep-mode: sleep / wake_up may free the device between jobs.
    enable_sleep_mode: bool = False
    # Which steps replay CUDA graphs (vLLM's cudagraph_mode names): "full" = pure-decode steps
    # and mixed steps (prefill chunks) at padded token counts; "full_decode_only" = pure-decode
    # steps only, mixed steps run eagerly.
    cudagraph_mode: str = "full"
    quantization: str | None = None   # one of QUANTIZATION_METHODS; None = by model and device
    # vLLM's --runner: "generate" (sample tokens), "pooling" (embeddings, classification,
    # scores), "auto" = by the architecture (model/pooling_info.py: resolve_runner).
    runner: str = "auto"
    # vLLM's --convert: how the pooling runner uses a model of another kind ("embed": a
    # decoder's last hidden state; "classify"; "reward": per-token classification).
    convert: str = "auto"
    # vLLM's older --task (embed, classify, score, reward, generate): sets runner and convert.
    task: str | None = None
    # --pooler-config JSON: pooling_type, normalize, use_activation over the model's own.
    pooler_config: dict | None = None
    # --hf-overrides JSON: set on the model's transformers config after it is read (e.g. a
    # decoder reranker's architectures and classifier_from_token, as vLLM documents them).
    hf_overrides: dict | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.dtype, str) and self.dtype.lower() in _VALID_DTYPES,
                 "dtype", f"must be one of {list(_VALID_DTYPES)}, got {self.dtype!r}")
        self.dtype = self.dtype.lower()
        _require(isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed",
                 f"must be an int, got {self.seed!r}")
        if self.max_model_len is not None:
            _require(isinstance(self.max_model_len, int) and self.max_model_len >= 1,
                     "max_model_len", f"must be a positive int, got {self.max_model_len!r}")
        _require(self.device in ("auto", "cpu", "cuda"), "device",
                 f"must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        _require(isinstance(self.enforce_eager, bool), "enforce_eager",
                 f"must be a bool, got {self.enforce_eager!r}")
        _require(isinstance(self.cudagraph_mode, str)
                 and self.cudagraph_mode.lower() in _CUDAGRAPH_MODES, "cudagraph_mode",
                 f"must be one of {list(_CUDAGRAPH_MODES)}, got {self.cudagraph_mode!r}")
        self.cudagraph_mode = self.cudagraph_mode.lower()
        if isinstance(self.quantization, str):
            self.quantization = QUANTIZATION_ALIASES.get(self.quantization.lower(),
                                                         self.quantization.lower())
        _require(self.quantization is None or self.quantization in QUANTIZATION_METHODS,
                 "quantization", f"must be one of {list(QUANTIZATION_METHODS)}, got "
                 f"{self.quantization!r}")
        if self.task is not None:
            _require(self.task in TASK_ALIASES, "task",
                     f"must be one of {sorted(TASK_ALIASES)}, got {self.task!r}")
            runner, convert = TASK_ALIASES[self.task]
            if self.runner == "auto":
                self.runner = runner
            if self.convert == "auto":
                self.convert = convert
        _require(self.runner in RUNNERS, "runner",
                 f"must be one of {list(RUNNERS)}, got {self.runner!r}")
        _require(self.convert in CONVERTS, "convert",
                 f"must be one of {list(CONVERTS)}, got {self.convert!r}")
        PoolerConfig.from_dict(self.pooler_config)   # its own errors name the field
        _require(self.hf_overrides is None or isinstance(self.hf_overrides, dict),
                 "hf_overrides", f"must be a JSON object, got {self.hf_overrides!r}")


@dataclass
class CacheConfig:
    """The paged KV cache: block geometry, size, dtype and prefix caching."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    # Memory for the KV cache on CPU; None = a default sized from this machine's free memory.
    kv_cache_memory_bytes: int | None = None
    # Fixes the number of blocks (vLLM's name), for tests and capacity planning.
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    # The KV cache's dtype (vLLM's name; --kv-cache-dtype): "auto" = the model's dtype, or
    # one of KV_CACHE_DTYPES (aliases normalized). A 2-byte cache on a float32 model holds
    # twice the tokens in the same memory; an FP8 cache (1 byte, scaled per layer and KV
    # head: folio.model.attention.fp8) twice those of a 2-byte one.
    cache_dtype: str = "auto"
    # FP8 cache only (vLLM's --calculate-kv-scales): each layer's K and V scales are computed
    # once, from the first step's K/V (amax / 200 and amax / 100, vLLM's), replacing the
    # checkpoint's or the default 1.0, then stay fixed.
    calculate_kv_scales: bool = False
    # The most of the usable blocks that pins may hold: finished requests' blocks kept out of
    # the LRU eviction for a time-to-live (a stored response's, for its continuation;
    # folio/core/kv_pins.py), so that pins never crowd out the prefix cache of other traffic.
    # 0 = no pins.
    kv_pin_max_fraction: float = 0.5
    # The host-memory KV tier (vLLM's --kv-offloading-size), GiB: prefix blocks evicted from
    # the device cache are kept there and loaded back on a hit (folio/core/kv_offload.py).
    # None = off.
    kv_offloading_size: float | None = None
    # The disk KV tier below it (folio's own): blocks the host tier evicts are kept as files
    # in this directory, up to kv_disk_size GiB, and survive a restart. None = off.
    kv_disk_path: str | None = None
    kv_disk_size: float | None = None

    def __post_init__(self) -> None:
        self.cache_dtype = normalize_kv_cache_dtype(self.cache_dtype)
        if self.kv_offloading_size is not None:
            _require(isinstance(self.kv_offloading_size, (int, float))
                     and not isinstance(self.kv_offloading_size, bool)
                     and 0 < self.kv_offloading_size <= 4096, "kv_offloading_size",
                     f"must be a size in GiB in (0, 4096], got {self.kv_offloading_size!r}")
            _require(self.enable_prefix_caching, "kv_offloading_size",
                     "the host KV tier keeps prefix-cache blocks: enable_prefix_caching "
                     "must be on")
        if self.kv_disk_path is not None or self.kv_disk_size is not None:
            _require(self.kv_disk_path is not None and self.kv_disk_size is not None,
                     "kv_disk_path", "the disk KV tier needs both kv_disk_path and kv_disk_size")
            _require(isinstance(self.kv_disk_size, (int, float))
                     and not isinstance(self.kv_disk_size, bool)
                     and 0 < self.kv_disk_size <= 1 << 20, "kv_disk_size",
                     f"must be a size in GiB in (0, 1048576], got {self.kv_disk_size!r}")
            _require(self.kv_offloading_size is not None, "kv_disk_path",
                     "the disk KV tier sits below the host tier: give kv_offloading_size too")
        _require(isinstance(self.kv_pin_max_fraction, (int, float))
                 and not isinstance(self.kv_pin_max_fraction, bool)
                 and 0.0 <= self.kv_pin_max_fraction <= 1.0, "kv_pin_max_fraction",
                 f"must be in [0, 1], got {self.kv_pin_max_fraction!r}")
        _require(isinstance(self.calculate_kv_scales, bool), "calculate_kv_scales",
                 f"must be a bool, got {self.calculate_kv_scales!r}")
        _require(isinstance(self.block_size, int) and self.block_size >= 1
                 and self.block_size & (self.block_size - 1) == 0,
                 "block_size", f"must be a positive power of two, got {self.block_size!r}")
        if self.kv_cache_memory_bytes is not None:
            _require(isinstance(self.kv_cache_memory_bytes, int) and self.kv_cache_memory_bytes > 0,
                     "kv_cache_memory_bytes", f"must be a positive int, got {self.kv_cache_memory_bytes!r}")
        if self.num_gpu_blocks_override is not None:
            _require(isinstance(self.num_gpu_blocks_override, int) and self.num_gpu_blocks_override >= 1,
                     "num_gpu_blocks_override",
                     f"must be a positive int, got {self.num_gpu_blocks_override!r}")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization!r}")

    def metrics_info(self) -> dict[str, str]:
        """The settings `cache_config_info` carries as labels (as vLLM's does, e.g. the KV
        cache's dtype); the block count is added where it is known."""
        return {"block_size": str(self.block_size), "cache_dtype": self.cache_dtype,
                "calculate_kv_scales": str(self.calculate_kv_scales),
                "enable_prefix_caching": str(self.enable_prefix_caching),
                "gpu_memory_utilization": str(self.gpu_memory_utilization)}


@dataclass
class SchedulerConfig:
    """How each step's token budget is shared out."""

    # None = a default chosen in EngineConfig by device: 256 on CUDA (vLLM's long-standing
    # default; fewer leaves an H200 idle on batch workloads), 128 on CPU.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None  # None = a default chosen in EngineConfig
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    # Schedule step N+1 while step N runs on the device (its sampled ids feed N+1 on the
    # device). None = on with CUDA, off on CPU (where the host runs the kernels itself, so
    # there is nothing to overlap).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        _require(self.async_scheduling is None or isinstance(self.async_scheduling, bool),
                 "async_scheduling", f"must be a bool or None, got {self.async_scheduling!r}")
        if self.max_num_seqs is not None:
            _require(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
                     "max_num_seqs", f"must be a positive int, got {self.max_num_seqs!r}")
        if self.max_num_batched_tokens is not None:
            _require(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
                     "max_num_batched_tokens",
                     f"must be a positive int, got {self.max_num_batched_tokens!r}")
        _require(self.policy in _VALID_POLICIES, "scheduling_policy",
                 f"must be one of {list(_VALID_POLICIES)}, got {self.policy!r}")


_STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "guidance")
_REASONING_PARSERS = tuple(REASONING_FORMATS)  # deepseek_r1, qwen3, mistral, deepseek_v3


@dataclass
class StructuredOutputsConfig:
    """Constrained decoding (vLLM's `--structured-outputs-config`)."""

    # "auto" picks per request: xgrammar first, guidance for what xgrammar rejects (and Lark).
    backend: str = "auto"
    # With a reasoning parser, a constraint applies only after the model's reasoning ends
    # (its end tag), so the model thinks freely and the answer is constrained.
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        _require(self.backend in _STRUCTURED_OUTPUT_BACKENDS, "structured_outputs_backend",
                 f"must be one of {list(_STRUCTURED_OUTPUT_BACKENDS)}, got {self.backend!r}")
        _require(self.reasoning_parser is None or self.reasoning_parser in _REASONING_PARSERS,
                 "reasoning_parser",
                 f"must be one of {list(_REASONING_PARSERS)}, got {self.reasoning_parser!r}")


_EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# Set (to 1) by the test suite: every step message and reply goes through msgpack and back.
DEBUG_STEP_MESSAGES_ENV = "FOLIO_DEBUG_STEP_MESSAGES"
# The executor backend when none is given (pytest --executor-backend mp runs the suites so).
EXECUTOR_BACKEND_ENV = "FOLIO_DISTRIBUTED_EXECUTOR_BACKEND"


@dataclass
class ParallelConfig:
    """How the model's workers run (vLLM's `--distributed-executor-backend`)."""

    # "uni": one worker in the engine-core process; "mp": workers in their own processes,
    # fed the step messages over ZMQ; "ray": those workers as Ray actors.
    distributed_executor_backend: str | None = field(
        default_factory=lambda: os.environ.get(EXECUTOR_BACKEND_ENV) or "uni")
    # Workers of the mp executor that each hold a whole replica of the model and run every
    # step (rank 0 answers); with tensor parallelism the workers are its ranks instead.
    num_workers: int = 1
    # Tensor parallelism (vLLM's --tensor-parallel-size): the model's layers split over this
    # many workers (folio/model/tensor_parallel.py), which then run on the mp executor.
    tensor_parallel_size: int = 1
    # Pipeline parallelism (vLLM's --pipeline-parallel-size): the layers split into this many
    # stages, each a tensor-parallel group of workers (folio/model/pipeline_parallel.py);
    # `pp_layer_partition`: the layers of each stage, "8,8,7,7" (default: an even split).
    pipeline_parallel_size: int = 1
    pp_layer_partition: str | None = None
    # Data parallelism (vLLM's --data-parallel-size): this many engine cores, each with its
    # own replica of the model (and its own tensor-parallel group), behind one API server
    # (folio/engine/dp_async_llm.py); `data_parallel_rank` is the replica an engine core is.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # Expert parallelism (vLLM's --enable-expert-parallel): with tensor_parallel_size > 1, a
    # mixture of experts spreads its experts (whole) over the ranks instead of being refused.
    enable_expert_parallel: bool = False
    # One rank (tensor and pipeline size 1) on the mp or ray executor that still joins a
    # torch.distributed group (NCCL on CUDA, gloo on the CPU) of world size 1 and runs the
    # tensor-parallel code path: sharded loading, vocabulary-parallel embedding and logits,
    # the all-reduces (in the CUDA graphs too). What N ranks run, tested on one device; it
    # costs a collective per reduction, so it is off unless asked for.
    distributed_single_rank: bool = False
    # Encode and decode every step message and reply (msgpack) even in process, and check
    # they come back equal: what crosses a process boundary is then tested everywhere.
    debug_step_messages: bool = field(
        default_factory=lambda: os.environ.get(DEBUG_STEP_MESSAGES_ENV, "0") == "1")

    def __post_init__(self) -> None:
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = os.environ.get(EXECUTOR_BACKEND_ENV) or "uni"
        _require(self.distributed_executor_backend in _EXECUTOR_BACKENDS,
                 "distributed_executor_backend",
                 f"must be one of {list(_EXECUTOR_BACKENDS)}, got "
                 f"{self.distributed_executor_backend!r}")
        _require(isinstance(self.num_workers, int) and self.num_workers >= 1, "num_workers",
                 f"must be a positive int, got {self.num_workers!r}")
        _require(self.num_workers == 1 or self.distributed_executor_backend in ("mp", "ray"),
                 "num_workers", "above 1 needs distributed_executor_backend='mp' or 'ray'")
        _require(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
                 "tensor_parallel_size", f"must be a positive int, got "
                 f"{self.tensor_parallel_size!r}")
        _require(isinstance(self.data_parallel_size, int) and self.data_parallel_size >= 1,
                 "data_parallel_size", f"must be a positive int, got {self.data_parallel_size!r}")
        _require(0 <= self.data_parallel_rank < self.data_parallel_size, "data_parallel_rank",
                 f"must be in [0, {self.data_parallel_size}), got {self.data_parallel_rank!r}")
        _require(isinstance(self.pipeline_parallel_size, int) and self.pipeline_parallel_size >= 1,
                 "pipeline_parallel_size", f"must be a positive int, got "
                 f"{self.pipeline_parallel_size!r}")
        _require(self.pp_layer_partition is None or self.pipeline_parallel_size > 1,
                 "pp_layer_partition", "needs pipeline_parallel_size > 1")
        world = self.world_size
        _require(not self.distributed_single_rank
                 or (world == 1 and self.num_workers == 1
                     and self.distributed_executor_backend in ("mp", "ray")),
                 "distributed_single_rank", "needs one rank (tensor_parallel_size and "
                 "pipeline_parallel_size 1, one worker) on distributed_executor_backend 'mp' "
                 "or 'ray'")
        if world > 1:
            # each rank is a worker process (as vLLM, mp is the default for N > 1)
            _require(self.num_workers in (1, world), "num_workers",
                     "with tensor or pipeline parallelism the workers are its ranks: leave "
                     "num_workers unset")
            if self.distributed_executor_backend == "uni":
                self.distributed_executor_backend = "mp"
            self.num_workers = world

    @property
    def world_size(self) -> int:
        """The ranks of one replica: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def joins_process_group(self) -> bool:
        """Whether the workers join a torch.distributed group (several ranks, or one by
        `distributed_single_rank`)."""
        return self.world_size > 1 or self.distributed_single_rank


@dataclass
class RequestLimitsConfig:
    """Upper bounds on every request field that sizes work, checked in the front end (the API
    process, or LLM offline) before anything is allocated. vLLM's names where it has them
    (`max_logprobs`); the defaults follow OpenAI's (n <= 128, 20 logprobs)."""

    max_n: int = 128                  # n and best_of
    max_logprobs: int = 20            # logprobs, top_logprobs, prompt_logprobs (-1: no limit)
    max_prompts: int = 256            # prompts in one batched completions request
    max_stop_strings: int = 64
    max_stop_string_chars: int = 512
    max_logit_bias_entries: int = 1024
    max_token_id_list: int = 4096     # allowed_token_ids, stop_token_ids
    max_bad_words: int = 256
    max_bad_word_chars: int = 512
    max_schema_bytes: int = 1 << 20   # a structured-output schema / grammar, serialized
    max_schema_depth: int = 64        # JSON nesting of a schema (vLLM refuses deeper than 64)
    max_tools: int = 128              # OpenAI's limit on tools in one chat request
    max_pooling_inputs: int = 2048    # OpenAI's limit on inputs of one embeddings request
    max_json_depth: int = 128         # nesting of a request body on the server

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            _require(isinstance(value, int) and not isinstance(value, bool)
                     and (value >= 1 or (name == "max_logprobs" and value == -1)),
                     name, f"must be a positive int, got {value!r}")


def _json_object(value: "str | dict", name: str) -> dict:
    """A config given as the CLI's JSON text or as a dict (offline), as a dict; ValueError
    naming `name` otherwise."""
    if isinstance(value, str):
        import json
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    _require(isinstance(value, dict), name, f"must be a JSON object, got {type(value).__name__}")
    return value


SPEC_METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp")
# The methods whose drafts come from a model the worker runs (its own KV cache, beside the
# target's); the others draft on the host, in the scheduler.
MODEL_SPEC_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# The methods that need `model` (mtp's module is in the target's own checkpoint).
_SPEC_METHODS_WITH_MODEL = ("draft_model", "eagle", "eagle3")
MAX_SPECULATIVE_TOKENS = 32
# vLLM's older method names, read as folio's.
_SPEC_METHOD_ALIASES = {"deepseek_mtp": "mtp", "[ngram]": "ngram"}
# vLLM's older way of asking for prompt lookup: `model` "[ngram]" (or "ngram"), no method.
_SPEC_NGRAM_MODELS = ("ngram", "[ngram]")
# vLLM's SpeculativeConfig keys that folio accepts and does not use, so that a config written
# for vLLM parses: the remote-code revision (folio runs no remote code), the draft's eager
# mode (it follows the target's CUDA graphs), vLLM's padded-drafter and argmax-reduction
# switches (its own kernels' choices) and the older log switches.
_SPEC_UNUSED_KEYS = ("code_revision", "enforce_eager", "disable_padded_drafter_batch",
                     "use_local_argmax_reduction", "disable_log_stats", "disable_logprobs")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `--speculative-config` JSON). A proposer guesses up to
    `num_speculative_tokens` tokens per request and step; the model checks them in one pass
    and a rejection sampler keeps the output distribution exactly the model's.

    `ngram` (prompt lookup): the longest n-gram (prompt_lookup_max down to prompt_lookup_min
    tokens) ending the request's tokens that occurred earlier in them proposes the tokens that
    followed it there.
    `suffix` (SuffixDecoding): the longest match of the context's suffix (up to
    suffix_decoding_max_tree_depth tokens) in the request itself or in the outputs of the
    last suffix_decoding_max_cached_requests requests, drafting up to max_spec_factor times
    the match length while each token's frequency share is at least min_token_prob.
    Each step verifies the number of drafts that maximises the expected tokens per second
    (measured step costs and acceptance; spec/policy.py) unless adaptive_draft_length is false.
    `draft_model`: `model` (a path or hub id of any model folio runs, with the target's
    vocabulary) drafts greedily, k steps per verify step, on its own KV cache (the target's
    block table, so its capacity in blocks is the target's).
    `eagle` / `eagle3`: `model` is an EAGLE or EAGLE-3 head in the published format
    (folio/model/eagle.py), drafting greedily in a chain from the target's hidden states.
    `mtp`: the target's own multi-token-prediction module (DeepSeek-V3's
    num_nextn_predict_layers, folio/model/mtp.py) drafts the same way; `model` is left out.
    Giving `model` without `method` picks eagle3 or eagle when the name says so, else
    draft_model, as vLLM does.
    `num_speculative_tokens` left out: 4 for ngram, draft_model and the heads, the tree depth
    (at most 32) for suffix.
    The shared suffix index holds depth entries per output token, so its default cache is 64
    requests (vLLM's is 10,000, in a C++ suffix tree)."""

    method: str | None = None       # None: "draft_model" when `model` is given, else ngram
    num_speculative_tokens: int | None = None
    model: str | None = None
    revision: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 64
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # folio's own key (vLLM has none): false verifies every draft the proposer gives instead
    # of choosing k per step from measured step times and acceptance (reproducible shapes).
    adaptive_draft_length: bool = True
    # vLLM's: no drafts while this many requests or more are running (None = no cap). The
    # adaptive length already rests at k = 0 where drafting would cost; this is a hard cap
    # on top of either length policy (core/spec/policy.py's BatchCappedDraftLength).
    disable_by_batch_size: int | None = None
    # vLLM's: the draft's tensor-parallel size. folio runs a draft model or head with the
    # target's (EngineConfig.finalize refuses another); None = the target's.
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if self.method in _SPEC_METHOD_ALIASES:
            self.method = _SPEC_METHOD_ALIASES[self.method]
        if self.method in (None, "ngram") and self.model in _SPEC_NGRAM_MODELS:
            self.method, self.model = "ngram", None
        if self.method is None:
            # vLLM's guess from the name when only a model is given
            name = (self.model or "").lower()
            self.method = "ngram" if self.model is None else "eagle3" if "eagle3" in name \
                else "eagle" if "eagle" in name else "draft_model"
        _require(self.method in SPEC_METHODS, "speculative_config.method",
                 f"must be one of {list(SPEC_METHODS)}, got {self.method!r}")
        if self.method == "mtp":
            _require(self.model is None or isinstance(self.model, str),
                     "speculative_config.model",
                     "for mtp is the target model (its own MTP layers), or left out")
        elif self.method in _SPEC_METHODS_WITH_MODEL:
            _require(isinstance(self.model, str) and self.model != "",
                     "speculative_config.model",
                     f"method {self.method!r} needs the draft model's path or hub id")
        else:
            _require(self.model is None, "speculative_config.model",
                     f"is for a draft model; method {self.method!r} drafts without one")
        depth = self.suffix_decoding_max_tree_depth
        _require(isinstance(depth, int) and not isinstance(depth, bool) and 1 <= depth <= 64,
                 "speculative_config.suffix_decoding_max_tree_depth",
                 f"must be an int in [1, 64], got {depth!r}")
        cached = self.suffix_decoding_max_cached_requests
        _require(isinstance(cached, int) and not isinstance(cached, bool)
                 and 0 <= cached <= 10000, "speculative_config.suffix_decoding_max_cached_requests",
                 f"must be an int in [0, 10000], got {cached!r}")
        factor = self.suffix_decoding_max_spec_factor
        _require(isinstance(factor, (int, float)) and 0 < factor <= 64,
                 "speculative_config.suffix_decoding_max_spec_factor",
                 f"must be a number in (0, 64], got {factor!r}")
        prob = self.suffix_decoding_min_token_prob
        _require(isinstance(prob, (int, float)) and 0 <= prob <= 1,
                 "speculative_config.suffix_decoding_min_token_prob",
                 f"must be a number in [0, 1], got {prob!r}")
        cap = self.disable_by_batch_size
        _require(cap is None or (isinstance(cap, int) and not isinstance(cap, bool)
                                 and 2 <= cap <= 1 << 20),
                 "speculative_config.disable_by_batch_size",
                 f"must be an int in [2, {1 << 20}] (as vLLM: more than 1), got {cap!r}")
        tp = self.draft_tensor_parallel_size
        _require(tp is None or (isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1),
                 "speculative_config.draft_tensor_parallel_size",
                 f"must be a positive int, got {tp!r}")
        _require(isinstance(self.adaptive_draft_length, bool),
                 "speculative_config.adaptive_draft_length",
                 f"must be true or false, got {self.adaptive_draft_length!r}")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = min(depth, MAX_SPECULATIVE_TOKENS) \
                if self.method == "suffix" else 4
        k = self.num_speculative_tokens
        _require(isinstance(k, int) and not isinstance(k, bool)
                 and 1 <= k <= MAX_SPECULATIVE_TOKENS,
                 "speculative_config.num_speculative_tokens",
                 f"must be an int in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        # vLLM's defaults: both 5 when neither is given; one given sets the other. (Looking
        # down to 1-token matches drafted more and was accepted less: on this VM's editing
        # workload 3.3-3.5 tokens a verify step against 4.1-4.2, 1.2-1.3x against 1.5-1.7x.)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo, hi = 5, 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            _require(isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 64,
                     f"speculative_config.{name}", f"must be an int in [1, 64], got {value!r}")
        _require(lo <= hi, "speculative_config.prompt_lookup_min",
                 f"({lo}) must not exceed prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    @property
    def drafts_on_worker(self) -> bool:
        """The drafts come from a model the worker runs, not from the scheduler's host."""
        return self.method in MODEL_SPEC_METHODS

    @classmethod
    def from_json(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From the CLI's JSON text, a dict (LLM(speculative_config=...)) or None; unknown
        keys are an error naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = _json_object(value, "speculative_config")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known - set(_SPEC_UNUSED_KEYS))
        _require(not unknown, "speculative_config", f"has unknown keys {unknown}; known: "
                 f"{sorted(known)} (and vLLM's {list(_SPEC_UNUSED_KEYS)}, unused)")
        return cls(**{k: v for k, v in value.items() if k in known})


# --kv-transfer-config's connectors folio has: OffloadingConnector (vLLM's name) is the host
# KV tier (folio/core/kv_offload.py); P2pConnector moves a prompt's KV from a prefill server
# to a decode server (disaggregated prefill, folio/core/kv_p2p.py), over ZMQ between the two
# workers' processes.
OFFLOADING_CONNECTOR = "OffloadingConnector"
P2P_CONNECTOR = "P2pConnector"
# vLLM's disaggregated-prefill connectors: a config written for vLLM runs folio's P2pConnector
# (the same kv_role and kv_transfer_params flow; folio's transport, which the log names).
P2P_ALIASES = ("P2pNcclConnector", "NixlConnector")
KV_CONNECTORS = (OFFLOADING_CONNECTOR, P2P_CONNECTOR, *P2P_ALIASES)
_KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# vLLM's other KVTransferConfig keys: accepted (a config written for vLLM parses), unused by
# the connectors folio has.
_KV_TRANSFER_UNUSED_KEYS = ("engine_id", "kv_buffer_device", "kv_buffer_size", "kv_rank",
                            "kv_parallel_size", "kv_connector_module_path",
                            "kv_load_failure_policy")
# P2pConnector's kv_connector_extra_config keys and their defaults: seconds a consumer waits
# for a transfer before it computes the prompt itself; seconds a producer keeps a finished
# prompt's blocks for a consumer that never comes; the hosts a consumer pulls from (the
# kv_transfer_params of a request name one, so a client cannot make the server connect
# anywhere else; default: kv_ip's).
P2P_DEFAULTS = {"transfer_timeout": 30.0, "hold_timeout": 120.0, "producer_hosts": None}


@dataclass
class KVTransferConfig:
    """vLLM's --kv-transfer-config JSON.

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config":
    {"cpu_bytes_to_use": N}} keeps evicted prefix blocks in N bytes of host memory, as
    --kv-offloading-size N/2^30 does.

    {"kv_connector": "P2pConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
    "kv_ip": "127.0.0.1", "kv_port": P} serves (producer) or fetches (consumer) a prompt's KV
    for disaggregated prefill: worker rank r of a producer listens on kv_ip:P+r (P = 0: a free
    port); requests carry kv_transfer_params as vLLM's do."""

    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    unused: dict = field(default_factory=dict)
    # The vLLM connector name given, when folio runs its own in its place (P2P_ALIASES).
    alias_of: str | None = None

    def __post_init__(self) -> None:
        _require(self.kv_connector in KV_CONNECTORS, "kv_transfer_config.kv_connector",
                 f"{self.kv_connector!r} is not built into folio; it has {list(KV_CONNECTORS)}")
        _require(self.kv_role in _KV_ROLES, "kv_transfer_config.kv_role",
                 f"must be one of {list(_KV_ROLES)}, got {self.kv_role!r}")
        extra = self.kv_connector_extra_config
        _require(isinstance(extra, dict), "kv_transfer_config.kv_connector_extra_config",
                 "must be a JSON object")
        if self.kv_connector in P2P_ALIASES:
            # vLLM's own transport settings (proxy_ip, send_type, ...) mean nothing here
            self.unused.update({f"kv_connector_extra_config.{k}": extra[k]
                                for k in set(extra) - set(P2P_DEFAULTS)})
            extra = self.kv_connector_extra_config = {k: v for k, v in extra.items()
                                                      if k in P2P_DEFAULTS}
            self.alias_of = self.kv_connector
            self.kv_connector = P2P_CONNECTOR
        if self.kv_connector == P2P_CONNECTOR:
            self._check_p2p(extra)
        else:
            self._check_offloading(extra)

    def _check_offloading(self, extra: dict) -> None:
        _require(self.kv_role == "kv_both", "kv_transfer_config.kv_role",
                 f"{self.kv_connector} both saves and loads: kv_role must be 'kv_both'")
        known = {"cpu_bytes_to_use", "spec_name", "block_size"}
        unknown = sorted(set(extra) - known)
        _require(not unknown, "kv_transfer_config.kv_connector_extra_config",
                 f"has keys folio's {self.kv_connector} does not read: {unknown}; it reads "
                 f"{sorted(known)}")
        _require(extra.get("spec_name", "CPUOffloadingSpec") == "CPUOffloadingSpec",
                 "kv_transfer_config.kv_connector_extra_config.spec_name",
                 "only 'CPUOffloadingSpec' (one host tier; folio's disk tier is --kv-disk-path)")
        size = extra.get("cpu_bytes_to_use")
        _require(isinstance(size, int) and not isinstance(size, bool) and size > 0,
                 "kv_transfer_config.kv_connector_extra_config.cpu_bytes_to_use",
                 f"must be a positive int (bytes of host memory), got {size!r}")

    def _check_p2p(self, extra: dict) -> None:
        unknown = sorted(set(extra) - set(P2P_DEFAULTS))
        _require(not unknown, "kv_transfer_config.kv_connector_extra_config",
                 f"has keys folio's {self.kv_connector} does not read: {unknown}; it reads "
                 f"{sorted(P2P_DEFAULTS)}")
        _require(isinstance(self.kv_ip, str) and self.kv_ip, "kv_transfer_config.kv_ip",
                 f"must be a host address, got {self.kv_ip!r}")
        _require(isinstance(self.kv_port, int) and not isinstance(self.kv_port, bool)
                 and 0 <= self.kv_port < 65536, "kv_transfer_config.kv_port",
                 f"must be a port in [0, 65535] (0 = any free one), got {self.kv_port!r}")
        for name in ("transfer_timeout", "hold_timeout"):
            value = extra.get(name, P2P_DEFAULTS[name])
            _require(isinstance(value, (int, float)) and not isinstance(value, bool)
                     and 0 < value <= 3600,
                     f"kv_transfer_config.kv_connector_extra_config.{name}",
                     f"must be seconds in (0, 3600], got {value!r}")
        hosts = extra.get("producer_hosts")
        _require(hosts is None or (isinstance(hosts, list) and hosts
                                   and all(isinstance(h, str) and h for h in hosts)),
                 "kv_transfer_config.kv_connector_extra_config.producer_hosts",
                 f"must be a non-empty list of host addresses, got {hosts!r}")

    def p2p_option(self, name: str):
        """A P2pConnector extra-config value, or its default."""
        value = self.kv_connector_extra_config.get(name, P2P_DEFAULTS[name])
        if name == "producer_hosts" and value is None:
            return [self.kv_ip]
        return value

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def offloading_size_gib(self) -> float:
        """The host tier's size, as --kv-offloading-size takes it."""
        return self.kv_connector_extra_config["cpu_bytes_to_use"] / 2**30

    @classmethod
    def from_json(cls, value: "str | dict | KVTransferConfig | None") -> "KVTransferConfig | None":
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = _json_object(value, "kv_transfer_config")
        known = {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_ip", "kv_port"}
        unknown = sorted(set(value) - known - set(_KV_TRANSFER_UNUSED_KEYS))
        _require(not unknown, "kv_transfer_config", f"has unknown keys {unknown}")
        return cls(**{k: v for k, v in value.items() if k in known},
                   unused={k: v for k, v in value.items() if k in _KV_TRANSFER_UNUSED_KEYS})


def offloading_size(kv_offloading_size: float | None,
                    kv_transfer_config: "str | dict | KVTransferConfig | None") -> float | None:
    """The host KV tier's size in GiB from --kv-offloading-size or an OffloadingConnector's
    --kv-transfer-config (one of the two)."""
    config = KVTransferConfig.from_json(kv_transfer_config)
    if config is None or config.kv_connector != OFFLOADING_CONNECTOR:
        return kv_offloading_size
    _require(kv_offloading_size is None, "kv_transfer_config",
             "give either kv_offloading_size or an OffloadingConnector kv_transfer_config, "
             "not both")
    return config.offloading_size_gib()


def p2p_transfer(kv_transfer_config: "str | dict | KVTransferConfig | None"
                 ) -> "KVTransferConfig | None":
    """The P2pConnector config of --kv-transfer-config (disaggregated prefill), else None."""
    config = KVTransferConfig.from_json(kv_transfer_config)
    return config if config is not None and config.kv_connector == P2P_CONNECTOR else None


# --max-lora-rank's ceiling: the rank buffers of every projection are sized by it, per slot.
MAX_LORA_RANK_LIMIT = 512
# --max-loras's ceiling: each device slot holds one adapter's A and B for every projection.
MAX_LORAS_LIMIT = 256


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (vLLM's --enable-lora and friends). `max_loras` adapters fit on the
    device at once (slots; a step schedules requests of at most that many distinct adapters),
    each of rank at most `max_lora_rank`; `max_cpu_loras` loaded adapters are kept in host
    memory (LRU) so a swapped-out one comes back without reading its files. `lora_modules`:
    name=path adapters the server lists from the start. Runtime loading over the API
    (`allow_runtime_lora_updating`) takes only paths inside `allowed_lora_dirs`;
    `lora_resolver_dir`: a request naming an unknown adapter loads <dir>/<name> when that is an
    adapter directory (vLLM's filesystem resolver)."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None      # None = max_loras
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    allow_runtime_lora_updating: bool = False
    allowed_lora_dirs: list[str] = field(default_factory=list)
    lora_resolver_dir: str | None = None

    def __post_init__(self) -> None:
        for name, limit in (("max_loras", MAX_LORAS_LIMIT), ("max_lora_rank", MAX_LORA_RANK_LIMIT)):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool)
                     and 1 <= value <= limit, name, f"must be an int in [1, {limit}], got {value!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _require(isinstance(self.max_cpu_loras, int) and not isinstance(self.max_cpu_loras, bool)
                 and self.max_loras <= self.max_cpu_loras <= 4 * MAX_LORAS_LIMIT,
                 "max_cpu_loras", f"must be an int in [max_loras ({self.max_loras}), "
                 f"{4 * MAX_LORAS_LIMIT}], got {self.max_cpu_loras!r}")
        modules = []
        for item in self.lora_modules:
            if isinstance(item, str):
                name, sep, path = item.partition("=")
                _require(bool(sep and name and path), "lora_modules",
                         f"entries are name=path, got {item!r}")
                item = (name, path)
            _require(isinstance(item, (tuple, list)) and len(item) == 2
                     and all(isinstance(x, str) and x for x in item), "lora_modules",
                     f"entries are (name, path) pairs, got {item!r}")
            modules.append((item[0], item[1]))
        names = [name for name, _ in modules]
        _require(len(set(names)) == len(names), "lora_modules",
                 f"names must be unique, got {names}")
        self.lora_modules = modules


# What the server does with a request that arrives while the engine sleeps.
SLEEP_MODE_REQUESTS = ("wait", "reject")


@dataclass
class AdmissionConfig:
    """Load shedding (folio's own; the peers queue without bound). The server refuses a
    request with HTTP 429 and a Retry-After from the measured drain rate once
    `max_waiting_requests` wait for their first step (a request that outranks a waiting one
    sheds it instead); the engine core finishes a request that waited `max_queue_time`
    seconds without a first step (the server answers 429 then too). None = no limit.
    `sleep_mode_requests`: what the server does with requests that arrive while the engine
    sleeps (sleep mode): "wait" for the wake-up, or "reject" them with HTTP 503 and a
    Retry-After."""
    max_waiting_requests: int | None = None
    max_queue_time: float | None = None
    sleep_mode_requests: str = "wait"

    def __post_init__(self) -> None:
        n = self.max_waiting_requests
        _require(n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= 1),
                 "max_waiting_requests", f"must be a positive int, got {n!r}")
        t = self.max_queue_time
        _require(t is None or (isinstance(t, (int, float)) and not isinstance(t, bool)
                               and 0 < t < float("inf")),
                 "max_queue_time", f"must be a positive number of seconds, got {t!r}")
        _require(self.sleep_mode_requests in SLEEP_MODE_REQUESTS, "sleep_mode_requests",
                 f"must be one of {list(SLEEP_MODE_REQUESTS)}, got {self.sleep_mode_requests!r}")


@dataclass
class MediaFetchConfig:
    """How the images a request names by URL are fetched (folio/multimodal/media_fetch.py):
    safe by default (no private or loopback addresses, bounded size, time and pixels)."""
    # Only these hosts (and their subdomains) are fetched; they may resolve to private
    # addresses (the operator named them). None = any public host.
    allowed_media_domains: list[str] | None = None
    allow_private_media_urls: bool = False
    # file:// URLs are read only under this directory (None = refused).
    allowed_local_media_path: str | None = None
    max_media_bytes: int = 20 * 2**20
    timeout: float = 10.0
    max_redirects: int = 5
    max_image_pixels: int = 64 * 2**20
    max_concurrency: int = 8

    def __post_init__(self) -> None:
        for name in ("max_media_bytes", "max_redirects", "max_image_pixels", "max_concurrency"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (
                    0 if name == "max_redirects" else 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.timeout, (int, float)) or not 0 < self.timeout <= 600:
            raise ValueError(f"media timeout must be seconds in (0, 600], got {self.timeout!r}")
        if self.allowed_media_domains is not None:
            self.allowed_media_domains = [d.lower().strip(".") for d in self.allowed_media_domains
                                          if d.strip(".")]
        if self.allowed_local_media_path is not None:
            self.allowed_local_media_path = os.path.realpath(self.allowed_local_media_path)


# Modalities --limit-mm-per-prompt names; the models here take images only.
MM_MODALITIES = ("image", "video", "audio")
# Images one prompt may carry unless --limit-mm-per-prompt says otherwise: each costs an
# encoder pass and hundreds of tokens, so the default is a bound, not vLLM's 999 (videos:
# one, on the models that take them).
DEFAULT_IMAGES_PER_PROMPT = 4
MAX_ITEMS_PER_PROMPT = 64


@dataclass
class MultiModalConfig:
    """A vision-language model's inputs: how many items of each modality one prompt may
    carry (--limit-mm-per-prompt), the HF processor's settings (--mm-processor-kwargs, e.g.
    Qwen2-VL's min_pixels / max_pixels), and how URLs are fetched."""
    limit_mm_per_prompt: dict = field(default_factory=dict)
    mm_processor_kwargs: dict | None = None
    media: MediaFetchConfig = field(default_factory=MediaFetchConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.limit_mm_per_prompt, dict):
            raise ValueError("limit_mm_per_prompt must be a JSON object like {\"image\": 2}")
        for name, value in self.limit_mm_per_prompt.items():
            _require(name in MM_MODALITIES, "limit_mm_per_prompt",
                     f"names modalities {list(MM_MODALITIES)}, got {name!r}")
            _require(isinstance(value, int) and not isinstance(value, bool)
                     and 0 <= value <= MAX_ITEMS_PER_PROMPT, f"limit_mm_per_prompt.{name}",
                     f"must be an int in [0, {MAX_ITEMS_PER_PROMPT}], got {value!r}")
        _require(self.mm_processor_kwargs is None or isinstance(self.mm_processor_kwargs, dict),
                 "mm_processor_kwargs", "must be a JSON object")

    def limit(self, modality: str) -> int:
        """Items of `modality` one prompt may carry."""
        default = {"image": DEFAULT_IMAGES_PER_PROMPT, "video": 1}.get(modality, 0)
        return self.limit_mm_per_prompt.get(modality, default)


def multimodal_config(limit_mm_per_prompt: dict | str | None = None,
                      mm_processor_kwargs: dict | str | None = None, *,
                      allowed_local_media_path: str | None = None,
                      allowed_media_domains: list[str] | None = None,
                      allow_private_media_urls: bool = False,
                      max_media_bytes: int | None = None,
                      media_fetch_timeout: float | None = None,
                      max_image_pixels: int | None = None) -> MultiModalConfig:
    """MultiModalConfig from vLLM's argument names (the JSON flags as text or dicts); None
    leaves a field at its default."""
    import json

    def parsed(name: str, value: dict | str | None) -> dict | None:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"{name} is not valid JSON ({exc}): {value!r}") from None
        return value

    media = {k: v for k, v in dict(allowed_local_media_path=allowed_local_media_path,
                                   allowed_media_domains=allowed_media_domains,
                                   max_media_bytes=max_media_bytes,
                                   timeout=media_fetch_timeout,
                                   max_image_pixels=max_image_pixels).items() if v is not None}
    return MultiModalConfig(
        limit_mm_per_prompt=parsed("limit_mm_per_prompt", limit_mm_per_prompt) or {},
        mm_processor_kwargs=parsed("mm_processor_kwargs", mm_processor_kwargs),
        media=MediaFetchConfig(allow_private_media_urls=allow_private_media_urls, **media))


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    limits: RequestLimitsConfig = field(default_factory=RequestLimitsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # None = no speculative decoding.
    speculative: SpeculativeConfig | None = None
    # None = no LoRA adapters (--enable-lora sets one).
    lora: LoRAConfig | None = None
    # Disaggregated prefill (a P2pConnector --kv-transfer-config); None = off.
    kv_transfer: KVTransferConfig | None = None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # A vision-language model's inputs (limits per prompt, processor settings, fetching).
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    disable_log_stats: bool = True
    # The pooling runner's model (set by the front end once the model is read; None =
    # the generate runner).
    pooling: PoolingModelInfo | None = None

    def set_pooling(self, info: PoolingModelInfo) -> None:
        """Run as a pooling model: an encoder's attention sees the whole input, so its prompt
        runs in one step (no chunked prefill, a token budget of at least max_model_len), and
        prefix-cache hits may skip tokens only where the pooled result does not need their
        hidden states (a causal model pooling the last token)."""
        self.pooling = info
        if self.scheduler.max_num_batched_tokens is None:
            # No decode latency to protect: bigger steps spread each step's host work over
            # more inputs (1,000 texts on a BERT-large took 36 steps at 2,048 tokens, most of
            # their time on the host).
            self.scheduler.max_num_batched_tokens = POOLING_MAX_NUM_BATCHED_TOKENS
        if not info.prefix_caching:
            self.cache.enable_prefix_caching = False
        if not info.is_causal:
            self.scheduler.enable_chunked_prefill = False
        if self.speculative is not None:
            raise ValueError("speculative_config: pooling models do not generate tokens")
        if self.lora is not None:
            raise ValueError("enable_lora: LoRA adapters are served for generation only, not by "
                             "the pooling runner")

    def finalize(self, model_max_len: int) -> None:
        """Fill the defaults that depend on the model, and check the settings agree.

        With device "auto" the device-dependent defaults wait for `finalize_device`: finding
        out whether CUDA is there needs torch, which the front end (the API process) does not
        import; the engine core calls it before it builds the scheduler and the worker."""
        if self.model.max_model_len is None:
            self.model.max_model_len = model_max_len
        sched = self.scheduler
        if sched.max_num_batched_tokens is None:
            # With chunked prefill a modest budget keeps decode latency low; without it, a
            # whole prompt must fit in one step.
            sched.max_num_batched_tokens = (2048 if sched.enable_chunked_prefill
                                            else max(2048, self.model.max_model_len))
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.model.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({sched.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.model.max_model_len}) with chunked prefill disabled: "
                "a long prompt could never be scheduled")
        spec = self.speculative
        if spec is not None and spec.draft_tensor_parallel_size not in (
                None, self.parallel.tensor_parallel_size):
            raise ValueError(
                f"speculative_config.draft_tensor_parallel_size "
                f"({spec.draft_tensor_parallel_size}): folio runs the draft with the target's "
                f"tensor-parallel size ({self.parallel.tensor_parallel_size}); leave it out or "
                "give that")
        self.finalize_device(None if self.model.device == "auto" else self.model.device)

    def finalize_device(self, device_type: str | None) -> None:
        """Fill the defaults that depend on the device ("cuda" or "cpu"; None = not known yet,
        only explicit settings are checked) and check them."""
        sched = self.scheduler
        if sched.max_num_seqs is None and device_type is not None:
            sched.max_num_seqs = (DEFAULT_MAX_NUM_SEQS_CUDA if device_type == "cuda"
                                  else DEFAULT_MAX_NUM_SEQS_CPU)
        if (sched.max_num_seqs is not None and sched.max_num_batched_tokens is not None
                and sched.max_num_batched_tokens < sched.max_num_seqs
                and not sched.enable_chunked_prefill):
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
