"""Disaggregated prefill, the scheduler's side (`--kv-transfer-config` with the P2pConnector):
a prefill server (kv_producer) computes a prompt and keeps its blocks for a decode server
(kv_consumer), which fetches that KV instead of computing it and generates from there.

The request carries vLLM's `kv_transfer_params`. To the prefill server: {"do_remote_decode":
true}; its answer's kv_transfer_params say where the KV is (`remote_host`, `remote_port`,
`remote_block_ids`, and folio's `remote_transfer_id`, a random token that a fetch must
present, `remote_num_tokens`, `remote_tokens_hash`, `remote_block_size`). Sent on to a decode
server with the same prompt, they let it fetch every prompt token's KV but the last (which it
computes, to have logits to sample from). A decode server that finds them wrong (another
prompt, block size or model) or whose fetch fails computes the prompt itself: slower, never
wrong.

Torch-free; the worker's side is folio/worker/kv_p2p.py.
"""
from __future__ import annotations

import hashlib
import logging
import secrets
import time
from array import array
from dataclasses import dataclass

from folio.config import KVTransferConfig
from folio.core.request import Request, RequestStatus
from folio.core.step_messages import KVTransferHold, KVTransferLoad, ModelRunnerOutput

logger = logging.getLogger(__name__)

# Bounds on a request's kv_transfer_params (every field that sizes work has one).
MAX_REMOTE_BLOCKS = 1 << 20
MAX_HOST_LEN = 255
_PARAM_KEYS = {"do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_host",
               "remote_port", "remote_block_ids", "remote_request_id", "remote_transfer_id",
               "remote_num_tokens", "remote_tokens_hash", "remote_block_size", "tp_size"}


def tokens_hash(token_ids: list[int]) -> str:
    """A prompt's fingerprint: a consumer checks it is fetching the KV of the same tokens."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()


@dataclass
class KVTransferParams:
    """A request's kv_transfer_params, checked."""
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: list[int] | None = None
    remote_transfer_id: str | None = None
    remote_num_tokens: int | None = None
    remote_tokens_hash: str | None = None
    remote_block_size: int | None = None
    remote_engine_id: str = ""


def parse_kv_transfer_params(value) -> KVTransferParams:
    """`value` (a request's kv_transfer_params) as KVTransferParams; a ValueError naming the
    field when it is malformed. vLLM's other keys (remote_engine_id, remote_request_id,
    tp_size) are accepted and not used."""
    name = "kv_transfer_params"
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, got {type(value).__name__}")
    unknown = sorted(set(value) - _PARAM_KEYS)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}")
    out = KVTransferParams()
    for key in ("do_remote_decode", "do_remote_prefill"):
        flag = value.get(key)
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"{name}.{key} must be a boolean, got {flag!r}")
        setattr(out, key, bool(flag))
    if out.do_remote_decode and out.do_remote_prefill:
        raise ValueError(f"{name}: do_remote_decode and do_remote_prefill exclude each other")
    if not out.do_remote_prefill:
        return out
    host = value.get("remote_host")
    if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_LEN:
        raise ValueError(f"{name}.remote_host must be a host address, got {host!r}")
    out.remote_host = host
    for key, low, high in (("remote_port", 1, 65535), ("remote_num_tokens", 1, 1 << 31),
                           ("remote_block_size", 1, 1 << 16)):
        number = value.get(key)
        if not isinstance(number, int) or isinstance(number, bool) or not low <= number <= high:
            raise ValueError(f"{name}.{key} must be an int in [{low}, {high}], got {number!r}")
        setattr(out, key, number)
    blocks = value.get("remote_block_ids")
    if (not isinstance(blocks, list) or not 0 < len(blocks) <= MAX_REMOTE_BLOCKS
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                       for b in blocks)):
        raise ValueError(f"{name}.remote_block_ids must be a list of 1 to {MAX_REMOTE_BLOCKS} "
                         "block ids (ints >= 0)")
    out.remote_block_ids = blocks
    engine = value.get("remote_engine_id")
    if engine is not None and (not isinstance(engine, str) or len(engine) > 128):
        raise ValueError(f"{name}.remote_engine_id must be a string of at most 128 "
                         f"characters, got {engine!r}")
    out.remote_engine_id = engine or ""
    for key in ("remote_transfer_id", "remote_tokens_hash"):
        text = value.get(key)
        if not isinstance(text, str) or not 0 < len(text) <= 128:
            raise ValueError(f"{name}.{key} must be a string of 1 to 128 characters, "
                             f"got {text!r}")
        setattr(out, key, text)
    return out


