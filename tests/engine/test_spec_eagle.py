"""EAGLE and EAGLE-3 heads (random weights, in the published checkpoint layouts) drafting for a
tiny Llama target on the CPU: every draft the engine makes equals a plain-torch reference of
the heads' math (no KV cache: each draft recomputed over the whole context from transformers'
hidden states of the target), and the answers equal the engine without speculation, greedy
and seeded; the configuration's errors."""
from __future__ import annotations

import math
import os
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from folio import LLM, SamplingParams

from model_utils import load_hf_model
from spec_overlap import watch_queued_steps
from test_invariants import _prompts

VOCAB = 49152
H, HEADS, KV_HEADS = 64, 4, 2
HEAD_DIM = H // HEADS
DRAFT_VOCAB = 512


def _matrix(gen: torch.Generator, out: int, inp: int) -> torch.Tensor:
    # wide weights, so the heads' logits are far from ties
    return torch.randn(out, inp, generator=gen) * (2.0 / math.sqrt(inp))


def _norm(gen: torch.Generator, h: int = H) -> torch.Tensor:
    return 1.0 + 0.3 * torch.randn(h, generator=gen)


def _layer(gen: torch.Generator, prefix: str, attn_in: int, input_norm: bool,
           h: int = H) -> dict:
    hd = h // HEADS
    w = {f"{prefix}self_attn.q_proj.weight": _matrix(gen, HEADS * hd, attn_in),
         f"{prefix}self_attn.k_proj.weight": _matrix(gen, KV_HEADS * hd, attn_in),
         f"{prefix}self_attn.v_proj.weight": _matrix(gen, KV_HEADS * hd, attn_in),
         f"{prefix}self_attn.o_proj.weight": _matrix(gen, h, HEADS * hd),
         f"{prefix}mlp.gate_proj.weight": _matrix(gen, 2 * h, h),
         f"{prefix}mlp.up_proj.weight": _matrix(gen, 2 * h, h),
         f"{prefix}mlp.down_proj.weight": _matrix(gen, h, 2 * h),
         f"{prefix}post_attention_layernorm.weight": _norm(gen, h)}
    if input_norm:
        w[f"{prefix}input_layernorm.weight"] = _norm(gen, h)
    return w


