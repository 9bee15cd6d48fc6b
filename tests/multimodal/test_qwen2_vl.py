"""Qwen2-VL through the engine (issue 24): its processor (without torchvision) equals
transformers' Qwen2VLProcessor on 20 generated images of different sizes and aspect ratios;
its vision transformer and M-RoPE positions equal transformers'; greedy answers with no
image, one, two, batched with text, across prefill chunks, and through LLM.chat equal
transformers' Qwen2VLForConditionalGeneration (float32, CPU, prefix caching on)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from folio import LLM, SamplingParams

from qwen2vl_utils import (IMAGE, MAX_PIXELS, build_tiny_qwen2_vl, hf_qwen2_vl_greedy,
                           random_image)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_qwen2_vl(str(tmp_path_factory.mktemp("tiny_qwen2_vl")))


@pytest.fixture(scope="module")
def llm(model_dir):
    engine = LLM(model_dir, dtype="float32", device="cpu", max_model_len=384)
    yield engine
    engine.llm_engine.shutdown()


def _hf_processor(model_dir: str):
    """transformers' Qwen2VLProcessor, made without its video processor (whose loading needs
    torchvision): the reference for images."""
    from transformers import AutoTokenizer, Qwen2VLProcessor
    try:
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import Qwen2VLImageProcessor as ImageProcessor
    tok = AutoTokenizer.from_pretrained(model_dir)
    processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    processor.tokenizer = tok
    processor.image_processor = ImageProcessor.from_pretrained(model_dir)
    processor.video_processor = None
    processor.chat_template = None
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tok.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = tok.convert_tokens_to_ids("<|video_pad|>")
    return processor


def test_preprocessing_matches_the_hf_processor(model_dir) -> None:
    from transformers import AutoConfig

    from folio.multimodal.processing import ImagePromptProcessor
    image_token = AutoConfig.from_pretrained(model_dir).image_token_id
    ours = ImagePromptProcessor.from_pretrained(model_dir, image_token, 2, kind="qwen2_vl")
    reference = _hf_processor(model_dir)
    rng = np.random.default_rng(3)
    sizes = [(int(w), int(h)) for w, h in rng.integers(20, 400, size=(20, 2))]
    sizes[:3] = [(1000, 30), (30, 700), (28, 28)]          # extreme aspect ratios, tiny
    for i, size in enumerate(sizes):
        image = random_image(i, size)
        prompt = f"a {IMAGE} b"
        ids, [entry] = ours.process(prompt, [image])
        ref = reference(text=[prompt], images=[image], return_tensors="np")
        assert ids == ref["input_ids"][0].tolist(), size
        assert list(entry.grid_thw) == ref["image_grid_thw"][0].tolist(), size
        assert entry.length == int(ref["image_grid_thw"][0].prod()) // 4
        assert entry.length == ids.count(image_token)
        np.testing.assert_array_equal(entry.pixel_values, ref["pixel_values"])
        # the token-id path (a chat template's ids) expands to the same
        tokens = reference.tokenizer(prompt)["input_ids"]
        assert ours.process_tokens(tokens, [image])[0] == ids


def test_vision_encoder_and_positions_match_transformers(model_dir) -> None:
    from safetensors.torch import load_file
    from transformers import Qwen2VLForConditionalGeneration

    from folio.model.vision.qwen2_vision import (Qwen2VisionEncoder, Qwen2VisionSpec,
                                                 load_qwen2_vision)
    from folio.model.mrope import mrope_positions
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir,
                                                            dtype=torch.float32).eval()
    encoder = Qwen2VisionEncoder(Qwen2VisionSpec.from_hf(model.config.vision_config)).eval()
    assert load_qwen2_vision(encoder, load_file(f"{model_dir}/model.safetensors").items()) == []
    processor = _hf_processor(model_dir)
    images = [random_image(1, (90, 60)), random_image(2, (50, 130))]
    prompt = f"x {IMAGE} y z {IMAGE} w"
    inputs = processor(text=[prompt], images=images, return_tensors="pt")
    with torch.no_grad():
        ref = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"],
                                             return_dict=True).pooler_output
    ref = torch.cat(list(ref)) if isinstance(ref, (list, tuple)) else ref
    got = encoder(inputs["pixel_values"], inputs["image_grid_thw"].tolist())
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    ids = inputs["input_ids"][0].tolist()
    runs, start = [], None
    image_id = processor.image_token_id
    for i, t in enumerate(ids + [-1]):
        if t == image_id and start is None:
            start = i
        elif t != image_id and start is not None:
            runs.append((start, i - start))
            start = None
    positions, delta = mrope_positions(
        len(ids), [(o, n, g) for (o, n), g in zip(runs, inputs["image_grid_thw"].tolist())], 2)
    ref_positions, ref_delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    np.testing.assert_array_equal(positions, ref_positions[:, 0].numpy())
    assert delta == int(ref_delta)


def test_greedy_answers_match_transformers(model_dir, llm) -> None:
    a, b, c = random_image(1, (90, 60)), random_image(2, (50, 130)), random_image(3, (64, 64))
    params = SamplingParams(temperature=0, max_tokens=32)
    cases = [(f"Look {IMAGE} what is it?", [a]),
             (f"Look {IMAGE} what is it?", [c]),
             (f"Compare {IMAGE} and {IMAGE} now", [a, b])]
    prompts = [{"prompt": p, "multi_modal_data": {"image": ims}} for p, ims in cases]
    outs = llm.generate(prompts + ["Once upon a time"], params, use_tqdm=False)
    for (prompt, images), out in zip(cases, outs):
        assert list(out.outputs[0].token_ids) == hf_qwen2_vl_greedy(model_dir, prompt,
                                                                     images, 32)
    assert list(outs[3].outputs[0].token_ids) == hf_qwen2_vl_greedy(
        model_dir, "Once upon a time", [], 32)
    # the same text with another image shares no KV: another answer
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
    # again (prefix cache and encoder cache warm): the same answer, no encoder pass
    runner = llm.llm_engine.engine_core.executor.worker.runner
    encoded = runner.images.num_encoded
    again = llm.generate(prompts[0], params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert runner.images.num_encoded == encoded


def test_chat_and_prefill_chunks_match_transformers(model_dir, llm) -> None:
    from folio.engine.chat import render_chat
    image = random_image(4, (120, 80))
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                         {"type": "text", "text": "Describe it."}]}]
    out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    text = render_chat(llm.get_tokenizer(), chat, image_placeholder=IMAGE).text
    assert IMAGE in text
    assert list(out.outputs[0].token_ids) == hf_qwen2_vl_greedy(
        model_dir, text, [image], 12, add_special_tokens=False)
    # an image's tokens split over prefill chunks of 8 tokens: the positions of each chunk
    # from the image's grid, its features sliced
    small = LLM(model_dir, dtype="float32", device="cpu", max_model_len=384,
                max_num_batched_tokens=8, max_num_seqs=2)
    try:
        prompt = f"Look {IMAGE} what is it?"
        got = small.generate({"prompt": prompt, "multi_modal_data": {"image": image}},
                             SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
        assert list(got.outputs[0].token_ids) == hf_qwen2_vl_greedy(model_dir, prompt,
                                                                     [image], 10)
    finally:
        small.llm_engine.shutdown()


def test_max_pixels_from_mm_processor_kwargs(model_dir) -> None:
    from transformers import AutoConfig

    from folio.multimodal.processing import ImagePromptProcessor
    image_token = AutoConfig.from_pretrained(model_dir).image_token_id
    image = random_image(5, (300, 200))
    default = ImagePromptProcessor.from_pretrained(model_dir, image_token, kind="qwen2_vl")
    small = ImagePromptProcessor.from_pretrained(model_dir, image_token, kind="qwen2_vl",
                                                 processor_kwargs={"max_pixels": 28 * 28 * 8})
    [big] = default.process(f"{IMAGE}", [image])[1]
    [few] = small.process(f"{IMAGE}", [image])[1]
    assert big.length <= MAX_PIXELS // (28 * 28) and few.length <= 8 < big.length
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        ImagePromptProcessor.from_pretrained(model_dir, image_token, kind="qwen2_vl",
                                             processor_kwargs={"max_pixelz": 1})


def test_qwen2_5_vl_window_attention_and_answers_match_transformers(tmp_path) -> None:
    """Qwen2.5-VL: the vision transformer with window attention (edge windows included:
    grids whose merged sides are not multiples of the window) equals transformers', and so
    do greedy answers with one and two images."""
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    from folio.model.vision.qwen2_vision import (Qwen2VisionEncoder, Qwen2VisionSpec,
                                                 load_qwen2_vision)
    from qwen2vl_utils import build_tiny_qwen2_5_vl
    model_dir = build_tiny_qwen2_5_vl(str(tmp_path / "tiny_qwen2_5_vl"))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir,
                                                               dtype=torch.float32).eval()
    spec = Qwen2VisionSpec.from_hf(model.config.vision_config)
    assert spec.qwen2_5 and spec.fullatt_block_indexes == (1,)
    encoder = Qwen2VisionEncoder(spec).eval()
    assert load_qwen2_vision(encoder, load_file(f"{model_dir}/model.safetensors").items()) == []
    processor = _hf_processor(model_dir)
    images = [random_image(1, (170, 120)), random_image(2, (90, 250)), random_image(3, (60, 60))]
    pixels = processor.image_processor(images=images, return_tensors="pt")
    grids = pixels["image_grid_thw"]
    assert any((g[1] // 2) % 2 or (g[2] // 2) % 2 for g in grids.tolist())   # edge windows
    with torch.no_grad():
        ref = model.model.get_image_features(pixels["pixel_values"], grids,
                                             return_dict=True).pooler_output
    ref = torch.cat(list(ref)) if isinstance(ref, (list, tuple)) else ref
    torch.testing.assert_close(encoder(pixels["pixel_values"], grids.tolist()), ref,
                               rtol=1e-5, atol=1e-5)
    llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=384)
    try:
        params = SamplingParams(temperature=0, max_tokens=12)
        cases = [(f"Look {IMAGE} what?", images[:1]), (f"C {IMAGE} and {IMAGE} now", images[1:])]
        outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": ims}}
                             for p, ims in cases], params, use_tqdm=False)
        for (prompt, ims), out in zip(cases, outs):
            assert list(out.outputs[0].token_ids) == hf_qwen2_vl_greedy(model_dir, prompt,
                                                                         ims, 12)
    finally:
        llm.llm_engine.shutdown()


def test_video_frames_match_transformers(model_dir, llm, tmp_path) -> None:
    """A video as a list of frames (an odd count: the last repeated to fill the pair), alone
    and beside an image: the answers equal transformers' on the same patches; a video where
    the model takes none, or a video placeholder without frames, is refused."""
    from qwen2vl_utils import VIDEO, build_tiny_qwen2_5_vl, hf_qwen2_vl_video_greedy
    frames = [random_image(10 + i, (84, 56)) for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12)
    prompt = f"Watch {VIDEO} what happens?"
    got = llm.generate({"prompt": prompt, "multi_modal_data": {"video": frames}}, params,
                       use_tqdm=False)[0]
    assert list(got.outputs[0].token_ids) == hf_qwen2_vl_video_greedy(model_dir, prompt,
                                                                       frames, 12)
    with pytest.raises(ValueError, match="video placeholder"):
        llm.generate(prompt, params, use_tqdm=False)
    with pytest.raises(ValueError, match="video"):
        llm.generate({"prompt": f"{VIDEO}", "multi_modal_data": {"video": [frames, frames]}},
                     params, use_tqdm=False)
    # Qwen2.5-VL: frame pairs spaced in M-RoPE time by tokens_per_second
    model25 = build_tiny_qwen2_5_vl(str(tmp_path / "tiny_qwen2_5_vl_video"))
    llm25 = LLM(model25, dtype="float32", device="cpu", max_model_len=384)
    try:
        got = llm25.generate({"prompt": prompt, "multi_modal_data": {"video": frames}}, params,
                             use_tqdm=False)[0]
        assert list(got.outputs[0].token_ids) == hf_qwen2_vl_video_greedy(model25, prompt,
                                                                           frames, 12)
    finally:
        llm25.llm_engine.shutdown()
