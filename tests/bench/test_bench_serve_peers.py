"""Tests of `folio bench serve --peer ...`: the launched servers' lifecycle and memory, the
llama.cpp command lines, llama-batched-bench's output, the comparison arithmetic, and one whole
comparison against stub binaries (no model, no llama.cpp): a small Python OpenAI streaming
server stands in for `folio serve` and `llama-server`, a script printing captured JSON lines for
`llama-batched-bench`.
"""
from __future__ import annotations

import argparse
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from typing import Any

import psutil
import pytest

from folio.bench import llama_cpp_tools, serve, serve_peers
from folio.bench.server_process import (ServerExited, ServerProcess, cpu_snapshot, cpu_usage,
                                        free_port, http_ok, tree_memory)

# llama-batched-bench's output on the embedded SmolLM2-135M Q4_1, 2 threads, captured from the
# real binary (llama.cpp of llama-cpp-python 0.3.36): --output-format jsonl, then the default
# markdown.
BATCHED_JSONL = """\
{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 16, "pl": 1, "n_kv": 48, "t_pp": 0.137864, "speed_pp": 232.112823, "t_tg": 0.189790, "speed_tg": 84.303703, "t": 0.327654, "speed": 146.496002}
{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 16, "pl": 4, "n_kv": 192, "t_pp": 0.427381, "speed_pp": 299.498566, "t_tg": 0.383381, "speed_tg": 166.935760, "t": 0.810762, "speed": 236.814240}
"""  # noqa: E501
BATCHED_MD = """\

llama_batched_bench: n_kv_max = 512, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |      8 |    1 |     24 |    0.201 |    79.76 |    0.279 |    28.67 |    0.480 |    50.04 |
|    16 |      8 |    2 |     48 |    0.384 |    83.35 |    0.360 |    44.39 |    0.744 |    64.49 |
"""  # noqa: E501

# A stand-in for `folio serve` and `llama-server`: --port N; /health, /v1/models and streamed
# /v1/completions (one chunk per token, a usage chunk, [DONE]); prints folio's KV cache start-up
# line; records each request's Connection header in $STUB_RECORD.
FAKE_SERVER = textwrap.dedent("""\
    import json, os, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    port = int(sys.argv[sys.argv.index("--port") + 1])
    record = os.environ.get("STUB_RECORD")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"
        def log_message(self, *a):
            pass
        def _json(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def do_GET(self):
            if self.path == "/health":
                return self._json({"status": "ok"})
            if self.path == "/v1/models":
                return self._json({"data": [{"id": "stub"}]})
            self.send_error(404)
        def do_POST(self):
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if record:
                with open(record, "a") as f:
                    f.write(json.dumps({"connection": self.headers.get("Connection"),
                                        "prompt_len": len(payload["prompt"]),
                                        "max_tokens": payload["max_tokens"]}) + "\\n")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = payload["max_tokens"]
            for i in range(n):
                time.sleep(0.005)
                self.wfile.write(b"data: " + json.dumps(
                    {"choices": [{"index": 0, "text": "w "}]}).encode() + b"\\n\\n")
                self.wfile.flush()
            usage = {"prompt_tokens": len(payload["prompt"]), "completion_tokens": n}
            self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode()
                             + b"\\n\\ndata: [DONE]\\n\\n")

    print("INFO folio.worker.worker: model loaded in 0.1 s (torch.float32, cpu); KV cache: "
          "100 blocks of 16 = 1600 tokens (float32, 4.5 MiB)", file=sys.stderr, flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
""")

