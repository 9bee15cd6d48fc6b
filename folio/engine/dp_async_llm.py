"""Data parallelism (`--data-parallel-size N`): N engine cores, each with its own model replica
(and its own tensor-parallel group), behind one API server.

Each replica is an AsyncLLM — its own engine-core process, sockets and front-end state — so
everything one engine does (streaming, aborts, admission, sleep) is unchanged; this class
routes each request to one of them (dp_router.py: prefix-aware, then least loaded), sends
aborts to the replica holding the request, fans utility calls out to all, and reports the
scheduler's metrics per replica (the `engine` label, as vLLM's). A replica whose core dies
fails its own requests with EngineDeadError; the others go on serving, and the server stays
healthy while one replica is.

GPUs: replica r's engine core sees devices r*TP ... r*TP + TP - 1 (core_proc.py narrows
CUDA_VISIBLE_DEVICES before CUDA starts).
"""
from __future__ import annotations

import copy
import itertools
import logging
from typing import Any, AsyncIterator, Sequence

from folio.config import EngineConfig
from folio.core.engine_core_outputs import SchedulerStats
from folio.engine.async_llm import AsyncLLM, EngineDeadError
from folio.engine.dp_router import PrefixAwareRouter, ReplicaLoad

logger = logging.getLogger(__name__)


class _ReplicaMetrics:
    """The shared EngineMetrics as one replica reports to it: scheduler stats under its
    `engine` label, everything else (per-request, keyed by unique ids) as it is."""

    def __init__(self, metrics: Any, engine: int) -> None:
        self._metrics = metrics
        self._engine = engine

    def observe_scheduler_stats(self, stats: SchedulerStats) -> None:
        self._metrics.observe_scheduler_stats(stats, engine=self._engine)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metrics, name)


def replica_config(config: EngineConfig, rank: int) -> EngineConfig:
    replica = copy.deepcopy(config)
    replica.parallel.data_parallel_rank = rank
    return replica


def _routing_key(prompt: Any) -> Sequence[Any] | None:
    """What the router hashes: the prompt's token ids, or its text's characters."""
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        if ids is not None:
            return ids
        prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return prompt
    return None


class _RoutedStream:
    """A replica's output stream, counted open on its replica from routing until it ends,
    is closed (which aborts the request, as closing the replica's own stream does), or is
    dropped unread."""

    def __init__(self, owner: "DataParallelAsyncLLM", rank: int, request_id: str,
                 inner: AsyncIterator[Any]) -> None:
        self._owner, self._rank, self._request_id, self._inner = owner, rank, request_id, inner
        self._counted = True

    def _done(self) -> None:
        if self._counted:
            self._counted = False
            self._owner._finished(self._rank, self._request_id)

    def __aiter__(self) -> "_RoutedStream":
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._inner.__anext__()
        except BaseException:   # the end (StopAsyncIteration), an error, a cancellation
            self._done()
            raise

    async def aclose(self) -> None:
        self._done()
        await self._inner.aclose()

    def __del__(self) -> None:
        self._done()


