"""`folio bench sweep serve`: `folio bench serve`'s measurement once per request rate or
concurrency, against one server, into one table and one figure.

    folio bench sweep serve --request-rates 1 2 4 inf --output-csv sweep.csv --plot sweep.png
    folio bench sweep serve --launch --max-concurrency 1 4 16 --output-json sweep.json

Exactly one list is swept: ``--request-rates`` (the arrival process of ``--request-rate``,
`inf` = all at once) or ``--max-concurrency`` (requests in flight). The other may be given as
one fixed value; otherwise it keeps `bench serve`'s default (rate inf, no concurrency cap).
Every value sends the same requests (one dataset, one seed), so rows differ only in the load.
The server is the one at ``--base-url``/``--host``/``--port``, or, with ``--launch``, a
`folio serve` started here once for the whole sweep (warmed up, stopped at the end however the
sweep ends). A value's requests are sent and measured by `folio.bench.serve` (benchmark,
build_report): a sweep row is exactly what `folio bench serve` would report at that value.

Output: the table on stdout (`folio.bench.sweep_table`), ``--output-json`` (the rows plus every
value's full serve report), ``--output-csv`` (the rows), ``--plot`` (`folio.bench.sweep_plot`).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import shlex
import sys
import tempfile
from datetime import datetime
from typing import Any, Iterator, Sequence

import numpy as np

from folio.bench.command import bench_main
from folio.bench import serve, sweep_table
from folio.bench.plot_support import add_plot_arg
from folio.bench.sweep_table import ROW_PERCENTILES, SWEPT

# A different seed for the warm-up requests: no prefix shared with the measured ones.
WARMUP_SEED_OFFSET = 1_000_003


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`folio bench serve`'s flags (workload, server, output), with --max-concurrency and
    --plot redefined for the sweep, plus the swept lists and the launched server's flags."""
    # Redefining an inherited flag needs argparse's "resolve": the sweep's --max-concurrency
    # takes a list and its --plot draws the sweep, where `bench serve`'s take one value and
    # draw distributions; the rest of serve's flags are reused unchanged.
    parser.conflict_handler = "resolve"
    serve.add_cli_args(parser)
    group = parser.add_argument_group("sweep")
    group.add_argument("--request-rates", type=float, nargs="+", default=None,
                       metavar="RATE",
                       help="sweep the mean request rate (req/s; inf = all at once)")
    group.add_argument("--max-concurrency", type=int, nargs="+", default=None, metavar="N",
                       help="sweep the cap on requests in flight (or, with --request-rates, "
                            "one fixed cap)")
    group.add_argument("--output-csv", default=None, help="write the table to this CSV file")
    add_plot_arg(group, "throughput and TTFT/TPOT/ITL/E2E latency against the swept value")
    launch = parser.add_argument_group("launched server")
    launch.add_argument("--launch", action="store_true",
                        help="start `folio serve` here once (free port) for the whole sweep, "
                             "instead of --base-url/--port")
    launch.add_argument("--model-path", default=None,
                        help="the model `folio serve` loads (default: the embedded one)")
    launch.add_argument("--threads", type=int, default=None,
                        help="the server's torch threads (default: os.cpu_count())")
    launch.add_argument("--folio-serve-args", default="",
                        help="extra `folio serve` flags, one shell-quoted string")
    launch.add_argument("--num-warmups", type=int, default=1,
                        help="requests sent before the first value (another seed); also "
                             "without --launch")
    launch.add_argument("--server-ready-timeout", type=float, default=900.0,
                        help="seconds the launched server may take to answer /health")
    launch.add_argument("--server-log-dir", default=None,
                        help="keep the launched server's log here (default: a temporary "
                             "directory)")


