"""Multi-LoRA through the OpenAI server, end to end: a real `folio serve` of SmolLM2-135M
(float32, CPU) with peft-written adapters, driven by the openai client and plain HTTP.

One server (module-scoped) serves two adapters from --lora-modules, loads and unloads others
at run time (--allow-runtime-lora-updating inside an --allowed-lora-dir), and resolves unknown
names from a --lora-resolver-dir. An adapter's greedy answer is the offline engine's
(`LLM(..., enable_lora=True).generate(..., lora_request=...)`) for the same prompt. What needs
no model (the routes' absence without the flag, a bad --lora-modules failing the app's
start) runs in-process on a stand-in engine that holds the real adapter checker."""
from __future__ import annotations

import asyncio
import os
import shutil
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from lora_utils import ADAPTERS, make_adapter
from server_utils import RemoteServer

pytest.importorskip("peft")

API_KEY = "lora-key"
BASE = "smol"
PROMPT = "The capital of France is"
MAX_TOKENS = 12
MAX_MODEL_LEN = 256
# What the tests compare by name: --lora-modules' two, the run-time one, the resolver's.
STATIC = ("qv8", "mlp4")


@pytest.fixture(scope="module")
def dirs(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The adapters on disk, each written by peft once: the static ones (outside the
    allowed directory), a run-time one inside it, a copy of qv8 in the resolver directory,
    and the bad ones (rank 32 over --max-lora-rank 16, a malformed directory, a link that
    leads out of the allowed directory)."""
    root = tmp_path_factory.mktemp("lora_server")
    static, allowed, resolver = root / "static", root / "allowed", root / "resolver"
    for d in (static, allowed, resolver):
        d.mkdir()
    # std 0.1: strong enough that every adapter changes the greedy answer to PROMPT.
    paths = {name: make_adapter(smollm2_dir, str(static / name), seed=i + 1, std=0.1,
                                **ADAPTERS[name])
             for i, name in enumerate(STATIC)}
    paths["all16rs"] = make_adapter(smollm2_dir, str(allowed / "all16rs"), seed=3, std=0.1,
                                    **ADAPTERS["all16rs"])
    paths["rank32"] = make_adapter(smollm2_dir, str(allowed / "rank32"), seed=4, r=32,
                                   lora_alpha=32, target_modules=["q_proj"])
    malformed = allowed / "malformed"
    malformed.mkdir()
    (malformed / "adapter_config.json").write_text("{not json")
    paths["malformed"] = str(malformed)
    os.symlink(paths["qv8"], allowed / "escape")
    paths["escape"] = str(allowed / "escape")
    shutil.copytree(paths["qv8"], resolver / "found")
    shutil.copytree(malformed, resolver / "broken")
    paths.update(static=str(static), allowed=str(allowed), resolver=str(resolver))
    return paths


@pytest.fixture(scope="module")
def expected(smollm2_dir: str, dirs: dict[str, str]) -> dict[str | None, str]:
    """The offline engine's greedy text for PROMPT: the base model (None) and each adapter."""
    from folio import LLM, LoRARequest, SamplingParams

    llm = LLM(smollm2_dir, dtype="float32", quantization="none", device="cpu",
              max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=1 << 27, enable_lora=True,
              max_loras=2, max_lora_rank=16, distributed_executor_backend="uni")
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        names: list[str | None] = [None, *STATIC, "all16rs"]
        loras = [None if n is None else LoRARequest(n, i + 1, dirs[n])
                 for i, n in enumerate(names)]
        outs = llm.generate([PROMPT] * len(names), params, lora_request=loras, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    texts = {name: out.outputs[0].text for name, out in zip(names, outs)}
    # Each adapter changes the answer, or matching the offline engine would prove nothing.
    for name in names[1:]:
        assert texts[name] != texts[None], name
    return texts


@pytest.fixture(scope="module")
def server(smollm2_dir: str, dirs: dict[str, str], expected: Any) -> RemoteServer:
    # `expected` first: the offline engine is gone before the server takes its memory.
    args = [smollm2_dir, "--served-model-name", BASE, "--dtype", "float32",
            "--quantization", "none", "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
            "--num-gpu-blocks-override", "64", "--max-loras", "2", "--max-lora-rank", "16",
            "--lora-modules", *(f"{n}={dirs[n]}" for n in STATIC),
            "--allow-runtime-lora-updating", "--allowed-lora-dir", dirs["allowed"],
            "--lora-resolver-dir", dirs["resolver"]]
    with RemoteServer(args, api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


def _complete(client: openai.OpenAI, model: str) -> Any:
    return client.completions.create(model=model, prompt=PROMPT, temperature=0,
                                     max_tokens=MAX_TOKENS)


def _post(server: RemoteServer, path: str, body: dict, **kwargs: Any) -> httpx.Response:
    headers = kwargs.pop("headers", server.headers)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kwargs)


def _load(server: RemoteServer, name: Any, path: Any) -> httpx.Response:
    return _post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


def _unload(server: RemoteServer, name: Any) -> httpx.Response:
    return _post(server, "/v1/unload_lora_adapter", {"lora_name": name})


def _error(response: httpx.Response, status: int, type: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if type is not None:
        assert error["type"] == type, error
    return error["message"]


def _model_ids(client: openai.OpenAI) -> list[str]:
    return [m.id for m in client.models.list().data]


def _still_serving(client: openai.OpenAI, expected: dict[str | None, str]) -> None:
    assert _complete(client, BASE).choices[0].text == expected[None]


# ---- requests pick the adapter by `model` ---------------------------------------------


def test_models_lists_the_adapters_after_the_base_model(server, dirs):
    data = httpx.get(server.url + "/v1/models", headers=server.headers).json()["data"]
    base, *adapters = data
    assert [c["id"] for c in data][:3] == [BASE, *STATIC]
    assert base["parent"] is None and base["object"] == "model"
    for card, name in zip(adapters, STATIC):
        assert card["object"] == "model" and card["owned_by"] == base["owned_by"]
        assert card["root"] == dirs[name] and card["parent"] == BASE
        assert card["max_model_len"] == MAX_MODEL_LEN
        assert isinstance(card["created"], int)
        assert card["permission"][0]["object"] == "model_permission"


def test_each_adapter_answers_as_the_offline_engine(client, expected):
    for model in (BASE, *STATIC):
        reply = _complete(client, model)
        want = expected[None if model == BASE else model]
        assert reply.choices[0].text == want, model
        assert reply.model == model
    # Streamed and chat requests run the adapter too.
    chunks = client.completions.create(model="qv8", prompt=PROMPT, temperature=0,
                                       max_tokens=MAX_TOKENS, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["qv8"]
    messages = [{"role": "user", "content": "Hi"}]
    chat = {m: client.chat.completions.create(model=m, messages=messages, temperature=0,
                                              max_tokens=8) for m in (BASE, "qv8")}
    assert chat["qv8"].model == "qv8"
    assert chat["qv8"].choices[0].message.content != chat[BASE].choices[0].message.content


def test_unknown_model_is_vllms_404(server, client, expected):
    response = _post(server, "/v1/completions", {"model": "nope", "prompt": PROMPT,
                                                 "max_tokens": 1})
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "The model `nope` does not exist.",
                                         "type": "NotFoundError", "param": "model",
                                         "code": 404}}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user",
                                                                "content": "hi"}])
    _still_serving(client, expected)


