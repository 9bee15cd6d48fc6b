"""Engine flags for the command line, with vLLM's names, mapped onto LLM(...) keyword arguments."""
from __future__ import annotations

import argparse
import json
from typing import Any

from folio.config import (KV_CACHE_DTYPES, QUANTIZATION_ALIASES, QUANTIZATION_METHODS,
                          normalize_kv_cache_dtype, offloading_size,
                          p2p_transfer)
from folio.pooling_params import CONVERTS, RUNNERS, TASK_ALIASES, PoolerConfig


def add_engine_args(parser: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
    if model_positional:
        parser.add_argument("model", nargs="?", default=None,
                            help="Hugging Face model directory, hub id (org/name) or .gguf file; "
                                 "default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)")
    parser.add_argument("--revision", default=None, help="hub revision of the model")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weight and activation dtype; auto = the checkpoint's (float16 becomes bfloat16 on CPU)")
    parser.add_argument("--quantization", "-q", default=None, type=_quantization,
                        choices=list(QUANTIZATION_METHODS),
                        help="how weights are kept: fp8 = FP8 W8A8, from an FP8 checkpoint or "
                             "quantized on load per output channel; compressed-tensors, awq, "
                             "gptq = checkpoints in those formats (FP8/INT8 W8A8, INT4 W4A16; "
                             "picked from config.json's quantization_config by default); gguf "
                             "= a GGUF model's quantized matrices stay packed; int8 = any "
                             "model's projections quantized on load to int8 per output channel "
                             "(CPU); none = dequantized to --dtype (the reference); default: the "
                             "checkpoint's method, gguf for a GGUF model, else none")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the engine")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length (prompt + output); default: the model's maximum")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="most requests in one step (default 256 on CUDA, 128 on CPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of one step (default 2048 with chunked prefill)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV cache of shared prompt prefixes")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="split long prompts across steps so decodes keep flowing")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument("--kv-offloading-size", type=float, default=None,
                        help="GiB of host memory for a second KV tier: prefix blocks evicted "
                             "from the device cache are kept there and copied back on a hit "
                             "instead of recomputed (needs prefix caching)")
    parser.add_argument("--kv-transfer-config", default=None,
                        help="vLLM's KV connector JSON. OffloadingConnector (kv_role kv_both, "
                             "kv_connector_extra_config.cpu_bytes_to_use): the host KV tier, "
                             "as --kv-offloading-size. P2pConnector (kv_role kv_producer on a "
                             "prefill server, kv_consumer on a decode server; kv_ip, kv_port): "
                             "disaggregated prefill behind `folio router`")
    parser.add_argument("--kv-disk-path", default=None,
                        help="a directory for a disk KV tier below the host tier: blocks the "
                             "host tier evicts are kept there as files and survive a restart")
    parser.add_argument("--kv-disk-size", type=float, default=None,
                        help="GiB the disk KV tier may use (with --kv-disk-path)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="on a GPU: the share of its memory this engine may use (weights, "
                             "activations and the KV cache; memory other processes hold is "
                             "counted against it); two servers on one GPU: give each "
                             "--kv-cache-memory-bytes instead")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="memory for the KV cache on CPU (default: min(4 GiB, a quarter of free memory))")
    parser.add_argument("--kv-cache-dtype", default="auto", type=_kv_cache_dtype,
                        choices=list(KV_CACHE_DTYPES),
                        help="KV cache dtype; auto = the model's (--dtype); bfloat16 or float16 "
                             "on a float32 model holds twice the tokens in the same memory "
                             "(CPU; on CUDA only the model's dtype); fp8 (= fp8_e4m3) or "
                             "fp8_e5m2: 1 byte per element, twice the tokens of a 16-bit cache, "
                             "scaled per layer by the checkpoint's k/v scales (1.0 without "
                             "them, or see --calculate-kv-scales); fp8_e4m3 on CUDA needs "
                             "compute capability 8.9+")
    parser.add_argument("--calculate-kv-scales", action="store_true",
                        help="with an fp8 KV cache: compute each layer's K and V scales once, "
                             "from the first step's keys and values (amax / 200 and amax / "
                             "100, as vLLM), instead of the checkpoint's or 1.0")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="fix the number of KV cache blocks (testing, capacity planning)")
    parser.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                        help="fcfs, or priority (lower value first, then arrival)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="never use CUDA graphs (otherwise every step replays them on CUDA)")
    parser.add_argument("--enable-sleep-mode", action="store_true",
                        help="allow sleep / wake_up (server: POST /sleep?level=1|2, POST "
                             "/wake_up, GET /is_sleeping): level 1 moves the weights to host "
                             "memory and frees the KV cache, level 2 frees both; requests "
                             "that arrive while asleep wait (the server's "
                             "--sleep-mode-requests reject: 503 instead)")
    parser.add_argument("--cudagraph-mode", default="full", type=str.lower,
                        choices=["full", "full_decode_only"],
                        help="which steps replay CUDA graphs: full = pure-decode and mixed "
                             "(prefill) steps, full_decode_only = pure-decode steps only")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule the next step while the current one runs on the GPU "
                             "(default: on with CUDA, off on CPU)")
    parser.add_argument("--structured-outputs-config.backend", dest="structured_outputs_backend",
                        default="auto", choices=["auto", "xgrammar", "guidance"],
                        help="grammar backend for constrained decoding ('auto': xgrammar, falling "
                             "back to guidance for what xgrammar rejects)")
    parser.add_argument("--speculative-config", default=None,
                        help='speculative decoding, as JSON: {"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                             '"prompt_lookup_min": 2}')
    parser.add_argument("--distributed-executor-backend", default=None,
                        choices=["uni", "mp", "ray"],
                        help="uni: the worker runs in the engine-core process; mp: workers in "
                             "their own processes, fed the step messages over ZMQ; ray: the "
                             "workers as Ray actors (the cluster RAY_ADDRESS names, or a local "
                             "one) (default: uni, mp with --tensor- or --pipeline-parallel-size > 1, or "
                             "$FOLIO_DISTRIBUTED_EXECUTOR_BACKEND)")
    parser.add_argument("--num-workers", type=int, default=1,
                        help="replica workers of the mp executor (each a full copy of the "
                             "model; for testing the step transport)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split the model's layers over this many workers (ranks: "
                             "torch.distributed, gloo on the CPU, NCCL on GPUs; the mp "
                             "executor)")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="split the model's layers into this many stages, run one after "
                             "another on their own workers (each stage a tensor-parallel "
                             "group: TP x PP ranks), with up to this many batches in flight")
    parser.add_argument("--pp-layer-partition", default=None,
                        help="the layers of each pipeline stage, comma-separated (e.g. "
                             "'16,16' or '9,8,8,7'; default: an even split, the earlier "
                             "stages taking the remainder)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="with --tensor-parallel-size N, a mixture-of-experts model's "
                             "experts are spread over the N ranks (each holds 1/N of them, "
                             "whole)")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="serve with this many engine cores, each a replica of the model "
                             "(and of its tensor-parallel group) on its own devices; requests "
                             "go to the replica holding their prefix, else the least loaded "
                             "(folio serve only)")
    _add_pooling_args(parser)
    _add_lora_args(parser)
    _add_limit_args(parser)
    _add_multimodal_args(parser)


