"""A LLaVA-style model on a CUDA GPU (issue 24): images through the engine match transformers;
the start-up memory profile runs the vision encoder at its largest image batch; a KV budget
that comes out at nothing fails at start-up with a message saying how much is missing and
which flags change it. Skipped without a GPU; run through the device tool
(tools/device_issue24.sh)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "multimodal"))

from llava_utils import build_tiny_llava, hf_llava_greedy  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llava(str(tmp_path_factory.mktemp("llava_gpu")),
                            tokenizer=os.environ.get("FOLIO_RANDOM_TOKENIZER"))


def _image(seed: int, size=(64, 48)):
    import random

    from PIL import Image
    rng = random.Random(seed)
    return Image.frombytes("RGB", size, bytes(rng.randrange(256)
                                               for _ in range(size[0] * size[1] * 3)))


def test_images_on_cuda_match_transformers_and_the_encoder_is_profiled(model_dir) -> None:
    from folio import LLM, SamplingParams
    from folio.worker.image_embeds import max_encoder_tokens
    llm = LLM(model_dir, dtype="float32", device="cuda", max_model_len=256,
              gpu_memory_utilization=0.5, limit_mm_per_prompt={"image": 2})
    try:
        worker = llm.llm_engine.engine_core.executor.worker
        tokens, peak = worker.encoder_profile
        sched = llm.llm_engine.config.scheduler
        assert tokens == max_encoder_tokens(sched.max_num_batched_tokens,
                                            worker.vision_encoder.largest_image_tokens, 2,
                                            sched.max_num_seqs)
        assert peak > 0
        a, b = _image(1), _image(2, (30, 90))
        cases = [("USER: <image> what is this? ASSISTANT:", [a]),
                 ("USER: <image> and <image>? ASSISTANT:", [a, b])]
        outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im}} for p, im in cases],
                            SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        for (prompt, imgs), out in zip(cases, outs):
            assert list(out.outputs[0].token_ids) == hf_llava_greedy(model_dir, prompt, imgs, 12)
    finally:
        llm.llm_engine.shutdown()


def test_a_kv_budget_of_nothing_fails_at_start_up(model_dir) -> None:
    from folio import LLM
    with pytest.raises(Exception) as info:
        LLM(model_dir, dtype="float32", device="cuda", max_model_len=256,
            gpu_memory_utilization=0.001)
    message = str(info.value)
    assert "missing" in message and "GiB" in message, message
    assert "--gpu-memory-utilization" in message and "vision encoder" in message, message


def test_qwen2_vl_on_cuda_matches_transformers(tmp_path) -> None:
    """Qwen2-VL on CUDA: prompts with images and a video run eagerly (M-RoPE's three
    position rows), their decode steps replay CUDA graphs with the requests' position
    offsets; greedy answers equal transformers' (CPU, float32)."""
    from folio import LLM, SamplingParams
    from qwen2vl_utils import (IMAGE, VIDEO, build_tiny_qwen2_vl, hf_qwen2_vl_greedy,
                               hf_qwen2_vl_video_greedy, random_image)
    model_dir = build_tiny_qwen2_vl(str(tmp_path / "qwen2vl"),
                                    tokenizer=os.environ.get("FOLIO_RANDOM_TOKENIZER"))
    llm = LLM(model_dir, dtype="float32", device="cuda", max_model_len=384,
              gpu_memory_utilization=0.3)
    try:
        a, b = random_image(1, (90, 60)), random_image(2, (50, 130))
        frames = [random_image(10 + i, (84, 56)) for i in range(4)]
        cases = [(f"Look {IMAGE} what is it?", {"image": [a]}),
                 (f"Compare {IMAGE} and {IMAGE} now", {"image": [a, b]}),
                 (f"Watch {VIDEO} what happens?", {"video": frames})]
        outs = llm.generate([{"prompt": p, "multi_modal_data": d} for p, d in cases]
                            + ["Once upon a time"],
                            SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        for (prompt, data), out in zip(cases, outs):
            expected = (hf_qwen2_vl_video_greedy(model_dir, prompt, data["video"], 24)
                        if "video" in data else
                        hf_qwen2_vl_greedy(model_dir, prompt, data["image"], 24))
            assert list(out.outputs[0].token_ids) == expected, prompt
        assert list(outs[3].outputs[0].token_ids) == hf_qwen2_vl_greedy(
            model_dir, "Once upon a time", [], 24)
    finally:
        llm.llm_engine.shutdown()
