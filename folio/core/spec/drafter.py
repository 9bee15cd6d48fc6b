"""The scheduler's drafter for a SpeculativeConfig: proposes a running request's draft tokens
once its latest tokens are known."""
from __future__ import annotations

from typing import TYPE_CHECKING

from folio.config import SpeculativeConfig
from folio.core.spec.ngram import NgramProposer

if TYPE_CHECKING:
    from folio.core.request import Request


class NgramDrafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, request: Request) -> list[int]:
        return self.proposer.propose(request.request_id, request.all_token_ids, self.k)

    def drop(self, request_id: str) -> None:
        self.proposer.drop(request_id)


def make_drafter(config: SpeculativeConfig | None) -> NgramDrafter | None:
    if config is None:
        return None
    if config.method == "ngram":
        return NgramDrafter(config)
    raise ValueError(f"speculative_config.method {config.method!r} has no drafter")
