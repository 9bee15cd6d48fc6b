"""The multimodal pieces on a saved tiny LLaVA directory (what the engine will run next):
the prompt processed through the directory's own processor, and folio's vision encoder
loaded from the directory's weights, give transformers' image features for those pixels;
transformers itself answers with images from the directory (the reference path works)."""
from __future__ import annotations

import glob
import random

import numpy as np
import pytest
import torch
from PIL import Image

from folio.model.vision.clip_vision import LlavaVisionEncoder, load_llava_vision
from folio.multimodal.processing import ImagePromptProcessor

from llava_utils import TOKENS_PER_IMAGE, build_tiny_llava, hf_llava_greedy


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(str(tmp_path_factory.mktemp("tiny_llava")))


def _image(seed: int, size=(90, 60)) -> Image.Image:
    rng = random.Random(seed)
    data = bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3))
    return Image.frombytes("RGB", size, data)


def test_processing_and_the_vision_encoder_match_transformers(llava_dir) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlavaForConditionalGeneration
    config = AutoConfig.from_pretrained(llava_dir)
    processor = ImagePromptProcessor.from_pretrained(llava_dir, config.image_token_index,
                                                     max_images=2)
    images = [_image(1), _image(2, (40, 120))]
    ids, inputs = processor.process("USER: <image> and <image> ASSISTANT:", images)
    assert [i.length for i in inputs] == [TOKENS_PER_IMAGE] * 2
    encoder = LlavaVisionEncoder.from_hf_config(config)
    tensors = {}
    for path in glob.glob(f"{llava_dir}/*.safetensors"):
        tensors.update(load_file(path))
    assert load_llava_vision(encoder, tensors.items()) == []
    pixels = torch.from_numpy(np.stack([i.pixel_values for i in inputs]))
    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack(list(model.model.get_image_features(
            pixel_values=pixels, vision_feature_layer=-2,
            vision_feature_select_strategy="default").pooler_output))
    torch.testing.assert_close(encoder(pixels), want, rtol=1e-5, atol=1e-5)


def test_transformers_answers_with_images_from_the_directory(llava_dir) -> None:
    tokens = hf_llava_greedy(llava_dir, "USER: <image> what is it? ASSISTANT:", [_image(3)], 8)
    assert len(tokens) == 8
    other = hf_llava_greedy(llava_dir, "USER: <image> what is it? ASSISTANT:", [_image(4)], 8)
    # the image matters to the answer (a different image, a different continuation)
    assert tokens != other
