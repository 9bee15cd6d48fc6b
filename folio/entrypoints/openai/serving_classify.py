"""POST /classify (vLLM): each input's class probabilities and its likeliest label."""
from __future__ import annotations

import time

from folio.entrypoints.openai.engine_streams import IsDisconnected
from folio.entrypoints.openai.pooling_protocol import ClassificationRequest
from folio.entrypoints.openai.pooling_responses import classification_response
from folio.entrypoints.openai.request_params import resolve_model_name
from folio.entrypoints.openai.serving_pooling import PoolingJob, ServingPooling, input_items
from folio.pooling_params import PoolingTask


class OpenAIServingClassification(ServingPooling):
    route = "/classify"

    async def create_classify(self, request: ClassificationRequest, *, request_id: str,
                              is_disconnected: IsDisconnected | None = None) -> dict:
        model = resolve_model_name(request.model, self.served_model_names)
        params = self.make_params(request, task=PoolingTask.CLASSIFY.value,
                                  use_activation=request.use_activation,
                                  activation=request.activation)
        items = input_items(request.input, "input")
        self.check_count(len(items), "input")
        outputs = await self.run_jobs([PoolingJob(item, "input") for item in items], params,
                                      request, request_id, is_disconnected)
        labels = self.pooling_info.labels
        return await self.run_blocking(lambda: classification_response(
            outputs, labels, response_id=request_id, created=int(time.time()), model=model))
