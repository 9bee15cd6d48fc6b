"""`folio bench latency --plot`: every timed iteration, and where the median batch's time goes.

Left: the latency of each timed iteration (full generation, and the max_tokens=1 prefill runs),
medians dashed, so drift or an outlier iteration (a compile, a neighbour's burst) is seen rather
than averaged in. Right: the median latency split into prefill and decode (the report's
arithmetic: decode = median latency - median prefill), for folio and the peer when there is one.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from folio.bench import plot_support


def workload_line(report: dict[str, Any]) -> str:
    return (f"{report.get('dataset', 'random')} prompts, batch {report.get('batch_size')}, "
            f"input {report.get('input_len')}, output {report.get('output_len')} tokens, "
            f"{report.get('num_iters')} timed iterations "
            f"({report.get('device')}, {report.get('dtype')})")


def _split(source: dict[str, Any]) -> tuple[float, float] | None:
    """(median prefill ms, median decode ms) of a report or peer, None when it has no data."""
    latency = source.get("median_latency_s")
    prefill = source.get("median_prefill_latency_s")
    if latency is None or prefill is None:
        return None
    # Prefill noise can exceed a short decode: clamp rather than draw a negative bar.
    return 1e3 * prefill, max(0.0, 1e3 * (latency - prefill))


def plot_latency(report: dict[str, Any], path: str) -> str:
    """One PNG at `path` from a `folio bench latency` report."""
    fig, axes = plot_support.subplots(1, 2, plot_support.figure_title(
        "latency", report.get("model"), workload_line(report)))
    iters_ax, split_ax = axes[0]

    for key, label, color in (("latencies", "full generation", "tab:blue"),
                              ("prefill_latencies", "prefill (max_tokens=1)", "tab:orange")):
        values = 1e3 * np.asarray(report.get(key) or [], dtype=np.float64)
        if values.size == 0:
            continue
        index = np.arange(1, values.size + 1)
        iters_ax.plot(index, values, marker="o", color=color, label=label)
        median = float(np.median(values))
        iters_ax.axhline(median, color=color, linestyle="--", linewidth=1,
                         label=f"median {median:.1f} ms")
    from matplotlib.ticker import MaxNLocator
    iters_ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # iterations are counts
    iters_ax.set_title("latency of each timed iteration")
    iters_ax.set_xlabel("iteration")
    iters_ax.set_ylabel("ms")
    iters_ax.set_ylim(bottom=0)
    iters_ax.grid(alpha=0.3)
    iters_ax.legend(fontsize=8)

    bars = [("folio", report)]
    peer = report.get("peer")
    if peer and peer.get("error") is None:
        bars.append((f"peer {peer.get('engine', '')}".strip(), peer))
    labels, prefills, decodes = [], [], []
    for label, source in bars:
        split = _split(source)
        if split is not None:
            labels.append(label)
            prefills.append(split[0])
            decodes.append(split[1])
    positions = np.arange(len(labels))
    split_ax.barh(positions, prefills, height=0.5, color="tab:orange", label="prefill (median)")
    split_ax.barh(positions, decodes, height=0.5, left=prefills, color="tab:blue",
                  label="decode")
    for y, (label, source) in enumerate((b for b in bars if _split(b[1]) is not None)):
        per_token = source.get("median_decode_ms_per_token")
        note = f" ({per_token:.2f} ms/token)" if per_token else ""
        split_ax.text(prefills[y] + decodes[y], y,
                      f"  {prefills[y]:.1f} + {decodes[y]:.1f} ms{note}", va="center",
                      fontsize=8)
    split_ax.set_yticks(positions, labels)
    split_ax.set_xlabel("ms (median latency of one batch)")
    split_ax.set_title("prefill / decode split")
    # Room on the right for the labels written past the bars' ends.
    totals = [p + d for p, d in zip(prefills, decodes)]
    split_ax.set_xlim(0, 1.45 * max(totals) if totals and max(totals) > 0 else 1)
    split_ax.grid(axis="x", alpha=0.3)
    split_ax.legend(fontsize=8, loc="lower right")
    return plot_support.save(fig, path)
