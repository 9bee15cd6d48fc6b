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
    params = SamplingParams(temperature=0, max_tokens=32)
    cases = [("USER: <image> what is this? ASSISTANT:", [a]),
             ("USER: <image> what is this? ASSISTANT:", [c]),
             ("USER: <image> and <image>, compare. ASSISTANT:", [a, b])]
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": imgs}} for p, imgs in cases]
                        + ["Once upon a time"], params, use_tqdm=False)
    for (prompt, imgs), out in zip(cases, outs):
        assert list(out.outputs[0].token_ids) == hf_llava_greedy(model_dir, prompt, imgs, 32)
    assert list(outs[3].outputs[0].token_ids) == hf_llava_greedy(model_dir, "Once upon a time",
                                                                 [], 32)
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


def test_chat_with_images_matches_transformers(llava, tmp_path) -> None:
    """LLM.chat with image parts (a PIL image, a data: URL, a file: URL under the allowed
    directory): the template's <image> expanded to the image's tokens, the answer equal to
    transformers' on the rendered prompt; file: URLs elsewhere, and more images than the
    limit, refused."""
    import base64
    import io

    from PIL import Image

    from folio.engine.chat import render_chat
    model_dir, llm = llava
    image = Image.frombytes("RGB", (50, 70), bytes(range(250)) * 42)
    png = io.BytesIO()
    image.save(png, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    question = {"type": "text", "text": "What is it?"}
    params = SamplingParams(temperature=0, max_tokens=10)
    by_pil = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                           question]}]
    by_url = [{"role": "user", "content": [{"type": "image_url",
                                            "image_url": {"url": data_url}}, question]}]
    outs = llm.chat([by_pil, by_url], params, use_tqdm=False)
    text = render_chat(llm.get_tokenizer(), by_pil, image_placeholder="<image>").text
    expected = hf_llava_greedy(model_dir, text, [image], 10)
    assert [list(o.outputs[0].token_ids) for o in outs] == [expected, expected]
    (tmp_path / "pic.png").write_bytes(png.getvalue())
    by_file = [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": (tmp_path / "pic.png").as_uri()}}, question]}]
    with pytest.raises(ValueError, match="allowed-local-media-path"):
        llm.chat(by_file, params, use_tqdm=False)
    five = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}] * 5}]
    with pytest.raises(ValueError, match="limit-mm-per-prompt"):
        llm.chat(five, params, use_tqdm=False)


def test_a_steps_new_images_are_encoded_in_one_batch(llava) -> None:
    from PIL import Image
    model_dir, llm = llava
    runner = llm.llm_engine.engine_core.executor.worker.runner
    images = [Image.frombytes("RGB", (40 + i, 40), bytes([i * 30 + 7]) * (40 + i) * 120)
              for i in range(3)]
    passes, encoded = runner.images.num_passes, runner.images.num_encoded
    prompt = "USER: <image> what is this? ASSISTANT:"
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": im}} for im in images],
                        SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert runner.images.num_encoded - encoded == 3
    assert runner.images.num_passes - passes == 1
    for image, out in zip(images, outs):
        assert list(out.outputs[0].token_ids) == hf_llava_greedy(model_dir, prompt, [image], 4)


def test_limits_and_processor_settings(llava, tmp_path) -> None:
    """--limit-mm-per-prompt and --mm-processor-kwargs offline; a file: URL inside
    allowed_local_media_path is read."""

    from PIL import Image
    model_dir, _ = llava
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        LLM(model_dir, dtype="float32", device="cpu", max_model_len=256,
            mm_processor_kwargs={"no_such_setting": 1})
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        LLM(model_dir, dtype="float32", device="cpu", limit_mm_per_prompt={"image": -1})
    image = Image.frombytes("RGB", (30, 30), bytes(range(90)) * 30)
    (tmp_path / "pic.png").write_bytes(_png_bytes(image))
    llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=256,
              limit_mm_per_prompt={"image": 1}, mm_processor_kwargs={"do_normalize": False},
              allowed_local_media_path=str(tmp_path))
    try:
        two = {"prompt": "<image> <image>", "multi_modal_data": {"image": [image, image]}}
        with pytest.raises(ValueError, match="1 allowed"):
            llm.generate(two, use_tqdm=False)
        chat = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": (tmp_path / "pic.png").as_uri()}},
            {"type": "text", "text": "hi"}]}]
        out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
        # the reference: transformers with the processor's normalization off
        import torch
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        from folio.engine.chat import render_chat
        text = render_chat(llm.get_tokenizer(), chat, image_placeholder="<image>").text
        processor = AutoProcessor.from_pretrained(model_dir)
        model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
        inputs = processor(text=[text], images=[image], return_tensors="pt", do_normalize=False)
        with torch.no_grad():
            ref = model.generate(**inputs, max_new_tokens=6, do_sample=False)
        assert list(out.outputs[0].token_ids) == ref[0, inputs["input_ids"].shape[1]:].tolist()
    finally:
        llm.llm_engine.shutdown()


def _png_bytes(image) -> bytes:
    import io
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
