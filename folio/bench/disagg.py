"""`folio bench disagg`: does disaggregated prefill protect decoding from long prompts?

Runs one workload twice: against a single `folio serve`, then against `folio router` in front
of a prefill server (kv_producer) and a decode server (kv_consumer), all started here. On one
GPU the two share it (give each --gpu-memory-utilization or --kv-cache-memory-bytes in
--server-args), under an MPS daemon of the benchmark's own where NVIDIA's is installed
(--mps): without MPS the GPU runs one process's kernels at a time, and a prefill's long
kernels hold the decode server's steps for their whole duration; under MPS the prefill gets
--mps-prefill-sm-percentage of the SMs and decoding goes on beside it. The workload:
`--num-decoders` streaming requests of short prompts and long outputs start together; while
they decode, `--num-long` prompts of `--long-input-len` tokens arrive every `--long-interval`
seconds. Reported: the decoders' inter-token latency (median, p99) and the whole run's output
throughput, each P/D figure over the single server's (the issue's targets: p99 ITL <= 0.5x,
throughput within 10 %).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from folio.bench.mps import mps_available, mps_control, mps_daemon
from folio.bench.serve import BenchRequest, RequestResult, build_payload, send_request
from folio.bench.server_process import ServerProcess, free_port


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="the model (default: folio's default)")
    parser.add_argument("--server-args", default="",
                        help="extra `folio serve` arguments for every server (one string)")
    parser.add_argument("--prefill-server-args", default="",
                        help="more arguments for the prefill server only (one string)")
    parser.add_argument("--decode-server-args", default="",
                        help="more arguments for the decode server only (one string)")
    parser.add_argument("--mps", choices=("auto", "on", "off"), default="auto",
                        help="run the prefill and decode servers under a CUDA MPS daemon of "
                             "the benchmark's own, so that on one GPU their kernels run side "
                             "by side rather than in turns; auto: when the daemon's control "
                             "program is on PATH and the servers are not told --device cpu "
                             "(default: %(default)s)")
    parser.add_argument("--mps-prefill-sm-percentage", type=int, default=60,
                        help="under MPS: the share of SMs the prefill server may use "
                             "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; 100: all; default: "
                             "%(default)s)")
    parser.add_argument("--num-decoders", type=int, default=16)
    parser.add_argument("--decode-input-len", type=int, default=128)
    parser.add_argument("--decode-output-len", type=int, default=512)
    parser.add_argument("--num-long", type=int, default=8)
    parser.add_argument("--long-input-len", type=int, default=8192)
    parser.add_argument("--long-output-len", type=int, default=8)
    parser.add_argument("--long-interval", type=float, default=1.0,
                        help="seconds between long prompts' arrivals")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


def _requests(args: argparse.Namespace) -> tuple[list[BenchRequest], list[BenchRequest]]:
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 20000) for _ in range(n)]
    decoders = [BenchRequest(ids(args.decode_input_len), args.decode_input_len,
                             args.decode_output_len) for _ in range(args.num_decoders)]
    longs = [BenchRequest(ids(args.long_input_len), args.long_input_len, args.long_output_len)
             for _ in range(args.num_long)]
    return decoders, longs


async def _workload(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp
    decoders, longs = _requests(args)
    endpoint = url + "/v1/completions"
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        start, start_wall = time.perf_counter(), time.time()

        def send(request: BenchRequest):
            payload = build_payload(request, model, chat=False, temperature=0.0, ignore_eos=True)
            return send_request(session, endpoint, {}, payload, False, 1800.0,
                                request.prompt_len, start)

        async def long_after(i: int, request: BenchRequest) -> RequestResult:
            await asyncio.sleep(0.5 + i * args.long_interval)
            return await send(request)
        decode_tasks = [asyncio.create_task(send(r)) for r in decoders]
        long_tasks = [asyncio.create_task(long_after(i, r)) for i, r in enumerate(longs)]
        decoded = await asyncio.gather(*decode_tasks)
        long_done = await asyncio.gather(*long_tasks)
        duration = time.perf_counter() - start
    failed = [r.error for r in decoded + long_done if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    itl = sorted(x for r in decoded for x in r.itl)
    tokens = sum(r.output_tokens for r in decoded + long_done)
    median = statistics.median(itl)
    return {"start_wall": start_wall,      # time.time() at the timeline's 0 (servers' logs)
            "itl_median_ms": 1e3 * median,
            "itl_p99_ms": 1e3 * itl[min(len(itl) - 1, int(0.99 * len(itl)))],
            "long_ttft_median_ms": 1e3 * statistics.median(r.ttft for r in long_done),
            "output_tokens": tokens, "duration_s": duration,
            "output_throughput": tokens / duration,
            "stalls": stalls(decoded, max(_STALL_MIN_S, _STALL_FACTOR * median)),
            "long_prompts": [{"sent_s": round(r.send_time, 4),
                              "first_token_s": round(r.send_time + r.ttft, 4),
                              "done_s": round(r.send_time + r.latency, 4)} for r in long_done]}


# A gap between two of a decoder's tokens counts as a stall when it is this many times the
# median inter-token latency, and at least _STALL_MIN_S.
_STALL_FACTOR = 3.0
_STALL_MIN_S = 0.02


def stalls(results: list[RequestResult], threshold: float) -> list[dict[str, float]]:
    """Where the decoders stopped: every gap of a decoder's tokens longer than `threshold`,
    gaps that overlap in time merged into one event (start, end, seconds since the
    benchmark started; how many decoders it held). Read beside the long prompts' send and
    first-token times, they say which phase of a long prompt stalls the others."""
    gaps = []
    for r in results:
        t = r.send_time + r.ttft
        for x in r.itl:
            if x > threshold:
                gaps.append((t, t + x))
            t += x
    events: list[dict[str, float]] = []
    for start, end in sorted(gaps):
        if events and start < events[-1]["end_s"]:
            last = events[-1]
            last["end_s"] = max(last["end_s"], end)
            last["longest_ms"] = max(last["longest_ms"], 1e3 * (end - start))
            last["decoders"] += 1
        else:
            events.append({"start_s": start, "end_s": end, "longest_ms": 1e3 * (end - start),
                           "decoders": 1})
    for e in events:
        e["start_s"], e["end_s"] = round(e["start_s"], 4), round(e["end_s"], 4)
        e["longest_ms"] = round(e["longest_ms"], 2)
    return events


# stall events printed per run (all of them are in the JSON)
_STALLS_PRINTED = 24


def _serve_cmd(args: argparse.Namespace, port: int, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "folio.entrypoints.cli", "serve"]
    if args.model:
        cmd.append(args.model)
    return cmd + ["--port", str(port), *args.server_args.split(), *extra]


def _start(stack: contextlib.ExitStack, name: str, cmd: list[str], port: int, logs: str,
           timeout: float, env: dict[str, str] | None = None) -> str:
    """Start a server in `stack` (stopped when it closes), wait until it is ready; its URL.
    `env`: variables added to this process's environment for it."""
    server = stack.enter_context(ServerProcess(
        name, cmd, log_path=os.path.join(logs, f"{name}.log"),
        env=None if env is None else {**os.environ, **env}))
    url = f"http://127.0.0.1:{port}"
    server.wait_ready(url + "/health", timeout)
    return url


