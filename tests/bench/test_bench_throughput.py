"""Smoke tests of `folio bench throughput` on a tiny random model: the result fields add up.

No timing assertions: the numbers depend on the machine; only their bookkeeping is checked.
"""
from __future__ import annotations

import argparse
import json
import os

import pytest

from folio.bench import throughput
from folio.bench.datasets import sample_random_requests


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    throughput.add_cli_args(parser)
    return parser.parse_args(argv)


def test_random_requests_are_reproducible_and_in_range() -> None:
    a = sample_random_requests(20, [3, 9], [1, 4], 100, seed=7, exclude_token_ids=range(10))
    b = sample_random_requests(20, [3, 9], [1, 4], 100, seed=7, exclude_token_ids=range(10))
    assert [(r.prompt_token_ids, r.expected_output_len) for r in a] == \
           [(r.prompt_token_ids, r.expected_output_len) for r in b]
    for r in a:
        assert 3 <= r.prompt_len <= 9 and 1 <= r.expected_output_len <= 4
        assert all(10 <= t < 100 for t in r.prompt_token_ids)
    c = sample_random_requests(20, [3, 9], [1, 4], 100, seed=8)
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    with pytest.raises(ValueError):
        sample_random_requests(1, [5, 4], [1, 1], 100)


def test_throughput_counts_add_up(tiny_model_dir, tmp_path) -> None:
    model = tiny_model_dir("llama")
    out_json = tmp_path / "result.json"
    args = _parse(["--model", model, "--num-prompts", "5", "--input-len-range", "4", "12",
                   "--output-len-range", "2", "6", "--seed", "3", "--no-tqdm",
                   "--num-gpu-blocks-override", "64", "--peer", "transformers",
                   "--peer-batch-size", "2", "--output-json", str(out_json)])
    report = throughput.run(args)

    requests = sample_random_requests(5, [4, 12], [2, 6], 49152, seed=3)
    wanted_out = sum(r.expected_output_len for r in requests)
    wanted_prompt = sum(r.prompt_len for r in requests)

    folio, peer = report["engines"]
    assert folio["engine"] == "folio" and folio["error"] is None
    assert folio["num_requests"] == 5
    # ignore_eos: every request makes exactly the tokens it asked for.
    assert folio["output_tokens"] == wanted_out
    assert folio["prompt_tokens"] == wanted_prompt
    assert report["total_num_tokens"] == wanted_prompt + wanted_out
    assert folio["elapsed_s"] > 0 and folio["peak_rss_bytes"] > 0
    assert folio["output_tokens_per_s"] == pytest.approx(wanted_out / folio["elapsed_s"])

    # The peer ran the same requests; padding waste is computed but not counted as output.
    assert peer["engine"] == "transformers" and peer["error"] is None, peer["error"]
    assert peer["num_requests"] == 5
    assert peer["prompt_tokens"] == wanted_prompt
    assert peer["output_tokens"] == wanted_out
    assert peer["generated_tokens"] >= wanted_out
    assert peer["generated_tokens"] - wanted_out == peer["extra"]["padding_waste_tokens"]
    assert peer["peak_rss_bytes"] > 0 and peer["folio_over_this"] > 0

    assert json.loads(out_json.read_text())["total_num_tokens"] == wanted_prompt + wanted_out


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="--config"):
        throughput.run(_parse(["--random-weights"]))
    with pytest.raises(ValueError, match="--peer none"):
        throughput.run(_parse(["--peer", "none", "transformers"]))


def test_random_weights_model_has_the_real_shapes(smollm2_tokenizer, tmp_path) -> None:
    """qwen3-0.6b's shapes, cut to 1 layer (the test-only override) to stay small."""
    from transformers import AutoConfig
    path = throughput.build_random_model("qwen3-0.6b", str(tmp_path / "qwen3"), num_layers=1)
    config = AutoConfig.from_pretrained(path)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == \
           (1024, 16, 8, 128, 3072, 151936)
    assert config.num_hidden_layers == 1 and config.tie_word_embeddings
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    # Built once: a second call reuses the directory.
    assert throughput.build_random_model("qwen3-0.6b", path, num_layers=1) == path
