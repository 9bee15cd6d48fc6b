"""What every benchmark figure needs: the `--plot PATH` flag, matplotlib behind the `plot` extra
(imported lazily, Agg backend), a title naming the model, the workload and the date, and saving.

matplotlib is optional: `folio bench ...` runs without it, and `--plot` then fails while the
arguments are parsed (before a model is loaded or a server started) with the install command,
rather than after a long run.
"""
from __future__ import annotations

import argparse
import os
from datetime import datetime
from typing import Any

INSTALL_HINT = "pip install 'folio[plot]'"
# One size for every figure: legible on a laptop screen and in a pull request.
FIGSIZE = (12.0, 8.0)
DPI = 100


class PlotUnavailable(ValueError):
    """matplotlib is not installed (a ValueError: the CLIs turn those into exit code 2)."""


def require_matplotlib() -> None:
    """Raise PlotUnavailable, with the install command, when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable(f"--plot needs matplotlib ({exc}); install it with: "
                              f"{INSTALL_HINT}") from None


def plot_path(text: str) -> str:
    """argparse `type` of --plot: checks, at argument time, that a figure can be written."""
    try:
        require_matplotlib()
    except PlotUnavailable as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"--plot: directory {directory!r} does not exist")
    return text


def add_plot_arg(parser: Any, what: str) -> None:
    """`--plot PATH` on `parser` (a parser or an argument group); `what` says what it draws."""
    parser.add_argument("--plot", type=plot_path, default=None, metavar="PATH",
                        help=f"write a PNG figure of {what} to PATH (needs matplotlib: "
                             f"{INSTALL_HINT})")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: files only, no display needed (servers, CI)."""
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def model_name(model: Any) -> str:
    """A short model name for a title: a path's last component, else the name as given."""
    if isinstance(model, dict):
        model = model.get("path") or model.get("name")
    if not model:
        return "unknown model"
    text = str(model).rstrip("/")
    return os.path.basename(text) or text


def display_date(stamp: str | None = None) -> str:
    """`stamp` (the reports' %Y%m%d-%H%M%S) as 'YYYY-MM-DD HH:MM'; now when absent."""
    if stamp:
        try:
            return datetime.strptime(stamp, "%Y%m%d-%H%M%S").strftime("%Y-%m-%d %H:%M")
        except ValueError:
            return stamp
    return datetime.now().strftime("%Y-%m-%d %H:%M")


def figure_title(command: str, model: Any, workload: str, date: str | None = None) -> str:
    return f"folio bench {command}: {model_name(model)}\n{workload} · {display_date(date)}"


def subplots(nrows: int, ncols: int, title: str) -> tuple[Any, Any]:
    """A figure of nrows x ncols axes (always a 2-D array) under `title`. Constrained layout
    keeps the two-line title, tick labels and legends from overlapping."""
    plt = pyplot()
    fig, axes = plt.subplots(nrows, ncols, figsize=FIGSIZE, dpi=DPI, layout="constrained",
                             squeeze=False)
    fig.suptitle(title)
    return fig, axes


def save(fig: Any, path: str) -> str:
    """Write `fig` as a PNG to `path` and free it (pyplot keeps every open figure alive)."""
    plt = pyplot()
    fig.savefig(path, format="png", dpi=DPI)
    plt.close(fig)
    return path