@dataclass
class P2PStats:
    """Cumulative: prompts a producer kept for consumers and those fetched from it;
    a consumer's fetches done, their tokens, and those that failed (computed instead)."""
    held_requests: int = 0
    sent_requests: int = 0
    received_requests: int = 0
    received_tokens: int = 0
    failed_requests: int = 0


class P2PConnectorScheduler:
    """The P2pConnector's scheduler side (a KVConnectorScheduler, folio/core/kv_connector.py)."""

    def __init__(self, config: KVTransferConfig, block_size: int, port: int) -> None:
        """`port`: where the producer's rank-0 worker serves (the executor reports it)."""
        self.config = config
        self.block_size = block_size
        self.port = port
        self.hold_timeout = float(config.p2p_option("hold_timeout"))
        self.engine_id = secrets.token_hex(8)
        self.stats_ = P2PStats()
        # producer: transfer id -> (the scheduler's key of the held blocks, expiry)
        self._holds: dict[str, tuple[str, float]] = {}
        self._releasing: set[str] = set()
        # consumer: fetches in flight (by the scheduler's key) -> (request id, the tokens it
        # brings); requests whose fetch failed or whose params were wrong (computed, never
        # fetched again)
        self._loading: dict[str, tuple[str, int]] = {}
        self._failed: set[str] = set()
        self._step_holds: list[KVTransferHold] = []
        self._step_releases: list[str] = []
        self._step_loads: list[KVTransferLoad] = []

    # ---- the consumer -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        # (a request that needs every prompt position's logits computes them all)
        if (params is None or not self.config.is_consumer or request.num_output_tokens
                or request.needs_every_prompt_token or request.request_id in self._failed):
            return 0, False
        try:
            parsed = parse_kv_transfer_params(params)
        except ValueError as exc:
            return self._refuse(request, str(exc))
        if not parsed.do_remote_prefill:
            return 0, False
        wanted = request.num_prompt_tokens - 1           # the last one is computed here
        problem = None
        if parsed.remote_block_size != self.block_size:
            problem = (f"the prefill server's block size {parsed.remote_block_size} is not "
                       f"{self.block_size}")
        elif parsed.remote_num_tokens != request.num_prompt_tokens \
                or parsed.remote_tokens_hash != tokens_hash(request.prompt_token_ids):
            problem = "the prefill server computed another prompt"
        elif len(parsed.remote_block_ids) * self.block_size < wanted:
            problem = "remote_block_ids do not cover the prompt"
        elif parsed.remote_host not in self.config.p2p_option("producer_hosts"):
            problem = (f"remote_host {parsed.remote_host!r} is not among the producer_hosts "
                       "of --kv-transfer-config")
        if problem is not None:
            return self._refuse(request, problem)
        return max(wanted - num_computed_tokens, 0), wanted > num_computed_tokens

    def _refuse(self, request: Request, problem: str) -> tuple[int, bool]:
        logger.warning("request %s: not fetching its KV (%s); it computes its prompt",
                       request.request_id, problem)
        self._failed.add(request.request_id)
        self.stats_.failed_requests += 1
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int, key: str) -> None:
        if not num_external_tokens:
            return
        parsed = parse_kv_transfer_params(request.kv_transfer_params)
        bs = self.block_size
        first = request.num_computed_tokens // bs        # device prefix hits are whole blocks
        last = -(-(request.num_computed_tokens + num_external_tokens) // bs)
        self._step_loads.append(KVTransferLoad(
            key, parsed.remote_transfer_id, parsed.remote_host,
            parsed.remote_port, parsed.remote_block_ids[first:last], list(block_ids[first:last]),
            parsed.remote_engine_id))
        self._loading[key] = (request.request_id, num_external_tokens)

    # ---- the producer -------------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int], key: str
                         ) -> tuple[bool, dict | None]:
        self._failed.discard(request.request_id)
        params = request.kv_transfer_params
        if (params is None or not self.config.is_producer
                or not params.get("do_remote_decode")
                or request.status not in (RequestStatus.FINISHED_STOPPED,
                                          RequestStatus.FINISHED_LENGTH_CAPPED)):
            return False, None
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        if len(block_ids) < num_blocks:
            return False, None
        transfer_id = secrets.token_hex(16)
        self._holds[transfer_id] = (key, time.monotonic() + self.hold_timeout)
        self._step_holds.append(KVTransferHold(transfer_id, list(block_ids[:num_blocks])))
        self.stats_.held_requests += 1
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
            "remote_host": self.config.kv_ip, "remote_port": self.port,
            "remote_block_ids": list(block_ids[:num_blocks]),
            "remote_transfer_id": transfer_id,
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_tokens_hash": tokens_hash(request.prompt_token_ids),
            "remote_block_size": self.block_size}

    def expired_holds(self, now: float) -> None:
        for transfer_id, (key, expiry) in self._holds.items():
            if now >= expiry and transfer_id not in self._releasing:
                logger.warning("request %s: no decode server fetched its KV in %g s; its "
                               "blocks are freed", key, self.hold_timeout)
                self._releasing.add(transfer_id)
                self._step_releases.append(transfer_id)

    # ---- both ---------------------------------------------------------------------------

    def build_connector_meta(self) -> dict:
        if not (self._step_holds or self._step_releases or self._step_loads):
            return {}
        meta = dict(kv_transfer_holds=self._step_holds, kv_transfer_releases=self._step_releases,
                    kv_transfer_loads=self._step_loads)
        self._step_holds, self._step_releases, self._step_loads = [], [], []
        return meta

    def update_connector_output(self, output: ModelRunnerOutput
                                ) -> tuple[list[str], list[tuple[str, bool]]]:
        freed = []
        for transfer_id in output.kv_transfer_sent:
            held = self._holds.pop(transfer_id, None)
            if held is None:
                continue
            if transfer_id in self._releasing:
                self._releasing.discard(transfer_id)
            else:
                self.stats_.sent_requests += 1
            freed.append(held[0])
        finished = []
        for key, ok in output.kv_transfer_received:
            loading = self._loading.pop(key, None)
            if loading is None:
                continue
            request_id, num_tokens = loading
            if ok:
                self.stats_.received_requests += 1
                self.stats_.received_tokens += num_tokens
            else:
                self._failed.add(request_id)
                self.stats_.failed_requests += 1
            finished.append((key, ok))
        return freed, finished

    def forget(self, request_id: str) -> None:
        """The request is gone for good (finished, its blocks freed)."""
        self._failed.discard(request_id)

    def reset(self) -> None:
        """The prefix cache was reset: nothing of this connector's lives there."""

    def has_pending_work(self) -> bool:
        return bool(self._holds or self._loading or self._step_holds or self._step_releases
                    or self._step_loads)

    def stats(self) -> dict:
        s = self.stats_
        return dict(kv_transfer_held_requests=s.held_requests,
                    kv_transfer_sent_requests=s.sent_requests,
                    kv_transfer_received_requests=s.received_requests,
                    kv_transfer_received_tokens=s.received_tokens,
                    kv_transfer_failed_requests=s.failed_requests)
