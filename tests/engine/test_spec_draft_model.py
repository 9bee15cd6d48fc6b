"""Speculative decoding with a draft model on the CPU (float32): the drafts are the draft
model's greedy continuation of each request's tokens (checked against transformers' greedy
decoding of the same draft model); greedy answers equal the engine without speculation, with a
draft of another family and head layout (tiny Qwen3 for a tiny Llama target), and with the
target as its own draft every draft is kept; seeded sampling, a grammar, preemption and the
prefix cache; the configuration's errors."""
from __future__ import annotations

import pytest
import torch

from folio import LLM, SamplingParams
from folio.sampling_params import StructuredOutputsParams

from model_utils import load_hf_model
from spec_overlap import watch_queued_steps
from test_invariants import _prompts


def _make(model: str, spec: dict | None, **overrides) -> LLM:
    kwargs = dict(dtype="float32", kv_cache_dtype="float32", max_model_len=512,
                  num_gpu_blocks_override=256, max_num_seqs=8, device="cpu",
                  speculative_config=spec)
    kwargs.update(overrides)
    return LLM(model, **kwargs)


def _spec(draft: str, k: int = 3) -> dict:
    # a fixed draft length: the counts asserted here must not depend on step times
    return {"model": draft, "num_speculative_tokens": k, "adaptive_draft_length": False}


def _ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _stats(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.stats()


def _record_drafts(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, the drafts the worker made after them) for every proposal."""
    drafter = llm.llm_engine.engine_core.scheduler.drafter
    seen: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def recording(request):
        drafts = propose(request)
        seen.append((list(request.all_token_ids), list(drafts)))
        return drafts

    drafter.propose = recording
    return seen


def _assert_continuation(reference, context: list[int], drafts: list[int]) -> None:
    """The drafts are transformers' greedy continuation of `context` by the draft model."""
    with torch.no_grad():
        out = reference.generate(torch.tensor([context]), max_new_tokens=len(drafts),
                                 do_sample=False, pad_token_id=0)
    assert drafts == out[0, len(context):].tolist(), (len(context), drafts)


def _assert_probes_follow(draft: str, seen: list[tuple[list[int], list[int]]]) -> None:
    """Every proposal after the first verdict's (the probes', after resting) is the draft
    model's greedy continuation of its whole context; there is at least one."""
    reference = load_hf_model(draft)
    probes = [(context, drafts) for context, drafts in seen if drafts][1:]
    assert probes
    for context, drafts in probes:
        _assert_continuation(reference, context, drafts)


def test_the_drafts_are_the_draft_models_greedy_continuation(tiny_model_dir) -> None:
    target, draft = tiny_model_dir("llama"), tiny_model_dir("qwen3")
    llm = _make(target, _spec(draft, k=4))
    seen = _record_drafts(llm)
    prompts = _prompts(3, seed=11)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    reference = load_hf_model(draft)
    checked = 0
    for context, drafts in seen[:24]:
        if drafts:
            _assert_continuation(reference, context, drafts)
            checked += 1
    assert checked >= 10


def test_a_resting_draft_model_writes_its_cache_before_it_drafts_again(tiny_model_dir,
                                                                      monkeypatch) -> None:
    """While the adaptive draft length rests (k = 0 verdicts) the draft model's cache writes
    are kept back and go in as one chunk before the probe drafts: the probe's drafts are the
    draft model's greedy continuation of the whole context."""
    from folio.core.spec.policy import AdaptiveDraftLength
    monkeypatch.setattr(AdaptiveDraftLength, "_best_k", lambda self, *a: 0)
    target, draft = tiny_model_dir("llama"), tiny_model_dir("qwen3")
    llm = _make(target, {"model": draft, "num_speculative_tokens": 3})
    seen = _record_drafts(llm)
    proposer = llm.llm_engine.engine_core.executor.worker.runner.draft_proposer
    most_kept, propose = [0], proposer.propose

    def watching(inputs, batch):
        drafts = propose(inputs, batch)
        most_kept[0] = max(most_kept[0], proposer.deferred.num_rows)
        return drafts

    proposer.propose = watching
    llm.generate(_prompts(1, seed=8), SamplingParams(temperature=0, max_tokens=48),
                 use_tqdm=False)
    assert most_kept[0] >= 30   # the 32 resting steps before the probe
    _assert_probes_follow(draft, seen)


def test_greedy_outputs_equal_the_engine_without_speculation(tiny_model_dir) -> None:
    target, draft = tiny_model_dir("llama"), tiny_model_dir("qwen3")
    prompts = _prompts(6, seed=12)
    params = [SamplingParams(temperature=0, max_tokens=20),
              SamplingParams(temperature=0, max_tokens=20, logprobs=2),
              SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.2)] * 2
    want = _ids(_make(target, None).generate(prompts, params, use_tqdm=False))
    llm = _make(target, _spec(draft))
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert _stats(llm).spec_num_drafts > 0


def test_the_target_as_its_own_draft_keeps_every_draft(tiny_model_dir) -> None:
    """The draft model equals the target: its greedy drafts are the target's greedy tokens,
    so every one is kept (up to the request's end) and each verify step emits k + 1."""
    target = tiny_model_dir("llama")
    prompts = _prompts(4, seed=13)
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    want = _ids(_make(target, None).generate(prompts, params, use_tqdm=False))
    llm = _make(target, _spec(target, k=4))
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == want
    stats = _stats(llm)
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_seeded_sampling_a_grammar_and_preemption(tiny_model_dir) -> None:
    target = tiny_model_dir("llama")
    draft = tiny_model_dir("qwen3")
    prompts = _prompts(4, seed=14)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=0, max_tokens=40),
              SamplingParams(temperature=0, max_tokens=40)]
    # few blocks: requests are preempted, recomputed (much from the prefix cache) and their
    # draft model cache rebuilt with them
    small = dict(num_gpu_blocks_override=20, max_model_len=256, max_num_seqs=4)
    want = _make(target, None, **small).generate(prompts, params, use_tqdm=False)
    llm = _make(target, _spec(target, k=4), **small)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _ids(got) == _ids(want)
    # (a random model fills its 24 tokens with the whitespace JSON allows, inside the object)
    assert got[1].outputs[0].text.startswith("{")
    stats = _stats(llm)
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0
    # a draft of another family, a few requests at once
    other = _make(target, _spec(draft), **small)
    assert _ids(other.generate(prompts, params, use_tqdm=False)) == _ids(want)