# Engine keyword arguments of the multimodal flags (LLM's, and folio.config.multimodal_config's).
MULTIMODAL_FLAGS = ("limit_mm_per_prompt", "mm_processor_kwargs", "allowed_local_media_path",
                     "allowed_media_domains", "allow_private_media_urls", "max_media_bytes",
                     "media_fetch_timeout", "max_image_pixels")


def _add_multimodal_args(parser: argparse.ArgumentParser) -> None:
    from folio.config import MediaFetchConfig
    parser.add_argument("--limit-mm-per-prompt", type=_modality_counts, default=None,
                        help='a vision-language model\'s inputs per prompt, as JSON per '
                             'modality: {"image": 2} (default: 4 images; more get HTTP 400)')
    parser.add_argument("--mm-processor-kwargs", type=_json_object, default=None,
                        help='the model\'s image processor settings, as JSON: Qwen2-VL\'s '
                             '{"min_pixels": 3136, "max_pixels": 1003520}, CLIP\'s '
                             '{"do_center_crop": false} (default: the processor\'s own)')
    parser.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                        help="file:// image URLs are read only under DIR (default: refused)")
    parser.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                        help="image URLs are fetched only from these hosts and their "
                             "subdomains, which may resolve to private addresses (default: "
                             "any host resolving to public addresses only)")
    parser.add_argument("--allow-private-media-urls", action="store_true",
                        help="let image URLs reach loopback, private, link-local and reserved "
                             "addresses (refused by default: a server fetching URLs for its "
                             "clients must not reach its own network)")
    parser.add_argument("--max-media-bytes", type=int, default=MediaFetchConfig.max_media_bytes,
                        help="largest image download or data: URL, in bytes")
    parser.add_argument("--media-fetch-timeout", type=float, default=MediaFetchConfig.timeout,
                        help="seconds one image URL may take to fetch, redirects included")
    parser.add_argument("--max-image-pixels", type=int,
                        default=MediaFetchConfig.max_image_pixels,
                        help="largest image (width x height) decoded; a larger one (a "
                             "decompression bomb) is refused from its header")


