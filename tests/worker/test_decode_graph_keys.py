"""Which decode CUDA graphs are captured (folio/worker/cuda_graphs.py): every (batch size, split
count) a decode step can call for, so that a short context never replays a graph whose split
count was chosen for max_model_len. The capture and replay themselves run on the GPU
(tests/gpu/test_cuda_graphs.py)."""
from __future__ import annotations

import pytest
import torch

from folio.model.attention.triton_backend import TritonPagedAttention
from folio.worker.cuda_graphs import capture_sizes, decode_graph_keys


@pytest.mark.parametrize("kv_heads,max_model_len,max_num_seqs", [
    (8, 4096, 256), (8, 8192, 32), (2, 2048, 64), (1, 512, 8), (8, 200, 4)])
def test_every_split_count_a_step_can_take_is_captured(kv_heads, max_model_len, max_num_seqs):
    backend = TritonPagedAttention()
    cpu = torch.device("cpu")
    sizes = capture_sizes(max_num_seqs)
    keys = decode_graph_keys(
        sizes, lambda bs: backend.splits_for(bs, kv_heads, max_model_len, cpu))
    assert len(keys) == len(set(keys))
    assert {bs for bs, _ in keys} == set(sizes)
    for bs in sizes:
        captured = {s for b, s in keys if b == bs}
        wanted = {backend.splits_for(bs, kv_heads, n, cpu) for n in range(1, max_model_len + 1)}
        assert captured == wanted, (bs, captured, wanted)
    # a batch of one at a short context runs one split; at the longest, several
    if max_model_len >= 4096:
        assert backend.splits_for(1, kv_heads, 256, cpu) == 1
        assert backend.splits_for(1, kv_heads, max_model_len, cpu) > 1


def test_split_counts_must_be_powers_of_two():
    with pytest.raises(AssertionError):
        decode_graph_keys([1, 2], lambda bs: 3)
    assert decode_graph_keys([1, 2], lambda bs: 4 // bs) == [(1, 1), (1, 2), (1, 4),
                                                            (2, 1), (2, 2)]
