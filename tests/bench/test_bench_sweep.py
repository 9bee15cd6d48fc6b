"""`folio bench sweep serve` for real: `folio serve` of the default model on CPU, started once by
the sweep (--launch), two concurrencies of a few short requests each, into the table (stdout),
the JSON, the CSV and the figure. About 15-25 s on the 2-core CI machine, most of it the
server's start.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from folio.bench import serve_plot, sweep  # noqa: E402
from folio.bench.server_process import ServerProcess  # noqa: E402
from png_utils import assert_png  # noqa: E402

NUM_PROMPTS = 3
OUTPUT_LEN = 4


@pytest.mark.timeout(300)
def test_sweep_over_concurrency_against_a_real_server(tmp_path: Path, capsys: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    starts: list[list[str]] = []
    real_start = ServerProcess.start

    def counting_start(self: ServerProcess) -> None:
        starts.append(self.argv)
        real_start(self)

    monkeypatch.setattr(ServerProcess, "start", counting_start)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out_json, out_csv, out_png = (tmp_path / "sweep.json", tmp_path / "sweep.csv",
                                  tmp_path / "sweep.png")
    code = sweep.main([
        "--launch", "--threads", "1", "--folio-serve-args", "--max-model-len 256",
        "--max-concurrency", "1", "2", "--num-prompts", str(NUM_PROMPTS),
        "--random-input-len", "16", "--random-output-len", str(OUTPUT_LEN), "--disable-tqdm",
        "--server-ready-timeout", "240", "--timeout", "60",
        "--output-json", str(out_json), "--output-csv", str(out_csv), "--plot", str(out_png)])
    printed = capsys.readouterr().out
    assert code == 0, printed

    assert len(starts) == 1                                       # one server for the sweep
    lines = printed.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["concurrency", "ok"])
    table = [line.split() for line in lines[header + 2: header + 4]]
    assert [row[0] for row in table] == ["1", "2"]
    assert all(row[1] == str(NUM_PROMPTS) and row[2] == "0" for row in table)

    result = json.loads(out_json.read_text())
    assert result["swept"] == "max_concurrency" and result["values"] == ["1", "2"]
    assert result["server"]["launched"] and result["num_warmups"] == 1
    rows, runs = result["rows"], result["runs"]
    assert [row["max_concurrency"] for row in rows] == ["1", "2"]
    for cap, row, run in zip((1, 2), rows, runs):
        assert run["max_concurrency"] == cap and run["max_concurrency_seen"] <= cap
        assert row["completed"] == NUM_PROMPTS and row["failed"] == 0, run["errors"]
        assert run["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN    # ignore_eos sent
        assert row["output_throughput"] > 0 and row["request_throughput"] > 0
        for metric in ("ttft", "tpot", "itl", "e2el"):
            assert 0 < row[f"p50_{metric}_ms"] <= row[f"p99_{metric}_ms"]
            assert row[f"mean_{metric}_ms"] == run[f"mean_{metric}_ms"]
        assert row["mean_ttft_ms"] < row["mean_e2el_ms"]
    # Concurrency 1 sends one request at a time: its peak says so.
    assert runs[0]["max_concurrency_seen"] == 1

    with open(out_csv, newline="") as f:
        read = list(csv.DictReader(f))
    assert [r["max_concurrency"] for r in read] == ["1", "2"]
    assert float(read[1]["p99_e2el_ms"]) == pytest.approx(rows[1]["p99_e2el_ms"])

    assert_png(out_png)
    # The real per-value reports also draw as `bench serve --plot` distributions.
    serve_plot.plot_serve([(f"concurrency {v}", run) for v, run in zip((1, 2), runs)],
                          str(tmp_path / "runs.png"))
    assert_png(tmp_path / "runs.png")
