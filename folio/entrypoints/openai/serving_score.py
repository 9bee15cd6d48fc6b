"""POST /score (vLLM) and /rerank (Jina / Cohere, as vLLM serves them): the relevance of text
pairs. A cross-encoder (a classifier of one label) reads each (query, document) pair in one
pass; an embedding model embeds each distinct text once and scores a pair by the cosine of
its two embeddings (as LLM.score does)."""
from __future__ import annotations

import time
from typing import Any

from folio.entrypoints.openai.engine_streams import IsDisconnected
from folio.entrypoints.openai.errors import OpenAIError
from folio.entrypoints.openai.pooling_protocol import RerankRequest, ScoreRequest
from folio.entrypoints.openai.pooling_responses import (cross_encoder_scores, embedding_scores,
                                                        prompt_tokens, rerank_response,
                                                        score_response)
from folio.entrypoints.openai.request_params import resolve_model_name
from folio.entrypoints.openai.serving_pooling import PoolingJob, ServingPooling
from folio.entrypoints.pooling_api import score_pairs
from folio.pooling_params import PoolingTask


class OpenAIServingScore(ServingPooling):
    route = "/score and /rerank"

    async def create_score(self, request: ScoreRequest, *, request_id: str,
                           is_disconnected: IsDisconnected | None = None) -> dict:
        model = resolve_model_name(request.model, self.served_model_names)
        param_1, first = self._side(request, "text_1", "queries")
        param_2, second = self._side(request, "text_2", "documents")
        try:
            pairs = score_pairs(first, second)
        except ValueError as exc:
            raise OpenAIError(str(exc), param=param_2) from exc
        scores, num_tokens = await self._score(request, pairs, param_1, param_2, request_id,
                                               is_disconnected)
        return score_response(scores, num_tokens, response_id=request_id,
                              created=int(time.time()), model=model)

    async def create_rerank(self, request: RerankRequest, *, request_id: str,
                            is_disconnected: IsDisconnected | None = None) -> dict:
        model = resolve_model_name(request.model, self.served_model_names)
        documents = [d if isinstance(d, str) else d.text for d in request.documents]
        if not documents:
            raise OpenAIError("documents must not be empty", param="documents")
        self.check_count(len(documents), "documents")
        pairs = [(request.query, document) for document in documents]
        scores, num_tokens = await self._score(request, pairs, "query", "documents",
                                               request_id, is_disconnected)
        return rerank_response(scores, documents, num_tokens, top_n=request.top_n,
                               return_documents=request.return_documents,
                               response_id=request_id, model=model)

    def _side(self, request: ScoreRequest, name: str, alias: str) -> tuple[str, list[str]]:
        """One side of the pairs, under its name or vLLM's newer alias, as a list of texts."""
        value, other = getattr(request, name), getattr(request, alias)
        if value is not None and other is not None:
            raise OpenAIError(f"{name} and {alias} are the same side of the pairs; give one",
                              param=alias)
        param = alias if value is None and other is not None else name
        value = value if value is not None else other
        if value is None:
            raise OpenAIError(f"{name} is required", param=name)
        texts = [value] if isinstance(value, str) else list(value)
        if not texts:
            raise OpenAIError(f"{param} must not be empty", param=param)
        self.check_count(len(texts), param)
        return param, texts

    async def _score(self, request: Any, pairs: list[tuple[str, str]], param_1: str,
                     param_2: str, request_id: str, is_disconnected: IsDisconnected | None
                     ) -> tuple[list[float], int]:
        """Each pair's score, and the prompt tokens the engine ran for them."""
        if self.pooling_info.kind == "embed":
            params = self.make_params(request, task=PoolingTask.EMBED.value)
            # Each distinct text once, named in errors by the side it first appears on.
            origin: dict[str, str] = {}
            for a, b in pairs:
                origin.setdefault(a, param_1)
                origin.setdefault(b, param_2)
            jobs = [PoolingJob(text, param) for text, param in origin.items()]
            outputs = await self.run_jobs(jobs, params, request, request_id, is_disconnected)
            vectors = {job.prompt: out.outputs.data for job, out in zip(jobs, outputs)}
            scores = await self.run_blocking(embedding_scores, pairs, vectors)
        else:
            params = self.make_params(request, task=PoolingTask.SCORE.value,
                                      use_activation=request.use_activation)
            jobs = [PoolingJob(a, param_2, pair=b) for a, b in pairs]
            outputs = await self.run_jobs(jobs, params, request, request_id, is_disconnected)
            scores = cross_encoder_scores(outputs)
        return scores, prompt_tokens(outputs)
