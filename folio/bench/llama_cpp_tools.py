"""The llama.cpp binaries `folio bench serve --peer` runs beside folio: where they are, the
command line of each, and the result table of `llama-batched-bench`.

The binaries come from tools/build_llama_cpp.sh (the llama.cpp that llama-cpp-python vendors,
built from source): found in $FOLIO_LLAMA_CPP_BIN, else the script's default build directory,
else on PATH.

Weight repacking: llama.cpp moves weights into "extra" CPU buffer types (the AMX one for Q4_1,
the repacked x86 layouts for Q4_0 / Q4_K / ...). On some AMX machines its AMX matmul crashes
in `ggml_backend_amx_mul_mat` (upstream ggml-org/llama.cpp#20824; a 2-vCPU Xeon VM with AMX
dies of SIGSEGV or SIGILL at the first forward pass); `--no-repack` avoids those buffer types.
The "auto" policy runs a peer with repacking and, only when that run crashes (dies of one of
CRASH_SIGNALS), once more with `--no-repack`, saying so in the report.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
from typing import Any, Sequence

from folio.bench.llama_cpp_peers import DEFAULT_BUILD_DIR

BUILD_SCRIPT = "tools/build_llama_cpp.sh"
BIN_DIR_VAR = "FOLIO_LLAMA_CPP_BIN"
REPACK_POLICIES = ("auto", "on", "off")
# Tokens per llama-server slot beyond the longest prompt and output the dataset can draw: room
# for a BOS token or a chat template's wrapping, so no slot ever runs out of context.
SLOT_MARGIN_TOKENS = 32


def find_binary(name: str) -> str:
    """The path of llama.cpp's `name` binary; ValueError naming the build script if none."""
    places = []
    env_dir = os.environ.get(BIN_DIR_VAR)
    if env_dir:
        places.append(env_dir)
    places.append(DEFAULT_BUILD_DIR)
    for directory in places:
        path = os.path.join(directory, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if found:
        return found
    raise ValueError(f"{name} not found in ${BIN_DIR_VAR} ({env_dir or 'unset'}), "
                     f"{DEFAULT_BUILD_DIR} or PATH; build it with {BUILD_SCRIPT} (and set "
                     f"{BIN_DIR_VAR} as it prints)")


def slot_context(max_input_len: int, max_output_len: int,
                 margin: int = SLOT_MARGIN_TOKENS) -> int:
    """Context one sequence needs: its longest prompt and output, plus a margin."""
    return max_input_len + max_output_len + margin


def llama_server_argv(binary: str, gguf_path: str, *, slots: int, ctx_size: int, threads: int,
                      port: int, host: str = "127.0.0.1", repack: bool = True,
                      extra: Sequence[str] = ()) -> list[str]:
    """llama-server with `slots` slots sharing `ctx_size` tokens of KV (ctx_size / slots each:
    with -np given, the KV cache is per slot, not unified), `threads` threads for decode and
    for prompt batches.

    --cache-ram 0: no host-memory copy of idle slots' KV for later prompt reuse (it would add
    memory and copying that random prompts never hit; folio keeps no second copy either).
    The per-slot prompt cache (--cache-prompt, on by default, like folio's prefix caching)
    stays on: neither finds a shared prefix among random prompts."""
    argv = [binary, "-m", gguf_path, "-np", str(slots), "-c", str(ctx_size),
            "-t", str(threads), "-tb", str(threads), "--host", host, "--port", str(port),
            "--cache-ram", "0"]
    if not repack:
        argv.append("--no-repack")
    return argv + list(extra)


def batched_bench_argv(binary: str, gguf_path: str, *, ctx_size: int, input_len: int,
                       output_len: int, parallel: int, threads: int, repack: bool = True,
                       batch: int = 2048, ubatch: int = 512,
                       extra: Sequence[str] = ()) -> list[str]:
    """llama-batched-bench: `parallel` sequences of `input_len` prompt tokens (not shared),
    then `output_len` generated tokens each, results as JSON lines."""
    argv = [binary, "-m", gguf_path, "-c", str(ctx_size), "-b", str(batch), "-ub", str(ubatch),
            "-npp", str(input_len), "-ntg", str(output_len), "-npl", str(parallel),
            "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]
    if not repack:
        argv.append("--no-repack")
    return argv + list(extra)


def repack_attempts(policy: str) -> list[bool]:
    """The repack settings to try in order: auto tries with, then (after a crash) without."""
    if policy not in REPACK_POLICIES:
        raise ValueError(f"--llama-cpp-repack must be one of {REPACK_POLICIES}, got {policy!r}")
    return {"auto": [True, False], "on": [True], "off": [False]}[policy]


# How llama.cpp's AMX matmul has been seen to die on such a machine (SIGSEGV, or SIGILL when
# the tile instructions fault), and the other signals of a crash rather than of a stop.
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGILL, signal.SIGBUS, signal.SIGFPE, signal.SIGABRT)


def crash_signal(returncode: int | None) -> str | None:
    """The name of the signal a process crashed of (returncode -N), else None."""
    if returncode is None or returncode >= 0:
        return None
    for sig in CRASH_SIGNALS:
        if -returncode == sig:
            return sig.name
    return None


# llama-batched-bench's markdown header -> its JSON keys.
_MD_COLUMNS = {"PP": "pp", "TG": "tg", "B": "pl", "N_KV": "n_kv", "T_PP s": "t_pp",
               "S_PP t/s": "speed_pp", "T_TG s": "t_tg", "S_TG t/s": "speed_tg", "T s": "t",
               "S t/s": "speed"}
_INT_KEYS = ("pp", "tg", "pl", "n_kv")


def parse_batched_bench(text: str) -> list[dict[str, Any]]:
    """The result rows of llama-batched-bench's output: its JSON lines (--output-format jsonl),
    else its markdown table. Each row has pp, tg, pl (parallel sequences), n_kv, t_pp / t_tg /
    t (seconds) and speed_pp / speed_tg / speed (tokens/s: S_PP, S_TG, S)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and "speed_tg" in line:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows.append(obj)
    if rows:
        return rows
    header: list[str] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            if "S_TG t/s" in cells:
                header = [_MD_COLUMNS.get(c, c) for c in cells]
            continue
        if all(set(c) <= set("-: ") for c in cells):
            continue  # the |---|---| rule
        try:
            values = [float(c) for c in cells]
        except ValueError:
            continue
        row: dict[str, Any] = dict(zip(header, values))
        for key in _INT_KEYS:
            if key in row:
                row[key] = int(row[key])
        rows.append(row)
    return rows
