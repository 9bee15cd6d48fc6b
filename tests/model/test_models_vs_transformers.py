"""folio's models against Hugging Face transformers, token for token and logprob for logprob.

Both sides load the same checkpoint directory. folio runs every prompt of a model in ONE
`generate` call (continuous batching, mixed prefill/decode steps, chunked prefill), while
transformers is the plain reference. Checks, per prompt:
  * greedy token ids equal (vLLM's rule: at a first difference each side's token must be in
    the other's top-5, and it must be a genuine near-tie; nothing after it is compared);
  * every sampled-token / top-k logprob folio reports equals transformers' log_softmax;
  * every prompt logprob (the prompt token and the top-k) likewise.

Families: SmolLM2-135M-Instruct (real weights, Llama), and tiny random Llama, Llama with
Llama-3.1 rope scaling, Mistral with a sliding window, Qwen2 (qkv bias), Qwen3 (qk-norm),
Gemma 3 (sandwich norms, sliding and full layers with their own rotary, soft-capped logits),
Gemma 2 (sandwich norms, soft-capped attention scores and logits, alternating windows),
Phi-3 (fused q/k/v and gate/up weights, partial rotary, a window), the rope scalings
(rope_scaling.py): Phi-3 with LongRoPE, Llama with YaRN, Llama with dynamic NTK; the mixtures
of experts Mixtral, Qwen2-MoE (shared expert, a dense layer) and Qwen3-MoE (sparse every
other layer); DeepSeek-V2 and V3 (latent attention, grouped routing, shared experts); GPT-OSS
(sinks, alternating windows, YaRN, biased experts with the clamped SwiGLU).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

from folio import LLM, SamplingParams
from model_utils import (
    assert_logprobs_match,
    check_greedy_close,
    folio_position_dict,
    hf_greedy_batch,
    hf_prompt_logprobs_batch,
    load_hf_model,
    top_k_dict,
    torch_threads,
)

MAX_TOKENS = 24
NUM_LOGPROBS = 5
# float32 on both sides: differences are summation-order rounding (measured <= 5e-5).
LOGPROB_ATOL = 1e-3
# When greedy picks differ, HF's logprobs of the two tokens must be this close: rounding can
# only flip a near-tie, never a clear preference.
NEAR_TIE = 1e-2
TINY_ARCHS = ["llama", "llama3_rope", "mistral", "qwen2", "qwen3", "gemma3", "gemma2", "phi3",
              "phi3_longrope", "llama_yarn", "llama_dynamic", "mixtral", "qwen2_moe",
              "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"]


@dataclass
class Case:
    """One model: folio's outputs for a batch of prompts and transformers' references."""
    name: str
    outputs: list[Any]                   # folio RequestOutputs, in prompt order
    hf_ids: list[list[int]]
    hf_step_logprobs: list[torch.Tensor]   # per prompt [steps, vocab]
    # Per prompt, per position 1..len-1: transformers' logprobs of the tokens folio reported
    # there (full-vocab rows for every prompt of every model would hold ~1 GB).
    hf_prompt_logprobs: list[list[dict[int, float]]]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          logprobs=NUM_LOGPROBS, prompt_logprobs=NUM_LOGPROBS)


def _run_folio(model_dir: str, prompts: list[Any], dtype: str = "float32",
               **engine_kwargs: Any) -> list[Any]:
    llm = LLM(model=model_dir, dtype=dtype, max_model_len=1024, seed=0, **engine_kwargs)
    try:
        return llm.generate(prompts, _params(), use_tqdm=False)
    finally:
        # Free the engine (weights, KV cache) before the next model is built.
        del llm
        gc.collect()


def _run_case(name: str, model_dir: str, prompts: list[Any], **engine_kwargs: Any) -> Case:
    outputs = _run_folio(model_dir, prompts, **engine_kwargs)
    prompt_ids = [out.prompt_token_ids for out in outputs]
    greedy = hf_greedy_batch(model_dir, prompt_ids, MAX_TOKENS)
    prompt_refs = []
    for out, full in zip(outputs, hf_prompt_logprobs_batch(model_dir, prompt_ids)):
        reported = out.prompt_logprobs or []
        rows = []
        for pos in range(1, len(out.prompt_token_ids)):
            tids = list(reported[pos] or {}) if pos < len(reported) else []
            rows.append(dict(zip(tids, full[pos - 1, tids].tolist())))
        prompt_refs.append(rows)
    load_hf_model.cache_clear()  # the reference model is not needed again
    return Case(name=name, outputs=outputs,
                hf_ids=[g.token_ids for g in greedy],
                hf_step_logprobs=[g.logprobs for g in greedy],
                hf_prompt_logprobs=prompt_refs)


# ---- the checks, shared by every model -------------------------------------------------------

def _first_divergence(case: Case, i: int) -> int | None:
    """Position of the first differing greedy token (None if none), after checking it is a
    genuine near-tie under both the top-5 rule and transformers' own logprobs."""
    out = case.outputs[i].outputs[0]
    hf_lp = case.hf_step_logprobs[i]
    where = f"{case.name} prompt {i}"
    assert len(out.token_ids) == MAX_TOKENS, f"{where}: {len(out.token_ids)} tokens"
    assert out.logprobs is not None and len(out.logprobs) == MAX_TOKENS, where
    div = check_greedy_close(
        out.token_ids, case.hf_ids[i],
        [folio_position_dict(p) for p in out.logprobs],
        [top_k_dict(row, NUM_LOGPROBS) for row in hf_lp], name=where)
    if div is not None:
        f_tok, h_tok = out.token_ids[div], case.hf_ids[i][div]
        gap = abs(hf_lp[div, f_tok].item() - hf_lp[div, h_tok].item())
        assert gap < NEAR_TIE, (f"{where}: step {div}: folio chose {f_tok}, transformers "
                                f"{h_tok}, logprob gap {gap:.4f} is not a near-tie")
    return div


