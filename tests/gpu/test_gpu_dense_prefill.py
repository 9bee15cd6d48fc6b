"""Long fresh prefills' attention through torch's fused kernel (folio/model/attention/
dense_prefill.py) on a CUDA GPU: the backend's mixed steps against the paged kernel alone and a
float32 reference, and the engine's greedy outputs with the path on and off and against
transformers. Skipped without a GPU.
"""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _step(reqs, H=32, KVH=8, D=128, bs=16, dtype=torch.bfloat16, seed=0):
    """Random q/k/v and a paged cache holding each request's earlier context; reqs:
    (num_computed_tokens, query_len) per request."""
    from folio.model.attention.backend import AttentionMetadata
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [-(-(c + n) // bs) for c, n in reqs]
    perm = torch.randperm(sum(blocks) + 2, device="cuda", generator=gen)
    tables = torch.zeros(len(reqs), max(blocks), dtype=torch.int64, device="cuda")
    qsl, slots, pos = [0], [], 0
    for i, ((c, n), nb) in enumerate(zip(reqs, blocks)):
        tables[i, :nb] = perm[pos:pos + nb]
        pos += nb
        qsl.append(qsl[-1] + n)
        p = torch.arange(c, c + n, device="cuda")
        slots.append(tables[i, p // bs] * bs + p % bs)
    T = qsl[-1]
    q = torch.randn(T, H, D, device="cuda", generator=gen).to(dtype)
    k = torch.randn(T, KVH, D, device="cuda", generator=gen).to(dtype)
    v = torch.randn(T, KVH, D, device="cuda", generator=gen).to(dtype)
    cache = torch.randn(2, sum(blocks) + 2, bs, KVH, D, device="cuda", generator=gen).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), query_start_loc=qsl,
                             seq_lens=[c + n for c, n in reqs],
                             num_computed_tokens=[c for c, _ in reqs], block_tables=tables,
                             block_size=bs)
    return q, k, v, cache, meta


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("reqs", [
    [(0, 4500)],                                       # one fresh prompt: dense only
    [(0, 4096)],                                       # a padded length itself: no padding
    [(300, 1), (0, 4100), (100, 40), (0, 5000), (7, 1)],  # dense requests among others
    [(0, 4095), (0, 30)],                              # below the bar: paged only
])
def test_backend_dense_matches_paged_and_reference(reqs):
    from folio.model.attention import dense_prefill
    from folio.model.attention.torch_paged import TorchPagedAttention
    from folio.model.attention.triton_backend import TritonPagedAttention
    q, k, v, cache, meta = _step(reqs)
    scale = q.shape[-1] ** -0.5
    dense_backend = TritonPagedAttention()
    st = dense_backend.step_tensors(meta)
    want = [(meta.query_start_loc[i], n) for i, (c, n) in enumerate(reqs)
            if c == 0 and n >= dense_prefill.DENSE_PREFILL_MIN_TOKENS]
    assert list(st.dense) == want
    cache_a, cache_b = cache.clone(), cache.clone()
    out = dense_backend.forward(q, k, v, cache_a, meta, scale=scale)
    paged = TritonPagedAttention(dense_prefill=False).forward(q, k, v, cache_b, meta,
                                                               scale=scale)
    assert torch.equal(cache_a, cache_b), "the cache write differs"
    ref_meta = _step(reqs)[4]
    ref = TorchPagedAttention().forward(q.float(), k.float(), v.float(), cache.float().clone(),
                                        ref_meta, scale=scale)
    assert torch.isfinite(out).all()
    # bf16 output rounding is ~4e-3 relative; both kernels must sit at that level.
    assert _rel(out, ref) < 1e-2, _rel(out, ref)
    assert _rel(paged, ref) < 1e-2, _rel(paged, ref)
    qsl = meta.query_start_loc
    for i, (c, n) in enumerate(reqs):
        rows = slice(qsl[i], qsl[i + 1])
        assert _rel(out[rows], paged[rows]) < 1e-2, (i, _rel(out[rows], paged[rows]))


def test_engine_dense_prefill_on_and_off(tmp_path, monkeypatch):
    from test_gpu_engine import _build, _close
    from folio import LLM, SamplingParams
    from folio.model.attention import dense_prefill

    model_dir = _build("llama", str(tmp_path / "llama"), max_positions=16384)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 2048) for _ in range(n)] for n in (4600, 40, 4200, 300)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    calls = []
    real = dense_prefill.causal_attention

    def counting(query, *args, **kwargs):
        calls.append(query.shape[0])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(dense_prefill, "causal_attention", counting)
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("FOLIO_DENSE_PREFILL", flag)
        llm = LLM(model_dir, dtype="bfloat16", max_model_len=8192, max_num_seqs=8,
                  max_num_batched_tokens=16384, device="cuda", kv_cache_memory_bytes=1 << 30)
        calls.clear()   # start-up's dummy prefills may take the path too
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[flag] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got]
        if flag == "1":
            # every layer (4) of the one step that holds both long prompts
            assert sorted(set(calls)) == [4200, 4600] and len(calls) == 8, calls
            calls.clear()
        del llm
        torch.cuda.empty_cache()
    assert not calls, "the path ran with FOLIO_DENSE_PREFILL=0"
    for i in range(len(prompts)):
        _close(outs["1"][i], outs["0"][i], f"prompt {i}")
