"""The scheduler's side of a KV connector: something outside the device's KV cache that
supplies a request's prompt KV (fetched from a prefill server, read from a store) or takes a
finished request's KV (for a decode server to fetch). Torch-free, like the rest of
folio/core; the bytes move on the worker's side, as the step messages say.

The scheduler asks the connector, for each waiting request, how many prompt tokens past its
device prefix hit it can supply; allocates blocks for them; and, for an asynchronous load,
parks the request (WAITING_FOR_REMOTE_KVS) until a step's output reports the load done, then
schedules it from there (or, if the load failed, computes the prompt itself). When a request
finishes, the connector may keep its blocks for a while (a producer's prompt, until the
consumer has fetched it) and adds what a client needs to the response (kv_transfer_params).

The names follow vLLM's KVConnectorBase_V1 scheduler methods, so that a reader who knows
those knows these. Implementations: `OffloadingConnectorScheduler` (folio/core/kv_offload.py: the host
and disk tiers, loads within the step), `P2PConnectorScheduler` (folio/core/kv_p2p.py:
disaggregated prefill, loads in the background). A connector may also take the device pool's
evicted blocks (`on_block_evicted(block_hash, block_id)`).
"""
from __future__ import annotations

from typing import Protocol

from folio.core.request import Request
from folio.core.step_messages import ModelRunnerOutput


class KVConnectorScheduler(Protocol):
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """(prompt tokens past `num_computed_tokens` the connector can supply, whether they
        arrive asynchronously: the request then waits until the load is reported). None
        tokens: not known yet (the request waits its turn and is asked again next step).
        Synchronous tokens are loaded within the step that computes the rest."""

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int, key: str) -> None:
        """The request's blocks (all of them, in order) are allocated; the connector's
        tokens go into those after its `num_computed_tokens`. The load is reported under
        `key` (unique: a request id may be used again meanwhile)."""

    def build_connector_meta(self) -> dict:
        """This step's work for the workers, as SchedulerOutput fields."""

    def update_connector_output(self, output: ModelRunnerOutput
                                ) -> tuple[list[str], list[tuple[str, bool]]]:
        """A step's report: (keys of held blocks that may be freed now, loads finished as
        (key, ok))."""

    def request_finished(self, request: Request, block_ids: list[int], key: str
                         ) -> tuple[bool, dict | None]:
        """(keep the request's blocks until `update_connector_output` frees `key`, the
        kv_transfer_params of its response)."""

    def expired_holds(self, now: float) -> None:
        """Give up holds past their time (released in the next step's message)."""

    def forget(self, request_id: str) -> None:
        """The request is gone for good (finished or aborted)."""

    def reset(self) -> None:
        """The prefix cache was reset (what the connector keeps of it goes too)."""

    def has_pending_work(self) -> bool:
        """A step must reach the workers (holds, releases or loads to tell them, results to
        collect) even when it runs no request."""

    def stats(self) -> dict:
        """SchedulerStats fields."""
