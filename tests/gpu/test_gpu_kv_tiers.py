"""The host KV tier on a CUDA GPU (pinned host pool, bf16, CUDA graphs): a prompt whose
prefix blocks a small device pool evicted comes back from the host tier — its full blocks
loaded, not computed — and the greedy answers equal the engine's without the tier; the disk
tier below it likewise after a restart. Skipped without a GPU; run through the device tool
(tools/device_issue23.sh)."""
from __future__ import annotations

import gc
import random

import pytest
import torch

from test_gpu_engine import VOCAB, _build

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BLOCK = 16
PROMPT_LEN = 8 * BLOCK + 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _build("llama", str(tmp_path_factory.mktemp("llama_tiers")))


def _answers(model_dir: str, prompts, **kw):
    from folio import LLM, SamplingParams
    llm = LLM(model_dir, dtype="bfloat16", max_model_len=192, num_gpu_blocks_override=12,
              max_num_seqs=1, device="cuda", **kw)
    params = SamplingParams(temperature=0, max_tokens=16)
    outs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts]
    stats = llm.llm_engine.engine_core.scheduler.stats()
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outs], stats


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)] for _ in range(4)]


def test_host_and_disk_tiers_on_cuda(model_dir, tmp_path) -> None:
    prompts = _prompts()
    sequence = prompts + [prompts[0]]
    want, _ = _answers(model_dir, sequence)
    got, stats = _answers(model_dir, sequence, kv_offloading_size=0.05)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert got[-1][1] == PROMPT_LEN - 1 and stats.kv_offload_hit_blocks == 8
    # six host slots (32 KiB blocks): the first prompt's blocks are spilled to disk, and
    # six of them fit the host pool again after a restart
    disk = dict(kv_offloading_size=0.0002, kv_disk_path=str(tmp_path), kv_disk_size=0.5)
    _answers(model_dir, sequence[:-1], **disk)
    again, stats = _answers(model_dir, [prompts[0]], **disk)     # a restart
    assert again[0][0] == want[0][0]
    assert stats.kv_disk_read_blocks == 6 and again[0][1] == 6 * BLOCK
