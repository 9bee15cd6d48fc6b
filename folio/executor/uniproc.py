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
from folio.worker.sleep import trim_host_heap
from folio.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config: Any) -> None:
        self.worker = Worker(config, source, hf_config)
        self.debug_step_messages = config.parallel.debug_step_messages
        # Sleep level 2 drops the whole worker; waking builds it again from these.
        self._worker_args = (config, source, hf_config)
        self.sleep_level = 0

    def sleep(self, level: int) -> dict[str, int]:
        """Sleep mode. Level 1: the worker frees its KV cache and CUDA graphs and moves the
        weights to host memory. Level 2: the worker is dropped whole (weights, KV cache,
        graphs); waking reads the checkpoint again, into as many KV blocks as before."""
        if level == 1:
            freed = self.worker.sleep()
        else:
            worker = self.worker
            from folio.worker.sleep import module_bytes, tensors_bytes
            freed = {"kv_cache": tensors_bytes(worker.kv_caches),
                     "weights": module_bytes(worker.model)}
            self._num_blocks, self._device_type = worker.num_blocks, worker.device.type
            self._layout, self._vocab_size = worker.kv_cache_layout, worker.arch_spec.vocab_size
            self.worker = None
            del worker
            _release_memory(self._device_type)
        self.sleep_level = level
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.sleep_level == 2:
            import dataclasses
            config, source, hf_config = self._worker_args
            cache = dataclasses.replace(config.cache, num_gpu_blocks_override=self._num_blocks,
                                        kv_cache_memory_bytes=None)
            self.worker = Worker(dataclasses.replace(config, cache=cache), source, hf_config)
        elif self.sleep_level == 1:
            self.worker.wake_up(tags)
            if self.worker.asleep:
                return          # woken in part (tags): still asleep
        self.sleep_level = 0

    @property
    def device_type(self) -> str:
        """The device type the model runs on: "cuda" or "cpu"."""
        return self._device_type if self.worker is None else self.worker.device.type

    @property
    def num_blocks(self) -> int:
        return self._num_blocks if self.worker is None else self.worker.num_blocks

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host KV tier's pool (0: no tier)."""
        worker = self.worker
        return 0 if worker is None or worker.host_kv is None else worker.host_kv.num_slots

    @property
    def disk_kv_hashes(self) -> list[bytes]:
        """The blocks the disk KV tier holds at start-up, oldest first."""
        worker = self.worker
        return [] if worker is None or worker.disk_kv is None else worker.disk_kv.existing()

    @property
    def kv_transfer_port(self) -> int:
        worker = self.worker
        return 0 if worker is None or worker.kv_p2p is None else worker.kv_p2p.port

    @property
    def host_block_bytes(self) -> int:
        return 0 if self.worker is None else self.worker.host_block_bytes

    @property
    def kv_cache_layout(self) -> KVCacheLayout:
        return self._layout if self.worker is None else self.worker.kv_cache_layout

    @property
    def timings(self) -> dict[str, float]:
        """Seconds of each worker start-up stage: load_s, profile_s, kv_alloc_s, warm_up_s,
        graph_capture_s."""
        return dict(self.worker.timings)

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits (may exceed the tokenizer's vocabulary)."""
        return self._vocab_size if self.worker is None else self.worker.arch_spec.vocab_size

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


def _release_memory(device_type: str) -> None:
    """Give a dropped worker's memory back: its cycles collected, CUDA's cached blocks freed,
    on the CPU the heap's freed pages handed back (glibc keeps them otherwise, and the process
    would still hold the weights it dropped)."""
    import gc
    gc.unfreeze()   # the engine froze its start-up objects (engine_core.py)
    gc.collect()
    gc.freeze()
    if device_type == "cuda":
        import torch
        torch.cuda.empty_cache()
    else:
        trim_host_heap()
