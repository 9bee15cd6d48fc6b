"""The mixed-step graph runner's padded static path (folio/worker/mixed_graphs.py); its staging
(the flat-batch builder's DUMMY_REQUEST padding) is tested in test_flat_batch.py.

The whole padded path runs in a child process under TRITON_INTERPRET=1 (the Triton attention
backend on CPU tensors): a tiny Qwen3-style model runs a real scheduler's steps (prefill
chunks, decodes, async scheduling's pending inputs, preemption) both eagerly on the step's own
inputs and through `MixedGraphRunner.run` on the static padded buffers (what a captured graph
replays); the real rows' hidden states and the KV caches must agree after every step, so
padding neither reads into nor writes over real rows.
"""
from __future__ import annotations

import numpy as np

from folio.worker.mixed_graphs import mixed_capture_sizes

BS = 4


def test_capture_sizes():
    assert mixed_capture_sizes(2048) == [8, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
    assert mixed_capture_sizes(8192) == [8, 16, 32, 64, 128, 256, 512] + list(
        range(1024, 8193, 1024))
    assert mixed_capture_sizes(600) == [8, 16, 32, 64, 128, 256, 512, 600]
    assert mixed_capture_sizes(100) == [8, 16, 32, 64, 100]
    assert mixed_capture_sizes(16) == [8, 16]
    assert mixed_capture_sizes(5) == [5]
    for budget in (5, 16, 100, 2048, 3000, 16384):
        sizes = mixed_capture_sizes(budget)
        assert sizes == sorted(set(sizes)) and sizes[-1] == budget


# ------------------------------------------------------------------ the padded path, end to end

def test_padded_path_matches_eager_under_interpreter():
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "model"))
    from interpreter_harness import interpreter_results
    results = interpreter_results(__file__, timeout=600)
    # Small steps in graph pieces, the residual stream handed between them in static buffers:
    # two layers (one and one) for steps of up to 16 tokens, larger ones whole; five layers
    # (one, three, one) for every step (PIECEWISE_MAX_TOKENS: 64).
    for name, pieces in (("padded_path", 2), ("padded_path_pieces", 3)):
        res = results.get(name)
        assert res is not None, results["_stderr"]
        assert "error" not in res, res["error"]
        assert res["pieces"] == pieces, res
        assert res["steps"] >= 8 and res["padded_steps"] >= 4 and res["pending"] >= 2, res
        assert res["max_hidden_err"] < 1e-4, res
        assert res["cache_equal"], res
    assert results["padded_path"]["whole_steps"] >= 1, results["padded_path"]
    # An EAGLE-3 target (three kept residual streams): one piece, and after every run the
    # model's streams are the static buffers' rows, equal to the eager forward's.
    res = results.get("padded_path_aux")
    assert res is not None and "error" not in res, res or results["_stderr"]
    assert res["pieces"] == 1 and res["steps"] >= 8 and res["max_hidden_err"] < 1e-4, res
    assert res["aux_streams"] == 3 and res["max_aux_err"] < 1e-4 and res["aux_published"], res