# A stand-in for llama-batched-bench: dies of SIGILL unless --no-repack (the AMX crash), else
# prints one JSON line for the -npl it was given.
FAKE_BATCHED = textwrap.dedent("""\
    import json, os, signal, sys
    argv = sys.argv
    if os.environ.get("STUB_SEGV") and "--no-repack" not in argv:
        os.kill(os.getpid(), signal.SIGILL)
    get = lambda flag: int(argv[argv.index(flag) + 1])
    pl, pp, tg = get("-npl"), get("-npp"), get("-ntg")
    print(json.dumps({"pp": pp, "tg": tg, "pl": pl, "n_kv": pl * (pp + tg), "t_pp": 0.5,
                      "speed_pp": pl * pp / 0.5, "t_tg": 1.0, "speed_tg": pl * tg / 1.0,
                      "t": 1.5, "speed": pl * (pp + tg) / 1.5}))
""")


def _script(path: Any, body: str) -> str:
    path.write_text(f"#!{sys.executable}\n" + body, encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.05)


# A tree: the parent (which ignores SIGTERM when asked) starts a child in its group holding
# ~40 MiB, and a grandchild in a session of its own (out of the group); it prints their pids.
TREE = textwrap.dedent("""\
    import os, signal, subprocess, sys, time
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = ("import signal, time\\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n" if "--ignore-term" in sys.argv
               else "")
            + "x = bytearray(40 << 20)\\n"
            + "for i in range(0, len(x), 4096): x[i] = 1\\n"
            + "time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code])
    away = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            start_new_session=True)
    print(child.pid, away.pid, flush=True)
    time.sleep(600)
""")


def _tree(tmp_path: Any, *flags: str) -> ServerProcess:
    script = tmp_path / "tree.py"
    script.write_text(TREE, encoding="utf-8")
    return ServerProcess("tree", [sys.executable, str(script), *flags],
                         log_path=str(tmp_path / "tree.log"), stop_timeout=1.0)


def _tree_pids(server: ServerProcess) -> list[int]:
    _wait_for(lambda: server.log_text().strip() != "")
    return [server.proc.pid] + [int(p) for p in server.log_text().split()]


def test_tree_memory_sums_every_process(tmp_path: Any) -> None:
    with _tree(tmp_path) as server:
        pids = _tree_pids(server)
        _wait_for(lambda: server.memory()["num_processes"] >= 2)
        _wait_for(lambda: server.memory()["rss_bytes"] > 40 << 20)
        memory = server.memory()
        listed = {p["pid"] for p in memory["processes"]}
        assert {pids[0], pids[1]} <= listed   # the escaped grandchild is no longer a descendant
        assert memory["rss_bytes"] == sum(p["rss_bytes"] for p in memory["processes"])
        assert memory["pss_bytes"] is None or 0 < memory["pss_bytes"] <= memory["rss_bytes"]
    assert all(_gone(pid) for pid in pids)
    assert tree_memory(pids[0])["num_processes"] == 0


def test_stop_kills_a_tree_that_ignores_sigterm(tmp_path: Any) -> None:
    server = _tree(tmp_path, "--ignore-term")
    server.start()
    pids = _tree_pids(server)
    server.memory()   # remembers the tree, the grandchild that left the group included
    start = time.monotonic()
    server.stop()
    assert time.monotonic() - start < 15
    _wait_for(lambda: all(_gone(pid) for pid in pids))
    assert server.proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_nothing_is_left_behind_when_the_body_raises(tmp_path: Any, error: type) -> None:
    with pytest.raises(error):
        with _tree(tmp_path) as server:
            pids = _tree_pids(server)
            server.memory()
            raise error("boom")
    _wait_for(lambda: all(_gone(pid) for pid in pids))


