"""Runs one worker in the engine-core process. Multi-process (tensor parallel) executors
implement the same members.

The engine talks to the executor only (never to its worker): what it needs to know about the
device and the step handles is here.
"""
from __future__ import annotations

from typing import Any

from folio.config import EngineConfig
from folio.core.outputs import ModelRunnerOutput
from folio.core.scheduler import SchedulerOutput
from folio.model.discovery import ModelSource
from folio.worker.model_runner import GrammarBitmaskFn, PendingRunnerOutput
from folio.worker.worker import Worker, resolve_device

__all__ = ["GrammarBitmaskFn", "PendingRunnerOutput", "UniProcExecutor"]


class UniProcExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config: Any) -> None:
        self.worker = Worker(config, source, hf_config)

    @staticmethod
    def resolve_device_type(device: str) -> str:
        """The device type ("cuda" or "cpu") workers for ModelConfig.device ("auto", "cpu",
        "cuda") run on, known before they start (the engine sizes defaults by it). ValueError
        for "cuda" without a CUDA device."""
        return resolve_device(device).type

    @property
    def device_type(self) -> str:
        """The device type the model runs on: "cuda" or "cpu"."""
        return self.worker.device.type

    @property
    def num_blocks(self) -> int:
        return self.worker.num_blocks

    @property
    def timings(self) -> dict[str, float]:
        """Seconds of each worker start-up stage: load_s, profile_s, kv_alloc_s, warm_up_s,
        graph_capture_s."""
        return dict(self.worker.timings)

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits (may exceed the tokenizer's vocabulary)."""
        return self.worker.arch_spec.vocab_size

    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar_bitmask: GrammarBitmaskFn | None = None) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output, grammar_bitmask)

    def execute_model_async(self, scheduler_output: SchedulerOutput,
                            grammar_bitmask: GrammarBitmaskFn | None = None) -> PendingRunnerOutput:
        """Queue the step; its output's get() waits for the sampled ids."""
        return self.worker.execute_model_async(scheduler_output, grammar_bitmask)
