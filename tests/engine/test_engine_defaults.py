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
    llm = LLM(max_model_len=128, num_gpu_blocks_override=32, dtype="float32")
    # Start-up objects were moved out of the collector's generations.
    assert gc.get_freeze_count() > 10_000
    assert llm.llm_engine.engine_core.scheduler.max_num_seqs == DEFAULT_MAX_NUM_SEQS_CPU
    runner = llm.llm_engine.engine_core.executor.worker.runner
    runner.warm_up_sampling(4)  # on CUDA the worker runs it at start-up; it must not disturb
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    gc.unfreeze()