def _add_lora_args(parser: argparse.ArgumentParser) -> None:
    from folio.config import LoRAConfig
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters (PEFT directories) on top of the model, "
                             "several in one batch")
    parser.add_argument("--max-loras", type=int, default=LoRAConfig.max_loras,
                        help="adapters on the device at once (a step runs at most this many)")
    parser.add_argument("--max-lora-rank", type=int, default=LoRAConfig.max_lora_rank,
                        help="largest adapter rank served (device memory is sized by it)")
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="adapters kept in host memory, least recently used dropped "
                             "(default: --max-loras)")


def add_lora_serving_args(parser: argparse.ArgumentParser) -> None:
    """The server's LoRA flags: adapters listed from the start, run-time loading."""
    parser.add_argument("--lora-modules", nargs="+", default=None, type=_lora_module,
                        metavar="NAME=PATH",
                        help="adapters served from the start, as name=path or JSON "
                             "{\"name\": ..., \"path\": ...}; clients pick one by `model` "
                             "(implies --enable-lora)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                             "(paths only inside --allowed-lora-dir)")
    parser.add_argument("--allowed-lora-dir", "--lora-allowed-dir", dest="allowed_lora_dirs",
                        action="append", default=[], metavar="DIR",
                        help="directory the run-time loaded adapters must lie in (repeatable; "
                             "without it, run-time loading refuses every path)")
    parser.add_argument("--lora-resolver-dir", default=None, metavar="DIR",
                        help="a request whose model names no loaded adapter loads DIR/<model> "
                             "when that is an adapter directory")


def _lora_module(value: str) -> tuple[str, str]:
    """--lora-modules' entry: name=path, or vLLM's JSON form."""
    if value.lstrip().startswith("{"):
        parsed = _json_object(value)
        name, path = parsed.get("name"), parsed.get("path")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise argparse.ArgumentTypeError(f"needs \"name\" and \"path\": {value!r}")
        return name, path
    name, sep, path = value.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"expected name=path, got {value!r}")
    return name, path


def _add_pooling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runner", default="auto", choices=list(RUNNERS),
                        help="generate: sample tokens; pooling: embeddings, scores and "
                             "classes (/v1/embeddings, /pooling, /classify, /score, /rerank); "
                             "auto: pooling for encoders (BertModel ...), "
                             "*ForSequenceClassification and sentence-transformers models")
    parser.add_argument("--convert", default="auto", choices=list(CONVERTS),
                        help="what the pooling runner makes of a model of another kind: embed "
                             "(a decoder's last hidden state), classify (a classifier head), "
                             "reward (per-token classification); auto: by the architecture")
    parser.add_argument("--task", default=None, choices=sorted(TASK_ALIASES),
                        help="vLLM's older name for --runner and --convert (embed = --runner "
                             "pooling --convert embed, ...; default: neither set)")
    parser.add_argument("--pooler-config", type=_pooler_config, default=None,
                        help='a pooling model\'s pooler, as JSON over what its files say: '
                             '{"pooling_type": "MEAN", "normalize": false, "use_activation": '
                             'true} (default: the model\'s)')
    parser.add_argument("--hf-overrides", type=_json_object, default=None,
                        help="JSON object set on the model's transformers config after it is "
                             "read, e.g. a decoder reranker's {\"architectures\": [...], "
                             "\"classifier_from_token\": [\"no\", \"yes\"]} (default: none)")


def _modality_counts(value: str) -> dict:
    """--limit-mm-per-prompt: JSON ({"image": 2}), or vLLM's older image=2,video=1."""
    if value.lstrip().startswith("{"):
        return _json_object(value)
    out = {}
    for item in value.split(","):
        name, sep, count = item.partition("=")
        if not (sep and name.strip() and count.strip().isdigit()):
            raise argparse.ArgumentTypeError(f"expected JSON or modality=count[,...], got "
                                             f"{value!r}")
        out[name.strip()] = int(count)
    return out


def _json_object(value: str) -> dict:
    """A flag's JSON object; anything else is argparse's clean error, not a traceback."""
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return parsed