def check_token_ids(case: Case) -> None:
    diverged = [i for i in range(len(case.outputs)) if _first_divergence(case, i) is not None]
    # A near-tie may flip one prompt, not most of them: that would be a systematic error.
    assert len(diverged) <= max(1, len(case.outputs) // 4), (
        f"{case.name}: greedy outputs differ from transformers for prompts {diverged}")


def check_sample_logprobs(case: Case) -> None:
    for i, request in enumerate(case.outputs):
        out = request.outputs[0]
        div = _first_divergence(case, i)
        # Up to and including the first difference both sides condition on the same history.
        last = MAX_TOKENS - 1 if div is None else div
        for step in range(last + 1):
            position = out.logprobs[step]
            token = out.token_ids[step]
            where = f"{case.name} prompt {i} step {step}"
            assert token in position, f"{where}: sampled token missing from logprobs"
            assert len(position) >= NUM_LOGPROBS, f"{where}: only {len(position)} entries"
            # Greedy: the sampled token is the most likely one.
            assert position[token].rank == 1, f"{where}: greedy token has rank {position[token].rank}"
            assert_logprobs_match(folio_position_dict(position), case.hf_step_logprobs[i][step],
                                  atol=LOGPROB_ATOL, where=where)


def check_prompt_logprobs(case: Case) -> None:
    for i, request in enumerate(case.outputs):
        ids = request.prompt_token_ids
        plp = request.prompt_logprobs
        where = f"{case.name} prompt {i}"
        assert plp is not None and len(plp) == len(ids), (
            f"{where}: {None if plp is None else len(plp)} prompt logprobs for {len(ids)} tokens")
        assert plp[0] is None, f"{where}: position 0 has no context and must be None"
        hf = case.hf_prompt_logprobs[i]
        for pos in range(1, len(ids)):
            position = plp[pos]
            assert position is not None and ids[pos] in position, (
                f"{where}: position {pos}: prompt token {ids[pos]} missing")
            assert len(position) >= NUM_LOGPROBS, f"{where}: position {pos}"
            assert_logprobs_match(folio_position_dict(position), hf[pos - 1],
                                  atol=LOGPROB_ATOL, where=f"{where} position {pos}")


# ---- SmolLM2-135M-Instruct, real weights -----------------------------------------------------

