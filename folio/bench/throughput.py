"""`folio bench throughput`: offline throughput on random-token requests, optionally against a peer.

vLLM's `bench throughput` semantics: every request is submitted at once to `LLM.generate`, and
throughput is measured around that call only (engine start-up is reported separately). The
default workload is nano-vllm's published one: 256 requests, prompt and output lengths uniform
in [100, 1024], random prompt tokens, temperature 1.0 and ignore_eos so every request generates
exactly the number of tokens it asked for.

Peers run the *same* requests on the *same* weights and dtype, each in its own spawned process,
so its peak RSS (VmHWM of that process) is its own and not mixed with folio's:

* ``transformers``: `model.generate` in static, left-padded batches of ``--peer-batch-size``
  requests, each batch generating ``max(output_len)`` tokens for every row. The padding waste
  is part of the peer's real cost, but only the tokens each request asked for count as output.
* ``transformers-cb``: transformers' own continuous batching (`init_continuous_batching`,
  paged KV cache, per-request max_new_tokens), when this transformers version offers it.

``--random-weights --config NAME`` builds (once, cached) a model directory with a real model's
shapes and random bf16 weights, for benchmarking big shapes without downloading checkpoints.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from typing import Any, Callable

from folio.bench.datasets import SampleRequest, sample_random_requests, special_token_ids

PEERS = ("none", "transformers", "transformers-cb")

# Shapes of the models `--random-weights --config NAME` can build (from their published
# config.json files). Only shapes matter for speed; the weights are random.
RANDOM_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=40960, rms_norm_eps=1e-6, hidden_act="silu",
        attention_bias=False),
    "llama3-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu",
        attention_bias=False, mlp_bias=False),
}
_RANDOM_WEIGHTS_SEED = 0          # fixed: the same NAME always gives the same weights
_RANDOM_MARKER = "folio_random.json"
_SHARD_BYTES = 2 << 30            # keeps the builder's peak memory near one shard


# ------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------

@dataclass
class EngineResult:
    """What one engine did on the workload. Rates are over `elapsed_s` (generation only)."""

    engine: str
    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0            # useful tokens: what the requests asked for
    generated_tokens: int = 0         # tokens actually computed (includes padding waste)
    elapsed_s: float = 0.0
    load_s: float = 0.0               # engine/model start-up, not in elapsed_s
    peak_rss_bytes: int = 0           # peak RSS (VmHWM) of the process that ran this engine
    baseline_rss_bytes: int = 0       # RSS of that process before the model was loaded
    memory_note: str = ""
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.elapsed_s > 0

    def rates(self) -> dict[str, float]:
        if not self.ok:
            return {}
        return {
            "requests_per_s": self.num_requests / self.elapsed_s,
            "output_tokens_per_s": self.output_tokens / self.elapsed_s,
            "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / self.elapsed_s,
        }

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), **self.rates()}


def _peak_rss_bytes() -> int:
    """Peak RSS of this process's own address space.

    VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork (a child starts at its parent's
    current RSS) and across exec, so a peer spawned after folio ran would report folio's
    memory as its own. VmHWM belongs to the address space that exec created."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    # Elsewhere: ru_maxrss is in KiB on Linux, bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags (vLLM's names, shared with `folio chat`) plus the benchmark's own."""
    from folio.engine.arg_utils import add_engine_args
    add_engine_args(parser, model_positional=False)
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=int, default=256, help="number of requests")
    group.add_argument("--input-len-range", type=int, nargs=2, default=[100, 1024],
                       metavar=("LOW", "HIGH"), help="prompt length, uniform in [LOW, HIGH]")
    group.add_argument("--output-len-range", type=int, nargs=2, default=[100, 1024],
                       metavar=("LOW", "HIGH"), help="output length, uniform in [LOW, HIGH]")
    group.add_argument("--temperature", type=float, default=1.0,
                       help="sampling temperature of every request (nano-vllm's workload: 1.0)")
    group.add_argument("--disable-detokenize", action="store_true",
                       help="do not detokenize outputs (measures the model and scheduler only)")
    group.add_argument("--no-tqdm", action="store_true", help="no progress bar")
    peer = parser.add_argument_group("peer")
    peer.add_argument("--peer", nargs="+", choices=PEERS, default=["none"],
                      help="also run these engines on the same requests and weights "
                           "(e.g. --peer transformers transformers-cb)")
    peer.add_argument("--peer-batch-size", type=int, default=16,
                      help="static batch size of the transformers peer")
    random_group = parser.add_argument_group("random weights")
    random_group.add_argument("--random-weights", action="store_true",
                              help="benchmark a model with random weights and the shapes of --config")
    random_group.add_argument("--config", choices=sorted(RANDOM_CONFIGS), default=None,
                              help="the shapes for --random-weights")
    # Test-only: a shallower model with otherwise real shapes, so creation can be smoke-tested.
    random_group.add_argument("--random-num-layers", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output-json", default=None, help="write the results to this file")


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from folio.engine.arg_utils import engine_kwargs_from_args
    return engine_kwargs_from_args(args)


def _validate(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be positive, got {args.num_prompts}")
    if args.peer_batch_size < 1:
        raise ValueError(f"--peer-batch-size must be positive, got {args.peer_batch_size}")
    if args.random_weights and args.config is None:
        raise ValueError("--random-weights needs --config NAME "
                         f"(one of {sorted(RANDOM_CONFIGS)})")
    if args.config is not None and not args.random_weights:
        raise ValueError("--config only applies with --random-weights")
    if args.random_weights and (getattr(args, "model_flag", None) or getattr(args, "model", None)):
        raise ValueError("--random-weights builds its own model; do not also give --model")
    if "none" in args.peer and len(args.peer) > 1:
        raise ValueError("--peer none cannot be combined with other peers")


# ------------------------------------------------------------------------------------------
# The benchmark
# ------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by `args`, print a table and return the results."""
    _validate(args)
    kwargs = _engine_kwargs(args)
    if args.random_weights:
        t0 = time.perf_counter()
        kwargs["model"] = _in_child(build_random_model, args.config, None, args.random_num_layers)
        print(f"random-weights model ({args.config}): {kwargs['model']} "
              f"[{time.perf_counter() - t0:.1f}s]", flush=True)

    folio_result, info = _run_folio(args, kwargs)
    requests: list[SampleRequest] = info.pop("requests")
    results = [folio_result]
    peers = [p for p in args.peer if p != "none"]
    if peers:
        # The peer gets the machine to itself: folio's engine was released in _run_folio.
        gc.collect()
        for peer in peers:
            results.append(_run_peer(peer, info, requests, args))

    report = _report(args, results, info)
    _print_table(results, info)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return report


def _run_folio(args: argparse.Namespace, kwargs: dict[str, Any]) -> tuple[EngineResult, dict]:
    from folio import LLM, SamplingParams

    result = EngineResult(engine="folio")
    result.baseline_rss_bytes = _current_rss_bytes()
    start = time.perf_counter()
    llm = LLM(**kwargs)
    result.load_s = time.perf_counter() - start

    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    vocab_size = engine.vocab_size
    requests = sample_random_requests(
        args.num_prompts, args.input_len_range, args.output_len_range, vocab_size,
        seed=args.seed, exclude_token_ids=special_token_ids(tokenizer))
    longest = max(r.prompt_len + r.expected_output_len for r in requests)
    if longest > engine.max_model_len:
        raise ValueError(f"the longest request needs {longest} tokens (prompt + output) but "
                         f"max_model_len is {engine.max_model_len}; shorten the ranges or raise "
                         "--max-model-len")

    detokenize = not args.disable_detokenize
    tokenizer_len = len(tokenizer) if tokenizer is not None else 0
    notes = []
    if detokenize and vocab_size > tokenizer_len:
        # Random-weights models borrow a smaller tokenizer: ids past its end cannot be decoded.
        detokenize = False
        notes.append(f"detokenization off: model vocab {vocab_size} > tokenizer's {tokenizer_len}")

    params = [SamplingParams(temperature=args.temperature, top_p=1.0, ignore_eos=True,
                             max_tokens=r.expected_output_len, detokenize=detokenize)
              for r in requests]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]

    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
    result.elapsed_s = time.perf_counter() - start
    result.peak_rss_bytes = _peak_rss_bytes()
    result.memory_note = "VmHWM of the benchmark process (includes the KV cache as allocated)"

    result.num_requests = len(outputs)
    result.prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    result.output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result.generated_tokens = result.output_tokens
    worker = getattr(getattr(engine.engine_core, "executor", None), "worker", None)
    dtype = getattr(worker, "dtype", None)
    result.extra = {"num_kv_blocks": getattr(engine.engine_core, "num_blocks", None),
                    "dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
                    "device": str(getattr(worker, "device", "")) or None,
                    "detokenize": detokenize, "notes": notes}
    info = {
        "requests": requests,
        "model_source": {"kind": engine.model_source.kind, "path": engine.model_source.path},
        "dtype": result.extra["dtype"],
        "vocab_size": vocab_size,
        "max_model_len": engine.max_model_len,
    }
    # Release the engine (model weights, KV cache) before any peer runs.
    del outputs, llm, engine, worker
    gc.collect()
    return result, info


def _run_peer(peer: str, info: dict, requests: list[SampleRequest],
              args: argparse.Namespace) -> EngineResult:
    source = info["model_source"]
    if source["kind"] != "hf_dir":
        return EngineResult(engine=peer, error=(
            f"skipped: the model is a {source['kind']} file ({source['path']}); the transformers "
            "peer needs a Hugging Face directory with the same weights"))
    worker: Callable[..., dict] = _transformers_static_peer if peer == "transformers" \
        else _transformers_cb_peer
    payload = [(r.prompt_token_ids, r.expected_output_len) for r in requests]
    print(f"running peer {peer} on {len(payload)} requests ...", flush=True)
    try:
        out = _in_child(worker, source["path"], info["dtype"] or "float32", payload,
                        args.peer_batch_size, args.temperature, args.seed)
    except Exception as exc:  # the child died (out of memory...) or could not start
        return EngineResult(engine=peer, error=f"{type(exc).__name__}: {exc}")
    return EngineResult(**out)


def _in_child(fn: Callable[..., Any], *fn_args: Any) -> Any:
    """Run fn(*fn_args) in a fresh spawned process: its peak RSS is then its own, and a crash
    or leak there cannot disturb the benchmark process."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *fn_args).result()


# ------------------------------------------------------------------------------------------
# Peers (each runs inside a spawned child)
# ------------------------------------------------------------------------------------------

def _load_peer_model(model_dir: str, dtype_name: str, result: EngineResult) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    result.baseline_rss_bytes = _current_rss_bytes()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype_name))
    model.eval()
    result.load_s = time.perf_counter() - start
    return model


def _peer_generation_config(model: Any, temperature: float, max_new_tokens: int) -> Any:
    """The folio requests' sampling (temperature, top_p=1, no top-k), built from scratch so a
    generation_config.json in the directory cannot add processors folio does not run."""
    from transformers import GenerationConfig
    pad = model.config.pad_token_id
    eos = model.config.eos_token_id
    sample = temperature > 0
    return GenerationConfig(
        do_sample=sample, temperature=temperature if sample else None,
        top_p=1.0 if sample else None, top_k=0 if sample else None,
        max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        pad_token_id=int(pad if pad is not None else (eos if isinstance(eos, int) else 0)),
        eos_token_id=eos)


def _transformers_static_peer(model_dir: str, dtype_name: str,
                              payload: list[tuple[list[int], int]], batch_size: int,
                              temperature: float, seed: int) -> dict:
    """HF `generate` in static batches of `batch_size` requests, in request order, left-padded;
    each batch runs to its longest requested output (min_new_tokens = max_new_tokens, so EOS
    cannot end a row early: the equivalent of ignore_eos)."""
    import torch
    result = EngineResult(engine="transformers")
    try:
        torch.manual_seed(seed)
        model = _load_peer_model(model_dir, dtype_name, result)
        gen_pad = _peer_generation_config(model, temperature, 1).pad_token_id
        useful = generated = prompt_tokens = 0
        start = time.perf_counter()
        with torch.inference_mode():
            for first in range(0, len(payload), batch_size):
                batch = payload[first:first + batch_size]
                width = max(len(ids) for ids, _ in batch)
                steps = max(out_len for _, out_len in batch)
                input_ids = torch.full((len(batch), width), gen_pad, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, (ids, _) in enumerate(batch):
                    input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
                    mask[row, width - len(ids):] = 1
                out = model.generate(input_ids=input_ids, attention_mask=mask,
                                     generation_config=_peer_generation_config(
                                         model, temperature, steps))
                made = out.shape[1] - width
                if made != steps:
                    raise RuntimeError(f"generate made {made} tokens per row, expected {steps}")
                generated += made * len(batch)
                useful += sum(out_len for _, out_len in batch)
                prompt_tokens += sum(len(ids) for ids, _ in batch)
        result.elapsed_s = time.perf_counter() - start
        result.num_requests = len(payload)
        result.prompt_tokens = prompt_tokens
        result.output_tokens = useful
        result.generated_tokens = generated
        result.extra = {"batch_size": batch_size, "padding_waste_tokens": generated - useful,
                        "attn_implementation": model.config._attn_implementation}
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.peak_rss_bytes = _peak_rss_bytes()
    result.memory_note = "VmHWM of the peer's own spawned process"
    return asdict(result)


def _transformers_cb_peer(model_dir: str, dtype_name: str,
                          payload: list[tuple[list[int], int]], batch_size: int,
                          temperature: float, seed: int) -> dict:
    """transformers' continuous batching: every request queued at once with its own
    max_new_tokens and EOS disabled (-1), like folio's ignore_eos. The manager's set-up and
    warm-up are counted in load_s, as folio's start-up is."""
    import torch
    result = EngineResult(engine="transformers-cb")
    manager = None
    try:
        from transformers import GenerationMixin
        if not hasattr(GenerationMixin, "init_continuous_batching"):
            raise RuntimeError("this transformers version has no continuous batching API")
        torch.manual_seed(seed)
        model = _load_peer_model(model_dir, dtype_name, result)
        longest_out = max(out_len for _, out_len in payload)
        gen_config = _peer_generation_config(model, temperature, longest_out)
        gen_config.min_new_tokens = None   # per-request lengths; EOS is disabled per request
        hints = None
        try:
            from transformers.generation.continuous_batching.utils import WorkloadHints
            hints = WorkloadHints(max_prompt_length=max(len(ids) for ids, _ in payload),
                                  max_generated_length=longest_out, num_requests=len(payload))
        except Exception:
            hints = None  # an older API without hints: the manager picks its own sizes
        setup_start = time.perf_counter()
        manager = model.init_continuous_batching(generation_config=gen_config,
                                                 workload_hints=hints)
        if hasattr(manager, "warmup"):
            manager.warmup()
        manager.start()
        result.load_s += time.perf_counter() - setup_start

        start = time.perf_counter()
        ids = [manager.add_request(input_ids=list(prompt), max_new_tokens=out_len,
                                   eos_token_id=-1)
               for prompt, out_len in payload]
        wanted = dict(zip(ids, (out_len for _, out_len in payload)))
        finished: dict[str, Any] = {}
        while len(finished) < len(ids):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("the continuous batching loop stopped unexpectedly")
                continue
            if out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                finished[out.request_id] = out
        result.elapsed_s = time.perf_counter() - start
        made = {rid: len(out.generated_tokens) for rid, out in finished.items()}
        short = {rid: (made[rid], wanted[rid]) for rid in made if made[rid] != wanted[rid]}
        if short:
            raise RuntimeError(f"{len(short)} requests did not get their requested length, "
                               f"e.g. {next(iter(short.items()))}")
        result.num_requests = len(payload)
        result.prompt_tokens = sum(len(prompt) for prompt, _ in payload)
        result.output_tokens = result.generated_tokens = sum(made.values())
        result.extra = {"attn_implementation": model.config._attn_implementation}
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if manager is not None:
            try:
                manager.stop(block=True, timeout=10)
            except Exception:
                pass
    result.peak_rss_bytes = _peak_rss_bytes()
    result.memory_note = "VmHWM of the peer's own spawned process"
    return asdict(result)


# ------------------------------------------------------------------------------------------
# Random-weights models
# ------------------------------------------------------------------------------------------

def random_model_dir(name: str, num_layers: int | None = None) -> str:
    from folio.model.default_model import folio_cache_dir
    suffix = f"-L{num_layers}" if num_layers is not None else ""
    return os.path.join(folio_cache_dir(), "random", f"{name}{suffix}")


def build_random_model(name: str, out_dir: str | None = None,
                       num_layers: int | None = None) -> str:
    """An HF directory with the shapes of RANDOM_CONFIGS[name] and random bf16 weights (fixed
    seed), plus the default model's tokenizer (vocab 49152: random prompts only need ids below
    the *model's* vocab). Built once, into a temp dir renamed into place, so a crash never
    leaves a half-written model; later calls return the cached directory."""
    if name not in RANDOM_CONFIGS:
        raise ValueError(f"unknown --config {name!r}; known: {sorted(RANDOM_CONFIGS)}")
    spec = dict(RANDOM_CONFIGS[name])
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        spec["num_hidden_layers"] = num_layers
    final = out_dir or random_model_dir(name, num_layers)
    marker = os.path.join(final, _RANDOM_MARKER)
    stamp = {"name": name, "seed": _RANDOM_WEIGHTS_SEED, "config": spec}
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            if json.load(f) == json.loads(json.dumps(stamp)):
                return final
        raise ValueError(f"{final} holds a different random model; remove it to rebuild")

    parent = os.path.dirname(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=parent)
    try:
        _write_random_model(spec, tmp)
        with open(os.path.join(tmp, _RANDOM_MARKER), "w", encoding="utf-8") as f:
            json.dump(stamp, f, indent=2)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(marker):  # not a concurrent builder that got there first
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_random_model(spec: dict[str, Any], out: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from folio.model.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    kwargs = dict(spec)
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(
        model_type, **kwargs, dtype="bfloat16", initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id)
    # The meta device gives every parameter's name and shape without allocating the model;
    # the tensors are then made one at a time, so memory stays near one shard.
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    shapes = [(name, tuple(t.shape)) for name, t in meta_model.state_dict().items()
              if not (config.tie_word_embeddings and name == "lm_head.weight")]
    del meta_model

    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    shard_bytes = 0
    for name, shape in shapes:
        size = math.prod(shape) * 2  # bf16
        if shards[-1] and shard_bytes + size > _SHARD_BYTES:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, shape))
        shard_bytes += size

    generator = torch.Generator().manual_seed(_RANDOM_WEIGHTS_SEED)
    weight_map: dict[str, str] = {}
    total = 0
    for index, shard in enumerate(shards):
        file = ("model.safetensors" if len(shards) == 1
                else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors")
        tensors = {}
        for name, shape in shard:
            if name.endswith("norm.weight"):
                tensor = torch.ones(shape, dtype=torch.bfloat16)   # RMSNorm gains
            elif name.endswith(".bias"):
                tensor = torch.zeros(shape, dtype=torch.bfloat16)
            else:
                tensor = torch.empty(shape, dtype=torch.float32).normal_(
                    0.0, config.initializer_range, generator=generator).to(torch.bfloat16)
            tensors[name] = tensor
            weight_map[name] = file
            total += tensor.numel() * 2
        save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------

def _report(args: argparse.Namespace, results: list[EngineResult], info: dict) -> dict[str, Any]:
    folio = results[0]
    report: dict[str, Any] = {
        # vLLM's bench throughput keys, for folio.
        "elapsed_time": folio.elapsed_s,
        "num_requests": folio.num_requests,
        "total_num_tokens": folio.prompt_tokens + folio.output_tokens,
        "requests_per_second": folio.rates().get("requests_per_s"),
        "tokens_per_second": folio.rates().get("total_tokens_per_s"),
        "output_tokens_per_second": folio.rates().get("output_tokens_per_s"),
        "settings": {
            "num_prompts": args.num_prompts, "input_len_range": list(args.input_len_range),
            "output_len_range": list(args.output_len_range), "seed": args.seed,
            "temperature": args.temperature, "peer": list(args.peer),
            "peer_batch_size": args.peer_batch_size, "random_weights": args.random_weights,
            "config": args.config, "engine": _engine_kwargs(args),
        },
        "model": info["model_source"], "dtype": info["dtype"],
        "max_model_len": info["max_model_len"],
        "engines": [r.to_dict() for r in results],
    }
    folio_rate = folio.rates().get("output_tokens_per_s")
    for entry, result in zip(report["engines"], results):
        peer_rate = result.rates().get("output_tokens_per_s")
        entry["folio_over_this"] = (folio_rate / peer_rate) if folio_rate and peer_rate else None
    return report


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n else "-"


def _print_table(results: list[EngineResult], info: dict) -> None:
    folio = results[0]
    print()
    print(f"model: {info['model_source']['path']} ({info['dtype']}); {folio.num_requests} "
          f"requests, {folio.prompt_tokens} prompt + {folio.output_tokens} output tokens")
    header = ["engine", "elapsed s", "req/s", "out tok/s", "total tok/s", "folio/peer",
              "peak RSS", "load s"]
    rows = [header]
    folio_rate = folio.rates().get("output_tokens_per_s")
    for r in results:
        if not r.ok:
            rows.append([r.engine, "-", "-", "-", "-", "-", _gib(r.peak_rss_bytes), "-"])
            continue
        rate = r.rates()
        ratio = "-" if r is folio or not folio_rate else f"{folio_rate / rate['output_tokens_per_s']:.2f}x"
        rows.append([r.engine, f"{r.elapsed_s:.2f}", f"{rate['requests_per_s']:.2f}",
                     f"{rate['output_tokens_per_s']:.1f}", f"{rate['total_tokens_per_s']:.1f}",
                     ratio, _gib(r.peak_rss_bytes), f"{r.load_s:.1f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))))
        if index == 0:
            print("  ".join("-" * w for w in widths))
    for r in results:
        if r.error:
            print(f"{r.engine}: {r.error}")
        elif r.generated_tokens != r.output_tokens:
            print(f"{r.engine}: computed {r.generated_tokens} tokens for {r.output_tokens} "
                  f"useful ({r.generated_tokens - r.output_tokens} padding waste)")
        for note in r.extra.get("notes", []):
            print(f"{r.engine}: {note}")
    print("peak RSS: each engine's own process (folio: this process; peers: a spawned child); "
          "baseline RSS before load: " + ", ".join(
              f"{r.engine} {_gib(r.baseline_rss_bytes)}" for r in results if r.baseline_rss_bytes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="folio bench throughput",
        description="Offline throughput on random-token requests, optionally against a peer.")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        run(args)
    except ValueError as exc:
        print(f"folio bench throughput: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
