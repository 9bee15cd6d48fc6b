"""Bad input gets a clear ValueError naming the problem, and the engine goes on serving."""
from __future__ import annotations

import os
import shutil

import pytest

from folio import LLM, SamplingParams
from folio.model.default_model import default_model_path


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=128, num_gpu_blocks_override=64, dtype="float32")


def _still_serves(llm: LLM) -> None:
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    pool = llm.llm_engine.engine_core.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt must not be empty"),
    ({"prompt_token_ids": []}, "prompt must not be empty"),
    ({"prompt_token_ids": [1, 2, 10**9]}, "outside the vocabulary"),
    ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
    ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
    ({"text": "no prompt key"}, "prompt"),
    (12345, "prompt must be"),
    ("word " * 200, "max_model_len"),
])
def test_bad_prompts(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    _still_serves(llm)


def test_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(["fine", {"prompt_token_ids": [10**9]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    _still_serves(llm)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens="ten"), "max_tokens"),
    (dict(n=0), "n"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=-2), "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={10**9: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[10**9]), "allowed_token_ids"),
    (dict(stop_token_ids=[10**9]), "stop_token_ids"),
])
def test_token_ids_checked_against_vocab(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(["Hi"], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    _still_serves(llm)


def test_bad_request_beside_running_ones(llm):
    """Through the streaming interface: a bad request fails alone; running ones finish."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("good-1", "The weather today", params)
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request("bad", {"prompt_token_ids": [10**9]}, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good-1", "again", params)
    engine.add_request("good-2", "Another request", params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"good-1", "good-2"}
    assert all(len(o.outputs[0].token_ids) == 6 for o in finished.values())


def test_unknown_model_path():
    with pytest.raises(ValueError, match="not found"):
        LLM("/no/such/model/dir")


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(tmp_path))


def test_corrupt_weight_file(tmp_path):
    src = default_model_path()
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(dst), max_model_len=128, num_gpu_blocks_override=16)


def test_corrupt_gguf_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(1000))
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(str(bad))


def test_engine_config_errors():
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=3)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(max_model_len=10**7)
    with pytest.raises(ValueError, match="KV cache"):
        LLM(max_model_len=1024, num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(scheduling_policy="random")
