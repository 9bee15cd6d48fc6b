"""A prompt with images as the engine will take it (issue 24, item 2): the model's own Hugging
Face processor expands each image placeholder into the image's tokens and makes its pixel
values (so the preprocessing is the processor's by construction: resize, normalize, patching
and the placeholder count); this finds where each image's tokens are and keys the image by
its content, for the encoder-output cache and the prefix cache.

Torch-free: the processors' PIL/numpy path (as the API process runs it).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from folio.config import DEFAULT_IMAGES_PER_PROMPT

# Images whose processor output is remembered (see ImagePromptProcessor._run_one).
_RECENT_IMAGES = 16


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
    # M-RoPE's step between a video's frame pairs (1 for images and Qwen2-VL's videos)
    time_interval: float = 1.0


def video_content_hash(frames: Sequence[Any]) -> str:
    """A video's identity: its frames' hashes, in order."""
    digest = hashlib.sha256(b"video:")
    for frame in frames:
        digest.update(image_content_hash(frame).encode())
    return digest.hexdigest()


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
                 max_images: int = DEFAULT_IMAGES_PER_PROMPT,
                 processor_kwargs: dict | None = None, max_videos: int = 0) -> None:
        """`processor_kwargs` (--mm-processor-kwargs): the image processor's settings for
        every call (Qwen2-VL's min_pixels / max_pixels, CLIP's do_center_crop...); a name
        the image processor does not have is refused here, not ignored."""
        self.processor = processor
        self.image_token_id = image_token_id
        self.max_images = max_images
        self.max_videos = max_videos
        self.processor_kwargs = dict(processor_kwargs or {})
        self._recent: OrderedDict[str, dict] = OrderedDict()
        images = getattr(processor, "image_processor", None)
        known = getattr(processor, "call_kwargs", ())
        unknown = [k for k in self.processor_kwargs if not hasattr(images, k) and k not in known]
        if unknown:
            raise ValueError(f"mm_processor_kwargs: {unknown} are not settings of this model's "
                             f"image processor ({type(images).__name__})")

    @classmethod
    def from_pretrained(cls, path: str, image_token_id: int,
                        max_images: int = DEFAULT_IMAGES_PER_PROMPT,
                        processor_kwargs: dict | None = None,
                        kind: str = "llava", max_videos: int = 0) -> "ImagePromptProcessor":
        """`kind`: the model's (families.VISION_LANGUAGE_ARCHS): Qwen2-VL's processor is
        Qwen2VLProcessorAdapter (transformers' own loads a video processor that needs
        torchvision), any other the model's AutoProcessor."""
        if kind == "qwen2_vl":
            processor = Qwen2VLProcessorAdapter.from_pretrained(path)
        else:
            from transformers import AutoProcessor
            processor = AutoProcessor.from_pretrained(path)
        return cls(processor, image_token_id, max_images, processor_kwargs, max_videos)

    @property
    def image_token(self) -> str:
        return self.processor.image_token

    @property
    def chat_placeholder(self) -> str:
        """What a chat's image part becomes in the template's text (Qwen2-VL wraps the
        image token in <|vision_start|> ... <|vision_end|>)."""
        return getattr(self.processor, "chat_placeholder", self.image_token)

    def _check_count(self, count: int) -> None:
        if count > self.max_images:
            raise ValueError(f"multi_modal_data: {count} images, more than the "
                             f"{self.max_images} allowed per prompt (--limit-mm-per-prompt)")

    def _run(self, text: str, images: list[Any], add_special_tokens: bool = True) -> dict:
        try:
            return self.processor(text=[text], images=images or None, return_tensors="np",
                                  add_special_tokens=add_special_tokens,
                                  **self.processor_kwargs)
        except (ValueError, TypeError, OSError) as exc:
            raise ValueError(f"the model's processor refused the image: {exc}") from None

    def process(self, prompt: str, images: Sequence[Any]) -> tuple[list[int], list[ImageInput]]:
        """(token ids, images) of a prompt whose text holds one image placeholder (the
        processor's image_token) per image, in order. ValueError naming the problem for a
        placeholder count that does not match, or more images than allowed."""
        images = list(images)
        self._check_count(len(images))
        found = prompt.count(self.image_token)
        if found != len(images):
            raise ValueError(f"prompt has {found} image placeholder(s) {self.image_token!r} "
                             f"for {len(images)} image(s)")
        out = self._run(prompt, images)
        token_ids = [int(t) for t in out["input_ids"][0]]
        runs = placeholder_runs(token_ids, self.image_token_id)
        if len(runs) != len(images):
            raise ValueError(f"the processor made {len(runs)} image token runs for "
                             f"{len(images)} image(s)")
        if not images:
            return token_ids, []
        return token_ids, self._inputs(images, runs, out)

    def process_tokens(self, token_ids: Sequence[int], images: Sequence[Any],
                       videos: Sequence[Sequence[Any]] = ()) -> tuple[list[int], list[ImageInput]]:
        """(token ids, images and videos) of a tokenized prompt (a chat template's, whose
        special tokens are already in place) holding one image token per image and one
        video token per video (a list of frames): each expanded to the item's tokens as the
        processor expands it (the processor run on the placeholder alone, per item: the
        same pixel values and the same count as on the whole text)."""
        images, videos = list(images), [list(v) for v in videos]
        self._check_count(len(images))
        runs = [(o, n, "image") for o, n in placeholder_runs(token_ids, self.image_token_id)]
        if len(runs) != len(images):
            raise ValueError(f"prompt has {len(runs)} image placeholder(s) "
                             f"{self.image_token!r} for {len(images)} image(s)")
        if videos or self.video_token_id is not None:
            found = placeholder_runs(token_ids, self.video_token_id) \
                if self.video_token_id is not None else []
            if len(found) != len(videos):
                raise ValueError(f"prompt has {len(found)} video placeholder(s) for "
                                 f"{len(videos)} video(s)")
            if len(videos) > self.max_videos:
                raise ValueError(f"multi_modal_data: {len(videos)} videos, more than the "
                                 f"{self.max_videos} allowed per prompt "
                                 "(--limit-mm-per-prompt)")
            runs += [(o, n, "video") for o, n in found]
        items = {"image": iter(images), "video": iter(videos)}
        out_ids: list[int] = []
        inputs: list[ImageInput] = []
        position = 0
        for offset, length, kind in sorted(runs):
            item = next(items[kind])
            expanded, entry = (self._image_entry(item) if kind == "image"
                               else self._video_entry(item))
            if length not in (1, entry.length):
                raise ValueError(f"an {kind} placeholder run of {length} tokens: one token "
                                 f"per {kind}, or the {kind}'s {entry.length}")
            out_ids += token_ids[position:offset]
            entry.offset += len(out_ids)
            out_ids += expanded
            inputs.append(entry)
            position = offset + length
        out_ids += token_ids[position:]
        return out_ids, inputs

    def _image_entry(self, image: Any) -> tuple[list[int], ImageInput]:
        """One image's expanded placeholder tokens and its ImageInput (offset within them)."""
        one = self._run_one(image)
        expanded = [int(t) for t in one["input_ids"][0]]
        [(first, count)] = placeholder_runs(expanded, self.image_token_id)
        [entry] = self._inputs([image], [(first, count)], one)
        return expanded, entry

    def _video_entry(self, frames: list[Any]) -> tuple[list[int], ImageInput]:
        if not frames or not all(hasattr(f, "convert") and hasattr(f, "size") for f in frames):
            raise ValueError("multi_modal_data.video must be lists of PIL frames")
        try:
            pixels, grid, interval = self.processor.video_inputs(
                [f.convert("RGB") for f in frames], **self.processor_kwargs)
        except (ValueError, TypeError, OSError) as exc:
            raise ValueError(f"the model's processor refused the video: {exc}") from None
        count = int(np.prod(grid)) // self.processor.image_processor.merge_size ** 2
        entry = ImageInput(video_content_hash(frames), 0, count,
                           np.ascontiguousarray(pixels, dtype=np.float32), tuple(grid),
                           interval)
        return [self.video_token_id] * count, entry

    @property
    def video_token_id(self) -> int | None:
        """The model's video placeholder token (None: it takes no video)."""
        token = getattr(self.processor, "video_token", None)
        if token is None:
            return None
        return self.processor.tokenizer.convert_tokens_to_ids(token)

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in self.processor.tokenizer(text)["input_ids"]]

    def _run_one(self, image: Any) -> dict:
        """The processor on the placeholder and one image, remembered by the image's content
        for a while: the server expands a chat's placeholders to size its output budget, and
        the engine's preparation then reads the same result."""
        key = image_content_hash(image)
        out = self._recent.get(key)
        if out is None:
            out = self._run(self.image_token, [image], add_special_tokens=False)
            self._recent[key] = out
            while len(self._recent) > _RECENT_IMAGES:
                self._recent.popitem(last=False)
        else:
            self._recent.move_to_end(key)
        return out

    @staticmethod
    def _inputs(images: list[Any], runs: list[tuple[int, int]], out: dict) -> list[ImageInput]:
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        grids = out.get("image_grid_thw")
        if grids is not None:
            # Qwen2-VL: the images' patches are concatenated; each takes t*h*w of them
            grids = [tuple(int(x) for x in g) for g in np.asarray(grids)]
            splits = np.cumsum([t * h * w for t, h, w in grids])[:-1]
            per_image = np.split(pixels, splits)
        else:
            per_image = list(pixels)
            grids = [None] * len(images)
        return [ImageInput(image_content_hash(image), offset, length,
                           np.ascontiguousarray(values), grid)
                for image, (offset, length), values, grid in zip(images, runs, per_image, grids)]


