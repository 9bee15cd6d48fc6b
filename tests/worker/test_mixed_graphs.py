"""The mixed-step graph runner's padded static path (folio/worker/mixed_graphs.py).

* `MixedInputStager` (numpy, this process): over random step sequences — prefill chunks,
  decodes, pending inputs, requests joining, leaving and being preempted — the staged buffers
  equal a from-scratch fill, and the padding is what the runner's docstring promises.
* The whole padded path (a child process under TRITON_INTERPRET=1, the Triton attention
  backend on CPU tensors): a tiny Qwen3-style model runs random mixed steps both eagerly on
  the step's own inputs and through `MixedGraphRunner.run` on the static padded buffers (what a
  captured graph replays); the real rows' hidden states and the KV caches must agree after
  every step, so padding neither reads into nor writes over real rows.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from folio.core.request import Request
from folio.core.scheduler import ScheduledRequest
from folio.sampling_params import SamplingParams
from folio.worker.mixed_graphs import MixedInputStager, mixed_capture_sizes

BS = 4
N, R, W = 64, 9, 20  # token capacity, request slots (max_num_seqs + 1), block-table width


def test_capture_sizes():
    assert mixed_capture_sizes(2048) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
    assert mixed_capture_sizes(8192) == [16, 32, 64, 128, 256, 512] + list(range(1024, 8193, 1024))
    assert mixed_capture_sizes(600) == [16, 32, 64, 128, 256, 512, 600]
    assert mixed_capture_sizes(100) == [16, 32, 64, 100]
    assert mixed_capture_sizes(16) == [16]
    assert mixed_capture_sizes(5) == [5]
    for budget in (5, 16, 100, 2048, 3000, 16384):
        sizes = mixed_capture_sizes(budget)
        assert sizes == sorted(set(sizes)) and sizes[-1] == budget


def _buffers():
    return (np.full(N, 99, np.int64), np.full(N, 99, np.int64), np.full(N, 99, np.int64),
            np.full(R + 1, 99, np.int32), np.full(R, 99, np.int32),
            np.full((R, W), 0, np.int32))


def _random_steps(rng: random.Random, num_steps: int, max_reqs: int, max_tokens: int,
                  max_len: int):
    """Yield lists of ScheduledRequest: random chunks of random requests' remaining tokens
    (prefill chunks and single decodes), sometimes with the last input pending."""
    live: dict[str, tuple[Request, list[int], int]] = {}  # request, blocks, computed
    next_block = [1]
    counter = 0

    def new_blocks(count):
        out = list(range(next_block[0], next_block[0] + count))
        next_block[0] += count
        return out

    for _ in range(num_steps):
        for rid in list(live):
            req, blocks, done = live[rid]
            if rng.random() < 0.1 or done >= max_len - 1:
                del live[rid]
            elif rng.random() < 0.08:  # preempted: recompute from scratch into new blocks
                live[rid] = (req, new_blocks(len(blocks)), 0)
        while len(live) < rng.randint(1, max_reqs):
            counter += 1
            length = rng.randint(1, max_len // 2)
            req = Request(f"r{counter}", [rng.randrange(3, 90) for _ in range(length)],
                          SamplingParams(), block_size=BS, max_model_len=max_len)
            live[req.request_id] = (req, [], 0)
        budget = rng.randint(1, max_tokens)
        scheduled = []
        order = list(live)
        rng.shuffle(order)
        for rid in order:
            req, blocks, done = live[rid]
            known = len(req.all_token_ids)
            pending = done == known and rng.random() < 0.5  # the step in flight samples one
            avail = known - done + (1 if pending else 0)
            if avail <= 0 or budget <= 0:
                continue
            n = min(avail, budget, rng.randint(1, avail))
            budget -= n
            while len(blocks) * BS < done + n:
                blocks.extend(new_blocks(1))
            scheduled.append(ScheduledRequest(req, done, n, blocks, samples=done + n >= known))
            live[rid] = (req, blocks, done + n)
        if scheduled:
            yield scheduled
        for item in scheduled:
            if item.has_pending_input:
                item.request.append_output_token(rng.randrange(3, 90))
            elif item.samples and rng.random() < 0.5:
                item.request.append_output_token(rng.randrange(3, 90))


@pytest.mark.parametrize("seed", range(12))
def test_staged_inputs_equal_a_fresh_fill(seed):
    rng = random.Random(seed)
    ids, pos, slots, qsl, seq, bt = _buffers()
    stager = MixedInputStager(ids, pos, slots, qsl, seq, bt, block_size=BS)
    checked = 0
    for scheduled in _random_steps(rng, 50, R - 1, N, W * BS):
        T = sum(s.num_new_tokens for s in scheduled)
        padded = min(N, T + rng.choice([0, 0, 1, 5, 17]))
        staged = stager.fill(scheduled, padded)
        B = len(scheduled)
        exp_ids, exp_pos, exp_slots, exp_qsl, pend = [], [], [], [0], []
        for i, item in enumerate(scheduled):
            known = item.request.all_token_ids
            for p in range(item.num_computed_tokens,
                           item.num_computed_tokens + item.num_new_tokens):
                if p < len(known):
                    exp_ids.append(known[p])
                else:
                    pend.append((len(exp_ids), i))
                    exp_ids.append(0)
                exp_pos.append(p)
                exp_slots.append(item.block_ids[p // BS] * BS + p % BS)
            exp_qsl.append(exp_qsl[-1] + item.num_new_tokens)
        assert staged.num_tokens == T
        assert staged.query_start_loc == exp_qsl
        assert list(zip(staged.pending_dst, staged.pending_req)) == pend
        assert ids[:padded].tolist() == exp_ids + [0] * (padded - T)
        assert pos[:padded].tolist() == exp_pos + [0] * (padded - T)
        assert slots[:padded].tolist() == exp_slots + [-1] * (padded - T)
        # Request slots: the real ones, then the dummy owning [T, padded), then empty ones.
        assert qsl.tolist() == exp_qsl + [padded] * (R - B)
        assert seq[:B].tolist() == [s.num_computed_tokens + s.num_new_tokens for s in scheduled]
        assert seq[B] == padded - T and (seq[B + 1:] == 0).all()
        for i, item in enumerate(scheduled):
            used = -(-(item.num_computed_tokens + item.num_new_tokens) // BS)
            assert bt[i, :used].tolist() == item.block_ids[:used], f"row {i}"
        checked += 1
    assert checked > 20


# ------------------------------------------------------------------ the padded path, end to end

def test_padded_path_matches_eager_under_interpreter():
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "model"))
    from interpreter_harness import interpreter_results
    results = interpreter_results(__file__, timeout=600)
    res = results.get("padded_path")
    assert res is not None, results["_stderr"]
    assert "error" not in res, res["error"]
    assert res["steps"] >= 8 and res["padded_steps"] >= 4 and res["pending"] >= 2
    assert res["max_hidden_err"] < 1e-4, res
    assert res["cache_equal"], res


def _run_padded_path(case: dict) -> dict:
    import torch
    from transformers import Qwen3Config

    from folio.model.attention import AttentionMetadata
    from folio.model.attention.triton_backend import TritonPagedAttention
    from folio.model.decoder import DecoderLM
    from folio.model.families import arch_spec_from_hf_config
    from folio.worker.kv_cache import allocate_kv_caches
    from folio.worker.mixed_graphs import MixedGraphRunner

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=97,
                      max_position_embeddings=256, tie_word_embeddings=True,
                      architectures=["Qwen3ForCausalLM"])
    spec = arch_spec_from_hf_config(cfg)
    model = DecoderLM(spec, cfg, TritonPagedAttention(), max_positions=256).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    max_len, max_reqs, max_tokens = 80, 6, 48
    num_blocks = 400
    eager_caches = allocate_kv_caches(spec, num_blocks, BS, torch.float32, torch.device("cpu"))
    # Poison-free but nonzero: padding reads whatever valid block ids it finds.
    for c in eager_caches:
        c.normal_()
    graph_caches = [c.clone() for c in eager_caches]
    runner = MixedGraphRunner(model, graph_caches, block_size=BS, max_num_seqs=max_reqs,
                              max_model_len=max_len, max_num_tokens=max_tokens,
                              device=torch.device("cpu"))
    rng = random.Random(case["seed"])
    stats = dict(name=case["name"], steps=0, padded_steps=0, pending=0, max_hidden_err=0.0)
    for scheduled in _random_steps(rng, 20, max_reqs, max_tokens, max_len):
        # Eager: the step's own tensors, ids all known (the pending one filled from the host).
        ids, positions, slots, qsl, seq_lens, computed = [], [], [], [0], [], []
        pend_values: dict[int, int] = {}
        for i, item in enumerate(scheduled):
            start, n = item.num_computed_tokens, item.num_new_tokens
            known = item.request.all_token_ids
            for p in range(start, start + n):
                tok = known[p] if p < len(known) else 50 + i  # what the step in flight sampled
                if p >= len(known):
                    pend_values[i] = tok
                ids.append(tok)
                positions.append(p)
                slots.append(item.block_ids[p // BS] * BS + p % BS)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            computed.append(start)
        width = max(len(s.block_ids) for s in scheduled)
        tables = torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in scheduled])
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_loc=qsl,
                                 seq_lens=seq_lens, num_computed_tokens=computed,
                                 block_tables=tables, block_size=BS)
        with torch.inference_mode():
            ref = model(torch.tensor(ids), torch.tensor(positions), eager_caches, meta)

        def fill(input_ids, dst, req):
            stats["pending"] += len(dst)
            input_ids[dst] = torch.tensor([pend_values[i] for i in req])

        hidden, got_qsl = runner.run(scheduled, fill)
        assert got_qsl == qsl
        T = qsl[-1]
        stats["steps"] += 1
        stats["padded_steps"] += int(runner.sizes[np.searchsorted(runner.sizes, T)] > T)
        err = float((hidden - ref).abs().max() / ref.abs().max())
        stats["max_hidden_err"] = max(stats["max_hidden_err"], err)
    stats["cache_equal"] = all(torch.allclose(a, b, atol=1e-5, rtol=1e-5)
                               for a, b in zip(eager_caches, graph_caches))
    return stats


if __name__ == "__main__":
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "model"))
    from interpreter_harness import child_main
    child_main([dict(name="padded_path", seed=5)], _run_padded_path)
