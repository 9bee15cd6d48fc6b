"""Speculative decoding on the scheduler's side, without a model: the n-gram proposer, drafts
in the step message (k + 1 scheduled tokens, KV slots for them), the rollback of rejected
drafts, stops inside accepted tokens, the caps on drafts, preemption, the config."""
from __future__ import annotations

import pytest

from folio.config import SpeculativeConfig
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.request import Request, RequestStatus
from folio.core.scheduler import Scheduler
from folio.core.spec.drafter import HostDrafter, NgramDrafter, WorkerDrafts
from folio.core.spec.ngram import NgramProposer
from folio.core.step_messages import ModelRunnerOutput
from folio.sampling_params import SamplingParams

BS = 4
EOS = 2


# ---- the n-gram proposer ------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_longest_match() -> None:
    p = NgramProposer(1, 3)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert p.propose("a", tokens, 4) == [4, 5, 9, 1]
    # the same request growing: the index extends; 3,4,5 matched at its earlier occurrence
    assert p.propose("a", tokens + [4, 5], 3) == [9, 1, 2]


def test_ngram_prefers_the_longest_then_the_latest_occurrence() -> None:
    p = NgramProposer(1, 2)
    # "7" alone is followed by 8 (first) and 9 (later); "6 7" only by 8
    assert p.propose("a", [6, 7, 8, 0, 7, 9, 0, 6, 7], 1) == [8]
    assert p.propose("b", [5, 7, 8, 0, 7, 9, 0, 6, 7], 1) == [9]


def test_ngram_respects_min_n_k_and_the_end_of_context() -> None:
    p = NgramProposer(2, 3)
    assert p.propose("a", [1, 2, 3, 1], 4) == []          # only a 1-gram matches
    assert p.propose("b", [1, 2, 3, 1, 2], 4) == [3, 1, 2]   # capped by the context's end
    assert p.propose("c", [1, 2, 3, 1, 2], 0) == []
    assert p.propose("d", [1], 4) == []
    p.drop("b")
    assert "b" not in p._indexes


def test_ngram_matches_a_brute_force_search() -> None:
    import random
    rng = random.Random(0)
    p = NgramProposer(2, 4)
    tokens: list[int] = []
    for step in range(300):
        tokens.append(rng.randrange(6))
        got = p.propose("r", tokens, 3)
        want: list[int] = []
        for n in range(min(4, len(tokens) - 1), 1, -1):
            tail = tokens[-n:]
            starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tail]
            if starts:
                want = tokens[starts[-1] + n:starts[-1] + n + 3]
                break
        assert got == want, (step, tokens[-8:])


def test_speculative_config_validates_like_vllm() -> None:
    cfg = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, '
                                      '"prompt_lookup_max": 4}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 4, 4)
    assert (SpeculativeConfig().prompt_lookup_min, SpeculativeConfig().prompt_lookup_max) \
        == (5, 5)     # vLLM's defaults
    assert SpeculativeConfig().num_speculative_tokens == 4
    assert SpeculativeConfig(method="suffix").num_speculative_tokens == 24
    assert SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=40) \
        .num_speculative_tokens == 32
    for bad, field in [({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "nope"}, "method"),
                       ({"method": "mtp", "model": 3}, "speculative_config.model"),
                       ({"method": "eagle3"}, "speculative_config.model"),
                       ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2},
                        "prompt_lookup_min"),
                       ({"method": "ngram", "k": 3}, "unknown keys"),
                       ({"method": "suffix", "suffix_decoding_min_token_prob": 2},
                        "suffix_decoding_min_token_prob"),
                       ({"method": "suffix", "suffix_decoding_max_tree_depth": 0},
                        "suffix_decoding_max_tree_depth"),
                       ({"method": "ngram", "adaptive_draft_length": "no"},
                        "adaptive_draft_length")]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.from_json(bad)
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.from_json("{method")


def test_vllm_keys_disable_by_batch_size_and_draft_tp_parse_and_are_checked() -> None:
    cfg = SpeculativeConfig.from_json({"method": "ngram", "disable_by_batch_size": 8,
                                       "draft_tensor_parallel_size": 1})
    assert (cfg.disable_by_batch_size, cfg.draft_tensor_parallel_size) == (8, 1)
    assert SpeculativeConfig.from_json({"method": "deepseek_mtp"}).method == "mtp"
    # vLLM's older spellings of prompt lookup, and keys folio accepts without using
    for legacy in ({"method": "[ngram]"}, {"model": "[ngram]"}, {"model": "ngram"},
                   {"method": "ngram", "model": "[ngram]"}):
        cfg = SpeculativeConfig.from_json({**legacy, "num_speculative_tokens": 3})
        assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("ngram", None, 3)
    cfg = SpeculativeConfig.from_json({"method": "ngram", "enforce_eager": True,
                                       "code_revision": "main", "disable_log_stats": False})
    assert cfg.method == "ngram" and not hasattr(cfg, "enforce_eager")
    with pytest.raises(ValueError, match=r"unknown keys \['max_model_len'\]"):
        SpeculativeConfig.from_json({"method": "ngram", "max_model_len": 512})
    for bad, field in [({"disable_by_batch_size": 1}, "disable_by_batch_size"),
                       ({"disable_by_batch_size": True}, "disable_by_batch_size"),
                       ({"draft_tensor_parallel_size": 0}, "draft_tensor_parallel_size")]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.from_json({"method": "ngram", **bad})
    from folio.config import EngineConfig, ParallelConfig
    config = EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2),
                          speculative=SpeculativeConfig(draft_tensor_parallel_size=1))
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size \(1\).*target's"):
        config.finalize(256)


