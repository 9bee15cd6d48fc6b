"""A LLaVA-1.5-style model serves text through the engine (issue 24, first step): its text
config and decoder weights are read from the vision-language checkpoint, and greedy answers
equal transformers' LlavaForConditionalGeneration without images. Images are refused with a
clear error until the engine runs the vision encoder (never silently dropped)."""
from __future__ import annotations

import pytest

from folio import LLM, SamplingParams

from llava_utils import build_tiny_llava, hf_llava_greedy


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    model_dir = build_tiny_llava(str(tmp_path_factory.mktemp("tiny_llava_text")))
    llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=256)
    yield model_dir, llm
    llm.llm_engine.shutdown()


def test_text_prompts_match_transformers(llava) -> None:
    model_dir, llm = llava
    params = SamplingParams(temperature=0, max_tokens=16)
    for prompt in ("USER: tell me about the sea. ASSISTANT:", "Once upon a time"):
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert list(got) == hf_llava_greedy(model_dir, prompt, [], 16)


def test_images_are_refused_not_dropped(llava) -> None:
    from PIL import Image
    _, llm = llava
    image = Image.new("RGB", (56, 56))
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "USER: <image> what? ASSISTANT:",
                      "multi_modal_data": {"image": image}}, use_tqdm=False)
    with pytest.raises(ValueError, match="image placeholder"):
        llm.generate("USER: <image> what? ASSISTANT:", use_tqdm=False)
