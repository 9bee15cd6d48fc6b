"""Test requests for the sampler: a sampling state with its token history, and a Sampler whose
calls take such rows and build the step's SamplingColumns from them (as the worker's
InputBatch does from its row arrays)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from folio.sampling_params import SamplingParams
from folio.worker import sampler as sampler_module
from folio.worker.sampler import SamplingState
from folio.worker.sampling_columns import SamplingColumns


@dataclass
class Row:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Async scheduling: the latest token is in this row of the previous step's sampled ids.
    pending_row: int | None = None

    @property
    def sampling(self) -> SamplingState:
        return SamplingState(self.params, self.generator, self.eos_token_ids)


def split(rows: list[Row]) -> tuple[list[SamplingState], SamplingColumns]:
    columns = SamplingColumns.from_params(
        [r.params for r in rows], [(r.prompt_token_ids, r.output_token_ids) for r in rows],
        seeded=[r.generator is not None for r in rows],
        pending_row=[r.pending_row for r in rows])
    return [r.sampling for r in rows], columns


class RowSampler:
    """A sampler, called with rows."""

    def __init__(self) -> None:
        self.sampler = sampler_module.Sampler()

    def __call__(self, logits, rows):
        return self.sampler(logits, *split(rows))

    def sample(self, logits, rows, prev_sampled=None):
        return self.sampler.sample(logits, *split(rows), prev_sampled)

    def process_logits(self, logits, rows, prev_sampled=None):
        return self.sampler.process_logits(logits, *split(rows), prev_sampled)


def choose_path(logits, rows):
    return sampler_module.choose_path(logits, split(rows)[1])


def apply_min_p(logits, params: list[SamplingParams]) -> None:
    sampler_module.apply_min_p(logits, np.array([p.min_p for p in params], np.float32))


def apply_top_k_top_p(logits, params: list[SamplingParams]) -> None:
    sampler_module.apply_top_k_top_p(logits, np.array([p.top_k for p in params], np.int32),
                                      np.array([p.top_p for p in params], np.float32))
