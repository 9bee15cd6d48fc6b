"""The periodic stats line the server logs while it is busy (vLLM's LoggingStatLogger shape):
prompt and generation throughput over the interval, running and waiting requests, KV cache use,
the prefix-cache hit rate, and with speculative decoding vLLM's SpecDecoding metrics (mean
acceptance length, accepted and drafted throughput and counts, per-position acceptance rate,
draft acceptance rate)."""
from __future__ import annotations

import logging
import time

from folio.core.engine_core_outputs import SchedulerStats

logger = logging.getLogger("folio.stats")


class StatsLogger:
    def __init__(self, now: float | None = None) -> None:
        self._last_time = time.monotonic() if now is None else now
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last_queries = 0
        self._last_hits = 0
        self._last_drafts = 0
        self._last_accepted = 0
        self._last_draft_tokens = 0
        self._last_per_pos: list[int] = []

    def record(self, prompt_tokens: int, generation_tokens: int) -> None:
        self._prompt_tokens += prompt_tokens
        self._generation_tokens += generation_tokens

    def line(self, now: float, stats: SchedulerStats) -> str | None:
        """The line for the interval ending now, or None when the engine was idle through it
        (nothing computed, nothing running or waiting). Starts the next interval."""
        elapsed = max(now - self._last_time, 1e-9)
        busy = (self._prompt_tokens or self._generation_tokens or stats.num_running
                or stats.num_waiting)
        queries = stats.prefix_cache_queries - self._last_queries
        hits = stats.prefix_cache_hits - self._last_hits
        text = None
        if busy:
            hit_rate = 100.0 * hits / queries if queries > 0 else 0.0
            text = (f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
                    f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} "
                    f"tokens/s, Running: {stats.num_running} reqs, Waiting: "
                    f"{stats.num_waiting} reqs, KV cache usage: "
                    f"{100.0 * stats.kv_cache_usage:.1f}%, Prefix cache hit rate: "
                    f"{hit_rate:.1f}%")
            drafts = stats.spec_num_drafts - self._last_drafts
            if drafts > 0:
                accepted = stats.spec_num_accepted_tokens - self._last_accepted
                draft_tokens = stats.spec_num_draft_tokens - self._last_draft_tokens
                last = self._last_per_pos + [0] * len(stats.spec_accepted_per_pos)
                per_pos = ", ".join(f"{(n - last[i]) / drafts:.3f}"
                                    for i, n in enumerate(stats.spec_accepted_per_pos))
                text += (f", SpecDecoding metrics: Mean acceptance length: "
                         f"{1.0 + accepted / drafts:.2f}, Accepted throughput: "
                         f"{accepted / elapsed:.2f} tokens/s, Drafted throughput: "
                         f"{draft_tokens / elapsed:.2f} tokens/s, Accepted: {accepted} tokens, "
                         f"Drafted: {draft_tokens} tokens, Per-position acceptance rate: "
                         f"{per_pos or '-'}, Draft acceptance rate: "
                         f"{100.0 * accepted / max(draft_tokens, 1):.1f}%")
        self._last_time = now
        self._prompt_tokens = self._generation_tokens = 0
        self._last_queries, self._last_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self._last_drafts = stats.spec_num_drafts
        self._last_accepted = stats.spec_num_accepted_tokens
        self._last_draft_tokens = stats.spec_num_draft_tokens
        self._last_per_pos = list(stats.spec_accepted_per_pos)
        return text

    def maybe_log(self, now: float, stats: SchedulerStats) -> None:
        text = self.line(now, stats)
        if text is not None:
            logger.info("%s", text)
