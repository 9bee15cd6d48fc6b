"""`folio bench sweep serve --plot`: throughput and latency against the swept value.

The swept values sit at evenly spaced positions labelled with the values: a request-rate sweep
may end in `inf` (no position on a numeric axis), and concurrencies are usually geometric
(1, 4, 16), which even spacing draws like a log axis. Latency panels show mean (solid), p50
(dashed) and p99 (dotted), the table's columns.
"""
from __future__ import annotations

from typing import Any, Sequence

from folio.bench import plot_support
from folio.bench.sweep_table import LATENCIES, SWEPT

_STYLES = {"mean": "-", "p50": "--", "p99": ":"}


def _latency_panel(ax: Any, positions: Sequence[int], rows: Sequence[dict[str, Any]],
                   metrics: Sequence[tuple[str, str]], title: str) -> None:
    plt = plot_support.pyplot()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (metric, short) in enumerate(metrics):
        for stat, style in _STYLES.items():
            ax.plot(positions, [row[f"{stat}_{metric}_ms"] for row in rows], linestyle=style,
                    marker="o", color=colors[(index + 1) % len(colors)],
                    label=f"{stat} {short}")
    ax.set_title(title)
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_sweep(sweep: dict[str, Any], path: str) -> str:
    """One PNG at `path` from the sweep's result (folio.bench.sweep.run)."""
    swept = sweep["swept"]
    rows = sweep["rows"]
    if not rows:
        raise ValueError("nothing to plot: the sweep has no rows")
    label = SWEPT[swept][1]
    fig, axes = plot_support.subplots(2, 2, plot_support.figure_title(
        f"sweep serve over {SWEPT[swept][0]}", sweep.get("model_id"),
        sweep.get("workload", ""), sweep.get("date")))
    positions = list(range(len(rows)))
    ticks = [str(row[swept]) for row in rows]

    ax = axes[0][0]
    # Wide and pale: with fixed output lengths the two curves are proportional and would
    # otherwise hide each other.
    ax.plot(positions, [row["output_throughput"] for row in rows], marker="o", linewidth=4,
            alpha=0.5, color="tab:blue", label="output tok/s")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    # Headroom over the highest point, so a marker is not cut in half by the frame.
    ax.set_ylim(0, 1.1 * max(row["output_throughput"] for row in rows) or 1.0)
    twin = ax.twinx()
    twin.plot(positions, [row["request_throughput"] for row in rows], marker="s",
              linestyle="--", color="tab:orange", label="requests/s")
    twin.set_ylabel("requests/s", color="tab:orange")
    twin.set_ylim(0, 1.1 * max(row["request_throughput"] for row in rows) or 1.0)
    ax.set_title("throughput")
    ax.grid(alpha=0.3)
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower right")

    by_name = dict(LATENCIES)
    _latency_panel(axes[0][1], positions, rows, [("ttft", by_name["ttft"])],
                   "time to first token")
    _latency_panel(axes[1][0], positions, rows,
                   [("tpot", by_name["tpot"]), ("itl", by_name["itl"])],
                   "time per output token, inter-token latency")
    _latency_panel(axes[1][1], positions, rows, [("e2el", by_name["e2el"])],
                   "end-to-end latency")
    for ax in axes.flat:
        ax.set_xticks(positions, ticks)
        ax.set_xlabel(label)
    return plot_support.save(fig, path)
