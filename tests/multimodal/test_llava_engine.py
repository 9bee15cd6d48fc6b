"""A LLaVA-1.5-style model through the engine (issue 24): its text config and decoder weights
read from the vision-language checkpoint, its CLIP tower and projector beside them; prompts
with images processed by the model's own processor, the image features written over the
placeholder tokens' embeddings. Greedy answers equal transformers' LlavaForConditionalGeneration
with no image, one, two, in a batch with text, across prefill chunks; the encoder-output cache
serves a seen image; malformed image prompts are refused with a clear error."""
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


def test_bad_image_prompts_are_refused(llava) -> None:
    from PIL import Image
    _, llm = llava
    image = Image.new("RGB", (56, 56))
    with pytest.raises(ValueError, match="image placeholder"):
        llm.generate("USER: <image> what? ASSISTANT:", use_tqdm=False)
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt": "USER: what? ASSISTANT:", "multi_modal_data": {"image": image}},
                     use_tqdm=False)
    with pytest.raises(ValueError, match="PIL"):
        llm.generate({"prompt": "USER: <image> ASSISTANT:",
                      "multi_modal_data": {"image": "http://x/y.png"}}, use_tqdm=False)
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"video": [image]}},
                     use_tqdm=False)


def test_images_match_transformers(llava) -> None:
    """One image, two images, and the same text with another image (prefix caching on: the
    images key the blocks, so no KV is shared across images), each greedy-equal to
    transformers; a later request with a seen image is not encoded again."""
    import random

    from PIL import Image
    model_dir, llm = llava

    def image(seed, size):
        rng = random.Random(seed)
        data = bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3))
        return Image.frombytes("RGB", size, data)
    a, b, c = image(1, (90, 60)), image(2, (40, 120)), image(3, (56, 56))
    params = SamplingParams(temperature=0, max_tokens=12)
    cases = [("USER: <image> what is this? ASSISTANT:", [a]),
             ("USER: <image> what is this? ASSISTANT:", [c]),
             ("USER: <image> and <image>, compare. ASSISTANT:", [a, b])]
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": imgs}} for p, imgs in cases]
                        + ["Once upon a time"], params, use_tqdm=False)
    for (prompt, imgs), out in zip(cases, outs):
        assert list(out.outputs[0].token_ids) == hf_llava_greedy(model_dir, prompt, imgs, 12)
    assert list(outs[3].outputs[0].token_ids) == hf_llava_greedy(model_dir, "Once upon a time",
                                                                 [], 12)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
    runner = llm.llm_engine.engine_core.executor.worker.runner
    encoded = runner.images.num_encoded
    again = llm.generate({"prompt": cases[0][0], "multi_modal_data": {"image": a}}, params,
                         use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert runner.images.num_encoded == encoded       # from the encoder cache


def test_an_image_split_over_prefill_chunks(llava) -> None:
    """Chunked prefill with a budget smaller than an image's tokens: each chunk takes its
    slice of the image's features (encoded once)."""
    from PIL import Image
    model_dir, _ = llava
    small = LLM(model_dir, dtype="float32", device="cpu", max_model_len=256,
                max_num_batched_tokens=8, max_num_seqs=2)
    image = Image.frombytes("RGB", (64, 48), bytes(range(256)) * 36)
    prompt = "USER: <image> what is this? ASSISTANT:"
    out = small.generate({"prompt": prompt, "multi_modal_data": {"image": image}},
                         SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_llava_greedy(model_dir, prompt, [image], 8)
    assert small.llm_engine.engine_core.executor.worker.runner.images.num_encoded == 1
    small.llm_engine.shutdown()
