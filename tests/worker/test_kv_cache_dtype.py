"""--kv-cache-dtype (CacheConfig.cache_dtype): the values and aliases the config takes (and
vLLM's FP8 names it does not: the FP8 cache's own tests are test_fp8_kv_cache.py), the flag, the worker sizing and allocating the cache in that
dtype, the CUDA (Triton) refusal, and greedy generation on a tiny float32 model with a
bfloat16 / float16 cache against the model-dtype cache, on the C++ CPU backend and the torch
reference."""
from __future__ import annotations

import argparse
import logging

import pytest
import torch

from model_utils import torch_threads

from folio import LLM, SamplingParams
from folio.config import CacheConfig, EngineConfig
from folio.model.families import ArchSpec
from folio.worker.kv_cache import (allocate_kv_caches, bytes_per_block, determine_num_blocks,
                                   resolve_cache_dtype)

# ---------------------------------------------------------------------------------------------
# Config and flag
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    ("auto", "auto"), ("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
    ("bf16", "bfloat16"), ("fp16", "float16"), ("half", "float16"), ("float", "float32"),
    ("fp32", "float32"), ("BF16", "bfloat16"), ("Float16", "float16"),
])
def test_config_accepts_and_normalizes(value, expected):
    assert CacheConfig(cache_dtype=value).cache_dtype == expected


def test_config_default_is_the_model_dtype():
    assert CacheConfig().cache_dtype == "auto"
    assert EngineConfig().cache.cache_dtype == "auto"


@pytest.mark.parametrize("value", ["fp8_inc", "fp8_ds_mla", "FP8_E4M3FN"])
def test_config_refuses_other_fp8_names_by_name(value):
    with pytest.raises(ValueError, match=r"cache_dtype .* is not supported: the FP8 KV cache "
                                         r"dtypes are \['fp8', 'fp8_e4m3', 'fp8_e5m2'\]"):
        CacheConfig(cache_dtype=value)


@pytest.mark.parametrize("value", ["int8", "float64", "", None, 16, "bfloat16 "])
def test_config_refuses_garbage(value):
    with pytest.raises(ValueError, match="cache_dtype must be one of"):
        CacheConfig(cache_dtype=value)


def _serve_config(*argv: str):
    from folio.entrypoints.openai.cli_args import add_serve_args, build_engine_config
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return build_engine_config(parser.parse_args(list(argv)))


def _engine_kwargs(*argv: str) -> dict:
    from folio.engine.arg_utils import add_engine_args, engine_kwargs_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_kwargs_from_args(parser.parse_args(list(argv)))


def test_flag_default_and_values_reach_llm_kwargs_and_the_server_config():
    assert _engine_kwargs()["kv_cache_dtype"] == "auto"
    assert _serve_config().cache.cache_dtype == "auto"
    for value, expected in [("bfloat16", "bfloat16"), ("float16", "float16"),
                            ("float32", "float32"), ("bf16", "bfloat16"), ("half", "float16")]:
        assert _engine_kwargs("--kv-cache-dtype", value)["kv_cache_dtype"] == expected
        assert _serve_config("--kv-cache-dtype", value).cache.cache_dtype == expected


@pytest.mark.parametrize("value, message", [("fp8_inc", "the FP8 KV cache dtypes are"),
                                            ("int4", "cache_dtype must be one of")])
