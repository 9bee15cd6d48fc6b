"""A prompt with images through the model's HF processor (issue 24, item 2): LLaVA-1.5's
(CLIP: resize, crop, normalize; a fixed token count) and Qwen2-VL's (smart resize, patches,
merge; a count per image size), on 20 generated images of different sizes and aspect ratios:
the pixel values are the image processor's own for each image, the placeholder runs sit
where the processor put them, and images are keyed by their pixels."""
from __future__ import annotations

import random

import numpy as np
import pytest
from PIL import Image

from folio.model.default_model import default_model_path
from folio.multimodal.processing import (ImagePromptProcessor, image_content_hash,
                                         placeholder_runs)


def _images(n: int = 20) -> list[Image.Image]:
    rng = random.Random(3)
    out = []
    for _ in range(n):
        w, h = rng.randrange(20, 400), rng.randrange(20, 400)
        data = bytes(rng.randrange(256) for _ in range(w * h * 3))
        out.append(Image.frombytes("RGB", (w, h), data))
    return out


def _tokenizer(*extra: str):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_path())
    tok.add_special_tokens({"additional_special_tokens": list(extra)})
    return tok


def _llava():
    from transformers import CLIPImageProcessorPil, LlavaProcessor
    tok = _tokenizer("<image>")
    images = CLIPImageProcessorPil(size={"shortest_edge": 56},
                                   crop_size={"height": 56, "width": 56})
    # (llava-1.5's processor config: the CLS token counted, then dropped by "default")
    proc = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14,
                          vision_feature_select_strategy="default", image_token="<image>",
                          num_additional_image_tokens=1)
    return ImagePromptProcessor(proc, tok.convert_tokens_to_ids("<image>"), max_images=4), images


def _qwen2_vl():
    # transformers builds Qwen2-VL's processor with its video processor, which needs
    # torchvision (not installed on the dev VM)
    pytest.importorskip("torchvision")
    from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor
    tok = _tokenizer("<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>")
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    proc = Qwen2VLProcessor(image_processor=images, tokenizer=tok)
    return ImagePromptProcessor(proc, tok.convert_tokens_to_ids("<|image_pad|>"),
                                max_images=4), images


def test_placeholder_runs() -> None:
    assert placeholder_runs([1, 9, 9, 2, 9, 3, 9, 9], 9) == [(1, 2), (4, 1), (6, 2)]
    assert placeholder_runs([1, 2], 9) == []


@pytest.mark.parametrize("make", [_llava, _qwen2_vl])
def test_each_image_is_the_processors_own(make) -> None:
    processor, image_processor = make()
    token = processor.image_token
    for image in _images():
        ids, (inp,) = processor.process(f"Describe {token} briefly.", [image])
        own = image_processor(images=[image], return_tensors="np")
        np.testing.assert_array_equal(inp.pixel_values, np.asarray(own["pixel_values"]).reshape(
            inp.pixel_values.shape))
        assert ids[inp.offset:inp.offset + inp.length] == [processor.image_token_id] * inp.length
        if "image_grid_thw" in own:        # Qwen2-VL: a token per 2 x 2 merged patches
            t, h, w = (int(x) for x in own["image_grid_thw"][0])
            assert inp.grid_thw == (t, h, w) and inp.length == t * h * w // 4
        else:                              # LLaVA: (56 / 14)^2 patches, CLS dropped
            assert inp.length == 16
        assert inp.content_hash == image_content_hash(image)


def test_two_images_in_order_and_the_bounds() -> None:
    processor, _ = _llava()
    a, b = _images(2)
    ids, inputs = processor.process("<image> and <image>?", [a, b])
    assert [i.offset for i in inputs][0] < inputs[1].offset
    assert [i.content_hash for i in inputs] == [image_content_hash(a), image_content_hash(b)]
    assert image_content_hash(a) != image_content_hash(b)
    assert image_content_hash(a.copy()) == image_content_hash(a)
    with pytest.raises(ValueError, match="placeholder"):
        processor.process("one <image> only", [a, b])
    with pytest.raises(ValueError, match="limit-mm-per-prompt"):
        processor.process("<image>" * 5, [a] * 5)
    ids, inputs = processor.process("no images", [])
    assert inputs == [] and processor.image_token_id not in ids
