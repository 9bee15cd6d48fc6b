"""Fetching the images a request names, safely (issue 24, item 5): the default refuses what
an attacker would use a server that fetches URLs for.

- **Addresses**: a URL's host is resolved once; if any address it resolves to is loopback,
  private, link-local, multicast, reserved or unspecified (IPv4 and IPv6, IPv4-mapped and
  6to4/NAT64-embedded IPv4 included), the URL is refused unless the operator allows private
  addresses (`allow_private_media_urls`) or the host is one of `allowed_media_domains`. The
  connection then goes to the checked addresses only (the resolver handed to the HTTP
  client returns them), so a second DNS answer cannot point it elsewhere (DNS rebinding).
- **Domains**: with `allowed_media_domains` set, only those hosts (and their subdomains) are
  fetched at all, as vLLM's flag of that name does.
- **Redirects** are followed by hand, each target checked as the first URL was.
- **Bounds**: the body (`max_media_bytes`, checked against Content-Length first and while
  reading), the whole fetch's time (`timeout`), the decoded pixel count (`max_image_pixels`,
  read from the header before any pixel is decoded: a 20,000 x 20,000 PNG bomb is refused
  without inflating it), and fetches in flight at once (`max_concurrency`).
- **Schemes**: http, https, data (base64 images), and file only under
  `allowed_local_media_path`. Only image content types are decoded (PNG, JPEG, WebP, GIF).

Fetching is asynchronous (aiohttp) and decoding runs in a worker thread, so the API server's
event loop never waits on either. Every refusal is a `MediaFetchError` (a ValueError: the
server answers 400 with its message, which names the reason).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import os
import socket
import urllib.parse
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from folio.config import MediaFetchConfig

__all__ = ["MediaFetchConfig", "MediaFetchError", "MediaFetcher", "FetchedImage", "ImageRef",
           "decode_image", "is_public_address"]

# The formats decoded; anything else is refused before decoding.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_CONTENT_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")
_REDIRECTS = (301, 302, 303, 307, 308)

# (host, port) -> the addresses it resolves to (a test injects its own).
Resolver = Callable[[str, int], Awaitable[list[str]]]


class MediaFetchError(ValueError):
    """A media URL refused or that could not be fetched; the message names why."""


def is_public_address(address: str) -> bool:
    """Whether an address is an ordinary public one: not loopback, private, link-local,
    multicast, reserved or unspecified, also when an IPv4 address hides inside an IPv6 one
    (IPv4-mapped ::ffff:a.b.c.d, 6to4 2002::/16, NAT64 64:ff9b::/96)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return is_public_address(str(ip.ipv4_mapped))    # a connection to the IPv4 address
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.sixtofour
        if inner is None and ip in ipaddress.ip_network("64:ff9b::/96"):
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None and not is_public_address(str(inner)):
            return False
    return not (ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_multicast
                or ip.is_reserved or ip.is_unspecified or not ip.is_global)