_LONG_TEXT = (
    "The water cycle describes how water moves between the oceans, the air and the land. "
    "Heat from the sun evaporates water from seas, lakes and rivers, and plants release "
    "more of it through their leaves. As the moist air rises it cools, and the vapour "
    "condenses into tiny droplets that form clouds. When the droplets merge and grow heavy "
    "enough, they fall back as rain, snow, sleet or hail. Some of that water soaks into the "
    "ground and refills aquifers, some runs off into streams that carry it back to the sea, "
    "and some is frozen for centuries in glaciers and ice sheets. Over millions of years the "
    "same water has been recycled countless times: the glass of water on your table may "
    "contain molecules that once fell as rain on dinosaurs. Human activity changes the cycle "
    "too. Cities cover the soil with concrete, so rain runs off quickly instead of sinking in; "
    "farms pump groundwater faster than it is replaced; and a warmer climate lets the air hold "
    "more moisture, which makes both droughts and heavy storms more intense. Understanding "
    "these flows helps engineers design reservoirs and drains, and helps farmers decide when "
    "to plant and how much to irrigate. It also explains why coastal towns are often mild "
    "and damp, why deserts form in the rain shadow of mountain ranges, and why a single "
    "warm winter can leave a whole valley short of water the following summer."
)


def _smollm2_prompts(tokenizer: Any) -> list[Any]:
    def chat(question: str) -> dict:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=False)
        return {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

    return [
        chat("What is the capital of France?"),
        chat("Write a haiku about the ocean."),
        chat("Explain in one sentence what a hash table is."),
        chat(f"Summarize this text in two sentences.\n\n{_LONG_TEXT}"),   # ~300 tokens
        "The quick brown fox",
        "Once upon a time, in a small village by the sea, there lived",
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        "1, 1, 2, 3, 5, 8, 13, 21,",
        "La capitale de la France est",
        "Der schnellste Weg von Hamburg nach Berlin ist",
        "日本の首都は",
        "SELECT name, COUNT(*) FROM users",
    ]


@pytest.fixture(scope="module")
def smollm2_case(smollm2_dir: str, smollm2_tokenizer: Any) -> Case:
    prompts = _smollm2_prompts(smollm2_tokenizer)
    # One thread: on a loaded CI box a 2-thread OpenMP team ran this 7x slower (210 s vs 28 s).
    with torch_threads(1):
        # A float32 KV cache: transformers keeps K/V in float32, and the float16 default of
        # GGUF weights would move logprobs by its rounding (~1e-3), past these tolerances.
        case = _run_case("smollm2", smollm2_dir, prompts, num_gpu_blocks_override=128,
                         kv_cache_dtype="float32",
                         # Below the batch's total prompt length: steps mix prefill chunks of
                         # some prompts with decodes of others.
                         max_num_batched_tokens=256)
    assert any(len(out.prompt_token_ids) >= 300 for out in case.outputs), "long prompt too short"
    return case


def test_smollm2_greedy_token_ids(smollm2_case: Case) -> None:
    check_token_ids(smollm2_case)


def test_smollm2_sample_logprobs(smollm2_case: Case) -> None:
    check_sample_logprobs(smollm2_case)


def test_smollm2_prompt_logprobs(smollm2_case: Case) -> None:
    check_prompt_logprobs(smollm2_case)


# ---- tiny random models of each family -------------------------------------------------------

def _tiny_prompts(tokenizer: Any) -> list[Any]:
    """Random ids give varied, unambiguous positions; lengths cross the interesting bounds:
    the sliding window (16), llama3's original context (256) and a chunk budget (256)."""
    gen = torch.Generator().manual_seed(1234)

    def rand(n: int) -> dict:
        return {"prompt_token_ids": torch.randint(3, len(tokenizer), (n,), generator=gen).tolist()}

    return ["Hello, my name is", rand(17), rand(60), rand(300), rand(620)]


@pytest.fixture(scope="module")
def tiny_cases(tiny_model_dir: Callable[[str], str],
               smollm2_tokenizer: Any) -> Callable[[str], Case]:
    """Per arch, computed on first use and kept for the module's other tests."""
    cache: dict[str, Case] = {}

    def get(arch: str) -> Case:
        if arch not in cache:
            with torch_threads(1):
                cache[arch] = _run_case(arch, tiny_model_dir(arch),
                                        _tiny_prompts(smollm2_tokenizer),
                                        num_gpu_blocks_override=128, max_num_batched_tokens=256)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_greedy_token_ids(tiny_cases: Callable[[str], Case], arch: str) -> None:
    check_token_ids(tiny_cases(arch))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_sample_logprobs(tiny_cases: Callable[[str], Case], arch: str) -> None:
    check_sample_logprobs(tiny_cases(arch))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_prompt_logprobs(tiny_cases: Callable[[str], Case], arch: str) -> None:
    check_prompt_logprobs(tiny_cases(arch))


def test_tiny_prompts_reach_scaled_and_windowed_positions(
        tiny_cases: Callable[[str], Case]) -> None:
    """Guard the test itself: the llama3 and mistral cases only mean something if positions
    run past 256 (scaled rope band) and past the window."""
    case = tiny_cases("llama3_rope")
    assert max(len(out.prompt_token_ids) for out in case.outputs) > 512


# ---- dtype --------------------------------------------------------------------------------

def test_bfloat16_matches_float32(tiny_cases: Callable[[str], Case],
                                  tiny_model_dir: Callable[[str], str],
                                  smollm2_tokenizer: Any) -> None:
    """bf16 rounding flips near-ties much earlier than float32 noise, so only the loose top-5
    rule applies; the prompt logprobs must still be close on average."""
    reference = tiny_cases("qwen3")
    prompts = _tiny_prompts(smollm2_tokenizer)
    with torch_threads(1):
        outputs = _run_folio(tiny_model_dir("qwen3"), prompts, dtype="bfloat16",
                             num_gpu_blocks_override=128, max_num_batched_tokens=256)
    for i, (bf16, fp32) in enumerate(zip(outputs, reference.outputs)):
        assert bf16.prompt_token_ids == fp32.prompt_token_ids
        b, f = bf16.outputs[0], fp32.outputs[0]
        assert len(b.token_ids) == MAX_TOKENS
        check_greedy_close(b.token_ids, f.token_ids,
                           [folio_position_dict(p) for p in b.logprobs],
                           [folio_position_dict(p) for p in f.logprobs], name=f"bf16 prompt {i}")
        diffs = [abs(bp[tok].logprob - fp[tok].logprob)
                 for tok, bp, fp in zip(bf16.prompt_token_ids[1:], bf16.prompt_logprobs[1:],
                                        fp32.prompt_logprobs[1:])]
        mean_diff = sum(diffs) / len(diffs)
        assert mean_diff < 0.1, f"bf16 prompt {i}: mean prompt-logprob error {mean_diff:.3f}"


# ---- sliding windows with a small block size: blocks freed out of the window, prefix hits --

SLIDING_ARCHS = ["mistral", "gemma3", "gemma2", "phi3"]


@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_tiny_sliding_small_blocks_with_prefix_hits(tiny_model_dir: Callable[[str], str],
                                                    smollm2_tokenizer: Any, arch: str) -> None:
    """Blocks of 4 tokens under a window of 16: each sliding group frees blocks as requests
    move on (chunked prefill and decode), and requests sharing a long prefix with one before
    them start from prefix hits whose sliding blocks were freed by that one (they stay
    cached). No prompt logprobs: those turn the prefix cache off. Token-exact as ever."""
    gen = torch.Generator().manual_seed(4321)

    def rand(n: int) -> list[int]:
        return torch.randint(3, len(smollm2_tokenizer), (n,), generator=gen).tolist()

    shared = rand(150)
    prompts = [shared + rand(30), rand(90), shared + rand(7), shared[:100] + rand(40), shared]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=NUM_LOGPROBS)
    model_dir = tiny_model_dir(arch)
    with torch_threads(1):
        llm = LLM(model=model_dir, dtype="float32", max_model_len=512, seed=0, block_size=4,
                  num_gpu_blocks_override=200, max_num_batched_tokens=64)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)
        finally:
            del llm
            gc.collect()
        greedy = hf_greedy_batch(model_dir, prompts, MAX_TOKENS)
    load_hf_model.cache_clear()
    case = Case(f"{arch} small blocks", outputs, [g.token_ids for g in greedy],
                [g.logprobs for g in greedy], [[] for _ in prompts])
    check_token_ids(case)
    check_sample_logprobs(case)
    assert any(out.num_cached_tokens >= 100 for out in outputs), "no prefix hit exercised"