def test_wait_ready_and_a_server_that_dies(tmp_path: Any) -> None:
    fake = _script(tmp_path / "fake_server.py", FAKE_SERVER)
    port = free_port()
    with ServerProcess("fake", [fake, "--port", str(port)],
                       log_path=str(tmp_path / "fake.log")) as server:
        assert server.wait_ready(f"http://127.0.0.1:{port}/health", timeout=30) < 30
        assert http_ok(f"http://127.0.0.1:{port}/health")
    assert not http_ok(f"http://127.0.0.1:{port}/health", timeout=0.5)
    # One SIGTERM, to the group only: the server exits of it (no second signal).
    assert server.proc.returncode == -signal.SIGTERM

    crash = _script(tmp_path / "crash.py",
                    "import os, signal\nprint('loading', flush=True)\n"
                    "os.kill(os.getpid(), signal.SIGSEGV)\n")
    with ServerProcess("crash", [crash], log_path=str(tmp_path / "crash.log")) as server:
        with pytest.raises(ServerExited, match="SIGSEGV") as info:
            server.wait_ready("http://127.0.0.1:9/health", timeout=30)
    assert llama_cpp_tools.crash_signal(info.value.returncode) == "SIGSEGV"
    assert llama_cpp_tools.crash_signal(-signal.SIGILL) == "SIGILL"
    assert llama_cpp_tools.crash_signal(-signal.SIGTERM) is None
    assert llama_cpp_tools.crash_signal(0) is None
    assert "loading" in str(info.value)


def test_cpu_usage_splits_the_machine_s_busy_time() -> None:
    before = {"wall": 10.0, "busy": 100.0, "steal": 1.0, "server": 50.0, "client": 5.0}
    after = {"wall": 20.0, "busy": 125.0, "steal": 1.5, "server": 66.0, "client": 6.0}
    assert cpu_usage(before, after) == {"wall_s": 10.0, "server_s": 16.0, "client_s": 1.0,
                                        "other_s": 8.0, "steal_s": 0.5}
    snap = cpu_snapshot([psutil.Process()])
    assert snap["server"] == pytest.approx(snap["client"], abs=0.05) and snap["busy"] > 0


# ------------------------------------------------------------------------------------------
# llama.cpp: binaries, command lines, batched-bench output
# ------------------------------------------------------------------------------------------

def test_parse_batched_bench_jsonl_and_markdown() -> None:
    rows = llama_cpp_tools.parse_batched_bench("some log line\n" + BATCHED_JSONL)
    assert [r["pl"] for r in rows] == [1, 4]
    assert rows[1]["speed_tg"] == pytest.approx(166.93576)
    assert rows[1]["speed_pp"] == pytest.approx(299.498566)
    assert rows[1]["speed"] == pytest.approx(236.81424)
    md = llama_cpp_tools.parse_batched_bench(BATCHED_MD)
    assert [(r["pp"], r["tg"], r["pl"], r["n_kv"]) for r in md] == [(16, 8, 1, 24), (16, 8, 2, 48)]
    assert md[1]["speed_tg"] == pytest.approx(44.39)
    assert md[1]["t_pp"] == pytest.approx(0.384)
    assert md[1]["speed"] == pytest.approx(64.49)
    assert llama_cpp_tools.parse_batched_bench("main: error: failed to load model\n") == []


def test_llama_command_lines() -> None:
    argv = llama_cpp_tools.llama_server_argv("/bin/llama-server", "/m.gguf", slots=16,
                                             ctx_size=16 * 288, threads=3, port=8123)

    def flag(args: list[str], name: str) -> str:
        return args[args.index(name) + 1]

    assert argv[0] == "/bin/llama-server"
    assert flag(argv, "-m") == "/m.gguf"
    assert flag(argv, "-np") == "16" and flag(argv, "-c") == str(16 * 288)
    assert flag(argv, "-t") == "3" and flag(argv, "-tb") == "3"
    assert flag(argv, "--host") == "127.0.0.1" and flag(argv, "--port") == "8123"
    assert flag(argv, "--cache-ram") == "0"
    assert "--no-repack" not in argv
    assert "--no-repack" in llama_cpp_tools.llama_server_argv(
        "s", "m", slots=1, ctx_size=64, threads=1, port=1, repack=False)

    bb = llama_cpp_tools.batched_bench_argv("/bin/bb", "/m.gguf", ctx_size=64 * 288,
                                            input_len=128, output_len=128, parallel=64,
                                            threads=2, extra=["-fa", "on"])
    assert flag(bb, "-npp") == "128" and flag(bb, "-ntg") == "128" and flag(bb, "-npl") == "64"
    assert flag(bb, "-c") == str(64 * 288)
    assert flag(bb, "-b") == "2048" and flag(bb, "-ub") == "512"
    assert flag(bb, "-t") == "2" and flag(bb, "-tb") == "2"
    assert flag(bb, "--output-format") == "jsonl"
    assert bb[-2:] == ["-fa", "on"]
    assert llama_cpp_tools.repack_attempts("auto") == [True, False]
    assert llama_cpp_tools.repack_attempts("off") == [False]


