"""`folio bench serve --peer llama-server --peer llama-batched-bench` (or `--launch`): the
benchmark starts the servers itself and compares them on one workload, in one run.

For each engine, one after the other on the same machine:

* **folio**: `folio serve` (the model of ``--model-path``, default the embedded one) on a free
  127.0.0.1 port, its torch threads set to ``--threads`` (OMP_NUM_THREADS; torch's own default
  is the number of physical cores);
* **llama-server** (``--peer llama-server``): the same GGUF file, one slot per stream
  (``-np`` = ``--max-concurrency``), ``-c`` = slots x (longest prompt + longest output + a
  margin), so every slot has room for any request (with ``-np`` given the KV cache is split
  per slot: a slot gets ``-c / -np``), ``-t`` / ``-tb`` = ``--threads``; see
  `llama_cpp_tools.llama_server_argv` for the rest;

each is started, awaited on /health, measured at idle (RSS summed over its whole process tree:
folio's API server, engine core, resource tracker; PSS too), warmed up with
``--num-warmups`` requests of a different seed (no prefix of the benchmark's prompts), sent the
same `BenchRequest` list the same way as `folio bench serve` sends it, and stopped (SIGTERM,
SIGKILL after a timeout; also on an error or Ctrl-C). Every request opens its own connection
for every engine (``--no-keep-alive``): llama-server closes a streamed response's connection
while advertising keep-alive, and a reused one fails ("Can not write request body").

* **llama-batched-bench** (``--peer llama-batched-bench``): ``-npp input_len -ntg output_len
  -npl max_concurrency`` on the same file and threads: llama.cpp's batched decode rate (S_TG)
  with no server in the way, the reference for folio's served output throughput.

The comparison then prints one table (engine, completed/failed, output tok/s, median TTFT and
TPOT, idle RSS), folio's output throughput over each peer's, and the memory line: folio's idle
RSS against llama-server's idle RSS plus the bytes of folio's KV cache (its block count and
dtype from folio's start-up log, times the model's per-token KV size). The CPU time other
processes took during each run is printed too: llama.cpp's threads wait for each other at every
op, so a busy neighbour costs it far more than its share (compare only quiet runs). A llama.cpp
peer that crashes with weight repacking on (its AMX matmul, on some AMX machines) is run again
without it, and the report says so (`llama_cpp_tools`). ``--output-json`` gets everything, each
HTTP engine with its full `folio bench serve` report.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import re
import shlex
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any, Callable, Sequence

from folio.bench.command import bench_main
from folio.bench import serve
from folio.bench.llama_cpp_tools import (REPACK_POLICIES, batched_bench_argv, crash_signal,
                                         find_binary, llama_server_argv, parse_batched_bench,
                                         repack_attempts, slot_context)
from folio.bench.server_process import (ServerExited, ServerProcess, cpu_snapshot, cpu_usage,
                                        free_port)

FOLIO = "folio"
LLAMA_SERVER = "llama-server"
BATCHED_BENCH = "llama-batched-bench"
PEERS = (LLAMA_SERVER, BATCHED_BENCH)
HOST = "127.0.0.1"
IDLE_SETTLE_S = 2.0    # after /health first answers, before the idle memory reading
MiB = 2 ** 20


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`folio bench serve`'s flags plus the launched servers' and peers'."""
    serve.add_cli_args(parser)
    group = parser.add_argument_group("launched servers and llama.cpp peers")
    group.add_argument("--peer", action="append", choices=PEERS, default=None,
                       help="also run this llama.cpp peer on the same GGUF file, threads and "
                            "workload (may be given twice); implies --launch")
    group.add_argument("--launch", action="store_true",
                       help="start `folio serve` here (free port), measure its idle memory, "
                            "benchmark it and stop it (instead of --base-url/--port)")
    group.add_argument("--model-path", default=None,
                       help="model folio serves, and the GGUF file llama.cpp loads (default: "
                            "the embedded default model)")
    group.add_argument("--threads", type=int, default=None,
                       help="CPU threads of every engine (default: os.cpu_count())")
    group.add_argument("--num-warmups", type=int, default=1,
                       help="requests sent to each server before the timed run (another seed)")
    group.add_argument("--server-start-timeout", type=float, default=900.0,
                       help="seconds a launched server may take to answer /health")
    group.add_argument("--peer-timeout", type=float, default=3600.0,
                       help="seconds llama-batched-bench may run before it is killed")
    group.add_argument("--llama-cpp-repack", choices=REPACK_POLICIES, default="auto",
                       help="llama.cpp weight repacking (AMX / x86 layouts): auto = on, and "
                            "off (--no-repack) for a second try if the first crashes "
                            "(SIGSEGV, SIGILL...)")
    group.add_argument("--folio-serve-args", default="",
                       help="extra `folio serve` flags, one shell-quoted string")
    group.add_argument("--llama-server-args", default="",
                       help="extra llama-server flags, one shell-quoted string")
    group.add_argument("--llama-batched-bench-args", default="",
                       help="extra llama-batched-bench flags, one shell-quoted string")
    group.add_argument("--server-log-dir", default=None,
                       help="keep the servers' logs here (default: a temporary directory)")


