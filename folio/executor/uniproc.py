"""Runs one worker in the engine-core process. Multi-process (tensor parallel) executors
implement the same three members."""
from __future__ import annotations

from typing import Any

from folio.config import EngineConfig
from folio.core.outputs import ModelRunnerOutput
from folio.core.scheduler import SchedulerOutput
from folio.model.loader import ModelSource
from folio.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config: Any) -> None:
        self.worker = Worker(config, source, hf_config)

    @property
    def num_blocks(self) -> int:
        return self.worker.num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