def build_head(path: str, method: str, seed: int = 0, *, hidden: int = H, vocab: int = VOCAB,
               aux_layers: tuple[int, int, int] = (0, 1, 2)) -> dict[str, torch.Tensor]:
    """An EAGLE head (2 layers, fc with a bias, the target's embedding) or an EAGLE-3 head
    (midlayer, own embedding, a 512-token draft vocabulary mapped by d2t), for a target of
    `hidden` and `vocab`, saved as config.json + model.safetensors."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    gen = torch.Generator().manual_seed(seed)
    layers = 2 if method == "eagle" else 1
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, vocab_size=vocab, rms_norm_eps=1e-6,
                         max_position_embeddings=1024)
    if method == "eagle":
        config.architectures = ["EagleLlamaForCausalLM"]
        w = {"fc.weight": _matrix(gen, hidden, 2 * hidden),
             "fc.bias": 0.1 * torch.randn(hidden, generator=gen)}
        w.update(_layer(gen, "layers.0.", hidden, input_norm=False, h=hidden))
        w.update(_layer(gen, "layers.1.", hidden, input_norm=True, h=hidden))
    else:
        draft_vocab = min(DRAFT_VOCAB, vocab)
        config.architectures = ["LlamaForCausalLMEagle3"]
        config.draft_vocab_size = draft_vocab
        config.eagle_aux_hidden_state_layer_ids = list(aux_layers)
        targets = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
        w = {"fc.weight": _matrix(gen, hidden, 3 * hidden),
             "embed_tokens.weight": torch.randn(vocab, hidden, generator=gen),
             "midlayer.input_layernorm.weight": _norm(gen, hidden),
             "midlayer.hidden_norm.weight": _norm(gen, hidden),
             "norm.weight": _norm(gen, hidden),
             "lm_head.weight": _matrix(gen, draft_vocab, hidden),
             "d2t": targets - torch.arange(draft_vocab),
             "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, targets, True)}
        w.update(_layer(gen, "midlayer.", 2 * hidden, input_norm=False, h=hidden))
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    return w


# ---- the reference: the heads' math in plain torch, over the whole context ---------------

def _rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def _rope(x, positions):
    """Llama's rotary embedding (base 10000, halves rotated) on [S, heads, HEAD_DIM]."""
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    angles = positions[:, None].float() * inv[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    half = HEAD_DIM // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _attention(x, w, prefix):
    S = x.shape[0]
    positions = torch.arange(S)
    q = _rope((x @ w[prefix + "q_proj.weight"].T).view(S, HEADS, HEAD_DIM), positions)
    k = _rope((x @ w[prefix + "k_proj.weight"].T).view(S, KV_HEADS, HEAD_DIM), positions)
    v = (x @ w[prefix + "v_proj.weight"].T).view(S, KV_HEADS, HEAD_DIM)
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(S, HEADS * HEAD_DIM)
    return out @ w[prefix + "o_proj.weight"].T


def _mlp(x, w, prefix):
    return (F.silu(x @ w[prefix + "gate_proj.weight"].T) * (x @ w[prefix + "up_proj.weight"].T)) \
        @ w[prefix + "down_proj.weight"].T


def _eagle_rows(method, w, tokens, feats, target):
    """(state for logits, state for the next step) of every row (token q+1, feature q)."""
    if method == "eagle":
        x = torch.cat([target.model.embed_tokens.weight[tokens], feats], -1) @ w["fc.weight"].T \
            + w["fc.bias"]
        for i in range(2):
            p = f"layers.{i}."
            h = x + _attention(x if i == 0 else _rms(x, w[p + "input_layernorm.weight"]), w,
                               p + "self_attn.")
            x = h + _mlp(_rms(h, w[p + "post_attention_layernorm.weight"]), w, p + "mlp.")
        return x, x
    p = "midlayer."
    e = _rms(w["embed_tokens.weight"][tokens], w[p + "input_layernorm.weight"])
    h = _rms(feats, w[p + "hidden_norm.weight"])
    r = feats + _attention(torch.cat([e, h], -1), w, p + "self_attn.")
    prenorm = r + _mlp(_rms(r, w[p + "post_attention_layernorm.weight"]), w, p + "mlp.")
    return _rms(prenorm, w["norm.weight"]), prenorm


def _greedy(method, w, state, target):
    if method == "eagle":
        return int((state @ target.lm_head.weight.T).argmax())
    draft = int((state @ w["lm_head.weight"].T).argmax())
    return draft + int(w["d2t"][draft])


def reference_drafts(method, w, target, context: list[int], k: int) -> list[int]:
    with torch.no_grad():
        out = target(torch.tensor([context]), output_hidden_states=True)
        if method == "eagle":
            feats = out.hidden_states[-1][0]             # the final, normed state
        else:                                            # streams entering layers 0, 1, 2
            feats = torch.cat([out.hidden_states[i][0] for i in (0, 1, 2)], -1) @ w["fc.weight"].T
        tokens = list(context[1:])
        feats = feats[:len(context) - 1]
        drafts = []
        for _ in range(k):
            logit_state, next_state = _eagle_rows(method, w, torch.tensor(tokens), feats, target)
            drafts.append(_greedy(method, w, logit_state[-1], target))
            tokens.append(drafts[-1])
            feats = torch.cat([feats, next_state[-1:]])
        return drafts


# ---- the engine ---------------------------------------------------------------------------

def _make(target: str, spec: dict | None, **overrides) -> LLM:
    kwargs = dict(dtype="float32", kv_cache_dtype="float32", max_model_len=512,
                  num_gpu_blocks_override=256, max_num_seqs=8, device="cpu",
                  speculative_config=spec)
    kwargs.update(overrides)
    return LLM(target, **kwargs)


def _ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def check_drafts_and_outputs(target: str, spec: dict, reference: Callable[[list[int]], list[int]],
                             *, seed: int, max_tokens: int, first: int, at_least: int) -> None:
    """Greedy and seeded answers with `spec` equal the engine's without speculation, and each
    of the first `first` proposals (k = 3 drafts) equals `reference(context)`; at least
    `at_least` of them checked. No prefix cache: a cached block's head entries were written
    with the token after the block in another request (lossless still, but not the
    reference's drafts)."""
    llm = _make(target, spec, enable_prefix_caching=False)
    seen = record_drafts(llm)
    prompts = _prompts(4, seed=seed)
    params = [SamplingParams(temperature=0, max_tokens=max_tokens),
              SamplingParams(temperature=0.8, seed=5, max_tokens=max_tokens)] * 2
    got = _ids(llm.generate(prompts, params, use_tqdm=False))
    assert got == _ids(_make(target, None).generate(prompts, params, use_tqdm=False))
    checked = 0
    for context, drafts in seen[:first]:
        assert len(drafts) == 3
        assert drafts == reference(context), len(context)
        checked += 1
    assert checked >= at_least


def record_drafts(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(context, drafts) of every proposal the engine's drafter makes from now on."""
    drafter = llm.llm_engine.engine_core.scheduler.drafter
    seen, propose = [], drafter.propose

    def recording(request):
        drafts = propose(request)
        seen.append((list(request.all_token_ids), list(drafts)))
        return drafts

    drafter.propose = recording
    return seen


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_follow_the_reference_and_outputs_equal(tiny_model_dir, tmp_path, method) -> None:
    target = tiny_model_dir("llama")
    head = str(tmp_path / method)
    weights = build_head(head, method, seed=3 if method == "eagle" else 4)
    spec = {"method": method, "model": head, "num_speculative_tokens": 3,
            "adaptive_draft_length": False}
    check_drafts_and_outputs(
        target, spec,
        lambda context: reference_drafts(method, weights, load_hf_model(target), context, 3),
        seed=21, max_tokens=16, first=20, at_least=10)


def test_the_name_picks_the_method_and_bad_heads_are_refused(tiny_model_dir, tmp_path) -> None:
    from folio.config import SpeculativeConfig
    assert SpeculativeConfig(model="org/EAGLE3-LLaMA3.1-8B").method == "eagle3"
    assert SpeculativeConfig(model="org/EAGLE-LLaMA3-8B").method == "eagle"
    assert SpeculativeConfig(model="org/Llama-3.2-1B").method == "draft_model"
    target = tiny_model_dir("llama")
    head = str(tmp_path / "head")
    build_head(head, "eagle3")
    with pytest.raises(ValueError, match="EAGLE head"):
        _make(target, {"method": "eagle", "model": head})   # an EAGLE-3 checkpoint as EAGLE
    with pytest.raises(ValueError, match="no multi-token-prediction"):
        _make(target, {"method": "mtp"})   # a Llama has no MTP layers
    other = str(tmp_path / "other")      # an EAGLE-3 head made for a target twice as wide
    build_head(other, "eagle3", hidden=2 * H)
    with pytest.raises(ValueError, match=r"speculative_config.model: .*fc.weight.*target's "
                                         r"width"):
        _make(target, {"method": "eagle3", "model": other})


def test_a_resting_draft_length_stops_the_head_drafting(tiny_model_dir, tmp_path,
                                                         monkeypatch) -> None:
    """While the adaptive draft length rests at k = 0 the step message says so
    (propose_drafts) and the head only writes its cache: on the CPU an EAGLE head's drafting
    cost more than the step, so a resting engine had run 2.3x slower than without
    speculation (a trained SmolLM2 head, tools/train_eagle_head.py). Outputs stay the
    plain engine's, and drafting resumes for the policy's probes."""
    from folio.core.spec.policy import AdaptiveDraftLength
    target = tiny_model_dir("llama")
    spec = _resting_spec(tmp_path)
    prompts = _prompts(1, seed=8)
    params = SamplingParams(temperature=0, max_tokens=48)
    want = _ids(_make(target, None).generate(prompts, params, use_tqdm=False))

    def drafting_calls(llm: LLM) -> list[int]:
        proposer = llm.llm_engine.engine_core.executor.worker.runner.draft_proposer
        calls, logits = [0], proposer.head.compute_logits

        def counting(hidden):
            calls[0] += 1
            return logits(hidden)

        proposer.head.compute_logits = counting
        return calls

    busy = _make(target, dict(spec, adaptive_draft_length=False), enable_prefix_caching=False)
    busy_calls = drafting_calls(busy)
    assert _ids(busy.generate(prompts, params, use_tqdm=False)) == want
    monkeypatch.setattr(AdaptiveDraftLength, "_best_k", lambda self, *a: 0)
    resting = _make(target, spec, enable_prefix_caching=False)
    calls = drafting_calls(resting)
    assert _ids(resting.generate(prompts, params, use_tqdm=False)) == want
    # each drafting step asks the head k times (every step at a fixed k); resting, only the
    # first verdict's and the probe's (after 32 steps without drafts) steps draft
    assert busy_calls[0] >= 3 * 10
    assert 0 < calls[0] <= 3 * 3, (calls[0], busy_calls[0])


def _resting_spec(tmp_path) -> dict:
    """A random EAGLE head (seed 3) written under tmp_path, drafting 3 tokens: the resting
    tests' speculative config."""
    head = str(tmp_path / "eagle")
    build_head(head, "eagle", seed=3)
    return {"method": "eagle", "model": head, "num_speculative_tokens": 3}


def _resting_run(target: str, spec: dict, prompts: list[str], params: SamplingParams,
                 on_engine: Callable[[LLM], None] | None = None,
                 **overrides) -> tuple[list[list[int]], list, dict[str, torch.Tensor], dict]:
    """Generate with `spec` (the adaptive draft length patched to rest by the caller) and
    return the answers, the drafts proposed (record_drafts), each request's head K/V at its
    positions [0, end of its last kept row) once the kept rows are written, and what the
    proposer saw: the most rows it kept at once, the steps its deferred writes ran and the
    preemptions. Every step message checks that no request leaving the batch keeps rows.
    `on_engine` is called with the engine before it generates."""
    llm = _make(target, spec, **overrides)
    if on_engine is not None:
        on_engine(llm)
    seen = record_drafts(llm)
    runner = llm.llm_engine.engine_core.executor.worker.runner
    proposer, batch = runner.draft_proposer, runner.input_batch
    deferred = proposer.deferred
    tables: dict[str, tuple[np.ndarray, int]] = {}
    info = {"most_kept": 0, "writes": 0, "preempted": 0}
    propose, update, write = proposer.propose, batch.update, deferred._write

    def recording_propose(inputs, batch_):
        for rid, pos in zip(inputs.req_ids, inputs.last_positions):
            row = batch_.requests[rid].row
            tables[rid] = (batch_.block_table[row, :batch_.num_blocks[row]].copy(), pos + 1)
        drafts = propose(inputs, batch_)
        info["most_kept"] = max(info["most_kept"], deferred.num_rows)
        return drafts

    def checked_update(step):
        leaving = [*step.finished_req_ids, *step.preempted_req_ids]
        assert not any(rid in deferred for rid in leaving), leaving
        info["preempted"] += len(step.preempted_req_ids)
        update(step)

    def counted_write(*args):
        info["writes"] += 1
        write(*args)

    proposer.propose, batch.update, deferred._write = recording_propose, checked_update, \
        counted_write
    answers = _ids(llm.generate(prompts, params, use_tqdm=False))
    deferred.flush(batch)   # the last steps' rows (their requests' finish not yet told)
    block = proposer.block_size
    cache = {rid: torch.stack([c[:, torch.as_tensor(blocks, dtype=torch.int64)]
                               .flatten(1, 2)[:, :end] for c in proposer.kv_caches])
             for rid, (blocks, end) in tables.items()}
    assert all(len(blocks) * block >= end for blocks, end in tables.values())
    return answers, seen, cache, info


def _rest_always(monkeypatch) -> None:
    """k = 0 verdicts: the head drafts only at the first verdict's and the probes' steps (a
    probe after 32 resting steps)."""
    from folio.core.spec.policy import AdaptiveDraftLength
    monkeypatch.setattr(AdaptiveDraftLength, "_best_k", lambda self, *a: 0)


def _assert_same_cache(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Equal to float32 rounding: 1e-5 of the entries' scale (batched and per-step passes sum
    in different orders; the entries reach ~15, the largest difference seen was 1.9e-5)."""
    assert got.keys() == want.keys()
    for rid in want:
        scale = want[rid].abs().max().item()
        torch.testing.assert_close(got[rid], want[rid], rtol=1e-5, atol=1e-5 * scale, msg=rid)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_resting_steps_write_the_head_cache_in_one_pass_before_drafting(
        tiny_model_dir, tmp_path, monkeypatch, method) -> None:
    """While no request drafts, the head's cache writes are kept back and go in as one chunk
    before the probe drafts: its drafts are the reference's (the head's cache whole), and its
    cache equals an engine's whose head wrote after every step (MAX_DEFERRED_ROWS = 0: the
    same steps, so the same target states)."""
    from folio.worker import spec_propose
    target = tiny_model_dir("llama")
    head = str(tmp_path / method)
    weights = build_head(head, method, seed=3 if method == "eagle" else 4)
    spec = {"method": method, "model": head, "num_speculative_tokens": 3}
    prompts = _prompts(1, seed=8)
    params = SamplingParams(temperature=0, max_tokens=48)
    _rest_always(monkeypatch)
    answers, seen, cache, info = _resting_run(target, spec, prompts, params,
                                              enable_prefix_caching=False)
    assert answers == _ids(_make(target, None).generate(prompts, params, use_tqdm=False))
    assert info["most_kept"] >= 30    # the rows of the 32 resting steps before the probe
    reference = load_hf_model(target)
    assert len(seen) >= 2             # the first verdict's drafts and the probe's
    for context, drafts in seen:
        assert drafts == reference_drafts(method, weights, reference, context, 3), len(context)
    monkeypatch.setattr(spec_propose, "MAX_DEFERRED_ROWS", 0)
    eager_answers, eager_seen, eager_cache, eager_info = _resting_run(
        target, spec, prompts, params, enable_prefix_caching=False)
    assert eager_info["most_kept"] == 0 and eager_answers == answers and eager_seen == seen
    _assert_same_cache(cache, eager_cache)


def test_async_scheduling_overlaps_resting_steps_with_the_same_head_cache(
        tiny_model_dir, tmp_path, monkeypatch) -> None:
    """An EAGLE-3 head beside async scheduling: resting steps overlap (their sampled tokens
    stay on the device and go into the kept rows from there), no step is queued while a
    drafting one is in flight, the drafts are the reference's, and the answers and the head's
    cache are those of the synchronous engine."""
    target = tiny_model_dir("llama")
    head = str(tmp_path / "eagle3")
    weights = build_head(head, "eagle3", seed=4)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    prompts = _prompts(2, seed=8)
    params = SamplingParams(temperature=0, max_tokens=48)
    _rest_always(monkeypatch)
    answers, _, cache, _ = _resting_run(target, spec, prompts, params,
                                        enable_prefix_caching=False, async_scheduling=False)
    watched: list[list[bool]] = []   # each step queued: whether one was in flight then
    async_answers, async_seen, async_cache, _ = _resting_run(
        target, spec, prompts, params, enable_prefix_caching=False, async_scheduling=True,
        on_engine=lambda llm: watched.append(watch_queued_steps(llm)))
    assert sum(watched[0]) >= 30
    assert async_answers == answers
    # (proposals fall a step later or earlier under async: the drafts are checked, not when)
    drafted = [(context, drafts) for context, drafts in async_seen if drafts]
    assert len(drafted) >= 2
    reference = load_hf_model(target)
    for context, drafts in drafted:
        assert drafts == reference_drafts("eagle3", weights, reference, context, 3), len(context)
    _assert_same_cache(async_cache, cache)


def test_async_drafting_steps_are_timed_for_the_draft_length(tiny_model_dir, tmp_path) -> None:
    """Under async scheduling a step whose drafts the head makes is finished before the next
    is queued, and timed, as a plain step when it verifies nothing: the adaptive draft
    length prices k = 0 on measured plain steps, as in the synchronous engine. Untimed, its
    plain curve stayed empty, k = 0 was priced on the verify steps' curve, and a random head
    drafted on until its acceptance estimate decayed (SmolLM2 with a random EAGLE head: 150
    drafts in six requests' first 64 tokens, against 12 synchronous)."""
    target = tiny_model_dir("llama")
    spec = _resting_spec(tmp_path)
    prompts = _prompts(4, seed=8)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = _ids(_make(target, None).generate(prompts, params, use_tqdm=False))
    llm = _make(target, spec, enable_prefix_caching=False, async_scheduling=True)
    core = llm.llm_engine.engine_core
    assert core.async_scheduling
    timed: list[tuple[int, bool]] = []   # (tokens, verify) of every step timed
    observe = core.scheduler.observe_step_time

    def recording(num_tokens, seconds, verify, *args):
        timed.append((num_tokens, verify))
        return observe(num_tokens, seconds, verify, *args)

    core.scheduler.observe_step_time = recording
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == want
    prefill = sum(len(ids) for ids in llm.get_tokenizer()(prompts)["input_ids"])
    # the prefill (whose drafts the head made) is timed as a plain step; after the first
    # verify step the policy times a plain decode step before it prices k = 0 on it
    assert timed[0] == (prefill, False), timed[:3]
    first_verify = next(i for i, (_, verify) in enumerate(timed) if verify)
    assert timed[first_verify + 1] == (len(prompts), False), timed[:first_verify + 3]


def test_leaving_requests_rows_are_written_before_their_blocks_go(tiny_model_dir, tmp_path,
                                                                  monkeypatch) -> None:
    """Few blocks: requests are preempted and finish while the head rests. Their kept rows go
    in when the step message tells the worker (before its batch drops their block tables, and
    before a request of that step can write the blocks), never at a later flush: a request
    recomputed under its id after a preemption gets only its new rows. The head cache then
    equals that of a head that wrote after every step."""
    from folio.worker import spec_propose
    target = tiny_model_dir("llama")
    spec = _resting_spec(tmp_path)
    prompts = _prompts(4, seed=14)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (12, 40, 24, 40)]
    small = dict(num_gpu_blocks_override=16, max_model_len=256, max_num_seqs=4)
    _rest_always(monkeypatch)
    answers, _, cache, info = _resting_run(target, spec, prompts, params, **small)
    assert info["preempted"] > 0
    assert answers == _ids(_make(target, None, **small).generate(prompts, params,
                                                                 use_tqdm=False))
    monkeypatch.setattr(spec_propose, "MAX_DEFERRED_ROWS", 0)
    _, _, eager_cache, eager_info = _resting_run(target, spec, prompts, params, **small)
    assert eager_info["preempted"] == info["preempted"]
    _assert_same_cache(cache, eager_cache)


