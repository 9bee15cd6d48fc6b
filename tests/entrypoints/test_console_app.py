"""The web console's server side without a model: HTTP Basic auth (the API key as the
password), the 401 challenge on its pages, its static files and the stats endpoint, on an app
built around a stand-in engine. The browser tests are in test_web_console.py."""
from __future__ import annotations

import base64
import math

import pytest
from starlette.testclient import TestClient

from folio.core.engine_core_outputs import SchedulerStats
from folio.entrypoints.openai.api_server import ServerSettings, build_app
from folio.entrypoints.openai.console_auth import basic_password
from folio.entrypoints.openai.console_routes import STATIC_FILES
from folio.entrypoints.openai.console_stats import ConsoleStats, Histogram
from folio.metrics import EngineMetrics
from test_api_app import _StandInEngine, _get

KEY = "sk-console"


def basic(password: str, user: str = "anyone") -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def _app(api_key: str | None = KEY, **settings):
    engine = _StandInEngine()
    engine.stats = SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.25,
                                  prefix_cache_queries=100, prefix_cache_hits=40,
                                  num_blocks=64, num_free_blocks=48)
    metrics = EngineMetrics("m", 128)
    return build_app(engine, ServerSettings(served_model_names=["m"], api_key=api_key,
                                            **settings), metrics)


def test_basic_password_parsing():
    assert basic_password(basic("k:with:colons")["Authorization"]) == b"k:with:colons"
    assert basic_password("basic " + base64.b64encode(b"u:").decode()) == b""
    assert basic_password("Basic " + base64.b64encode(b"no-colon").decode()) is None
    assert basic_password("Basic not*base64") is None
    assert basic_password("Bearer " + KEY) is None
    assert basic_password("") is None


