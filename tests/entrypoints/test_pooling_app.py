"""The pooling routes of the app (/v1/embeddings, /pooling, /classify, /score, /rerank) around
a stand-in engine whose `encode` keeps AsyncLLM.encode's contract (PoolingParams checked
against the model, a ValueError naming `prompt` for a long input, cancellation aborts), driven
in-process by httpx and the official openai client. No model: the shapes, the pairing, the
concurrency and every 400 are the server's own."""
from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest

from folio.config import RequestLimitsConfig
from folio.engine.async_llm import EngineDeadError
from folio.engine.frontend import check_pooling_params
from folio.entrypoints.openai.api_server import ServerSettings, build_app
from folio.pooling_params import PoolingModelInfo, PoolingParams, PoolingType
from folio.request_outputs import PoolingOutput, PoolingRequestOutput

API_KEY = "key-1"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
EMBED = PoolingModelInfo(kind="embed", architecture="BertModel", pooling_type=PoolingType.MEAN,
                         is_causal=False, hidden_size=26)
MATRYOSHKA = PoolingModelInfo(kind="embed", architecture="BertModel",
                              pooling_type=PoolingType.MEAN, is_causal=False, hidden_size=26,
                              matryoshka_dimensions=())
CLASSIFY = PoolingModelInfo(kind="classify", architecture="BertForSequenceClassification",
                            pooling_type=PoolingType.CLS, is_causal=False, normalize=False,
                            num_labels=3, labels=("short", "medium", "long"))
CROSS_ENCODER = PoolingModelInfo(kind="classify", architecture="BertForSequenceClassification",
                                 pooling_type=PoolingType.CLS, is_causal=False, normalize=False,
                                 num_labels=1, activation="sigmoid", labels=("LABEL_0",))


def _tokens(text: str) -> list[int]:
    """[CLS] one id per word [SEP]."""
    return [101, *(sum(map(ord, w)) % 1000 for w in text.split()), 102]


def _letters(text: str) -> np.ndarray:
    return np.array([text.lower().count(chr(97 + i)) for i in range(26)], dtype=np.float32)


class FakePoolingEngine:
    """What build_app and the pooling handlers use of AsyncLLM. An "embedding" is the text's
    letter counts; a class is picked by word count; a cross-encoder scores shared words."""

    is_healthy = True
    errored = None
    tokenizer = None

    def __init__(self, pooling: PoolingModelInfo | None, *, max_model_len: int = 12,
                 max_pooling_inputs: int = 8, delay_s: float = 0.01) -> None:
        self.model_info = SimpleNamespace(source=SimpleNamespace(path="/models/x"),
                                          vocab_size=1000, pooling=pooling)
        self.max_model_len = max_model_len
        self.config = SimpleNamespace(limits=RequestLimitsConfig(
            max_pooling_inputs=max_pooling_inputs))
        self.delay_s = delay_s
        self.calls: list[dict[str, Any]] = []
        self.cancelled: list[str] = []
        self.in_flight = self.max_in_flight = 0
        self.fail_with: BaseException | None = None
        self.no_result = False

    async def run_blocking(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def shutdown(self) -> None:
        pass

    async def encode(self, prompt: Any, params: PoolingParams, request_id: str | None = None,
                     *, pair: str | None = None, priority: int = 0) -> PoolingRequestOutput:
        if not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must be a 64-bit signed int, got {priority!r}")
        params = check_pooling_params(params, self.model_info.pooling)
        if self.fail_with is not None:
            raise self.fail_with
        if isinstance(prompt, list):
            if not all(0 <= t < 1000 for t in prompt):
                raise ValueError("prompt_token_ids has ids outside the vocabulary [0, 1000)")
            ids = list(prompt)
        else:
            ids = _tokens(prompt) + (_tokens(pair)[1:] if pair is not None else [])
        if params.truncate_prompt_tokens is not None:
            ids = ids[:self.max_model_len if params.truncate_prompt_tokens == -1
                      else params.truncate_prompt_tokens]
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than the model's maximum "
                             f"input length of {self.max_model_len} (max_model_len); set "
                             "truncate_prompt_tokens to cut it")
        self.calls.append({"prompt": prompt, "pair": pair, "params": params,
                           "request_id": request_id, "priority": priority})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        finally:
            self.in_flight -= 1
        if self.no_result:
            return PoolingRequestOutput(request_id, None, ids, True, finish_reason="error")
        return PoolingRequestOutput(request_id, PoolingOutput(self._result(prompt, pair, params)),
                                    ids, True, finish_reason="stop", task=params.task)

    def _result(self, prompt: Any, pair: str | None, params: PoolingParams) -> np.ndarray:
        text = prompt if isinstance(prompt, str) else " ".join(chr(97 + t % 26) for t in prompt)
        if params.task == "embed":
            vector = _letters(text)[:params.dimensions]
            return vector / np.linalg.norm(vector) if params.normalize is not False else vector
        if params.task == "classify":
            logits = np.array([3.0, 2.0, 1.0]) if len(text.split()) < 3 else np.array(
                [1.0, 2.0, 3.0])
            return (np.exp(logits) / np.exp(logits).sum()).astype(np.float32)
        if params.task == "score":
            shared = len(set(text.split()) & set(pair.split()))
            return np.array([1 / (1 + math.exp(1 - shared))], dtype=np.float32)
        return np.stack([_letters(w) for w in text.split()])  # "encode": per word, raw


