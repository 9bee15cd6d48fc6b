"""The paged cache keeps only the blocks a sliding-window layer still sees: a long sequence on a
tiny sliding model holds fewer blocks (and fewer bytes) than the same model with full
attention, and the engine's KV cache groups follow the model's layers."""
from __future__ import annotations

import gc
import json
import os
import shutil
from typing import Any, Callable

from folio import LLM, SamplingParams
from folio.core.kv_cache_layout import KVCacheGroup
from model_utils import torch_threads

BLOCK_SIZE = 4
PROMPT_LEN = 120
OUTPUT_LEN = 80


def _full_attention_copy(model_dir: str, out: str, config_changes: dict[str, Any]) -> str:
    """The same weights and tokenizer, with the config's windows taken away."""
    if not os.path.isdir(out):
        shutil.copytree(model_dir, out)
        path = os.path.join(out, "config.json")
        with open(path) as f:
            config = json.load(f)
        config.update(config_changes)
        with open(path, "w") as f:
            json.dump(config, f)
    return out


def _peak_usage(model_dir: str) -> tuple[int, int, tuple[KVCacheGroup, ...]]:
    """Run one long greedy sequence step by step; the most blocks it held at once, in blocks
    and in layer pages (a block id is group_size pages), and the engine's KV cache groups."""
    llm = LLM(model=model_dir, dtype="float32", max_model_len=512, seed=0,
              block_size=BLOCK_SIZE, num_gpu_blocks_override=400, max_num_batched_tokens=32)
    try:
        engine = llm.llm_engine
        core = engine.engine_core
        pool = core.kv_cache_manager.block_pool
        layout = core.executor.kv_cache_layout
        engine.add_request("long", {"prompt_token_ids": list(range(100, 100 + PROMPT_LEN))},
                           SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True))
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, pool.num_usable_blocks - pool.num_free_blocks)
        assert pool.num_free_blocks == pool.num_usable_blocks
        return peak, peak * layout.group_size, layout.groups
    finally:
        del llm
        gc.collect()


def test_a_long_sequence_on_a_sliding_model_holds_fewer_blocks(
        tiny_model_dir: Callable[[str], str], tmp_path: Any) -> None:
    """Mistral, window 16 on every layer: one sliding group, about 16 / 4 + 1 blocks held
    against the 50 of all 200 tokens."""
    sliding = tiny_model_dir("mistral")
    full = _full_attention_copy(sliding, str(tmp_path / "mistral_full"), {"sliding_window": None})
    with torch_threads(1):
        sliding_blocks, _, sliding_groups = _peak_usage(sliding)
        full_blocks, _, full_groups = _peak_usage(full)
    assert sliding_groups == (KVCacheGroup((0, 1, 2), 16),)
    assert full_groups == (KVCacheGroup((0, 1, 2), None),)
    assert full_blocks == (PROMPT_LEN + OUTPUT_LEN) // BLOCK_SIZE
    # The window's 15 keys and a prefill chunk of 32 span at most 13 blocks.
    assert sliding_blocks <= 13 < full_blocks


def test_interleaved_sliding_layers_hold_fewer_pages(
        tiny_model_dir: Callable[[str], str], tmp_path: Any) -> None:
    """Gemma 3, sliding / full / sliding: three groups of one layer. The full layer keeps every
    block, the sliding ones their window's."""
    sliding = tiny_model_dir("gemma3")
    full = _full_attention_copy(sliding, str(tmp_path / "gemma3_full"),
                                {"layer_types": ["full_attention"] * 3})
    with torch_threads(1):
        _, sliding_pages, sliding_groups = _peak_usage(sliding)
        _, full_pages, full_groups = _peak_usage(full)
    assert sliding_groups == (KVCacheGroup((1,), None), KVCacheGroup((0,), 16),
                              KVCacheGroup((2,), 16))
    assert full_groups == (KVCacheGroup((0, 1, 2), None),)
    whole = (PROMPT_LEN + OUTPUT_LEN) // BLOCK_SIZE
    assert full_pages == 3 * whole
    assert sliding_pages <= whole + 2 * 13 < full_pages

