"""folio's rope scaling (folio/model/rope_scaling.py) against transformers' ROPE_INIT_FUNCTIONS
on several configs per type, and RotaryEmbedding's tables built from it (LongRoPE's two
halves, partial rotary, the attention factor)."""
from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from folio.model.layers import RotaryEmbedding
from folio.model.rope_scaling import rope_frequencies, rope_type


def _llama(rope: dict, head_dim: int = 64, max_pos: int = 8192, **extra) -> object:
    return transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                                    head_dim=head_dim, max_position_embeddings=max_pos,
                                    rope_parameters=dict(rope), **extra)


def _phi3(rope: dict | None, head_dim: int = 32, max_pos: int = 131072, original: int = 4096,
          partial: float = 1.0) -> object:
    return transformers.Phi3Config(hidden_size=head_dim * 4, num_attention_heads=4,
                                   max_position_embeddings=max_pos,
                                   original_max_position_embeddings=original,
                                   partial_rotary_factor=partial,
                                   rope_parameters=None if rope is None else dict(rope))


def _factors(n: int, lo: float, hi: float) -> list[float]:
    return [lo + (hi - lo) * i / max(1, n - 1) for i in range(n)]


CONFIGS = {
    "default": _llama({"rope_type": "default", "rope_theta": 500000.0}),
    "linear": _llama({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "dynamic": _llama({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    "dynamic_d128": _llama({"rope_type": "dynamic", "rope_theta": 1e6, "factor": 8.0},
                           head_dim=128, max_pos=4096),
    "llama3": _llama({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, max_pos=131072),
    "llama3_short": _llama({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 256}, head_dim=16,
                           max_pos=1024),
    "yarn": _llama({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                    "original_max_position_embeddings": 2048}),
    "yarn_betas_no_truncate": _llama({"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0,
                                      "original_max_position_embeddings": 4096,
                                      "beta_fast": 16, "beta_slow": 2, "truncate": False},
                                     head_dim=128, max_pos=32768),
    "yarn_mscale": _llama({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                           "original_max_position_embeddings": 4096, "mscale": 1.0,
                           "mscale_all_dim": 0.707}, max_pos=163840),
    "yarn_attention_factor": _llama({"rope_type": "yarn", "rope_theta": 10000.0,
                                     "factor": 2.0, "attention_factor": 1.25,
                                     "original_max_position_embeddings": 256},
                                    head_dim=16, max_pos=1024),
    "longrope_phi3": _phi3({"rope_type": "longrope", "rope_theta": 10000.0,
                            "short_factor": _factors(16, 1.0, 1.2),
                            "long_factor": _factors(16, 1.0, 30.0)}),
    "longrope_partial": _phi3({"rope_type": "longrope", "rope_theta": 10000.0,
                               "short_factor": _factors(8, 1.05, 1.3),
                               "long_factor": _factors(8, 2.0, 9.0)}, partial=0.5),
    # folio is handed it as the old "su" type (transformers' Phi3Config renames it on load)
    "longrope_su_alias": _phi3({"rope_type": "longrope", "rope_theta": 10000.0,
                                "short_factor": _factors(16, 1.0, 1.1),
                                "long_factor": _factors(16, 1.5, 4.0)},
                               max_pos=1024, original=700),
}


def _folio_params(cfg) -> tuple[dict, int]:
    params = dict(cfg.rope_parameters)
    original = getattr(cfg, "original_max_position_embeddings", None)
    if original:
        params["original_max_position_embeddings"] = original
    if params.get("rope_type") == "longrope" and cfg is CONFIGS.get("longrope_su_alias"):
        del params["rope_type"]
        params["type"] = "su"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    return params, dim


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_frequencies_match_transformers(name: str) -> None:
    cfg = CONFIGS[name]
    params, dim = _folio_params(cfg)
    kind = rope_type(params)
    found = rope_frequencies(params, dim, cfg.max_position_embeddings)
    if name == "longrope_su_alias":
        assert "rope_type" not in params and kind == "longrope"
    if kind == "default":
        ref = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    assert found.inv_freq.shape == (dim // 2,)
    torch.testing.assert_close(found.inv_freq, ref.float(), rtol=1e-6, atol=0)
    assert found.attention_scaling == pytest.approx(ref_scale, rel=1e-12)
    if kind == "longrope":
        original = cfg.rope_parameters["original_max_position_embeddings"]
        long_ref, long_scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=original + 1)
        assert found.long_from == original
        torch.testing.assert_close(found.long_inv_freq, long_ref.float(), rtol=1e-6, atol=0)
        assert long_scale == pytest.approx(found.attention_scaling)
        assert not torch.allclose(found.inv_freq, found.long_inv_freq)
    else:
        assert found.long_inv_freq is None
    if kind in ("linear", "llama3", "yarn", "longrope"):
        default = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
        assert not torch.allclose(found.inv_freq, default), "the scaling changed nothing"


def test_dynamic_is_transformers_table_below_and_at_max_positions() -> None:
    """folio's one table is transformers' at any length up to max_position_embeddings (its
    base grows only past it, where folio's max_model_len never goes)."""
    cfg = CONFIGS["dynamic"]
    params, dim = _folio_params(cfg)
    found = rope_frequencies(params, dim, cfg.max_position_embeddings)
    for seq_len in (1, 100, cfg.max_position_embeddings):
        ref, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=seq_len)
        torch.testing.assert_close(found.inv_freq, ref.float(), rtol=1e-6, atol=0)
    grown, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=2 * cfg.max_position_embeddings)
    assert not torch.allclose(found.inv_freq, grown)


def test_longrope_table_is_short_below_the_original_length_and_long_beyond() -> None:
    cfg = CONFIGS["longrope_su_alias"]
    params, dim = _folio_params(cfg)
    rotary = RotaryEmbedding(dim, 1024, cfg)
    assert rotary.rotary_dim == dim
    short, scale = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=701)
    assert scale == pytest.approx(math.sqrt(1 + math.log(1024 / 700) / math.log(700)))
    pos = torch.arange(1024, dtype=torch.float32)
    for lo, hi, inv in ((0, 700, short), (700, 1024, long)):
        freqs = torch.outer(pos[lo:hi], inv.float())
        emb = torch.cat((freqs, freqs), -1)
        torch.testing.assert_close(rotary.cos[lo:hi], emb.cos() * scale, rtol=0, atol=1e-6)
        torch.testing.assert_close(rotary.sin[lo:hi], emb.sin() * scale, rtol=0, atol=1e-6)


def test_partial_rotary_longrope_table() -> None:
    cfg = CONFIGS["longrope_partial"]
    rotary = RotaryEmbedding(32, 64, cfg)
    assert rotary.rotary_dim == 16 and rotary.cos.shape == (64, 16)


def test_unknown_type_and_wrong_factor_count_are_refused() -> None:
    with pytest.raises(ValueError, match="not supported"):
        rope_frequencies({"rope_type": "mrope", "rope_theta": 1e4}, 64, 4096)
    with pytest.raises(ValueError, match="short_factor has 3 entries"):
        rope_frequencies({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 3,
                          "long_factor": [1.0] * 32, "original_max_position_embeddings": 8},
                         64, 4096)
