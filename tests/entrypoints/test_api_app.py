"""The FastAPI app's own behaviour (CORS, auth middleware, size limit), without a model: the
app is built around a stand-in engine and driven in-process."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from folio.entrypoints.openai.api_server import ServerSettings, build_app


class _StandInEngine:
    is_healthy = True
    errored = None
    max_model_len = 128
    tokenizer = None
    num_open_requests = 0
    model_info = SimpleNamespace(source=SimpleNamespace(path="/models/x"), vocab_size=100,
                                 pooling=None)

    def default_sampling_params(self):
        from folio import SamplingParams
        return SamplingParams()

    def shutdown(self):
        pass


def _get(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)
    return asyncio.run(run())


PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}


def test_cors_off_by_default():
    app = build_app(_StandInEngine(), ServerSettings(served_model_names=["m"]))
    r = _get(app, "OPTIONS", "/v1/models", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in r.headers
    r = _get(app, "GET", "/v1/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_on_for_allowed_origins_only():
    app = build_app(_StandInEngine(), ServerSettings(served_model_names=["m"], api_key="k",
                                                     allowed_origins=["https://app.example"]))
    r = _get(app, "OPTIONS", "/v1/models", headers=PREFLIGHT)
    assert r.headers.get("access-control-allow-origin") == "https://app.example"
    r = _get(app, "OPTIONS", "/v1/models", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert r.headers.get("access-control-allow-origin") != "https://evil.example"
    # CORS never opens the API: a real request still needs the key.
    assert _get(app, "GET", "/v1/models", headers={"Origin": "https://app.example"}).status_code == 401


@pytest.mark.parametrize("length, status", [(10, 400), (2000, 413)])
def test_declared_body_size_limit(length, status):
    app = build_app(_StandInEngine(), ServerSettings(served_model_names=["m"], max_request_body_bytes=1000))
    r = _get(app, "POST", "/v1/completions", content=b"x" * length,
             headers={"Content-Type": "application/json"})
    assert r.status_code == status and r.json()["error"]["message"]


def test_unhealthy_engine():
    engine = _StandInEngine()
    engine.is_healthy = False
    engine.errored = "the engine core exited (code -9)"
    app = build_app(engine, ServerSettings(served_model_names=["m"]))
    assert _get(app, "GET", "/health").status_code == 503
    r = _get(app, "POST", "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 503 and "exited" in r.json()["error"]["message"]
