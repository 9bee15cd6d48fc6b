"""`folio bench serve`: online serving benchmark against an OpenAI-compatible streaming server.

vLLM's `bench serve` semantics: a dataset of requests is sent to `/v1/completions` (or
`/v1/chat/completions`) with ``"stream": true`` (or, to `/v1/embeddings`, as one embeddings
request each: its latency is reported as TTFT and E2EL, no tokens are generated); arrivals follow a Poisson process (gamma
inter-arrivals with ``--burstiness``; ``--request-rate inf`` sends everything at once), optionally
capped by ``--max-concurrency``. Each streamed response yields:

* TTFT: time from sending the request to the first chunk that carries content;
* ITL: the gaps between consecutive content chunks;
* E2EL: time from sending the request to the end of the stream;
* TPOT: (E2EL - TTFT) / (output_tokens - 1), output tokens from the final ``usage`` chunk.

A failed request (HTTP error, error chunk, broken stream, timeout) is counted with its error
message and never aborts the run. Works with any OpenAI-compatible server, not only folio's.
`folio bench serve --peer llama-server` (folio.bench.serve_peers) starts `folio serve` and
llama.cpp's peers itself and compares them on these requests.

    python -m folio.bench.serve --base-url http://127.0.0.1:8000 --num-prompts 100 \\
        --random-input-len 256 --random-output-len 128 --request-rate 8 --output-json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Sequence

import numpy as np

from folio.bench.command import bench_main
from folio.bench.datasets import sample_random_requests, special_token_ids
from folio.bench.plot_support import add_plot_arg

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DATASETS = ("random", "file", "random-mm")
# The metrics the report summarises (vLLM's names); every one is reported in milliseconds.
METRICS = ("ttft", "tpot", "itl", "e2el")
_METRIC_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


# ------------------------------------------------------------------------------------------
# Requests and results
# ------------------------------------------------------------------------------------------

@dataclass
class BenchRequest:
    """One request to send: a text prompt or token ids (exact lengths for /v1/completions)."""

    prompt: str | list[int]
    prompt_len: int | None     # None when no tokenizer was used: the server's usage says
    output_len: int
    # Images sent with a chat prompt (data URLs; --dataset random-mm).
    images: list[str] = field(default_factory=list)


@dataclass
class RequestResult:
    """What one streamed request measured. Times are seconds, from when it was sent."""

    success: bool = False
    error: str = ""
    send_time: float = 0.0         # seconds since the benchmark started
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    prompt_len: int = 0
    output_tokens: int = 0


# ------------------------------------------------------------------------------------------
# Arrivals
# ------------------------------------------------------------------------------------------

def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Send time of each request, in seconds after the first (which goes at 0).

    Inter-arrival gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate for
    any burstiness; burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular. Offsets
    are absolute (not a sleep per gap) so scheduling jitter does not accumulate over a long run.
    A private Generator keeps them deterministic for a seed and leaves global state alone."""
    if num_requests < 1:
        return []
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                     size=num_requests - 1)
    return [0.0] + np.cumsum(gaps).tolist()


# ------------------------------------------------------------------------------------------
# Datasets
# ------------------------------------------------------------------------------------------

def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's random-dataset range: uniform in [len*(1-r), len*(1+r)], at least 1 token."""
    if length < 1:
        raise ValueError(f"lengths must be >= 1, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    return max(1, math.floor(length * (1 - range_ratio))), math.ceil(length * (1 + range_ratio))


def load_prompt_file(path: str) -> list[dict[str, Any]]:
    """Rows of {"prompt": str, optional "output_len": int} from a text file (one prompt per
    non-empty line) or JSONL (objects with a "prompt" field, optional "output_len"/"max_tokens")."""
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\r\n") for line in f]
    lines = [line for line in lines if line.strip()]
    if not lines:
        raise ValueError(f"no prompts in {path}")
    jsonl = path.endswith(".jsonl") or lines[0].lstrip().startswith("{")
    if not jsonl:
        return [{"prompt": line} for line in lines]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f"{path}:{number}: expected an object with a string 'prompt'")
        row: dict[str, Any] = {"prompt": obj["prompt"]}
        out = obj.get("output_len", obj.get("max_tokens"))
        if out is not None:
            row["output_len"] = int(out)
        rows.append(row)
    return rows