def sweep_plan(args: argparse.Namespace) -> tuple[str, list[Any]]:
    """(the swept variable, its values), checking that exactly one list is swept."""
    rates, caps = args.request_rates, args.max_concurrency
    if rates is None and caps is None:
        raise ValueError("give the values to sweep: --request-rates R1 R2 ... or "
                         "--max-concurrency N1 N2 ...")
    if rates is not None and caps is not None and len(rates) > 1 and len(caps) > 1:
        raise ValueError("sweep one list at a time: --request-rates and --max-concurrency "
                         "both have several values (give the other one value, or none)")
    if rates is not None and (caps is None or len(caps) == 1):
        return "request_rate", list(rates)
    return "max_concurrency", list(caps)


def value_args(args: argparse.Namespace, swept: str, value: Any) -> argparse.Namespace:
    """`bench serve`'s arguments for one value: the swept one set, the other fixed (its one
    given value, else serve's default), validated as `bench serve` validates them."""
    out = copy.copy(args)
    if swept == "request_rate":
        out.request_rate = float(value)
        out.max_concurrency = args.max_concurrency[0] if args.max_concurrency else None
    else:
        out.max_concurrency = int(value)
        if args.request_rates:
            out.request_rate = float(args.request_rates[0])
    serve._validate(out)
    return out


# ------------------------------------------------------------------------------------------
# The server
# ------------------------------------------------------------------------------------------

@contextlib.contextmanager
def sweep_server(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The server the sweep loads: the one given (--base-url/--port), or with --launch a
    `folio serve` started once here and stopped when the block ends (serve_peers' process
    handling: its whole tree, also on an error, Ctrl-C or SIGTERM)."""
    if not args.launch:
        yield {"base_url": serve.resolve_base_url(args), "launched": False}
        return
    if args.base_url:
        raise ValueError("--launch starts the server here; drop --base-url")
    from folio.bench import serve_peers
    from folio.bench.server_process import ServerProcess, free_port

    port = free_port(serve_peers.HOST)
    base_url = f"http://{serve_peers.HOST}:{port}"
    argv = serve_peers.folio_serve_command(args.model_path, port,
                                           shlex.split(args.folio_serve_args))
    env = serve_peers.folio_serve_env(serve_peers.resolve_threads(args))
    with contextlib.ExitStack() as stack:
        log_dir = args.server_log_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="folio-bench-sweep-"))
        os.makedirs(log_dir, exist_ok=True)
        print(f"[sweep] starting: {shlex.join(argv)}", flush=True)
        server = ServerProcess("folio", argv, log_path=os.path.join(log_dir, "folio.log"),
                               env=env)
        stack.enter_context(serve_peers._SigtermAsExit())
        stack.enter_context(server)
        ready_s = server.wait_ready(base_url + "/health", args.server_ready_timeout)
        print(f"[sweep] folio serve ready in {ready_s:.1f} s at {base_url}", flush=True)
        info = {"base_url": base_url, "launched": True, "command": argv,
                "start_to_ready_s": ready_s, "process": server}
        yield info
        info["log_tail"] = server.log_tail(30).splitlines()


def _check_alive(server: dict[str, Any]) -> None:
    """A launched server that died mid-sweep would fail every later value: stop there."""
    process = server.get("process")
    if process is not None and not process.alive():
        raise RuntimeError(f"folio serve exited during the sweep (exit code "
                           f"{process.proc.returncode}); last log lines:\n{process.log_tail()}")


def _tokenizer(args: argparse.Namespace) -> Any:
    """The launched model's tokenizer (random prompts are its token ids); for a server given
    by URL, `bench serve`'s choice (--tokenizer, else the default model's)."""
    if not args.launch or args.tokenizer or args.dataset != "random":
        return None                      # serve.prepare_requests loads what it needs
    from folio.bench import serve_peers
    source, _ = serve_peers.resolve_model(args.model_path)
    return serve_peers._load_tokenizer(args, source)


# ------------------------------------------------------------------------------------------
# The sweep
# ------------------------------------------------------------------------------------------

def workload_line(first: argparse.Namespace, swept: str,
                  requests: Sequence[serve.BenchRequest]) -> str:
    """The workload held fixed across the sweep, for the figure's title (`first`: the first
    value's arguments, which carry the fixed setting)."""
    ins = [r.prompt_len for r in requests if r.prompt_len]
    outs = [r.output_len for r in requests]
    lengths = (f"mean {np.mean(ins):.0f} in / " if ins else "mean ") + \
        f"{np.mean(outs):.0f} out tokens"
    if swept == "request_rate":
        fixed = f"max concurrency {first.max_concurrency or 'unlimited'}"
    else:
        fixed = f"request rate {sweep_table.value_text(float(first.request_rate))}/s"
    return f"{first.dataset} dataset, {len(requests)} requests per value ({lengths}), {fixed}"


