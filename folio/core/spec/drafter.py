"""The scheduler's drafter for a SpeculativeConfig: proposes a running request's draft tokens
once its latest tokens are known. Host drafters (n-gram, suffix) compute them here; for a
draft model the worker computes them in the step and the runner's output carries them
(`WorkerDrafts`).

`lookahead` is how many KV slots past a step's tokens each request needs: a draft model
writes its k drafts' keys and values there before the next step verifies them."""
from __future__ import annotations

from typing import TYPE_CHECKING

from folio.config import SpeculativeConfig
from folio.core.spec.ngram import NgramProposer
from folio.core.spec.suffix import SuffixProposer

if TYPE_CHECKING:
    from folio.core.request import Request


class HostDrafter:
    """Drafts made here from the request's tokens: nothing comes from the worker."""

    lookahead = 0
    # False while the adaptive draft length rests at k = 0 (the scheduler sets it each step):
    # work that only serves future drafts may be skipped then.
    active = True

    def receive(self, drafts: dict[str, list[int]]) -> None:
        """Host drafters make their own drafts."""

    def begin_proposals(self) -> None:
        """A step's proposals are about to be made (once per step that makes them)."""


class NgramDrafter(HostDrafter):
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, request: Request) -> list[int]:
        return self.proposer.propose(request.request_id, request.all_token_ids, self.k)

    def drop(self, request: Request) -> None:
        self.proposer.drop(request.request_id)


class SuffixDrafter(HostDrafter):
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.proposer = SuffixProposer(config.suffix_decoding_max_tree_depth,
                                       config.suffix_decoding_max_cached_requests,
                                       config.suffix_decoding_max_spec_factor,
                                       config.suffix_decoding_min_token_prob)

    # Finished requests' outputs moved into the shared index per step of proposals: their
    # indexing (~1 ms per 64-token output) spread over steps, not all in one.
    INDEXED_PER_STEP = 1

    def begin_proposals(self) -> None:
        self.proposer.index_pending(self.INDEXED_PER_STEP)

    def propose(self, request: Request) -> list[int]:
        return self.proposer.propose(request.request_id, request.all_token_ids, self.k)

    def drop(self, request: Request) -> None:
        # a finished request's outputs teach the shared index; an aborted one's too (the
        # tokens it made are the model's all the same). Not while resting: indexing takes
        # max_depth dict updates per token (64 outputs of 64 tokens finishing at once: 106
        # ms on the dev CPU, in the step that finishes them), spent on drafts no one makes.
        self.proposer.finish(request.request_id,
                             request.output_token_ids if self.active else [])


class WorkerDrafts:
    """Drafts made by the worker (a draft model) in the step just finished: `receive` takes
    the runner output's drafts, `propose` hands each request its own."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.lookahead = self.k
        self._drafts: dict[str, list[int]] = {}

    def receive(self, drafts: dict[str, list[int]]) -> None:
        self._drafts = drafts

    def begin_proposals(self) -> None:
        """The worker made this step's drafts already."""

    def propose(self, request: Request) -> list[int]:
        return list(self._drafts.get(request.request_id, ()))[:self.k]

    def drop(self, request: Request) -> None:
        self._drafts.pop(request.request_id, None)


Drafter = NgramDrafter | SuffixDrafter | WorkerDrafts


def make_drafter(config: SpeculativeConfig | None) -> Drafter | None:
    if config is None:
        return None
    if config.drafts_on_worker:
        return WorkerDrafts(config)
    if config.method == "ngram":
        return NgramDrafter(config)
    if config.method == "suffix":
        return SuffixDrafter(config)
    raise ValueError(f"speculative_config.method {config.method!r} has no drafter")