def launching(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "peer", None) or getattr(args, "launch", False))


def run(args: argparse.Namespace, *, tokenizer: Any = None) -> dict[str, Any]:
    """`folio bench serve`: against a running server, or (--launch / --peer) the comparison."""
    if launching(args):
        return run_comparison(args, tokenizer=tokenizer)
    return serve.run(args, tokenizer=tokenizer)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, 'folio bench serve',
                      'Online serving benchmark; with --peer, folio serve against llama.cpp.',
                      add_cli_args, run)


# ------------------------------------------------------------------------------------------
# Set-up: model, threads, slots, context, binaries
# ------------------------------------------------------------------------------------------

@dataclass
class Setup:
    model_path: str | None          # what `folio serve` is given (None: its default model)
    model_source: str               # the directory or file folio loads
    gguf_path: str | None           # the GGUF file behind it (llama.cpp's input)
    threads: int
    slots: int                      # llama-server -np, llama-batched-bench -npl
    slot_tokens: int                # context one slot needs
    server_ctx: int                 # llama-server -c
    batched_ctx: int                # llama-batched-bench -c
    binaries: dict[str, str] = field(default_factory=dict)


def peers_of(args: argparse.Namespace) -> list[str]:
    return list(dict.fromkeys(getattr(args, "peer", None) or []))


def resolve_model(model_path: str | None) -> tuple[Any, str | None]:
    """(folio's ModelSource for `model_path`, the GGUF file it comes from or None)."""
    from folio.model.discovery import gguf_file_of, resolve_model_source
    source = resolve_model_source(model_path)
    return source, gguf_file_of(source)


def check_gguf_for_peers(peers: Sequence[str], model_desc: str, gguf_path: str | None) -> None:
    if peers and gguf_path is None:
        raise ValueError(
            f"--peer {' --peer '.join(peers)} needs a GGUF model: llama.cpp reads GGUF files, and "
            f"folio must serve the same file; {model_desc} is not one (give --model-path "
            "FILE.gguf, or leave it out for the embedded default model)")


def resolve_threads(args: argparse.Namespace) -> int:
    threads = args.threads if args.threads is not None else (os.cpu_count() or 1)
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    return int(threads)


def max_lengths(args: argparse.Namespace,
                requests: Sequence[serve.BenchRequest]) -> tuple[int, int]:
    """The longest prompt and output a request of this run can have: the random dataset's
    range upper ends (len * (1 + range_ratio)), or longer where a request is (file prompts)."""
    in_hi = serve.length_range(args.random_input_len, args.random_range_ratio)[1]
    out_hi = serve.length_range(args.random_output_len, args.random_range_ratio)[1]
    for request in requests:
        in_hi = max(in_hi, request.prompt_len or 0)
        out_hi = max(out_hi, request.output_len)
    return in_hi, out_hi


def build_setup(args: argparse.Namespace, source: Any, gguf_path: str | None,
                requests: Sequence[serve.BenchRequest]) -> Setup:
    peers = peers_of(args)
    slots = args.max_concurrency or len(requests)
    in_hi, out_hi = max_lengths(args, requests)
    per_slot = slot_context(in_hi, out_hi)
    setup = Setup(model_path=args.model_path, model_source=source.path, gguf_path=gguf_path,
                  threads=resolve_threads(args), slots=slots, slot_tokens=per_slot,
                  server_ctx=slots * per_slot,
                  batched_ctx=slots * slot_context(args.random_input_len,
                                                   args.random_output_len))
    for peer in peers:
        setup.binaries[peer] = find_binary(peer)
    return setup


# ------------------------------------------------------------------------------------------
# Command lines
# ------------------------------------------------------------------------------------------