# ---- run-time loading ------------------------------------------------------------------


def test_load_use_unload(server, client, dirs, expected):
    response = _load(server, "rt", dirs["all16rs"])
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'rt' added successfully."
    assert response.headers["content-type"].startswith("text/plain")
    assert "rt" in _model_ids(client)
    assert _complete(client, "rt").choices[0].text == expected["all16rs"]

    response = _unload(server, "rt")
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'rt' removed successfully."
    assert "rt" not in _model_ids(client)
    with pytest.raises(openai.NotFoundError):
        _complete(client, "rt")
    assert _error(_unload(server, "rt"), 404, "NotFoundError") == \
        "The lora adapter 'rt' cannot be found."

    # The name is free again: loaded anew (a fresh id), it runs the adapter again.
    assert _load(server, "rt", dirs["all16rs"]).status_code == 200
    assert _complete(client, "rt").choices[0].text == expected["all16rs"]
    assert _unload(server, "rt").status_code == 200


def test_a_running_request_finishes_after_its_adapter_is_unloaded(server, client, dirs,
                                                                  expected):
    assert _load(server, "brief", dirs["all16rs"]).status_code == 200
    # Long enough that the unload (after the first chunk) lands while it runs.
    max_tokens = 96

    async def run() -> tuple[str, str | None, int]:
        aclient = server.async_client()
        stream = await aclient.completions.create(
            model="brief", prompt=PROMPT, temperature=0, max_tokens=max_tokens, stream=True,
            extra_body={"ignore_eos": True})
        text, finish_reason, unloaded = "", None, 0
        async for chunk in stream:
            if not unloaded:
                async with httpx.AsyncClient() as http:
                    unloaded = (await http.post(server.url + "/v1/unload_lora_adapter",
                                                json={"lora_name": "brief"},
                                                headers=server.headers)).status_code
            if chunk.choices:
                text += chunk.choices[0].text
                finish_reason = chunk.choices[0].finish_reason or finish_reason
        await aclient.close()
        return text, finish_reason, unloaded

    text, finish_reason, unloaded = asyncio.run(run())
    assert unloaded == 200
    assert finish_reason == "length" and text.startswith(expected["all16rs"])
    with pytest.raises(openai.NotFoundError):
        _complete(client, "brief")