# ---- the scheduler ------------------------------------------------------------------------

class FixedDrafter(HostDrafter):
    """Proposes `drafts` for every request."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts
        self.dropped: list[str] = []

    def propose(self, request: Request) -> list[int]:
        return list(self.drafts)

    def drop(self, request: Request) -> None:
        self.dropped.append(request.request_id)


class CountingDrafter(FixedDrafter):
    def __init__(self, drafts: list[int]) -> None:
        super().__init__(drafts)
        self.calls = 0

    def propose(self, request: Request) -> list[int]:
        self.calls += 1
        return super().propose(request)


def make(drafter, *, num_blocks: int = 64, budget: int = 64, max_model_len: int = 256,
         policy: str = "fcfs", **kw):
    return Scheduler(kv_cache_manager=KVCacheManager(num_blocks, BS, True), max_num_seqs=8,
                     max_num_batched_tokens=budget, max_model_len=max_model_len,
                     drafter=drafter, policy=policy, **kw)


def request(rid: str, prompt_len: int = 6, priority: int = 0, first: int = 100,
            **params) -> Request:
    params.setdefault("max_tokens", 20)
    params.setdefault("temperature", 0)
    return Request(rid, list(range(first, first + prompt_len)), SamplingParams(**params), (EOS,),
                   block_size=BS, max_model_len=256, priority=priority)


def reply(tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=list(tokens), sampled_token_ids=list(tokens.values()))


def test_drafts_are_scheduled_verified_and_rolled_back() -> None:
    drafter = FixedDrafter([7, 8, 9])
    s = make(drafter)
    r = request("a")
    s.add_request(r)
    step = s.schedule()                      # the prefill
    assert step.message.num_scheduled_tokens == {"a": 6}
    assert step.message.scheduled_spec_decode_tokens == {}
    s.update_from_output(step, reply({"a": [50]}))
    assert r.spec_token_ids == [7, 8, 9]     # drafted once the first token is known

    step = s.schedule()                      # verify: the last token and three drafts
    assert step.message.num_scheduled_tokens == {"a": 4}
    assert step.message.scheduled_spec_decode_tokens == {"a": [7, 8, 9]}
    assert step.message.sampling_req_ids == ["a"]
    assert r.num_computed_tokens == 6 + 4
    assert len(s.kv.get_block_ids("a")[0]) * BS >= 10
    # two drafts accepted, then the model's own token
    out = s.update_from_output(step, reply({"a": [7, 8, 60]}))
    assert out[0].new_token_ids == [7, 8, 60]
    assert r.output_token_ids == [50, 7, 8, 60]
    # the rejected draft's slot is given back: computed = every token but the newest
    assert r.num_computed_tokens == len(r.all_token_ids) - 1 == 9
    stats = s.stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens,
            stats.spec_num_accepted_tokens, stats.spec_accepted_per_pos) == (1, 3, 2, [1, 1, 0])
    assert s.spec_stats.mean_acceptance_length == 3.0

    step = s.schedule()                      # the next verify starts after the kept tokens
    assert step.message.num_scheduled_tokens == {"a": 4}
    assert step.scheduled[0].num_computed_tokens == 9


def test_drafts_made_by_the_worker_with_slots_for_them() -> None:
    """A draft model's drafts come in the runner output; every step allocates k slots past
    its tokens (the draft model writes its drafts' keys and values there), up to
    max_model_len, and none of them enter the prefix cache."""
    drafter = WorkerDrafts(SpeculativeConfig(model="draft", num_speculative_tokens=3,
                                             adaptive_draft_length=False))
    s = make(drafter, max_model_len=40)
    r = request("a", prompt_len=BS)          # the prompt fills one block exactly
    s.add_request(r)
    step = s.schedule()
    assert len(s.kv.get_block_ids("a")[0]) == 2  # lookahead: 3 slots past the prompt
    out = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[50]],
                            draft_token_ids={"a": [7, 8, 9, 10]})
    s.update_from_output(step, out)
    assert r.spec_token_ids == [7, 8, 9]     # at most k
    step = s.schedule()
    assert step.message.scheduled_spec_decode_tokens == {"a": [7, 8, 9]}
    # this step's tokens end at BS + 4; three more slots for the next drafts
    assert len(s.kv.get_block_ids("a")[0]) * BS >= BS + 4 + 3
    s.update_from_output(step, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7, 60]]))
    assert r.spec_token_ids == []            # this output carried no drafts
    assert s.kv.allocate_slots(r, 1, num_lookahead_tokens=0) == []
    # near max_model_len the lookahead stops there
    assert s._lookahead(39) == 1 and s._lookahead(40) == 0


def test_a_stop_inside_the_accepted_tokens_drops_the_rest() -> None:
    s = make(FixedDrafter([EOS, 5]))
    r = request("a")
    s.add_request(r)
    s.update_from_output(s.schedule(), reply({"a": [50]}))
    step = s.schedule()
    out = s.update_from_output(step, reply({"a": [EOS, 5, 6]}))
    assert out[0].new_token_ids == [EOS] and out[0].finish_reason == "stop"
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [50, EOS]
    assert s.drafter.dropped == ["a"]   # the proposer forgets a finished request


def test_drafts_are_capped_by_max_tokens_the_model_length_and_the_budget() -> None:
    s = make(FixedDrafter([7, 8, 9, 10]))
    r = request("a", max_tokens=3)
    s.add_request(r)
    s.update_from_output(s.schedule(), reply({"a": [50]}))
    step = s.schedule()      # one output so far: at most 2 more, so one draft
    assert step.message.scheduled_spec_decode_tokens == {"a": [7]}
    out = s.update_from_output(step, reply({"a": [7, 8]}))
    assert out[0].finish_reason == "length" and r.output_token_ids == [50, 7, 8]

    s = make(FixedDrafter([7, 8, 9, 10]), budget=6)
    s.add_request(request("b", prompt_len=5))
    s.update_from_output(s.schedule(), reply({"b": [50]}))
    s.add_request(request("c", prompt_len=3))
    step = s.schedule()      # b: 1 + 4 drafts = 5 of the budget of 6; c's prefill gets 1
    assert step.message.num_scheduled_tokens == {"b": 5, "c": 1}


def test_every_request_speculates() -> None:
    """Every sampling option is verified (logprobs, bias, penalties...), and a grammar (a
    mask per draft position, filled by the engine layer): every request drafts."""
    s = make(FixedDrafter([7, 8]))
    plain, logprobs, penalty, grammar = request("a"), request("b", logprobs=2), \
        request("c", repetition_penalty=1.2), request("d")
    class AnyGrammar:       # a grammar state that accepts everything: enough to be one
        ready = True

        def accept_tokens(self, tokens):
            return True
    grammar.structured_output = AnyGrammar()
    for r in (plain, logprobs, penalty, grammar):
        s.add_request(r)
    s.update_from_output(s.schedule(), reply({"a": [50], "b": [50], "c": [50], "d": [50]}))
    step = s.schedule()
    assert step.message.scheduled_spec_decode_tokens == {r: [7, 8] for r in "abcd"}
    assert step.message.num_scheduled_tokens == {r: 3 for r in "abcd"}
    assert step.message.has_grammar


def test_preemption_drops_the_drafts() -> None:
    s = make(FixedDrafter([7, 8]), num_blocks=4)
    r1, r2 = request("a", prompt_len=6), request("b", prompt_len=6)
    s.add_request(r1)
    s.add_request(r2)
    step = s.schedule()
    s.update_from_output(step, reply({rid: [50] for rid in step.message.num_scheduled_tokens}))
    step = s.schedule()      # 4 blocks of 4: both cannot grow by 3, the later is preempted
    assert step.preempted_req_ids == ["b"]
    assert r2.spec_token_ids == [] and r2.status == RequestStatus.PREEMPTED


def test_priority_preempts_a_speculating_request_and_it_resumes() -> None:
    """Priority scheduling: when blocks run short for two verifying requests, the less urgent
    one (here the earlier) is preempted, its drafts dropped; once back it recomputes and
    drafts again."""
    s = make(FixedDrafter([7, 8]), num_blocks=5, policy="priority")
    low = request("low", prompt_len=6, priority=5)
    high = request("high", prompt_len=6, first=300)     # no prefix shared with low
    s.add_request(low)
    s.add_request(high)
    step = s.schedule()
    s.update_from_output(step, reply({"low": [50], "high": [60]}))
    step = s.schedule()          # 2 + 2 of 5 blocks; each verify step needs a third
    assert step.preempted_req_ids == ["low"] and low.spec_token_ids == []
    assert step.message.scheduled_spec_decode_tokens == {"high": [7, 8]}
    s.update_from_output(step, reply({"high": [7, 8, 61]}))
    s.abort_requests(["high"])
    step = s.schedule()          # low back: its first block from the prefix cache, the rest
    assert step.message.num_scheduled_tokens == {"low": 3}   # (2 prompt tokens + 1) recomputed
    s.update_from_output(step, reply({"low": [51]}))
    step = s.schedule()
    assert step.message.scheduled_spec_decode_tokens == {"low": [7, 8]}


def test_under_async_scheduling_a_draft_models_step_runs_ahead_with_its_slots() -> None:
    """A draft model beside async scheduling (the engine queues a step while another is in
    flight only when that one drafts nothing, the draft length resting): the step scheduled
    while the request's token is in flight gets that token's slot and the k slots past it
    that a later drafting step's chain writes."""
    s = Scheduler(kv_cache_manager=KVCacheManager(64, BS, True), max_num_seqs=2,
                  max_num_batched_tokens=16, max_model_len=64, async_scheduling=True,
                  drafter=WorkerDrafts(SpeculativeConfig(num_speculative_tokens=2)),
                  adaptive_draft_length=False)
    s.add_request(request("a", prompt_len=2 * BS - 2))
    prefill = s.schedule()                  # positions 0 .. 2 BS - 3, drafts' slots to 2 BS - 1
    assert len(s.kv.get_block_ids("a")[0]) == 2
    decode = s.schedule()                   # the prefill's token in flight, at 2 BS - 2
    assert decode.message.num_scheduled_tokens == {"a": 1}
    # its drafts' slots 2 BS - 1 and 2 BS: a third block
    assert len(s.kv.get_block_ids("a")[0]) == 3
    s.update_from_output(prefill, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[50]]))
    s.update_from_output(decode, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[51]],
                                                   draft_token_ids={"a": [9, 10]}))
    step = s.schedule()
    assert step.message.scheduled_spec_decode_tokens == {"a": [9, 10]}