def folio_serve_argv(setup: Setup, port: int, extra: Sequence[str] = ()) -> list[str]:
    return folio_serve_command(setup.model_path, port, extra)


def folio_serve_command(model_path: str | None, port: int,
                        extra: Sequence[str] = ()) -> list[str]:
    """`folio serve` of `model_path` (None: its default model) on HOST:port (also what
    `folio bench sweep serve --launch` starts)."""
    argv = [sys.executable, "-m", "folio.entrypoints.cli", "serve"]
    if model_path:
        argv.append(model_path)
    return argv + ["--host", HOST, "--port", str(port)] + list(extra)


def folio_serve_env(threads: int) -> dict[str, str]:
    """The environment of `folio serve`: torch's intra-op threads (the engine core runs the
    model there) set to `threads`, like llama.cpp's -t/-tb."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    return env


# ------------------------------------------------------------------------------------------
# folio's KV cache size
# ------------------------------------------------------------------------------------------

# The worker's start-up line ("model loaded in 3.1 s (torch.float32, cpu); KV cache: 5825 blocks
# of 16 = 93200 tokens (float32, 4.00 GiB)") and the server's ("KV cache: 5825 blocks x 16 =
# 93200 tokens | ..."): the block count, block size and, where given, the cache dtype and size,
# and with KV cache groups (sliding-window layers beside full ones) the layers one block id
# spans ("... shared by 7 KV cache groups of 4 layers").
_KV_LINE = re.compile(r"KV cache: (?P<blocks>\d+) blocks (?:of|x) (?P<block_size>\d+) = "
                      r"\d+ tokens(?: \((?P<dtype>\w+), (?P<size>[\d.]+) (?P<unit>GiB|MiB)\))?"
                      r"(?: shared by \d+ KV cache groups of (?P<group_size>\d+) layers?)?")
_MODEL_DTYPE = re.compile(r"model loaded in [\d.]+ s \((?:torch\.)?(?P<dtype>\w+), ")
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
                "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass
class KVShape:
    """What one token's K and V take, per element: 2 x layers x KV heads x head dim."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, element_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes


def model_kv_shape(source: Any) -> KVShape | None:
    """The model's KV geometry, read the way folio reads it (None if it cannot be read)."""
    try:
        from folio.model.discovery import load_hf_config
        from folio.model.families import arch_spec_from_hf_config
        spec = arch_spec_from_hf_config(load_hf_config(source)[0])
    except Exception:  # noqa: BLE001 - the figure is then the log's rounded one
        return None
    return KVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim)


def folio_kv_cache(log_text: str, shape: KVShape | None) -> dict[str, Any] | None:
    """folio's KV cache from its start-up log: blocks x block size x the model's per-token KV
    bytes in the cache dtype (exact), else the size the log prints (rounded). None when the
    log has no KV cache line."""
    matches = list(_KV_LINE.finditer(log_text))
    if not matches:
        return None
    # The worker's line (with dtype and size) when there is one, else the server's.
    line = next((m for m in matches if m.group("dtype")), matches[0])
    blocks, block_size = int(line.group("blocks")), int(line.group("block_size"))
    dtype = line.group("dtype")
    if dtype is None:
        model_dtype = _MODEL_DTYPE.search(log_text)
        dtype = model_dtype.group("dtype") if model_dtype else None
    logged = None
    if line.group("size"):
        logged = int(float(line.group("size")) * (2 ** 30 if line.group("unit") == "GiB"
                                                  else MiB))
    out: dict[str, Any] = {"num_blocks": blocks, "block_size": block_size,
                           "tokens": blocks * block_size, "dtype": dtype,
                           "logged_bytes": logged}
    element = _DTYPE_BYTES.get(dtype or "")
    if shape is not None and line.group("group_size"):
        # A block id holds a page of group_size layers, not of every layer.
        shape = replace(shape, num_layers=int(line.group("group_size")))
    if shape is not None and element is not None:
        out["bytes"] = blocks * block_size * shape.bytes_per_token(element)
        out["how"] = (f"{blocks} blocks x {block_size} tokens x {shape.bytes_per_token(element)} "
                      f"B/token (2 x {shape.num_layers} layers x {shape.num_kv_heads} KV heads x "
                      f"{shape.head_dim} x {element} B, {dtype})")
    elif logged is not None:
        out["bytes"] = logged
        out["how"] = "the size folio's start-up log prints (rounded)"
    else:
        return {**out, "bytes": None, "how": "unknown: no dtype or size in the log"}
    return out


