"""`folio bench latency` on a tiny random model, and the roofline's byte accounting.

No timing assertions beyond positivity: the numbers depend on the machine; only their
bookkeeping (counts, ordering of percentiles, derived rates) is checked.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os

import pytest

from folio.bench import latency, roofline
from folio.bench.random_model import RANDOM_CONFIGS

# A config small enough to count by hand (see test_decode_bytes_by_hand).
_HAND_CONFIG = dict(model_type="llama", hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=10,
                    tie_word_embeddings=False)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    latency.add_cli_args(parser)
    return parser.parse_args(argv)


def test_decode_bytes_by_hand() -> None:
    # Per layer: q 8*8=64, k and v 8*4=32 each, o 8*8=64 -> 192; MLP 3*8*16=384; 2 norms 16.
    per_layer = 192 + 384 + 16
    params = 2 * per_layer + 10 * 8 + 10 * 8 + 8      # layers, embed, untied lm_head, final norm
    assert params == 1352
    assert roofline.count_params(_HAND_CONFIG) == params
    # KV per token: 2 layers * 1 kv head * head_dim 4 * (K and V) * 2 bytes = 32.
    assert roofline.kv_bytes_per_token(_HAND_CONFIG, 2) == 32
    assert roofline.decode_bytes_per_step(_HAND_CONFIG, batch=3, context_len=5,
                                          dtype_bytes=2) == 1352 * 2 + 3 * 5 * 32
    # A tied lm_head is the embedding: read once.
    tied = {**_HAND_CONFIG, "tie_word_embeddings": True}
    assert roofline.count_params(tied) == params - 80
    assert roofline.decode_bytes_per_step(tied, batch=1, context_len=0, dtype_bytes=2) == 1272 * 2
    # Prefill of 2 prompts of 5 tokens: 2 FLOPs per layer weight per token (576 weights in a
    # layer's matmuls), causal attention 2*heads*head_dim*n^2 per layer, one LM-head row.
    linear = 2 * 576 * 2 * 5
    attention = 2 * 2 * 4 * 5 * 5 * 2
    assert roofline.prefill_flops(_HAND_CONFIG, batch=2, prompt_len=5) == \
        2 * (linear + attention + 2 * 8 * 10)


def test_param_counts_match_reference_script() -> None:
    # The reference script (shared/tools/roofline.py) uses 0.596e9 and 8.03e9 parameters.
    assert roofline.count_params(RANDOM_CONFIGS["qwen3-0.6b"]) == pytest.approx(0.596e9, rel=1e-3)
    assert roofline.count_params(RANDOM_CONFIGS["llama3-8b"]) == pytest.approx(8.03e9, rel=1e-3)
    # 28 layers * 8 kv heads * 128 * 2 * 2 bytes.
    assert roofline.kv_bytes_per_token(RANDOM_CONFIGS["qwen3-0.6b"]) == 28 * 8 * 128 * 2 * 2


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_param_count_matches_checkpoint(tiny_model_dir, arch: str) -> None:
    """The analytic count equals the tensors actually stored (biases, q/k norms, tying)."""
    from safetensors import safe_open
    model = tiny_model_dir(arch)
    stored = 0
    for file in glob.glob(os.path.join(model, "*.safetensors")):
        with safe_open(file, "pt") as f:
            stored += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert roofline.count_params(roofline.load_config(model)) == stored
    # A model directory works directly as the argument.
    assert roofline.decode_bytes_per_step(model, 1, 0, 4) == stored * 4


def test_measured_roofs_are_positive() -> None:
    assert roofline.measure_copy_bandwidth("cpu", nbytes=16 << 20, iters=3) > 0
    assert roofline.matmul_peak_flops("cpu", n=128, iters=2) > 0
    line = roofline.roofline_line(0.001, 50e9, 0.004)
    assert line == "roofline: 1.000 ms/token at 50.0 GB/s measured → achieved 25.0% of roofline"


def test_the_roof_is_the_better_of_the_probes_before_and_after_the_engine(monkeypatch) -> None:
    """The bench probes the copy bandwidth before its engine starts (on a GPU) and after it
    is gone, and takes the better: a probe can read low (2.62 against 3.03 TB/s on an H100),
    never above what the card allows. No probe before an engine on the CPU."""
    assert roofline.copy_bandwidth_before_engine({"device": "cpu"}) is None
    # an engine outside this process: no CUDA context here beside its workers
    assert roofline.copy_bandwidth_before_engine({"tensor_parallel_size": 2}) is None
    assert roofline.copy_bandwidth_before_engine(
        {"distributed_executor_backend": "ray"}) is None
    monkeypatch.setattr(roofline, "measure_copy_bandwidth", lambda device: 2.62e12)
    assert roofline.best_copy_bandwidth("cuda", 3.03e12) == 3.03e12
    assert roofline.best_copy_bandwidth("cuda", 2.0e12) == 2.62e12
    assert roofline.best_copy_bandwidth("cpu", None) == 2.62e12


def test_latency_bench_fields(tiny_model_dir, tmp_path) -> None:
    out_json = tmp_path / "latency.json"
    args = _parse(["--model", tiny_model_dir("llama"), "--input-len", "8", "--output-len", "6",
                   "--batch-size", "3", "--num-iters-warmup", "1", "--num-iters", "3",
                   "--num-gpu-blocks-override", "64", "--step-breakdown",
                   "--output-json", str(out_json)])
    report = latency.run(args)

    assert len(report["latencies"]) == 3 and len(report["prefill_latencies"]) == 3
    # ignore_eos: every iteration makes batch * output_len tokens.
    assert report["output_tokens_per_iter"] == [3 * 6] * 3
    assert all(t > 0 for t in report["latencies"] + report["prefill_latencies"])
    assert report["median_latency_s"] == pytest.approx(report["percentiles"]["50"])
    assert min(report["latencies"]) <= report["median_latency_s"] <= report["p90_latency_s"] \
        <= max(report["latencies"])
    per_token = report["median_decode_ms_per_token"]
    assert per_token == pytest.approx(
        (report["median_latency_s"] - report["median_prefill_latency_s"]) / 5 * 1e3)
    assert per_token > 0
    assert report["decode_tokens_per_s_per_seq"] == pytest.approx(1e3 / per_token)

    roof = report["roofline"]
    assert roof is not None and roof["bandwidth_bytes_per_s"] > 0
    assert roof["context_len"] == 8 + 6 // 2
    assert roof["bytes_per_step"] == roofline.decode_bytes_per_step(
        tiny_model_dir("llama"), 3, roof["context_len"], roof["dtype_bytes"])
    assert roof["floor_ms_per_token"] > 0 and "% of roofline" in roof["line"]
    assert json.loads(out_json.read_text())["output_len"] == 6
    prefill = report["prefill_roofline"]
    assert prefill["flops"] == roofline.prefill_flops(tiny_model_dir("llama"), 3, 8)
    assert prefill["matmul_peak_flops_per_s"] > 0 and prefill["fraction_of_peak"] > 0
    assert prefill["achieved_flops_per_s"] == pytest.approx(
        prefill["flops"] / report["median_prefill_latency_s"])

    assert report["quantization"] == "none" and report["kv_cache_dtype"] == "float32"
    assert report["settings"]["engine"]["num_gpu_blocks_override"] == 64
    assert roof["stored_weight_bytes"] is None    # a float model: the formula

    # Start-to-ready, split by the worker's stages; on the CPU there is no profiling or capture.
    startup = report["startup"]
    assert set(startup) == {"total_s", "load_s", "profile_s", "kv_alloc_s", "warm_up_s",
                            "graph_capture_s", "other_s"}
    assert startup["total_s"] > 0 and startup["load_s"] > 0 and startup["kv_alloc_s"] >= 0
    assert startup["profile_s"] == 0.0 and startup["graph_capture_s"] == 0.0
    assert startup["warm_up_s"] == 0.0
    assert startup["other_s"] >= 0
    assert startup["load_s"] + startup["kv_alloc_s"] + startup["other_s"] == \
        pytest.approx(startup["total_s"])
    assert report["random_model"] is None
    assert report["peer"] is None and report["folio_over_peer"] is None

    # The step breakdown: one prefill step and output_len - 1 decode steps (sync on the CPU),
    # its parts adding up to the whole.
    breakdown = report["step_breakdown"]
    assert breakdown["steps"] == 6
    parts = breakdown["parts_ms"]
    assert set(parts) == {"schedule", "launch", "wait", "update", "output"}
    assert all(parts[name] >= 0 for name in ("schedule", "launch", "wait", "update"))
    assert sum(parts.values()) == pytest.approx(breakdown["ms_per_step"])
    assert breakdown["line"].startswith("step breakdown (6 steps)")


def test_latency_peer_transformers(tiny_model_dir, capsys) -> None:
    """The peer replays folio's calls (same prompts and lengths) through static-cache generate
    and reports the same statistics; no --num-iters-warmup still gets the peer one warm-up."""
    args = _parse(["--model", tiny_model_dir("llama"), "--input-len", "8", "--output-len", "5",
                   "--batch-size", "2", "--num-iters-warmup", "0", "--num-iters", "3",
                   "--num-gpu-blocks-override", "64", "--no-roofline", "--peer", "transformers"])
    report = latency.run(args)
    peer = report["peer"]
    assert peer["error"] is None, peer["error"]
    assert peer["engine"] == "transformers" and peer["cache_implementation"] == "static"
    assert peer["torch_compile"] is False and peer["attn_implementation"] == "sdpa"
    assert peer["device"] == report["device"] == "cpu" and peer["dtype"] == report["dtype"]
    # The same calls as folio: 3 timed, 1 prefill warm-up, 3 prefill; plus its own warm-up.
    assert len(peer["latencies"]) == 3 and len(peer["prefill_latencies"]) == 3
    assert len(peer["prefill_warmup_latencies"]) == 1 and len(peer["warmup_latencies"]) == 1
    assert all(t > 0 for t in peer["latencies"] + peer["prefill_latencies"])
    assert peer["load_s"] > 0 and peer["peak_rss_bytes"] > 0
    assert peer["median_decode_ms_per_token"] == pytest.approx(
        (peer["median_latency_s"] - peer["median_prefill_latency_s"]) / 4 * 1e3)
    ratios = report["folio_over_peer"]
    assert ratios["ttft"] == pytest.approx(
        report["median_prefill_latency_s"] / peer["median_prefill_latency_s"])
    assert ratios["latency"] == pytest.approx(
        report["median_latency_s"] / peer["median_latency_s"])
    out = capsys.readouterr().out
    assert "folio/peer time ratio" in out and "start-to-ready:" in out


def test_latency_peer_timeout(tiny_model_dir, tmp_path) -> None:
    """A peer past --peer-timeout is killed and reported as an error; the bench still finishes."""
    out_json = tmp_path / "latency.json"
    args = _parse(["--model", tiny_model_dir("llama"), "--input-len", "4", "--output-len", "3",
                   "--num-iters-warmup", "0", "--num-iters", "1",
                   "--num-gpu-blocks-override", "64", "--no-roofline", "--peer", "transformers",
                   "--peer-timeout", "0.001", "--output-json", str(out_json)])
    report = latency.run(args)
    assert report["peer"]["error"] == "did not finish in 0.001 s (killed)"
    assert report["peer"]["timed_out"] is True and report["folio_over_peer"] is None
    assert report["median_latency_s"] > 0
    assert json.loads(out_json.read_text())["peer"]["timed_out"] is True
    with pytest.raises(ValueError, match="--peer-timeout"):
        latency.run(_parse(["--peer-timeout", "-1"]))


def test_latency_rejects_bad_flags() -> None:
    with pytest.raises(ValueError):
        latency.run(_parse(["--output-len", "0"]))
    with pytest.raises(ValueError):
        latency.run(_parse(["--config", "qwen3-0.6b"]))


def test_roofline_counts_experts_and_latents(tiny_model_dir) -> None:
    """The mixtures' and DeepSeek's stored parameters equal their checkpoints' tensor sizes;
    a decode step reads the experts its tokens touch, and a latent cache's bytes per token."""
    import json
    import os

    from safetensors import safe_open
    for arch in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"):
        path = tiny_model_dir(arch)
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        assert roofline.count_params(cfg) == stored, arch
    qwen = RANDOM_CONFIGS["qwen3-30b-a3b"]
    assert roofline.count_params(qwen) == pytest.approx(30.5e9, rel=0.01)
    assert roofline.count_params(qwen, active_batch=1) == pytest.approx(3.3e9, rel=0.03)
    one = roofline.decode_bytes_per_step(qwen, 1, 0)
    many = roofline.decode_bytes_per_step(qwen, 256, 0)
    assert one < many < roofline.weight_bytes(qwen) * 1.0001
    lite = RANDOM_CONFIGS["deepseek-v2-lite"]
    assert roofline.count_params(lite) == pytest.approx(15.7e9, rel=0.02)
    assert roofline.kv_bytes_per_token(lite) == 27 * 576 * 2


