"""Pipeline parallelism (`--pipeline-parallel-size N`): the decoder's layers split into N
stages, each run by its own workers (a tensor-parallel group of them).

Stage s holds layers [start, end): the first stage also the embedding, the last the final
norm and the output matrix (and the embedding too when the two are tied). Every stage gets
every step message and builds the same flat batch (positions, slots, attention metadata);
the first embeds the step's tokens, each stage runs its layers and sends the residual stream
(hidden states and residual, [2, tokens, hidden]) to the next with torch.distributed's
point-to-point send; the last computes the logits and samples. Stages run one after another
for a step, so the engine keeps up to N steps in flight (each of other requests) and the
stages work on different steps at once.

Ranks: TP x PP processes; global rank = stage * TP + tp_rank. Stage s's tp_rank r sends to
stage s + 1's tp_rank r (every tensor-parallel rank holds the whole residual stream).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def partition_layers(num_layers: int, size: int, partition: str | None = None) -> list[range]:
    """Each stage's layers: `partition` ("8,8,7,7", vLLM's VLLM_PP_LAYER_PARTITION form) or an
    even split whose remainder goes to the earlier stages (the last stage also carries the
    output matrix). ValueError for a partition that does not fit."""
    if size < 1:
        raise ValueError(f"pipeline_parallel_size must be positive, got {size}")
    if partition is not None:
        try:
            counts = [int(part) for part in partition.split(",")]
        except ValueError:
            raise ValueError(f"pp_layer_partition: {partition!r} is not comma-separated "
                             "layer counts") from None
        if len(counts) != size:
            raise ValueError(f"pp_layer_partition: {len(counts)} stages given, "
                             f"pipeline_parallel_size is {size}")
        if any(count < 1 for count in counts) or sum(counts) != num_layers:
            raise ValueError(f"pp_layer_partition: {partition!r} must give each stage at "
                             f"least one layer and {num_layers} layers in all")
    else:
        if num_layers < size:
            raise ValueError(f"pipeline_parallel_size={size} exceeds the model's "
                             f"{num_layers} layers")
        base, extra = divmod(num_layers, size)
        counts = [base + (1 if stage < extra else 0) for stage in range(size)]
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


@dataclass
class PPStage:
    """This worker's pipeline stage; size 1 = the whole model (no pipeline)."""
    stage: int = 0
    size: int = 1
    layers: range | None = None     # None: every layer
    prev_rank: int | None = None    # the global rank the stream comes from
    next_rank: int | None = None    # the global rank it goes to
    # Off for the workers' own runs at start-up (profiling, warm-up): each stage runs its
    # layers alone on a zero stream, sending nothing.
    communicate: bool = True

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def owns(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """The residual stream to the next stage (it waits for this, in step order)."""
        if not self.communicate:
            return
        import torch.distributed as dist
        dist.send(torch.stack((hidden, residual)).contiguous(), dst=self.next_rank)

    def receive(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream of this step from the previous stage."""
        stream = torch.zeros((2, num_tokens, hidden_size), dtype=dtype, device=device)
        if self.communicate:
            import torch.distributed as dist
            dist.recv(stream, src=self.prev_rank)
        return stream[0], stream[1]


WHOLE = PPStage()


def stage_of(rank: int, tp_size: int, pp_size: int, num_layers: int,
             partition: str | None = None) -> PPStage:
    """Global rank `rank`'s stage (rank = stage * tp_size + tp_rank)."""
    if pp_size == 1:
        return WHOLE
    stage, tp_rank = divmod(rank, tp_size)
    layers = partition_layers(num_layers, pp_size, partition)[stage]
    return PPStage(stage, pp_size, layers,
                   prev_rank=None if stage == 0 else (stage - 1) * tp_size + tp_rank,
                   next_rank=None if stage == pp_size - 1 else (stage + 1) * tp_size + tp_rank)