def _pooler_config(value: str) -> dict:
    parsed = _json_object(value)
    try:
        PoolerConfig.from_dict(parsed)  # unknown fields and bad types, named
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return parsed


# Request limits that apply offline too (the server adds its own: body depth, prompts, tools).
_LIMIT_FLAGS = {
    "max_n": "most samples per request (n, best_of)",
    "max_logprobs": "most logprobs / top_logprobs / prompt_logprobs per token (-1: no limit)",
    "max_stop_strings": "most stop strings per request",
    "max_stop_string_chars": "longest stop string",
    "max_logit_bias_entries": "most logit_bias entries",
    "max_token_id_list": "longest allowed_token_ids / stop_token_ids list",
    "max_bad_words": "most bad_words",
    "max_bad_word_chars": "longest bad word",
    "max_schema_bytes": "largest structured-output schema, regex or grammar, in bytes",
    "max_schema_depth": "deepest JSON nesting of a structured-output schema",
}


def _add_limit_args(parser: argparse.ArgumentParser) -> None:
    from folio.config import RequestLimitsConfig
    for name, text in _LIMIT_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int,
                            default=getattr(RequestLimitsConfig, name), help=text)


def _quantization(value: str) -> str:
    """--quantization's value, vLLM's kernel-specific aliases (awq_marlin, gptq_marlin)
    normalized to the method they read."""
    return QUANTIZATION_ALIASES.get(value.lower(), value.lower())


def _kv_cache_dtype(value: str) -> str:
    """--kv-cache-dtype's value, aliases (bf16, fp16, half, float) normalized; vLLM's other
    fp8 names get the config's own message rather than argparse's "invalid choice"."""
    try:
        return normalize_kv_cache_dtype(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        model=getattr(args, "model_flag", None) or getattr(args, "model", None),
        tokenizer=args.tokenizer, revision=args.revision, dtype=args.dtype, seed=args.seed,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.9),
        kv_offloading_size=offloading_size(getattr(args, "kv_offloading_size", None),
                                           getattr(args, "kv_transfer_config", None)),
        kv_disk_path=getattr(args, "kv_disk_path", None),
        kv_disk_size=getattr(args, "kv_disk_size", None),
        # the host tier's connector became kv_offloading_size above; a P2pConnector stays
        kv_transfer_config=p2p_transfer(getattr(args, "kv_transfer_config", None)),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        calculate_kv_scales=getattr(args, "calculate_kv_scales", False),
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        scheduling_policy=args.scheduling_policy, device=args.device,
        enforce_eager=getattr(args, "enforce_eager", False),
        cudagraph_mode=getattr(args, "cudagraph_mode", "full"),
        enable_sleep_mode=getattr(args, "enable_sleep_mode", False),
        quantization=getattr(args, "quantization", None),
        async_scheduling=getattr(args, "async_scheduling", None),
        structured_outputs_config={
            "backend": getattr(args, "structured_outputs_backend", "auto"),
            "reasoning_parser": getattr(args, "reasoning_parser", None)},
        request_limits={name: getattr(args, name) for name in _LIMIT_FLAGS
                        if hasattr(args, name)},
        distributed_executor_backend=getattr(args, "distributed_executor_backend", None),
        num_workers=getattr(args, "num_workers", 1),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
        pp_layer_partition=getattr(args, "pp_layer_partition", None),
        data_parallel_size=getattr(args, "data_parallel_size", 1),
        enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
        speculative_config=getattr(args, "speculative_config", None),
        runner=getattr(args, "runner", "auto"), convert=getattr(args, "convert", "auto"),
        task=getattr(args, "task", None), pooler_config=getattr(args, "pooler_config", None),
        hf_overrides=getattr(args, "hf_overrides", None),
        lora_config=lora_config_from_args(args),
        **{name: getattr(args, name) for name in MULTIMODAL_FLAGS if hasattr(args, name)})


def lora_config_from_args(args: argparse.Namespace) -> dict | None:
    """LoRAConfig's fields from the flags; None without --enable-lora (or --lora-modules)."""
    modules = getattr(args, "lora_modules", None) or []
    if not (getattr(args, "enable_lora", False) or modules):
        return None
    return dict(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                max_cpu_loras=args.max_cpu_loras, lora_modules=list(modules),
                allow_runtime_lora_updating=getattr(args, "allow_runtime_lora_updating", False),
                allowed_lora_dirs=list(getattr(args, "allowed_lora_dirs", []) or []),
                lora_resolver_dir=getattr(args, "lora_resolver_dir", None))
