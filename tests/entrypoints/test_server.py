"""The OpenAI-compatible server, end to end: a real `folio serve` (engine core in its own
process) on a free loopback port, driven by the official `openai` client and raw HTTP."""
from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import psutil
import pytest

from folio import LLM, SamplingParams
from server_utils import RemoteServer

API_KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    with RemoteServer(["--max-model-len", "512", "--num-gpu-blocks-override", "256",
                       "--dtype", "float32", "--max-num-seqs", "64"], api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=server.headers).text
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not in /metrics"
    return total


# ---- the openai client ---------------------------------------------------------------

def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_matches_offline_llm(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
                                       logprobs=True).choices[0].logprobs.content)
    llm = LLM(max_model_len=512, num_gpu_blocks_override=64, dtype="float32")
    offline = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert reply.choices[0].message.content == offline.outputs[0].text
    assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_chat_streaming(client):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_completions_and_streaming(client):
    full = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                     max_tokens=8)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 8
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                         max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text


def test_n_and_batch_prompts(client):
    out = client.completions.create(model=MODEL, prompt=["One, two,", "A, B,"], n=2, temperature=1.0,
                                    max_tokens=5, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, temperature=1.0,
                                          max_tokens=5, seed=3)
    assert [c.index for c in chat.choices] == [0, 1]


def test_logprobs(client):
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    comp = client.completions.create(model=MODEL, prompt="Hello there", temperature=0, max_tokens=3,
                                     logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3


def test_echo(client):
    out = client.completions.create(model=MODEL, prompt="Echo this", temperature=0, max_tokens=2, echo=True)
    assert out.choices[0].text.startswith("Echo this")


def test_stop_strings(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
                                         stop=["France"])
    assert out.choices[0].message.content == "The capital of "
    assert out.choices[0].finish_reason == "stop"


def test_seed_reproducible(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", temperature=1.0, max_tokens=12)
    a = client.completions.create(seed=42, **kwargs).choices[0].text
    b = client.completions.create(seed=42, **kwargs).choices[0].text
    c = client.completions.create(seed=43, **kwargs).choices[0].text
    assert a == b and a != c


def test_usage_reports_cached_tokens(client):
    system = "You are a helpful assistant that answers in one short sentence. " * 4
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
    client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=2)
    again = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_x_request_id_echoed(server):
    r = httpx.post(server.url + "/v1/completions", headers={**server.headers, "X-Request-Id": "abc-123"},
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"


def test_64_concurrent_streams(server):
    async def run() -> list[tuple[str, str | None]]:
        client = server.async_client()

        async def one(i: int):
            stream = await client.completions.create(model=MODEL, prompt=f"Count from {i}:", temperature=0,
                                                     max_tokens=12, stream=True)
            text, reason = "", None
            async for chunk in stream:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            return text, reason
        return await asyncio.gather(*(one(i) for i in range(64)))
    results = asyncio.run(run())
    assert all(reason == "length" for _, reason in results)
    # Each stream equals the same request made alone (greedy, batch-independent).
    client = server.client()
    for i in (0, 31, 63):
        alone = client.completions.create(model=MODEL, prompt=f"Count from {i}:", temperature=0, max_tokens=12)
        assert results[i][0] == alone.choices[0].text


def test_disconnect_frees_blocks(server):
    before = _metric(server, "folio:request_success_total")
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers, timeout=60,
                      json={"model": MODEL, "prompt": "Write a long story:", "max_tokens": 400,
                            "ignore_eos": True, "stream": True}) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 3:
                break  # the client goes away mid-stream
    deadline = time.time() + 20
    while time.time() < deadline:
        if _metric(server, "folio:num_requests_running") == 0 and _metric(server, "folio:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.2)
    assert _metric(server, "folio:num_requests_running") == 0
    assert _metric(server, "folio:kv_cache_usage_perc") == 0
    assert re.search(r'folio:request_success_total\{[^}]*finished_reason="abort"[^}]*\} [1-9]',
                     httpx.get(server.url + "/metrics", headers=server.headers).text)
    assert _metric(server, "folio:request_success_total") > before


def test_metrics_move(server, client):
    before = _metric(server, "folio:generation_tokens_total")
    prompts_before = _metric(server, "folio:prompt_tokens_total")
    client.completions.create(model=MODEL, prompt="Metrics test", temperature=0, max_tokens=5)
    assert _metric(server, "folio:generation_tokens_total") >= before + 5
    assert _metric(server, "folio:prompt_tokens_total") > prompts_before
    text = httpx.get(server.url + "/metrics", headers=server.headers).text
    for name in ("folio:time_to_first_token_seconds_count", "folio:e2e_request_latency_seconds_count",
                 "folio:inter_token_latency_seconds_count", "folio:request_queue_time_seconds_count",
                 "folio:prefix_cache_queries_total", "folio:num_requests_waiting"):
        assert name in text


# ---- raw HTTP: errors ----------------------------------------------------------------

def _post(server, path: str, body, headers=None, raw: bytes | None = None):
    h = {**server.headers, **(headers or {})}
    if raw is not None:
        return httpx.post(server.url + path, headers={**h, "Content-Type": "application/json"}, content=raw)
    return httpx.post(server.url + path, headers=h, json=body)


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 5}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 600}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 100000}, 400, None),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, None),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION,
                              "response_format": {"type": "xml"}}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "top_logprobs": 3}, 400, None),
])
def test_errors_get_openai_bodies(server, path, body, status, param):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert param in (error["param"] or "") or param in error["message"]
    # ...and the server keeps serving.
    ok = _post(server, "/v1/completions", {"model": MODEL, "prompt": "still here", "max_tokens": 1})
    assert ok.status_code == 200


