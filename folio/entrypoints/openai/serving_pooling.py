"""What every pooling route does around the engine: refuse a generate model, bound and split
the request's inputs, build and check its PoolingParams, and run one engine request per input
concurrently (the engine batches them), each error a 400 naming the field it came from."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Sequence

from folio.engine.frontend import check_pooling_params
from folio.entrypoints.openai.engine_streams import IsDisconnected
from folio.entrypoints.openai.errors import OpenAIError, to_openai_error
from folio.entrypoints.openai.serving_base import ServingBase
from folio.pooling_params import PoolingModelInfo, PoolingParams
from folio.request_outputs import PoolingRequestOutput

@dataclass
class PoolingJob:
    """One engine request of a route: its input (and a cross-encoder's document), and the
    request field it came from, which names it in errors."""

    prompt: Any
    param: str
    pair: str | None = None


def input_items(value: Any, param: str) -> list[Any]:
    """OpenAI's `input` (a string, a list of strings, a token-id list, a list of token-id
    lists) as the list of inputs, none of them empty."""
    if isinstance(value, str) or (value and all(isinstance(t, int) for t in value)):
        items = [value]
    else:
        items = list(value)
    if not items or any(len(item) == 0 for item in items):
        raise OpenAIError(f"{param} must not be empty", param=param)
    return items


class ServingPooling(ServingBase):
    """Shared by the embeddings / pooling, classify, and score / rerank handlers."""

    # The route, for messages ("/v1/embeddings needs ...").
    route: str = "this route"

    @property
    def pooling_info(self) -> PoolingModelInfo:
        info = self.engine.model_info.pooling
        if info is None:
            raise OpenAIError(f"{self.route} needs a pooling model, and this one runs the "
                              "generate runner (serve an embedding, classification or "
                              "reranking model, or start the server with --runner pooling)",
                              param="model")
        return info

    def check_count(self, count: int, param: str) -> None:
        limit = self.limits.max_pooling_inputs
        if count > limit:
            raise OpenAIError(f"{param} has {count} inputs; at most {limit} are allowed in one "
                              f"request (--max-pooling-inputs)", param=param)

    def make_params(self, request: Any, *, task_param: str = "model",
                    **fields: Any) -> PoolingParams:
        """The request's PoolingParams for this model, checked now: a task the model has no
        head for or `dimensions` it cannot give is one 400, before any input is tokenized."""
        known = set(type(request).model_fields)
        try:
            params = PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens,
                                   **fields)
            return check_pooling_params(params, self.pooling_info)
        except ValueError as exc:
            aliases = None if task_param == "task" else {"task": task_param}
            raise to_openai_error(exc, known_params=known, aliases=aliases) from exc

    async def run_jobs(self, jobs: Sequence[PoolingJob], params: PoolingParams, request: Any,
                       request_id: str, is_disconnected: IsDisconnected | None
                       ) -> list[PoolingRequestOutput]:
        """Every job as its own engine request, all in flight at once; their outputs in job
        order. The first error (a 400 naming the job's field) or the client going away
        aborts the rest."""
        ids = ([request_id] if len(jobs) == 1
               else [f"{request_id}-{i}" for i in range(len(jobs))])
        tasks = [asyncio.ensure_future(self.engine.encode(job.prompt, params, rid, pair=job.pair,
                                                          priority=request.priority))
                 for job, rid in zip(jobs, ids)]
        known = set(type(request).model_fields)
        try:
            pending: set[asyncio.Future] = set(tasks)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=self.disconnect_poll_interval_s,
                                                return_when=asyncio.FIRST_EXCEPTION)
                for job, task in zip(jobs, tasks):
                    exc = _failure(task)
                    if exc is not None:
                        raise to_openai_error(exc, known_params=known, aliases={
                            "prompt": job.param, "prompt_token_ids": job.param}) from exc
                if pending and is_disconnected is not None and await is_disconnected():
                    raise OpenAIError("Client disconnected", status_code=499,
                                      type="ClientDisconnected")
        finally:
            for task in tasks:
                task.cancel()  # a no-op for the finished; the engine aborts the others
            await asyncio.gather(*tasks, return_exceptions=True)
        outputs = [task.result() for task in tasks]
        failed = [out for out in outputs if out.outputs is None]
        if failed:
            raise OpenAIError(f"the engine ended {len(failed)} of {len(outputs)} pooling "
                              f"request(s) without a result (finish reason "
                              f"{failed[0].finish_reason!r})", status_code=500,
                              type="InternalServerError")
        return outputs


def _failure(task: asyncio.Future) -> BaseException | None:
    """A finished engine request's error (an abort in the engine cancels it), else None."""
    if not task.done():
        return None
    if task.cancelled():
        return OpenAIError("the engine aborted the request", status_code=500,
                           type="InternalServerError")
    return task.exception()