_LLAMA_SLOTS = re.compile(r"n_slots = (?P<slots>\d+), n_ctx_slot = (?P<ctx>\d+)")


def llama_server_ctx_from_log(log_text: str) -> int | None:
    """The KV cells llama-server allocated: slots x per-slot context as its log reports them
    (llama.cpp rounds each slot's context up, to 256-token steps: -c 288 x 64 becomes 512 x
    64)."""
    match = _LLAMA_SLOTS.search(log_text)
    return int(match.group("slots")) * int(match.group("ctx")) if match else None


def llama_kv_cache_estimate(ctx_size: int, shape: KVShape | None) -> int | None:
    """llama-server's KV cache at its defaults (f16 K and V, `ctx_size` cells in all). It is
    cleared at start-up, so resident: part of llama-server's idle RSS (folio's KV cache pages
    are mapped on first use: not part of folio's)."""
    return ctx_size * shape.bytes_per_token(2) if shape is not None else None


# ------------------------------------------------------------------------------------------
# Running the engines
# ------------------------------------------------------------------------------------------

def _engine_args(args: argparse.Namespace, base_url: str, *, quiet: bool) -> argparse.Namespace:
    out = copy.copy(args)
    out.base_url = base_url
    out.model = None            # each server names its model itself (GET /v1/models)
    out.no_keep_alive = True    # the same for every engine (see the module docstring)
    if quiet:
        out.disable_tqdm = True
    return out


def _warm_up(eng_args: argparse.Namespace, warmups: Sequence[serve.BenchRequest]) -> None:
    if not warmups:
        return
    warm = copy.copy(eng_args)
    warm.max_concurrency = None
    warm.request_rate = float("inf")
    warm.disable_tqdm = True
    results, _, _, _ = asyncio.run(serve.benchmark(warm, warmups))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(warmups)} warm-up request(s) failed: "
                           f"{failed[0]}")


def run_http_engine(name: str, argv_for_port: Callable[[int], list[str]],
                    env: dict[str, str] | None, args: argparse.Namespace,
                    requests: Sequence[serve.BenchRequest],
                    warmups: Sequence[serve.BenchRequest], percentiles: Sequence[float],
                    log_dir: str, attempt: int = 0) -> dict[str, Any]:
    """Start one server, wait for /health, read its idle memory, warm it up, run the benchmark
    on `requests`, read its memory again, stop it. Raises what went wrong (the server is
    stopped either way)."""
    port = free_port(HOST)
    argv = argv_for_port(port)
    base_url = f"http://{HOST}:{port}"
    log_path = os.path.join(log_dir, f"{name}{'-' + str(attempt) if attempt else ''}.log")
    out: dict[str, Any] = {"engine": name, "command": argv, "base_url": base_url,
                           "log_path": log_path, "error": None}
    print(f"[{name}] starting: {shlex.join(argv)}", flush=True)
    server = ServerProcess(name, argv, log_path=log_path, env=env)
    try:
        with server:
            out["start_to_ready_s"] = server.wait_ready(base_url + "/health",
                                                        args.server_start_timeout)
            time.sleep(IDLE_SETTLE_S)
            out["idle_memory"] = server.memory()
            print(f"[{name}] ready in {out['start_to_ready_s']:.1f} s; idle RSS "
                  f"{out['idle_memory']['rss_bytes'] / MiB:.1f} MiB over "
                  f"{out['idle_memory']['num_processes']} process(es)", flush=True)
            eng_args = _engine_args(args, base_url, quiet=args.quiet)
            try:
                _warm_up(eng_args, warmups)
            except RuntimeError:
                if not server.exits_within(2.0):
                    raise
                # Died at its first requests: reported like a crash at start-up (a llama.cpp
                # peer is then tried again without weight repacking).
                raise ServerExited(name, server.proc.returncode, server.log_tail(),
                                   when="during the warm-up") from None
            before = cpu_snapshot(server.tree())
            results, duration, model, peak = asyncio.run(serve.benchmark(eng_args, requests))
            out["cpu"] = cpu_usage(before, cpu_snapshot(server.tree()))
            out["after_run_memory"] = server.memory()
            if not server.alive():
                out["error"] = f"{name} died during the run (exit code {server.proc.returncode})"
            out["report"] = serve.build_report(eng_args, requests, results, duration, model,
                                               peak, percentiles)
    finally:
        out["exit_code"] = server.proc.returncode if server.proc is not None else None
        out["pids"] = server.pids
        out["log_text"] = server.log_text()
    return out