def test_basic_auth_opens_every_route_like_the_bearer_key():
    app = _app()
    for path in ("/", "/v1/models", "/v1/console/stats"):
        assert _get(app, "GET", path, headers=basic(KEY)).status_code == 200, path
        assert _get(app, "GET", path, headers=basic(KEY, user="")).status_code == 200, path
        assert _get(app, "GET", path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert _get(app, "GET", path, headers=basic("wrong")).status_code == 401, path
        assert _get(app, "GET", path, headers=basic(KEY + "x")).status_code == 401, path
        assert _get(app, "GET", path).status_code == 401, path


def test_pages_challenge_the_browser_and_the_api_does_not():
    app = _app()
    for path in ("/", "/console/app.js"):
        r = _get(app, "GET", path)
        assert r.status_code == 401
        assert r.headers["www-authenticate"].startswith('Basic realm="folio"')
        r = _get(app, "GET", path, headers=basic("wrong"))
        assert r.status_code == 401 and "www-authenticate" in r.headers
    for path in ("/v1/models", "/v1/console/stats", "/metrics"):
        r = _get(app, "GET", path)
        assert r.status_code == 401 and "www-authenticate" not in r.headers
        assert r.json()["error"]["type"] == "AuthenticationError"


def test_basic_credentials_from_another_site_are_refused():
    """A browser attaches cached Basic credentials to a cross-site form POST by itself;
    those requests must not pass on them."""
    app = _app()
    same = {**basic(KEY), "Sec-Fetch-Site": "same-origin", "Origin": "http://test"}
    assert _get(app, "GET", "/v1/models", headers=same).status_code == 200
    assert _get(app, "GET", "/", headers={**basic(KEY), "Sec-Fetch-Site": "none"}).status_code == 200
    for extra in ({"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
                  {"Origin": "https://evil.example"}, {"Origin": "null"}):
        r = _get(app, "POST", "/v1/chat/completions", headers={**basic(KEY), **extra},
                 json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401, extra
    # The bearer key is not something a browser sends by itself: unchanged.
    r = _get(app, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}",
                                                "Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 200


def test_without_a_key_everything_is_open():
    app = _app(api_key=None)
    assert _get(app, "GET", "/").status_code == 200
    assert _get(app, "GET", "/v1/console/stats").status_code == 200


def test_static_files_and_their_types():
    app = _app()
    r = _get(app, "GET", "/", headers=basic(KEY))
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff"
    assert '<script type="module" src="/console/app.js">' in r.text
    for name, media_type in STATIC_FILES.items():
        r = _get(app, "GET", f"/console/{name}", headers=basic(KEY))
        assert r.status_code == 200 and r.headers["content-type"] == media_type, name
        assert r.content
    for path in ("/console/missing.js", "/console/..%2Fconsole_routes.py", "/console/"):
        assert _get(app, "GET", path, headers=basic(KEY)).status_code == 404, path
    # Nothing is fetched from elsewhere.
    for name in STATIC_FILES:
        text = _get(app, "GET", f"/console/{name}", headers=basic(KEY)).text
        assert "http://" not in text.replace('"http://www.w3.org/2000/svg"', "")
        assert "https://" not in text


def test_console_can_be_disabled():
    app = _app(enable_console=False)
    r = _get(app, "GET", "/")
    assert r.status_code == 401 and "www-authenticate" not in r.headers
    assert _get(app, "GET", "/", headers=basic(KEY)).status_code == 404
    assert _get(app, "GET", "/v1/console/stats", headers=basic(KEY)).status_code == 404


def test_stats_read_the_scheduler_and_the_metrics():
    app = _app()
    body = _get(app, "GET", "/v1/console/stats", headers=basic(KEY)).json()
    assert body["requests"]["running"] == 2 and body["requests"]["waiting"] == 1
    assert body["kv_cache"] == {"usage": 0.25, "num_blocks": 64, "num_free_blocks": 48}
    assert body["prefix_cache"]["hit_rate"] == 0.4
    assert body["tokens"]["generation_total"] == 0 and body["metrics_enabled"]
    assert set(body["latency_s"]) == {"ttft", "itl"}


def test_the_sampler_runs_with_the_app():
    app = _app()
    with TestClient(app, headers=basic(KEY)) as client:  # runs the lifespan
        assert len(app.state.console_stats.samples) >= 1
        assert client.get("/v1/console/stats").status_code == 200


def test_stats_series_rates_and_recent_percentiles():
    engine = _StandInEngine()
    engine.stats = SchedulerStats()
    metrics = EngineMetrics("m", 128)
    stats = ConsoleStats(engine, metrics, interval_s=1.0, history_s=10.0, recent_s=60.0)
    stats.sample()
    metrics.request_added("r", 0.0, 5)
    metrics.tokens_generated("r", 1, 0.3, None)   # TTFT 0.3 s
    for i in range(1, 11):
        metrics.tokens_generated("r", 1, 0.3 + 0.02 * i, None)  # ITL 20 ms
    stats.sample()
    body = stats.snapshot()
    assert body["tokens"]["generation_total"] == 11
    assert len(body["series"]["time"]) == 1 and body["series"]["generation_tokens_per_s"][0] > 0
    ttft, itl = body["latency_s"]["ttft"]["recent"], body["latency_s"]["itl"]["recent"]
    assert ttft["count"] == 1 and 0.25 < ttft["p50"] <= 0.5
    assert itl["count"] == 10 and 0.01 < itl["p99"] <= 0.025


def test_histogram_quantiles():
    inf = math.inf
    h = Histogram((0.1, 0.2, 0.4, inf), (0, 10, 20, 20))
    assert h.quantile(0.5) == pytest.approx(0.2)
    assert h.quantile(0.25) == pytest.approx(0.15)
    assert h.quantile(0.99) == pytest.approx(0.2 + 0.2 * 9.8 / 10)
    assert Histogram((0.1, inf), (0, 0)).quantile(0.5) is None
    assert Histogram((0.1, inf), (0, 5)).quantile(0.5) == 0.1  # only the +Inf bucket
    older = Histogram((0.1, 0.2, 0.4, inf), (0, 10, 10, 10))
    assert h.minus(older).counts == (0, 0, 10, 10)
    assert h.minus(Histogram((0.1, 0.2, 0.4, inf), (0, 30, 30, 30))) == h  # a reset


def test_every_console_file_is_package_data():
    """`pip install .` ships the console: each served file matches pyproject's package-data
    patterns for its package (an editable install would hide a missing one)."""
    import fnmatch
    from pathlib import Path
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    data = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["folio.entrypoints.openai"]
    for name in STATIC_FILES:
        assert any(fnmatch.fnmatch(f"console/{name}", p) for p in patterns), name
