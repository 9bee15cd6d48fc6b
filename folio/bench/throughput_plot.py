"""`folio bench throughput --plot`: the throughput of each engine as bars, folio and its peers.

Generation: output tokens/s per engine (the number the benchmark compares), each bar labelled
with its value and folio's ratio over it; an engine that failed gets an empty bar marked
"failed" rather than vanishing from the figure. `--task embed`: sentences/s of folio and of
the sentence-transformers peer at each batch size it ran.
"""
from __future__ import annotations

from typing import Any

from folio.bench import plot_support

Bar = tuple[str, float | None, str]    # label, value (None: the engine failed), note


def generation_bars(report: dict[str, Any]) -> list[Bar]:
    bars: list[Bar] = []
    for engine in report.get("engines", []):
        rate = engine.get("output_tokens_per_s")
        ratio = engine.get("folio_over_this")
        note = f"folio {ratio:.2f}x" if ratio and engine.get("engine") != "folio" else ""
        bars.append((str(engine.get("engine")), rate, note if rate else "failed"))
    return bars


def embed_bars(report: dict[str, Any]) -> list[Bar]:
    folio = report.get("folio") or {}
    bars: list[Bar] = [("folio", folio.get("sentences_per_s"), "")]
    peer = report.get("peer") or {}
    if peer.get("error"):
        bars.append(("sentence-transformers", None, "failed"))
    for size, rate in sorted((int(k), v) for k, v in (peer.get("rates") or {}).items()):
        bars.append((f"{peer.get('engine', 'peer')}\nbatch {size}", rate, ""))
    return bars


def workload_line(report: dict[str, Any]) -> str:
    if report.get("task") == "embed":
        return (f"embed: {report.get('num_texts')} texts, {report.get('num_tokens')} tokens "
                f"({report.get('device')}, {report.get('dtype')})")
    settings = report.get("settings") or {}
    ins, outs = settings.get("input_len_range"), settings.get("output_len_range")
    return (f"{report.get('num_requests')} requests, prompt {ins[0]}-{ins[1]}, output "
            f"{outs[0]}-{outs[1]} tokens, temperature {settings.get('temperature')} "
            f"({report.get('device')}, {report.get('dtype')})"
            if ins and outs else f"{report.get('num_requests')} requests")


def plot_throughput(report: dict[str, Any], path: str) -> str:
    """One PNG at `path` from a `folio bench throughput` report (generation or embed)."""
    embed = report.get("task") == "embed"
    bars = embed_bars(report) if embed else generation_bars(report)
    if not bars:
        raise ValueError("nothing to plot: the report lists no engine")
    fig, axes = plot_support.subplots(1, 1, plot_support.figure_title(
        "throughput", report.get("model"), workload_line(report)))
    ax = axes[0][0]
    values = [value or 0.0 for _, value, _ in bars]
    colors = ["tab:blue" if label == "folio" else "tab:gray" for label, _, _ in bars]
    positions = range(len(bars))
    ax.bar(positions, values, color=colors)
    top = max(values) if max(values) > 0 else 1.0
    for x, (_, value, note) in zip(positions, bars):
        text = f"{value:,.1f}" if value else ""
        ax.text(x, (value or 0.0) + 0.01 * top, "\n".join(t for t in (text, note) if t),
                ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(positions), [label for label, _, _ in bars])
    ax.set_ylabel("sentences/s" if embed else "output tokens/s")
    ax.set_ylim(0, 1.2 * top)
    ax.set_title("sentences per second" if embed else "output throughput per engine")
    ax.grid(axis="y", alpha=0.3)
    return plot_support.save(fig, path)
