"""Speculative decoding's counts over a benchmark's timed part (vLLM's names), for the
latency and throughput benches."""
from __future__ import annotations

from typing import Any


def spec_counts(engine: Any) -> tuple[int, int, int] | None:
    """(verify steps, draft tokens, accepted tokens) so far, or None without speculation."""
    core = engine.engine_core
    if getattr(core.config, "speculative", None) is None:
        return None
    stats = core.scheduler.stats()
    return stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens


def spec_report(before: tuple[int, int, int] | None,
                after: tuple[int, int, int] | None) -> dict[str, Any] | None:
    """The counts between two snapshots; the mean acceptance length counts the token sampled
    after the accepted drafts (1.0 where nothing was drafted: each step still gave a token)."""
    if before is None or after is None:
        return None
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before))
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
            "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0}


def format_spec_report(spec: dict[str, Any]) -> str:
    return (f"speculative decoding: mean acceptance length {spec['mean_acceptance_length']:.2f} "
            f"({spec['num_accepted_tokens']} of {spec['num_draft_tokens']} draft tokens accepted "
            f"over {spec['num_drafts']} verify steps)")
