"""The benches' roofline for quantized models: the projections' share of the weights at their
stored bits (codes plus scales and zero points), the KV cache at its dtype's bytes."""
from __future__ import annotations

import json

import pytest

from folio.bench import quant_bytes, roofline
from folio.bench.random_model import RANDOM_CONFIGS, _w4a16_config

LLAMA = RANDOM_CONFIGS["llama3-8b"]


def test_projection_params_by_hand() -> None:
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert roofline.projection_params(LLAMA) == 32 * per_layer
    total = roofline.count_params(LLAMA)
    assert roofline.weight_bytes(LLAMA, 2) == 2 * total
    proj = 32 * per_layer
    assert roofline.weight_bytes(LLAMA, 2, projection_bits=8) == (total - proj) * 2 + proj
    assert roofline.weight_bytes(LLAMA, 2, projection_bits=4.125) == \
        pytest.approx((total - proj) * 2 + proj * 4.125 / 8)
    # the KV cache at one byte per element halves the context's share
    bf16 = roofline.decode_bytes_per_step(LLAMA, 1, 1000, 2)
    fp8 = roofline.decode_bytes_per_step(LLAMA, 1, 1000, 2, projection_bits=8,
                                         kv_dtype_bytes=1)
    kv = roofline.kv_bytes_per_token(LLAMA, 2) * 1000
    assert bf16 - fp8 == pytest.approx(proj + kv / 2, rel=1e-9)


def test_projection_params_of_a_mixture_of_experts_by_hand() -> None:
    """FP8 experts: the experts a step reads are projections (stored in 8 bits), in place of
    the dense MLP the config's intermediate_size would give every layer; routers stay."""
    cfg = dict(RANDOM_CONFIGS["qwen3-30b-a3b"], num_hidden_layers=4)
    hidden, heads, kv_heads, head_dim = 2048, 32, 4, 128
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    experts = 3 * hidden * 768
    assert roofline.projection_params(cfg) == 4 * (attention + 128 * experts)
    read = 128 * (1 - (1 - 8 / 128) ** 1)       # one token reads its top 8
    assert roofline.projection_params(cfg, active_batch=1) == 4 * (attention
                                                                 + round(read * experts))
    total = roofline.count_params(cfg, active_batch=1)
    proj = roofline.projection_params(cfg, active_batch=1)
    assert roofline.weight_bytes(cfg, 2, projection_bits=8, active_batch=1) == \
        (total - proj) * 2 + proj
    # the layers' non-projection weights (norms, routers) are a small share
    assert 0 < (total - proj) - 2 * 151936 * hidden < 0.01 * total


def _model(path, quantization_config: dict | None) -> str:
    path.mkdir()
    config = dict(LLAMA)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_projection_bits_of_each_scheme(tmp_path) -> None:
    plain = _model(tmp_path / "a", None)
    assert quant_bytes.projection_bits(plain, None) is None
    assert quant_bytes.projection_bits(plain, "fp8") == 8 + 32 / 4096   # on-load FP8
    w4 = _model(tmp_path / "b", _w4a16_config())
    assert quant_bytes.projection_bits(w4, None) == 4 + 16 / 128
    awq = _model(tmp_path / "c", {"quant_method": "awq", "bits": 4, "group_size": 128,
                                  "zero_point": True, "version": "gemm"})
    assert quant_bytes.projection_bits(awq, None) == 4 + 32 / 128      # scales and zeros
    assert quant_bytes.kv_dtype_bytes("fp8", 2) == 1
    assert quant_bytes.kv_dtype_bytes("auto", 2) == 2
    assert quant_bytes.kv_dtype_bytes("float32", 2) == 4


def test_a_packed_gguf_models_bytes_come_from_its_tensors() -> None:
    """A model run on its GGUF file's packed weights: the roofline takes the running model's
    bytes (each storage once: a tied embedding and lm_head share one), in place of the
    formula, for a dense model; a mixture of experts keeps the formula (a step reads the
    experts its tokens touch). So does any quantized model on the CPU. Others: None."""
    import types

    import torch
    from torch import nn
    model = nn.Module()
    model.packed = nn.Module()
    model.packed.register_buffer("codes", torch.zeros(1000, dtype=torch.uint8))
    model.packed.register_buffer("scales", torch.zeros(10, dtype=torch.float32))
    model.tied = nn.Module()
    model.tied.register_buffer("codes", model.packed.codes)        # the same storage
    model.norm = nn.Parameter(torch.ones(4))
    worker = types.SimpleNamespace(quantization="gguf", model=model)
    assert quant_bytes.packed_weight_bytes(worker) == 1000 + 40 + 16
    assert quant_bytes.packed_weight_bytes(
        types.SimpleNamespace(quantization="none", model=model)) is None
    # a quantized model on the CPU is counted as it is held (FP8 runs widened there); on a
    # GPU the formula's bits stand
    assert quant_bytes.packed_weight_bytes(types.SimpleNamespace(
        quantization="fp8", device=torch.device("cpu"), model=model)) == 1056
    assert quant_bytes.packed_weight_bytes(types.SimpleNamespace(
        quantization="fp8", device=torch.device("cuda", 0), model=model)) is None
    assert quant_bytes.packed_weight_bytes(types.SimpleNamespace(
        quantization="none", device=torch.device("cpu"), model=model)) is None
    formula = roofline.decode_bytes_per_step(LLAMA, 1, 100, 2)
    kv = roofline.kv_bytes_per_token(LLAMA, 2) * 100
    assert roofline.decode_bytes_per_step(LLAMA, 1, 100, 2, stored_weight_bytes=1056) == \
        1056 + kv != formula
    moe = dict(RANDOM_CONFIGS["qwen3-30b-a3b"], num_hidden_layers=4)
    assert roofline.decode_bytes_per_step(moe, 1, 100, 2, stored_weight_bytes=1056) == \
        roofline.decode_bytes_per_step(moe, 1, 100, 2)
    floor = roofline.offline_floor(LLAMA, [10], [3], 1e9, 1e15, 2, stored_weight_bytes=1056)
    assert floor["memory_s"] == pytest.approx(
        sum(1056 + (10 + s) * roofline.kv_bytes_per_token(LLAMA, 2) for s in range(3)) / 1e9)


def test_the_roofline_line_says_when_the_step_fits_the_cpus_cache() -> None:
    line = roofline.roofline_line(0.015, 6.9e9, 0.0117, step_bytes=104e6, cache_bytes=480 << 20)
    assert "achieved 128.2% of roofline" in line
    assert "104 MB fit the CPU's 480 MiB last-level cache" in line
    assert "cache" not in roofline.roofline_line(0.015, 6.9e9, 0.0117, step_bytes=600e6,
                                                 cache_bytes=480 << 20)
    assert "cache" not in roofline.roofline_line(0.015, 6.9e9, 0.0117)
    found = roofline.last_level_cache_bytes()
    assert found is None or found >= 1 << 10