def _run_watching_overlap(llm: LLM, prompts: list[str], params) -> tuple[list[list[int]],
                                                                         list[bool]]:
    """Generate, and for each step queued whether the step before it was still in flight
    then (spec_overlap.watch_queued_steps, which also asserts that no step was queued while
    a drafting step was in flight)."""
    overlapped = watch_queued_steps(llm)
    return _ids(llm.generate(prompts, params, use_tqdm=False)), overlapped


def test_async_scheduling_runs_beside_a_draft_model(tiny_model_dir, monkeypatch) -> None:
    """A draft model beside async scheduling: a step whose drafts the draft model makes is
    finished before the next is queued, so every draft is verified as without async (the
    target as its own draft keeps them all, in as many verify steps); while the adaptive
    draft length rests the steps overlap, and the drafts made after a rest are still the
    draft model's greedy continuation of the whole context (its cache written from the
    kept rows, whose sampled tokens never went to the host)."""
    from folio.core.spec.policy import AdaptiveDraftLength
    target, draft = tiny_model_dir("llama"), tiny_model_dir("qwen3")
    prompts = _prompts(3, seed=15)
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    want = _ids(_make(target, None).generate(prompts, params, use_tqdm=False))
    sync = _make(target, _spec(target, k=4), async_scheduling=False)
    assert _ids(sync.generate(prompts, params, use_tqdm=False)) == want
    busy = _make(target, _spec(target, k=4), async_scheduling=True)
    assert busy.llm_engine.engine_core.async_scheduling is True
    answers, overlapped = _run_watching_overlap(busy, prompts, params)
    assert answers == want
    assert overlapped and not any(overlapped)   # every step drafts at a fixed k
    got, ref = _stats(busy), _stats(sync)
    assert got.spec_num_drafts == ref.spec_num_drafts > 0
    assert got.spec_num_accepted_tokens == got.spec_num_draft_tokens

    monkeypatch.setattr(AdaptiveDraftLength, "_best_k", lambda self, *a: 0)
    resting = _make(target, {"model": draft, "num_speculative_tokens": 3},
                    async_scheduling=True)
    seen = _record_drafts(resting)
    params = SamplingParams(temperature=0, max_tokens=48)
    answers, overlapped = _run_watching_overlap(resting, prompts[:1], params)
    assert answers == _ids(_make(target, None).generate(prompts[:1], params, use_tqdm=False))
    assert sum(overlapped) >= 30      # the resting steps before the probe
    _assert_probes_follow(draft, seen)


def test_configuration_errors(tiny_model_dir, tmp_path) -> None:
    target = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="speculative_config.model"):
        _make(target, {"method": "draft_model"})
    with pytest.raises(ValueError, match="speculative_config.model"):
        _make(target, {"method": "ngram", "model": target})
    with pytest.raises(ValueError, match="speculative_config.model"):
        _make(target, {"model": str(tmp_path / "missing")})
    # a draft with another vocabulary
    from transformers import LlamaConfig, LlamaForCausalLM
    small_vocab = tmp_path / "small_vocab"
    LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1)).save_pretrained(small_vocab)
    with pytest.raises(ValueError, match="vocabulary"):
        _make(target, {"model": str(small_vocab)})


# ---- a target with sliding-window layers -----------------------------------------------------

def _layout(llm: LLM):
    return llm.llm_engine.engine_core.executor.kv_cache_layout


def test_a_draft_model_keeps_a_sliding_targets_cache_one_full_group(tiny_model_dir) -> None:
    """A draft model keeps its K/V in the target's blocks through one block table, so with one
    the cache of an interleaved sliding target (Gemma 3) is one full-attention group (no
    block freed early); greedy answers equal the engine without speculation, whose cache has
    three groups and frees blocks out of the window."""
    target = tiny_model_dir("gemma3")
    prompts = _prompts(4, seed=14)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = _make(target, None, block_size=4, num_gpu_blocks_override=512)
    assert _layout(plain).num_groups == 3
    want = _ids(plain.generate(prompts, params, use_tqdm=False))
    llm = _make(target, _spec(target, k=3), block_size=4, num_gpu_blocks_override=512)
    assert _layout(llm).is_single_full
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert _stats(llm).spec_num_drafts > 0


def test_ngram_drafts_on_a_sliding_target_free_blocks_as_usual(tiny_model_dir) -> None:
    """Host drafts need no lookahead slots: the sliding groups stay, and verify steps that
    step back over rejected drafts never move a window backwards."""
    target = tiny_model_dir("gemma3")
    pattern = list(range(300, 340))
    prompts = [{"prompt_token_ids": pattern * 3 + pattern[:i]} for i in (5, 17, 29)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4, "adaptive_draft_length": False}
    plain = _make(target, None, block_size=4, num_gpu_blocks_override=512)
    want = _ids(plain.generate(prompts, params, use_tqdm=False))
    llm = _make(target, spec, block_size=4, num_gpu_blocks_override=512)
    assert _layout(llm).num_groups == 3
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert _stats(llm).spec_num_draft_tokens > 0