def test_find_binary(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_cpp_tools, "DEFAULT_BUILD_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv(llama_cpp_tools.BIN_DIR_VAR, raising=False)
    with pytest.raises(ValueError, match="tools/build_llama_cpp.sh"):
        llama_cpp_tools.find_binary("llama-server")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    path = _script(bin_dir / "llama-server", "pass\n")
    monkeypatch.setenv(llama_cpp_tools.BIN_DIR_VAR, str(bin_dir))
    assert llama_cpp_tools.find_binary("llama-server") == path


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_peers.add_cli_args(parser)
    return parser.parse_args(list(argv))


class StubTokenizer:
    all_special_ids = [0, 1, 2]
    added_tokens_decoder: dict[int, Any] = {}

    def __len__(self) -> int:
        return 500

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"t{i}" for i in ids)


def test_setup_slots_context_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_peers, "find_binary", lambda name: f"/bin/{name}")
    args = _parse("--peer", "llama-server", "--peer", "llama-batched-bench", "--peer",
                  "llama-server", "--num-prompts", "8", "--max-concurrency", "4",
                  "--random-input-len", "100", "--random-output-len", "50",
                  "--random-range-ratio", "0.2", "--threads", "3")
    requests = serve.build_requests(args, StubTokenizer(), chat=False)
    source = argparse.Namespace(path="/m.gguf")
    setup = serve_peers.build_setup(args, source, "/m.gguf", requests)
    assert serve_peers.peers_of(args) == ["llama-server", "llama-batched-bench"]
    assert setup.threads == 3 and setup.slots == 4
    per_slot = 120 + 60 + llama_cpp_tools.SLOT_MARGIN_TOKENS   # ceil(len * 1.2) each
    assert setup.slot_tokens == per_slot and setup.server_ctx == 4 * per_slot
    assert setup.batched_ctx == 4 * (100 + 50 + llama_cpp_tools.SLOT_MARGIN_TOKENS)
    assert setup.binaries == {"llama-server": "/bin/llama-server",
                              "llama-batched-bench": "/bin/llama-batched-bench"}
    # No --max-concurrency: every request may be in flight at once, one slot each.
    no_cap = _parse("--launch", "--num-prompts", "5")
    assert serve_peers.build_setup(no_cap, source, None, requests[:5]).slots == 5
    # Threads default to the machine's CPUs; folio gets them as torch's thread count.
    assert serve_peers.resolve_threads(_parse()) == os.cpu_count()
    env = serve_peers.folio_serve_env(3)
    assert env["OMP_NUM_THREADS"] == "3" and env["MKL_NUM_THREADS"] == "3"
    argv = serve_peers.folio_serve_argv(setup, 9999, ["--max-num-seqs", "64"])
    assert argv[:4] == [sys.executable, "-m", "folio.entrypoints.cli", "serve"]
    assert argv[4] == "--host"          # no --model-path: folio serve's default model
    assert argv[-4:] == ["--port", "9999", "--max-num-seqs", "64"]


