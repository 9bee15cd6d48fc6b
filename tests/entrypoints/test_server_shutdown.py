"""Shutdown and a dead engine, on a real `folio serve`: SIGTERM with 32 streams open ends the
whole process tree within 10 s (streams end with a clean error event, the port is freed); an
engine process that dies makes /health 503 and fails open and new requests at once."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import psutil
import pytest

from server_utils import RemoteServer

QUESTION = [{"role": "user", "content": "Tell me a long story about a dragon."}]
ARGS = ["--max-model-len", "512", "--num-gpu-blocks-override", "512", "--dtype", "float32",
        "--max-num-seqs", "32"]


def _stream(url: str, out: list, started: threading.Event) -> None:
    """One long stream; records how it ended: 'done' ([DONE] seen), the error event, or
    the transport error."""
    body = {"messages": QUESTION, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    ending = None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
                    if line == "data: [DONE]":
                        ending = ending or "done"
                    else:
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            ending = chunk["error"]
    except httpx.HTTPError as exc:
        ending = f"transport: {type(exc).__name__}"
    out.append(ending)


def _engine_process(server: RemoteServer) -> psutil.Process:
    """The engine-core child (multiprocessing also starts a resource tracker)."""
    [engine] = [c for c in psutil.Process(server.proc.pid).children()
                if "spawn_main" in " ".join(c.cmdline())]
    return engine


def _port_free(port: int) -> bool:
    """True when a new server could listen on `port`. SO_REUSEADDR as every server sets it:
    the connections the server closed first linger in TIME_WAIT for a minute and would
    refuse a plain bind, yet a socket still listening refuses this one too (Linux)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_sigterm_with_32_streams_ends_the_process_tree_within_10s():
    server = RemoteServer(ARGS)
    try:
        tree = [server.proc.pid] + [c.pid for c in psutil.Process(server.proc.pid).children(
            recursive=True)]
        assert len(tree) >= 2  # the API process and the engine core
        endings: list = []
        events = [threading.Event() for _ in range(32)]
        threads = [threading.Thread(target=_stream, args=(server.url, endings, e))
                   for e in events]
        for t in threads:
            t.start()
        for e in events:
            assert e.wait(120), "a stream never started"
        start = time.monotonic()
        os.kill(server.proc.pid, signal.SIGTERM)
        server.proc.wait(10)
        for pid in tree:
            while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() - start < 10.0, f"process {pid} still alive"
                time.sleep(0.05)
        elapsed = time.monotonic() - start
        for t in threads:
            t.join(10)
        assert elapsed < 10.0
        assert server.proc.returncode == 0, server.log()
        assert _port_free(server.port)
        assert len(endings) == 32
        # Every stream ended cleanly: an error event naming the shutdown, then [DONE].
        for ending in endings:
            assert isinstance(ending, dict), (ending, server.log())
            assert ending["type"] == "ServiceUnavailableError" and "shutting down" in ending["message"]
    finally:
        server.stop()


def test_dead_engine_is_503_and_fails_requests_fast():
    with RemoteServer(ARGS) as server:
        engine = _engine_process(server)
        endings: list = []
        started = threading.Event()
        stream = threading.Thread(target=_stream, args=(server.url, endings, started))
        stream.start()
        assert started.wait(120)
        engine.kill()
        start = time.monotonic()
        stream.join(10)
        assert not stream.is_alive() and time.monotonic() - start < 5.0
        [ending] = endings
        assert isinstance(ending, dict) and ending["type"] == "ServiceUnavailableError", ending
        r = httpx.get(server.url + "/health", timeout=5)
        assert r.status_code == 503 and "exited" in r.json()["error"]["message"]
        start = time.monotonic()
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"messages": QUESTION, "max_tokens": 4}, timeout=10)
        assert r.status_code == 503 and time.monotonic() - start < 2.0
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
        # The API process itself still answers, and stops cleanly.
        assert httpx.get(server.url + "/version", timeout=5).status_code == 200
        assert server.stop() == 0


@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_sigint_when_idle_stops_cleanly(sig):
    server = RemoteServer(ARGS)
    engine = _engine_process(server)
    start = time.monotonic()
    os.kill(server.proc.pid, sig)
    assert server.proc.wait(10) == 0
    engine_gone = not psutil.pid_exists(engine.pid) or engine.status() == psutil.STATUS_ZOMBIE
    assert engine_gone and time.monotonic() - start < 10.0
    assert _port_free(server.port)
    server.stop()
