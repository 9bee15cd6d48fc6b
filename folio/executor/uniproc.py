"""Runs one worker in the engine-core process. Multi-process (tensor parallel) executors
implement the same members."""
from __future__ import annotations

from typing import Any

from folio.config import EngineConfig
from folio.core.outputs import ModelRunnerOutput
from folio.core.scheduler import SchedulerOutput
from folio.model.loader import ModelSource
from folio.worker.model_runner import GrammarBitmaskFn, PendingRunnerOutput
from folio.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config: Any) -> None:
        self.worker = Worker(config, source, hf_config)

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
