"""The host KV tier through the engine (issue 23, item 2), on the default model (SmolLM2-135M,
float32 on the CPU, whose "host" pool is a second CPU pool): a prompt whose prefix blocks were
evicted from a small device pool by later prompts comes back from the host tier — every full
block of it cached (device hits plus host loads), only its last token computed — and the
greedy answers are the engine's without the tier; a salted request finds nothing of another
tenant; the tier's metrics count it."""
from __future__ import annotations

import logging
import os
import random
import shutil

import pytest

from folio import LLM, SamplingParams
from folio.model.default_model import default_model_path

pytestmark = pytest.mark.slow

BLOCK = 16
PROMPT_LEN = 8 * BLOCK + 1          # eight full blocks and the token that must be computed


def _token_prompts(llm: LLM) -> list[dict]:
    """Four prompts of PROMPT_LEN tokens from standard-library sources (text no one here
    wrote): the first is asked again after the others evicted it."""
    tok = llm.get_tokenizer()
    out = []
    for name in ("textwrap.py", "bisect.py", "colorsys.py", "fnmatch.py"):
        with open(os.path.join(os.path.dirname(os.__file__), name), encoding="utf-8") as f:
            ids = tok.encode(f.read()[:4000])
        out.append({"prompt_token_ids": ids[:PROMPT_LEN]})
    return out


def _make(**kw) -> LLM:
    return LLM(default_model_path(), dtype="float32", kv_cache_dtype="float32",
               max_model_len=192, num_gpu_blocks_override=12, max_num_seqs=1, device="cpu",
               **kw)


def test_an_evicted_prefix_is_served_from_the_host_tier() -> None:
    params = SamplingParams(temperature=0, max_tokens=16)
    plain = _make()
    prompts = _token_prompts(plain)
    sequence = prompts + [prompts[0]]
    want = [list(plain.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids)
            for p in sequence]
    plain.llm_engine.shutdown()

    llm = _make(kv_offloading_size=0.1)
    outs = [llm.generate(p, params, use_tqdm=False)[0] for p in sequence]
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    again = outs[-1]
    # every full block of the prompt cached, none of it on the device any more: loaded
    assert again.num_cached_tokens == PROMPT_LEN - 1
    stats = llm.llm_engine.engine_core.scheduler.stats()
    assert stats.kv_offload_hit_blocks == 8 and stats.kv_offload_loaded_bytes > 0
    assert stats.kv_offload_saved_bytes >= stats.kv_offload_loaded_bytes

    # another tenant (a cache_salt) finds none of it, and still gets the same answer
    salted = llm.generate(prompts[0], params, cache_salt="tenant-2", use_tqdm=False)[0]
    assert salted.num_cached_tokens == 0 and list(salted.outputs[0].token_ids) == want[0]
    assert llm.llm_engine.engine_core.scheduler.stats().kv_offload_hit_blocks == 8
    llm.llm_engine.shutdown()


def test_a_lora_adapter_finds_nothing_the_base_model_saved(tiny_model_dir, tmp_path) -> None:
    """An adapter's K/V differ from the base model's: its request on a prefix the base model
    left in the host tier loads nothing and answers as it does without the tier; the base
    model's request on it still loads every full block."""
    pytest.importorskip("peft")
    from lora_utils import make_adapter

    from folio import LoRARequest
    model = tiny_model_dir("llama")
    adapter = LoRARequest("r8", 1, make_adapter(model, str(tmp_path / "r8"), seed=12, std=0.2,
                                                r=8, lora_alpha=8,
                                                target_modules=["q_proj", "k_proj", "v_proj"]))
    prompts = _random_prompts()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def make(**kw) -> LLM:
        return LLM(model, dtype="float32", max_model_len=192, num_gpu_blocks_override=12,
                   max_num_seqs=1, device="cpu", enable_lora=True, max_loras=1,
                   max_lora_rank=8, **kw)

    def ask(llm, lora=None):
        return llm.generate(prompts[0], params, lora_request=lora, use_tqdm=False)[0]

    plain = make()
    want_base = list(ask(plain).outputs[0].token_ids)
    want_lora = list(ask(plain, adapter).outputs[0].token_ids)
    plain.llm_engine.shutdown()
    assert want_lora != want_base            # else the adapter proves nothing

    llm = make(kv_offloading_size=0.01)
    ask(llm)
    for prompt in prompts[1:]:               # evict the base model's blocks to the host
        llm.generate(prompt, params, use_tqdm=False)
    adapted = ask(llm, adapter)
    assert adapted.num_cached_tokens == 0 and list(adapted.outputs[0].token_ids) == want_lora
    assert llm.llm_engine.engine_core.scheduler.stats().kv_offload_hit_blocks == 0
    base = ask(llm)
    assert base.num_cached_tokens == PROMPT_LEN - 1
    assert list(base.outputs[0].token_ids) == want_base
    assert llm.llm_engine.engine_core.scheduler.stats().kv_offload_hit_blocks == 8
    llm.llm_engine.shutdown()