def build_requests(args: argparse.Namespace, tokenizer: Any, chat: bool) -> list[BenchRequest]:
    """The benchmark's requests. Random prompts are token ids (sent as ids to /v1/completions so
    the server sees exactly the sampled length; decoded to text for chat, where the template
    changes the length anyway). File prompts are sent as text."""
    in_range = length_range(args.random_input_len, args.random_range_ratio)
    out_range = length_range(args.random_output_len, args.random_range_ratio)
    if args.dataset == "random-mm":
        return _image_requests(args, tokenizer, in_range, out_range)
    if args.dataset == "random":
        if tokenizer is None:
            raise ValueError("the random dataset needs a tokenizer (--tokenizer)")
        samples = sample_random_requests(
            args.num_prompts, in_range, out_range, len(tokenizer), seed=args.seed,
            exclude_token_ids=special_token_ids(tokenizer))
        return [BenchRequest(prompt=tokenizer.decode(s.prompt_token_ids) if chat
                             else s.prompt_token_ids,
                             prompt_len=s.prompt_len, output_len=s.expected_output_len)
                for s in samples]

    if not args.dataset_path:
        raise ValueError("--dataset file needs --dataset-path")
    rows = load_prompt_file(args.dataset_path)
    # Fewer prompts than requested: cycle through them, so --num-prompts always holds.
    rows = [rows[i % len(rows)] for i in range(args.num_prompts)]
    rng = np.random.default_rng(args.seed)
    out_lens = rng.integers(out_range[0], out_range[1] + 1, size=len(rows)).tolist()
    requests = []
    for row, out_len in zip(rows, out_lens):
        prompt_len = len(tokenizer.encode(row["prompt"])) if tokenizer is not None else None
        requests.append(BenchRequest(prompt=row["prompt"], prompt_len=prompt_len,
                                     output_len=row.get("output_len", out_len)))
    return requests


def _image_requests(args: argparse.Namespace, tokenizer: Any, in_range: tuple[int, int],
                    out_range: tuple[int, int], seed_offset: int = 0) -> list[BenchRequest]:
    """Random text prompts, each with --random-mm-images-per-request distinct images (random
    pixels, or --mm-image-dir's); `seed_offset` changes the texts only."""
    from folio.bench.image_dataset import folder_image_urls, parse_size, random_image_urls
    if tokenizer is None:
        raise ValueError("the random-mm dataset needs a tokenizer (--tokenizer)")
    samples = sample_random_requests(
        args.num_prompts, in_range, out_range, len(tokenizer), seed=args.seed + seed_offset,
        exclude_token_ids=special_token_ids(tokenizer))
    per = args.random_mm_images_per_request
    count = args.num_prompts * per
    urls = (folder_image_urls(args.mm_image_dir, count) if args.mm_image_dir
            else random_image_urls(count, parse_size(args.random_mm_image_size), args.seed))
    return [BenchRequest(prompt=tokenizer.decode(s.prompt_token_ids), prompt_len=None,
                         output_len=s.expected_output_len, images=urls[i * per:(i + 1) * per])
            for i, s in enumerate(samples)]


def load_tokenizer(path: str | None) -> Any:
    """The tokenizer at `path`, or the default model's (converted from its GGUF on first use)."""
    from transformers import AutoTokenizer

    if path is None:
        from folio.model.default_model import default_model_path
        path = default_model_path()
    return AutoTokenizer.from_pretrained(path)


# ------------------------------------------------------------------------------------------
# HTTP
# ------------------------------------------------------------------------------------------

def resolve_base_url(args: argparse.Namespace) -> str:
    base = args.base_url or f"http://{args.host}:{args.port}"
    base = base.rstrip("/")
    # Accept a base URL that already ends in /v1 (what OpenAI clients are given).
    if base.endswith("/v1") and args.endpoint.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base


def resolve_api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("FOLIO_API_KEY") or os.environ.get("OPENAI_API_KEY")


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