def run_llama_server(setup: Setup, args: argparse.Namespace,
                     requests: Sequence[serve.BenchRequest],
                     warmups: Sequence[serve.BenchRequest], percentiles: Sequence[float],
                     log_dir: str) -> dict[str, Any]:
    extra = shlex.split(args.llama_server_args)
    notes = []
    attempts = repack_attempts(args.llama_cpp_repack)
    for i, repack in enumerate(attempts):
        def argv_for_port(port: int, repack: bool = repack) -> list[str]:
            assert setup.gguf_path is not None
            return llama_server_argv(setup.binaries[LLAMA_SERVER], setup.gguf_path,
                                     slots=setup.slots, ctx_size=setup.server_ctx,
                                     threads=setup.threads, port=port, host=HOST,
                                     repack=repack, extra=extra)
        try:
            out = run_http_engine(LLAMA_SERVER, argv_for_port, None, args, requests, warmups,
                                  percentiles, log_dir, attempt=i)
        except ServerExited as exc:
            crash = crash_signal(exc.returncode)
            if crash and i + 1 < len(attempts):
                notes.append(_repack_note("start", crash))
                print(f"[{LLAMA_SERVER}] {notes[-1]}", flush=True)
                continue
            raise
        out["repack"] = repack
        out["notes"] = notes
        return out
    raise AssertionError("unreachable")  # pragma: no cover


def _repack_note(what: str, crash: str) -> str:
    return (f"the first {what} (weight repacking on) died of {crash} (llama.cpp's AMX matmul "
            "crashes on some AMX machines, ggml-org/llama.cpp#20824): ran again with --no-repack")


def run_batched_bench(setup: Setup, args: argparse.Namespace, log_dir: str) -> dict[str, Any]:
    """llama-batched-bench at the run's parallel count; its S_PP / S_TG / S row, its peak RSS
    (sampled every 0.5 s) and the command line."""
    extra = shlex.split(args.llama_batched_bench_args)
    notes: list[str] = []
    attempts = repack_attempts(args.llama_cpp_repack)
    assert setup.gguf_path is not None
    for i, repack in enumerate(attempts):
        argv = batched_bench_argv(setup.binaries[BATCHED_BENCH], setup.gguf_path,
                                  ctx_size=setup.batched_ctx, input_len=args.random_input_len,
                                  output_len=args.random_output_len, parallel=setup.slots,
                                  threads=setup.threads, repack=repack, extra=extra)
        log_path = os.path.join(log_dir, f"{BATCHED_BENCH}{'-' + str(i) if i else ''}.log")
        print(f"[{BATCHED_BENCH}] running: {shlex.join(argv)}", flush=True)
        proc = ServerProcess(BATCHED_BENCH, argv, log_path=log_path)
        peak_rss = 0
        with proc:
            before = cpu_snapshot(proc.tree())
            last = before
            deadline = time.monotonic() + args.peer_timeout
            while proc.alive() and time.monotonic() < deadline:
                peak_rss = max(peak_rss, proc.memory(pss=False)["rss_bytes"])
                tree = proc.tree()
                if tree:   # its own CPU time is readable only while it runs
                    last = cpu_snapshot(tree)
                time.sleep(0.5)
            timed_out = proc.alive()
        code = proc.proc.returncode if not timed_out else None
        text = proc.log_text()
        out: dict[str, Any] = {"engine": BATCHED_BENCH, "command": argv, "log_path": log_path,
                               "exit_code": code, "repack": repack, "notes": notes,
                               "peak_rss_bytes": peak_rss, "cpu": cpu_usage(before, last),
                               "error": None}
        if timed_out:
            out["error"] = f"did not finish in {args.peer_timeout:g} s (killed)"
            return out
        crash = crash_signal(code)
        if crash and i + 1 < len(attempts):
            notes.append(_repack_note("run", crash))
            print(f"[{BATCHED_BENCH}] {notes[-1]}", flush=True)
            continue
        rows = [r for r in parse_batched_bench(text) if int(r.get("pl", 0)) == setup.slots]
        if code != 0 or not rows:
            tail = "\n".join(text.strip().splitlines()[-10:])
            why = (f"killed by {crash}" if crash else f"exit code {code}") if code != 0 else \
                (f"no result row for {setup.slots} parallel sequences (-c {setup.batched_ctx} "
                 "too small?)")
            out["error"] = f"{why}; last output lines:\n{tail}"
            return out
        out["result"] = rows[-1]
        return out
    raise AssertionError("unreachable")  # pragma: no cover