def test_kept_rows_past_the_bound_are_written_at_once(tiny_model_dir, tmp_path,
                                                      monkeypatch) -> None:
    """Past MAX_DEFERRED_ROWS kept rows the head writes them at once, resting or not: the
    kept rows stay below the bound, and the cache is the same."""
    from folio.worker import spec_propose
    target = tiny_model_dir("llama")
    spec = _resting_spec(tmp_path)
    prompts = _prompts(1, seed=8)
    params = SamplingParams(temperature=0, max_tokens=48)
    _rest_always(monkeypatch)
    _, _, cache, info = _resting_run(target, spec, prompts, params, enable_prefix_caching=False)
    monkeypatch.setattr(spec_propose, "MAX_DEFERRED_ROWS", 8)
    _, _, bounded_cache, bounded_info = _resting_run(target, spec, prompts, params,
                                                     enable_prefix_caching=False)
    assert info["most_kept"] >= 30 and bounded_info["most_kept"] < 8
    # 32 resting steps' rows: 4 flushes of 8 where the unbounded run wrote them once
    assert bounded_info["writes"] >= info["writes"] + 3
    _assert_same_cache(bounded_cache, cache)


def test_a_head_beside_a_packed_cpu_target_is_int8(tmp_path) -> None:
    """Beside the default model (a GGUF kept packed on the CPU) the head's projections are
    int8 per channel (its float32 ones were the step's dearest part); the drafts may change,
    the greedy answers may not."""
    from folio.model.default_model import default_model_path
    from folio.model.layers import Linear
    head = str(tmp_path / "eagle")
    build_head(head, "eagle", seed=5, hidden=576)
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3,
            "adaptive_draft_length": False}
    prompts = _prompts(2, seed=9)
    params = SamplingParams(temperature=0, max_tokens=12)
    llm = LLM(default_model_path(), max_num_seqs=2, device="cpu", speculative_config=spec)
    proposer = llm.llm_engine.engine_core.executor.worker.runner.draft_proposer
    linears = [m for m in proposer.head.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    want = _ids(LLM(default_model_path(), max_num_seqs=2, device="cpu").generate(
        prompts, params, use_tqdm=False))
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == want
