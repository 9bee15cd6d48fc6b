"""What the engine core needs of an executor, whichever runs the workers (in process, or in
their own processes)."""
from __future__ import annotations

from typing import Protocol

from folio.core.kv_cache_layout import KVCacheLayout
from folio.core.step_messages import GrammarBitmaskFn, ModelRunnerOutput, SchedulerOutput


class PendingOutput(Protocol):
    def get(self) -> ModelRunnerOutput:
        """Wait for the step's output (rank 0's)."""
        ...


class Executor(Protocol):
    device_type: str      # "cuda" or "cpu"
    num_blocks: int       # KV cache blocks per worker
    kv_cache_layout: KVCacheLayout   # how the layers share those blocks (KV cache groups)
    num_host_blocks: int  # blocks of the host KV tier's pool (0: none)
    host_block_bytes: int  # one block's K/V bytes on a worker (what a tier copy moves)
    disk_kv_hashes: list[bytes]   # the blocks the disk KV tier holds at start-up
    kv_transfer_port: int  # where rank 0 serves prompts' KV (a P2pConnector producer; else 0)
    vocab_size: int       # the width of the model's logits
    timings: dict[str, float]  # seconds of each worker start-up stage

    def execute_model(self, step: SchedulerOutput,
                      grammar_bitmask: GrammarBitmaskFn | None = None) -> ModelRunnerOutput: ...

    def execute_model_async(self, step: SchedulerOutput,
                            grammar_bitmask: GrammarBitmaskFn | None = None) -> PendingOutput: ...

    def shutdown(self) -> None: ...
