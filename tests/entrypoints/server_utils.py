"""Start a real `folio serve` on a free loopback port, for tests."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(self, args: list[str], *, api_key: str | None = None, timeout_s: float = 240) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "folio.entrypoints.cli", "serve", *args,
               "--port", str(self.port)]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = f"/tmp/folio-test-server-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                             max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        import openai
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                                  max_retries=0, **kwargs)

    def stop(self, sig_timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(sig_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "RemoteServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def qwen3_chat_template_file(directory) -> str:
    """The real Qwen3 chat template (tools, tool results, the thinking switch; fetched by
    fixtures_tokenizers) written to `directory`, for a server's --chat-template: the default
    model's own template has no tool calls."""
    import json
    from pathlib import Path

    from fixtures_tokenizers import tokenizer_dir
    config = json.loads((Path(tokenizer_dir("qwen3")) / "tokenizer_config.json").read_text())
    template = Path(directory) / "qwen3_chat_template.jinja"
    template.write_text(config["chat_template"], encoding="utf-8")
    return str(template)