def test_malformed_json_and_oversized_body(server):
    r = _post(server, "/v1/completions", None, raw=b'{"model": "x", "prompt": ')
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", None, raw=b'{"prompt": "' + b"a" * (33 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/nothing-here", headers=server.headers)
    assert r.status_code == 404 and "error" in r.json()


# ---- auth ----------------------------------------------------------------------------

@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 1}),
    ("POST", "/invocations", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/metrics", None),
])
def test_auth_guards_every_route(server, method, path, body):
    for headers, expected in (({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                              ({"Authorization": f"Bearer {API_KEY}"}, 200)):
        r = httpx.request(method, server.url + path, headers=headers, json=body)
        assert r.status_code == expected, (path, headers, r.text)
        if expected == 401:
            assert r.json()["error"]["type"] == "AuthenticationError"


@pytest.mark.parametrize("path", ["/health", "/ping", "/version"])
def test_health_routes_open(server, path):
    assert httpx.get(server.url + path).status_code == 200


def test_tokenize_detokenize_invocations(server):
    t = _post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0
    assert _post(server, "/detokenize", {"tokens": t["tokens"]}).json()["prompt"] == "Hello world"
    chat_tokens = _post(server, "/tokenize", {"messages": QUESTION}).json()
    assert chat_tokens["count"] > t["count"]
    r = _post(server, "/invocations", {"messages": QUESTION, "max_tokens": 32, "temperature": 0})
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert httpx.get(server.url + "/version").json()["version"]


# ---- engine death and shutdown (own server each) -------------------------------------

def _engine_pid(server: RemoteServer) -> int:
    children = psutil.Process(server.proc.pid).children(recursive=True)
    # The spawned engine core (not multiprocessing's resource tracker).
    cores = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    assert cores, "engine core process not found"
    return cores[0].pid


def test_engine_death_reports_unhealthy(tiny_server_args):
    with RemoteServer(tiny_server_args) as srv:
        psutil.Process(_engine_pid(srv)).kill()
        deadline = time.time() + 20
        while time.time() < deadline and httpx.get(srv.url + "/health").status_code == 200:
            time.sleep(0.2)
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["message"]


def test_sigterm_shuts_down_cleanly(tiny_server_args):
    """SIGTERM with a stream in flight: the stream ends, the server exits by itself with 0
    (not the -SIGKILL of a forced stop), and no engine-core process is left behind."""
    import signal
    import threading
    srv = RemoteServer(tiny_server_args)
    core = psutil.Process(_engine_pid(srv))
    received: list[str] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                              json={"prompt": "go", "max_tokens": 200, "ignore_eos": True,
                                    "stream": True}) as response:
                for line in response.iter_lines():
                    received.append(line)
        except httpx.HTTPError:
            received.append("<cut>")
    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.time() + 20
    while not received and time.time() < deadline:
        time.sleep(0.05)
    assert received, "the stream never started"
    srv.proc.send_signal(signal.SIGTERM)
    code = srv.proc.wait(30)
    reader.join(30)
    assert not reader.is_alive()
    assert code == 0, srv.log()
    core.wait(15)
    assert not core.is_running()
    srv.stop()


@pytest.fixture(scope="module")
def tiny_server_args(tiny_model_dir):
    return [tiny_model_dir("llama"), "--max-model-len", "256", "--num-gpu-blocks-override", "32",
            "--dtype", "float32"]


def test_startup_timeline_is_logged(server):
    """The engine core logs where its start went and the server when it was ready (issue 21:
    a start-up timeline)."""
    log = server.log()
    timeline = re.search(r"start-up timeline: process start [\d.]+ s, imports [\d.]+ s, model "
                         r"config [\d.]+ s, engine [\d.]+ s \(.*model load [\d.]+.*\); ready "
                         r"([\d.]+) s after spawn", log)
    assert timeline, log
    ready = re.search(r"serving .* \| ready ([\d.]+) s after the command started", log)
    assert ready and float(ready.group(1)) >= float(timeline.group(1)) - 0.2, log