def test_llama_peer_refuses_a_model_that_is_not_gguf(tmp_path: Any) -> None:
    hf_dir = tmp_path / "hf-model"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}", encoding="utf-8")
    args = _parse("--peer", "llama-server", "--model-path", str(hf_dir), "--num-prompts", "2")
    with pytest.raises(ValueError, match="needs a GGUF model"):
        serve_peers.run_comparison(args, tokenizer=StubTokenizer())
    with pytest.raises(ValueError, match="drop --base-url"):
        serve_peers.run_comparison(_parse("--launch", "--base-url", "http://x:1"),
                                   tokenizer=StubTokenizer())


# ------------------------------------------------------------------------------------------
# folio's KV cache and the comparison arithmetic
# ------------------------------------------------------------------------------------------

WORKER_LINE = ("INFO folio.worker.worker: model loaded in 5.3 s (torch.float32, cpu); KV cache: "
               "5825 blocks of 16 = 93200 tokens (float32, 4.00 GiB)\n"
               "INFO folio.server: KV cache: 5825 blocks x 16 = 93200 tokens | max_model_len "
               "8192\n")


def test_folio_kv_cache_from_the_start_up_log() -> None:
    shape = serve_peers.KVShape(num_layers=30, num_kv_heads=3, head_dim=64)
    kv = serve_peers.folio_kv_cache(WORKER_LINE, shape)
    assert kv["num_blocks"] == 5825 and kv["block_size"] == 16 and kv["dtype"] == "float32"
    assert kv["bytes"] == 5825 * 16 * 2 * 30 * 3 * 64 * 4
    assert abs(kv["bytes"] - kv["logged_bytes"]) < 0.01 * 2 ** 30
    # A bfloat16 cache halves it; without the model's shape, the logged (rounded) size.
    bf16 = WORKER_LINE.replace("(float32, 4.00 GiB)", "(bfloat16, 2.00 GiB)")
    assert serve_peers.folio_kv_cache(bf16, shape)["bytes"] == kv["bytes"] // 2
    assert serve_peers.folio_kv_cache(WORKER_LINE, None)["bytes"] == 4 * 2 ** 30
    # Only the server's line (an older worker line): the model dtype from the load line.
    older = ("model loaded in 1.0 s (torch.bfloat16, cpu); KV cache: 10 blocks of 16 = 160 "
             "tokens\n")
    assert serve_peers.folio_kv_cache(older, shape)["bytes"] == 10 * 16 * 2 * 30 * 3 * 64 * 2
    assert serve_peers.folio_kv_cache("nothing here", shape) is None
    # KV cache groups: a block id is a page of a group's layers (here 6 of the 30).
    grouped = WORKER_LINE.replace("(float32, 4.00 GiB)",
                                  "(float32, 0.80 GiB) shared by 5 KV cache groups of 6 layers")
    assert serve_peers.folio_kv_cache(grouped, shape)["bytes"] == kv["bytes"] // 5
    assert serve_peers.llama_kv_cache_estimate(1000, shape) == 1000 * 2 * 30 * 3 * 64 * 2
    line = "0.01.133 I srv    load_model: initializing, n_slots = 64, n_ctx_slot = 512, kv_unified"
    assert serve_peers.llama_server_ctx_from_log("x\n" + line + "\n") == 64 * 512
    assert serve_peers.llama_server_ctx_from_log("nothing") is None


def _http_engine(name: str, completed: int, failed: int, out_tps: float, ttft: float,
                 tpot: float, idle_rss: int) -> dict[str, Any]:
    return {"engine": name, "error": None, "idle_memory": {"rss_bytes": idle_rss},
            "report": {"completed": completed, "failed": failed, "output_throughput": out_tps,
                       "median_ttft_ms": ttft, "median_tpot_ms": tpot}}