async def fetch_default_model(session: Any, base_url: str, headers: dict[str, str]) -> str:
    """The first model the server lists at GET /v1/models."""
    import aiohttp

    url = f"{base_url}/v1/models"
    try:
        async with session.get(url, headers=headers) as resp:
            if resp.status != 200:
                raise ValueError(f"GET {url}: HTTP {resp.status}: {(await resp.text())[:300]}")
            data = (await resp.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise ValueError(f"cannot list models at {url} ({type(exc).__name__}: {exc}); "
                         f"is the server up? (or pass --model)") from None
    if not data or "id" not in data[0]:
        raise ValueError(f"GET {url} listed no models; pass --model")
    return str(data[0]["id"])


def build_payload(request: BenchRequest, model: str, chat: bool, temperature: float,
                  ignore_eos: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": temperature,
        "stream": True,
        # The final chunk then carries the exact token counts.
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        # vLLM's extra field (generate exactly max_tokens); sent only when asked, since strict
        # OpenAI-compatible servers reject unknown fields.
        payload["ignore_eos"] = True
    if chat and request.images:
        from folio.bench.image_dataset import chat_content
        payload["messages"] = [{"role": "user",
                                "content": chat_content(request.prompt, request.images)}]
    elif chat:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    return payload


def _chunk_content(chunk: dict[str, Any], chat: bool) -> str:
    """The generated text a stream chunk carries ('' for role-only or usage-only chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        # Reasoning models stream thoughts separately; they are generated tokens all the same.
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def _chunk_error(chunk: dict[str, Any]) -> str | None:
    if "error" in chunk:
        err = chunk["error"]
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    if chunk.get("object") == "error":
        return str(chunk.get("message", chunk))
    return None


def is_embeddings_endpoint(endpoint: str) -> bool:
    """/v1/embeddings (or /pooling): one non-streamed response per request."""
    return endpoint.rstrip("/").endswith(("/embeddings", "/pooling"))


def build_embeddings_payload(request: BenchRequest, model: str) -> dict[str, Any]:
    return {"model": model, "input": request.prompt}


async def send_embeddings_request(session: Any, url: str, headers: dict[str, str],
                                  payload: dict[str, Any], timeout_s: float,
                                  prompt_len: int | None, bench_start: float) -> RequestResult:
    """One embeddings request: its whole latency (reported as TTFT and E2EL, as vLLM's
    embeddings backend does; nothing streams). Never raises (except cancellation)."""
    import aiohttp

    result = RequestResult(prompt_len=prompt_len or 0)
    start = time.perf_counter()
    result.send_time = start - bench_start
    try:
        async with session.post(url, json=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            body = await resp.read()
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {body[:500].decode(errors='replace')}"
                return result
            response = json.loads(body)
    except asyncio.TimeoutError:
        result.error = f"timeout after {timeout_s:g} s"
        return result
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = result.ttft = time.perf_counter() - start
    if not isinstance(response, dict) or not response.get("data"):
        result.error = f"response carries no data: {body[:200]!r}"
        return result
    usage = response.get("usage") or {}
    if usage.get("prompt_tokens"):
        result.prompt_len = int(usage["prompt_tokens"])
    result.success = True
    return result


async def send_request(session: Any, url: str, headers: dict[str, str], payload: dict[str, Any],
                       chat: bool, timeout_s: float, prompt_len: int | None,
                       bench_start: float) -> RequestResult:
    """Send one streaming request and time its chunks. Never raises (except cancellation):
    every failure becomes a failed RequestResult with a message."""
    import aiohttp

    result = RequestResult(prompt_len=prompt_len or 0)
    start = time.perf_counter()
    result.send_time = start - bench_start
    content_chunks = 0
    last: float | None = None
    usage: dict[str, Any] | None = None
    done = False
    finished = False
    try:
        async with session.post(url, json=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                body = (await resp.text())[:500]
                result.error = f"HTTP {resp.status}: {body or resp.reason}"
                return result
            buffer = b""
            # Split lines ourselves: aiohttp's line iterator rejects lines over 64 KiB.
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue            # blank separators, ": keep-alive", "event:" lines
                    body_bytes = line[len(b"data:"):].strip()
                    if body_bytes == b"[DONE]":
                        done = True
                        continue
                    chunk = json.loads(body_bytes)
                    if not isinstance(chunk, dict):
                        raise ValueError(f"stream chunk is not a JSON object: {body_bytes[:100]!r}")
                    error = _chunk_error(chunk)
                    if error is not None:
                        result.error = f"error in stream: {error}"
                        return result
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if any(c.get("finish_reason") for c in chunk.get("choices") or []):
                        finished = True
                    content = _chunk_content(chunk, chat)
                    if not content:
                        continue
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    content_chunks += 1
        result.latency = time.perf_counter() - start
    except asyncio.TimeoutError:
        result.error = f"timeout after {timeout_s:g} s"
        return result
    except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: bad JSON chunk
        result.error = f"{type(exc).__name__}: {exc}"
        return result

    if not done and not finished:
        # A stream cut short. (Some servers omit [DONE] but send a finish_reason: accepted.)
        result.error = "stream ended without 'data: [DONE]' or a finish_reason"
    elif content_chunks == 0:
        result.error = "stream carried no content (no TTFT)"
    else:
        result.success = True
    if usage:
        result.output_tokens = int(usage.get("completion_tokens") or content_chunks)
        # The server knows the true prompt length (chat templates add tokens).
        if usage.get("prompt_tokens"):
            result.prompt_len = int(usage["prompt_tokens"])
    else:
        result.output_tokens = content_chunks
    return result


# ------------------------------------------------------------------------------------------
# Benchmark
# ------------------------------------------------------------------------------------------

@dataclass
class _Concurrency:
    """Requests in flight now and the peak seen (counted after the semaphore, at send)."""

    current: int = 0
    peak: int = 0


async def benchmark(args: argparse.Namespace, requests: Sequence[BenchRequest],
                    model: str | None = None) -> tuple[list[RequestResult], float, str, int]:
    """Send `requests` on the arrival schedule; return (results, duration_s, model, peak)."""
    import aiohttp

    base_url = resolve_base_url(args)
    url = base_url + args.endpoint
    chat = is_chat_endpoint(args.endpoint)
    headers = _headers(resolve_api_key(args))
    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    concurrency = _Concurrency()
    progress = None
    if not args.disable_tqdm:
        from tqdm import tqdm
        progress = tqdm(total=len(requests), desc="requests", file=sys.stderr)

    # limit=0: no connection-pool cap, so concurrency is set only by the arrivals and
    # --max-concurrency (aiohttp's default of 100 would silently cap a burst). --no-keep-alive:
    # a new connection per request (llama-server closes a connection after each stream while
    # advertising keep-alive; a reused one then fails with "Can not write request body").
    connector = aiohttp.TCPConnector(limit=0,
                                     force_close=bool(getattr(args, "no_keep_alive", False)))
    async with aiohttp.ClientSession(connector=connector, trust_env=False,
                                     timeout=aiohttp.ClientTimeout(total=args.timeout)) as session:
        if model is None:
            model = args.model or await fetch_default_model(session, base_url, headers)

        embeddings = is_embeddings_endpoint(args.endpoint)

        async def one(request: BenchRequest, bench_start: float) -> RequestResult:
            if embeddings:
                payload = build_embeddings_payload(request, model)
            else:
                payload = build_payload(request, model, chat, args.temperature, args.ignore_eos)
            if semaphore is not None:
                await semaphore.acquire()
            concurrency.current += 1
            concurrency.peak = max(concurrency.peak, concurrency.current)
            try:
                if embeddings:
                    return await send_embeddings_request(session, url, headers, payload,
                                                         args.timeout, request.prompt_len,
                                                         bench_start)
                return await send_request(session, url, headers, payload, chat, args.timeout,
                                          request.prompt_len, bench_start)
            finally:
                concurrency.current -= 1
                if semaphore is not None:
                    semaphore.release()
                if progress is not None:
                    progress.update(1)

        bench_start = time.perf_counter()
        tasks = []
        for request, offset in zip(requests, offsets):
            delay = bench_start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request, bench_start)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - bench_start
    if progress is not None:
        progress.close()
    return results, duration, model, concurrency.peak


def is_chat_endpoint(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def _summary(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/percentiles in ms; zeros when there is no data (all requests failed)."""
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    if arr.size == 0:
        arr = np.zeros(1)
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        out[f"p{_pct_name(p)}"] = float(np.percentile(arr, p))
    return out


def _pct_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def compute_metrics(results: Sequence[RequestResult], duration: float,
                    percentiles: Sequence[float]) -> dict[str, Any]:
    """vLLM's serving metrics over the successful requests (flat keys like mean_ttft_ms)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    # TPOT needs at least two tokens: the first one's time is TTFT, not decode.
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": tpots,
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    for name in METRICS:
        for stat, value in _summary(series[name], percentiles).items():
            metrics[f"{stat}_{name}_ms"] = value
    return metrics


def print_report(report: dict[str, Any], percentiles: Sequence[float]) -> None:
    """vLLM's result table."""
    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<40} {text:<10}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", report["completed"])
    row("Failed requests:", report["failed"])
    row("Maximum request concurrency:", report["max_concurrency"] or "unlimited")
    row("Peak concurrent requests:", report["max_concurrency_seen"])
    row("Request rate configured (RPS):", float(report["request_rate"]))
    row("Benchmark duration (s):", report["duration"])
    row("Total input tokens:", report["total_input_tokens"])
    row("Total generated tokens:", report["total_output_tokens"])
    row("Request throughput (req/s):", report["request_throughput"])
    row("Output token throughput (tok/s):", report["output_throughput"])
    row("Total token throughput (tok/s):", report["total_token_throughput"])
    for name in METRICS:
        title, short = _METRIC_TITLES[name]
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", report[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", report[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{_pct_name(p)} {short} (ms):", report[f"p{_pct_name(p)}_{name}_ms"])
    print("=" * 50)
    errors = [e for e in report["errors"] if e]
    if errors:
        # Distinct messages with counts: 100 identical "HTTP 404" lines would hide the cause.
        counts: dict[str, int] = {}
        for e in errors:
            counts[e] = counts.get(e, 0) + 1
        print(f"Errors ({len(errors)} failed requests):")
        for message, count in sorted(counts.items(), key=lambda kv: -kv[1])[:10]:
            print(f"  {count} x {message}")


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------

def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in str(text).split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--percentiles must be comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"--percentiles must be numbers in [0, 100], got {text!r}")
    return values


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default=None,
                        help=f"server URL (default http://HOST:PORT = {DEFAULT_BASE_URL})")
    server.add_argument("--host", default="127.0.0.1", help="server host, when --base-url is not given")
    server.add_argument("--port", type=int, default=8000, help="server port, when --base-url is not given")
    server.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions or /v1/chat/completions")
    server.add_argument("--model", default=None,
                        help="model name sent in requests (default: first of GET /v1/models)")
    server.add_argument("--api-key", default=None,
                        help="Bearer token (default: $FOLIO_API_KEY, then $OPENAI_API_KEY)")
    server.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    server.add_argument("--no-keep-alive", action="store_true",
                        help="open a new connection for every request (servers that close "
                             "connections they advertised as kept alive, like llama-server)")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", "--dataset-name", dest="dataset", choices=DATASETS,
                      default="random",
                      help="random: random-token prompts; file: prompts read from --dataset-path; "
                           "random-mm: random text with images, to a chat endpoint, sent twice "
                           "(the second pass's images come from the encoder cache: TTFT "
                           "reported with and without it)")
    data.add_argument("--dataset-path", default=None,
                      help="--dataset file: one prompt per line, or JSONL with a 'prompt' field")
    data.add_argument("--num-prompts", type=int, default=100, help="number of requests")
    data.add_argument("--random-mm-images-per-request", type=int, default=1,
                      help="--dataset random-mm: images per chat request")
    data.add_argument("--random-mm-image-size", default="336x336", metavar="WxH",
                      help="--dataset random-mm: size of the generated random-pixel images")
    data.add_argument("--mm-image-dir", default=None, metavar="DIR",
                      help="--dataset random-mm: send this folder's images (PNG, JPEG, WebP) "
                           "instead of generated ones")
    data.add_argument("--random-input-len", type=int, default=256,
                      help="prompt tokens of a random request")
    data.add_argument("--random-output-len", type=int, default=128,
                      help="output length (also for --dataset file rows that give none)")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)]")
    data.add_argument("--tokenizer", default=None,
                      help="tokenizer for random prompts (default: the default model's)")
    data.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and arrivals")

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="mean requests/s of the arrival process; inf = all at once")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrivals: 1 = Poisson, <1 burstier")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="at most this many requests in flight (default: no limit)")

    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0,
                          help="sampling temperature of every request (0 = greedy)")
    sampling.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                          help="generate exactly max_tokens (default: on for random, off for file)")

    out = parser.add_argument_group("output")
    out.add_argument("--percentiles", "--metric-percentiles", dest="percentiles", default="50,99",
                     help="comma-separated percentiles to report")
    out.add_argument("--output-json", default=None, help="write the results to this file")
    add_plot_arg(out, "the TTFT, TPOT, ITL and E2E latency distributions (CDFs, "
                      "p50/p90/p99 marked)")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    out.add_argument("--quiet", action="store_true", help="do not print the result table")