def _app(engine: FakePoolingEngine, api_key: str | None = API_KEY):
    return build_app(engine, ServerSettings(served_model_names=["m"], api_key=api_key))


def _post(app, path: str, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, headers=headers)
    return asyncio.run(run())


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.fixture
def embed_engine() -> FakePoolingEngine:
    return FakePoolingEngine(EMBED)


# ---- /v1/embeddings -------------------------------------------------------------------


def test_embeddings_float(embed_engine):
    r = _post(_app(embed_engine), "/v1/embeddings",
              {"model": "m", "input": ["a cat", "the dog", "ab ab"], "user": "u-1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "m"
    assert body["id"].startswith("embd-") and isinstance(body["created"], int)
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", i) for i in range(3)]
    for item, text in zip(body["data"], ["a cat", "the dog", "ab ab"]):
        expected = _letters(text) / np.linalg.norm(_letters(text))
        np.testing.assert_allclose(item["embedding"], expected, rtol=1e-6)
    tokens = sum(len(_tokens(t)) for t in ["a cat", "the dog", "ab ab"])
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # one engine request per input, all with the embed task
    assert [c["params"].task for c in embed_engine.calls] == ["embed"] * 3
    assert len({c["request_id"] for c in embed_engine.calls}) == 3


def test_embeddings_with_the_openai_client_base64_and_float(embed_engine):
    openai = pytest.importorskip("openai")
    app = _app(embed_engine)

    async def run():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key=API_KEY,
                                    http_client=http, max_retries=0)
        # The client asks for base64 unless told otherwise, and decodes it itself.
        default = await client.embeddings.create(model="m", input=["hello world", "cat"])
        floats = await client.embeddings.create(model="m", input=["hello world", "cat"],
                                                encoding_format="float")
        await http.aclose()
        return default, floats

    default, floats = asyncio.run(run())
    assert [d.index for d in default.data] == [0, 1]
    for a, b in zip(default.data, floats.data):
        np.testing.assert_array_equal(np.asarray(a.embedding, dtype=np.float32),
                                      np.asarray(b.embedding, dtype=np.float32))
    assert default.usage.prompt_tokens == default.usage.total_tokens == 4 + 3


@pytest.mark.parametrize("inputs, count", [("one text", 1), ([5, 6, 7], 1),
                                           ([[5, 6], [7, 8, 9]], 2), (["a", "b c"], 2)])
def test_embeddings_input_forms(embed_engine, inputs, count):
    r = _post(_app(embed_engine), "/v1/embeddings", {"input": inputs})
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == count == len(embed_engine.calls)


def test_embeddings_run_concurrently(embed_engine):
    embed_engine.delay_s = 0.05
    r = _post(_app(embed_engine), "/v1/embeddings", {"input": ["a", "b", "c", "d", "e"]})
    assert r.status_code == 200
    assert embed_engine.max_in_flight == 5


def test_embeddings_dimensions(embed_engine):
    error = _error(_post(_app(embed_engine), "/v1/embeddings", {"input": "a", "dimensions": 8}))
    assert error["param"] == "dimensions" and "Matryoshka" in error["message"]
    assert embed_engine.calls == []  # refused before any input ran
    # the full size is always allowed; a Matryoshka model shortens
    assert _post(_app(embed_engine), "/v1/embeddings",
                 {"input": "a", "dimensions": 26}).status_code == 200
    r = _post(_app(FakePoolingEngine(MATRYOSHKA)), "/v1/embeddings",
              {"input": "abc", "dimensions": 8, "normalize": False})
    assert r.json()["data"][0]["embedding"] == [1.0, 1.0, 1.0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": ["a"] * 9}, "input"),                                   # --max-pooling-inputs 8
    ({"input": ["a", "one two three four five six seven eight nine ten eleven"]}, "input"),
    ({"input": [1, 2, 5000]}, "input"),                                # outside the vocabulary
    ({"input": "a", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": 1 << 20}, "dimensions"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": [["a"]]}, "input"),
    ({"input": "a", "priority": 1 << 70}, "priority"),
    ({}, "input"),
])
def test_embeddings_errors_name_the_field(embed_engine, body, param):
    error = _error(_post(_app(embed_engine), "/v1/embeddings", body))
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_too_many_inputs_names_the_flag(embed_engine):
    error = _error(_post(_app(embed_engine), "/v1/embeddings", {"input": ["a"] * 9}))
    assert "at most 8" in error["message"] and "--max-pooling-inputs" in error["message"]


