"""SmoothQuant for the checkpoint writers (folio/bench/smoothquant.py,
quant_checkpoints.write_smoothed) on a tiny random Llama:
the smoothed checkpoint computes the same logits in transformers; at strength 0.5 each input
channel's activation maximum equals its weight column maximum afterwards (the point of the
method: the range split evenly between the two; checked for q/k/v and down, whose weights no
later mapping changes); write_compressed_tensors smooths first when
asked and its dequantized reference is the smoothed model; families the mappings do not
describe, and strengths outside (0, 1), are refused naming the field."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("compressed_tensors")

from folio.bench import quant_checkpoints as qc  # noqa: E402
from folio.bench import smoothquant as sq  # noqa: E402


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (4, 24), generator=torch.Generator().manual_seed(0))


def _logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_smoothing_keeps_the_outputs_and_evens_the_ranges(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    config, tensors = qc._read_source(src)
    tokens = _tokens(config["vocab_size"])
    dst = str(tmp_path / "smoothed")
    qc.write_smoothed(src, dst, 0.5, tokens)
    _, smoothed = qc._read_source(dst)
    changed = [n for n in tensors if not torch.equal(tensors[n], smoothed[n])]
    assert any("input_layernorm" in n for n in changed)
    assert any("mlp.up_proj" in n for n in changed) and any("q_proj" in n for n in changed)
    assert not any("embed" in n or "lm_head" in n or n == "model.norm.weight" for n in changed)

    want, got = _logits(src, tokens), _logits(dst, tokens)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5

    stats = sq.activation_absmax(dst, tokens)
    for layer in range(config["num_hidden_layers"]):
        for key, readers, _, _ in sq._mappings(layer):
            if key.endswith("gate_up"):
                continue    # up_proj's rows were divided again by the down mapping after
            weight = torch.cat([smoothed[n].float() for n in readers]).abs().amax(0)
            assert torch.allclose(stats[key], weight, rtol=1e-3), key


def test_compressed_tensors_smooths_first(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    config, _ = qc._read_source(src)
    tokens = _tokens(config["vocab_size"])
    deq = str(tmp_path / "deq")
    qc.write_compressed_tensors(src, str(tmp_path / "q"), "w8a8-int8", dequantized_dir=deq,
                                smoothing_strength=0.6, calibration_ids=tokens)
    _, plain = qc._read_source(src)
    _, reference = qc._read_source(deq)
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(plain[norm], reference[norm])       # the smoothed model's norms
    # the reference is the quantized model: near the float one, not equal to it (a random
    # tiny model's ranges are wide: 8 bits cost it a few %)
    want, got = _logits(src, tokens), _logits(deq, tokens)
    err = float((got - want).norm() / want.norm())
    assert 0 < err < 0.15, err


def test_refusals(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="smoothing_strength"):
        qc.write_smoothed(tiny_model_dir("llama"), str(tmp_path / "a"), 1.0)
    with pytest.raises(ValueError, match="smoothing_strength.*architectures"):
        qc.write_smoothed(tiny_model_dir("gemma2"), str(tmp_path / "b"), 0.5)
