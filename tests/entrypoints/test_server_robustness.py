"""Hostile and oversized requests against a real `folio serve`: every field that sizes work has
a limit (a 4xx naming the field, answered at once), the event loop stays free (/health answers
while a DoS request is refused), and another client's stream goes on undisturbed."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from server_utils import RemoteServer

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
NUM_BLOCKS = 256  # x 16 = 4,096 tokens of KV cache
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    with RemoteServer(["--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override",
                       str(NUM_BLOCKS), "--dtype", "float32", "--max-num-seqs", "32"]) as srv:
        yield srv


def _post(server, path: str, body, timeout: float = 30.0, **kwargs) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, timeout=timeout,
                          headers={"Content-Type": "application/json"}, **kwargs)
    return httpx.post(server.url + path, json=body, timeout=timeout, **kwargs)


def _deep_array(depth: int) -> str:
    return "[" * depth + "]" * depth


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


C = "/v1/completions"
CHAT = "/v1/chat/completions"
P = {"prompt": "Hello", "max_tokens": 4}
M = {"messages": QUESTION, "max_tokens": 4}

# (route, body, expected param) — each must be a 400 whose error names the field.
LIMIT_CASES = [
    (C, {**P, "n": 100_000_000, "temperature": 1.0}, "n"),
    (C, {**P, "n": 129, "temperature": 1.0}, "n"),
    (C, {**P, "best_of": 1000, "n": 1000, "temperature": 1.0}, "n"),
    (C, {**P, "max_tokens": 10**12}, "max_tokens"),
    (CHAT, {**M, "max_tokens": 10**12}, "max_tokens"),
    (CHAT, {**M, "max_completion_tokens": MAX_MODEL_LEN + 1}, "max_completion_tokens"),
    (C, {**P, "logprobs": 21}, "logprobs"),
    (CHAT, {**M, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (C, {**P, "prompt_logprobs": 21}, "prompt_logprobs"),
    (C, {**P, "prompt_logprobs": -1}, "prompt_logprobs"),
    (C, {**P, "prompt": ["hi"] * 257}, "prompt"),
    (C, {**P, "stop": ["x"] * 100_000}, "stop"),
    (C, {**P, "stop": ["x" * 513]}, "stop"),
    (C, {**P, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    (C, {**P, "logit_bias": {"5": 101}}, "logit_bias"),
    (C, {**P, "logit_bias": {"5": -1000}}, "logit_bias"),
    (C, {**P, "logit_bias": {"49152": 1}}, "logit_bias"),
    (C, {**P, "allowed_token_ids": list(range(4097))}, "allowed_token_ids"),
    (C, {**P, "allowed_token_ids": [10**9]}, "allowed_token_ids"),
    (C, {**P, "stop_token_ids": [49152]}, "stop_token_ids"),
    (C, {**P, "bad_words": ["w"] * 257}, "bad_words"),
    (C, {**P, "bad_words": ["w" * 513]}, "bad_words"),
    (C, {**P, "prompt": [1, 2, 10**9]}, "prompt"),
    (C, {**P, "seed": 2**63}, "seed"),
    (C, {**P, "seed": -(2**63) - 1}, "seed"),
    (CHAT, {**M, "seed": 2**64}, "seed"),
    (CHAT, {**M, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": _nested_schema(40)}}}, "response_format.json_schema.schema"),
    (CHAT, {**M, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "enum": ["v" * 1000] * 1100}}}},
     "response_format.json_schema.schema"),
    (CHAT, {**M, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": _nested_schema(40)}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    (CHAT, {**M, "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                           for i in range(129)], "tool_choice": "required"}, "tools"),
    (C, {**P, "structured_outputs": {"regex": "a" * (1 << 20 + 1)}}, "structured_outputs"),
    # n sequences of prompt + max_tokens that cannot all be held by the 4,096-token cache.
    (C, {**P, "n": 16, "max_tokens": 400, "temperature": 1.0}, "n"),
    (CHAT, {"messages": QUESTION, "chat_template": "{{ messages }}"}, "chat_template"),
]


@pytest.mark.parametrize("path,body,param", LIMIT_CASES,
                         ids=[f"{i}-{c[2]}" for i, c in enumerate(LIMIT_CASES)])
def test_limit_is_a_400_naming_the_field(server, path, body, param):
    start = time.monotonic()
    r = _post(server, path, body)
    # refused before any work: doing the work (16 x 400 tokens and the like) takes minutes
    # here, so a bound this loose still tells them apart on a loaded machine
    assert time.monotonic() - start < 15.0
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_logprobs_at_the_limit_are_served(server):
    r = _post(server, C, {**P, "logprobs": 20, "prompt_logprobs": 20, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 20


def test_max_tokens_past_the_room_is_clamped(server):
    # A prompt that leaves ~20 tokens of room, so the clamped request finishes quickly.
    r = _post(server, C, {"prompt": "word " * 490, "max_tokens": MAX_MODEL_LEN,
                          "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["prompt_token_ids"]) + len(choice["token_ids"]) == MAX_MODEL_LEN


def test_body_too_large_is_413(server):
    body = b'{"prompt": "' + b"a" * (50 << 20) + b'"}'
    start = time.monotonic()
    r = _post(server, C, body)
    assert r.status_code == 413 and r.json()["error"]["message"]
    assert time.monotonic() - start < 2.0 + 2.0  # sending 50 MB over loopback takes a moment


def test_deep_json_is_400(server):
    for depth in (10_000, 200):
        r = _post(server, C, '{"prompt": "hi", "x": ' + _deep_array(depth) + "}")
        assert r.status_code == 400 and "nests deeper" in r.json()["error"]["message"]
    # Within the limit, an unknown field is ignored, as OpenAI-compatible servers do.
    r = _post(server, C, '{"prompt": "hi", "max_tokens": 1, "x": ' + _deep_array(100) + "}")
    assert r.status_code == 200, r.text


def test_start_up_progress_is_logged(server):
    server.log()  # flushes
    with open(server.log_path) as f:
        log = f.read()
    for step in ("starting the engine", "loading weights", "model loaded",
                 f"KV cache: {NUM_BLOCKS} blocks", "serving " + MODEL, "http://127.0.0.1:"):
        assert step in log, (step, log)


def test_cors_is_off_by_default(server):
    r = httpx.options(server.url + CHAT, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in {k.lower() for k in r.headers}


def _stream_text(server, out: dict) -> None:
    """A long greedy stream; records its text, the largest gap between chunks, its end."""
    body = {"messages": QUESTION, "max_tokens": 120, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, last, worst = [], time.monotonic(), 0.0
    with httpx.stream("POST", server.url + CHAT, json=body, timeout=120) as r:
        for line in r.iter_lines():
            now = time.monotonic()
            worst, last = max(worst, now - last), now
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
                if choice.get("finish_reason"):
                    out["finish_reason"] = choice["finish_reason"]
    out["text"], out["worst_gap_s"] = "".join(text), worst


def test_dos_requests_leave_health_and_other_streams_alone(server):
    reference: dict = {}
    _stream_text(server, reference)
    assert reference["finish_reason"] == "length"

    watched: dict = {}
    stream = threading.Thread(target=_stream_text, args=(server, watched))
    stream.start()
    health_worst = 0.0
    stop = threading.Event()

    def poll_health() -> None:
        nonlocal health_worst
        while not stop.is_set():
            start = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            health_worst = max(health_worst, time.monotonic() - start)
            time.sleep(0.05)

    poller = threading.Thread(target=poll_health)
    poller.start()
    attacks = [
        (C, {**P, "n": 100_000_000, "temperature": 1.0}, 400),
        (C, {**P, "max_tokens": 10**12}, 400),
        (C, b'{"prompt": "' + b"a" * (50 << 20) + b'"}', 413),
        (C, '{"prompt": ' + _deep_array(10_000) + "}", 400),
        (C, {**P, "stop": ["x"] * 100_000}, 400),
        # Not a limit but a cost: a 20 MB prompt is refused without tokenizing all of it.
        (C, {"prompt": "word " * (4 << 20), "max_tokens": 1}, 400),
    ]
    try:
        for path, body, status in attacks:
            start = time.monotonic()
            r = _post(server, path, body)
            elapsed = time.monotonic() - start
            assert r.status_code == status, (path, r.status_code, r.text[:300])
            assert elapsed < 4.0 if isinstance(body, bytes) else elapsed < 2.0, elapsed
    finally:
        stop.set()
        poller.join()
        stream.join()
    assert health_worst < 1.0, health_worst
    assert watched["text"] == reference["text"] and watched["finish_reason"] == "length"
    # Its chunks kept coming (a generous bound: the two cores are shared with the attackers).
    assert watched["worst_gap_s"] < 5.0, watched
    assert httpx.get(server.url + "/v1/models", timeout=5).status_code == 200