def test_bad_settings_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="kv_offloading_size"):
        _make(kv_offloading_size=-1)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        _make(kv_offloading_size=0.1, enable_prefix_caching=False)


def test_the_disk_tier_survives_a_restart_and_a_bad_file_is_a_miss(tmp_path, caplog) -> None:
    """Run 1 pushes the first prompt's blocks through the device and host pools to disk.
    A new engine on the same directory reads them back (every full block cached, the same
    answer); with one of the files corrupted, that block and those after it are computed,
    a log line says so, and the answer is still the same."""
    import logging
    params = SamplingParams(temperature=0, max_tokens=16)
    tiers = dict(kv_offloading_size=0.007, kv_disk_path=str(tmp_path), kv_disk_size=0.5)
    llm = _make(**tiers)
    prompts = _token_prompts(llm)
    want = list(llm.generate(prompts[0], params, use_tqdm=False)[0].outputs[0].token_ids)
    for prompt in prompts[1:]:
        llm.generate(prompt, params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.host_tier.stats.disk_spilled_blocks >= 8
    llm.llm_engine.shutdown()

    llm = _make(**tiers)                    # a restart: empty device and host pools
    again = llm.generate(prompts[0], params, use_tqdm=False)[0]
    assert list(again.outputs[0].token_ids) == want
    assert again.num_cached_tokens == PROMPT_LEN - 1
    assert llm.llm_engine.engine_core.scheduler.stats().kv_disk_read_blocks == 8
    llm.llm_engine.shutdown()

    files = sorted((p for p in tmp_path.rglob("*") if p.is_file()), key=lambda p: p.name)
    assert files
    llm = _make(**tiers)
    for path in files:                     # corrupt every file's payload, one byte each
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="folio"):
        again = llm.generate(prompts[0], params, use_tqdm=False)[0]
    assert list(again.outputs[0].token_ids) == want
    assert again.num_cached_tokens == 0
    assert "checksum mismatch" in caplog.text
    stats = llm.llm_engine.engine_core.scheduler.stats()
    assert stats.kv_disk_bad_blocks >= 1 and stats.kv_disk_read_blocks == 0
    llm.llm_engine.shutdown()


def _random_prompts() -> list[dict]:
    """Four PROMPT_LEN-token prompts for the tiny models (random ids, fixed seed)."""
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(PROMPT_LEN)]}
            for _ in range(4)]


_TINY_SLOT = 3 * 2 * BLOCK * 2 * 16 * 4     # layers, planes, tokens, KV heads, dim, float32


