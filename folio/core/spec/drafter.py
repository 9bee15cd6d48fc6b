"""The scheduler's drafter for a SpeculativeConfig: proposes a running request's draft tokens
once its latest tokens are known."""
from __future__ import annotations

from typing import TYPE_CHECKING

from folio.config import SpeculativeConfig
from folio.core.spec.ngram import NgramProposer
from folio.core.spec.suffix import SuffixProposer

if TYPE_CHECKING:
    from folio.core.request import Request


class NgramDrafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, request: Request) -> list[int]:
        return self.proposer.propose(request.request_id, request.all_token_ids, self.k)

    def drop(self, request: Request) -> None:
        self.proposer.drop(request.request_id)


class SuffixDrafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.proposer = SuffixProposer(config.suffix_decoding_max_tree_depth,
                                       config.suffix_decoding_max_cached_requests,
                                       config.suffix_decoding_max_spec_factor,
                                       config.suffix_decoding_min_token_prob)

    def propose(self, request: Request) -> list[int]:
        return self.proposer.propose(request.request_id, request.all_token_ids, self.k)

    def drop(self, request: Request) -> None:
        # a finished request's outputs teach the shared index; an aborted one's too (the
        # tokens it made are the model's all the same)
        self.proposer.finish(request.request_id, request.output_token_ids)


def make_drafter(config: SpeculativeConfig | None) -> NgramDrafter | SuffixDrafter | None:
    if config is None:
        return None
    if config.method == "ngram":
        return NgramDrafter(config)
    if config.method == "suffix":
        return SuffixDrafter(config)
    raise ValueError(f"speculative_config.method {config.method!r} has no drafter")