def test_long_input_is_refused_unless_truncated(embed_engine):
    long_text = " ".join(["word"] * 30)
    error = _error(_post(_app(embed_engine), "/v1/embeddings", {"input": long_text}))
    assert "truncate_prompt_tokens" in error["message"] and error["param"] == "input"
    r = _post(_app(embed_engine), "/v1/embeddings",
              {"input": long_text, "truncate_prompt_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5
    r = _post(_app(embed_engine), "/v1/embeddings",
              {"input": long_text, "truncate_prompt_tokens": -1})
    assert r.json()["usage"]["prompt_tokens"] == 12


def test_first_error_aborts_the_other_inputs(embed_engine):
    embed_engine.delay_s = 5.0
    long_text = " ".join(["word"] * 30)
    r = _post(_app(embed_engine), "/v1/embeddings", {"input": ["a", "b", long_text]})
    assert _error(r)["param"] == "input"
    assert sorted(embed_engine.cancelled) == sorted(c["request_id"] for c in embed_engine.calls)
    assert len(embed_engine.cancelled) == 2


def test_unknown_model_is_404(embed_engine):
    error = _error(_post(_app(embed_engine), "/v1/embeddings", {"model": "x", "input": "a"}), 404)
    assert error["param"] == "model"


def test_engine_errors():
    engine = FakePoolingEngine(EMBED)
    engine.fail_with = EngineDeadError("the engine core exited")
    assert _post(_app(engine), "/v1/embeddings", {"input": "a"}).status_code == 503
    engine = FakePoolingEngine(EMBED)
    engine.no_result = True
    error = _error(_post(_app(engine), "/v1/embeddings", {"input": ["a", "b"]}), 500)
    assert "without a result" in error["message"]


# ---- runners, auth, models, OpenAPI ---------------------------------------------------


ROUTES = [("/v1/embeddings", {"input": "a"}), ("/pooling", {"input": "a"}),
          ("/classify", {"input": "a"}), ("/score", {"text_1": "a", "text_2": "b"}),
          ("/v1/score", {"text_1": "a", "text_2": "b"}),
          ("/rerank", {"query": "a", "documents": ["b"]}),
          ("/v1/rerank", {"query": "a", "documents": ["b"]}),
          ("/v2/rerank", {"query": "a", "documents": ["b"]})]


@pytest.mark.parametrize("path, body", ROUTES)
def test_pooling_routes_on_a_generate_model(path, body):
    error = _error(_post(_app(FakePoolingEngine(None)), path, body))
    assert "generate runner" in error["message"] and error["param"] == "model"


@pytest.mark.parametrize("path, body", ROUTES)
def test_api_key_guards_the_pooling_routes(embed_engine, path, body):
    _error(_post(_app(embed_engine), path, body, headers=None), 401)
    _error(_post(_app(embed_engine), path, body, headers={"Authorization": "Bearer no"}), 401)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"})])
def test_generation_routes_on_a_pooling_model(embed_engine, path, body):
    error = _error(_post(_app(embed_engine), path, body))
    assert "pooling runner" in error["message"] and "/v1/embeddings" in error["message"]


def test_models_and_openapi(embed_engine):
    app = _app(embed_engine, api_key=None)

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.get("/v1/models")).json(), \
                (await client.get("/openapi.json")).json()

    models, spec = asyncio.run(run())
    assert [m["id"] for m in models["data"]] == ["m"]
    for path, model in [("/v1/embeddings", "EmbeddingRequest"), ("/pooling", "PoolingRequest"),
                        ("/classify", "ClassificationRequest"), ("/score", "ScoreRequest"),
                        ("/v1/score", "ScoreRequest"), ("/rerank", "RerankRequest"),
                        ("/v1/rerank", "RerankRequest"), ("/v2/rerank", "RerankRequest")]:
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert schema["schema"]["$ref"].endswith("/" + model), path
        assert model in spec["components"]["schemas"]
    assert "input" in spec["components"]["schemas"]["EmbeddingRequest"]["properties"]


# ---- /pooling, /classify ------------------------------------------------------------


def test_pooling_raw_per_token_default_and_task():
    engine = FakePoolingEngine(EMBED)
    body = _post(_app(engine), "/pooling", {"input": "ab c"}).json()
    assert body["id"].startswith("pool-") and body["object"] == "list"
    assert body["data"][0]["object"] == "pooling"
    assert np.asarray(body["data"][0]["data"]).shape == (2, 26)  # the "encode" task's matrix
    assert engine.calls[0]["params"].task == "encode"
    body = _post(_app(engine), "/pooling", {"input": "ab c", "task": "embed"}).json()
    assert len(body["data"][0]["data"]) == 26
    error = _error(_post(_app(engine), "/pooling", {"input": "a", "task": "classify"}))
    assert error["param"] == "task" and "not supported" in error["message"]
    assert _error(_post(_app(engine), "/pooling", {"input": "a", "task": "nope"}))["param"] \
        == "task"


def test_classify():
    engine = FakePoolingEngine(CLASSIFY)
    body = _post(_app(engine), "/classify",
                 {"model": "m", "input": ["hi", "one two three four"]}).json()
    assert body["id"].startswith("classify-") and body["object"] == "list"
    assert [(d["index"], d["label"], d["num_classes"]) for d in body["data"]] == [
        (0, "short", 3), (1, "long", 3)]
    assert sum(body["data"][0]["probs"]) == pytest.approx(1.0, abs=1e-6)
    assert body["usage"]["prompt_tokens"] == 3 + 6
    assert _error(_post(_app(engine), "/classify", {"input": []}))["param"] == "input"
    # an embedding model has no classifier; a classifier gives no embeddings
    assert _error(_post(_app(FakePoolingEngine(EMBED)), "/classify",
                        {"input": "a"}))["param"] == "model"
    assert _error(_post(_app(engine), "/v1/embeddings", {"input": "a"}))["param"] == "model"


# ---- /score, /rerank ----------------------------------------------------------------


def _cos(a: str, b: str) -> float:
    x, y = _letters(a).astype(np.float64), _letters(b).astype(np.float64)
    return float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))


