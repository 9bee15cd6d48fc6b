"""The web console's dashboard numbers: read from what the server already keeps, never
recomputed from requests.

- The scheduler's stats (`AsyncLLM.stats`, the `SchedulerStats` of the latest step message):
  running and waiting requests, KV cache use, the prefix cache's cumulative queries and hits,
  preemptions.
- The Prometheus registry of `EngineMetrics` (absent with --disable-log-stats): the token and
  finished-request counters and the TTFT / inter-token latency histograms.

A sampler task reads both every `interval_s` into a bounded ring (`history_s` of samples),
from which the endpoint derives tokens/s over time and latency percentiles over a recent
window (the difference of two cumulative histograms is the window's histogram).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from folio.metrics.prometheus import PREFIX

logger = logging.getLogger("folio.server")

# The registry's names (vLLM's, under folio:); counters are exposed with "_total".
_PROMPT_TOKENS = PREFIX + "prompt_tokens_total"
_GENERATION_TOKENS = PREFIX + "generation_tokens_total"
_FINISHED = PREFIX + "request_success_total"
_TTFT = PREFIX + "time_to_first_token_seconds"
_ITL = PREFIX + "inter_token_latency_seconds"
QUANTILES = (0.5, 0.9, 0.99)
# The "now" tokens/s figure: the average over about this many seconds.
RATE_WINDOW_S = 5.0


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts (Prometheus' `le` buckets, +Inf last) and their bounds."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    def minus(self, older: Histogram | None) -> Histogram:
        """The observations made since `older` (a reset in between: all of them)."""
        if older is None or older.bounds != self.bounds or older.counts[-1] > self.counts[-1]:
            return self
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.counts, older.counts)))

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear within the bucket holding rank q·n; the
        +Inf bucket answers its lower bound. None without observations."""
        total = self.counts[-1] if self.counts else 0
        if total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts):
            if count >= rank:
                if math.isinf(bound):
                    return lower
                if count == below:
                    return bound
                return lower + (bound - lower) * (rank - below) / (count - below)
            lower, below = bound, count
        return lower


@dataclass(frozen=True)
class Sample:
    """One reading. Cumulative values stay cumulative; the endpoint takes differences."""

    time: float  # time.time(): the chart's x axis
    mono: float  # time.monotonic(): rates
    running: int
    waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    # None when metrics are off (--disable-log-stats)
    prompt_tokens: float | None
    generation_tokens: float | None
    finished_requests: float | None
    ttft: Histogram | None
    itl: Histogram | None


def _read_registry(metrics: Any) -> dict[str, Any]:
    """One pass over the registry: the counters (summed over labels) and two histograms."""
    sums: dict[str, float] = {_PROMPT_TOKENS: 0.0, _GENERATION_TOKENS: 0.0, _FINISHED: 0.0}
    buckets: dict[str, list[tuple[float, float]]] = {_TTFT: [], _ITL: []}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
            elif sample.name.endswith("_bucket"):
                family_name = sample.name[:-len("_bucket")]
                if family_name in buckets:
                    buckets[family_name].append((float(sample.labels["le"]), sample.value))
    histograms = {}
    for name, pairs in buckets.items():
        pairs.sort()
        histograms[name] = Histogram(tuple(b for b, _ in pairs), tuple(c for _, c in pairs))
    return {"prompt_tokens": sums[_PROMPT_TOKENS], "generation_tokens": sums[_GENERATION_TOKENS],
            "finished_requests": sums[_FINISHED], "ttft": histograms[_TTFT],
            "itl": histograms[_ITL]}


def _rate(new: float | None, old: float | None, seconds: float) -> float | None:
    if new is None or old is None or seconds <= 0:
        return None
    # A counter below its last value was reset: count from zero.
    return (new - old if new >= old else new) / seconds


def _percentiles(histogram: Histogram | None) -> dict[str, Any] | None:
    if histogram is None:
        return None
    out: dict[str, Any] = {"count": int(histogram.counts[-1]) if histogram.counts else 0}
    for q in QUANTILES:
        value = histogram.quantile(q)
        out[f"p{round(q * 100)}"] = None if value is None else round(value, 6)
    return out


