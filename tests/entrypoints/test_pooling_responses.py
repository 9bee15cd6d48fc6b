"""The pooling routes' response bodies (folio.entrypoints.openai.pooling_responses), from
PoolingRequestOutputs made by hand: OpenAI's embeddings list (float and base64 as the openai
client decodes it), vLLM's pooling / classify / score lists, the rerank results. No model."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from folio.entrypoints.openai import pooling_responses as responses
from folio.request_outputs import PoolingOutput, PoolingRequestOutput

IDS = {"response_id": "embd-1", "created": 1700000000, "model": "m"}


def _out(data, num_tokens: int = 3) -> PoolingRequestOutput:
    return PoolingRequestOutput("r", PoolingOutput(np.asarray(data, dtype=np.float32)),
                                list(range(num_tokens)), True, finish_reason="stop")


def test_embedding_response_float():
    body = responses.embedding_response([_out([0.5, -0.25], 3), _out([1.0, 0.0], 4)],
                                        encoding_format="float", **IDS)
    assert body == {
        "id": "embd-1", "object": "list", "created": 1700000000, "model": "m",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25]},
                 {"object": "embedding", "index": 1, "embedding": [1.0, 0.0]}],
        "usage": {"prompt_tokens": 7, "total_tokens": 7}}
    json.dumps(body, allow_nan=False)  # plain JSON types only


def test_embedding_response_base64_is_what_the_openai_client_decodes():
    vector = np.random.default_rng(0).standard_normal(384).astype(np.float32)
    body = responses.embedding_response([_out(vector)], encoding_format="base64", **IDS)
    text = body["data"][0]["embedding"]
    assert isinstance(text, str)
    # openai-python: np.frombuffer(base64.b64decode(data), dtype="float32")
    decoded = np.frombuffer(base64.b64decode(text), dtype="float32")
    np.testing.assert_array_equal(decoded, vector)
    # little-endian whatever the host: the bytes are "<f4"
    assert base64.b64decode(text) == vector.astype("<f4").tobytes()


def test_encode_vector_of_a_matrix_is_row_major():
    matrix = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert responses.encode_vector(matrix, "float") == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    raw = base64.b64decode(responses.encode_vector(matrix, "base64"))
    np.testing.assert_array_equal(np.frombuffer(raw, "<f4").reshape(2, 3), matrix)


def test_pooling_response_nested_lists():
    body = responses.pooling_response([_out([[1, 2], [3, 4]], 2)], encoding_format="float",
                                      **{**IDS, "response_id": "pool-1"})
    assert body["id"] == "pool-1" and body["object"] == "list"
    assert body["data"] == [{"index": 0, "object": "pooling", "data": [[1.0, 2.0], [3.0, 4.0]]}]
    assert body["usage"] == {"prompt_tokens": 2, "total_tokens": 2}


def test_classification_response_labels_the_argmax():
    body = responses.classification_response(
        [_out([0.1, 0.7, 0.2], 5), _out([0.6, 0.3, 0.1], 2)], ("neg", "neutral", "pos"),
        **{**IDS, "response_id": "classify-1"})
    assert [(d["index"], d["label"], d["num_classes"]) for d in body["data"]] == [
        (0, "neutral", 3), (1, "neg", 3)]
    assert body["data"][0]["probs"] == pytest.approx([0.1, 0.7, 0.2])
    assert set(body["data"][0]) == {"index", "label", "probs", "num_classes"}
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}


def test_scores_of_a_cross_encoder_and_of_embeddings():
    assert responses.cross_encoder_scores([_out([0.25]), _out([0.75])]) == [0.25, 0.75]
    vectors = {"a": np.array([1.0, 0.0]), "b": np.array([1.0, 1.0]), "c": np.array([0.0, 2.0])}
    scores = responses.embedding_scores([("a", "b"), ("a", "c"), ("b", "b")], vectors)
    assert scores == pytest.approx([2 ** -0.5, 0.0, 1.0])


def test_score_response():
    body = responses.score_response([0.5, 0.25], 11, **{**IDS, "response_id": "score-1"})
    assert body == {"id": "score-1", "object": "list", "created": 1700000000, "model": "m",
                    "data": [{"index": 0, "object": "score", "score": 0.5},
                             {"index": 1, "object": "score", "score": 0.25}],
                    "usage": {"prompt_tokens": 11, "total_tokens": 11}}


DOCS = ["zero", "one", "two", "three"]


def test_rerank_response_sorted_best_first():
    body = responses.rerank_response([0.1, 0.9, 0.5, 0.9], DOCS, 20, top_n=None,
                                     return_documents=True, response_id="rerank-1", model="m")
    assert body["id"] == "rerank-1" and body["model"] == "m"
    assert body["usage"] == {"total_tokens": 20}
    # ties keep the documents' order
    assert [r["index"] for r in body["results"]] == [1, 3, 2, 0]
    assert body["results"][0] == {"index": 1, "relevance_score": 0.9,
                                  "document": {"text": "one"}}
    assert "object" not in body and "created" not in body


@pytest.mark.parametrize("top_n, expected", [(None, 4), (0, 4), (2, 2), (9, 4)])
def test_rerank_top_n(top_n, expected):
    body = responses.rerank_response([0.1, 0.9, 0.5, 0.3], DOCS, 1, top_n=top_n,
                                     return_documents=True, response_id="r", model="m")
    assert [r["index"] for r in body["results"]] == [1, 2, 3, 0][:expected]


def test_rerank_without_documents():
    body = responses.rerank_response([0.1, 0.9], DOCS[:2], 1, top_n=None,
                                     return_documents=False, response_id="r", model="m")
    assert body["results"] == [{"index": 1, "relevance_score": 0.9},
                               {"index": 0, "relevance_score": pytest.approx(0.1)}]
