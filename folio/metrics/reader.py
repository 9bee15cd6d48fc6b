"""The offline API's metrics (`LLM.get_metrics`, in the shape of vLLM's metrics reader): the
samples of an engine's Prometheus registry as plain objects, under the names `/metrics` serves
(counters without the exposition's `_total`). A counter labelled by draft `position` (the
speculative decoding per-position counter) becomes one `Vector` of its values by position."""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

# The label that turns a counter into a Vector (EngineMetrics' per-position counter).
_VECTOR_LABEL = "position"


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int] = field(default_factory=dict)   # upper bound -> cumulative count


def read_metrics(registry: CollectorRegistry) -> list[Metric]:
    """Every series in `registry`, as Counter, Gauge, Vector or Histogram."""
    out: list[Metric] = []
    for family in registry.collect():
        if family.type == "counter":
            out += _counters(family)
        elif family.type == "gauge":
            out += [Gauge(family.name, dict(s.labels), s.value) for s in family.samples]
        elif family.type == "histogram":
            out += _histograms(family)
    return out


def _counters(family) -> list[Metric]:
    samples = [s for s in family.samples if s.name.endswith("_total")]
    if not any(_VECTOR_LABEL in s.labels for s in samples):
        return [Counter(family.name, dict(s.labels), int(s.value)) for s in samples]
    by_series: dict[tuple, dict[int, int]] = {}
    for s in samples:
        rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != _VECTOR_LABEL))
        by_series.setdefault(rest, {})[int(s.labels[_VECTOR_LABEL])] = int(s.value)
    return [Vector(family.name, dict(rest),
                   [by_pos.get(i, 0) for i in range(max(by_pos) + 1)])
            for rest, by_pos in by_series.items()]


def _histograms(family) -> list[Metric]:
    series: dict[tuple, Histogram] = {}
    for s in family.samples:
        rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        h = series.setdefault(rest, Histogram(family.name, dict(rest), 0, 0.0))
        if s.name.endswith("_bucket"):
            h.buckets[s.labels["le"]] = int(s.value)
        elif s.name.endswith("_count"):
            h.count = int(s.value)
        elif s.name.endswith("_sum"):
            h.sum = float(s.value)
    return list(series.values())
