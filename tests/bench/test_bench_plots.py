"""`--plot` of `folio bench serve|throughput|latency` and the sweep's figure and table.

The figure functions run on synthetic reports (every file a valid PNG of the set size, within
sane bytes); throughput and latency also end to end on a tiny random model. Without matplotlib
(simulated: `sys.modules["matplotlib"] = None` makes its import fail) `--plot` is refused while
the arguments are parsed, naming the install command.
"""
from __future__ import annotations

import argparse
import csv
import random
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from folio.bench import (latency, latency_plot, plot_support, serve, serve_plot,  # noqa: E402
                         sweep, sweep_plot, sweep_table, throughput, throughput_plot)
from folio.entrypoints.cli import build_parser  # noqa: E402
from png_utils import assert_png  # noqa: E402

def serve_report(seed: int, ttft_s: float, num: int = 30) -> dict[str, Any]:
    """A `folio bench serve` report built by serve's own code from synthetic request timings
    (one request in ten failed)."""
    rng = random.Random(seed)
    results = []
    for i in range(num):
        failed = i % 10 == 3
        r = serve.RequestResult(success=not failed, error="HTTP 500" if failed else "")
        r.ttft = ttft_s * (1 + rng.random())
        r.itl = [0.02 + 0.01 * rng.random() for _ in range(7)]
        r.latency = r.ttft + sum(r.itl)
        r.prompt_len, r.output_tokens, r.send_time = 32, 8, 0.05 * i
        results.append(r)
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(["--num-prompts", str(num), "--max-concurrency", "4"])
    requests = [serve.BenchRequest(prompt=[5] * 32, prompt_len=32, output_len=8)] * num
    return serve.build_report(args, requests, results, 2.0, "SmolLM2-135M", 4, [50, 99])


def test_serve_plot_on_synthetic_reports(tmp_path: Path) -> None:
    report = serve_report(0, 0.05)
    series = serve_plot.request_series(report)
    assert len(series["ttft"]) == len(series["e2el"]) == 27       # failed requests left out
    assert len(series["itl"]) == 27 * 7 and len(series["tpot"]) == 27
    assert min(series["ttft"]) >= 50.0                            # seconds -> ms
    assert "random dataset, 30 requests" in serve_plot.workload_line(report)
    path = tmp_path / "serve.png"
    assert serve_plot.plot_serve([("folio", report), ("peer", serve_report(1, 0.1))],
                                 str(path)) == str(path)
    assert_png(path)
    # A run where every request failed still draws (panels say "no data").
    empty = dict(report, errors=["boom"] * len(report["errors"]))
    serve_plot.plot_serve([("folio", empty)], str(tmp_path / "empty.png"))
    assert_png(tmp_path / "empty.png")


