"""An image (or a video's frames) of a prompt as the engine carries it (issue 24): where its placeholder tokens
are, its content hash (the encoder-output cache and the prefix cache key by it), and the
processor's pixel values (float32, little-endian bytes: compact on the wire). Torch-free."""
from __future__ import annotations

import msgspec


class ImageInputData(msgspec.Struct, array_like=True, gc=False):
    content_hash: str
    offset: int          # its first placeholder token in the prompt
    length: int          # its placeholder tokens (= the encoder's features for it)
    shape: list[int]     # of the pixel values
    pixel_values: bytes
    # Qwen2-VL: the image's patch grid [t, h, w] (the encoder's input layout and the
    # M-RoPE positions of its tokens); None for fixed-size encoders (LLaVA).
    grid_thw: list[int] | None = None
    # M-RoPE's step between a video's frame pairs (1.0 for images)
    time_interval: float = 1.0
