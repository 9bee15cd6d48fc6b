"""A prompt with images as the engine will take it (issue 24, item 2): the model's own Hugging
Face processor expands each image placeholder into the image's tokens and makes its pixel
values (so the preprocessing is the processor's by construction: resize, normalize, patching
and the placeholder count); this finds where each image's tokens are and keys the image by
its content, for the encoder-output cache and the prefix cache.

Torch-free: the processors' PIL/numpy path (as the API process runs it).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

# Images one prompt may carry unless --limit-mm-per-prompt says otherwise (vLLM's default
# for images is 1; a bound either way: each image costs an encoder pass and its tokens).
DEFAULT_IMAGES_PER_PROMPT = 1


@dataclass
class ImageInput:
    """One image of a prompt: its tokens are prompt positions [offset, offset + length)."""
    content_hash: str
    offset: int
    length: int
    # The processor's pixel values for this image (float32), and the patch grid where the
    # family has one (Qwen2-VL's [t, h, w]).
    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int] | None = None


def image_content_hash(image: Any) -> str:
    """The image's identity: its decoded RGB pixels and size (the same picture sent as PNG
    or as JPEG-then-decoded-identically is the same image; any pixel that differs is not)."""
    rgb = image.convert("RGB") if image.mode != "RGB" else image
    digest = hashlib.sha256()
    digest.update(f"{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()


def placeholder_runs(token_ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of `token_id` in `token_ids`, in order."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate(token_ids):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i - start))
            start = None
    if start is not None:
        runs.append((start, len(token_ids) - start))
    return runs


class ImagePromptProcessor:
    """Wraps a model's HF processor (AutoProcessor): a text prompt with its image
    placeholders, and images, in; token ids and one ImageInput per image out."""

    def __init__(self, processor: Any, image_token_id: int,
                 max_images: int = DEFAULT_IMAGES_PER_PROMPT) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        self.max_images = max_images

    @classmethod
    def from_pretrained(cls, path: str, image_token_id: int,
                        max_images: int = DEFAULT_IMAGES_PER_PROMPT) -> "ImagePromptProcessor":
        from transformers import AutoProcessor
        return cls(AutoProcessor.from_pretrained(path), image_token_id, max_images)

    @property
    def image_token(self) -> str:
        return self.processor.image_token

    def process(self, prompt: str, images: Sequence[Any]) -> tuple[list[int], list[ImageInput]]:
        """(token ids, images) of a prompt whose text holds one image placeholder (the
        processor's image_token) per image, in order. ValueError naming the problem for a
        placeholder count that does not match, or more images than allowed."""
        images = list(images)
        if len(images) > self.max_images:
            raise ValueError(f"multi_modal_data: {len(images)} images, more than the "
                             f"{self.max_images} allowed per prompt (--limit-mm-per-prompt)")
        found = prompt.count(self.image_token)
        if found != len(images):
            raise ValueError(f"prompt has {found} image placeholder(s) {self.image_token!r} "
                             f"for {len(images)} image(s)")
        out = self.processor(text=[prompt], images=images or None, return_tensors="np")
        token_ids = [int(t) for t in out["input_ids"][0]]
        runs = placeholder_runs(token_ids, self.image_token_id)
        if len(runs) != len(images):
            raise ValueError(f"the processor made {len(runs)} image token runs for "
                             f"{len(images)} image(s)")
        if not images:
            return token_ids, []
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        grids = out.get("image_grid_thw")
        inputs = []
        if grids is not None:
            # Qwen2-VL: the images' patches are concatenated; each takes t*h*w of them
            grids = [tuple(int(x) for x in g) for g in np.asarray(grids)]
            splits = np.cumsum([t * h * w for t, h, w in grids])[:-1]
            per_image = np.split(pixels, splits)
        else:
            per_image = list(pixels)
            grids = [None] * len(images)
        for image, (offset, length), values, grid in zip(images, runs, per_image, grids):
            inputs.append(ImageInput(image_content_hash(image), offset, length,
                                     np.ascontiguousarray(values), grid))
        return token_ids, inputs