def test_comparison_arithmetic() -> None:
    MiB = 2 ** 20
    engines = {
        "folio": _http_engine("folio", 48, 0, 120.0, 900.0, 100.0, 1000 * MiB),
        "llama-server": _http_engine("llama-server", 48, 0, 60.0, 1500.0, 150.0, 200 * MiB),
        "llama-batched-bench": {"engine": "llama-batched-bench", "error": None, "result": {
            "pp": 128, "tg": 128, "pl": 16, "t_pp": 2.0, "t_tg": 25.6, "speed_tg": 80.0}},
    }
    kv = {"bytes": 900 * MiB}
    out = serve_peers.compare(engines, kv)
    assert out["output_throughput_ratio"] == {"llama-server": pytest.approx(2.0),
                                              "llama-batched-bench": pytest.approx(1.5)}
    mem = out["memory"]
    assert mem["llama_server_idle_rss_plus_folio_kv_bytes"] == 1100 * MiB
    assert mem["folio_within"] is True and mem["margin_bytes"] == 100 * MiB
    rows = {r["engine"]: r for r in out["rows"]}
    assert rows["llama-batched-bench"]["output_throughput"] == 80.0
    assert rows["llama-batched-bench"]["median_ttft_ms"] == pytest.approx(2000.0)
    assert rows["llama-batched-bench"]["median_tpot_ms"] == pytest.approx(200.0)
    assert rows["llama-batched-bench"]["idle_rss_bytes"] is None
    # Over budget; and a peer that failed gives no ratio (not a division by zero).
    engines["folio"]["idle_memory"]["rss_bytes"] = 1200 * MiB
    engines["llama-server"] = {"engine": "llama-server", "error": "ServerExited: ..."}
    out = serve_peers.compare(engines, kv)
    assert out["output_throughput_ratio"]["llama-server"] is None
    assert "folio_within" not in out["memory"]
    engines["llama-server"] = _http_engine("llama-server", 40, 8, 0.0, 0.0, 0.0, 200 * MiB)
    out = serve_peers.compare(engines, kv)
    assert out["output_throughput_ratio"]["llama-server"] is None
    assert out["memory"]["folio_within"] is False and out["memory"]["margin_bytes"] == -100 * MiB


# ------------------------------------------------------------------------------------------
# A whole comparison, on stubs
# ------------------------------------------------------------------------------------------

