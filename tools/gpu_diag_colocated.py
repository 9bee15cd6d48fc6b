"""Does another process's GPU work stall a server's decoding? (issue 23: prefill and decode
servers sharing one GPU; without MPS the GPU time-slices between the two processes.)

Starts one `folio serve`, streams `--num-decoders` requests through it, and meanwhile has a
second process (the "hog", plain torch) run bursts of GPU work at given times: `big` bursts
are back-to-back GEMMs of an 8k-token prefill's size (ms each), `small` bursts many short
kernels. Printed: each burst's window and the decoders' stalls (bench disagg's timeline)
inside it; the JSON has all of it.

    python tools/gpu_diag_colocated.py --model DIR --server-args "--dtype bfloat16 ..." \
        --bursts 0.6:200:big,1.6:50:big,2.4:200:small
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

from folio.bench.disagg import stalls
from folio.bench.serve import BenchRequest, build_payload, send_request
from folio.bench.server_process import ServerProcess, free_port

_HOG = r"""
import sys, time, torch
device = sys.argv[1]
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
rows = 8192 if device == "cuda" else 64   # cpu: only to try the tool
dtype = torch.bfloat16 if device == "cuda" else torch.float32
big_a = torch.randn(rows, 4096, device=device, dtype=dtype)
big_b = torch.randn(4096, 14336, device=device, dtype=dtype)
small_a = torch.randn(16, 4096, device=device, dtype=dtype)
small_b = torch.randn(4096, 4096, device=device, dtype=dtype)
ops = {"big": lambda: big_a @ big_b, "small": lambda: small_a @ small_b}
cost = {}
for kind, op in ops.items():
    for _ in range(3):
        op()
    sync()
    start = time.perf_counter()
    for _ in range(20):
        op()
    sync()
    cost[kind] = (time.perf_counter() - start) / 20
print("ready", json.dumps({k: round(v * 1e3, 4) for k, v in cost.items()}), flush=True)
for line in sys.stdin:
    ms, kind = line.split()
    n = max(1, int(float(ms) / 1e3 / cost[kind]))
    start = time.time()
    for _ in range(n):
        ops[kind]()
    sync()
    print("done", start, time.time(), n, flush=True)
""".replace("import sys, time, torch", "import json, sys, time, torch")


async def _run(url: str, hog: subprocess.Popen, args: argparse.Namespace) -> dict:
    import aiohttp
    bursts = []
    for spec in args.bursts.split(","):
        at, ms, kind = spec.split(":")
        bursts.append((float(at), float(ms), kind))
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        start, wall0 = time.perf_counter(), time.time()
        requests = [BenchRequest([1000 + (i * 37 + j) % 9000 for j in range(args.input_len)],
                                 args.input_len, args.output_len)
                    for i in range(args.num_decoders)]

        def send(request: BenchRequest):
            payload = build_payload(request, model, chat=False, temperature=0.0,
                                    ignore_eos=True)
            return send_request(session, url + "/v1/completions", {}, payload, False, 600.0,
                                request.prompt_len, start)

        async def burst(at: float, ms: float, kind: str) -> dict:
            await asyncio.sleep(at)
            hog.stdin.write(f"{ms} {kind}\n")
            hog.stdin.flush()
            line = await loop.run_in_executor(None, hog.stdout.readline)
            _, t0, t1, n = line.split()
            return {"kind": kind, "asked_ms": ms, "kernels": int(n),
                    "start_s": round(float(t0) - wall0, 4), "end_s": round(float(t1) - wall0, 4)}
        burst_tasks = [asyncio.create_task(burst(*b)) for b in bursts]
        decoded = await asyncio.gather(*[send(r) for r in requests])
        done = await asyncio.gather(*burst_tasks)
    failed = [r.error for r in decoded if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    itl = sorted(x for r in decoded for x in r.itl)
    median = itl[len(itl) // 2]
    events = stalls(decoded, max(0.02, 3 * median))
    for b in done:
        inside = [e for e in events if e["end_s"] > b["start_s"] and e["start_s"] < b["end_s"]]
        b["stalls_inside"] = inside
        b["longest_stall_ms"] = max((e["longest_ms"] for e in inside), default=0.0)
    return {"itl_median_ms": 1e3 * median,
            "itl_p99_ms": 1e3 * itl[min(len(itl) - 1, int(0.99 * len(itl)))],
            "decode_end_s": max(r.send_time + r.latency for r in decoded),
            "bursts": done, "stalls": events}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: folio's default model")
    parser.add_argument("--server-args", default="")
    parser.add_argument("--num-decoders", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--bursts", default="0.6:200:big,1.4:50:big,2.0:200:small")
    parser.add_argument("--hog-device", default="cuda", help="cpu: try the tool here")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logs = tempfile.mkdtemp(prefix="folio-diag-colocated-")
    port = free_port()
    cmd = [sys.executable, "-m", "folio.entrypoints.cli", "serve",
           *([args.model] if args.model else []), "--port", str(port),
           *args.server_args.split()]
    hog = subprocess.Popen([sys.executable, "-c", _HOG, args.hog_device], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        ready = hog.stdout.readline().split(maxsplit=1)
        print("hog ms per kernel:", ready[1].strip() if len(ready) > 1 else ready, flush=True)
        with ServerProcess("serve", cmd, log_path=os.path.join(logs, "serve.log")) as server:
            url = f"http://127.0.0.1:{port}"
            server.wait_ready(url + "/health", 600)
            report = asyncio.run(_run(url, hog, args))
    finally:
        hog.kill()
    print(f"ITL median {report['itl_median_ms']:.2f} ms, p99 {report['itl_p99_ms']:.2f} ms; "
          f"decoding ended at {report['decode_end_s']:.2f} s")
    for b in report["bursts"]:
        print(f"burst {b['kind']:5s} {b['asked_ms']:.0f} ms ({b['kernels']} kernels): "
              f"{b['start_s']:.3f}-{b['end_s']:.3f} s, longest stall inside "
              f"{b['longest_stall_ms']:.1f} ms ({len(b['stalls_inside'])} events)")
    print("all stalls:", ", ".join(f"{e['start_s']:.3f}+{e['longest_ms']:.0f}"
                                   f"({e['decoders']})" for e in report["stalls"][:30]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
