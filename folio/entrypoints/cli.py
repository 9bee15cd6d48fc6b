"""The `folio` command: chat with a model, run benchmarks."""
from __future__ import annotations

import argparse
import logging
import sys

from folio.engine.arg_utils import add_engine_args, engine_kwargs_from_args
from folio.entrypoints.help_format import FolioHelpFormatter


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling: keep the smallest set of tokens whose probability "
                             "reaches this (1 = off)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="keep only the k most likely tokens (0 = off)")
    parser.add_argument("--system", default=None, help="system prompt (default: none)")


def _chat(args: argparse.Namespace) -> int:
    from folio import LLM, SamplingParams
    llm = LLM(**engine_kwargs_from_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})

    def answer(text: str) -> str:
        history.append({"role": "user", "content": text})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        return reply

    if args.prompt is not None:
        print(answer(args.prompt))
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print("folio chat: type a message, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        if line.strip():
            print(answer(line.strip()), flush=True)


def _log_level_arg(parser: argparse.ArgumentParser) -> None:
    """--log-level after a server's command too (`folio serve MODEL --log-level debug`), as
    before it; absent there, the one before the command (or the default) holds."""
    parser.add_argument("--log-level", default=argparse.SUPPRESS,
                        help="logging level (default: INFO)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="folio", description="folio: LLM inference and serving engine",
                                     formatter_class=FolioHelpFormatter)
    parser.add_argument("--log-level", default=None,
                        help="logging level (default: INFO for serve, WARNING otherwise)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default 127.0.0.1:8000)",
                           formatter_class=FolioHelpFormatter)
    from folio.entrypoints.openai.cli_args import add_serve_args
    add_serve_args(serve)

    def _serve(args: argparse.Namespace) -> int:
        if args.role == "router":
            from folio.entrypoints.disagg_router import run_router
            return run_router(args)
        from folio.entrypoints.openai.api_server import serve as run_server
        return run_server(args)
    serve.set_defaults(func=_serve)
    _log_level_arg(serve)

    router = sub.add_parser("router", help="the front of disaggregated prefill: prompts to "
                            "prefill servers, generation to decode servers (default "
                            "127.0.0.1:8000)", formatter_class=FolioHelpFormatter)
    from folio.entrypoints.disagg_router import add_router_args

    def _router(args: argparse.Namespace) -> int:
        from folio.entrypoints.disagg_router import run_router
        return run_router(args)
    add_router_args(router)
    router.set_defaults(func=_router)
    _log_level_arg(router)

    chat = sub.add_parser("chat", help="chat with a model (interactive, or one-shot with --prompt)",
                          formatter_class=FolioHelpFormatter)
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.add_argument("--prompt", default=None, help="answer this one message and exit")
    chat.set_defaults(func=_chat)

    bench = sub.add_parser("bench", help="benchmarks", formatter_class=FolioHelpFormatter)
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    throughput = bench_sub.add_parser("throughput", help="offline throughput, optionally against a peer",
                                       formatter_class=FolioHelpFormatter)
    from folio.bench import throughput as throughput_bench
    throughput_bench.add_cli_args(throughput)
    throughput.set_defaults(func=lambda a: (throughput_bench.run(a), 0)[1])
    latency = bench_sub.add_parser("latency", help="latency of one batch; decode ms/token vs roofline",
                                    formatter_class=FolioHelpFormatter)
    from folio.bench import latency as latency_bench
    latency_bench.add_cli_args(latency)
    latency.set_defaults(func=lambda a: (latency_bench.run(a), 0)[1])
    kv_tiers = bench_sub.add_parser("kv-tiers", help="TTFT of a long prefix: device hit, host "
                                    "tier, recompute", formatter_class=FolioHelpFormatter)
    from folio.bench import kv_tiers as kv_tiers_bench
    kv_tiers_bench.add_cli_args(kv_tiers)
    kv_tiers.set_defaults(func=lambda a: (kv_tiers_bench.run(a), 0)[1])
    disagg = bench_sub.add_parser("disagg", help="disaggregated prefill vs one server: decoders' "
                                  "ITL while long prompts arrive", formatter_class=FolioHelpFormatter)
    from folio.bench import disagg as disagg_bench
    disagg_bench.add_cli_args(disagg)
    disagg.set_defaults(func=lambda a: (disagg_bench.run(a), 0)[1])
    serve_bench = bench_sub.add_parser("serve", help="load an OpenAI-compatible server; TTFT/TPOT/ITL",
                                        formatter_class=FolioHelpFormatter)
    # serve_peers: bench serve's flags plus --peer / --launch (servers started here).
    from folio.bench import serve_peers as serve_bench_module
    serve_bench_module.add_cli_args(serve_bench)
    serve_bench.set_defaults(func=lambda a: (serve_bench_module.run(a), 0)[1])
    sweep = bench_sub.add_parser("sweep", help="bench serve over request rates or concurrencies",
                                 formatter_class=FolioHelpFormatter)
    sweep_sub = sweep.add_subparsers(dest="sweep_command", required=True)
    sweep_serve = sweep_sub.add_parser("serve", help="one table and one figure over "
                                       "--request-rates or --max-concurrency",
                                       formatter_class=FolioHelpFormatter)
    from folio.bench import sweep as sweep_module
    sweep_module.add_cli_args(sweep_serve)
    sweep_serve.set_defaults(func=lambda a: (sweep_module.run(a), 0)[1])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = args.log_level or ("INFO" if args.command in ("serve", "router") else "WARNING")
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from folio.model.default_model import DefaultModelNotInstalled
    try:
        return args.func(args)
    except DefaultModelNotInstalled as exc:
        print(f"folio: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"folio: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
