"""`folio router` (or `folio serve --role router`): the front of disaggregated prefill.

It takes OpenAI completions and chat requests, has a prefill server (a folio server with a
kv_producer P2pConnector) compute the prompt with max_tokens 1, and passes the request with
the prefill answer's kv_transfer_params to a decode server (kv_consumer), which fetches the
prompt's KV instead of computing it; the decode server's answer (streamed or not) goes back to
the client as it comes. Each side is the least busy of its servers (requests in flight).

When the prefill side fails (unreachable, an error of its own, no kv_transfer_params in its
answer) the request goes to the decode server as it is, which computes the prompt: slower,
never lost. A client's own mistake (a 4xx from the prefill server) is answered as it is.
Requests that cannot be split (n > 1, prompt logprobs, or kv_transfer_params already) go
straight to a decode server.

The router holds no model: it is an aiohttp app of a few routes. It binds 127.0.0.1 unless
told; with --api-key every route but /health needs it.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

logger = logging.getLogger(__name__)

# The routes split into prefill and decode; /v1/models and the rest are not served.
_SPLIT_ROUTES = ("/v1/completions", "/v1/chat/completions")
# A request body larger than this is refused (the servers behind have their own limits).
MAX_BODY_BYTES = 32 * 2**20


@dataclass
class RouterConfig:
    prefill_urls: list[str]
    decode_urls: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    # What clients must send (Bearer); None = open. The servers behind get `upstream_api_key`
    # (default: the same key).
    api_key: str | None = None
    upstream_api_key: str | None = None
    # Seconds to wait for a server's answer to start (prefill) or for its next bytes.
    timeout: float = 600.0

    def __post_init__(self) -> None:
        for name in ("prefill_urls", "decode_urls"):
            urls = getattr(self, name)
            if not urls or not all(isinstance(u, str) and u.startswith(("http://", "https://"))
                                   for u in urls):
                raise ValueError(f"{name} must be one or more http(s) URLs, got {urls!r}")
            setattr(self, name, [u.rstrip("/") for u in urls])
        if not 0 < self.timeout <= 86400:
            raise ValueError(f"timeout must be seconds in (0, 86400], got {self.timeout!r}")
        if self.upstream_api_key is None:
            self.upstream_api_key = self.api_key


@dataclass
class _Pool:
    """Servers of one side and their requests in flight; the least busy is picked, ties in
    turn."""
    urls: list[str]
    busy: dict[str, int] = field(default_factory=dict)
    _turn: itertools.count = field(default_factory=itertools.count)

    def pick(self) -> str:
        start = next(self._turn)
        order = self.urls[start % len(self.urls):] + self.urls[:start % len(self.urls)]
        return min(order, key=lambda u: self.busy.get(u, 0))


def _error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


def _splittable(body: dict) -> bool:
    n = body.get("n")
    return ((n is None or n == 1) and body.get("kv_transfer_params") is None
            and body.get("prompt_logprobs") is None and not body.get("use_beam_search")
            and body.get("best_of") in (None, 1))


def _prefill_body(body: dict) -> dict:
    """The request as the prefill server gets it: one token, not streamed, its KV kept."""
    out = {k: v for k, v in body.items()
           if k not in ("stream", "stream_options", "min_tokens", "max_completion_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return out


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.prefill = _Pool(config.prefill_urls)
        self.decode = _Pool(config.decode_urls)
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        for route in _SPLIT_ROUTES:
            app.router.add_post(route, self._split)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.config.timeout)
        self._session = aiohttp.ClientSession(timeout=timeout)

    async def _stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        key = self.config.api_key
        if key is not None and request.path != "/health":
            if request.headers.get("Authorization", "") != f"Bearer {key}":
                return _error(401, "invalid or missing API key", "AuthenticationError")
        return await handler(request)

    def _headers(self) -> dict[str, str]:
        key = self.config.upstream_api_key
        return {} if key is None else {"Authorization": f"Bearer {key}"}

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _models(self, request: web.Request) -> web.Response:
        url = self.decode.pick()
        try:
            async with self._session.get(url + "/v1/models", headers=self._headers()) as up:
                return web.Response(body=await up.read(), status=up.status,
                                    content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return _error(502, f"the decode server {url} did not answer: {exc}", "BadGateway")

    async def _split(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not valid JSON", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "BadRequestError")
        decode_body = body
        if _splittable(body):
            params, early = await self._run_prefill(request.path, body)
            if early is not None:
                return early
            if params is not None:
                decode_body = dict(body, kv_transfer_params=params)
        return await self._run_decode(request, decode_body)

    async def _run_prefill(self, path: str, body: dict
                           ) -> tuple[dict | None, web.Response | None]:
        """(the prefill answer's kv_transfer_params, None), or (None, an answer for the
        client: its own mistake), or (None, None): the prefill side failed, the decode side
        computes the prompt."""
        url = self.prefill.pick()
        self.prefill.busy[url] = self.prefill.busy.get(url, 0) + 1
        try:
            async with self._session.post(url + path, json=_prefill_body(body),
                                          headers=self._headers()) as up:
                data = await up.read()
                if 400 <= up.status < 500 and up.status not in (408, 429):
                    return None, web.Response(body=data, status=up.status,
                                              content_type="application/json")
                if up.status != 200:
                    raise RuntimeError(f"HTTP {up.status}")
                params = json.loads(data).get("kv_transfer_params")
                if not isinstance(params, dict):
                    raise RuntimeError("its answer has no kv_transfer_params (is it started "
                                       "with a kv_producer --kv-transfer-config?)")
                return params, None
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as exc:
            logger.warning("prefill server %s failed (%s); the decode server computes the "
                           "prompt", url, exc or type(exc).__name__)
            return None, None
        finally:
            self.prefill.busy[url] -= 1

    async def _run_decode(self, request: web.Request, body: dict) -> web.StreamResponse:
        url = self.decode.pick()
        self.decode.busy[url] = self.decode.busy.get(url, 0) + 1
        try:
            async with self._session.post(url + request.path, json=body,
                                          headers=self._headers()) as up:
                content_type = up.headers.get("Content-Type", "application/json")
                if not body.get("stream") or up.status != 200:
                    return web.Response(body=await up.read(), status=up.status,
                                        headers={"Content-Type": content_type})
                out = web.StreamResponse(status=200, headers={"Content-Type": content_type,
                                                              "Cache-Control": "no-cache"})
                await out.prepare(request)
                try:
                    async for chunk in up.content.iter_any():
                        await out.write(chunk)
                    await out.write_eof()
                except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                    pass    # the client went away: leaving closes the decode request too
                return out
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            logger.warning("decode server %s failed: %s", url, exc or type(exc).__name__)
            return _error(502, f"the decode server did not answer ({type(exc).__name__})",
                          "BadGateway")
        finally:
            self.decode.busy[url] -= 1


def add_router_args(parser: argparse.ArgumentParser, *, with_address: bool = True) -> None:
    parser.add_argument("--prefill", nargs="+", default=None, metavar="URL",
                        help="prefill servers (folio serve with a kv_producer "
                             "--kv-transfer-config), e.g. http://127.0.0.1:8100")
    parser.add_argument("--decode", nargs="+", default=None, metavar="URL",
                        help="decode servers (folio serve with a kv_consumer "
                             "--kv-transfer-config)")
    parser.add_argument("--upstream-api-key", default=None,
                        help="API key the router sends to the servers (default: --api-key)")
    parser.add_argument("--router-timeout", type=float, default=600.0,
                        help="seconds to wait for a server's next bytes")
    if with_address:
        parser.add_argument("--host", default="127.0.0.1", help="address to bind")
        parser.add_argument("--port", type=int, default=8000, help="port to listen on")
        parser.add_argument("--api-key", default=os.environ.get("FOLIO_API_KEY"),
                            help="clients must send it as a Bearer token (every route but "
                                 "/health); env FOLIO_API_KEY")


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    if not args.prefill or not args.decode:
        raise ValueError("the router needs --prefill URL... and --decode URL...")
    return RouterConfig(prefill_urls=args.prefill, decode_urls=args.decode, host=args.host,
                        port=args.port, api_key=args.api_key,
                        upstream_api_key=args.upstream_api_key, timeout=args.router_timeout)


def run_router(args: argparse.Namespace) -> int:
    config = router_config_from_args(args)
    logger.info("folio router on %s:%d: prefill %s, decode %s", config.host, config.port,
                config.prefill_urls, config.decode_urls)
    web.run_app(Router(config).app(), host=config.host, port=config.port, print=None,
                access_log=None)
    return 0