def test_under_async_scheduling_drafts_wait_for_the_token_in_flight() -> None:
    """A host drafter beside async scheduling: a step scheduled while the request's latest
    token is in flight verifies nothing (its drafts were made before that token); the
    engine, told by next_step_drafts, finishes that step first and the next one verifies."""
    s = Scheduler(kv_cache_manager=KVCacheManager(64, BS, True), max_num_seqs=8,
                  max_num_batched_tokens=64, max_model_len=256, async_scheduling=True,
                  drafter=FixedDrafter([7, 8]), adaptive_draft_length=False)
    s.add_request(request("a"))
    prefill = s.schedule()
    assert not s.next_step_drafts()          # no drafts yet: the decode step may overlap
    decode = s.schedule()                    # scheduled with the prefill's token in flight
    assert decode.message.num_scheduled_tokens == {"a": 1}
    s.update_from_output(prefill, reply({"a": [50]}))   # drafts made, a token behind
    assert s.next_step_drafts()              # the engine finishes the step in flight first...
    step = s.schedule()                      # (were it not to, the stale drafts stay unused)
    assert step.message.scheduled_spec_decode_tokens == {}
    s.update_from_output(decode, reply({"a": [51]}))
    s.update_from_output(step, reply({"a": [52]}))
    step = s.schedule()                      # every token known: the drafts are verified
    assert step.message.scheduled_spec_decode_tokens == {"a": [7, 8]}
    assert step.message.num_scheduled_tokens == {"a": 3}


