"""The sweep's table: one row per swept value, from `folio bench serve` reports; printed, and
written as CSV (the JSON carries the same rows).

The columns are the serving report's own keys (serve.compute_metrics), so a row can be checked
against the full report kept beside it in the JSON.
"""
from __future__ import annotations

import csv
import math
from typing import Any, Sequence

# Swept variable -> (its flag, the table's column title).
SWEPT = {
    "request_rate": ("--request-rates", "rate req/s"),
    "max_concurrency": ("--max-concurrency", "concurrency"),
}
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
STATS = ("mean", "p50", "p99")
# Every percentile a row needs from the report (--percentiles is widened to include them).
ROW_PERCENTILES = (50.0, 99.0)
# Row keys beyond the latencies, in table order; the CSV's extra columns after them.
_HEAD = ("completed", "failed", "request_throughput", "output_throughput")
_TAIL = ("total_token_throughput", "duration", "max_concurrency_seen")


def value_text(value: float | int | None) -> str:
    """A swept value as written in the table, CSV and JSON ('inf' rather than JSON's invalid
    Infinity; '-' for no cap)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:g}"
    return str(value)


def row_of(swept: str, value: float | int, report: dict[str, Any]) -> dict[str, Any]:
    """One table row: the swept value, then the report's throughput and latency keys (ms)."""
    row: dict[str, Any] = {swept: value_text(value)}
    for key in _HEAD:
        row[key] = report[key]
    for metric, _ in LATENCIES:
        for stat in STATS:
            row[f"{stat}_{metric}_ms"] = report[f"{stat}_{metric}_ms"]
    for key in _TAIL:
        row[key] = report.get(key)
    return row


def columns(swept: str) -> list[str]:
    return [swept, *_HEAD, *(f"{s}_{m}_ms" for m, _ in LATENCIES for s in STATS), *_TAIL]


def format_table(swept: str, rows: Sequence[dict[str, Any]]) -> str:
    """The rows as aligned text: throughput, then mean/p50/p99 of each latency in ms."""
    title = SWEPT[swept][1]
    header = [title, "ok", "failed", "req/s", "out tok/s"] + [
        f"{stat} {short}" for _, short in LATENCIES for stat in STATS]
    keys = [swept, "completed", "failed", "request_throughput", "output_throughput"] + [
        f"{stat}_{metric}_ms" for metric, _ in LATENCIES for stat in STATS]

    def cell(value: Any) -> str:
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    table = [header] + [[cell(row[key]) for key in keys] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = ["  ".join(text.rjust(width) for text, width in zip(line, widths))
             for line in table]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines) + "\n(latencies in ms)"


def write_csv(path: str, swept: str, rows: Sequence[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns(swept))
        writer.writeheader()
        writer.writerows(rows)
