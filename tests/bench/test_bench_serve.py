"""Tests of `folio bench serve` against a fake OpenAI-compatible streaming server.

No model: the fake server (aiohttp, in its own thread and event loop) streams `max_tokens`
content chunks with known delays, a usage chunk and [DONE], and records what it received and
the peak number of requests in flight. Prompts containing FAIL get HTTP 500, BREAK a stream cut
mid-way, NOUSAGE no usage chunk. Timing bounds are loose: the CI machine is shared.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from folio.bench import serve  # noqa: E402

FIRST_DELAY = 0.06   # s before the first content chunk
GAP = 0.03           # s between content chunks


class FakeServer:
    """An OpenAI-compatible streaming server with scripted timing."""

    def __init__(self) -> None:
        self.payloads: list[dict[str, Any]] = []
        self.arrivals: list[float] = []
        self.auth: list[str | None] = []
        self.current = 0
        self.peak = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def reset(self) -> None:
        self.payloads.clear()
        self.arrivals.clear()
        self.auth.clear()
        self.peak = 0

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"},
                                                              {"id": "other"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.payloads.append(payload)
        self.arrivals.append(time.perf_counter())
        self.auth.append(request.headers.get("Authorization"))
        chat = "messages" in payload
        prompt = payload["messages"][-1]["content"] if chat else payload["prompt"]
        text = prompt if isinstance(prompt, str) else ""
        self.current += 1
        self.peak = max(self.peak, self.current)
        try:
            if "FAIL" in text:
                return web.json_response({"error": {"message": "scripted failure"}}, status=500)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def send(obj: Any) -> None:
                data = obj if isinstance(obj, str) else json.dumps(obj)
                await resp.write(f"data: {data}\n\n".encode())

            if chat:  # a role-only chunk right away: it must not count as the first token
                await send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            n = int(payload["max_tokens"])
            for i in range(n):
                await asyncio.sleep(FIRST_DELAY if i == 0 else GAP)
                piece = f"w{i} "
                choice = ({"index": 0, "delta": {"content": piece}} if chat
                          else {"index": 0, "text": piece})
                await send({"choices": [choice]})
                if "BREAK" in text and i == 1:
                    request.transport.close()   # cut the stream mid-way
                    return resp
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(text.split())
            if "NOUSAGE" not in text:
                await send({"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                     "completion_tokens": n,
                                                     "total_tokens": prompt_tokens + n}})
            await send("[DONE]")
            await resp.write_eof()
            return resp
        finally:
            self.current -= 1


@pytest.fixture(scope="module")
def fake_server() -> Any:
    server = FakeServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def server(fake_server: FakeServer) -> FakeServer:
    fake_server.reset()
    return fake_server


class StubTokenizer:
    """Just what the random dataset needs: a vocabulary size, special ids and decode."""

    all_special_ids = [0, 1, 2]
    added_tokens_decoder: dict[int, Any] = {}

    def __len__(self) -> int:
        return 500

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"t{i}" for i in ids)

    def encode(self, text: str) -> list[int]:
        return list(range(len(text.split())))


def _args(server: FakeServer, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    return parser.parse_args(["--base-url", f"http://127.0.0.1:{server.port}", "--disable-tqdm",
                              "--quiet", "--timeout", "20", *extra])


def _prompt_file(tmp_path: Any, lines: list[str], name: str = "prompts.txt") -> str:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_file_dataset_metrics_failures_and_json(server: FakeServer, tmp_path: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FOLIO_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    path = _prompt_file(tmp_path, ["hello there", "FAIL me", "a b c", "BREAK it", "one"])
    out = tmp_path / "result.json"
    report = serve.run(_args(server, "--dataset", "file", "--dataset-path", path,
                             "--num-prompts", "5", "--random-output-len", "4",
                             "--output-json", str(out)))

    assert report["model_id"] == "fake-model"           # first of GET /v1/models
    assert report["completed"] == 3 and report["failed"] == 2
    assert report["completed"] + report["failed"] == report["num_prompts"] == 5
    assert report["errors"][0] == "" and report["errors"][2] == "" and report["errors"][4] == ""
    assert "HTTP 500" in report["errors"][1] and "scripted failure" in report["errors"][1]
    assert report["errors"][3]                           # the cut stream, with some message
    assert report["total_output_tokens"] == 3 * 4
    assert report["total_input_tokens"] == 2 + 3 + 1     # from the server's usage
    assert report["max_concurrency_seen"] == 5

    # Timing roughly matches the script: TTFT ~ FIRST_DELAY, ITL ~ GAP, E2EL ~ both.
    assert FIRST_DELAY * 0.9 <= report["mean_ttft_ms"] / 1000 < FIRST_DELAY + 0.5
    assert GAP * 0.5 <= report["mean_itl_ms"] / 1000 < GAP + 0.3
    assert GAP * 0.5 <= report["mean_tpot_ms"] / 1000 < GAP + 0.3
    e2el = FIRST_DELAY + 3 * GAP
    assert e2el * 0.9 <= report["mean_e2el_ms"] / 1000 < e2el + 0.8
    assert report["median_ttft_ms"] <= report["p99_ttft_ms"]
    assert report["duration"] >= e2el * 0.9
    assert report["request_throughput"] == pytest.approx(3 / report["duration"])
    assert report["total_token_throughput"] == pytest.approx(18 / report["duration"])

    payload = server.payloads[0]
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}
    assert payload["max_tokens"] == 4 and "ignore_eos" not in payload  # off for file data: not sent
    assert payload["model"] == "fake-model" and payload["temperature"] == 0.0
    assert isinstance(payload["prompt"], str)
    assert set(server.auth) == {"Bearer sk-test"}

    saved = json.loads(out.read_text())
    assert saved["completed"] == 3 and saved["errors"] == report["errors"]


def test_random_dataset_sends_exact_token_ids(server: FakeServer,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FOLIO_API_KEY", "folio-key")
    args = _args(server, "--num-prompts", "6", "--random-input-len", "10",
                 "--random-output-len", "3", "--random-range-ratio", "0.5", "--model", "mine",
                 "--percentiles", "50,90,99.9", "--api-key", "explicit")
    report = serve.run(args, tokenizer=StubTokenizer())

    assert report["completed"] == 6 and report["failed"] == 0
    prompts = [p["prompt"] for p in server.payloads]
    assert all(isinstance(p, list) and 5 <= len(p) <= 15 for p in prompts)
    assert all(t not in (0, 1, 2) for p in prompts for t in p)       # no special ids
    assert sorted(report["input_lens"]) == sorted(len(p) for p in prompts)
    assert report["total_input_tokens"] == sum(len(p) for p in prompts)
    assert all(p["ignore_eos"] is True and p["model"] == "mine" for p in server.payloads)
    assert set(server.auth) == {"Bearer explicit"}                    # flag beats env
    for key in ("p50_itl_ms", "p90_ttft_ms", "p99.9_e2el_ms", "std_tpot_ms"):
        assert key in report

    # Same seed, same requests.
    server.reset()
    serve.run(args, tokenizer=StubTokenizer())
    assert sorted(map(tuple, prompts)) == sorted(tuple(p["prompt"]) for p in server.payloads)


def test_max_concurrency_is_respected(server: FakeServer, tmp_path: Any) -> None:
    path = _prompt_file(tmp_path, ["x y"])
    report = serve.run(_args(server, "--dataset", "file", "--dataset-path", path,
                             "--num-prompts", "8", "--random-output-len", "2",
                             "--max-concurrency", "2"))
    assert report["completed"] == 8
    assert server.peak == 2 and report["max_concurrency_seen"] == 2
    # Four waves of two requests, each at least FIRST_DELAY + GAP long.
    assert report["duration"] >= 4 * (FIRST_DELAY + GAP) * 0.9


def test_poisson_arrivals_are_deterministic() -> None:
    a = serve.arrival_offsets(200, 10.0, 1.0, seed=3)
    assert a == serve.arrival_offsets(200, 10.0, 1.0, seed=3)
    assert a != serve.arrival_offsets(200, 10.0, 1.0, seed=4)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert 0.07 < sum(gaps) / len(gaps) < 0.13                        # mean 1/rate
    regular = serve.arrival_offsets(200, 10.0, 50.0, seed=3)          # burstiness > 1
    regular_gaps = [y - x for x, y in zip(regular, regular[1:])]
    assert max(regular_gaps) - min(regular_gaps) < max(gaps) - min(gaps)
    assert serve.arrival_offsets(4, float("inf")) == [0.0] * 4
    with pytest.raises(ValueError):
        serve.arrival_offsets(3, 1.0, 0.0)


def test_requests_follow_the_arrival_schedule(server: FakeServer, tmp_path: Any) -> None:
    path = _prompt_file(tmp_path, ["p"])
    report = serve.run(_args(server, "--dataset", "file", "--dataset-path", path,
                             "--num-prompts", "5", "--random-output-len", "1",
                             "--request-rate", "20", "--seed", "5"))
    expected = serve.arrival_offsets(5, 20.0, 1.0, seed=5)
    for sent, planned in zip(report["send_times"], expected):
        assert planned - 0.005 <= sent < planned + 0.25
    # One-token outputs have no TPOT: reported as 0 rather than failing.
    assert report["completed"] == 5 and report["mean_tpot_ms"] == 0.0


def test_chat_endpoint(server: FakeServer, tmp_path: Any) -> None:
    path = _prompt_file(tmp_path, [json.dumps({"prompt": "hi you", "output_len": 3}),
                                   json.dumps({"prompt": "NOUSAGE please"})], "p.jsonl")
    report = serve.run(_args(server, "--endpoint", "/v1/chat/completions", "--dataset", "file",
                             "--dataset-path", path, "--num-prompts", "2",
                             "--random-output-len", "5"))
    assert report["backend"] == "openai-chat"
    assert report["completed"] == 2, report["errors"]
    assert [p["messages"] for p in server.payloads] == [
        [{"role": "user", "content": "hi you"}], [{"role": "user", "content": "NOUSAGE please"}]]
    assert [p["max_tokens"] for p in server.payloads] == [3, 5]
    # Usage for the first; the second falls back to counting content chunks.
    assert report["output_lens"] == [3, 5]
    # The role-only chunk sent at once is not the first token.
    assert min(report["ttfts"]) >= FIRST_DELAY * 0.9

    # Random prompts for chat go as decoded text.
    server.reset()
    serve.run(_args(server, "--endpoint", "/v1/chat/completions", "--num-prompts", "2",
                    "--random-input-len", "4", "--random-output-len", "2"),
              tokenizer=StubTokenizer())
    contents = [p["messages"][0]["content"] for p in server.payloads]
    assert all(isinstance(c, str) and len(c.split()) == 4 for c in contents)


def test_unreachable_server_fails_requests_not_the_run(tmp_path: Any, capsys: Any) -> None:
    path = _prompt_file(tmp_path, ["x"])
    # A port nobody listens on (bound then closed).
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = serve.main(["--port", str(port), "--dataset", "file", "--dataset-path", path,
                       "--num-prompts", "2", "--model", "m", "--disable-tqdm"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Failed requests:" in printed
    assert "2 x " in printed                                          # the error, counted
    # Without --model the server must list models: a clear error, exit code 2.
    assert serve.main(["--port", str(port), "--dataset", "file", "--dataset-path", path,
                       "--disable-tqdm"]) == 2
    assert "cannot list models" in capsys.readouterr().err


def test_lengths_and_cli_validation() -> None:
    assert serve.length_range(256, 0.0) == (256, 256)
    assert serve.length_range(100, 0.5) == (50, 150)
    assert serve.length_range(1, 0.9) == (1, 2)
    with pytest.raises(ValueError):
        serve.length_range(10, 1.0)
    assert serve.parse_percentiles("50, 99.9") == [50.0, 99.9]
    with pytest.raises(ValueError):
        serve.parse_percentiles("101")
    assert serve.main(["--num-prompts", "0"]) == 2
