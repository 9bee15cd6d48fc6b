"""The Ray executor (`--distributed-executor-backend ray`): the mp executor's workers as Ray
actors, one per device (or per CPU rank) in a placement group, on one host or across a Ray
cluster.

Everything but where the workers run is the mp executor's: the same worker loop
(worker_proc.run_worker) runs inside each actor, fed the step messages over ZMQ — on TCP here,
since an actor may be on another host — and ranks join torch.distributed at rank 0's address.
The engine joins the cluster named by RAY_ADDRESS (`ray start --head` on one host, `ray start
--address=HEAD:6379` on the others), or starts a local one when there is none. A worker whose
actor dies ends the engine with a WorkerFailed naming it, as a dead process does in the mp
executor. Actors are owned by this process, so Ray removes them when it exits.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from folio.config import EngineConfig
from folio.executor import worker_proc as wp
from folio.executor.multiproc import MultiprocExecutor

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 120.0


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install "
                         "'folio[ray]'") from exc
    return ray


class _RayWorkerBody:
    """The actor: where it runs, a free port there, then the worker loop until shutdown."""

    def node_ip(self) -> str:
        import ray
        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        import socket
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def run(self, args: wp.WorkerArgs) -> None:
        wp.run_worker(args)


class RayWorker:
    """A worker as a Ray actor: the handle the executor watches."""

    def __init__(self, ray: Any, actor: Any, args: wp.WorkerArgs) -> None:
        self.ray = ray
        self.actor = actor
        self.done = actor.run.remote(args)

    def exit_reason(self) -> str | None:
        ready, _ = self.ray.wait([self.done], timeout=0)
        if not ready:
            return None
        try:
            self.ray.get(self.done)
        except Exception as exc:   # RayActorError: killed, or its process died
            return f"(Ray actor) died: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        return "(Ray actor) left its loop"

    def stop(self, timeout_s: float) -> None:
        self.ray.wait([self.done], timeout=timeout_s)
        self.ray.kill(self.actor)


class RayExecutor(MultiprocExecutor):
    transport = "tcp"

    def __init__(self, config: EngineConfig, source: Any, hf_config: Any) -> None:
        ray = _import_ray()
        if not ray.is_initialized():
            # RAY_ADDRESS names an existing cluster; without it Ray starts a local one
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     log_to_driver=True, logging_level=logging.WARNING)
        self._ray = ray
        self._host = ray.util.get_node_ip_address()
        self._placement_group = None
        super().__init__(config, source, hf_config)

    def _spawn_workers(self, arg_list: list[wp.WorkerArgs], config: EngineConfig) -> list:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from folio.worker.worker import resolve_device
        on_gpu = resolve_device(config.model.device).type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if on_gpu else {"CPU": 1}
        group = placement_group([dict(bundle) for _ in arg_list], strategy="PACK")
        self._placement_group = group
        ready, _ = ray.wait([group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ValueError(f"the Ray cluster has no room for {len(arg_list)} workers of "
                             f"{bundle} each (ray status shows what it has)")
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if on_gpu else 0)(_RayWorkerBody)
        actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=rank)).remote()
            for rank in range(len(arg_list))]
        dist_init = None
        if config.parallel.joins_process_group:
            # torch.distributed's rendezvous is served by rank 0, wherever it was placed
            ip, port = ray.get([actors[0].node_ip.remote(), actors[0].free_port.remote()])
            dist_init = f"tcp://{ip}:{port}"
        import dataclasses
        # an actor's parent is Ray's worker process, not this one: Ray ends it with its owner
        args = [dataclasses.replace(a, dist_init_method=dist_init, parent_pid=None)
                for a in arg_list]
        return [RayWorker(ray, actor, a) for actor, a in zip(actors, args)]

    def shutdown(self) -> None:
        super().shutdown()
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group
            try:
                remove_placement_group(self._placement_group)
            except Exception:   # the cluster is gone already
                pass
            self._placement_group = None