@pytest.mark.parametrize("body, message", [
    ({"lora_path": "/x"}, "Both 'lora_name' and 'lora_path' must be provided."),
    ({"lora_name": "x"}, "Both 'lora_name' and 'lora_path' must be provided."),
    ({"lora_name": "", "lora_path": "/x"}, "Both 'lora_name' and 'lora_path' must be provided."),
    ({"lora_name": "qv8", "lora_path": "/x"}, "The lora adapter 'qv8' has already been loaded."),
    ({"lora_name": BASE, "lora_path": "/x"}, f"The lora adapter '{BASE}' has already been loaded."),
])
def test_load_refuses_a_bad_request(server, body, message):
    assert _error(_post(server, "/v1/load_lora_adapter", body), 400, "InvalidUserInput") \
        == message


def test_load_refuses_bad_adapters(server, client, dirs, expected):
    # Outside the allowed directory: by path, and through a link inside it.
    for path in (dirs["qv8"], dirs["escape"]):
        assert "--allowed-lora-dir" in _error(_load(server, "out", path), 400)
    assert "max_lora_rank (16)" in _error(_load(server, "big", dirs["rank32"]), 400)
    assert "adapter_config.json is not valid JSON" in \
        _error(_load(server, "bad", dirs["malformed"]), 400)
    missing = os.path.join(dirs["allowed"], "missing")
    assert "No adapter found" in _error(_load(server, "gone", missing), 404, "NotFoundError")
    # A wrong type is the usual validation 400; unload needs a name.
    assert _post(server, "/v1/load_lora_adapter",
                 {"lora_name": 3, "lora_path": "/x"}).status_code == 400
    assert _error(_unload(server, ""), 400) == \
        "'lora_name' needs to be provided to unload a LoRA adapter."
    # Nothing was registered, and the server goes on.
    assert not {"out", "big", "bad", "gone"} & set(_model_ids(client))
    _still_serving(client, expected)
    assert _complete(client, "qv8").choices[0].text == expected["qv8"]


def test_load_routes_need_the_api_key(server, dirs):
    body = {"lora_name": "k", "lora_path": dirs["all16rs"]}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            _error(_post(server, path, body, headers=headers), 401)
    assert "k" not in [c["id"] for c in httpx.get(
        server.url + "/v1/models", headers=server.headers).json()["data"]]


# ---- --lora-resolver-dir ---------------------------------------------------------------