def test_flag_refuses_other_fp8_names_and_garbage(value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _engine_kwargs("--kv-cache-dtype", value)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_flag_is_in_every_engine_command_help(capsys):
    from folio.entrypoints.cli import main
    for command in (["serve"], ["chat"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert ("--kv-cache-dtype {auto,float32,bfloat16,float16,fp8,fp8_e4m3,fp8_e5m2}"
                in text), command


# ---------------------------------------------------------------------------------------------
# Sizing and allocation
# ---------------------------------------------------------------------------------------------

# The tiny models' attention geometry: 3 layers, 2 KV heads of 16.
_SPEC = ArchSpec(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=49152, rms_norm_eps=1e-6,
                 max_position_embeddings=1024, tie_word_embeddings=False)
_FP32_BLOCK = 2 * 3 * 16 * 2 * 16 * 4  # K and V x layers x block x heads x head_dim x 4 bytes


def test_resolve_cache_dtype():
    assert resolve_cache_dtype("auto", torch.float32) is torch.float32
    assert resolve_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_cache_dtype("bfloat16", torch.float32) is torch.bfloat16
    assert resolve_cache_dtype("float16", torch.float32) is torch.float16
    assert resolve_cache_dtype("float32", torch.bfloat16) is torch.float32
    # GGUF weights on the CPU: "auto" is float16, llama.cpp's default for the same file; an
    # explicit dtype, or the dequantized float path, keep theirs.
    assert resolve_cache_dtype("auto", torch.float32, "gguf") is torch.float16
    assert resolve_cache_dtype("float32", torch.float32, "gguf") is torch.float32
    assert resolve_cache_dtype("auto", torch.float32, "none") is torch.float32
    assert resolve_cache_dtype("auto", torch.float32, "int8") is torch.float32
    assert resolve_cache_dtype("auto", torch.bfloat16, "gguf") is torch.bfloat16


@pytest.mark.parametrize("dtype, blocks", [(torch.float32, 64), (torch.bfloat16, 128),
                                           (torch.float16, 128)])
def test_two_byte_cache_holds_twice_the_blocks(dtype, blocks):
    assert bytes_per_block(_SPEC, 16, torch.float32) == _FP32_BLOCK
    assert bytes_per_block(_SPEC, 16, dtype) * blocks == 64 * _FP32_BLOCK
    assert determine_num_blocks(_SPEC, block_size=16, dtype=dtype, max_model_len=256,
                                kv_cache_memory_bytes=64 * _FP32_BLOCK,
                                num_blocks_override=None) == blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_allocated_in_the_cache_dtype(dtype):
    caches = allocate_kv_caches(_SPEC, 8, 16, dtype, torch.device("cpu"))
    assert len(caches) == 3
    assert all(c.dtype == dtype and c.shape == (2, 8, 16, 2, 16) for c in caches)
    assert all(not c.any() for c in caches)


def test_cuda_triton_refuses_a_cache_dtype_other_than_the_model_dtype():
    # Pure check, no CUDA needed: torch.device("cuda") is only a name here.
    from folio.model.attention.selector import check_kv_cache_dtype
    from folio.model.kernel_config import KernelConfig
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with pytest.raises(ValueError, match=r"kv_cache_dtype float16 differs from the model's "
                                         r"dtype bfloat16: the CUDA \(Triton\)"):
        check_kv_cache_dtype(cuda, torch.bfloat16, torch.float16, KernelConfig())
    check_kv_cache_dtype(cuda, torch.bfloat16, torch.bfloat16, KernelConfig())
    # The torch reference on CUDA, and every CPU backend, convert.
    check_kv_cache_dtype(cuda, torch.bfloat16, torch.float16, KernelConfig(attention="torch"))
    check_kv_cache_dtype(cpu, torch.float32, torch.bfloat16, KernelConfig())
    check_kv_cache_dtype(cpu, torch.float32, torch.float16, KernelConfig(attention="torch"))


# ---------------------------------------------------------------------------------------------
# End to end on a tiny float32 model
# ---------------------------------------------------------------------------------------------

PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello, my name is",
           "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]
MAX_TOKENS = 8
KV_BYTES = 64 * _FP32_BLOCK   # 64 float32 blocks of 16 tokens: 1024 tokens
# Logprob (nats) of each greedy token, the cache dtype's run against the float32 cache's.
# bfloat16 keeps 8 significant bits (each cached K/V element off by up to 2^-9 relative),
# float16 11 (2^-12, 8x finer); through the 3 layers of the tiny model that moved the
# logprobs by at most 0.083 (bfloat16) and 0.009 (float16) over 24 tokens of these prompts.
# The bounds leave about 2x room; a cache ignored (left float32) is caught by the check that
# bfloat16 moves them at all.
LOGPROB_TOL = {"bfloat16": 0.15, "float16": 0.02}

BACKENDS = ["cpp", "torch"]


def _build(model_dir: str, **kwargs) -> LLM:
    # In process (the test reaches into the worker, also under pytest --executor-backend mp).
    return LLM(model_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=KV_BYTES,
               distributed_executor_backend="uni", **kwargs)


def _worker(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker


def _use_backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if backend == "torch":
        monkeypatch.setenv("FOLIO_ATTENTION", "torch")
    else:
        monkeypatch.delenv("FOLIO_ATTENTION", raising=False)
        from folio.model import cpu_kernels
        if cpu_kernels.loaded() is None:
            pytest.skip("folio's C++ CPU kernels do not build here")


def _backend_name(llm: LLM) -> str:
    from folio.model.attention.cpu_backend import CpuPagedAttention
    from folio.model.attention.torch_paged import TorchPagedAttention
    backends = {type(m.backend) for m in _worker(llm).model.modules() if hasattr(m, "backend")}
    assert len(backends) == 1, backends
    return {CpuPagedAttention: "cpp", TorchPagedAttention: "torch"}[backends.pop()]


def _greedy(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[pos[t].logprob for t, pos in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
           for o in outs]
    return ids, lps


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generation_with_a_2_byte_cache_on_a_float32_model(backend, tiny_model_dir,
                                                                   monkeypatch):
    _use_backend(backend, monkeypatch)
    model_dir = tiny_model_dir("llama")
    with torch_threads(1):
        reference = _build(model_dir)
        worker = _worker(reference)
        assert _backend_name(reference) == backend
        assert worker.kv_cache_dtype == torch.float32 and worker.num_blocks == 64
        assert {c.dtype for c in worker.kv_caches} == {torch.float32}
        ref_ids, ref_lps = _greedy(reference)
        del reference, worker
        for cache_dtype, torch_dtype in [("bfloat16", torch.bfloat16), ("float16", torch.float16)]:
            llm = _build(model_dir, kv_cache_dtype=cache_dtype)
            worker = _worker(llm)
            assert _backend_name(llm) == backend
            assert next(worker.model.parameters()).dtype == torch.float32
            assert worker.kv_cache_dtype == torch_dtype
            assert {c.dtype for c in worker.kv_caches} == {torch_dtype}
            # The same bytes hold twice the blocks, and the scheduler knows it.
            assert worker.num_blocks == 128
            assert llm.llm_engine.engine_core.kv_cache_manager.block_pool.num_blocks == 128
            ids, lps = _greedy(llm)
            assert ids == ref_ids, cache_dtype
            diffs = [abs(a - b) for row, ref_row in zip(lps, ref_lps) for a, b in zip(row, ref_row)]
            assert max(diffs) < LOGPROB_TOL[cache_dtype], (cache_dtype, max(diffs))
            if cache_dtype == "bfloat16":
                assert max(diffs) > 1e-4, "a bfloat16 cache changed nothing: was it float32?"
            del llm, worker


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_caching_hits_with_a_bfloat16_cache(backend, tiny_model_dir, monkeypatch, caplog):
    _use_backend(backend, monkeypatch)
    with torch_threads(1), caplog.at_level(logging.INFO, logger="folio.worker.worker"):
        llm = _build(tiny_model_dir("llama"), kv_cache_dtype="bf16")
        assert {c.dtype for c in _worker(llm).kv_caches} == {torch.bfloat16}
        # The start-up line that reports the cache's size names its dtype.
        assert "KV cache: 128 blocks of 16 = 2048 tokens (bfloat16, 0.8 MiB)" in caplog.text
        prompt = PROMPTS[0] * 2   # well over two blocks
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        first = llm.generate([prompt], params, use_tqdm=False)[0]
        again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    # Every full block but the last, recomputed one came from the cache.
    assert again.num_cached_tokens >= 16 * ((len(again.prompt_token_ids) - 1) // 16) > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