def test_score_embedding_model_one_to_many():
    engine = FakePoolingEngine(EMBED)
    docs = ["a cat", "dog", "a cat", "cab"]
    body = _post(_app(engine), "/score", {"text_1": "cat", "text_2": docs}).json()
    assert body["id"].startswith("score-") and body["object"] == "list"
    assert [d["object"] for d in body["data"]] == ["score"] * 4
    assert [d["score"] for d in body["data"]] == pytest.approx([_cos("cat", d) for d in docs],
                                                               abs=1e-6)
    # each distinct text embedded once
    assert sorted(c["prompt"] for c in engine.calls) == ["a cat", "cab", "cat", "dog"]
    assert body["usage"]["prompt_tokens"] == sum(len(_tokens(t))
                                                 for t in ["cat", "a cat", "dog", "cab"])


def test_score_one_to_one_and_newer_names():
    engine = FakePoolingEngine(EMBED)
    body = _post(_app(engine), "/v1/score",
                 {"queries": ["cat", "dog"], "documents": ["act", "god"]}).json()
    assert [d["score"] for d in body["data"]] == pytest.approx([1.0, 1.0], abs=1e-6)


@pytest.mark.parametrize("body, param", [
    ({"text_1": "a", "text_2": []}, "text_2"),
    ({"text_1": [], "text_2": "a"}, "text_1"),
    ({"text_2": "a"}, "text_1"),
    ({"text_1": "a"}, "text_2"),
    ({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ({"text_1": "a", "text_2": ["b"] * 9}, "text_2"),
    ({"text_1": "a", "queries": "a", "text_2": "b"}, "queries"),
    ({"queries": "a", "documents": []}, "documents"),
    ({"text_1": "a", "text_2": " ".join(["w"] * 20)}, "text_2"),
    ({"text_1": " ".join(["w"] * 20), "text_2": "b"}, "text_1"),
    ({"text_1": "a", "text_2": 5}, "text_2"),
])
def test_score_errors_name_the_field(body, param):
    error = _error(_post(_app(FakePoolingEngine(EMBED)), "/score", body))
    assert error["param"] == param, error


def test_score_cross_encoder_reads_each_pair():
    engine = FakePoolingEngine(CROSS_ENCODER)
    body = _post(_app(engine), "/score",
                 {"text_1": "the cat sat", "text_2": ["the cat", "a dog", "sat"]}).json()
    expected = [1 / (1 + math.exp(1 - shared)) for shared in (2, 0, 1)]
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-6)
    assert [(c["prompt"], c["pair"], c["params"].task) for c in engine.calls] == [
        ("the cat sat", "the cat", "score"), ("the cat sat", "a dog", "score"),
        ("the cat sat", "sat", "score")]
    # a pair too long together: named by the document side
    error = _error(_post(_app(engine), "/score",
                         {"text_1": "a b c d e", "text_2": "f g h i j k"}))
    assert error["param"] == "text_2"
    # a classifier of several labels gives no scores
    assert _error(_post(_app(FakePoolingEngine(CLASSIFY)), "/score",
                        {"text_1": "a", "text_2": "b"}))["param"] == "model"


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_cross_encoder(path):
    engine = FakePoolingEngine(CROSS_ENCODER)
    docs = ["a dog", "the cat sat", {"text": "the cat"}]
    body = _post(_app(engine), path, {"model": "m", "query": "the cat sat",
                                      "documents": docs}).json()
    assert body["id"].startswith("rerank-") and body["model"] == "m"
    assert [r["index"] for r in body["results"]] == [1, 2, 0]
    assert [r["document"]["text"] for r in body["results"]] == ["the cat sat", "the cat", "a dog"]
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert body["usage"]["total_tokens"] == sum(len(c["prompt"].split()) + len(c["pair"].split())
                                                + 3 for c in engine.calls)


def test_rerank_top_n_and_return_documents():
    engine = FakePoolingEngine(EMBED)
    docs = ["cat", "dog", "act", "tac cat"]
    body = _post(_app(engine), "/rerank", {"query": "cat", "documents": docs, "top_n": 2,
                                           "return_documents": False}).json()
    order = sorted(range(4), key=lambda i: -_cos("cat", docs[i]))
    assert [r["index"] for r in body["results"]] == order[:2]
    assert all(set(r) == {"index", "relevance_score"} for r in body["results"])


@pytest.mark.parametrize("body, param", [
    ({"query": "a", "documents": []}, "documents"),
    ({"query": "a", "documents": ["b"] * 9}, "documents"),
    ({"query": "a", "documents": [{"txt": "b"}]}, "documents[0]"),
    ({"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ({"documents": ["b"]}, "query"),
])
def test_rerank_errors_name_the_field(body, param):
    error = _error(_post(_app(FakePoolingEngine(EMBED)), "/rerank", body))
    assert error["param"] == param, error