def test_resolver_dir_loads_unknown_names(server, client, dirs, expected):
    reply = _complete(client, "found")  # resolver/found: a copy of qv8
    assert reply.choices[0].text == expected["qv8"] and reply.model == "found"
    card = next(c for c in client.models.list().data if c.id == "found")
    assert card.root == os.path.join(dirs["resolver"], "found") and card.parent == BASE
    # Only one plain name below the directory is looked up.
    for name in ("../static/qv8", "found/", "..", "missing", "/" + dirs["qv8"]):
        with pytest.raises(openai.NotFoundError):
            _complete(client, name)
    # Found but not servable: 400 with the reason.
    message = _error(_post(server, "/v1/completions", {"model": "broken", "prompt": PROMPT,
                                                       "max_tokens": 1}), 400)
    assert "'broken' was found but could not be loaded" in message
    _still_serving(client, expected)


# ---- metrics ---------------------------------------------------------------------------


def test_lora_metrics(server, client):
    _complete(client, "mlp4")
    text = httpx.get(server.url + "/metrics", headers=server.headers).text
    info = [line for line in text.splitlines() if line.startswith("folio:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0]
    assert 'running_lora_adapters="' in info[0] and 'waiting_lora_adapters="' in info[0]
    assert float(info[0].rsplit(" ", 1)[1]) > 1e9  # a timestamp, as vLLM's
    counts = {line.split('lora_name="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line.startswith("folio:lora_requests_total{")}
    assert counts["mlp4"] >= 1 and counts["qv8"] >= 1
    assert BASE not in counts


# ---- in-process: the app around a stand-in engine with the real adapter checks ---------


class _StandInEngine:
    """Enough of AsyncLLM for build_app: the real LoRAChecker of SmolLM2's architecture."""

    is_healthy = True
    errored = None
    max_model_len = MAX_MODEL_LEN
    tokenizer = None

    def __init__(self, model_dir: str, lora: Any) -> None:
        from transformers import AutoConfig

        from folio.engine.lora_checks import LoRAChecker
        self.config = SimpleNamespace(lora=lora)
        self.preparer = SimpleNamespace(lora=LoRAChecker(lora,
                                                         AutoConfig.from_pretrained(model_dir)))
        self.model_info = SimpleNamespace(source=SimpleNamespace(path=model_dir),
                                          vocab_size=49152, pooling=None)
        self.removed: list[int] = []

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True

    def shutdown(self) -> None:
        pass


def _app(engine: Any, **settings: Any) -> Any:
    from folio.entrypoints.openai.api_server import ServerSettings, build_app
    return build_app(engine, ServerSettings(served_model_names=[BASE], **settings))


def _request(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.request(method, path, **kwargs)
    return asyncio.run(run())


def test_load_routes_absent_without_the_flag(smollm2_dir, dirs):
    from folio.config import LoRAConfig
    app = _app(_StandInEngine(smollm2_dir, LoRAConfig(lora_modules=[("qv8", dirs["qv8"])])))
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        response = _request(app, "POST", path, json={"lora_name": "qv8",
                                                     "lora_path": dirs["qv8"]})
        _error(response, 404, "NotFoundError")
    ids = [c["id"] for c in _request(app, "GET", "/v1/models").json()["data"]]
    assert ids == [BASE, "qv8"]


def test_unload_has_the_engine_free_the_adapter(smollm2_dir, dirs):
    """/v1/unload_lora_adapter hands the adapter's id to the engine's remove_lora, which
    frees the worker's copies (tests/lora/test_lora_offline.py); the real server's
    test_load_use_unload runs it through the engine-core process."""
    from folio.config import LoRAConfig
    engine = _StandInEngine(smollm2_dir, LoRAConfig(allow_runtime_lora_updating=True,
                                                    allowed_lora_dirs=[dirs["allowed"]]))
    app = _app(engine)
    for name in ("one", "two"):
        response = _request(app, "POST", "/v1/load_lora_adapter",
                            json={"lora_name": name, "lora_path": dirs["all16rs"]})
        assert response.status_code == 200, response.text
    assert _request(app, "POST", "/v1/unload_lora_adapter",
                    json={"lora_name": "two"}).status_code == 200
    assert engine.removed == [2]
    _error(_request(app, "POST", "/v1/unload_lora_adapter", json={"lora_name": "two"}), 404)
    assert engine.removed == [2]


@pytest.mark.parametrize("module, reason", [
    ("malformed", "not valid JSON"), ("rank32", "max_lora_rank"),
    ("missing", "no such directory")])
def test_a_bad_lora_module_fails_the_start(smollm2_dir, dirs, module, reason):
    from folio.config import LoRAConfig
    path = dirs.get(module, os.path.join(dirs["allowed"], module))
    engine = _StandInEngine(smollm2_dir, LoRAConfig(lora_modules=[("qv8", dirs["qv8"]),
                                                                  (module, path)]))
    with pytest.raises(ValueError, match=f"--lora-modules {module}=") as info:
        _app(engine)
    assert reason in str(info.value)


def test_a_lora_module_named_as_the_base_model_fails_the_start(smollm2_dir, dirs):
    from folio.config import LoRAConfig
    engine = _StandInEngine(smollm2_dir, LoRAConfig(lora_modules=[(BASE, dirs["qv8"])]))
    with pytest.raises(ValueError, match="has already been loaded"):
        _app(engine)


def test_lora_serving_flags_need_lora_on(smollm2_dir, tmp_path):
    from folio.entrypoints.cli import build_parser
    from folio.entrypoints.openai.api_server import serve
    for flags in (["--allow-runtime-lora-updating"], ["--lora-resolver-dir", str(tmp_path)]):
        args = build_parser().parse_args(["serve", smollm2_dir, *flags])
        with pytest.raises(ValueError, match=f"{flags[0]}: LoRA is off"):
            serve(args)  # refused before the engine starts
    args = build_parser().parse_args(["serve", smollm2_dir, "--enable-lora",
                                      "--lora-resolver-dir", str(tmp_path / "none")])
    with pytest.raises(ValueError, match="--lora-resolver-dir .*: no such directory"):
        serve(args)


def test_lora_metric_labels_stay_bounded():
    from folio.core.engine_core_outputs import SchedulerStats
    from folio.metrics.prometheus import LORA_OTHER, MAX_LORA_NAME_LABELS, EngineMetrics

    def lines(m: EngineMetrics, name: str) -> list[str]:
        return [line for line in m.render().decode().splitlines()
                if line.startswith(name + "{")]

    assert "lora" not in EngineMetrics(BASE, MAX_MODEL_LEN).render().decode()  # LoRA off
    m = EngineMetrics(BASE, MAX_MODEL_LEN, max_lora=2)
    for i in range(MAX_LORA_NAME_LABELS + 5):
        m.lora_request(f"a{i}")
    m.lora_request("a0")
    counts = {line.split('lora_name="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in lines(m, "folio:lora_requests_total")}
    assert len(counts) == MAX_LORA_NAME_LABELS + 1
    assert counts[LORA_OTHER] == 5 and counts["a0"] == 2
    # The info gauge keeps one series: the latest mix of adapters.
    for running, waiting in ((["a", "b"], ["c"]), (["b"], []), (["b"], [])):
        m.observe_scheduler_stats(SchedulerStats(running_lora_adapters=running,
                                                 waiting_lora_adapters=waiting, max_lora=2))
    [info] = lines(m, "folio:lora_requests_info")
    assert 'running_lora_adapters="b"' in info and 'waiting_lora_adapters=""' in info


@pytest.mark.parametrize("name, ok", [
    ("found", True), ("my-adapter_v2.1", True), ("..", False), ("a..b", False),
    (".", False), ("a/b", False), ("/abs", False), ("", False), ("x" * 256, False),
    ("nul\x00", False)])
def test_resolvable_names(name, ok):
    from folio.entrypoints.openai.serving_models import resolvable_name
    assert resolvable_name(name) is ok
