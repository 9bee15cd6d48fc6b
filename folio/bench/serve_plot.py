"""`folio bench serve --plot`: the distributions behind the serving report's means.

Four empirical CDFs (TTFT, TPOT, ITL, E2E latency) over the successful requests, with p50/p90/p99
marked: a mean hides the tail that a serving user feels, and a CDF shows it without choosing
histogram bins (a run can have five requests or fifty thousand). With `--launch`/`--peer` every
HTTP engine is drawn on the same axes, one colour each.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from folio.bench import plot_support

MARKED_PERCENTILES = (50, 90, 99)
_PANELS = (("ttft", "TTFT (time to first token)"),
           ("tpot", "TPOT (time per output token, excl. 1st)"),
           ("itl", "ITL (inter-token latency)"),
           ("e2el", "E2E latency"))


def request_series(report: dict[str, Any]) -> dict[str, list[float]]:
    """Per-request values in ms from a `folio bench serve` report's lists, successful requests
    only (a failed one has no meaningful times). TPOT as the report defines it."""
    ok = [not error for error in report.get("errors", [])]
    rows = [(ttft, itl, e2el, out) for ttft, itl, e2el, out, good in zip(
        report.get("ttfts", []), report.get("itls", []), report.get("e2els", []),
        report.get("output_lens", []), ok) if good]
    return {
        "ttft": [1e3 * ttft for ttft, _, _, _ in rows],
        "tpot": [1e3 * (e2el - ttft) / (out - 1) for ttft, _, e2el, out in rows if out > 1],
        "itl": [1e3 * gap for _, itl, _, _ in rows for gap in itl],
        "e2el": [1e3 * e2el for _, _, e2el, _ in rows],
    }


def workload_line(report: dict[str, Any]) -> str:
    """The workload in one line: dataset, requests, mean lengths, arrivals, concurrency."""
    good = [not e for e in report.get("errors", [])]
    ins = [n for n, g in zip(report.get("input_lens", []), good) if g]
    outs = [n for n, g in zip(report.get("output_lens", []), good) if g]
    lengths = (f" (mean {np.mean(ins):.0f} in / {np.mean(outs):.0f} out tokens)"
               if ins and outs else "")
    rate = report.get("request_rate", "inf")
    concurrency = report.get("max_concurrency") or "unlimited"
    return (f"{report.get('dataset', '?')} dataset, {report.get('num_prompts', '?')} requests"
            f"{lengths}, request rate {rate}/s, max concurrency {concurrency}, "
            f"{report.get('endpoint', '')}")


def _cdf(ax: Any, values: Sequence[float], label: str, color: str, row: int) -> None:
    """One engine's empirical CDF on `ax`, its p50/p90/p99 as dotted lines labelled at the
    top (`row` staggers the labels of several engines)."""
    data = np.sort(np.asarray(values, dtype=np.float64))
    if data.size == 0:
        ax.text(0.5, 0.5 - 0.08 * row, f"{label}: no data", transform=ax.transAxes,
                ha="center", color=color)
        return
    ax.step(data, np.arange(1, data.size + 1) / data.size, where="post", color=color,
            label=f"{label} (n={data.size})")
    for p in MARKED_PERCENTILES:
        x = float(np.percentile(data, p))
        ax.axvline(x, color=color, linestyle=":", linewidth=1)
        ax.annotate(f"p{p} {x:.1f}", xy=(x, 1.0), xycoords=("data", "axes fraction"),
                    xytext=(2, -10 - 11 * (row * len(MARKED_PERCENTILES)
                                           + MARKED_PERCENTILES.index(p))),
                    textcoords="offset points", fontsize=7, color=color)


def plot_serve(runs: Sequence[tuple[str, dict[str, Any]]], path: str) -> str:
    """One PNG at `path`: the four CDFs for each (label, `folio bench serve` report)."""
    if not runs:
        raise ValueError("nothing to plot: no serving report")
    first = runs[0][1]
    fig, axes = plot_support.subplots(2, 2, plot_support.figure_title(
        "serve", first.get("model_id"), workload_line(first), first.get("date")))
    plt = plot_support.pyplot()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    series = [(label, request_series(report)) for label, report in runs]
    for ax, (metric, title) in zip(axes.flat, _PANELS):
        for row, (label, values) in enumerate(series):
            _cdf(ax, values[metric], label, colors[row % len(colors)], row)
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:      # none when no engine has data here
            ax.legend(loc="lower right", fontsize=8)
        # Tails of several orders of magnitude (a queued burst): a log axis keeps the bulk
        # readable. Only when every value is positive, as a log axis needs.
        lows = [min(v[metric]) for _, v in series if v[metric]]
        highs = [max(v[metric]) for _, v in series if v[metric]]
        if lows and min(lows) > 0 and math.log10(max(highs) / min(lows)) > 2:
            ax.set_xscale("log")
    return plot_support.save(fig, path)
