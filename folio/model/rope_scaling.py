"""Rotary frequencies per rope scaling type: what RotaryEmbedding builds its cos/sin table from.

One function, `rope_frequencies(params, rotary_dim, max_position_embeddings)`, reads a model's
rope parameters (transformers' `rope_parameters` dict: rope_type, rope_theta and the type's
own keys) and returns the inverse frequencies and the factor cos and sin are multiplied by.
Types: default, linear, dynamic (NTK), yarn, llama3, longrope (Phi-3's "su" is its old name).
The arithmetic follows transformers' definitions step for step in float32, so the tables agree
with transformers' to the last bit where the semantics agree (tests/model/test_rope_scaling.py).

Where the semantics cannot agree. transformers recomputes two of these per forward pass from
the longest sequence in its batch; folio builds one table at load and a paged batch mixes
sequences of every length, whose cached keys were rotated at earlier steps, so the table must
be a function of the position alone:
  * longrope: transformers uses the short factors for every position while the sequence is at
    most original_max_position_embeddings long and the long factors for every position once
    it is longer. folio uses the short factors for positions below
    original_max_position_embeddings and the long ones from there on (one table from two
    halves, as vLLM does). A sequence within the original length sees exactly transformers'
    numbers; a longer one differs in its first original_max_position_embeddings positions.
  * dynamic: transformers keeps the default frequencies until a sequence outgrows
    max_position_embeddings, then raises the base for that length. folio's table is the one
    transformers has at max_position_embeddings, i.e. the default frequencies, and folio's
    max_model_len never exceeds max_position_embeddings, so every sequence folio runs sees
    exactly transformers' numbers; there is no growth past it to imitate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# Old names of rope types, as configs still spell them.
_ALIASES = {"su": "longrope"}


@dataclass(frozen=True)
class RopeFrequencies:
    """inv_freq [rotary_dim // 2] float32 for positions below `long_from` (every position when
    it is None); long_inv_freq for positions from `long_from` on (LongRoPE only); cos and sin
    are multiplied by attention_scaling (YaRN's and LongRoPE's attention factor)."""
    inv_freq: torch.Tensor
    attention_scaling: float = 1.0
    long_inv_freq: torch.Tensor | None = None
    long_from: int | None = None


def _exponents(rotary_dim: int) -> torch.Tensor:
    """2i / d for i < d / 2, float32 (the exponent of the base for pair i)."""
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim


def _default(base: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (base ** _exponents(rotary_dim))


def _original_length(params: dict, max_position_embeddings: int) -> int:
    return int(params.get("original_max_position_embeddings") or max_position_embeddings)


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than original / low_freq_factor slowed by `factor`,
    shorter than original / high_freq_factor kept, a smooth blend between."""
    factor = params["factor"]
    low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    original = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _dynamic_ntk(base: float, rotary_dim: int, factor: float, seq_len: int,
                 max_position_embeddings: int) -> torch.Tensor:
    """Dynamic NTK: the base raised for a sequence of `seq_len` (no change up to
    max_position_embeddings)."""
    seq_len = max(seq_len, max_position_embeddings)
    grown = (factor * seq_len / max_position_embeddings) - (factor - 1)
    return _default(base * grown ** (rotary_dim / (rotary_dim - 2)), rotary_dim)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, rotary_dim: int, params: dict,
          max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN: pairs that turn many times over the original context keep their frequency
    (extrapolated), pairs that turn less than once are slowed by `factor` (interpolated), a
    linear ramp between, in pair index, from the pair turning beta_fast times to the one
    turning beta_slow times; cos and sin scaled by the attention factor (0.1 ln(factor) + 1,
    or the ratio of two such with mscale / mscale_all_dim, or the config's own)."""
    original = _original_length(params, max_position_embeddings)
    factor = params.get("factor") or max_position_embeddings / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def pair_turning(turns: float) -> float:
        # The (fractional) pair index whose wavelength fits `turns` times in the original
        # context: original / (2 pi turns) = base^(2i / d).
        return rotary_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width: avoid dividing by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the pair keeps its frequency; 0: slowed by `factor`
    powers = base ** _exponents(rotary_dim)
    extrapolated, interpolated = 1.0 / powers, 1.0 / (factor * powers)
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)


def _longrope(base: float, rotary_dim: int, params: dict,
              max_position_embeddings: int) -> RopeFrequencies:
    """LongRoPE (Phi-3): each pair's wavelength stretched by its own factor, the short list
    below the original context and the long list beyond (module docstring); cos and sin
    scaled by sqrt(1 + ln(s) / ln(original)), s = max_position_embeddings / original (or the
    config's `factor`), unless the config gives attention_factor."""
    original = _original_length(params, max_position_embeddings)
    factor = params.get("factor") or max_position_embeddings / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    powers = base ** _exponents(rotary_dim)

    def stretched(key: str) -> torch.Tensor:
        factors = torch.tensor(params[key], dtype=torch.float32)
        if factors.shape != (rotary_dim // 2,):
            raise ValueError(f"longrope {key} has {factors.numel()} entries, expected "
                             f"{rotary_dim // 2} (rotary dimension / 2)")
        return 1.0 / (factors * powers)

    return RopeFrequencies(stretched("short_factor"), float(attention),
                           long_inv_freq=stretched("long_factor"), long_from=original)


def rope_type(params: dict) -> str:
    name = params.get("rope_type") or params.get("type") or "default"
    return _ALIASES.get(name, name)


def rope_frequencies(params: dict[str, Any], rotary_dim: int,
                     max_position_embeddings: int) -> RopeFrequencies:
    """The frequencies of one rotary table. `params`: rope_type, rope_theta and the type's
    keys (original_max_position_embeddings filled in by the caller where the config keeps it
    outside, as Phi-3's does); `max_position_embeddings`: the config's."""
    kind = rope_type(params)
    base = float(params.get("rope_theta", 10000.0))
    if kind == "default":
        return RopeFrequencies(_default(base, rotary_dim))
    if kind == "linear":
        return RopeFrequencies(_default(base, rotary_dim) / params["factor"])
    if kind == "dynamic":
        # The table transformers has at max_position_embeddings (module docstring).
        return RopeFrequencies(_dynamic_ntk(base, rotary_dim, params["factor"],
                                            max_position_embeddings, max_position_embeddings))
    if kind == "llama3":
        return RopeFrequencies(_llama3(_default(base, rotary_dim), params))
    if kind == "yarn":
        inv_freq, attention = _yarn(base, rotary_dim, params, max_position_embeddings)
        return RopeFrequencies(inv_freq, attention)
    if kind == "longrope":
        return _longrope(base, rotary_dim, params, max_position_embeddings)
    raise ValueError(f"rope scaling type {kind!r} is not supported; supported: default, linear, "
                     f"dynamic, yarn, llama3, longrope (su)")