def _tiny_answers(model: str, batch: list[dict], **kw):
    """([(answer, cached tokens)] of each prompt in turn, scheduler stats) of a tiny model
    with a 12-block device pool."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(model, dtype="float32", max_model_len=192, num_gpu_blocks_override=12,
              max_num_seqs=1, device="cpu", **kw)
    outs = [llm.generate(p, params, use_tqdm=False)[0] for p in batch]
    stats = llm.llm_engine.engine_core.scheduler.stats()
    llm.llm_engine.shutdown()
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outs], stats


def _tiny_tiers(disk) -> dict:
    return dict(kv_offloading_size=6 * _TINY_SLOT / 2**30, kv_disk_path=str(disk),
                kv_disk_size=0.5)


@pytest.fixture(scope="module")
def tiny_disk(tiny_model_dir, tmp_path_factory):
    """(tiny llama, prompts, first prompt's [(answer, 0)] without tiers, a disk tier
    directory holding that prompt's blocks): built once, tests damage copies of it."""
    model = tiny_model_dir("llama")
    prompts = _random_prompts()
    want, _ = _tiny_answers(model, prompts[:1])
    disk = tmp_path_factory.mktemp("kv_disk")
    _tiny_answers(model, prompts, **_tiny_tiers(disk))
    return model, prompts, want, disk


@pytest.mark.parametrize("damage, problem", [
    (lambda data: data[:-10], "bytes, expected"),
    (lambda data: b"NOTFOLI" + data[7:], "not a folio KV block file"),
], ids=["truncated", "bad-magic"])
def test_a_short_or_foreign_disk_block_file_is_a_miss(tiny_disk, tmp_path, caplog, damage,
                                                      problem) -> None:
    """Only the checksum test above reaches the payload: a short file and a bad header
    fail earlier checks, and must also be misses (logged, deleted), not crashes."""
    model, prompts, want, populated = tiny_disk
    disk = tmp_path / "disk"
    shutil.copytree(populated, disk)
    files = [p for p in disk.rglob("*") if p.is_file()]
    assert len(files) >= 6
    for path in files:
        path.write_bytes(damage(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="folio"):
        got, stats = _tiny_answers(model, prompts[:1], **_tiny_tiers(disk))
    assert got == want                       # the same answer, nothing cached
    assert problem in caplog.text and "computed instead" in caplog.text
    assert stats.kv_disk_bad_blocks >= 1 and stats.kv_disk_read_blocks == 0
    assert sum(p.is_file() for p in files) < len(files)       # bad files are deleted


@pytest.mark.parametrize("other", ["kv-dtype", "model"])
def test_another_kv_dtype_or_model_reads_nothing_from_a_shared_disk_dir(
        tiny_disk, tmp_path, smollm2_tokenizer, other) -> None:
    """The directory is shared, its blocks are not: another KV dtype (other file size) or
    another model of the same shapes (files that would pass every check) reads none, marks
    none bad, answers as without tiers; the first engine still reads all of them after."""
    import model_utils
    model, prompts, want, populated = tiny_disk
    disk = tmp_path / "disk"
    shutil.copytree(populated, disk)
    if other == "kv-dtype":
        kw = dict(model=model, kv_cache_dtype="bfloat16")
    else:
        kw = dict(model=model_utils.build_tiny_model("llama", str(tmp_path / "llama2"),
                                                     smollm2_tokenizer, seed=7))
    plain, _ = _tiny_answers(batch=prompts[:1], **kw)
    got, stats = _tiny_answers(batch=prompts[:1], **kw, **_tiny_tiers(disk))
    assert got == plain and got[0][1] == 0
    assert stats.kv_disk_read_blocks == 0 and stats.kv_disk_bad_blocks == 0
    again, stats = _tiny_answers(model, prompts[:1], **_tiny_tiers(disk))
    assert again == [(want[0][0], 6 * BLOCK)] and stats.kv_disk_read_blocks == 6

def _preempting_run(**kw):
    """Four 49-token prompts, 40 tokens each, in a 14-block pool: requests are preempted.
    (answers, scheduler stats)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(default_model_path(), dtype="float32", kv_cache_dtype="float32",
              max_model_len=128, num_gpu_blocks_override=14, max_num_seqs=4, device="cpu", **kw)
    prompts = [{"prompt_token_ids": p["prompt_token_ids"][:49]} for p in _token_prompts(llm)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.engine_core.scheduler.stats()
    llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], stats


def test_preempted_requests_resume_from_the_host_tier(caplog) -> None:
    """Swap by way of the tier: a preempted request's full blocks stay cached, are saved to
    the host when the device pool evicts them, and load back when it resumes. Answers are
    those of the engine without the tier (recompute preemption)."""

    import logging
    want, plain_stats = _preempting_run()
    with caplog.at_level(logging.INFO, logger="folio.core.scheduler"):
        got, stats = _preempting_run(kv_offloading_size=0.05)
    assert "(device, then host tier: a swap)" in caplog.text
    assert plain_stats.num_preemptions > 0 and stats.num_preemptions > 0
    assert got == want
    assert stats.kv_offload_hit_blocks > 0


def test_a_tiny_host_pool_spills_only_written_slots(tiny_model_dir, tmp_path) -> None:
    """Six host slots and many evictions per step (a tiny model's 3-layer blocks): after a
    restart the first prompt's blocks are read back from disk and the answer is the one the
    engine gives without tiers (a spill of a slot saved in the same step once wrote stale
    bytes to disk here)."""
    model = tiny_model_dir("llama")
    prompts = _random_prompts()
    want, _ = _tiny_answers(model, prompts[:1])
    tiers = _tiny_tiers(tmp_path)
    _tiny_answers(model, prompts, **tiers)
    again, stats = _tiny_answers(model, prompts[:1], **tiers)
    assert again[0][0] == want[0][0]
    assert stats.kv_disk_read_blocks == 6 and again[0][1] == 6 * BLOCK


def test_vllms_kv_transfer_config_turns_the_host_tier_on() -> None:
    llm = _make(kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 26}})
    tier = llm.llm_engine.engine_core.scheduler.host_tier
    assert tier is not None and tier.num_host_blocks == (1 << 26) // 737280   # SmolLM2 fp32
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("swap", [True, False])
def test_swap_and_recompute_preemption_give_the_same_answers(swap, monkeypatch, caplog) -> None:
    """Preemption priced either way (forced here): a swap keeps the preempted request's full
    blocks for the host tier, a recompute leaves them unsaved; the answers are those of the
    engine without the tier, the choice is counted and logged with its reason."""
    import logging

    from folio.core.kv_offload import SwapPricing
    monkeypatch.setattr(SwapPricing, "choose",
                        lambda self, n, bs, free, pool: (swap, "forced by the test"))

    want, _ = _preempting_run()
    with caplog.at_level(logging.INFO, logger="folio.core.scheduler"):
        got, stats = _preempting_run(kv_offloading_size=0.05)
    assert got == want
    assert stats.num_preemptions > 0
    assert "forced by the test" in caplog.text
    if swap:
        assert stats.kv_swap_preemptions > 0 and stats.kv_recompute_preemptions == 0
        assert "preempted" in caplog.text and ": swap (" in caplog.text
    else:
        assert stats.kv_recompute_preemptions > 0 and stats.kv_swap_preemptions == 0
        assert ": recompute (" in caplog.text