def _server_device(server_args: str) -> str | None:
    """The --device the servers are given, if any."""
    tokens = server_args.split()
    for i, token in enumerate(tokens):
        if token.startswith("--device="):
            return token.split("=", 1)[1]
        if token == "--device" and i + 1 < len(tokens):
            return tokens[i + 1]
    return None


def _use_mps(args: argparse.Namespace) -> bool:
    if args.mps == "on":
        mps_control()            # a clear error where there is none
        return True
    return (args.mps == "auto" and _server_device(args.server_args) != "cpu"
            and mps_available())


def _start_mps(stack: contextlib.ExitStack, mode: str) -> dict[str, str] | None:
    """The MPS daemon's client environment (the daemon stopped when `stack` closes); None
    when it did not start and `mode` is auto (the servers then share the GPU in turns)."""
    try:
        return stack.enter_context(mps_daemon())
    except (OSError, subprocess.SubprocessError) as exc:
        if mode == "on":
            raise RuntimeError(f"--mps on: the MPS daemon did not start: {exc}") from exc
        print(f"MPS daemon did not start ({exc}); prefill and decode run without it",
              flush=True)
        return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not 1 <= args.mps_prefill_sm_percentage <= 100:
        raise ValueError("--mps-prefill-sm-percentage must be in 1..100, got "
                         f"{args.mps_prefill_sm_percentage}")
    use_mps = _use_mps(args)       # decided before the single server's run, not after it
    logs = tempfile.mkdtemp(prefix="folio-bench-disagg-")
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()
                                       if not callable(v)}, "logs": logs, "mps": use_mps}
    port = free_port()
    with contextlib.ExitStack() as stack:
        url = _start(stack, "single", _serve_cmd(args, port, []), port, logs, args.ready_timeout)
        report["single"] = asyncio.run(_workload(url, args))
    p_port, d_port, r_port = free_port(), free_port(), free_port()

    def p2p(role: str) -> list[str]:
        return ["--kv-transfer-config", json.dumps({"kv_connector": "P2pConnector",
                                                    "kv_role": role})]
    with contextlib.ExitStack() as stack:
        mps = _start_mps(stack, args.mps) if use_mps else None
        use_mps = report["mps"] = mps is not None
        prefill_env = decode_env = mps
        if mps is not None and args.mps_prefill_sm_percentage < 100:
            prefill_env = {**mps, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE":
                           str(args.mps_prefill_sm_percentage)}
        prefill = _start(stack, "prefill", _serve_cmd(
            args, p_port, [*p2p("kv_producer"), *args.prefill_server_args.split()]), p_port,
            logs, args.ready_timeout, prefill_env)
        decode = _start(stack, "decode", _serve_cmd(
            args, d_port, [*p2p("kv_consumer"), *args.decode_server_args.split()]), d_port,
            logs, args.ready_timeout, decode_env)
        router = _start(stack, "router", [sys.executable, "-m", "folio.entrypoints.cli",
                                          "router", "--port", str(r_port), "--prefill", prefill,
                                          "--decode", decode], r_port, logs, 60)
        report["disagg"] = asyncio.run(_workload(router, args))
    single, disagg = report["single"], report["disagg"]
    report["itl_p99_ratio"] = disagg["itl_p99_ms"] / single["itl_p99_ms"]
    report["throughput_ratio"] = disagg["output_throughput"] / single["output_throughput"]
    for name in ("single", "disagg"):
        r = report[name]
        print(f"{name:7s}: ITL median {r['itl_median_ms']:.2f} ms, p99 {r['itl_p99_ms']:.2f} ms; "
              f"long prompts' TTFT median {r['long_ttft_median_ms']:.1f} ms; output "
              f"{r['output_throughput']:.1f} tok/s over {r['duration_s']:.1f} s")
        longs = ", ".join(f"{p['sent_s']:.3f}-{p['first_token_s']:.3f}"
                          for p in r["long_prompts"])
        print(f"         long prompts (sent-first token, s): {longs}")
        print("         stalls (start s +ms longest, decoders): " + ", ".join(
            f"{e['start_s']:.3f}+{e['longest_ms']:.0f}({e['decoders']})"
            for e in r["stalls"][:_STALLS_PRINTED]))
    print(f"P/D over single: p99 ITL {report['itl_p99_ratio']:.2f}x (target <= 0.5x), "
          f"throughput {report['throughput_ratio']:.2f}x (target >= 0.9x); prefill and decode "
          + (f"under MPS (prefill {args.mps_prefill_sm_percentage} % of the SMs)" if use_mps
             else "without MPS"))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report