def test_a_reply_that_is_not_a_verification_of_the_drafts_is_an_error() -> None:
    s = make(FixedDrafter([7, 8]))
    s.add_request(request("a"))
    s.update_from_output(s.schedule(), reply({"a": [50]}))
    step = s.schedule()
    with pytest.raises(RuntimeError, match="verify step"):
        s.update_from_output(step, reply({"a": [9, 8, 1]}))


def test_the_ngram_drafter_reads_the_request_tokens() -> None:
    d = NgramDrafter(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1,
                                       prompt_lookup_max=2))
    r = Request("a", [1, 2, 3, 1], SamplingParams(), (EOS,), block_size=BS, max_model_len=64)
    assert d.propose(r) == [2, 3]
    d.drop(r)


# ---- the adaptive draft length ------------------------------------------------------------

def test_adaptive_draft_length_maximises_tokens_per_second() -> None:
    from folio.core.spec.policy import AdaptiveDraftLength
    policy = AdaptiveDraftLength()
    # nothing measured: drafts are tried
    assert policy.choose({"a": 4}, 0) == 4
    # steps up to 16 tokens cost the same (the weights' reading), then 1 ms per token
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for _ in range(20):
            for verify in (False, True):
                policy.observe_step(tokens, 0.010 + 0.001 * max(tokens - 16, 0), verify)
    assert abs(policy.cost(5) - 0.010) < 1e-9 and abs(policy.cost(96) - 0.090) < 1e-3
    # batch 1: every draft is nearly free
    assert policy.choose({"a": 8}, 0) == 8
    # batch 64 decoding, all drafting: past the knee a draft costs a token's compute,
    # more than the expected gain at acceptance 0.7 per step of 10 + 48 ms
    assert policy.choose({str(i): 4 for i in range(64)}, 0) == 0
    # a rejected request's low acceptance makes drafting at batch 4 not pay beyond the knee
    for _ in range(10):
        policy.observe_acceptance("b", 4, 0)
    assert policy.acceptance["b"] < 0.05
    assert policy.choose({"b": 4}, 30) == 0 and policy.choose({"a": 4}, 0) == 4
    policy.drop("b")
    assert "b" not in policy.acceptance


def test_drafting_steps_in_a_bucket_do_not_make_drafts_look_free() -> None:
    """At batch 64 plain steps (64 tokens) and drafting ones (64 + 56) share a size bucket;
    the bucket is a point at its steps' mean, so a step costs what it measured: 1 ms per
    token here, plain or drafting."""
    from folio.core.spec.policy import AdaptiveDraftLength
    policy = AdaptiveDraftLength()
    policy.observe_step(32, 0.032, True)
    for _ in range(30):
        policy.observe_step(64, 0.064, True)
        policy.observe_step(120, 0.120, True)
    assert abs(policy.cost(64) - 0.064) < 2e-3 and abs(policy.cost(120) - 0.120) < 2e-3
    # every token costs the same: drafts that are kept half the time do not pay
    drafting = {str(i): 4 for i in range(64)}
    for rid in drafting:
        for _ in range(10):
            policy.observe_acceptance(rid, 4, 1)
    assert policy.choose(drafting, 0) == 0


