"""POST /v1/embeddings (OpenAI) and POST /pooling (vLLM): one vector (or, for a per-token
task, one matrix) per input."""
from __future__ import annotations

import time

from folio.entrypoints.openai.engine_streams import IsDisconnected
from folio.entrypoints.openai.pooling_protocol import EmbeddingRequest, PoolingRequest
from folio.entrypoints.openai.pooling_responses import embedding_response, pooling_response
from folio.entrypoints.openai.request_params import resolve_model_name
from folio.entrypoints.openai.serving_pooling import PoolingJob, ServingPooling, input_items
from folio.pooling_params import PoolingParams, PoolingTask
from folio.request_outputs import PoolingRequestOutput


class OpenAIServingEmbedding(ServingPooling):
    route = "/v1/embeddings"

    async def create_embedding(self, request: EmbeddingRequest, *, request_id: str,
                               is_disconnected: IsDisconnected | None = None) -> dict:
        model = resolve_model_name(request.model, self.served_model_names)
        params = self.make_params(request, task=PoolingTask.EMBED.value,
                                  dimensions=request.dimensions, normalize=request.normalize)
        outputs = await self._run(request, params, request_id, is_disconnected)
        return await self.run_blocking(lambda: embedding_response(
            outputs, response_id=request_id, created=int(time.time()),
            model=model, encoding_format=request.encoding_format))

    async def _run(self, request: EmbeddingRequest, params: PoolingParams, request_id: str,
                   is_disconnected: IsDisconnected | None) -> list[PoolingRequestOutput]:
        items = input_items(request.input, "input")
        self.check_count(len(items), "input")
        jobs = [PoolingJob(item, "input") for item in items]
        return await self.run_jobs(jobs, params, request, request_id, is_disconnected)


class OpenAIServingPooling(OpenAIServingEmbedding):
    route = "/pooling"

    async def create_pooling(self, request: PoolingRequest, *, request_id: str,
                             is_disconnected: IsDisconnected | None = None) -> dict:
        model = resolve_model_name(request.model, self.served_model_names)
        # Without a task: the model's own output, raw (vLLM's "encode").
        params = self.make_params(request, task_param="task",
                                  task=request.task or PoolingTask.ENCODE.value,
                                  dimensions=request.dimensions, normalize=request.normalize,
                                  use_activation=request.use_activation)
        outputs = await self._run(request, params, request_id, is_disconnected)
        return await self.run_blocking(lambda: pooling_response(
            outputs, response_id=request_id, created=int(time.time()),
            model=model, encoding_format=request.encoding_format))
