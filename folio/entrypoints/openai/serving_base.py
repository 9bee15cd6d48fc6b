"""ServingBase: what the completions and chat handlers do around the engine (its tokenizer
and limits, blocking work off the event loop, starting a request's streams, collecting or
streaming their outputs with errors mapped to OpenAIError)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Mapping, Sequence

from folio.config import RequestLimitsConfig
from folio.entrypoints.openai.engine_streams import EngineStreams, IsDisconnected
from folio.entrypoints.openai.errors import ClientDisconnected, OpenAIError, to_openai_error
from folio.entrypoints.openai.request_params import resolve_model_name
from folio.lora.request import LoRARequest
from folio.request_outputs import RequestOutput
from folio.sampling_params import SamplingParams

if TYPE_CHECKING:
    from folio.entrypoints.openai.serving_models import OpenAIServingModels


class ServingBase:
    """Engine access shared by the completions and chat handlers."""

    # How often a waiting non-streaming request asks whether its client is still there.
    disconnect_poll_interval_s: float = 0.5

    def __init__(self, engine: Any, served_model_names: Sequence[str],
                 models: OpenAIServingModels | None = None) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        self.engine = engine
        self.served_model_names = list(served_model_names)
        # The server's registry of what `model` may name (LoRA adapters among them); None:
        # the served names of the base model only.
        self.models = models

    async def resolve_model(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """The model name the response carries, and the LoRA adapter it runs (None: the
        base model); a 404 OpenAIError for a name the server does not serve."""
        if self.models is None:
            return resolve_model_name(requested, self.served_model_names), None
        return await self.models.resolve(requested)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def limits(self) -> RequestLimitsConfig:
        config = getattr(self.engine, "config", None)
        return getattr(config, "limits", None) or RequestLimitsConfig()

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Per-request work that can take long (templates, tokenizing, constraint checks,
        big responses) runs on the engine's preprocessing thread, not on the event loop."""
        runner = getattr(self.engine, "run_blocking", None)
        if runner is None:  # stand-in engines in tests
            return fn(*args)
        return await runner(fn, *args)

    def start_streams(self, prompts: Sequence[Any], params: Sequence[SamplingParams],
                      request_ids: Sequence[str], request: Any,
                      is_disconnected: IsDisconnected | None,
                      lora_request: LoRARequest | None = None, *,
                      kv_pin_ttl: float | None = None) -> EngineStreams:
        """`kv_pin_ttl`: seconds the requests' KV blocks stay pinned once they finish (a
        stored response's)."""
        # Only passed when set: the base model's requests call generate as before.
        extra: dict[str, Any] = {} if lora_request is None else {"lora_request": lora_request}
        deadline = request_deadline(request)
        if deadline is not None:
            extra["deadline"] = deadline
        if kv_pin_ttl is not None:
            extra["kv_pin_ttl"] = kv_pin_ttl
        kv_transfer_params = getattr(request, "kv_transfer_params", None)
        if kv_transfer_params is not None:
            if len(prompts) != 1:
                raise OpenAIError("kv_transfer_params: disaggregated prefill runs one prompt "
                                  "per request", param="kv_transfer_params")
            extra["kv_transfer_params"] = kv_transfer_params
        streams = [self._count_lora(self.engine.generate(prompt, p, rid,
                                                         priority=request.priority,
                                                         cache_salt=request.cache_salt, **extra),
                                    lora_request)
                   for prompt, p, rid in zip(prompts, params, request_ids)]
        return EngineStreams(streams, is_disconnected=is_disconnected,
                             poll_interval_s=self.disconnect_poll_interval_s)

    def _count_lora(self, stream: AsyncIterator[RequestOutput],
                    lora_request: LoRARequest | None) -> AsyncIterator[RequestOutput]:
        """The stream, counted under folio:lora_requests_total once the engine has run it
        (its first output): a request refused or aborted before it ran is not counted."""
        metrics = getattr(self.engine, "metrics", None)
        if lora_request is None or metrics is None:
            return stream
        return _count_on_first_output(stream, lambda: metrics.lora_request(
            lora_request.lora_name))

    async def collect_final(self, streams: EngineStreams, count: int,
                            error_kwargs: Mapping[str, Any]) -> list[RequestOutput]:
        """Wait for every prompt's final output (FINAL_ONLY), aborting all on disconnect."""
        finals: list[RequestOutput | None] = [None] * count
        try:
            async for index, output in streams:
                finals[index] = output
        except ClientDisconnected as exc:
            raise OpenAIError("Client disconnected", status_code=499,
                              type="ClientDisconnected") from exc
        except Exception as exc:
            raise to_openai_error(exc, **error_kwargs) from exc
        finally:
            await streams.aclose()
        missing = [i for i, out in enumerate(finals) if out is None]
        if missing:
            raise OpenAIError("The engine ended the request without an output", status_code=500,
                              type="InternalServerError")
        return finals  # type: ignore[return-value]

    async def first_output(self, streams: EngineStreams, error_kwargs: Mapping[str, Any]
                           ) -> tuple[int, RequestOutput] | None:
        """Streaming starts only once the engine accepted the request(s): errors up to the
        first output still become a proper HTTP error instead of an in-stream event."""
        try:
            return await streams.__anext__()
        except StopAsyncIteration:
            await streams.aclose()
            return None
        except ClientDisconnected as exc:
            await streams.aclose()
            raise OpenAIError("Client disconnected", status_code=499,
                              type="ClientDisconnected") from exc
        except BaseException as exc:
            await streams.aclose()
            if isinstance(exc, Exception):
                raise to_openai_error(exc, **error_kwargs) from exc
            raise

    async def iterate_stream(self, streams: EngineStreams,
                             first: tuple[int, RequestOutput] | None
                             ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The primed first output, then the rest; a client gone ends it quietly."""
        if first is not None:
            yield first
        try:
            async for item in streams:
                yield item
        except ClientDisconnected:
            return


async def _count_on_first_output(stream: AsyncIterator[RequestOutput],
                                 count: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    counted = False
    try:
        async for output in stream:
            if not counted:
                count()
                counted = True
            yield output
    finally:
        # Closing this wrapper (client gone, stream abandoned) must close the engine's
        # stream too: its own `finally` aborts the request in the engine.
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


def request_deadline(request: Any) -> float | None:
    """The request's `timeout` (seconds from now) or `deadline` (a Unix time), the earlier,
    as a time.monotonic() value (the engine core's clock); None when it gives neither. A
    deadline already past is refused."""
    now_mono, now_wall = time.monotonic(), time.time()
    ends = []
    timeout = getattr(request, "timeout", None)
    if timeout is not None:
        ends.append(now_mono + timeout)
    deadline = getattr(request, "deadline", None)
    if deadline is not None:
        if deadline <= now_wall:
            raise OpenAIError(f"deadline {deadline} is already past (now {now_wall:.3f})",
                              param="deadline")
        ends.append(now_mono + (deadline - now_wall))
    return min(ends) if ends else None