def test_a_k0_verdict_is_probed_again_with_growing_waits() -> None:
    """A noisy time (another process held the core) must not turn speculation off for
    good: after some k = 0 steps one step drafts in full, its time replaces the stale
    figure, and the wait doubles while probes confirm k = 0. The probe's wait is priced: a
    verify step that looks 20x dearer than a plain one waits the longest priced wait,
    PRICED_WAIT_FACTOR x probe_after, not the 1 % rule's ~1,900 steps."""
    from folio.core.spec.policy import AdaptiveDraftLength
    policy = AdaptiveDraftLength()
    for tokens in (2, 4, 8):
        policy.observe_step(tokens, 0.200, True)   # noisy: steps with drafts look 20x dearer
    for _ in range(AdaptiveDraftLength.STALE_AFTER_STEPS + 1):
        policy.observe_step(1, 0.010, False)   # the engine decodes without drafts meanwhile
        policy.observe_step(1, 0.010, True)
    wait = policy.PRICED_WAIT_FACTOR * policy.MIN_PROBE_AFTER
    choices = [policy.choose({"a": 7}, 0) for _ in range(wait)]
    assert choices[:-1] == [0] * (wait - 1) and choices[-1] == 7
    policy.observe_step(8, 0.010, True)  # the probe's step: the true cost replaces the stale one
    assert policy.choose({"a": 7}, 0) == 7 and policy.probe_after == policy.MIN_PROBE_AFTER
    # a real k = 0 (every token costs) is probed ever more rarely
    confirm = AdaptiveDraftLength()
    for tokens in (1, 2, 4, 8, 16):
        confirm.observe_step(tokens, 0.001 * tokens, True)
    for _ in range(10):
        confirm.observe_acceptance("b", 4, 0)
    waits, since = [], 0
    for _ in range(5000):
        since += 1
        if confirm.choose({"b": 4}, 30) > 0:
            waits.append(since)
            since = 0
    m = AdaptiveDraftLength.MIN_PROBE_AFTER
    assert waits[:3] == [m, 2 * m, 4 * m] and waits[-2:] == [1024, 1024]


def test_probes_of_dear_verify_steps_wait_for_their_price() -> None:
    """Batch 64 on the H200 (issue 17): plain steps 2.1 ms, verify steps 20 ms, drafts kept
    half the time: k = 0, and the probes that re-check it cost at most 1 % of the steps
    waited (within the factor's bound): waits of 256, 512, then the 1 % rule's ~860 steps,
    where unpriced they came after 32, 64, 128... steps."""
    from folio.core.spec.policy import AdaptiveDraftLength
    policy = AdaptiveDraftLength()
    batch = {str(i): 4 for i in range(64)}
    for _ in range(10):
        for tokens in (64, 128):
            policy.observe_step(tokens, 0.0021, False)
        for tokens in (256, 320):
            policy.observe_step(tokens, 0.020, True)
    for rid in batch:
        for _ in range(10):
            policy.observe_acceptance(rid, 4, 2)
    waits, since = [], 0
    for _ in range(4000):
        since += 1
        if policy.choose(batch, 0) > 0:
            waits.append(since)
            since = 0
            policy.observe_step(320, 0.020, True)    # the probe confirms: still dear
    m = AdaptiveDraftLength.MIN_PROBE_AFTER * AdaptiveDraftLength.PRICED_WAIT_FACTOR
    assert waits[:2] == [m, 2 * m]
    assert all(840 <= w <= 880 for w in waits[2:]) and len(waits) >= 4, waits
    # each priced wait: the probe's extra time is 1 % of the plain steps waited
    assert all(w * 0.0021 * 0.01 >= 0.99 * (0.020 - 0.0021) for w in waits[2:])


def test_verify_steps_dearer_than_plain_ones_turn_drafting_off() -> None:
    """Per token the steps cost alike, but a step with drafts costs 2x a plain one of any
    size (on a GPU it runs synchronously, host work unhidden): at batch 64 drafts kept half
    the time do not pay, at batch 1 with high acceptance they do."""
    from folio.core.spec.policy import AdaptiveDraftLength
    policy = AdaptiveDraftLength()
    for _ in range(10):
        for tokens in (1, 2, 4, 8, 64, 128, 256):
            policy.observe_step(tokens, 0.002, False)
            policy.observe_step(tokens, 0.004, True)
    assert policy.cost(64, verify=False) == pytest.approx(0.002)
    assert policy.cost(64) == pytest.approx(0.004)
    batch = {str(i): 4 for i in range(64)}
    for rid in batch:
        for _ in range(10):
            policy.observe_acceptance(rid, 4, 2)
    assert not policy.will_draft(batch, 0) and policy.choose(batch, 0) == 0
    for _ in range(10):
        policy.observe_acceptance("solo", 4, 4)
    assert policy.will_draft({"solo": 4}, 0) and policy.choose({"solo": 4}, 0) == 4


