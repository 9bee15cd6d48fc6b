"""The pooling routes' response bodies, as plain dicts, from the engine's PoolingRequestOutputs
(or anything with `.outputs.data` and `.prompt_token_ids`): OpenAI's embeddings list, vLLM's
pooling / classification / score lists, and the Jina / Cohere rerank results. Pure functions:
no engine, no request; the handlers call them off the event loop."""
from __future__ import annotations

import base64
from typing import Any, Mapping, Sequence

import numpy as np

from folio.entrypoints.pooling_api import cosine


def encode_vector(data: Any, encoding_format: str) -> list | str:
    """One result as the wire carries it: nested lists of floats, or (base64) the base64 of
    its little-endian float32 bytes, row-major, which the openai client reads back with
    np.frombuffer(..., dtype="float32")."""
    array = np.asarray(data, dtype=np.float32)
    if encoding_format == "base64":
        return base64.b64encode(array.astype("<f4", copy=False).tobytes()).decode("ascii")
    return array.tolist()


def prompt_tokens(outputs: Sequence[Any]) -> int:
    return sum(len(out.prompt_token_ids) for out in outputs)


def usage(num_prompt_tokens: int) -> dict:
    """OpenAI's embeddings usage: pooling produces no completion tokens."""
    return {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}


def _list_body(response_id: str, created: int, model: str, data: list[dict],
               num_prompt_tokens: int) -> dict:
    return {"id": response_id, "object": "list", "created": created, "model": model,
            "data": data, "usage": usage(num_prompt_tokens)}


def embedding_response(outputs: Sequence[Any], *, response_id: str, created: int, model: str,
                       encoding_format: str) -> dict:
    """/v1/embeddings: one {"object": "embedding"} per input, in input order."""
    data = [{"object": "embedding", "index": i,
             "embedding": encode_vector(out.outputs.data, encoding_format)}
            for i, out in enumerate(outputs)]
    return _list_body(response_id, created, model, data, prompt_tokens(outputs))


def pooling_response(outputs: Sequence[Any], *, response_id: str, created: int, model: str,
                     encoding_format: str) -> dict:
    """/pooling: each input's raw result (a vector, or a matrix for per-token tasks)."""
    data = [{"index": i, "object": "pooling",
             "data": encode_vector(out.outputs.data, encoding_format)}
            for i, out in enumerate(outputs)]
    return _list_body(response_id, created, model, data, prompt_tokens(outputs))


def classification_response(outputs: Sequence[Any], labels: Sequence[str], *,
                            response_id: str, created: int, model: str) -> dict:
    """/classify: each input's class probabilities and the name of the likeliest class (the
    model's id2label)."""
    data = []
    for i, out in enumerate(outputs):
        probs = np.asarray(out.outputs.data, dtype=np.float32).reshape(-1)
        best = int(np.argmax(probs))
        data.append({"index": i, "label": labels[best] if best < len(labels) else None,
                     "probs": probs.tolist(), "num_classes": int(probs.size)})
    return _list_body(response_id, created, model, data, prompt_tokens(outputs))


def cross_encoder_scores(outputs: Sequence[Any]) -> list[float]:
    """A cross-encoder's score of each (query, document) pair: its one output value."""
    return [float(np.asarray(out.outputs.data).reshape(-1)[0]) for out in outputs]


def embedding_scores(pairs: Sequence[tuple[str, str]],
                     vectors: Mapping[str, Any]) -> list[float]:
    """An embedding model's score of each pair: the cosine of the two texts' embeddings."""
    return [cosine(vectors[a], vectors[b]) for a, b in pairs]


def score_response(scores: Sequence[float], num_prompt_tokens: int, *, response_id: str,
                   created: int, model: str) -> dict:
    """/score: one {"object": "score"} per pair, in pair order."""
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)]
    return _list_body(response_id, created, model, data, num_prompt_tokens)


def rerank_response(scores: Sequence[float], documents: Sequence[str], num_tokens: int, *,
                    top_n: int | None, return_documents: bool, response_id: str,
                    model: str) -> dict:
    """/rerank (Jina, Cohere): the documents by relevance, best first (ties in document
    order), cut to top_n (None or 0: all); each with its index in the request and, unless
    return_documents is false, its text."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if top_n:
        order = order[:top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {"id": response_id, "model": model, "usage": {"total_tokens": num_tokens},
            "results": results}
