"""folio loading SmolLM2 from its GGUF file and from a safetensors directory gives the same
logits (compared through prompt logprobs) and the same greedy tokens."""
from __future__ import annotations

import pytest

from folio import LLM, SamplingParams
from folio.model.default_model import default_gguf_path, default_model_path

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return"]


def _run(model: str):
    llm = LLM(model, dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=5, logprobs=5)
    return llm, llm.generate(PROMPTS, params, use_tqdm=False)


@pytest.fixture(scope="module")
def both():
    gguf_llm, from_gguf = _run(default_gguf_path())
    assert gguf_llm.llm_engine.model_source.kind == "gguf"
    dir_llm, from_dir = _run(default_model_path())
    assert dir_llm.llm_engine.model_source.kind == "hf_dir"
    return gguf_llm, from_gguf, from_dir


def test_same_logits_and_tokens(both):
    _, from_gguf, from_dir = both
    for a, b in zip(from_gguf, from_dir):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            for token_id in pa:
                assert abs(pa[token_id].logprob - pb[token_id].logprob) < 1e-5
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for token_id in pa:
                assert abs(pa[token_id].logprob - pb[token_id].logprob) < 1e-5


def test_gguf_tokenizer_and_chat_template(both):
    gguf_llm, _, _ = both
    out = gguf_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert out.outputs[0].text == "The capital of France is Paris."