class DataParallelAsyncLLM:
    def __init__(self, config: EngineConfig, **kwargs: Any) -> None:
        self.config = config
        self.replicas: list[AsyncLLM] = []
        try:
            for rank in range(config.parallel.data_parallel_size):
                self.replicas.append(AsyncLLM(replica_config(config, rank), **kwargs))
        except BaseException:
            self.shutdown()
            raise
        first = self.replicas[0]
        self.router = PrefixAwareRouter(first.ready.block_size)
        self._owner: dict[str, int] = {}
        # Requests routed to each replica, and those of them routed by a cached prefix.
        self.routed = [0] * len(self.replicas)
        self.prefix_routed = [0] * len(self.replicas)
        self._metrics: Any = None
        self._ids = itertools.count()
        self._open = [0] * len(self.replicas)

    # ---- what the server reads: replica 0's answers (they are the same model) ------------

    def __getattr__(self, name: str) -> Any:
        # model_info, tokenizer, max_model_len, preparer, run_blocking, admission, ready...
        if name == "replicas":
            raise AttributeError(name)
        return getattr(self.replicas[0], name)

    @property
    def metrics(self) -> Any:
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: Any) -> None:
        self._metrics = metrics
        for rank, replica in enumerate(self.replicas):
            replica.metrics = None if metrics is None else _ReplicaMetrics(metrics, rank)
        if metrics is not None:
            metrics.track_dp_routing(lambda: list(self.routed), lambda: list(self.prefix_routed))

    @property
    def stats(self) -> SchedulerStats:
        """The replicas' latest scheduler stats, summed (KV use: their mean)."""
        parts = [r.stats for r in self.replicas]
        total = SchedulerStats()
        for name in ("num_running", "num_waiting", "num_preemptions", "prefix_cache_queries",
                     "prefix_cache_hits", "num_blocks", "num_free_blocks",
                     "num_tracked_requests", "num_pinned_blocks"):
            setattr(total, name, sum(getattr(p, name) for p in parts))
        total.kv_cache_usage = sum(p.kv_cache_usage for p in parts) / len(parts)
        return total

    @property
    def is_healthy(self) -> bool:
        return any(r.is_healthy for r in self.replicas)

    @property
    def errored(self) -> str | None:
        errors = [r.errored for r in self.replicas]
        return None if any(e is None for e in errors) else "; ".join(errors)

    @property
    def num_open_requests(self) -> int:
        return sum(r.num_open_requests for r in self.replicas)

    def num_tracked_requests(self) -> int:
        return sum(r.num_tracked_requests() for r in self.replicas)

    # ---- requests --------------------------------------------------------------------------

    def _loads(self) -> list[ReplicaLoad]:
        # open requests counted here, from routing on: a replica registers a request only
        # once its stream is first read, after the next one may have been routed
        return [ReplicaLoad(r.is_healthy, self._open[i], r.stats.kv_cache_usage)
                for i, r in enumerate(self.replicas)]

    def _route(self, prompt: Any, salt: Any) -> int:
        key = _routing_key(prompt)
        if key is None:   # nothing to hash (embeddings inputs...): by load only
            key = ()
        try:
            route = self.router.choose(key, self._loads(), salt)
        except ValueError:
            raise EngineDeadError("every data-parallel replica is down") from None
        self.router.record(key, route.replica, salt)
        self.routed[route.replica] += 1
        if route.prefix_tokens:
            self.prefix_routed[route.replica] += 1
        return route.replica

    def _start(self, method: str, prompt: Any, params: Any, request_id: str | None,
               salt: Any, kwargs: dict[str, Any]) -> AsyncIterator[Any]:
        # ids unique across replicas (each would number its own from 0)
        request_id = f"dp-{next(self._ids)}" if request_id is None else request_id
        rank = self._route(prompt, salt)
        self._owner[request_id] = rank
        self._open[rank] += 1
        inner = getattr(self.replicas[rank], method)(prompt, params, request_id, **kwargs)
        return _RoutedStream(self, rank, request_id, inner)

    def _finished(self, rank: int, request_id: str) -> None:
        self._owner.pop(request_id, None)
        self._open[rank] -= 1

    def generate(self, prompt: Any, params: Any, request_id: str | None = None,
                 **kwargs: Any) -> AsyncIterator[Any]:
        salt = (kwargs.get("cache_salt"), getattr(kwargs.get("lora_request"), "lora_int_id",
                                                  None))
        return self._start("generate", prompt, params, request_id, salt, kwargs)

    def encode(self, prompt: Any, params: Any, request_id: str | None = None,
               **kwargs: Any) -> AsyncIterator[Any]:
        return self._start("encode", prompt, params, request_id, None, kwargs)

    async def abort(self, request_id: str) -> None:
        rank = self._owner.get(request_id)
        for i, replica in enumerate(self.replicas):
            if rank is None or i == rank:
                await replica.abort(request_id)

    def abort_all(self, reason: str) -> None:
        for replica in self.replicas:
            replica.abort_all(reason)

    def begin_shutdown(self, reason: str) -> None:
        for replica in self.replicas:
            replica.begin_shutdown(reason)

    def shutdown(self, timeout_s: float = 4.0) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout_s)

    # ---- utility calls: every live replica ---------------------------------------------

    async def _each(self, method: str, *args: Any) -> list[Any]:
        return [await getattr(r, method)(*args) for r in self.replicas if r.is_healthy]

    async def reset_prefix_cache(self) -> bool:
        return all(await self._each("reset_prefix_cache"))

    async def unpin_kv(self, request_ids: list[str]) -> int:
        return sum(await self._each("unpin_kv", request_ids))

    async def sleep(self, level: int = 1) -> dict[str, int]:
        freed: dict[str, int] = {}
        for part in await self._each("sleep", level):
            for key, value in part.items():
                freed[key] = freed.get(key, 0) + value
        return freed

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._each("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return any(await self._each("is_sleeping"))

    async def remove_lora(self, lora_id: int) -> bool:
        return any(await self._each("remove_lora", lora_id))

    async def list_loras(self) -> set[int]:
        out: set[int] = set()
        for part in await self._each("list_loras"):
            out |= part
        return out
