"""Engine defaults that depend on the device, and start-up steps that must not disturb a
running engine."""
from __future__ import annotations

import gc

import pytest

from folio import LLM, SamplingParams
from folio.config import (DEFAULT_MAX_NUM_SEQS_CPU, DEFAULT_MAX_NUM_SEQS_CUDA, EngineConfig,
                          ModelConfig, SchedulerConfig)


@pytest.mark.parametrize("device, expected", [("cpu", DEFAULT_MAX_NUM_SEQS_CPU),
                                              ("cuda", DEFAULT_MAX_NUM_SEQS_CUDA)])
def test_max_num_seqs_default_by_device(device, expected):
    config = EngineConfig(model=ModelConfig(device=device))
    assert config.scheduler.max_num_seqs is None
    config.finalize(4096)
    assert config.scheduler.max_num_seqs == expected
    assert (DEFAULT_MAX_NUM_SEQS_CPU, DEFAULT_MAX_NUM_SEQS_CUDA) == (128, 256)


def test_device_defaults_wait_for_the_engine_core_with_device_auto():
    # Whether "auto" means CUDA needs torch, which the front end (the API process) does not
    # import: the model-dependent defaults are filled, max_num_seqs waits for the engine core.
    config = EngineConfig()
    config.finalize(4096)
    assert (config.model.max_model_len, config.scheduler.max_num_batched_tokens) == (4096, 2048)
    assert config.scheduler.max_num_seqs is None
    config.finalize_device("cuda")
    assert config.scheduler.max_num_seqs == DEFAULT_MAX_NUM_SEQS_CUDA


def test_max_num_seqs_check_runs_once_the_device_is_known():
    def config():
        return EngineConfig(scheduler=SchedulerConfig(enable_chunked_prefill=False,
                                                      max_num_batched_tokens=200))
    on_cpu, on_cuda = config(), config()
    for c in (on_cpu, on_cuda):
        c.finalize(200)
    on_cpu.finalize_device("cpu")  # 200 tokens >= 128 sequences
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs"):
        on_cuda.finalize_device("cuda")  # < 256


def test_explicit_max_num_seqs_is_kept_and_checked():
    config = EngineConfig(model=ModelConfig(device="cuda"), scheduler=SchedulerConfig(max_num_seqs=7))
    config.finalize(4096)
    assert config.scheduler.max_num_seqs == 7
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


def test_cudagraph_mode_is_checked():
    assert ModelConfig(cudagraph_mode="FULL_DECODE_ONLY").cudagraph_mode == "full_decode_only"
    with pytest.raises(ValueError, match="cudagraph_mode"):
        ModelConfig(cudagraph_mode="piecewise")


def test_engine_start_freezes_gc_and_sampling_warm_up_runs_on_cpu():
    gc.unfreeze()
    # In process: the test reaches into the worker (also under pytest --executor-backend mp).
    llm = LLM(max_model_len=128, num_gpu_blocks_override=32, dtype="float32",
              distributed_executor_backend="uni")
    # Start-up objects were moved out of the collector's generations.
    assert gc.get_freeze_count() > 10_000
    assert llm.llm_engine.engine_core.scheduler.max_num_seqs == DEFAULT_MAX_NUM_SEQS_CPU
    assert llm.llm_engine.config.scheduler.max_num_seqs == DEFAULT_MAX_NUM_SEQS_CPU
    assert llm.llm_engine.engine_core.executor.device_type == "cpu"
    runner = llm.llm_engine.engine_core.executor.worker.runner
    runner.warm_up_sampling(4)  # on CUDA the worker runs it at start-up; it must not disturb
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    gc.unfreeze()
