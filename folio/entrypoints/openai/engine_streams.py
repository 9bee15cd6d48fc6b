"""Running a request's engine streams (one per prompt) concurrently, noticing a client that
disconnects while it waits."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, Sequence

from folio.entrypoints.openai.errors import ClientDisconnected
from folio.request_outputs import RequestOutput

IsDisconnected = Callable[[], Awaitable[bool]]


_END = object()
_DISCONNECTED = object()


class EngineStreams:
    """Drives one engine stream per prompt concurrently and hands out (prompt_index,
    RequestOutput) in arrival order.

    Each stream runs in its own task, so cancelling the task (aclose) throws into the
    engine's generator at its await: its `finally` aborts the request in the engine. A
    watcher polls `is_disconnected` so a client that leaves is noticed even while no
    output arrives (non-streaming requests can wait a long time for the final output).
    """

    def __init__(self, streams: Sequence[AsyncIterator[RequestOutput]], *,
                 is_disconnected: IsDisconnected | None = None,
                 poll_interval_s: float = 0.5) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(streams)
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]
        self._watcher: asyncio.Task | None = None
        if is_disconnected is not None:
            self._watcher = asyncio.create_task(self._watch(is_disconnected, poll_interval_s))
        self._closed = False

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                self._queue.put_nowait((index, output))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait((index, exc))
        else:
            self._queue.put_nowait((index, _END))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()  # no-op if the generator already finished
                except Exception:  # noqa: BLE001
                    pass

    async def _watch(self, is_disconnected: IsDisconnected, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                gone = await is_disconnected()
            except Exception:  # noqa: BLE001 - a broken probe must not fail the request
                return
            if gone:
                self._queue.put_nowait((-1, _DISCONNECTED))
                return

    def __aiter__(self) -> "EngineStreams":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while self._open > 0:
            index, item = await self._queue.get()
            if item is _END:
                self._open -= 1
                continue
            if item is _DISCONNECTED:
                raise ClientDisconnected("the client disconnected")
            if isinstance(item, BaseException):
                raise item
            return index, item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Cancel whatever is still running (aborting those engine requests)."""
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in self._tasks if not t.done()]
        if self._watcher is not None:
            tasks.append(self._watcher)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
