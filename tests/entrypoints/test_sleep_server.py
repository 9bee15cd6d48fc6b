"""Sleep mode on a real server (the default model, CPU): /sleep, /wake_up and /is_sleeping
behind the API key and only with --enable-sleep-mode; a request sent while asleep waits and
is answered after /wake_up, the same as before the sleep; a bad level is a 400. With
--sleep-mode-requests reject a request sent while asleep gets a 503 with a Retry-After at
once (Anthropic's 529 on /v1/messages) while /health stays 200, until the wake-up is whole."""
from __future__ import annotations

import threading

import httpx
import pytest

from server_utils import RemoteServer

KEY = "sleepy-key"
BODY = {"model": "m", "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with RemoteServer(["--served-model-name", "m", "--enable-sleep-mode",
                       "--max-model-len", "512"], api_key=KEY) as srv:
        yield srv


def _post(server, path, **kwargs):
    return httpx.post(server.url + path, headers=server.headers, timeout=120, **kwargs)


def test_sleep_wake_cycle_keeps_answers(server):
    before = _post(server, "/v1/completions", json=BODY).json()["choices"][0]["text"]
    assert httpx.post(server.url + "/sleep").status_code == 401      # the key guards it
    reply = _post(server, "/sleep", params={"level": 1})
    assert reply.status_code == 200, reply.text
    assert reply.json()["is_sleeping"] and reply.json()["freed_bytes"]["kv_cache"] > 0
    assert httpx.get(server.url + "/is_sleeping", headers=server.headers).json() == {
        "is_sleeping": True}
    assert _post(server, "/sleep", params={"level": 1}).status_code == 400   # already
    waiting = {}
    thread = threading.Thread(target=lambda: waiting.update(
        reply=_post(server, "/v1/completions", json=BODY)))
    thread.start()
    thread.join(timeout=2)
    assert thread.is_alive()            # it waits while the engine sleeps
    assert _post(server, "/wake_up").json() == {"is_sleeping": False}
    thread.join(timeout=60)
    assert waiting["reply"].status_code == 200
    assert waiting["reply"].json()["choices"][0]["text"] == before
    # level 2 frees the weights too; waking reads them again
    assert _post(server, "/sleep", params={"level": 2}).status_code == 200
    assert _post(server, "/wake_up").status_code == 200
    after = _post(server, "/v1/completions", json=BODY).json()["choices"][0]["text"]
    assert after == before
    assert _post(server, "/sleep", params={"level": 3}).status_code == 400


def test_routes_absent_without_the_flag():
    with RemoteServer(["--served-model-name", "m", "--max-model-len", "256"]) as srv:
        assert httpx.post(srv.url + "/sleep").status_code == 404
        assert httpx.get(srv.url + "/is_sleeping").status_code == 404


CHAT = {"model": "m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6,
        "temperature": 0, "ignore_eos": True}


def _refused_while_asleep(reply: httpx.Response, status: int = 503) -> dict:
    assert reply.status_code == status, reply.text
    assert 1 <= int(reply.headers["Retry-After"]) <= 600
    return reply.json()["error"]


def test_reject_mode_answers_503_while_asleep():
    with RemoteServer(["--served-model-name", "m", "--enable-sleep-mode",
                       "--sleep-mode-requests", "reject", "--max-model-len", "512"]) as srv:
        def post(path: str, **kwargs) -> httpx.Response:
            return httpx.post(srv.url + path, timeout=120, **kwargs)

        before = post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
        assert post("/sleep", params={"level": 1}).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200     # the process is fine
        for body in (CHAT, CHAT | {"stream": True}):
            error = _refused_while_asleep(post("/v1/chat/completions", json=body))
            assert error["type"] == "ServiceUnavailableError" and "asleep" in error["message"]
        _refused_while_asleep(post("/v1/completions", json=BODY))
        _refused_while_asleep(post("/v1/responses", json={"model": "m", "input": "Say hi",
                                                          "max_output_tokens": 6}))
        error = _refused_while_asleep(post("/v1/messages", json={
            "model": "m", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}),
            status=529)
        assert error["type"] == "overloaded_error"
        # woken in part: still asleep, still refused
        assert post("/wake_up", params={"tags": "weights"}).json() == {"is_sleeping": True}
        _refused_while_asleep(post("/v1/chat/completions", json=CHAT))
        assert post("/wake_up", params={"tags": "kv_cache"}).json() == {"is_sleeping": False}
        reply = post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"] == before


def test_sleep_mode_requests_flag():
    from folio.config import AdmissionConfig
    from folio.entrypoints.cli import build_parser
    from folio.entrypoints.openai.api_server import serve
    from folio.entrypoints.openai.cli_args import build_engine_config

    def parse(*flags: str):
        return build_parser().parse_args(["serve", *flags])

    assert build_engine_config(parse()).admission.sleep_mode_requests == "wait"
    args = parse("--enable-sleep-mode", "--sleep-mode-requests", "reject")
    assert build_engine_config(args).admission.sleep_mode_requests == "reject"
    with pytest.raises(SystemExit):
        parse("--sleep-mode-requests", "drop")
    with pytest.raises(ValueError, match="sleep_mode_requests"):
        AdmissionConfig(sleep_mode_requests="drop")
    with pytest.raises(ValueError, match="without --enable-sleep-mode"):
        serve(parse("--sleep-mode-requests", "reject"))   # refused before the engine starts


def test_asleep_refusal_is_a_503_with_retry_after():
    import json

    from folio.engine.async_llm import EngineAsleep
    from folio.entrypoints.openai.api_server import route_error_response
    from folio.entrypoints.openai.errors import to_openai_error

    error = to_openai_error(EngineAsleep("the engine is asleep", 5))
    reply = route_error_response("/v1/chat/completions", error)
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "5"
    assert json.loads(reply.body) == {"error": {
        "message": "the engine is asleep", "type": "ServiceUnavailableError", "param": None,
        "code": None}}
    reply = route_error_response("/v1/messages", error)     # Anthropic's retryable shape
    assert reply.status_code == 529 and reply.headers["Retry-After"] == "5"
    assert json.loads(reply.body)["error"]["type"] == "overloaded_error"
