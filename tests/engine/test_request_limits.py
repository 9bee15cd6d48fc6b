"""Request limits (RequestLimitsConfig), checked before tokenization and fan-out: each a
ValueError whose message starts with the field's name."""
from __future__ import annotations

import pytest

from folio import LLM, SamplingParams, StructuredOutputsParams
from folio.config import RequestLimitsConfig
from folio.engine.request_limits import (check_kv_fit, check_sampling_limits,
                                         json_depth_exceeds)

LIMITS = RequestLimitsConfig()


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("kwargs,field", [
    ({"n": 129, "temperature": 1.0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"stop": ["x"] * 65}, "stop"),
    ({"stop": ["x" * 513]}, "stop"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
    ({"allowed_token_ids": list(range(4097))}, "allowed_token_ids"),
    ({"stop_token_ids": list(range(4097))}, "stop_token_ids"),
    ({"bad_words": ["w"] * 257}, "bad_words"),
    ({"bad_words": ["w" * 513]}, "bad_words"),
    ({"structured_outputs": StructuredOutputsParams(json=_nested(40))}, "structured_outputs"),
    ({"structured_outputs": StructuredOutputsParams(regex="a" * (1 << 20 | 1))},
     "structured_outputs"),
])
def test_each_limit_names_its_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        check_sampling_limits(SamplingParams(**kwargs), LIMITS)
    assert str(info.value).startswith(field), info.value


def test_at_the_limits_passes():
    check_sampling_limits(SamplingParams(
        n=128, temperature=1.0, logprobs=20, prompt_logprobs=20, stop=["x" * 512] * 64,
        logit_bias={i: 1.0 for i in range(1024)}, allowed_token_ids=list(range(4096)),
        bad_words=["w" * 512] * 256,
        structured_outputs=StructuredOutputsParams(json=_nested(30))), LIMITS)
    check_sampling_limits(SamplingParams(logprobs=-1),
                          RequestLimitsConfig(max_logprobs=-1))  # -1: no limit


def test_json_depth():
    value = {"a": [1, {"b": []}]}  # dict, list, dict, list: 4 levels
    assert not json_depth_exceeds(value, 4)
    assert json_depth_exceeds(value, 3)
    assert not json_depth_exceeds(5, 0)
    deep: list = []
    for _ in range(100_000):  # iterative: no RecursionError
        deep = [deep]
    assert json_depth_exceeds(deep, 64)


def test_kv_fit():
    p = SamplingParams(n=4, temperature=1.0, max_tokens=100)
    check_kv_fit(50, p, 512, 600)  # 4 x 150 = 600 fits
    with pytest.raises(ValueError, match=r"^n=4 sequences"):
        check_kv_fit(51, p, 512, 600)
    check_kv_fit(500, SamplingParams(max_tokens=None), 512, 16)  # n=1 always fits
    with pytest.raises(ValueError, match=r"^n=2"):  # max_tokens None: the rest of the context
        check_kv_fit(10, SamplingParams(n=2, temperature=1.0, max_tokens=None), 512, 1000)


def test_limits_config_validates():
    with pytest.raises(ValueError, match="^max_n"):
        RequestLimitsConfig(max_n=0)
    with pytest.raises(ValueError, match="^max_schema_depth"):
        RequestLimitsConfig(max_schema_depth=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), max_model_len=128, num_gpu_blocks_override=32,
               dtype="float32", max_logprobs=5)


def test_offline_limits_before_anything_is_queued(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"^n must be at most 128"):
        llm.generate("hi", SamplingParams(n=100_000_000, temperature=1.0), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^logprobs must be at most 5"):
        llm.generate("hi", SamplingParams(logprobs=6), use_tqdm=False)
    # 32 blocks x 16 = 512 tokens: 8 x (prompt + 100) cannot be held at once.
    with pytest.raises(ValueError, match=r"^n=8 sequences"):
        llm.generate("hi", SamplingParams(n=8, temperature=1.0, max_tokens=100), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt is longer than max_model_len"):
        llm.generate("word " * 5000, SamplingParams(max_tokens=1), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    out = llm.generate("hi", SamplingParams(max_tokens=3, logprobs=5, temperature=0),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and all(len(p) >= 5 for p in out.logprobs)


def test_child_seeds_wrap_in_int64(llm):
    out = llm.generate("hi", SamplingParams(n=3, temperature=1.0, seed=2**63 - 1, max_tokens=2),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3