# ------------------------------------------------------------------------------------------
# The comparison
# ------------------------------------------------------------------------------------------

def _ratio(mine: float | None, theirs: float | None) -> float | None:
    if mine is None or theirs is None or not theirs > 0 or not math.isfinite(mine):
        return None
    return mine / theirs


def engine_row(out: dict[str, Any]) -> dict[str, Any]:
    """One engine's line of the table (None where an engine has no such figure)."""
    row: dict[str, Any] = {"engine": out["engine"], "error": out.get("error"),
                           "completed": None, "failed": None, "output_throughput": None,
                           "median_ttft_ms": None, "median_tpot_ms": None,
                           "idle_rss_bytes": None}
    report = out.get("report")
    if report is not None:
        row.update(completed=report["completed"], failed=report["failed"],
                   output_throughput=report["output_throughput"],
                   median_ttft_ms=report["median_ttft_ms"],
                   median_tpot_ms=report["median_tpot_ms"])
    if out.get("idle_memory"):
        row["idle_rss_bytes"] = out["idle_memory"]["rss_bytes"]
    result = out.get("result")
    if result is not None:  # llama-batched-bench: no requests; its step times instead
        row.update(output_throughput=result["speed_tg"],
                   median_ttft_ms=result["t_pp"] * 1e3,
                   median_tpot_ms=result["t_tg"] / result["tg"] * 1e3 if result["tg"] else None)
    return row


def compare(engines: dict[str, dict[str, Any]], kv_cache: dict[str, Any] | None
            ) -> dict[str, Any]:
    """folio over each peer (output throughput), and the memory line: folio's idle RSS
    against llama-server's idle RSS plus folio's KV cache bytes."""
    rows = {name: engine_row(out) for name, out in engines.items()}
    mine = rows.get(FOLIO, {}).get("output_throughput")
    ratios = {}
    for peer in PEERS:
        if peer in rows:
            ratios[peer] = _ratio(mine, rows[peer]["output_throughput"])
    memory: dict[str, Any] = {
        "folio_idle_rss_bytes": rows.get(FOLIO, {}).get("idle_rss_bytes"),
        "llama_server_idle_rss_bytes": rows.get(LLAMA_SERVER, {}).get("idle_rss_bytes"),
        "folio_kv_cache_bytes": (kv_cache or {}).get("bytes"),
    }
    folio_rss = memory["folio_idle_rss_bytes"]
    peer_rss = memory["llama_server_idle_rss_bytes"]
    kv = memory["folio_kv_cache_bytes"]
    if folio_rss is not None and peer_rss is not None and kv is not None:
        budget = peer_rss + kv
        memory["llama_server_idle_rss_plus_folio_kv_bytes"] = budget
        memory["folio_within"] = folio_rss <= budget
        memory["margin_bytes"] = budget - folio_rss
    return {"rows": list(rows.values()), "output_throughput_ratio": ratios, "memory": memory}


