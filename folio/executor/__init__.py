"""Executors run the workers: `make_executor` picks one by
ParallelConfig.distributed_executor_backend."""
from __future__ import annotations

from typing import Any

from folio.config import EngineConfig
from folio.executor.base import Executor
from folio.model.discovery import ModelSource


def make_executor(config: EngineConfig, source: ModelSource, hf_config: Any) -> Executor:
    if config.parallel.distributed_executor_backend == "ray":
        from folio.executor.ray_executor import RayExecutor
        return RayExecutor(config, source, hf_config)
    if config.parallel.distributed_executor_backend == "mp":
        from folio.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor(config, source, hf_config)
    from folio.executor.uniproc import UniProcExecutor
    return UniProcExecutor(config, source, hf_config)


def resolve_device_type(device: str) -> str:
    """The device type ("cuda" or "cpu") workers for ModelConfig.device ("auto", "cpu",
    "cuda") run on, known before they start (the engine sizes defaults by it). ValueError for
    "cuda" without a CUDA device."""
    from folio.worker.worker import resolve_device
    return resolve_device(device).type
