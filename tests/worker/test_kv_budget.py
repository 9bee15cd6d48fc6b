"""The start-up refusal when the KV cache would get no memory (issue 24, item 4): it says how
much is missing, what the peak holds (a vision encoder's pass among it) and which flags
change it; a budget below one sequence says the same in MiB."""
from __future__ import annotations

import pytest
import torch

from folio.model.families import ArchSpec
from folio.worker.kv_cache import determine_num_blocks, kv_budget_message


def test_the_message_names_what_is_missing_and_the_flags() -> None:
    GiB = 2**30
    detail = (" (the vision encoder's 3.00 GiB for a pass of 4096 image tokens included; "
              "lower --limit-mm-per-prompt ...)")
    message = kv_budget_message(total=80 * GiB, utilization=0.5, peak=38 * GiB,
                                outside_torch=int(2.5 * GiB), detail=detail)
    assert "0.5 GiB missing" in message.replace("0.50", "0.5")
    assert "40.00 GiB" in message and "38.00 GiB" in message and "vision encoder" in message
    for flag in ("--gpu-memory-utilization", "--max-num-batched-tokens", "--max-num-seqs"):
        assert flag in message


def test_a_budget_below_one_sequence_says_how_much_is_missing() -> None:
    spec = ArchSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=128, vocab_size=100, rms_norm_eps=1e-6,
                    max_position_embeddings=4096, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"MiB missing.*--gpu-memory-utilization"):
        determine_num_blocks(spec, block_size=16, dtype=torch.float32, max_model_len=4096,
                             kv_cache_memory_bytes=1 << 16, num_blocks_override=None)