def test_a_plain_step_size_never_timed_is_timed_before_drafting_is_judged() -> None:
    """Only prefill-sized plain steps timed: the plain cost of a 64-request decode step is
    unknown (the prefill's would make drafting look free), so one step goes without drafts
    to time it; will_draft agrees with choose and changes nothing."""
    from folio.core.spec.policy import AdaptiveDraftLength
    policy = AdaptiveDraftLength()
    policy.observe_step(4096, 0.050, False)          # a prefill
    policy.observe_step(128, 0.006, True)            # a verify step
    batch = {str(i): 1 for i in range(64)}
    assert [policy.will_draft(batch, 0) for _ in range(3)] == [False] * 3
    assert policy.choose(batch, 0) == 0
    policy.observe_step(64, 0.002, False)
    assert policy.cost(64, verify=False) == pytest.approx(0.002)
    assert policy.choose(batch, 0) == 0              # 0.006 s for <= 96 tokens: no gain


def test_a_resting_draft_length_asks_for_no_proposals_but_probes() -> None:
    """Past a k = 0 verdict no proposals are made (at batch 64 the suffix proposer's host
    work cost more than the steps it would shorten); they are made again for the probes,
    which come ever more rarely while they confirm k = 0, and for the verdict after each."""
    from folio.core.spec.policy import AdaptiveDraftLength
    policy = AdaptiveDraftLength()
    for tokens in (64, 128, 256, 512):
        policy.observe_step(tokens, 0.002, False)
        policy.observe_step(tokens, 0.010, True)
    batch = {str(i): 4 for i in range(64)}
    assert policy.wants_proposals() and policy.choose(batch, 0) == 0
    proposing, probes = [], []
    for step in range(3000):
        asked = policy.wants_proposals()
        proposing.append(asked)
        if policy.choose(batch if asked else {}, 0 if asked else 64) > 0:
            probes.append(step)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    # (verify steps 5x dearer: probes also wait for their price, 400 steps, at first)
    assert len(probes) >= 4 and gaps == sorted(gaps) and gaps[-1] > 2 * gaps[0]
    assert sum(proposing) <= 3 * len(probes) + 1        # a probe, the step before, the verdict
    # a probe that finds drafting cheap now ends the rest
    policy.observe_step(320, 0.001, True)
    policy.observe_step(512, 0.001, True)
    while not policy.wants_proposals():
        policy.choose({}, 64)
    assert policy.choose(batch, 0) > 0 and policy.wants_proposals()