def test_latency_bench_records_quantization(tiny_model_dir, tmp_path) -> None:
    """`--quantization fp8 --kv-cache-dtype fp8`: the JSON says what the engine ran (the
    method, the cache's dtype, the arguments), and on the CPU, where FP8 weights run widened,
    the roofline counts the weights as held, not at 8 bits."""
    out_json = tmp_path / "latency.json"
    args = _parse(["--model", tiny_model_dir("llama"), "--input-len", "8", "--output-len", "4",
                   "--num-iters-warmup", "0", "--num-iters", "1", "--quantization", "fp8",
                   "--kv-cache-dtype", "fp8", "--num-gpu-blocks-override", "64",
                   "--output-json", str(out_json)])
    latency.run(args)
    report = json.loads(out_json.read_text())
    assert report["quantization"] == "fp8" and report["kv_cache_dtype"] == "float8_e4m3fn"
    engine = report["settings"]["engine"]
    assert engine["quantization"] == "fp8" and engine["kv_cache_dtype"] == "fp8"
    roof = report["roofline"]
    formula = roofline.decode_bytes_per_step(tiny_model_dir("llama"), 1, roof["context_len"],
                                             roof["dtype_bytes"], projection_bits=8.125,
                                             kv_dtype_bytes=1)
    assert roof["stored_weight_bytes"] > 0 and roof["bytes_per_step"] > formula
