"""The web console: static pages at `/` and `/console/*`, and its stats at /v1/console/stats.

The pages are plain HTML, CSS and JavaScript shipped inside the package (`console/`), with no
build step and nothing loaded from elsewhere (the Content-Security-Policy says so). The chat
playground talks to the public API (/v1/models, /v1/chat/completions) like any client; the
dashboard polls the stats endpoint. Every route is behind the API key (the guard in
api_server.py; browsers log in with HTTP Basic, console_auth.py).
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from folio.entrypoints.openai.console_stats import ConsoleStats
from folio.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger("folio.server")

STATS_PATH = "/v1/console/stats"
STATIC_PREFIX = "/console/"

# The files served, with their types: a fixed list, so no path from a request reaches the
# file system.
STATIC_FILES: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "api.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "chart.js": "text/javascript; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}

# Same-origin everything: no inline script or style, no third-party resource, no framing.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self'; connect-src 'self'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
_COMMON_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


def load_static_files() -> dict[str, bytes]:
    """The console's files from the package (read once; they are a few tens of KB)."""
    folder = resources.files("folio.entrypoints.openai") / "console"
    return {name: (folder / name).read_bytes() for name in STATIC_FILES}


def add_console_routes(app: FastAPI, engine: Any, metrics: Any | None) -> ConsoleStats:
    """Register the console's routes and start its stats sampler with the app's lifespan."""
    stats = ConsoleStats(engine, metrics)
    app.state.console_stats = stats
    _sample_during_lifespan(app, stats)

    @app.get(STATS_PATH, include_in_schema=False)
    async def console_stats():
        return JSONResponse(stats.snapshot(), headers=_COMMON_HEADERS)

    try:
        files = load_static_files()
    except OSError as exc:  # an install without the package data: the API still serves
        logger.error("web console disabled: its files are missing (%s)", exc)
        return stats

    def static(name: str) -> Response:
        headers = dict(_COMMON_HEADERS)
        if name.endswith(".html"):
            headers.update(_PAGE_HEADERS)
        return Response(files[name], media_type=STATIC_FILES[name], headers=headers)

    @app.get("/", include_in_schema=False)
    async def console_index():
        return static("index.html")

    @app.get(STATIC_PREFIX + "{name}", include_in_schema=False)
    async def console_file(name: str):
        if name not in files:
            raise OpenAIError(f"no console file {name!r}", status_code=404, type="NotFoundError")
        return static(name)

    return stats


def _sample_during_lifespan(app: FastAPI, stats: ConsoleStats) -> None:
    """Run the sampler while the server runs: the app's lifespan is wrapped (build_app owns
    it), so the history fills from start-up, whether or not a dashboard is open."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: Any):
        task = asyncio.get_running_loop().create_task(stats.run())
        try:
            async with inner(app_) as state:
                yield state
        finally:
            task.cancel()

    app.router.lifespan_context = lifespan