def test_the_scheduler_makes_no_proposals_while_the_draft_length_rests() -> None:
    drafter = CountingDrafter([7, 8])
    s = make(drafter)
    for tokens in (1, 2, 4, 8, 16):
        s.observe_step_time(tokens, 0.001, False)
        s.observe_step_time(tokens, 0.050, True)
    reqs = [request(str(i)) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    step = s.schedule()
    assert step.message.propose_drafts
    s.update_from_output(step, reply({r.request_id: [50] for r in reqs}))
    assert drafter.calls == 4
    step = s.schedule()                            # k = 0: the verdict, and the rest begins
    assert step.message.scheduled_spec_decode_tokens == {}
    # ... which a worker's proposer (draft model, EAGLE head) hears in the step message
    assert not step.message.propose_drafts
    for token in range(51, 56):
        s.update_from_output(step, reply({r.request_id: [token] for r in reqs}))
        step = s.schedule()
        assert not step.message.propose_drafts
    assert drafter.calls == 4


def test_a_fixed_draft_length_verifies_every_draft() -> None:
    from folio.core.spec.policy import FixedDraftLength
    policy = FixedDraftLength()
    policy.observe_step(64, 10.0, True)
    assert policy.will_draft({"a": 3}, 0) and not policy.will_draft({}, 4)
    assert policy.choose({"a": 3, "b": 5}, 60) == 5 and policy.choose({}, 4) == 0


def test_the_scheduler_stops_drafting_when_a_large_batch_makes_it_cost() -> None:
    s = make(FixedDrafter([7, 8, 9]))
    for tokens in (1, 2, 4, 8, 16, 32):
        for _ in range(10):
            s.observe_step_time(tokens, 0.001 * tokens, tokens > 1)   # every token costs
    reqs = [request(str(i)) for i in range(8)]
    for r in reqs:
        s.add_request(r)
    step = s.schedule()
    s.update_from_output(step, reply({r.request_id: [50] for r in reqs}))
    step = s.schedule()
    assert step.message.scheduled_spec_decode_tokens == {}
    assert step.message.num_scheduled_tokens == {r.request_id: 1 for r in reqs}


# ---- the suffix proposer ------------------------------------------------------------------

def test_suffix_continues_the_request_own_longest_match() -> None:
    from folio.core.spec.suffix import SuffixProposer
    p = SuffixProposer(max_depth=8, max_spec_factor=1.0)
    tokens = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    assert p.propose("a", tokens, 8) == [4, 5, 6]       # a 3-token match drafts at most 3
    assert SuffixProposer(max_depth=8, max_spec_factor=2.0).propose("a", tokens, 8) \
        == [4, 5, 6, 9, 1, 2]
    assert p.propose("b", [1, 2, 3], 4) == []


def test_suffix_learns_from_other_requests_outputs_and_forgets_the_oldest() -> None:
    from folio.core.spec.suffix import SuffixProposer
    p = SuffixProposer(max_depth=6, max_cached_requests=2, max_spec_factor=3.0,
                       min_token_prob=0.4)
    p.finish("x", [10, 11, 12, 13, 14, 15])
    # queued until indexed (the drafter indexes a few per step of proposals)
    assert p.propose("b", [7, 8, 10, 11], 8) == []
    p.index_pending()
    # two context tokens match: up to 6 drafted, along the most frequent continuations
    assert p.propose("b", [7, 8, 10, 11], 8) == [12, 13, 14, 15]
    # two outputs disagree after 11 (12 twice, 20 once): 12 has 2/3 >= 0.4
    p.finish("y", [10, 11, 20])
    p.index_pending(1)
    assert p.propose("c", [10, 11], 1) == [12]
    # a continuation below the frequency bar stops the draft
    strict = SuffixProposer(max_depth=6, min_token_prob=0.9, max_spec_factor=4.0)
    strict.finish("x", [10, 11, 12])
    strict.finish("y", [10, 11, 20])
    strict.index_pending()
    assert strict.propose("c", [5, 10, 11], 4) == []
    # past the cache size the oldest request's counts leave the index
    p.finish("z", [30, 31])
    p.index_pending()
    assert p.propose("d", [9, 10, 11], 3) == [20]


def test_the_suffix_drafter_feeds_finished_outputs_to_the_shared_index() -> None:
    from folio.core.spec.drafter import SuffixDrafter
    d = SuffixDrafter(SpeculativeConfig(method="suffix", num_speculative_tokens=3,
                                        suffix_decoding_max_tree_depth=4))
    done = Request("a", [1, 2], SamplingParams(), (EOS,), block_size=BS, max_model_len=64)
    for t in (40, 41, 42, 43):
        done.append_output_token(t)
    d.drop(done)
    d.begin_proposals()        # a step of proposals indexes a finished request's outputs
    fresh = Request("b", [5, 40, 41], SamplingParams(), (EOS,), block_size=BS, max_model_len=64)
    assert d.propose(fresh) == [42, 43]


def test_logprobs_rows_of_a_verify_step_go_to_their_tokens() -> None:
    from folio.core.step_messages import LogprobsLists
    s = make(FixedDrafter([7, 8]))
    r = request("a", logprobs=1)
    s.add_request(r)
    s.update_from_output(s.schedule(), reply({"a": [50]}))
    step = s.schedule()
    lists = LogprobsLists([7, 9], [-0.1, -0.5], [1, 2], [[7], [4]], [[-0.1], [-0.2]])
    out = s.update_from_output(step, ModelRunnerOutput(
        req_ids=["a"], sampled_token_ids=[[7, 9]], logprobs_req_ids=["a", "a"],
        logprobs=lists))
    assert out[0].new_token_ids == [7, 9]
    assert [lp.token_id for lp in out[0].new_logprobs] == [7, 9]


def test_a_rare_stall_does_not_move_a_step_cost():
    """A bucket's cost is the median of its recent steps: one 40 ms stall among 2 ms plain
    steps (seen on the H200 at batch 64) leaves the cost at 2 ms, so speculation whose verify
    steps cost 4x for 3x the tokens stays off."""
    from folio.core.spec.policy import AdaptiveDraftLength, StepCostCurve
    curve = StepCostCurve(stale_after=1000)
    for i in range(14):
        curve.observe(64, 0.002, i)
    curve.observe(64, 0.040, 14)
    assert curve.cost(64) == pytest.approx(0.002)
    policy = AdaptiveDraftLength()
    for _ in range(10):
        policy.observe_step(64, 0.002, verify=False)
        policy.observe_step(320, 0.008, verify=True)
    policy.observe_step(64, 0.040, verify=False)
    drafting = {f"r{i}": 4 for i in range(64)}
    for rid in drafting:
        for _ in range(5):
            policy.observe_acceptance(rid, 4, 2)     # about 3 tokens a verify step
    assert policy.choose(drafting, 0) == 0


def test_a_resting_suffix_drafter_skips_indexing_finished_outputs():
    """Finished outputs teach the suffix drafter's shared index only while drafts are being
    made: indexing costs max_depth updates per token, wasted while the draft length rests."""
    from folio.core.spec.drafter import SuffixDrafter
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=4)
    drafter = SuffixDrafter(config)
    params = SamplingParams(max_tokens=8)
    done = Request("a", [1, 2, 3], params, block_size=4, max_model_len=64)
    for t in [7, 8, 9, 10, 11]:
        done.append_output_token(t)
    drafter.active = False
    drafter.drop(done)
    assert drafter.proposer._shared == {} and not drafter.proposer._pending
    drafter.active = True
    drafter.drop(done)
    # queued, and indexed by the steps of proposals, one per step (a step that finishes
    # many requests does not pay for their indexing)
    assert drafter.proposer._pending and drafter.proposer._shared == {}
    drafter.begin_proposals()
    assert drafter.proposer._shared and not drafter.proposer._pending
    # and a new request continuing those tokens is drafted from them
    fresh = Request("b", [5, 7, 8, 9], params, block_size=4, max_model_len=64)
    assert drafter.propose(fresh)[:2] == [10, 11]