def _fmt(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def print_comparison(result: dict[str, Any]) -> None:
    cfg = result["config"]
    comparison = result["comparison"]
    width = 96
    print("{s:{c}^{n}}".format(s=" folio serve vs llama.cpp ", n=width, c="="))
    print(f"model {cfg['gguf_path'] or cfg['model_source']} | {cfg['threads']} threads | "
          f"{cfg['num_prompts']} prompts, input {cfg['input_len']}, output {cfg['output_len']}"
          f" (range {cfg['range_ratio']:g}) | max concurrency {cfg['slots']}")
    header = (f"{'engine':<22}{'ok/failed':>10}{'output tok/s':>14}{'median TTFT ms':>16}"
              f"{'median TPOT ms':>16}{'idle RSS MiB':>14}")
    print(header)
    print("-" * width)
    for row in comparison["rows"]:
        name = row["engine"]
        if name == LLAMA_SERVER:
            name = f"{name} (-np {cfg['slots']})"
        elif name == BATCHED_BENCH:
            name = f"{name} *"
        ok = ("-" if row["completed"] is None
              else f"{row['completed']}/{row['failed']}")
        rss = row["idle_rss_bytes"] / MiB if row["idle_rss_bytes"] is not None else None
        print(f"{name:<22}{ok:>10}{_fmt(row['output_throughput']):>14}"
              f"{_fmt(row['median_ttft_ms']):>16}{_fmt(row['median_tpot_ms']):>16}"
              f"{_fmt(rss):>14}")
        if row["error"]:
            print(f"    error: {row['error']}")
    if any(r["engine"] == BATCHED_BENCH for r in comparison["rows"]):
        print(f"  * llama-batched-bench: output tok/s = S_TG at {cfg['slots']} parallel "
              "sequences; TTFT column = T_PP (all prompts' prefill), TPOT = T_TG / tokens")
    print("-" * width)
    for peer, ratio in comparison["output_throughput_ratio"].items():
        what = "S_TG" if peer == BATCHED_BENCH else "output throughput"
        print(f"folio / {peer} ({what}): "
              + (f"{ratio:.2f}x" if ratio is not None else "n/a (no figure for both)"))
    mem = comparison["memory"]
    kv = result.get("folio_kv_cache") or {}
    if mem.get("folio_within") is not None:
        print(f"memory: folio idle RSS {mem['folio_idle_rss_bytes'] / MiB:.1f} MiB vs "
              f"llama-server idle RSS {mem['llama_server_idle_rss_bytes'] / MiB:.1f} MiB + "
              f"folio KV cache {mem['folio_kv_cache_bytes'] / MiB:.1f} MiB = "
              f"{mem['llama_server_idle_rss_plus_folio_kv_bytes'] / MiB:.1f} MiB -> "
              f"{'within' if mem['folio_within'] else 'OVER'} "
              f"(margin {mem['margin_bytes'] / MiB:.1f} MiB)")
    elif mem.get("folio_idle_rss_bytes") is not None:
        print(f"memory: folio idle RSS {mem['folio_idle_rss_bytes'] / MiB:.1f} MiB"
              + (f", folio KV cache {mem['folio_kv_cache_bytes'] / MiB:.1f} MiB"
                 if mem.get("folio_kv_cache_bytes") is not None else ""))
    if kv.get("how"):
        print(f"  folio KV cache: {kv['how']}; its pages are mapped on first use, so not in "
              "folio's idle RSS")
    llama_kv = result.get("llama_server_kv_cache") or {}
    if llama_kv.get("bytes") is not None:
        print(f"  llama-server's own KV cache ({llama_kv['cells']} cells, f16): "
              f"{llama_kv['bytes'] / MiB:.1f} MiB, cleared at start-up: in its idle RSS")
    for name, out in result["engines"].items():
        cpu = out.get("cpu")
        if cpu:
            print(f"  CPU during {name}'s run ({cpu['wall_s']:.1f} s): itself "
                  f"{cpu['server_s']:.1f} s, this client {cpu['client_s']:.1f} s, other "
                  f"processes {cpu['other_s']:.1f} s, stolen {cpu['steal_s']:.1f} s")
    for name, out in result["engines"].items():
        for note in out.get("notes") or []:
            print(f"  {name}: {note}")
    print("=" * width)


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------

class _SigtermAsExit:
    """SIGTERM raises SystemExit in the main thread while the servers run, so the `with`
    blocks stop them (the default action would end the benchmark and leave them running)."""

    def __enter__(self) -> "_SigtermAsExit":
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def _load_tokenizer(args: argparse.Namespace, source: Any) -> Any:
    from folio.engine.tokenizer import load_tokenizer
    return load_tokenizer(source, args.tokenizer)


def _strip_logs(engines: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The engines' results for the JSON: each log's last lines, not the whole log (the log
    files themselves are gone unless --server-log-dir kept them)."""
    out = {}
    for name, engine in engines.items():
        engine = dict(engine)
        text = engine.pop("log_text", None)
        if text:
            engine["log_tail"] = text.strip().splitlines()[-30:]
        out[name] = engine
    return out


def run_comparison(args: argparse.Namespace, *, tokenizer: Any = None) -> dict[str, Any]:
    serve._validate(args)
    if args.base_url:
        raise ValueError("--peer / --launch start the servers here; drop --base-url")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    percentiles = serve.parse_percentiles(args.percentiles)
    peers = peers_of(args)
    source, gguf_path = resolve_model(args.model_path)
    check_gguf_for_peers(peers, repr(args.model_path or source.path), gguf_path)
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset == "random"
    chat = serve.is_chat_endpoint(args.endpoint)
    if tokenizer is None:
        tokenizer = _load_tokenizer(args, source)
    requests = serve.build_requests(args, tokenizer, chat)
    warm_args = copy.copy(args)
    warm_args.num_prompts = args.num_warmups
    warm_args.seed = args.seed + 1_000_003   # other prompts: no shared prefix with the run's
    warmups = serve.build_requests(warm_args, tokenizer, chat) if args.num_warmups else []
    setup = build_setup(args, source, gguf_path, requests)
    if BATCHED_BENCH in peers and args.dataset != "random":
        print(f"note: {BATCHED_BENCH} uses -npp {args.random_input_len} -ntg "
              f"{args.random_output_len}, not the file's prompts", flush=True)

    log_dir_ctx = (tempfile.TemporaryDirectory(prefix="folio-bench-serve-")
                   if args.server_log_dir is None else None)
    log_dir = log_dir_ctx.name if log_dir_ctx is not None else args.server_log_dir
    os.makedirs(log_dir, exist_ok=True)
    engines: dict[str, dict[str, Any]] = {}
    shape = model_kv_shape(source)
    try:
        with _SigtermAsExit():
            engines[FOLIO] = _guarded(FOLIO, lambda: run_http_engine(
                FOLIO, lambda port: folio_serve_argv(setup, port,
                                                     shlex.split(args.folio_serve_args)),
                folio_serve_env(setup.threads), args, requests, warmups, percentiles,
                log_dir))
            if LLAMA_SERVER in peers:
                engines[LLAMA_SERVER] = _guarded(LLAMA_SERVER, lambda: run_llama_server(
                    setup, args, requests, warmups, percentiles, log_dir))
            if BATCHED_BENCH in peers:
                engines[BATCHED_BENCH] = _guarded(BATCHED_BENCH, lambda: run_batched_bench(
                    setup, args, log_dir))
    finally:
        if log_dir_ctx is not None:
            log_dir_ctx.cleanup()

    kv_cache = folio_kv_cache(engines[FOLIO].get("log_text", ""), shape)
    llama_kv = None
    if LLAMA_SERVER in peers:
        cells = llama_server_ctx_from_log(engines[LLAMA_SERVER].get("log_text", "")) \
            or setup.server_ctx
        llama_kv = {"cells": cells, "bytes": llama_kv_cache_estimate(cells, shape),
                    "how": "slots x per-slot context from llama-server's log (else -c) x f16 "
                           "K and V of the model's shape"}
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "config": {
            "model_path": setup.model_path, "model_source": setup.model_source,
            "gguf_path": setup.gguf_path, "threads": setup.threads, "slots": setup.slots,
            "slot_tokens": setup.slot_tokens, "llama_server_ctx": setup.server_ctx,
            "llama_batched_bench_ctx": setup.batched_ctx, "binaries": setup.binaries,
            "peers": peers, "num_prompts": len(requests), "num_warmups": len(warmups),
            "input_len": args.random_input_len, "output_len": args.random_output_len,
            "range_ratio": args.random_range_ratio, "dataset": args.dataset,
            "endpoint": args.endpoint, "request_rate": args.request_rate
            if math.isfinite(args.request_rate) else "inf",
            "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos,
            "temperature": args.temperature, "seed": args.seed, "keep_alive": False,
            "folio_env": {"OMP_NUM_THREADS": str(setup.threads),
                          "MKL_NUM_THREADS": str(setup.threads)},
            "llama_cpp_repack": args.llama_cpp_repack,
        },
        "engines": _strip_logs(engines),
        "folio_kv_cache": kv_cache,
        "llama_server_kv_cache": llama_kv,
    }
    result["comparison"] = compare(engines, kv_cache)
    if not args.quiet:
        for name, out in engines.items():
            if out.get("report") is not None:
                print(f"\n[{name}]")
                serve.print_report({**out["report"], "request_rate": float(args.request_rate)},
                                   percentiles)
        print()
        print_comparison(result)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, default=_json_default)
    runs = [(name, out["report"]) for name, out in engines.items() if out.get("report")]
    if getattr(args, "plot", None) and runs:
        # Every HTTP engine's distributions on the same axes (llama-batched-bench has none).
        from folio.bench.serve_plot import plot_serve
        print(f"plot written to {plot_serve(runs, args.plot)}")
    return result


def _guarded(name: str, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One engine's run; an ordinary failure becomes its error (the others still run);
    Ctrl-C and SystemExit go through (every server is stopped on the way out)."""
    try:
        return body()
    except Exception as exc:  # noqa: BLE001 - reported in the engine's row
        print(f"[{name}] failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return {"engine": name, "error": f"{type(exc).__name__}: {exc}"}


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    return str(obj)


if __name__ == "__main__":
    sys.exit(main())