class Qwen2VLProcessorAdapter:
    """Qwen2-VL's processor for images, as transformers' Qwen2VLProcessor computes it: the
    model's own image processor (resize to multiples of 28 within min/max pixels,
    normalize, patch; its PIL backend) for the pixel values and patch grids, and each
    <|image_pad|> in the text expanded to grid t*h*w / merge^2 image tokens. Called like an
    HF processor (text, images, return_tensors, add_special_tokens)."""

    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"
    chat_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    # --mm-processor-kwargs names beside the image processor's attributes (vLLM's and
    # Qwen's documented min/max pixels; a video's frames per second)
    call_kwargs = ("min_pixels", "max_pixels", "fps")

    def __init__(self, image_processor: Any, tokenizer: Any,
                 tokens_per_second: float | None = None) -> None:
        """`tokens_per_second`: Qwen2.5-VL's vision config value, which spaces a video's
        frame pairs in M-RoPE time (None: Qwen2-VL, a step of 1)."""
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.tokens_per_second = tokens_per_second

    def video_inputs(self, frames: list, fps: float = 2.0, **kwargs: Any
                     ) -> tuple[np.ndarray, list[int], float]:
        """A video's patches [t/2 * h * w, C * 2 * 14 * 14], grid [t/2, h, w] and M-RoPE time
        step: each frame resized and normalized by the image processor (one size for all,
        the first frame's), consecutive frames paired in each patch (an odd last frame
        repeated), as Qwen2-VL's video processor lays them out."""
        if len({f.size for f in frames}) != 1:
            raise ValueError("a video's frames must all have one size")
        out = self(text=[""], images=frames, **kwargs)
        grids = np.asarray(out["image_grid_thw"])
        if len({tuple(g) for g in grids}) != 1:
            raise ValueError("a video's frames must all have one size")
        _, h, w = (int(x) for x in grids[0])
        temporal = self.image_processor.temporal_patch_size
        per_frame = np.asarray(out["pixel_values"], dtype=np.float32).reshape(
            len(frames), h * w, -1, temporal, self.image_processor.patch_size ** 2)[:, :, :, 0]
        if len(frames) % temporal:
            per_frame = np.concatenate(
                [per_frame, np.repeat(per_frame[-1:], temporal - len(frames) % temporal, 0)])
        t = len(per_frame) // temporal
        paired = per_frame.reshape(t, temporal, h * w, -1, per_frame.shape[-1])
        pixels = paired.transpose(0, 2, 3, 1, 4).reshape(t * h * w, -1)
        interval = 1.0
        if self.tokens_per_second is not None:
            interval = self.tokens_per_second * temporal / fps
        return pixels, [t, h, w], interval

    @classmethod
    def from_pretrained(cls, path: str) -> "Qwen2VLProcessorAdapter":
        from transformers import AutoTokenizer
        try:
            from transformers import Qwen2VLImageProcessorPil as ImageProcessor
        except ImportError:          # transformers before the PIL backends
            from transformers import Qwen2VLImageProcessor as ImageProcessor
        import json
        import os
        tokens_per_second = None
        config_path = os.path.join(path, "config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                vision = json.load(f).get("vision_config", {})
            if "fullatt_block_indexes" in vision:          # Qwen2.5-VL
                tokens_per_second = vision.get("tokens_per_second", 4)
        return cls(ImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path),
                   tokens_per_second)

    def __call__(self, text: list[str], images: list | None = None, return_tensors: str = "np",
                 add_special_tokens: bool = True, **kwargs: Any) -> dict:
        out: dict = {}
        text = list(text)
        kwargs.pop("fps", None)            # a video's setting (video_inputs)
        if images:
            size = kwargs.pop("size", None)
            lo, hi = kwargs.pop("min_pixels", None), kwargs.pop("max_pixels", None)
            if lo is not None or hi is not None:
                current = self.image_processor.size
                size = {"shortest_edge": lo if lo is not None else current["shortest_edge"],
                        "longest_edge": hi if hi is not None else current["longest_edge"]}
            if size is not None:
                kwargs["size"] = size
            pixels = self.image_processor(images=images, return_tensors="np", **kwargs)
            out["pixel_values"] = pixels["pixel_values"]
            out["image_grid_thw"] = pixels["image_grid_thw"]
            merge = self.image_processor.merge_size ** 2
            counts = iter(int(np.prod(g)) // merge for g in pixels["image_grid_thw"])
            marker = "\0image\0"
            expanded = []
            for piece in text:
                while self.image_token in piece:
                    piece = piece.replace(self.image_token, marker * next(counts), 1)
                expanded.append(piece.replace(marker, self.image_token))
            text = expanded
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        out["input_ids"] = np.asarray(ids, dtype=np.int64)
        return out
