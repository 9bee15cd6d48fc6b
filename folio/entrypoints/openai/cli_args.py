"""`folio serve` flags, kept apart from the app so `folio --help` needs no web stack."""
from __future__ import annotations

import argparse
import os

from folio.config import SLEEP_MODE_REQUESTS, RequestLimitsConfig

DEFAULT_MAX_BODY_BYTES = 32 << 20


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from folio.engine.arg_utils import add_engine_args, add_lora_serving_args
    from folio.entrypoints.openai.responses_store import add_responses_args
    from folio.entrypoints.openai.tool_parsers.registry import TOOL_PARSERS
    from folio.reasoning import REASONING_FORMATS
    add_engine_args(parser)
    add_lora_serving_args(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind; 127.0.0.1 is loopback only, 0.0.0.0 exposes it")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use (default: the model argument, or the default model's name)")
    parser.add_argument("--chat-template", default=None,
                        help="chat template: a Jinja file path, or the template text itself")
    parser.add_argument("--api-key", default=os.environ.get("FOLIO_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route but /health, /ping, "
                             "/version; browsers on the web console log in with HTTP Basic, "
                             "the key as the password (default: $FOLIO_API_KEY)")
    parser.add_argument("--role", choices=("engine", "router"), default="engine",
                        help="engine: serve a model; router: the front of disaggregated "
                             "prefill (--prefill URL... --decode URL...), as `folio router`")
    from folio.entrypoints.disagg_router import add_router_args
    add_router_args(parser, with_address=False)
    parser.add_argument("--generation-config", default="auto",
                        help="sampling defaults: 'auto' (the model's generation_config.json), "
                             "'folio' (none), or a directory holding a generation_config.json")
    parser.add_argument("--reasoning-parser", default=None,
                        choices=list(REASONING_FORMATS),
                        help="split the model's thinking (<think>…</think>, [THINK]…[/THINK]) into "
                             "the message's reasoning / reasoning_content fields")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let tool_choice \"auto\" parse tool calls out of the model's text "
                             "(needs --tool-call-parser)")
    parser.add_argument("--tool-call-parser", default=None,
                        choices=["auto", *TOOL_PARSERS],
                        help="the model's tool-call format; 'auto' picks it from the chat template")
    parser.add_argument("--allowed-origins", nargs="*", default=[],
                        help="CORS origins allowed (default: none, CORS off)")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies get HTTP 413")
    parser.add_argument("--max-json-depth", type=int, default=RequestLimitsConfig.max_json_depth,
                        help="request bodies nested deeper get HTTP 400")
    parser.add_argument("--max-prompts", type=int, default=RequestLimitsConfig.max_prompts,
                        help="most prompts in one batched /v1/completions request")
    parser.add_argument("--max-tools", type=int, default=RequestLimitsConfig.max_tools,
                        help="most tools in one chat request")
    parser.add_argument("--max-pooling-inputs", type=int,
                        default=RequestLimitsConfig.max_pooling_inputs,
                        help="most inputs in one /v1/embeddings, /pooling or /classify request, "
                             "texts on either side of one /score, documents of one /rerank")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept a chat_template in requests (Jinja run by the server; "
                             "refused by default)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no /metrics and no periodic stats line")
    parser.add_argument("--disable-console", action="store_true",
                        help="no web console at / (chat playground and engine dashboard)")
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="refuse requests with HTTP 429 (and a Retry-After from the "
                             "measured drain rate) while this many wait for their first step; "
                             "a request of better priority sheds a waiting one instead "
                             "(default: no limit)")
    parser.add_argument("--max-queue-time", type=float, default=None,
                        help="seconds a request may wait for its first step; past it the "
                             "request is refused with HTTP 429 (default: no limit)")
    parser.add_argument("--sleep-mode-requests", default="wait", choices=SLEEP_MODE_REQUESTS,
                        help="with --enable-sleep-mode: requests that arrive while the engine "
                             "sleeps wait for the wake-up (wait), or get HTTP 503 with a "
                             "Retry-After (reject); /health stays 200 either way")
    add_responses_args(parser)
    parser.add_argument("--uvicorn-log-level", default="warning", help="uvicorn's log level")