def run(args: argparse.Namespace, *, tokenizer: Any = None) -> dict[str, Any]:
    """Run the sweep; print the table; write the JSON, CSV and figure asked for."""
    swept, values = sweep_plan(args)
    for value in values:                  # every value checked before anything starts
        value_args(args, swept, value)
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    percentiles = sorted(set(serve.parse_percentiles(args.percentiles)) | set(ROW_PERCENTILES))
    if tokenizer is None:
        tokenizer = _tokenizer(args)
    # Resolves --ignore-eos on `args` too, so the per-value copies below send it.
    requests = serve.prepare_requests(args, tokenizer)
    warmups: list[serve.BenchRequest] = []
    if args.num_warmups:
        warm_args = copy.copy(args)
        warm_args.num_prompts = args.num_warmups
        warm_args.seed = args.seed + WARMUP_SEED_OFFSET
        warmups = serve.prepare_requests(warm_args, tokenizer)
    per_value = [value_args(args, swept, v) for v in values]

    reports: list[dict[str, Any]] = []
    with sweep_server(args) as server:
        if warmups:
            from folio.bench.serve_peers import _warm_up
            try:
                _warm_up(_with_url(args, server["base_url"]), warmups)
            except RuntimeError as exc:     # failed requests: the server's fault, not a bug
                raise ValueError(f"warm-up: {exc}") from None
        model = args.model
        for value, v_args in zip(values, per_value):
            v_args = _with_url(v_args, server["base_url"])
            results, duration, model, peak = asyncio.run(serve.benchmark(v_args, requests,
                                                                         model))
            report = serve.build_report(v_args, requests, results, duration, model, peak,
                                        percentiles)
            reports.append(report)
            if not args.quiet:
                print(f"[sweep] {swept}={sweep_table.value_text(value)}: "
                      f"{report['completed']} ok, {report['failed']} failed, "
                      f"{report['output_throughput']:.1f} out tok/s, mean TTFT "
                      f"{report['mean_ttft_ms']:.1f} ms", flush=True)
            _check_alive(server)
    server.pop("process", None)

    rows = [sweep_table.row_of(swept, value, report) for value, report in zip(values, reports)]
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "swept": swept,
        "flag": SWEPT[swept][0],
        "values": [sweep_table.value_text(v) for v in values],
        "model_id": model,
        "workload": workload_line(per_value[0], swept, requests),
        "server": server,
        "num_prompts": len(requests),
        "num_warmups": len(warmups),
        "percentiles": percentiles,
        "rows": rows,
        "runs": reports,
    }
    if not args.quiet:
        print(sweep_table.format_table(swept, rows))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    if args.output_csv:
        sweep_table.write_csv(args.output_csv, swept, rows)
    if args.plot:
        from folio.bench.sweep_plot import plot_sweep
        print(f"plot written to {plot_sweep(result, args.plot)}")
    return result


def _with_url(args: argparse.Namespace, base_url: str) -> argparse.Namespace:
    out = copy.copy(args)
    out.base_url = base_url
    return out


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, 'folio bench sweep serve',
                      '`folio bench serve` over several request rates or concurrencies.',
                      add_cli_args, run)


if __name__ == "__main__":
    sys.exit(main())