async def system_resolver(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


@dataclass
class FetchedImage:
    """A decoded image (a PIL.Image in RGB) and where it came from."""
    image: object
    source: str
    num_bytes: int


@dataclass
class ImageRef:
    """An image a request names: a URL to fetch (http(s), data:, file:) or, offline, the
    image itself (a PIL image)."""
    url: str | None = None
    image: object = None


@dataclass
class MediaFetcher:
    config: MediaFetchConfig = field(default_factory=MediaFetchConfig)
    # None: system_resolver, looked up when used (so a test can stand in for the DNS).
    resolver: Resolver | None = None

    def __post_init__(self) -> None:
        self._slots: asyncio.Semaphore | None = None

    # ---- the checks ------------------------------------------------------------------------

    def _domain_allowed(self, host: str) -> bool:
        domains = self.config.allowed_media_domains
        return domains is not None and any(host == d or host.endswith("." + d) for d in domains)

    async def check_url(self, url: str) -> tuple[urllib.parse.SplitResult, list[str]]:
        """(the parsed URL, the addresses to connect to) for an http(s) URL; a
        MediaFetchError when it may not be fetched."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise MediaFetchError(f"media URL scheme {parts.scheme!r} is not allowed")
        host = (parts.hostname or "").lower().strip(".")
        if not host:
            raise MediaFetchError("media URL has no host")
        domains = self.config.allowed_media_domains
        if domains is not None and not self._domain_allowed(host):
            raise MediaFetchError(f"media URL host {host!r} is not in --allowed-media-domains")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            ipaddress.ip_address(host)
            addresses = [host]
        except ValueError:
            try:
                addresses = await (self.resolver or system_resolver)(host, port)
            except OSError as exc:
                raise MediaFetchError(f"media URL host {host!r} does not resolve: {exc}") from None
        if not addresses:
            raise MediaFetchError(f"media URL host {host!r} does not resolve")
        if not (self.config.allow_private_media_urls or self._domain_allowed(host)):
            private = [a for a in addresses if not is_public_address(a)]
            if private:
                raise MediaFetchError(
                    f"media URL host {host!r} resolves to a private, loopback or reserved "
                    f"address ({private[0]}); refused (--allow-private-media-urls or "
                    "--allowed-media-domains allow it)")
        return parts, addresses

    # ---- fetching --------------------------------------------------------------------------

    async def fetch_image(self, url: str) -> FetchedImage:
        """The image at `url` (http, https, data or file), decoded to RGB."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_concurrency)
        async with self._slots:
            scheme = url.split(":", 1)[0].lower()
            if scheme == "data":
                data = _data_url_bytes(url, self.config.max_media_bytes)
            elif scheme == "file":
                data = self._read_local(url)
            else:
                try:
                    data = await asyncio.wait_for(self._download(url), self.config.timeout)
                except asyncio.TimeoutError:
                    raise MediaFetchError(f"media URL took longer than {self.config.timeout:g} "
                                          "s to fetch") from None
            image = await asyncio.get_running_loop().run_in_executor(
                None, decode_image, data, self.config.max_image_pixels)
            return FetchedImage(image, url if scheme != "data" else "data:", len(data))

    async def load_images(self, refs: list[ImageRef]) -> list[object]:
        """The RGB PIL images `refs` name, fetched concurrently (at most max_concurrency at
        once); the first refusal is raised once all have settled."""
        async def one(ref: ImageRef):
            if ref.image is not None:
                return ref.image.convert("RGB")
            return (await self.fetch_image(ref.url)).image
        results = await asyncio.gather(*(one(r) for r in refs), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)

    async def _download(self, url: str) -> bytes:
        import aiohttp
        for _ in range(self.config.max_redirects + 1):
            parts, addresses = await self.check_url(url)
            connector = aiohttp.TCPConnector(resolver=_PinnedResolver(addresses),
                                             use_dns_cache=False, force_close=True)
            try:
                async with aiohttp.ClientSession(connector=connector) as session:
                    async with session.get(url, allow_redirects=False) as resp:
                        if resp.status in _REDIRECTS:
                            location = resp.headers.get("Location")
                            if not location:
                                raise MediaFetchError("media URL redirected without a Location")
                            url = urllib.parse.urljoin(url, location)
                            continue
                        if resp.status != 200:
                            raise MediaFetchError(f"media URL answered HTTP {resp.status}")
                        content_type = resp.headers.get("Content-Type", "").split(";")[0]
                        if content_type.strip().lower() not in _CONTENT_TYPES:
                            raise MediaFetchError(f"media URL content type {content_type!r} "
                                                  "is not an image type folio decodes")
                        return await _read_bounded(resp, self.config.max_media_bytes)
            except aiohttp.ClientError as exc:
                raise MediaFetchError(f"media URL could not be fetched: {exc}") from None
        raise MediaFetchError(f"media URL redirected more than {self.config.max_redirects} times")

    def _read_local(self, url: str) -> bytes:
        root = self.config.allowed_local_media_path
        if root is None:
            raise MediaFetchError("file:// media URLs are refused (--allowed-local-media-path "
                                  "allows a directory)")
        path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
        if os.path.commonpath([root, path]) != root:
            raise MediaFetchError("file:// media URL is outside --allowed-local-media-path")
        try:
            size = os.path.getsize(path)
            if size > self.config.max_media_bytes:
                raise MediaFetchError(f"media file is {size} bytes, over the "
                                      f"{self.config.max_media_bytes} allowed")
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise MediaFetchError(f"media file could not be read: {exc.strerror}") from None


class _PinnedResolver:
    """aiohttp's resolver for one connection: the addresses already checked, nothing else
    (no second DNS lookup whose answer could differ)."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET):
        return [{"hostname": host, "host": a, "port": port,
                 "family": socket.AF_INET6 if ":" in a else socket.AF_INET,
                 "proto": 0, "flags": socket.AI_NUMERICHOST} for a in self.addresses]

    async def close(self) -> None:
        """Nothing to close: it holds no resolver of its own."""


async def _read_bounded(resp, limit: int) -> bytes:
    length = resp.headers.get("Content-Length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise MediaFetchError(f"media URL's body is {length} bytes, over the {limit} allowed")
    out = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        out += chunk
        if len(out) > limit:
            raise MediaFetchError(f"media URL's body is over the {limit} bytes allowed")
    return bytes(out)


def _data_url_bytes(url: str, limit: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header.lower():
        raise MediaFetchError("a data: media URL must be base64 (data:image/png;base64,...)")
    media_type = header[5:].split(";")[0].strip().lower()
    if media_type not in _CONTENT_TYPES:
        raise MediaFetchError(f"data: media type {media_type!r} is not an image type folio "
                              "decodes")
    if len(payload) * 3 // 4 > limit:
        raise MediaFetchError(f"data: media URL is over the {limit} bytes allowed")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaFetchError("data: media URL is not valid base64") from None


def decode_image(data: bytes, max_pixels: int):
    """The image in `data` as an RGB PIL image; its size is checked from the header before
    any pixel is decoded."""
    from PIL import Image
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise MediaFetchError(f"image is over the {max_pixels} pixels allowed") from None
    except Exception:      # noqa: BLE001 - PIL raises many kinds for bad input
        raise MediaFetchError("media is not an image folio can decode") from None
    if image.format not in IMAGE_FORMATS:
        raise MediaFetchError(f"media format {image.format} is not one folio decodes "
                              f"({', '.join(IMAGE_FORMATS)})")
    width, height = image.size
    if width < 1 or height < 1 or width * height > max_pixels:
        raise MediaFetchError(f"image is {width} x {height} pixels, over the {max_pixels} "
                              "allowed")
    try:
        image.load()
        return image.convert("RGB")
    except Exception:      # noqa: BLE001
        raise MediaFetchError("image data is truncated or corrupt") from None
