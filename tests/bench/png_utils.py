"""Checks of the PNG figures the benchmarks write (shared by the plot and sweep tests)."""
from __future__ import annotations

import struct
from pathlib import Path

from folio.bench import plot_support

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    """A complete PNG of the figures' size, neither empty nor absurdly large."""
    data = Path(path).read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", data[16:24])             # the IHDR chunk
    assert (width, height) == (int(plot_support.FIGSIZE[0] * plot_support.DPI),
                               int(plot_support.FIGSIZE[1] * plot_support.DPI))
    assert 10_000 < len(data) < 2_000_000
    assert data[-8:-4] == b"IEND"                                 # not cut short
    from PIL import Image
    with Image.open(path) as image:
        image.verify()