def _validate(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.endpoint.startswith("/"):
        raise ValueError(f"--endpoint must start with '/', got {args.endpoint!r}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    arrival_offsets(1, args.request_rate, args.burstiness)   # validates rate and burstiness
    if args.dataset == "random-mm":
        if not is_chat_endpoint(args.endpoint):
            raise ValueError("--dataset random-mm sends images: use --endpoint "
                             "/v1/chat/completions")
        if not 1 <= args.random_mm_images_per_request <= 64:
            raise ValueError("--random-mm-images-per-request must be in [1, 64]")


def run(args: argparse.Namespace, *, tokenizer: Any = None) -> dict[str, Any]:
    """Run the benchmark and return vLLM-style results. `tokenizer` overrides --tokenizer
    (tests pass a stub); it is loaded only when needed (random data or an explicit path)."""
    _validate(args)
    percentiles = parse_percentiles(args.percentiles)
    requests = prepare_requests(args, tokenizer)

    results, duration, model, peak = asyncio.run(benchmark(args, requests))
    report = build_report(args, requests, results, duration, model, peak, percentiles)
    if args.dataset == "random-mm":
        # The same images with other texts: each image is in the server's encoder cache
        # (if it holds them all), no prefix is shared with the first pass.
        warm_requests = _image_requests(args, _tokenizer_of(args, tokenizer),
                                        length_range(args.random_input_len,
                                                     args.random_range_ratio),
                                        length_range(args.random_output_len,
                                                     args.random_range_ratio), seed_offset=1)
        warm, warm_duration, _, _ = asyncio.run(benchmark(args, warm_requests, model))
        report["encoder_cache"] = {
            "images_per_request": args.random_mm_images_per_request,
            "without": _ttft_summary(results, duration, percentiles),
            "with": _ttft_summary(warm, warm_duration, percentiles)}

    if not args.quiet:
        print_report({**report, "request_rate": float(args.request_rate)}, percentiles)
        if "encoder_cache" in report:
            cache = report["encoder_cache"]
            for label, key in (("without", "without"), ("with", "with")):
                print(f"{'TTFT ' + label + ' the encoder cache (median ms):':<50} "
                      f"{cache[key]['median_ttft_ms']:.2f}")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    if getattr(args, "plot", None):
        from folio.bench.serve_plot import plot_serve
        print(f"plot written to {plot_serve([(report['model_id'], report)], args.plot)}")
    return report


def _tokenizer_of(args: argparse.Namespace, tokenizer: Any) -> Any:
    return tokenizer if tokenizer is not None else load_tokenizer(args.tokenizer)


def _ttft_summary(results: Sequence[RequestResult], duration: float,
                  percentiles: Sequence[float]) -> dict[str, Any]:
    """One pass's TTFT figures and its failures (random-mm's encoder-cache comparison)."""
    metrics = compute_metrics(results, duration, percentiles)
    return {k: v for k, v in metrics.items() if k.endswith("_ttft_ms")
            or k in ("completed", "failed", "total_input_tokens")}


def prepare_requests(args: argparse.Namespace, tokenizer: Any = None) -> list[BenchRequest]:
    """The run's requests (also each value's of `folio bench sweep serve`): --ignore-eos
    resolved (on for random data), the tokenizer loaded when needed (random data or an
    explicit path; `tokenizer` overrides it)."""
    chat = is_chat_endpoint(args.endpoint)
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset in ("random", "random-mm")
    if tokenizer is None and (args.dataset in ("random", "random-mm") or args.tokenizer):
        tokenizer = load_tokenizer(args.tokenizer)
    return build_requests(args, tokenizer, chat)


def build_report(args: argparse.Namespace, requests: Sequence[BenchRequest],
                 results: Sequence[RequestResult], duration: float, model: str, peak: int,
                 percentiles: Sequence[float]) -> dict[str, Any]:
    """The run's vLLM-style results: settings, metrics, then the per-request lists."""
    chat = is_chat_endpoint(args.endpoint)
    report: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if chat else "openai",
        "base_url": resolve_base_url(args),
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer_id": args.tokenizer,
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "max_concurrency_seen": peak,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": args.seed,
        "percentiles": percentiles,
    }
    report.update(compute_metrics(results, duration, percentiles))
    # Per-request detail, in request order (vLLM's lists, plus send times and failures).
    report["input_lens"] = [r.prompt_len for r in results]
    report["output_lens"] = [r.output_tokens for r in results]
    report["ttfts"] = [r.ttft for r in results]
    report["itls"] = [r.itl for r in results]
    report["e2els"] = [r.latency for r in results]
    report["send_times"] = [r.send_time for r in results]
    report["errors"] = [r.error for r in results]
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, 'folio bench serve',
                      'Online serving benchmark against an OpenAI-compatible streaming server.',
                      add_cli_args, run)


if __name__ == "__main__":
    sys.exit(main())