def test_graph_pieces():
    from folio.worker.mixed_graphs import graph_pieces
    assert graph_pieces(1) == [(0, 1)]
    assert graph_pieces(2) == [(0, 1), (1, 2)]
    assert graph_pieces(4) == [(0, 1), (1, 4)]
    assert graph_pieces(5) == [(0, 1), (1, 4), (4, 5)]
    assert graph_pieces(32) == [(0, 1), (1, 4), (4, 32)]


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
    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=case["layers"], num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=97,
                      max_position_embeddings=256, tie_word_embeddings=True,
                      architectures=["Qwen3ForCausalLM"])
    spec = arch_spec_from_hf_config(cfg)
    model = DecoderLM(spec, cfg, TritonPagedAttention(), max_positions=256).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    if case.get("aux"):
        model.aux_hidden_layers = (0, 1, case["layers"] - 1)    # an EAGLE-3 head's
    max_len, max_reqs, max_tokens = 80, 6, 48
    num_blocks = 100
    eager_caches = allocate_kv_caches(spec, num_blocks, BS, torch.float32, torch.device("cpu"))
    # Poison-free but nonzero: padding reads whatever valid block ids it finds.
    for c in eager_caches:
        c.normal_()
    graph_caches = [c.clone() for c in eager_caches]
    from folio.worker import mixed_graphs
    mixed_graphs.PIECEWISE_MAX_TOKENS = case["piece_max_tokens"]
    runner = MixedGraphRunner(model, graph_caches, block_size=BS, max_num_seqs=max_reqs,
                              max_model_len=max_len, max_num_tokens=max_tokens,
                              device=torch.device("cpu"))
    from folio.worker.input_batch import InputBatch
    from scheduler_steps import scheduler_steps
    batch = InputBatch(max_reqs, -(-max_len // BS), torch.device("cpu"), max_len)
    stats = dict(name=case["name"], steps=0, padded_steps=0, pending=0, max_hidden_err=0.0,
                 pieces=len(runner.pieces), whole_steps=0, max_aux_err=0.0, aux_streams=0,
                 aux_published=True)
    for step_case in scheduler_steps(case["seed"], block_size=BS, max_model_len=max_len,
                                     max_reqs=max_reqs, budget=max_tokens, num_blocks=60,
                                     async_scheduling=True, num_steps=16):
        step = step_case.step
        batch.update(step.message)
        if step.is_empty:
            continue
        # Eager: the step's own tensors, every id known (the pending ones are what the step
        # before sampled).
        ids, positions, slots, qsl, seq_lens, computed = [], [], [], [0], [], []
        for item in step.scheduled:
            rid = item.request_id
            start, n = item.num_computed_tokens, item.num_new_tokens
            known = step_case.known_tokens[rid]
            blocks = step_case.block_ids[rid]
            for p in range(start, start + n):
                ids.append(known[p] if p < len(known) else step_case.pending_tokens[rid])
                positions.append(p)
                slots.append(blocks[p // BS] * BS + p % BS)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            computed.append(start)
        tables_list = [step_case.block_ids[s.request_id] for s in step.scheduled]
        width = max(len(t) for t in tables_list)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in tables_list])
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_loc=qsl,
                                 seq_lens=seq_lens, num_computed_tokens=computed,
                                 block_tables=tables, block_size=BS)
        with torch.inference_mode():
            ref = model(torch.tensor(ids), torch.tensor(positions), eager_caches, meta)
        ref_aux = [a.clone() for a in model.aux_hidden_states]
        by_row = {step_case.prev_rows[rid]: tok for rid, tok in step_case.pending_tokens.items()}

        def fill(input_ids, dst, src):
            stats["pending"] += len(dst)
            input_ids[dst] = torch.tensor([by_row[j] for j in src])

        hidden, got_qsl = runner.run(step.message, batch, step_case.prev_rows, fill)
        assert got_qsl == qsl
        T = qsl[-1]
        stats["steps"] += 1
        size = runner.sizes[np.searchsorted(runner.sizes, T)]
        stats["padded_steps"] += int(size > T)
        stats["whole_steps"] += int(size > runner.piece_max_tokens)
        err = float((hidden - ref).abs().max() / ref.abs().max())
        stats["max_hidden_err"] = max(stats["max_hidden_err"], err)
        if case.get("aux"):
            got_aux = model.aux_hidden_states
            stats["aux_streams"] = len(got_aux)
            stats["aux_published"] &= all(
                g.shape[0] == T and g.data_ptr() == buf.data_ptr()
                for g, buf in zip(got_aux, runner.aux.buffers))
            for g, r in zip(got_aux, ref_aux):
                stats["max_aux_err"] = max(stats["max_aux_err"], float(
                    (g - r).abs().max() / r.abs().max()))
    stats["cache_equal"] = all(torch.allclose(a, b, atol=1e-5, rtol=1e-5)
                               for a, b in zip(eager_caches, graph_caches))
    return stats


if __name__ == "__main__":
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "model"))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from interpreter_harness import child_main
    child_main([dict(name="padded_path", seed=5, layers=2, piece_max_tokens=16),
                dict(name="padded_path_pieces", seed=6, layers=5, piece_max_tokens=64),
                dict(name="padded_path_aux", seed=7, layers=4, piece_max_tokens=64,
                     aux=True)],
               _run_padded_path)
