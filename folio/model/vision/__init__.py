"""Vision encoders of vision-language models (issue 24): their image features replace the
image placeholder tokens' embeddings in the decoder's input.

Every encoder offers the same face to the worker's ImageEmbedder:
- `encode_batch(pixels, grids)`: each image's features (pixels as the processor made them,
  grids the patch grids where the family has them, else None);
- `largest_image_tokens`: the most features one image can have;
- `profile_batch(tokens)`: blank inputs of about `tokens` features at the largest image
  size, for the start-up memory profile.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

import torch


def build_vision_encoder(vision: dict, text_hidden_size: int, model_path: str,
                         tensors: Iterable[tuple[str, torch.Tensor]],
                         processor_kwargs: dict | None = None) -> torch.nn.Module:
    """The encoder `vision` (families.decoder_config's vision_language) describes, its
    weights read from `tensors`; ValueError when the checkpoint lacks some."""
    if vision["kind"] == "qwen2_vl":
        from folio.model.vision.qwen2_vision import (Qwen2VisionEncoder, Qwen2VisionSpec,
                                                     load_qwen2_vision)
        encoder = Qwen2VisionEncoder(Qwen2VisionSpec.from_hf(vision["vision_config"]),
                                     largest_patches(model_path, processor_kwargs))
        missing = load_qwen2_vision(encoder, tensors)
    else:
        from folio.model.vision.clip_vision import (ClipVisionSpec, LlavaVisionEncoder,
                                                    load_llava_vision)
        encoder = LlavaVisionEncoder(
            ClipVisionSpec.from_hf(vision["vision_config"]), text_hidden_size,
            vision["vision_feature_layer"], vision["vision_feature_select_strategy"],
            vision["projector_hidden_act"], vision["multimodal_projector_bias"])
        missing = load_llava_vision(encoder, tensors)
    if missing:
        raise ValueError(f"the checkpoint lacks the vision encoder's {missing[:3]}")
    return encoder


def largest_patches(model_path: str, processor_kwargs: dict | None = None) -> int:
    """The most patches Qwen2-VL's processor makes of one image: its max_pixels (from
    --mm-processor-kwargs, else preprocessor_config.json's size.longest_edge or
    max_pixels) over a patch's 14 x 14 pixels."""
    config: dict[str, Any] = {}
    path = os.path.join(model_path, "preprocessor_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    kwargs = processor_kwargs or {}
    size = kwargs.get("size") or config.get("size") or {}
    max_pixels = (kwargs.get("max_pixels") or size.get("longest_edge")
                  or config.get("max_pixels") or 12845056)
    patch = int(config.get("patch_size", 14))
    return max(1, int(max_pixels) // (patch * patch))