def build_engine_config(args: argparse.Namespace):
    from folio.config import (AdmissionConfig, CacheConfig, EngineConfig, LoRAConfig, ModelConfig,
                              ParallelConfig, SchedulerConfig, SpeculativeConfig,
                              StructuredOutputsConfig, multimodal_config)
    from folio.engine.arg_utils import MULTIMODAL_FLAGS, engine_kwargs_from_args
    kw = engine_kwargs_from_args(args)
    return EngineConfig(
        model=ModelConfig(model=kw["model"], tokenizer=kw["tokenizer"], dtype=kw["dtype"],
                          seed=kw["seed"], max_model_len=kw["max_model_len"],
                          revision=kw["revision"], device=kw["device"], enforce_eager=kw["enforce_eager"],
                          cudagraph_mode=kw["cudagraph_mode"], generation_config=args.generation_config,
                          quantization=kw["quantization"], runner=kw["runner"],
                          convert=kw["convert"], task=kw["task"],
                          pooler_config=kw["pooler_config"], hf_overrides=kw["hf_overrides"],
                          enable_sleep_mode=kw["enable_sleep_mode"]),
        cache=CacheConfig(block_size=kw["block_size"], enable_prefix_caching=kw["enable_prefix_caching"],
                          kv_cache_memory_bytes=kw["kv_cache_memory_bytes"],
                          gpu_memory_utilization=kw["gpu_memory_utilization"],
                          kv_offloading_size=kw["kv_offloading_size"],
                          kv_disk_path=kw["kv_disk_path"], kv_disk_size=kw["kv_disk_size"],
                          cache_dtype=kw["kv_cache_dtype"],
                          calculate_kv_scales=kw["calculate_kv_scales"],
                          num_gpu_blocks_override=kw["num_gpu_blocks_override"],
                          kv_pin_max_fraction=args.responses_kv_pin_max_fraction),
        scheduler=SchedulerConfig(max_num_seqs=kw["max_num_seqs"],
                                  max_num_batched_tokens=kw["max_num_batched_tokens"],
                                  enable_chunked_prefill=kw["enable_chunked_prefill"],
                                  policy=kw["scheduling_policy"],
                                  async_scheduling=kw["async_scheduling"]),
        structured_outputs=StructuredOutputsConfig(**kw["structured_outputs_config"]),
        limits=RequestLimitsConfig(**kw["request_limits"], max_json_depth=args.max_json_depth,
                                   max_prompts=args.max_prompts, max_tools=args.max_tools,
                                   max_pooling_inputs=args.max_pooling_inputs),
        parallel=ParallelConfig(distributed_executor_backend=kw["distributed_executor_backend"],
                                num_workers=kw["num_workers"],
                                tensor_parallel_size=kw["tensor_parallel_size"],
                                pipeline_parallel_size=kw["pipeline_parallel_size"],
                                pp_layer_partition=kw["pp_layer_partition"],
                                data_parallel_size=kw["data_parallel_size"],
                                enable_expert_parallel=kw["enable_expert_parallel"]),
        speculative=SpeculativeConfig.from_json(kw["speculative_config"]),
        lora=None if kw["lora_config"] is None else LoRAConfig(**kw["lora_config"]),
        kv_transfer=kw["kv_transfer_config"],
        multimodal=multimodal_config(**{name: kw[name] for name in MULTIMODAL_FLAGS
                                        if name in kw}),
        admission=AdmissionConfig(max_waiting_requests=args.max_waiting_requests,
                                  max_queue_time=args.max_queue_time,
                                  sleep_mode_requests=args.sleep_mode_requests))
