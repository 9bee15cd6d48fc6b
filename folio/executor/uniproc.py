"""Runs one worker in the engine-core process: the step message is handed over as it is (or,
in the debug mode the test suite turns on, through msgpack and back, so every message of a
test run is checked to survive a process boundary).

The engine talks to the executor only (never to its worker): what it needs to know about the
device and the step handles is here, the same members the multiprocess executor has.
"""
from __future__ import annotations

from typing import Any

from folio.config import EngineConfig
from folio.core.kv_cache_layout import KVCacheLayout
from folio.core.step_messages import GrammarBitmaskFn, ModelRunnerOutput, SchedulerOutput
from folio.executor import step_codec
from folio.model.discovery import ModelSource
from folio.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config: Any) -> None:
        self.worker = Worker(config, source, hf_config)
        self.debug_step_messages = config.parallel.debug_step_messages

    @property
    def device_type(self) -> str:
        """The device type the model runs on: "cuda" or "cpu"."""
        return self.worker.device.type

    @property
    def num_blocks(self) -> int:
        return self.worker.num_blocks

    @property
    def kv_cache_layout(self) -> KVCacheLayout:
        return self.worker.kv_cache_layout

    @property
    def timings(self) -> dict[str, float]:
        """Seconds of each worker start-up stage: load_s, profile_s, kv_alloc_s, warm_up_s,
        graph_capture_s."""
        return dict(self.worker.timings)

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits (may exceed the tokenizer's vocabulary)."""
        return self.worker.arch_spec.vocab_size

    def execute_model(self, step: SchedulerOutput,
                      grammar_bitmask: GrammarBitmaskFn | None = None) -> ModelRunnerOutput:
        return self.execute_model_async(step, grammar_bitmask).get()

    def execute_model_async(self, step: SchedulerOutput,
                            grammar_bitmask: GrammarBitmaskFn | None = None):
        """Queue the step; its output's get() waits for the sampled ids."""
        if not self.debug_step_messages:
            return self.worker.execute_model_async(step, grammar_bitmask)
        step = step_codec.round_trip(step, step_codec.decode_step)

        def fill():
            mask = grammar_bitmask()
            return None if mask is None else step_codec.round_trip(mask, step_codec.decode_bitmask)

        return _RoundTripOutput(self.worker.execute_model_async(
            step, fill if grammar_bitmask is not None else None))

    def shutdown(self) -> None:
        """Nothing to stop: the worker lives and dies with this process."""


class _RoundTripOutput:
    def __init__(self, pending) -> None:
        self._pending = pending

    def get(self) -> ModelRunnerOutput:
        return step_codec.round_trip(self._pending.get(), step_codec.decode_output)