def test_serve_plot_flag_is_wired(tmp_path: Path, capsys: Any) -> None:
    """`bench serve --plot` writes the figure even when the server is unreachable (every
    request failed: still one PNG, the run does not abort)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    path = tmp_path / "serve.png"
    assert serve.main(["--port", str(port), "--dataset", "file", "--dataset-path", str(prompts),
                       "--num-prompts", "2", "--model", "m", "--disable-tqdm", "--quiet",
                       "--plot", str(path)]) == 0
    assert_png(path)
    assert f"plot written to {path}" in capsys.readouterr().out


def test_latency_plot_on_a_synthetic_report(tmp_path: Path) -> None:
    report = {"latencies": [0.51, 0.49, 0.50], "prefill_latencies": [0.05, 0.06, 0.05],
              "median_latency_s": 0.50, "median_prefill_latency_s": 0.05,
              "median_decode_ms_per_token": 3.5, "batch_size": 1, "input_len": 32,
              "output_len": 128, "num_iters": 3, "model": {"kind": "gguf", "path": "/m/x.gguf"},
              "dtype": "float32", "device": "cpu", "dataset": "random",
              "peer": {"engine": "transformers", "error": None, "median_latency_s": 0.9,
                       "median_prefill_latency_s": 0.1, "median_decode_ms_per_token": 6.3}}
    assert latency_plot._split(report) == pytest.approx((50.0, 450.0))
    assert latency_plot._split(report["peer"]) == pytest.approx((100.0, 800.0))
    path = tmp_path / "latency.png"
    latency_plot.plot_latency(report, str(path))
    assert_png(path)


def test_throughput_plot_on_synthetic_reports(tmp_path: Path) -> None:
    report = {"model": {"kind": "hf", "path": "/m/SmolLM2"}, "device": "cpu",
              "dtype": "float32", "num_requests": 256,
              "settings": {"input_len_range": [100, 1024], "output_len_range": [100, 1024],
                           "temperature": 1.0},
              "engines": [{"engine": "folio", "output_tokens_per_s": 1500.0,
                           "folio_over_this": 1.0},
                          {"engine": "transformers", "output_tokens_per_s": 400.0,
                           "folio_over_this": 3.75},
                          {"engine": "transformers-cb", "output_tokens_per_s": None,
                           "folio_over_this": None, "error": "timed out"}]}
    assert throughput_plot.generation_bars(report) == [
        ("folio", 1500.0, ""), ("transformers", 400.0, "folio 3.75x"),
        ("transformers-cb", None, "failed")]
    throughput_plot.plot_throughput(report, str(tmp_path / "gen.png"))
    assert_png(tmp_path / "gen.png")
    embed = {"task": "embed", "model": "/m/minilm", "num_texts": 64, "num_tokens": 900,
             "device": "cpu", "dtype": "float32", "folio": {"sentences_per_s": 300.0},
             "peer": {"engine": "sentence-transformers", "rates": {"8": 120.0, "32": 200.0}}}
    assert [label for label, _, _ in throughput_plot.embed_bars(embed)] == [
        "folio", "sentence-transformers\nbatch 8", "sentence-transformers\nbatch 32"]
    throughput_plot.plot_throughput(embed, str(tmp_path / "embed.png"))
    assert_png(tmp_path / "embed.png")


def test_sweep_table_csv_and_plot(tmp_path: Path) -> None:
    reports = [serve_report(0, 0.05), serve_report(1, 0.1), serve_report(2, 0.2)]
    values = [1.0, 4.0, float("inf")]
    rows = [sweep_table.row_of("request_rate", v, r) for v, r in zip(values, reports)]
    assert [row["request_rate"] for row in rows] == ["1", "4", "inf"]
    assert rows[2]["p99_ttft_ms"] == reports[2]["p99_ttft_ms"]
    text = sweep_table.format_table("request_rate", rows)
    assert text.splitlines()[0].split()[:2] == ["rate", "req/s"]
    assert "p99 E2EL" in text and "inf" in text
    sweep_table.write_csv(str(tmp_path / "s.csv"), "request_rate", rows)
    with open(tmp_path / "s.csv", newline="") as f:
        read = list(csv.DictReader(f))
    assert [r["request_rate"] for r in read] == ["1", "4", "inf"]
    assert float(read[1]["mean_tpot_ms"]) == pytest.approx(rows[1]["mean_tpot_ms"])
    sweep_plot.plot_sweep({"swept": "request_rate", "rows": rows, "model_id": "SmolLM2",
                           "workload": "random dataset"}, str(tmp_path / "sweep.png"))
    assert_png(tmp_path / "sweep.png")


def _sweep_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sweep.add_cli_args(parser)
    return parser.parse_args(list(argv))


def test_sweep_plan_takes_one_list() -> None:
    assert sweep.sweep_plan(_sweep_args("--request-rates", "1", "inf")) == \
        ("request_rate", [1.0, float("inf")])
    assert sweep.sweep_plan(_sweep_args("--max-concurrency", "1", "4")) == \
        ("max_concurrency", [1, 4])
    # The other list may hold one fixed value.
    args = _sweep_args("--request-rates", "2", "8", "--max-concurrency", "3")
    assert sweep.sweep_plan(args) == ("request_rate", [2.0, 8.0])
    one = sweep.value_args(args, "request_rate", 8.0)
    assert one.request_rate == 8.0 and one.max_concurrency == 3
    args = _sweep_args("--request-rates", "5", "--max-concurrency", "1", "2")
    assert sweep.sweep_plan(args) == ("max_concurrency", [1, 2])
    assert sweep.value_args(args, "max_concurrency", 2).request_rate == 5.0
    with pytest.raises(ValueError, match="one list at a time"):
        sweep.sweep_plan(_sweep_args("--request-rates", "1", "2", "--max-concurrency", "1", "2"))
    with pytest.raises(ValueError, match="give the values to sweep"):
        sweep.sweep_plan(_sweep_args())
    with pytest.raises(ValueError, match="max-concurrency"):
        sweep.value_args(_sweep_args("--max-concurrency", "0"), "max_concurrency", 0)
    assert sweep.main(["--request-rates", "-1"]) == 2               # refused before any request


@pytest.mark.parametrize("command", [["bench", "serve"], ["bench", "throughput"],
                                     ["bench", "latency"],
                                     ["bench", "sweep", "serve", "--request-rates", "1"]])
def test_plot_without_matplotlib_fails_at_argument_time(command: list[str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: Any) -> None:
    parser = build_parser()
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # `import matplotlib` fails
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([*command, "--plot", str(tmp_path / "out.png")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install 'folio[plot]'" in err
    # Without --plot, matplotlib is not needed.
    parser.parse_args(command)
    with pytest.raises(plot_support.PlotUnavailable, match=r"folio\[plot\]"):
        plot_support.pyplot()


def test_plot_into_a_missing_directory_is_refused(tmp_path: Path, capsys: Any) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--plot", str(tmp_path / "no" / "x.png")])
    assert "does not exist" in capsys.readouterr().err


def test_latency_and_throughput_plot_end_to_end(tiny_model_dir: Any, tmp_path: Path) -> None:
    model = tiny_model_dir("llama")
    parser = argparse.ArgumentParser()
    latency.add_cli_args(parser)
    latency.run(parser.parse_args([
        "--model", model, "--input-len", "8", "--output-len", "4", "--num-iters-warmup", "0",
        "--num-iters", "2", "--num-gpu-blocks-override", "64", "--no-roofline",
        "--plot", str(tmp_path / "latency.png")]))
    assert_png(tmp_path / "latency.png")
    parser = argparse.ArgumentParser()
    throughput.add_cli_args(parser)
    throughput.run(parser.parse_args([
        "--model", model, "--num-prompts", "3", "--input-len-range", "4", "8",
        "--output-len-range", "2", "4", "--no-tqdm", "--num-gpu-blocks-override", "64",
        "--no-roofline", "--plot", str(tmp_path / "throughput.png")]))
    assert_png(tmp_path / "throughput.png")
