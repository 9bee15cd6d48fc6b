"""Images for `folio bench serve --dataset random-mm` (issue 24): random-pixel images of a
given size, or the images of a folder, each sent as a base64 PNG data URL in a chat
request's image_url parts. A second pass sends the same images with other texts, so its
requests find every image in the server's encoder-output cache but share no prefix with the
first pass: the two passes' TTFT are the encoder cache's effect."""
from __future__ import annotations

import base64
import io
import os
from typing import Any

import numpy as np

# File types read from --mm-image-dir.
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def parse_size(text: str) -> tuple[int, int]:
    """'WxH' -> (W, H); ValueError for anything else or a side outside [1, 8192]."""
    w, sep, h = text.lower().partition("x")
    if not (sep and w.isdigit() and h.isdigit()):
        raise ValueError(f"an image size is WIDTHxHEIGHT, got {text!r}")
    size = int(w), int(h)
    if not all(1 <= side <= 8192 for side in size):
        raise ValueError(f"image sides must be in [1, 8192], got {text!r}")
    return size


def png_data_url(image: Any) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def random_image_urls(count: int, size: tuple[int, int], seed: int) -> list[str]:
    """`count` distinct random-pixel images of `size`, as data URLs."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    return [png_data_url(Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3),
                                                      dtype=np.uint8)))
            for _ in range(count)]


def folder_image_urls(directory: str, count: int) -> list[str]:
    """The first `count` images of `directory` (sorted by name; cycled when there are fewer),
    re-encoded as PNG data URLs."""
    from PIL import Image
    names = sorted(n for n in os.listdir(directory) if n.lower().endswith(_IMAGE_SUFFIXES))
    if not names:
        raise ValueError(f"--mm-image-dir {directory!r} holds no {_IMAGE_SUFFIXES} images")
    urls = []
    for name in names[:count]:
        with Image.open(os.path.join(directory, name)) as image:
            urls.append(png_data_url(image.convert("RGB")))
    return [urls[i % len(urls)] for i in range(count)]


def chat_content(text: str, image_urls: list[str]) -> list[dict]:
    """A user message's parts: the text first (so another text means another prefix), then
    the images."""
    return [{"type": "text", "text": text}] + [
        {"type": "image_url", "image_url": {"url": url}} for url in image_urls]
