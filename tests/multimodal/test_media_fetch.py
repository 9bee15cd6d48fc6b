"""Safe fetching of media URLs (issue 24, item 5), against a real HTTP server on loopback:
loopback and private addresses refused by default (also behind a public-looking name, through
the resolver hook), allowed when the operator says so; redirects checked again; size, time
and pixel bounds; data: and file: URLs; only image types decoded."""
from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib

import pytest
from aiohttp import web
from PIL import Image

from folio.multimodal.media_fetch import (MediaFetchConfig, MediaFetchError, MediaFetcher,
                                          decode_image, is_public_address)


def _png(width: int = 7, height: int = 5) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(out, format="PNG")
    return out.getvalue()


def _bomb_png(width: int = 20000, height: int = 20000) -> bytes:
    """A PNG whose header claims width x height pixels (a few hundred bytes on the wire)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)    # 8-bit greyscale
    idat = zlib.compress(b"\x00" * (width + 1) * 4)                  # a few rows only
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.mark.parametrize("address, public", [
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.9", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("224.0.0.1", False), ("0.0.0.0", False), ("100.64.0.1", False),
    ("::1", False), ("fe80::1", False), ("fc00::1", False), ("::", False),
    ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("2002:7f00:1::1", False),
    ("64:ff9b::7f00:1", False), ("ff02::1", False),
    ("8.8.8.8", True), ("1.1.1.1", True), ("2606:4700:4700::1111", True),
    ("::ffff:8.8.8.8", True),
])
def test_which_addresses_are_public(address, public) -> None:
    assert is_public_address(address) is public


class _Site:
    """An aiohttp server on a loopback port: an image, a redirect, a huge body, a slow
    answer, an HTML page."""

    def __init__(self) -> None:
        self.png = _png()
        self.redirect_to = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/img.png", self._img)
        app.router.add_get("/redirect", self._redirect)
        app.router.add_get("/huge", self._huge)
        app.router.add_get("/huge-chunked", self._huge_chunked)
        app.router.add_get("/slow", self._slow)
        app.router.add_get("/page", self._page)
        app.router.add_get("/bomb.png", self._bomb)
        return app

    async def _img(self, request):
        return web.Response(body=self.png, content_type="image/png")

    async def _bomb(self, request):
        return web.Response(body=_bomb_png(), content_type="image/png")

    async def _redirect(self, request):
        raise web.HTTPFound(self.redirect_to)

    async def _huge(self, request):
        return web.Response(body=b"\0" * (100 * 2**20), content_type="image/png")

    async def _huge_chunked(self, request):
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        block = b"\0" * 2**20
        try:
            for _ in range(100):
                await resp.write(block)
        except (ConnectionResetError, RuntimeError):
            pass     # the fetcher hung up once over its limit: what this route checks
        return resp

    async def _slow(self, request):
        await asyncio.sleep(5)
        return web.Response(body=self.png, content_type="image/png")

    async def _page(self, request):
        return web.Response(text="<html></html>", content_type="text/html")


def _run(site: _Site, body):
    """Serve `site` on a loopback port and run `body(port)` (a coroutine function)."""
    async def main():
        runner = web.AppRunner(site.app())
        await runner.setup()
        tcp = web.TCPSite(runner, "127.0.0.1", 0)
        await tcp.start()
        port = tcp._server.sockets[0].getsockname()[1]
        try:
            return await body(port)
        finally:
            await runner.cleanup()
    return asyncio.run(main())


def _resolver(table: dict[str, str]):
    async def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError(f"unknown host {host}")
        return [table[host]]
    return resolve


def test_loopback_is_refused_by_default_and_served_when_allowed() -> None:
    site = _Site()

    async def body(port):
        url = f"http://127.0.0.1:{port}/img.png"
        with pytest.raises(MediaFetchError, match="private, loopback or reserved"):
            await MediaFetcher().fetch_image(url)
        got = await MediaFetcher(MediaFetchConfig(allow_private_media_urls=True)).fetch_image(url)
        assert got.image.size == (7, 5) and got.image.mode == "RGB"
        assert got.image.getpixel((0, 0)) == (200, 30, 90)
    _run(site, body)


def test_a_public_looking_name_resolving_to_loopback_is_refused() -> None:
    site = _Site()
    resolve = _resolver({"images.example.com": "127.0.0.1"})

    async def body(port):
        url = f"http://images.example.com:{port}/img.png"
        with pytest.raises(MediaFetchError, match="127.0.0.1"):
            await MediaFetcher(resolver=resolve).fetch_image(url)
        # the operator names the domain: fetched, from the address checked (no second lookup)
        allowed = MediaFetcher(MediaFetchConfig(allowed_media_domains=["example.com"]),
                               resolver=resolve)
        assert (await allowed.fetch_image(url)).image.size == (7, 5)
        # and nothing outside the named domains is fetched at all
        with pytest.raises(MediaFetchError, match="allowed-media-domains"):
            await allowed.fetch_image(f"http://127.0.0.1:{port}/img.png")
    _run(site, body)


def test_a_redirect_to_loopback_is_refused() -> None:
    site = _Site()
    resolve = _resolver({"good.example": "127.0.0.1", "evil.example": "127.0.0.1"})

    async def body(port):
        fetcher = MediaFetcher(MediaFetchConfig(allowed_media_domains=["good.example"]),
                               resolver=resolve)
        url = f"http://good.example:{port}/redirect"
        site.redirect_to = f"http://good.example:{port}/img.png"
        assert (await fetcher.fetch_image(url)).image.size == (7, 5)
        for target in (f"http://127.0.0.1:{port}/img.png", f"http://evil.example:{port}/img.png"):
            site.redirect_to = target
            with pytest.raises(MediaFetchError, match="allowed-media-domains"):
                await fetcher.fetch_image(url)
        # without a domain list, a redirect's target is checked for its address
        open_fetcher = MediaFetcher(resolver=resolve)
        with pytest.raises(MediaFetchError, match="private"):
            await open_fetcher.fetch_image(url)
    _run(site, body)


def test_size_time_and_pixel_bounds() -> None:
    site = _Site()
    fetcher = MediaFetcher(MediaFetchConfig(allow_private_media_urls=True, timeout=1.0))

    async def body(port):
        base = f"http://127.0.0.1:{port}"
        # refused for their size, which the message names (no wall-clock bound: a loaded
        # machine would break it, and a loopback read of the whole body is fast anyway)
        for path in ("/huge", "/huge-chunked"):
            with pytest.raises(MediaFetchError, match="bytes"):
                await fetcher.fetch_image(base + path)
        with pytest.raises(MediaFetchError, match="pixels"):
            await fetcher.fetch_image(base + "/bomb.png")
        with pytest.raises(MediaFetchError, match="longer than"):
            await fetcher.fetch_image(base + "/slow")
        with pytest.raises(MediaFetchError, match="content type"):
            await fetcher.fetch_image(base + "/page")
        with pytest.raises(MediaFetchError, match="HTTP 404"):
            await fetcher.fetch_image(base + "/missing.png")
    _run(site, body)


def test_data_urls() -> None:
    fetcher = MediaFetcher()
    good = "data:image/png;base64," + base64.b64encode(_png(3, 4)).decode()

    async def body():
        assert (await fetcher.fetch_image(good)).image.size == (3, 4)
        with pytest.raises(MediaFetchError, match="not an image type"):
            await fetcher.fetch_image("data:text/plain;base64,aGVsbG8=")
        with pytest.raises(MediaFetchError, match="base64"):
            await fetcher.fetch_image("data:image/png;base64,@@@")
        with pytest.raises(MediaFetchError, match="base64"):
            await fetcher.fetch_image("data:image/png,rawbytes")
        with pytest.raises(MediaFetchError, match="pixels"):
            await fetcher.fetch_image("data:image/png;base64,"
                                      + base64.b64encode(_bomb_png()).decode())
        small = MediaFetcher(MediaFetchConfig(max_media_bytes=64))
        with pytest.raises(MediaFetchError, match="bytes allowed"):
            await small.fetch_image(good)
        for scheme in ("ftp://x/y.png", "gopher://x/", "javascript:alert(1)"):
            with pytest.raises(MediaFetchError, match="scheme"):
                await fetcher.fetch_image(scheme)
    asyncio.run(body())


def test_file_urls_only_under_the_allowed_directory(tmp_path) -> None:
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "a.png").write_bytes(_png(2, 2))
    (tmp_path / "secret.png").write_bytes(_png(2, 2))

    async def body():
        with pytest.raises(MediaFetchError, match="allowed-local-media-path"):
            await MediaFetcher().fetch_image(f"file://{inside}/a.png")
        fetcher = MediaFetcher(MediaFetchConfig(allowed_local_media_path=str(inside)))
        assert (await fetcher.fetch_image(f"file://{inside}/a.png")).image.size == (2, 2)
        for outside in (f"file://{inside}/../secret.png", f"file://{tmp_path}/secret.png",
                        "file:///etc/passwd"):
            with pytest.raises(MediaFetchError, match="outside"):
                await fetcher.fetch_image(outside)
    asyncio.run(body())


def test_only_image_formats_are_decoded() -> None:
    out = io.BytesIO()
    Image.new("RGB", (4, 4)).save(out, format="BMP")
    with pytest.raises(MediaFetchError, match="format BMP"):
        decode_image(out.getvalue(), 1000)
    noisy = io.BytesIO()
    Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48).save(noisy, format="PNG")
    with pytest.raises(MediaFetchError, match="truncated or corrupt"):
        decode_image(noisy.getvalue()[:len(noisy.getvalue()) // 2], 10**6)
    with pytest.raises(MediaFetchError, match="decode"):
        decode_image(b"not an image", 1000)
