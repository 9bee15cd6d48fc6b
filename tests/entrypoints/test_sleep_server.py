"""Sleep mode on a real server (the default model, CPU): /sleep, /wake_up and /is_sleeping
behind the API key and only with --enable-sleep-mode; a request sent while asleep waits and
is answered after /wake_up, the same as before the sleep; a bad level is a 400."""
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
