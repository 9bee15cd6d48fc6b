"""TTFT of a Responses API continuation with the stored response's KV blocks pinned, against
the same server without pins (--responses-kv-pin-ttl 0), both measured in one run.

Two `folio serve` of the same model and KV cache size run side by side (one busy at a time).
Each repetition, on each server: a stored response to a long conversation (about
--conversation-tokens prompt tokens), then unrelated completions that together prefill more
tokens than the KV cache holds (the prefix cache's LRU goes round), then the streamed
continuation (previous_response_id): its TTFT is the time from sending it to its first
output_text delta. The servers take turns, in alternating order, so a drifting load on the
machine weighs on both sides alike; medians are reported.

python tools/bench_kv_pins.py [--reps 7] [--warmups 2] [--blocks 256]
    [--conversation-tokens 1500] [--model PATH] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import openai

from folio.bench.server_process import ServerProcess, free_port

_PLACES = ["museum", "harbour", "old town", "castle", "market", "cathedral", "park", "river",
           "gallery", "bridge", "garden", "tower", "library", "station", "beach", "square"]
_FOODS = ["bread", "fish", "cheese", "soup", "fruit", "pasta", "salad", "rice", "cake", "stew",
          "pie", "noodles", "dumplings", "curry", "tacos", "olives"]


@dataclass
class Sample:
    side: str               # "pins" or "no pins"
    rep: int
    prompt_tokens: int      # the stored response's prompt
    continuation_tokens: int
    cached_tokens: int      # of the continuation's prompt, found in the prefix cache
    flood_tokens: int
    ttft_s: float


def conversation(rep: int, approx_tokens: int) -> str:
    """Trip notes, different for every repetition (so no repetition hits another's blocks);
    about 15 tokens a line."""
    lines = [f"Trip {rep} notes."]
    for i in range(approx_tokens // 15):
        lines.append(f"Day {i}: the {_PLACES[(i + rep) % 16]}, then "
                     f"{_FOODS[(3 * i + rep) % 16]} for dinner.")
    return "\n".join(lines)


def flood(client: openai.OpenAI, model: str, tag: str, min_tokens: int) -> int:
    """Completions with nothing in common with the conversations (nor each other) until
    `min_tokens` prompt tokens were computed; returns how many."""
    total = 0
    n = 0
    while total < min_tokens:
        prompt = " ".join(f"{tag}{n}q{j}" for j in range(120))
        total += client.completions.create(model=model, prompt=prompt,
                                           max_tokens=1).usage.prompt_tokens
        n += 1
    return total


def one_rep(side: str, client: openai.OpenAI, model: str, rep: int, args: argparse.Namespace
            ) -> Sample:
    first = client.responses.create(model=model, input=conversation(rep, args.conversation_tokens),
                                    max_output_tokens=32, temperature=0)
    flooded = flood(client, model, f"r{rep}{side[0]}", args.blocks * args.block_size * 11 // 10)
    start = time.perf_counter()
    ttft = None
    stream = client.responses.create(model=model, previous_response_id=first.id,
                                     input="On which days is there fish for dinner?",
                                     max_output_tokens=8, temperature=0, stream=True)
    final = None
    for event in stream:
        if ttft is None and event.type == "response.output_text.delta":
            ttft = time.perf_counter() - start
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert ttft is not None and final is not None, "the continuation produced no text"
    client.responses.delete(final.id)
    client.responses.delete(first.id)     # ends its pin: the next repetition starts clean
    return Sample(side, rep, first.usage.input_tokens, final.usage.input_tokens,
                  final.usage.input_tokens_details.cached_tokens, flooded, ttft)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmups", type=int, default=2,
                        help="untimed repetitions on each server first (one-off costs)")
    parser.add_argument("--blocks", type=int, default=256,
                        help="KV cache blocks of each server (--num-gpu-blocks-override)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--conversation-tokens", type=int, default=1500)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--json", default=None, help="write the samples and medians here")
    args = parser.parse_args()

    sides = {"pins": "300", "no pins": "0"}
    started: list[ServerProcess] = []
    clients: dict[str, openai.OpenAI] = {}
    logs = tempfile.mkdtemp(prefix="folio-bench-kv-pins-")
    try:
        for side, ttl in sides.items():
            port = free_port()
            argv = [sys.executable, "-m", "folio.entrypoints.cli", "serve",
                    *([args.model] if args.model else []), "--port", str(port),
                    "--num-gpu-blocks-override", str(args.blocks),
                    "--block-size", str(args.block_size),
                    "--max-model-len", str(min(4096, args.blocks * args.block_size)),
                    "--responses-kv-pin-ttl", ttl, "--disable-console"]
            server = ServerProcess(side, argv, log_path=f"{logs}/{side.replace(' ', '_')}.log")
            started.append(server)
            server.start()
            server.wait_ready(f"http://127.0.0.1:{port}/health", timeout=300)
            clients[side] = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                          api_key="none", max_retries=0, timeout=600)
        model = clients["pins"].models.list().data[0].id
        for warmup in range(args.warmups):
            for client in clients.values():
                one_rep("warm-up", client, model, -1 - warmup, args)
        samples: list[Sample] = []
        for rep in range(args.reps):
            order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
            for side in order:
                sample = one_rep(side, clients[side], model, rep, args)
                samples.append(sample)
                print(f"rep {rep} {side:8s} prompt {sample.prompt_tokens} continuation "
                      f"{sample.continuation_tokens} cached {sample.cached_tokens} flood "
                      f"{sample.flood_tokens}: TTFT {1e3 * sample.ttft_s:.0f} ms", flush=True)
    finally:
        for server in started:
            server.stop()
    medians = {side: statistics.median(s.ttft_s for s in samples if s.side == side)
               for side in sides}
    cached = {side: statistics.median(s.cached_tokens for s in samples if s.side == side)
              for side in sides}
    print(f"median TTFT: pins {1e3 * medians['pins']:.0f} ms (cached "
          f"{cached['pins']:.0f} tokens), no pins {1e3 * medians['no pins']:.0f} ms (cached "
          f"{cached['no pins']:.0f}): {medians['no pins'] / medians['pins']:.1f}x, "
          f"{1e3 * (medians['no pins'] - medians['pins']):.0f} ms saved")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": [asdict(s) for s in samples], "median_ttft_s": medians,
                       "median_cached_tokens": cached}, f, indent=1)


if __name__ == "__main__":
    main()