def test_resting_ends_when_the_batch_halves():
    """A k = 0 verdict at a large batch is judged again once the batch has halved (the
    drafts may pay at the smaller one), not only at the next probe."""
    from folio.core.spec.policy import AdaptiveDraftLength
    policy = AdaptiveDraftLength()
    for _ in range(10):
        policy.observe_step(64, 0.002, verify=False)
        policy.observe_step(320, 0.012, verify=True)
    drafting = {f"r{i}": 4 for i in range(64)}
    assert policy.choose(drafting, 0) == 0
    assert not policy.wants_proposals(64) and not policy.wants_proposals(40)
    # a batch finishing together passes through half in a few steps: not judged again
    for _ in range(policy.HALVED_STEPS - 1):
        assert not policy.wants_proposals(32)
    assert not policy.wants_proposals(40)        # back above half: the count starts over
    for _ in range(policy.HALVED_STEPS - 1):
        assert not policy.wants_proposals(30)
    assert policy.wants_proposals(30)
    # and so does the step message's question (no batch given) until the verdict
    assert policy.wants_proposals()
    assert policy.choose(drafting, 0) == 0 and not policy.wants_proposals()


def test_suffix_proposals_skip_the_shared_walk_only_where_the_own_match_wins() -> None:
    """The shared index's draft is walked only when its match is longer than the request's
    own (which wins ties): the proposals equal those of always walking it."""
    import random

    from folio.core.spec.suffix import SuffixProposer
    rng = random.Random(0)
    walked, skipping = SuffixProposer(max_depth=8), SuffixProposer(max_depth=8)
    vocab = list(range(12))          # a small vocabulary: both indexes match often
    for i in range(6):
        out = [rng.choice(vocab) for _ in range(60)]
        for p in (walked, skipping):
            p.finish(f"old{i}", out)
            p.index_pending()
    full_walk = walked._shared_walk
    walked._shared_walk = lambda tokens, k, beat=0: full_walk(tokens, k)
    mismatches = drafted = 0
    for i in range(40):
        tokens = [rng.choice(vocab) for _ in range(rng.randrange(2, 80))]
        a = walked.propose(f"r{i}", tokens, 6)
        b = skipping.propose(f"r{i}", tokens, 6)
        mismatches += a != b
        drafted += bool(b)
    assert mismatches == 0 and drafted > 10


def test_ngram_proposals_equal_a_scan_of_the_context() -> None:
    """The n-gram index (keys from ngram_keys.py, many new tokens at once indexed with numpy,
    a few with the loop) proposes what a scan finds: the tokens after the latest earlier
    occurrence of the longest n-gram (max_n down to min_n) ending the context."""
    import random
    rng = random.Random(1)

    def scan(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
        end = len(tokens)
        for n in range(min(max_n, end - 1), min_n - 1, -1):
            tail = tokens[end - n:]
            for start in range(end - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k]
        return []

    for min_n, max_n in ((1, 3), (2, 4), (3, 3)):
        p = NgramProposer(min_n, max_n)
        for r in range(12):
            tokens = [rng.randrange(6) for _ in range(rng.randrange(2, 40))]
            for _ in range(6):   # growing by one token (the loop) or by many (numpy)
                assert p.propose(str(r), tokens, 4) == scan(tokens, min_n, max_n, 4), tokens
                tokens = tokens + [rng.randrange(6) for _ in range(rng.choice((1, 1, 12)))]


@pytest.mark.parametrize("adaptive", [False, True])
def test_disable_by_batch_size_stops_drafting_at_the_cap(adaptive: bool) -> None:
    """vLLM's disable_by_batch_size: with 3 or more requests running no proposals are made
    and no step verifies drafts; when the batch falls below it again, drafting resumes."""
    drafter = CountingDrafter([7, 8])
    s = make(drafter, adaptive_draft_length=adaptive, disable_by_batch_size=3)
    first, second = request("a"), request("b", first=200)
    s.add_request(first)
    s.add_request(second)
    s.update_from_output(s.schedule(), reply({"a": [50], "b": [51]}))
    step = s.schedule()                      # two running: below the cap
    assert step.message.scheduled_spec_decode_tokens == {"a": [7, 8], "b": [7, 8]}
    s.add_request(request("c", first=300))
    # c's prefill joins this step: three running when the next drafts would be made
    s.update_from_output(step, reply({"a": [7, 60], "b": [7, 61]}))
    step = s.schedule()
    s.update_from_output(step, reply({rid: [70] for rid in step.message.num_scheduled_tokens}))
    calls = drafter.calls
    for _ in range(3):
        step = s.schedule()
        assert step.message.scheduled_spec_decode_tokens == {}
        assert not step.message.propose_drafts
        s.update_from_output(step, reply({rid: [70] for rid in
                                          step.message.num_scheduled_tokens}))
    assert drafter.calls == calls            # no proposals at the cap
    s.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    s.update_from_output(s.schedule(), reply({"a": [71], "b": [72]}))
    step = s.schedule()                      # two again: drafts verified once more
    assert step.message.scheduled_spec_decode_tokens == {"a": [7, 8], "b": [7, 8]}
