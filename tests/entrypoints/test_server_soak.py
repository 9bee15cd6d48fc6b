"""A soak against one `folio serve`: 1,000 mixed requests (completions and chat, lengths, n,
streaming, structured outputs), a fifth of the streaming clients disconnecting mid-stream and
some non-streaming clients giving up (aborts). Every completed output must be well formed;
once idle the KV cache holds no blocks and neither process holds request state (both shown by
/metrics); the RSS of both processes stays flat over the second half.

A tiny random model keeps the run to about a minute on two cores. Marked slow; CI runs it.
The figures go to docs/benchmarks.md (run with -s to see them)."""
from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import re
import time

import httpx
import psutil
import pytest

from server_utils import RemoteServer

pytestmark = pytest.mark.slow

NUM_REQUESTS = int(os.environ.get("FOLIO_SOAK_REQUESTS", "1000"))
CONCURRENCY = 32
MAX_MODEL_LEN = 256
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with RemoteServer([tiny_model_dir("llama"), "--max-model-len", str(MAX_MODEL_LEN),
                       "--num-gpu-blocks-override", "192", "--max-num-seqs", "32"]) as srv:
        yield srv


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.compile(rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", re.M)
    values = [float(v) for v in pattern.findall(text)]
    assert values, f"{name} {labels} not in /metrics"
    return sum(values)


def _request(rng: random.Random, i: int) -> dict:
    """One request description: route, body, and what the client does."""
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    n = rng.choice([1, 1, 1, 2, 3])
    length = rng.choice([2, 8, 30, 120])
    text = " ".join(rng.choice(WORDS) for _ in range(length))
    body: dict = {"max_tokens": rng.randint(1, 40), "temperature": 0.0 if n == 1 else 0.8,
                  "n": n, "stream": stream, "seed": i}
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    kind = rng.random()
    structured = None
    if kind < 0.06:
        structured = "choice"
        body["structured_outputs"] = {"choice": ["alpha", "beta", "gamma"]}
    elif kind < 0.12:
        structured = "regex"
        body["structured_outputs"] = {"regex": "[0-9]{1,6}"}
    elif kind < 0.16 and chat:
        structured = "json"
        body["response_format"] = {"type": "json_object"}
        body["max_tokens"] = 60
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    action = "complete"
    if stream and rng.random() < 0.2:
        action = "disconnect"
    elif not stream and rng.random() < 0.05:
        action = "abort"
    return {"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body,
            "action": action, "structured": structured, "chat": chat}


def _check_choice_text(req: dict, text: str, finish_reason: str) -> None:
    assert finish_reason in ("stop", "length"), finish_reason
    if req["structured"] == "choice" and finish_reason == "stop":
        assert text in ("alpha", "beta", "gamma"), text
    if req["structured"] == "regex" and finish_reason == "stop":
        assert re.fullmatch("[0-9]{1,6}", text), text
    if req["structured"] == "json" and finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text


async def _run_one(client: httpx.AsyncClient, req: dict, tally: collections.Counter) -> None:
    body, n = req["body"], req["body"]["n"]
    if req["action"] == "abort":
        try:
            await client.post(req["path"], json=body, timeout=0.05)
            tally["abort_too_late"] += 1
        except httpx.TimeoutException:
            tally["aborted"] += 1
        return
    if not body["stream"]:
        r = await client.post(req["path"], json=body, timeout=120)
        tally[f"status_{r.status_code}"] += 1
        assert r.status_code == 200, r.text
        data = r.json()
        assert sorted(c["index"] for c in data["choices"]) == list(range(n))
        total = 0
        for c in data["choices"]:
            text = c["message"]["content"] if req["chat"] else c["text"]
            _check_choice_text(req, text, c["finish_reason"])
        total = data["usage"]["completion_tokens"]
        assert 1 <= total <= n * body["max_tokens"]
        assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + total
        tally["completed"] += 1
        return
    texts: dict[int, list[str]] = collections.defaultdict(list)
    finish: dict[int, str] = {}
    chunks = 0
    stop_after = random.Random(body["seed"]).randint(1, 4)
    async with client.stream("POST", req["path"], json=body, timeout=120) as r:
        tally[f"status_{r.status_code}"] += 1
        assert r.status_code == 200
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            chunks += 1
            for c in chunk["choices"]:
                piece = c["delta"].get("content") if req["chat"] else c["text"]
                texts[c["index"]].append(piece or "")
                if c.get("finish_reason"):
                    finish[c["index"]] = c["finish_reason"]
            if req["action"] == "disconnect" and chunks >= stop_after:
                tally["disconnected"] += 1
                return  # leaving the context closes the connection mid-stream
    assert done
    assert sorted(finish) == list(range(n)), finish
    for index, reason in finish.items():
        _check_choice_text(req, "".join(texts[index]), reason)
    tally["completed"] += 1


def _full_log(server) -> str:
    server.log()  # flushes
    with open(server.log_path) as f:
        return f.read()


def _rss(pids: list[int]) -> list[int]:
    return [psutil.Process(pid).memory_info().rss for pid in pids]


def test_soak(server):
    api = psutil.Process(server.proc.pid)
    [engine] = [c for c in api.children() if "spawn_main" in " ".join(c.cmdline())]
    pids = [api.pid, engine.pid]
    rng = random.Random(1234)
    requests = [_request(rng, i) for i in range(NUM_REQUESTS)]
    tally: collections.Counter = collections.Counter()
    rss_samples: list[tuple[int, list[int]]] = []
    failures: list[str] = []

    async def main() -> None:
        limits = httpx.Limits(max_connections=CONCURRENCY + 4)
        async with httpx.AsyncClient(base_url=server.url, limits=limits) as client:
            queue: asyncio.Queue = asyncio.Queue()
            for i, req in enumerate(requests):
                queue.put_nowait((i, req))
            done = 0

            async def worker() -> None:
                nonlocal done
                while not queue.empty():
                    i, req = queue.get_nowait()
                    try:
                        await _run_one(client, req, tally)
                    except Exception as exc:  # noqa: BLE001 - collected and reported below
                        failures.append(f"request {i} {req['action']} {req['path']}: "
                                        f"{type(exc).__name__}: {exc}"[:400])
                    done += 1
                    if done % 50 == 0:
                        rss_samples.append((done, _rss(pids)))

            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))

    start = time.monotonic()
    asyncio.run(main())
    elapsed = time.monotonic() - start
    assert not failures, "\n".join(failures[:10])

    # Idle: aborts and disconnects reach the engine within the front end's poll interval.
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(server.url + "/metrics").text
        idle = (_metric(text, "folio:kv_cache_usage_perc") == 0
                and _metric(text, "folio:num_requests_running") == 0
                and _metric(text, "folio:num_requests_waiting") == 0
                and _metric(text, "folio:tracked_requests", 'process="engine"') == 0
                and _metric(text, "folio:tracked_requests", 'process="api"') == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert idle, [line for line in text.splitlines()
                  if "kv_cache_usage" in line or "tracked" in line or "num_requests" in line]
    assert httpx.get(server.url + "/health").status_code == 200

    half = rss_samples[len(rss_samples) // 2][1]
    end = _rss(pids)
    growth = [e / h - 1 for h, e in zip(half, end)]
    figures = {
        "requests": NUM_REQUESTS, "seconds": round(elapsed, 1), "tally": dict(tally),
        "rss_mib_start_half_end": [[round(rss_samples[0][1][k] / 2**20),
                                    round(half[k] / 2**20), round(end[k] / 2**20)]
                                   for k in range(2)],
        "rss_growth_second_half": [round(g, 4) for g in growth],
        "aborted_in_metrics": _metric(text, "folio:request_success_total", 'finished_reason="abort"'),
    }
    print("\nsoak:", json.dumps(figures))
    assert tally["completed"] + tally["disconnected"] + tally["aborted"] + \
        tally["abort_too_late"] == NUM_REQUESTS
    assert tally["disconnected"] > 0 and tally["aborted"] > 0
    assert all(abs(g) <= 0.10 for g in growth), figures
    if elapsed > 10:
        # Busy for more than one interval: the stats line was logged (vLLM's format).
        assert re.search(r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: "
                         r"[\d.]+ tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache "
                         r"usage: [\d.]+%, Prefix cache hit rate: [\d.]+%", _full_log(server))
