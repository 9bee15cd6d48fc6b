"""LoRA through the offline API on a tiny random Llama: every bad adapter or request is a
ValueError naming the problem and the engine goes on serving; adapters come back from the
host cache or their files as the slots and --max-cpu-loras allow; Qwen2's biased q/k/v and
a model whose slots are all in use still give peft's tokens."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from lora_utils import make_adapter, peft_greedy

pytest.importorskip("peft")

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 17, 42, 99, 7, 3, 250, 11]}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_adapters")
    return {
        "r4": make_adapter(tiny, str(root / "r4"), seed=11, std=0.2, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj", "down_proj"]),
        "r8": make_adapter(tiny, str(root / "r8"), seed=12, std=0.2, r=8, lora_alpha=8,
                           target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]),
        "r32": make_adapter(tiny, str(root / "r32"), seed=13, std=0.2, r=32, lora_alpha=8,
                            target_modules=["q_proj"]),
    }


@pytest.fixture(scope="module")
def llm(tiny):
    from folio import LLM
    return LLM(tiny, dtype="float32", device="cpu", max_model_len=128,
               kv_cache_memory_bytes=1 << 24, enable_lora=True, max_loras=1, max_cpu_loras=1,
               max_lora_rank=16, distributed_executor_backend="uni")


def _generate(llm, lora=None) -> list[int]:
    from folio import SamplingParams
    out = llm.generate(PROMPT, SamplingParams(**GREEDY), lora_request=lora, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def test_one_slot_one_host_slot_swaps_and_reloads_each_adapter(llm, tiny, adapters):
    from folio import LoRARequest
    r4, r8 = LoRARequest("r4", 1, adapters["r4"]), LoRARequest("r8", 2, adapters["r8"])
    want = {name: peft_greedy(tiny, adapters[name], [PROMPT["prompt_token_ids"]], 8)[0]
            for name in ("r4", "r8")}
    assert want["r4"] != want["r8"] != _generate(llm)   # the adapters change the answer
    manager = llm.llm_engine.engine_core.executor.worker.lora
    loads = manager.num_loads
    # both in one call: one slot, so the scheduler runs them one after the other
    outs = llm.generate([PROMPT, PROMPT], _params(), lora_request=[r4, r8], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [want["r4"], want["r8"]]
    assert manager.num_loads == loads + 2
    assert _generate(llm, r4) == want["r4"]     # evicted from host memory: read again
    assert manager.num_loads == loads + 3
    assert _generate(llm, r4) == want["r4"]     # still in its slot
    assert manager.num_loads == loads + 3
    assert manager.device_adapters == [1] and manager.host_adapters == [1]


def _params():
    from folio import SamplingParams
    return SamplingParams(**GREEDY)


def test_bad_adapters_are_value_errors_and_the_engine_goes_on(llm, tiny, adapters, tmp_path):
    from folio import LoRARequest
    base = _generate(llm)

    def refused(lora, *words):
        with pytest.raises(ValueError) as info:
            _generate(llm, lora)
        for word in words:
            assert word in str(info.value), str(info.value)

    refused(LoRARequest("big", 10, adapters["r32"]), "rank 32", "max_lora_rank (16)")
    refused(LoRARequest("none", 11, str(tmp_path / "missing")), "no such directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(LoRARequest("empty", 12, str(empty)), "adapter_config.json")
    broken = tmp_path / "broken"
    shutil.copytree(adapters["r4"], broken)
    (broken / "adapter_config.json").write_text("{not json")
    refused(LoRARequest("broken", 13, str(broken)), "not valid JSON")
    truncated = tmp_path / "truncated"
    shutil.copytree(adapters["r4"], truncated)
    with open(truncated / "adapter_model.safetensors", "r+b") as f:
        f.truncate(20)
    refused(LoRARequest("truncated", 14, str(truncated)), "adapter_model.safetensors")
    dora = tmp_path / "dora"
    shutil.copytree(adapters["r4"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    refused(LoRARequest("dora", 15, str(dora)), "use_dora")
    refused("r4", "must be a LoRARequest")
    # an id already naming another adapter
    assert _generate(llm, LoRARequest("r4", 1, adapters["r4"]))
    refused(LoRARequest("other", 1, adapters["r8"]), "lora_int_id 1 already names")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, adapters["r4"])
    # nothing of the above reached the engine: it still answers, the same as before
    assert _generate(llm) == base
    assert not llm.llm_engine.has_unfinished_requests()


def test_adapter_of_another_model_is_refused(llm, tiny_model_dir, tmp_path):
    from folio import LoRARequest
    other = make_adapter(tiny_model_dir("qwen3"), str(tmp_path / "qwen3"), seed=1, r=4,
                         target_modules=["q_proj"])
    with pytest.raises(ValueError, match="do not fit"):
        _generate(llm, LoRARequest("q", 21, other))


def test_lora_off_refuses_a_lora_request(tiny, adapters):
    from folio import LLM, LoRARequest
    plain = LLM(tiny, dtype="float32", device="cpu", max_model_len=64,
                kv_cache_memory_bytes=1 << 22, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="not enabled"):
        _generate(plain, LoRARequest("r4", 1, adapters["r4"]))


def test_qwen2_biased_qkv_matches_peft(tiny_model_dir, tmp_path):
    from folio import LLM, LoRARequest
    base = tiny_model_dir("qwen2")
    path = make_adapter(base, str(tmp_path / "a"), seed=5, std=0.2, r=8,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    want = peft_greedy(base, path, [PROMPT["prompt_token_ids"]], 8)[0]
    llm = LLM(base, dtype="float32", device="cpu", max_model_len=64,
              kv_cache_memory_bytes=1 << 22, enable_lora=True,
              distributed_executor_backend="uni")
    assert _generate(llm, LoRARequest("a", 1, path)) == want
    assert os.path.isdir(path)


def test_bench_random_adapters_are_valid_peft_directories(tiny, tmp_path):
    """`folio bench --lora N`'s adapters pass the front end's checks and run."""
    from folio import LLM
    from folio.bench.lora_adapters import spread, write_random_adapters
    from folio.model.discovery import load_hf_config, resolve_model_source
    from folio.model.families import arch_spec_from_hf_config
    from folio.model.lora.adapter_files import read_adapter

    hf_config, _ = load_hf_config(resolve_model_source(tiny))
    requests = write_random_adapters(hf_config, 2, 8, str(tmp_path))
    spec = arch_spec_from_hf_config(hf_config)
    for request in requests:
        files = read_adapter(request.lora_path, spec, max_rank=8)
        assert files.rank == 8 and len(files.modules) == 7 * spec.num_layers
    assert spread(requests, 3) == [requests[0], requests[1], requests[0]]
    llm = LLM(tiny, dtype="float32", device="cpu", max_model_len=64,
              kv_cache_memory_bytes=1 << 22, enable_lora=True, max_loras=2,
              distributed_executor_backend="uni")
    outs = llm.generate([PROMPT] * 3, _params(), lora_request=spread(requests, 3),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


def test_chat_and_ngram_speculation_keep_the_adapters_answer(tiny, adapters):
    """LLM.chat takes lora_request; n-gram drafts are verified by the model with the
    adapter, so greedy answers do not change."""
    from folio import LLM, LoRARequest, SamplingParams
    lora = LoRARequest("r4", 1, adapters["r4"])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    repeated = {"prompt_token_ids": [5, 17, 42, 99, 7] * 6}
    common = dict(dtype="float32", device="cpu", max_model_len=128,
                  kv_cache_memory_bytes=1 << 24, enable_lora=True,
                  distributed_executor_backend="uni")
    plain = LLM(tiny, **common)
    want = plain.generate(repeated, params, lora_request=lora, use_tqdm=False)
    chat = [{"role": "user", "content": "hello there"}]
    want_chat = plain.chat(chat, params, lora_request=lora, use_tqdm=False)
    assert want_chat[0].outputs[0].token_ids != plain.chat(chat, params, use_tqdm=False)[
        0].outputs[0].token_ids
    spec = LLM(tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 2}, **common)
    got = spec.generate(repeated, params, lora_request=lora, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    got_chat = spec.chat(chat, params, lora_request=lora, use_tqdm=False)
    assert got_chat[0].outputs[0].token_ids == want_chat[0].outputs[0].token_ids


def test_adapter_whose_files_break_after_the_check_fails_only_its_request(llm, adapters,
                                                                          tmp_path):
    """The front end checked the files; they change before the worker loads them: that
    request finishes with an error, the others in the step are answered, the engine goes on."""
    from folio import LoRARequest, SamplingParams
    path = tmp_path / "fragile"
    shutil.copytree(adapters["r8"], path)
    engine = llm.llm_engine
    base = _generate(llm)
    params = SamplingParams(**GREEDY)
    engine.add_request("fragile", PROMPT, params, lora_request=LoRARequest("fragile", 31,
                                                                          str(path)))
    engine.add_request("plain", PROMPT, params)
    with open(path / "adapter_model.safetensors", "r+b") as f:
        f.truncate(64)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert outs["fragile"].outputs[0].finish_reason == "error"
    assert list(outs["plain"].outputs[0].token_ids) == base
    assert _generate(llm) == base


def _drain(engine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return outs


def test_remove_lora_frees_the_workers_copies(llm, adapters):
    """vLLM's remove_lora: the next step message has the worker drop the adapter's host copy
    and device slot (a request using it finishes with it first); the same directory under a
    new id is read from its files again and answers the same."""
    from folio import LoRARequest
    engine = llm.llm_engine
    manager = engine.engine_core.executor.worker.lora
    first = _generate(llm, LoRARequest("r8-first", 41, adapters["r8"]))
    assert manager.host_adapters == [41] and manager.device_adapters == [41]
    assert 41 in engine.list_loras()
    assert engine.remove_lora(41) is True
    assert 41 not in engine.list_loras()
    engine.step()           # idle: the next (empty) step message carries the removal
    assert manager.host_adapters == [] and manager.device_adapters == []
    assert engine.remove_lora(41) is False
    loads = manager.num_loads
    again = LoRARequest("r8-again", 42, adapters["r8"])
    engine.add_request("again", PROMPT, _params(), lora_request=again)
    engine.step()
    assert engine.remove_lora(42) is True   # while its request runs
    outs = _drain(engine)
    assert list(outs["again"].outputs[0].token_ids) == first
    assert manager.num_loads == loads + 1 and manager.device_adapters == [42]
    engine.step()           # the request is done: now the removal goes out
    assert manager.host_adapters == [] and manager.device_adapters == []


def test_a_failed_adapter_load_is_remembered_until_removed(llm, adapters, tmp_path):
    """The worker does not read a broken adapter's files for every request of it: the
    failure stands for its id, even after the files are mended, until remove_lora."""
    from folio import LoRARequest
    engine = llm.llm_engine
    want = _generate(llm, LoRARequest("r4", 1, adapters["r4"]))
    path = tmp_path / "flaky"
    shutil.copytree(adapters["r4"], path)
    weights = path / "adapter_model.safetensors"
    lora = LoRARequest("flaky", 51, str(path))
    engine.add_request("f1", PROMPT, _params(), lora_request=lora)   # checked: fine
    with open(weights, "r+b") as f:
        f.truncate(64)
    assert _drain(engine)["f1"].outputs[0].finish_reason == "error"
    shutil.copyfile(os.path.join(adapters["r4"], "adapter_model.safetensors"), weights)
    engine.add_request("f2", PROMPT, _params(), lora_request=lora)
    assert _drain(engine)["f2"].outputs[0].finish_reason == "error"   # not read again
    assert engine.remove_lora(51) is True
    assert _generate(llm, lora) == want
