"""The decode steps ModelRunner runs at start-up before the decode CUDA graphs are captured
(`_warm_up_decode`): the decode attention kernel's autotuner picks a tile on each variant's
first call, so those calls must be real contexts -- one that the split-K variant serves and one
that the one-split variant serves -- reading distinct blocks and writing nothing. The forward
itself is a recording stand-in here; on the GPU the worker runs the real one at start-up."""
from __future__ import annotations

import torch

from folio.model.attention.triton_backend import TritonPagedAttention
from folio.worker.model_runner import ModelRunner


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, ids, positions, kv_caches, meta):
        self.calls.append((ids, positions, meta))
        return torch.zeros(ids.shape[0], 4)


def _runner(max_model_len: int, max_num_seqs: int, num_blocks: int = 4096, kvh: int = 8):
    runner = ModelRunner.__new__(ModelRunner)
    runner.model = _Recorder()
    runner.kv_caches = [torch.zeros(2, num_blocks, 16, kvh, 8)] * 2
    runner.block_size = 16
    runner.device = torch.device("cpu")
    runner.max_model_len = max_model_len
    runner.max_num_seqs = max_num_seqs
    return runner


def test_decode_warm_up_runs_both_split_variants_at_real_contexts():
    runner = _runner(max_model_len=4096, max_num_seqs=256)
    runner._warm_up_decode()
    backend = TritonPagedAttention()
    splits = []
    for ids, positions, meta in runner.model.calls:
        reqs = len(meta.seq_lens)
        assert meta.query_start_loc == list(range(reqs + 1))           # one token each
        assert all(n == meta.seq_lens[0] for n in meta.seq_lens)
        ctx = meta.seq_lens[0]
        assert ctx >= 384                                              # a real context
        assert meta.num_computed_tokens == [ctx - 1] * reqs
        assert positions.tolist() == [ctx - 1] * reqs
        assert (meta.slot_mapping == -1).all()                         # writes nothing
        assert tuple(meta.block_tables.shape) == (reqs, -(-ctx // 16))
        assert meta.block_tables.unique().numel() == meta.block_tables.numel()
        splits.append(backend.splits_for(reqs, 8, ctx, torch.device("cpu")))
    assert splits[0] > 1 and splits[1] == 1, splits


def test_decode_warm_up_stays_inside_small_limits():
    runner = _runner(max_model_len=200, max_num_seqs=4, num_blocks=10)
    runner._warm_up_decode()
    for ids, positions, meta in runner.model.calls:
        assert len(meta.seq_lens) <= 4 and max(meta.seq_lens) <= 200
        assert int(meta.block_tables.max()) < 10
