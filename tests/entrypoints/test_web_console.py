"""The web console in a real headless browser: playwright drives the system's chromium
(Debian's `chromium` package; `make test` installs it, see README) against a real
`folio serve` with an API key, logged in with HTTP Basic like a person would be.

- the chat playground streams the answer /v1/chat/completions gives the openai SDK for the
  same request, and JSON mode answers JSON;
- the dashboard's counters move while a load runs;
- the page routes challenge a browser without credentials, the stats endpoint needs the key,
  the static files carry their types.

No timing assertions: every wait is for a condition in the page, with generous timeouts.
The server runs with OMP_NUM_THREADS=1 (see test_structured_server.py).
"""
from __future__ import annotations

import base64
import concurrent.futures
import json
import shutil
import threading

import httpx
import pytest

from server_utils import RemoteServer

sync_api = pytest.importorskip("playwright.sync_api")

API_KEY = "sk-console-test"
MODEL = "SmolLM2-135M-Instruct"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WAIT_MS = 120_000  # a busy 2-core machine: conditions, not speed, are what is tested

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs the system's chromium (apt-get install chromium; "
                             "`make setup` installs it when run as root)")


@pytest.fixture(scope="module")
def server():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        srv = RemoteServer(["--max-model-len", "2048", "--num-gpu-blocks-override", "256",
                            "--dtype", "float32", "--max-num-seqs", "16"], api_key=API_KEY)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: chromium's sandbox refuses to run as root (CI machines do).
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser, server):
    """A logged-in console page; fails the test on any script error or CSP violation."""
    context = browser.new_context(http_credentials={"username": "tester",
                                                    "password": API_KEY})
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}")
            if m.type == "error" else None)
    page.goto(server.url + "/")
    page.wait_for_selector("body[data-ready=true]")
    yield page
    context.close()
    assert not errors, errors


def _ask(page, text: str) -> dict:
    """Send a message from the composer; wait for the answer to end; its text and state."""
    before = page.locator(".message.assistant").count()
    page.fill("#prompt", text)
    page.click("#send")
    answer = page.locator(".message.assistant").nth(before)
    page.wait_for_function("(n) => document.querySelectorAll('.message.assistant')[n]"
                           "?.dataset.state !== 'streaming'", arg=before)
    return {"state": answer.get_attribute("data-state"),
            "content": answer.locator(".content").text_content(),
            "chunks": int(answer.get_attribute("data-chunks")),
            "json": answer.get_attribute("data-json"),
            "meta": answer.locator(".meta").text_content()}


def test_chat_streams_what_the_api_answers(page, server):
    question = "What is the capital of France?"
    expected = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0,
        top_p=1, max_tokens=64).choices[0].message.content
    assert page.locator("#model option").all_text_contents() == [MODEL]
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "64")
    answer = _ask(page, question)
    assert answer["state"] == "done", answer
    assert answer["content"] == expected
    assert answer["chunks"] > 1  # it arrived in pieces: streamed, not at once
    assert "finish: stop" in answer["meta"]


def test_json_mode_answers_json(page):
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "128")
    page.check("#json-mode")
    answer = _ask(page, "Give me a JSON object describing a cat with a name and an age.")
    assert answer["state"] == "done" and answer["json"] == "valid", answer
    assert isinstance(json.loads(answer["content"]), dict)


def test_stop_ends_the_stream(page, server):
    page.fill("#max-tokens", "1500")
    page.fill("#prompt", "Write a very long story about a dragon and a lighthouse.")
    page.click("#send")
    page.wait_for_function("() => Number(document.querySelector('.message.assistant')"
                           "?.dataset.chunks) >= 3")
    page.click("#stop")
    page.wait_for_selector(".message.assistant[data-state=stopped]")
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    # The server aborts the request once the browser hangs up.
    page.goto(server.url + "/#dashboard")
    page.wait_for_function("() => document.getElementById('stat-open').dataset.value === '0'")


def _value(page, element_id: str) -> float:
    return float(page.get_attribute(f"#{element_id}", "data-value") or "nan")


def test_dashboard_counters_move_under_load(page, server):
    page.goto(server.url + "/#dashboard")
    page.wait_for_function("() => document.getElementById('stat-finished').dataset.value")
    finished0 = _value(page, "stat-finished")
    generated0 = _value(page, "stat-gen-total")
    # enough to be seen running, little enough for a slow 2-core CPU (160 tokens a request
    # outran the 120 s wait on one without native bfloat16)
    requests, tokens = 8, 48
    done = threading.Event()

    def load() -> None:
        client = server.client(timeout=600)

        def one(i: int) -> None:
            client.completions.create(model=MODEL, prompt=f"Count to {i + 10}:",
                                      max_tokens=tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
        try:
            with concurrent.futures.ThreadPoolExecutor(requests) as pool:
                list(pool.map(one, range(requests)))
        finally:
            done.set()

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        # Seen while the load runs: requests in the batch, tokens coming out.
        page.wait_for_function("() => Number(document.getElementById('stat-running')"
                               ".dataset.value) > 0")
        page.wait_for_function("() => Number(document.getElementById('stat-gen-tps')"
                               ".dataset.value) > 0")
        # And once it is over, every request and token counted.
        page.wait_for_function(
            "([f, g]) => Number(document.getElementById('stat-finished').dataset.value) >= f"
            " && Number(document.getElementById('stat-gen-total').dataset.value) >= g",
            arg=[finished0 + requests, generated0 + requests * tokens])
        page.wait_for_function("() => document.getElementById('stat-running')"
                               ".dataset.value === '0'")
    finally:
        worker.join(timeout=600)
    assert done.is_set()
    ttft_count = page.locator("#lat-ttft-total .n").text_content().replace(",", "")
    assert int(ttft_count) >= requests
    assert page.locator("#lat-itl-total .p50").text_content().endswith("ms")


def test_page_auth_stats_and_static_types(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith('Basic realm="folio"')
    login = base64.b64encode(f"anyone:{API_KEY}".encode()).decode()
    r = httpx.get(server.url + "/", headers={"Authorization": f"Basic {login}"})
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    types = {"console.css": "text/css", "app.js": "text/javascript",
             "favicon.svg": "image/svg+xml"}
    for name, media_type in types.items():
        r = httpx.get(f"{server.url}/console/{name}", headers=server.headers)
        assert r.status_code == 200 and r.headers["content-type"].startswith(media_type)
    assert httpx.get(server.url + "/v1/console/stats").status_code == 401
    r = httpx.get(server.url + "/v1/console/stats", headers=server.headers)
    assert r.status_code == 200 and r.json()["model"] == MODEL
    assert set(r.json()["requests"]) >= {"running", "waiting", "finished"}