class ConsoleStats:
    """The ring of samples and the dashboard's JSON. Runs on the server's event loop only
    (the engine's stats and the metrics are written there too), so nothing is locked."""

    def __init__(self, engine: Any, metrics: Any | None, *, interval_s: float = 1.0,
                 history_s: float = 600.0, recent_s: float = 60.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.interval_s = interval_s
        self.recent_s = recent_s
        self.samples: deque[Sample] = deque(maxlen=max(2, int(history_s / interval_s) + 1))
        self.started = time.time()

    def read(self) -> Sample:
        stats = getattr(self.engine, "stats", None)
        reading = _read_registry(self.metrics) if self.metrics is not None else {}
        return Sample(
            time=time.time(), mono=time.monotonic(),
            running=getattr(stats, "num_running", 0), waiting=getattr(stats, "num_waiting", 0),
            kv_cache_usage=getattr(stats, "kv_cache_usage", 0.0),
            prefix_cache_queries=getattr(stats, "prefix_cache_queries", 0),
            prefix_cache_hits=getattr(stats, "prefix_cache_hits", 0),
            preemptions=getattr(stats, "num_preemptions", 0),
            prompt_tokens=reading.get("prompt_tokens"),
            generation_tokens=reading.get("generation_tokens"),
            finished_requests=reading.get("finished_requests"),
            ttft=reading.get("ttft"), itl=reading.get("itl"))

    def sample(self) -> None:
        self.samples.append(self.read())

    async def run(self) -> None:
        """Sample forever (cancelled at shutdown). One bad read must not end the history."""
        warned = False
        while True:
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - the dashboard is not worth the server
                if not warned:
                    logger.exception("web console: reading the stats failed")
                    warned = True
            await asyncio.sleep(self.interval_s)

    def _oldest_within(self, now_mono: float, seconds: float) -> Sample | None:
        for sample in self.samples:
            if now_mono - sample.mono <= seconds + self.interval_s / 2:
                return sample
        return None

    def snapshot(self) -> dict[str, Any]:
        """The dashboard's JSON: live values now, the series of the ring, percentiles."""
        now = self.read()
        stats = getattr(self.engine, "stats", None)
        samples = list(self.samples)
        queries, hits = now.prefix_cache_queries, now.prefix_cache_hits
        recent = self._oldest_within(now.mono, self.recent_s)
        recent_queries = queries - recent.prefix_cache_queries if recent else 0
        recent_hits = hits - recent.prefix_cache_hits if recent else 0
        series: dict[str, list] = {"time": [], "generation_tokens_per_s": [],
                                   "prompt_tokens_per_s": [], "running": [], "waiting": []}
        for older, newer in zip(samples, samples[1:]):
            seconds = newer.mono - older.mono
            series["time"].append(round(newer.time, 2))
            for key, attr in (("generation_tokens_per_s", "generation_tokens"),
                              ("prompt_tokens_per_s", "prompt_tokens")):
                rate = _rate(getattr(newer, attr), getattr(older, attr), seconds)
                series[key].append(None if rate is None else round(rate, 2))
            series["running"].append(newer.running)
            series["waiting"].append(newer.waiting)

        rate_from = self._oldest_within(now.mono, RATE_WINDOW_S)

        def rate_now(attr: str) -> float | None:
            if rate_from is None or now.mono - rate_from.mono < self.interval_s / 2:
                return None
            rate = _rate(getattr(now, attr), getattr(rate_from, attr), now.mono - rate_from.mono)
            return None if rate is None else round(rate, 2)

        def latency(attr: str) -> dict[str, Any]:
            current: Histogram | None = getattr(now, attr)
            older = getattr(recent, attr) if recent is not None else None
            return {"recent": _percentiles(current.minus(older) if current else None),
                    "total": _percentiles(current)}

        return {
            "model": getattr(self.metrics, "model_name", None),
            "server_time": round(now.time, 3),
            "uptime_s": round(now.time - self.started, 1),
            "interval_s": self.interval_s,
            "history_s": round((self.samples.maxlen - 1) * self.interval_s, 1),
            "recent_s": self.recent_s,
            "metrics_enabled": self.metrics is not None,
            "requests": {
                "running": now.running, "waiting": now.waiting,
                # streams the API process has open (includes requests not yet scheduled)
                "open": getattr(self.engine, "num_open_requests", None),
                "finished": None if now.finished_requests is None else int(now.finished_requests),
                "preemptions": now.preemptions,
            },
            "kv_cache": {
                "usage": round(now.kv_cache_usage, 4),
                "num_blocks": getattr(stats, "num_blocks", 0),
                "num_free_blocks": getattr(stats, "num_free_blocks", 0),
            },
            "prefix_cache": {
                "queries": queries, "hits": hits,
                "hit_rate": round(hits / queries, 4) if queries > 0 else None,
                "recent_hit_rate": (round(recent_hits / recent_queries, 4)
                                    if recent_queries > 0 else None),
            },
            "tokens": {
                "prompt_total": None if now.prompt_tokens is None else int(now.prompt_tokens),
                "generation_total": (None if now.generation_tokens is None
                                     else int(now.generation_tokens)),
                # over the last few seconds: one interval alone jitters with step timing
                "generation_per_s": rate_now("generation_tokens"),
                "prompt_per_s": rate_now("prompt_tokens"),
            },
            "latency_s": {"ttft": latency("ttft"), "itl": latency("itl")},
            "series": series,
        }