def test_comparison_end_to_end_on_stubs(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = _script(bin_dir / "llama-server", FAKE_SERVER)
    _script(bin_dir / "llama-batched-bench", FAKE_BATCHED)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    record = tmp_path / "requests.jsonl"
    monkeypatch.setenv(llama_cpp_tools.BIN_DIR_VAR, str(bin_dir))
    monkeypatch.setenv("STUB_RECORD", str(record))
    monkeypatch.setenv("STUB_SEGV", "1")
    monkeypatch.setattr(serve_peers, "IDLE_SETTLE_S", 0.0)
    monkeypatch.setattr(serve_peers, "folio_serve_argv",
                        lambda setup, port, extra=(): [fake, "serve", "--port", str(port)])
    monkeypatch.setattr(serve_peers, "model_kv_shape",
                        lambda source: serve_peers.KVShape(30, 3, 64))
    out_json = tmp_path / "out.json"
    args = _parse("--peer", "llama-server", "--peer", "llama-batched-bench",
                  "--model-path", str(gguf), "--num-prompts", "4", "--max-concurrency", "2",
                  "--random-input-len", "12", "--random-output-len", "5", "--threads", "2",
                  "--disable-tqdm", "--timeout", "30", "--output-json", str(out_json),
                  "--plot", str(tmp_path / "comparison.png"))
    result = serve_peers.run_comparison(args, tokenizer=StubTokenizer())

    engines = result["engines"]
    assert set(engines) == {"folio", "llama-server", "llama-batched-bench"}
    for name in ("folio", "llama-server"):
        report = engines[name]["report"]
        assert (report["completed"], report["failed"]) == (4, 0), report["errors"]
        assert report["output_lens"] == [5] * 4 and report["input_lens"] == [12] * 4
        assert engines[name]["idle_memory"]["rss_bytes"] > 0
        assert engines[name]["cpu"]["wall_s"] > 0 and engines[name]["cpu"]["other_s"] >= 0
        assert all(_gone(pid) for pid in engines[name]["pids"])
    command = engines["llama-server"]["command"]
    assert command[command.index("-np") + 1] == "2"
    # llama-server started at once (only llama-batched-bench's stub crashes without
    # --no-repack); the batched bench was run again without repacking.
    assert engines["llama-server"]["repack"] is True
    assert engines["llama-batched-bench"]["repack"] is False
    assert "SIGILL" in engines["llama-batched-bench"]["notes"][0]
    assert engines["llama-batched-bench"]["result"]["speed_tg"] == 2 * 5 / 1.0
    # Each engine: 1 warm-up + 4 requests, every one on a connection of its own.
    sent = [line for line in record.read_text().splitlines()]
    assert len(sent) == 2 * 5
    assert all('"connection": "close"' in line for line in sent)

    kv = result["folio_kv_cache"]
    assert kv["bytes"] == 100 * 16 * 2 * 30 * 3 * 64 * 4
    cells = 2 * (12 + 5 + llama_cpp_tools.SLOT_MARGIN_TOKENS)   # -c: the stub logs no slots
    assert result["llama_server_kv_cache"]["cells"] == cells == result["config"]["llama_server_ctx"]
    comparison = result["comparison"]
    assert comparison["output_throughput_ratio"]["llama-server"] > 0
    assert comparison["output_throughput_ratio"]["llama-batched-bench"] > 0
    assert comparison["memory"]["folio_kv_cache_bytes"] == kv["bytes"]
    assert "folio_within" in comparison["memory"]
    printed = capsys.readouterr().out
    assert "folio serve vs llama.cpp" in printed
    assert "folio / llama-server (output throughput)" in printed
    assert "memory: folio idle RSS" in printed
    assert "CPU during llama-server's run" in printed
    # --plot: both HTTP engines' distributions in one figure (batched-bench has none).
    from png_utils import assert_png
    assert_png(tmp_path / "comparison.png")
    assert f"plot written to {tmp_path / 'comparison.png'}" in printed
    import json
    saved = json.loads(out_json.read_text())
    assert saved["comparison"]["memory"] == comparison["memory"]
    assert saved["config"]["threads"] == 2 and saved["config"]["slots"] == 2


def test_ctrl_c_during_the_run_stops_the_server(tmp_path: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _script(tmp_path / "fake_server.py", FAKE_SERVER)
    monkeypatch.setattr(serve_peers, "IDLE_SETTLE_S", 0.0)
    started: list[ServerProcess] = []
    real_start = ServerProcess.start

    def start(self: ServerProcess) -> None:
        real_start(self)
        started.append(self)

    async def interrupted(*a: Any, **k: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(ServerProcess, "start", start)
    monkeypatch.setattr(serve, "benchmark", interrupted)
    args = _parse("--launch", "--num-prompts", "2", "--num-warmups", "0", "--quiet")
    with pytest.raises(KeyboardInterrupt):
        serve_peers.run_http_engine("folio", lambda port: [fake, "--port", str(port)], None,
                                    args, [], [], [50.0], str(tmp_path))
    assert started and not started[0].alive()
    assert all(_gone(pid) for pid in started[0].pids)


def test_sigterm_becomes_an_exit_that_stops_the_servers() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        with serve_peers._SigtermAsExit():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert info.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == previous


def test_cli_registers_the_peer_flags() -> None:
    from folio.entrypoints.cli import build_parser
    args = build_parser().parse_args(["bench", "serve", "--peer", "llama-server", "--threads",
                                      "4", "--llama-cpp-repack", "off"])
    assert args.peer == ["llama-server"] and args.threads == 4
    assert serve_peers.launching(args)
    assert not serve_peers.launching(build_parser().parse_args(["bench", "serve"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--peer", "vllm"])
    # A plain subprocess check that `python -m folio.bench.serve_peers --help` works.
    done = subprocess.run([sys.executable, "-m", "folio.bench.serve_peers", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--peer" in done.stdout
