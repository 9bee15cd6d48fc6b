"""Disaggregated prefill on the worker's side (P2pConnector): a producer's worker serves the
KV of finished prompts' blocks to consumers; a consumer's worker fetches them into its own
blocks. The scheduler decides what is held and what is fetched (folio/core/kv_p2p.py); this
moves the bytes.

Transports. Between GPUs of one host (two servers on one GPU included): CUDA IPC
(folio/worker/cuda_ipc.py): the consumer maps the producer's cache tensors once and copies
the blocks device to device on a side stream; over the socket go only the request and the
confirmation. Otherwise (CPU caches, another host, a mapping that failed): ZMQ over TCP
between the two workers' processes (a DEALER per fetch, a ROUTER per producer rank), a fetch
one request frame and one reply of a header plus one frame per layer — the blocks' K and V,
staged in pinned host memory on a GPU producer and copied from the received frames on the
consumer, on side streams. NCCL (between hosts) and NIXL are not built: one GPU is lent here.

Blocks are read and written off the step loop, in threads, so that neither side's forward
passes wait for a transfer. That is safe because no step touches them meanwhile: a held
block belongs to a finished request the producer does not free until the consumer is done
(or the hold is released, which waits for a read in progress), and a fetched block belongs
to a request the consumer schedules only after the fetch is reported.

Anything wrong on the way (the producer gone, a timeout, an unknown transfer id, another
model's layout) fails the fetch; the consumer's scheduler then computes the prompt itself.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import msgspec
import torch
import zmq

from folio.config import KVTransferConfig
from folio.core.step_messages import KVTransferHold, KVTransferLoad
from folio.worker.cuda_ipc import IpcTensor, export_tensors, import_tensors

logger = logging.getLogger(__name__)

# Fetches run at once on a consumer (each one thread, one connection).
_MAX_FETCHES = 4
# How often the producer's thread wakes to look at parked fetches and whether to stop.
_POLL_MS = 50
# Fetches a producer keeps waiting for their hold at once; more are refused (anyone who can
# reach the port can send fetches).
_MAX_PARKED = 4096
# The producer's answer to a "handles" request whose transfer id it does not hold (yet).
_NOT_HELD = "transfer not held"


class _FetchRequest(msgspec.Struct, array_like=True):
    op: str                      # "get", "done" or "handles" (CUDA IPC)
    transfer_id: str
    block_ids: list[int] = []
    # "get" over CUDA IPC: check the hold, send no bytes (the consumer copies on the GPU)
    ipc: bool = False


class _FetchReply(msgspec.Struct, array_like=True):
    ok: bool
    error: str = ""
    layout_id: str = ""
    # per layer: the dtype's name and the shape of the blocks sent, [planes, n, ...]
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    # "handles": the cache tensors' CUDA IPC handles
    ipc: list[IpcTensor] = []


class P2PKVTransfer:
    def __init__(self, config: KVTransferConfig, kv_caches: Callable[[], list[torch.Tensor]],
                 rank: int, layout_id: str) -> None:
        """`kv_caches` returns the worker's cache tensors (a function: sleep mode may
        reallocate them); `layout_id` names the model, dtype and layout, so a consumer never
        takes another model's KV."""
        self._config = config
        self._kv_caches = kv_caches
        self._rank = rank
        self._layout_id = layout_id
        self._timeout = float(config.p2p_option("transfer_timeout"))
        self._allowed_hosts = set(config.p2p_option("producer_hosts"))
        # CUDA IPC: (host, port, producer engine id) -> its cache tensors mapped here, or
        # None when that failed (then bytes through host memory)
        self._ipc: dict[tuple[str, int, str], list[torch.Tensor] | None] = {}
        self._ipc_lock = threading.Lock()
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._holds: dict[str, list[int]] = {}
        self._sent: list[str] = []                        # fetched or released transfer ids
        self._received: list[tuple[str, bool]] = []
        self._in_flight = 0
        self._event = threading.Event()                   # a result is ready to report
        self._closed = False
        self.port = 0
        self._server: threading.Thread | None = None
        self._fetches: ThreadPoolExecutor | None = None
        cuda = bool(kv_caches()) and kv_caches()[0].device.type == "cuda"
        self._stream = torch.cuda.Stream(kv_caches()[0].device) if cuda else None
        if config.is_producer:
            socket = self._ctx.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            if config.kv_port:
                self.port = config.kv_port + rank
                socket.bind(f"tcp://{config.kv_ip}:{self.port}")
            else:
                self.port = socket.bind_to_random_port(f"tcp://{config.kv_ip}")
            self._server = threading.Thread(target=self._serve, args=(socket,), daemon=True,
                                            name="folio-kv-p2p-server")
            self._server.start()
            logger.info("KV transfer (producer): rank %d serves on %s:%d", rank,
                        config.kv_ip, self.port)
        if config.alias_of is not None:
            logger.info("kv_connector %s: folio runs its P2pConnector in its place (the same "
                        "roles and kv_transfer_params; transport: ZMQ through host memory)",
                        config.alias_of)
        if config.is_consumer:
            self._fetches = ThreadPoolExecutor(_MAX_FETCHES, thread_name_prefix="folio-kv-p2p")

    # ---- the step's part (the worker's main thread) --------------------------------------

    def start_load_kv(self, step, kv_caches: list[torch.Tensor]) -> None:
        """KVConnectorWorker (folio/worker/kv_connector.py): the step's holds, releases and
        fetches."""
        self.apply(step.kv_transfer_holds, step.kv_transfer_releases, step.kv_transfer_loads)

    def get_finished(self, step, pending) -> None:
        """KVConnectorWorker: transfers finished so far into the step's output. A step with
        nothing to run is the engine polling for them: wait a little for one rather than
        have the engine spin."""
        pending.kv_transfer_sent, pending.kv_transfer_received = self.take_results(
            wait=0.005 if not step.total_num_scheduled_tokens else 0.0)

    def apply(self, holds: list[KVTransferHold], releases: list[str],
              loads: list[KVTransferLoad]) -> None:
        """A step's transfer work: new holds, released ones (reported as sent once no read
        of theirs is in progress), fetches to start."""
        with self._lock:                 # the server reads a hold's blocks under this lock
            for hold in holds:
                self._holds[hold.transfer_id] = list(hold.block_ids)
            for transfer_id in releases:
                if self._holds.pop(transfer_id, None) is not None:
                    self._sent.append(transfer_id)
            if releases:
                self._event.set()
        for load in loads:
            with self._lock:
                self._in_flight += 1
            if self._fetches is None:      # a producer only: it never fetches
                self._finish(load.req_id, False)
            else:
                self._fetches.submit(self._fetch, load)

    def take_results(self, wait: float = 0.0) -> tuple[list[str], list[tuple[str, bool]]]:
        """(transfer ids fetched or released, fetches finished) since the last call; with
        `wait`, up to that many seconds for one when there is none yet and work is pending."""
        if wait and not self._sent and not self._received and self.busy:
            self._event.wait(wait)
        with self._lock:
            sent, self._sent = self._sent, []
            received, self._received = self._received, []
            self._event.clear()
        return sent, received

    @property
    def busy(self) -> bool:
        return bool(self._in_flight or self._holds)

    def close(self) -> None:
        self._closed = True
        if self._fetches is not None:
            self._fetches.shutdown(wait=False, cancel_futures=True)
        if self._server is not None:
            self._server.join(timeout=1.0)    # it closes its socket and the context
        else:
            self._ctx.term()

    # ---- the producer's server thread ----------------------------------------------------

    def _serve(self, socket: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        parked: list[tuple[float, bytes, _FetchRequest]] = []   # (deadline, peer, request)
        try:
            while not self._closed:
                if poller.poll(_POLL_MS):
                    frames = socket.recv_multipart()
                    try:
                        peer, payload = frames      # a DEALER's one frame, after its identity
                        request = msgspec.msgpack.decode(payload, type=_FetchRequest)
                    except (ValueError, msgspec.DecodeError):
                        continue     # not a fetch: ignored (the sender times out)
                    if request.op == "done":
                        self._done(request.transfer_id)
                    elif request.op == "handles":
                        self._send_handles(socket, peer, request.transfer_id)
                    elif not self._reply(socket, peer, request):
                        # The hold may come with the next step (the consumer can be quicker
                        # than the producer's step loop): wait for it, up to the timeout.
                        if len(parked) >= _MAX_PARKED:
                            self._send_error(socket, peer, "too many fetches waiting")
                        else:
                            parked.append((time.monotonic() + self._timeout, peer, request))
                if parked:
                    now = time.monotonic()
                    still = []
                    for deadline, peer, request in parked:
                        if self._reply(socket, peer, request):
                            continue
                        if now >= deadline:
                            self._send_error(socket, peer, f"unknown transfer "
                                             f"{request.transfer_id[:8]}… (released or expired)")
                        else:
                            still.append((deadline, peer, request))
                    parked = still
        finally:
            socket.close(0)
            self._ctx.term()

    def _reply(self, socket: zmq.Socket, peer: bytes, request: _FetchRequest) -> bool:
        """Send the blocks a fetch asks for; False while its transfer id is not held."""
        with self._lock:
            held = self._holds.get(request.transfer_id)
            if held is None:
                return False
            if not set(request.block_ids) <= set(held):
                self._send_error(socket, peer, "asked for blocks the transfer does not hold")
                return True
            if request.ipc:      # the consumer reads the blocks itself, on the GPU
                socket.send_multipart([peer, msgspec.msgpack.encode(
                    _FetchReply(True, layout_id=self._layout_id))])
                return True
            try:
                frames, dtypes, shapes = self._read_blocks(request.block_ids)
            except Exception as exc:          # noqa: BLE001 - a failed read fails the fetch
                logger.warning("KV transfer: reading blocks failed: %s", exc)
                self._send_error(socket, peer, f"reading the blocks failed: {exc}")
                return True
        header = _FetchReply(True, layout_id=self._layout_id, dtypes=dtypes, shapes=shapes)
        socket.send_multipart([peer, msgspec.msgpack.encode(header), *frames], copy=False)
        return True

    def _read_blocks(self, block_ids: list[int]) -> tuple[list, list[str], list[list[int]]]:
        caches = self._kv_caches()
        device = caches[0].device
        index = torch.tensor(block_ids, dtype=torch.int64, device=device)
        frames, dtypes, shapes, staged = [], [], [], []
        with torch.inference_mode(), _on_stream(self._stream):
            for cache in caches:
                blocks = cache.index_select(1, index)
                if blocks.is_cuda:
                    # pinned staging: the copy is one DMA at the link's speed (torch's host
                    # allocator keeps the pinned blocks for the next fetch)
                    host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
                    blocks = host.copy_(blocks, non_blocking=True)
                staged.append(blocks)
                dtypes.append(str(cache.dtype).removeprefix("torch."))
                shapes.append(list(blocks.shape))
            if self._stream is not None:
                self._stream.synchronize()
        for blocks in staged:
            frames.append(blocks.contiguous().view(torch.uint8).numpy())
        return frames, dtypes, shapes

    def _send_handles(self, socket: zmq.Socket, peer: bytes, transfer_id: str) -> None:
        """The cache tensors' CUDA IPC handles, to a consumer that presents a transfer id
        held now (it got a prefill answer). The handles map the whole cache: processes on
        this host that may reach the port are trusted as far as that (kv_ip is loopback
        unless the operator says otherwise)."""
        with self._lock:
            held = transfer_id in self._holds
        if not held:
            self._send_error(socket, peer, _NOT_HELD)
            return
        caches = self._kv_caches()
        if self._stream is None:
            self._send_error(socket, peer, "the producer's KV cache is not on a GPU")
            return
        try:
            handles = export_tensors(caches)
        except Exception as exc:       # noqa: BLE001 - the consumer falls back to bytes
            self._send_error(socket, peer, f"no CUDA IPC: {exc}")
            return
        socket.send_multipart([peer, msgspec.msgpack.encode(
            _FetchReply(True, layout_id=self._layout_id, ipc=handles))])

    def _done(self, transfer_id: str) -> None:
        with self._lock:
            if self._holds.pop(transfer_id, None) is not None:
                self._sent.append(transfer_id)
                self._event.set()

    @staticmethod
    def _send_error(socket: zmq.Socket, peer: bytes, error: str) -> None:
        socket.send_multipart([peer, msgspec.msgpack.encode(_FetchReply(False, error=error))])

    # ---- the consumer's fetches ----------------------------------------------------------

    def _fetch(self, load: KVTransferLoad) -> None:
        ok = False
        start = time.perf_counter()
        try:
            ok = self._fetch_blocks(load)
        except Exception as exc:              # noqa: BLE001 - any failure means recompute
            logger.warning("KV transfer for %s failed (%s); it computes its prompt instead",
                           load.req_id, exc)
        if ok:
            logger.debug("KV transfer for %s: %d blocks in %.1f ms, ended at %.3f",
                         load.req_id, len(load.local_block_ids),
                         1e3 * (time.perf_counter() - start), time.time())
        self._finish(load.req_id, ok)

    def _finish(self, req_id: str, ok: bool) -> None:
        with self._lock:
            self._received.append((req_id, ok))
            self._in_flight -= 1
            self._event.set()

    def _fetch_blocks(self, load: KVTransferLoad) -> bool:
        if load.host not in self._allowed_hosts:
            raise ValueError(f"host {load.host!r} is not among the producer_hosts "
                             f"{sorted(self._allowed_hosts)}")
        if len(load.remote_block_ids) != len(load.local_block_ids):
            raise ValueError("remote and local block counts differ")
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 1000)      # let "done" leave before the socket closes
        try:
            socket.connect(f"tcp://{load.host}:{load.port + self._rank}")
            remote = self._remote_caches(socket, load)
            socket.send(msgspec.msgpack.encode(_FetchRequest(
                "get", load.transfer_id, list(load.remote_block_ids), ipc=remote is not None)))
            frames = self._answer(socket, load)
            header = msgspec.msgpack.decode(frames[0].buffer, type=_FetchReply)
            if not header.ok:
                raise ValueError(f"the producer refused: {header.error}")
            if remote is not None:
                self._copy_on_gpu(remote, load)
            else:
                self._write_blocks(header, frames[1:], load.local_block_ids)
            socket.send(msgspec.msgpack.encode(_FetchRequest("done", load.transfer_id)))
        finally:
            socket.close()
        return True

    def _answer(self, socket: zmq.Socket, load: KVTransferLoad) -> list:
        if not socket.poll(int(self._timeout * 1000)):
            raise TimeoutError(f"no answer from {load.host}:{load.port + self._rank} in "
                               f"{self._timeout:g} s")
        return socket.recv_multipart(copy=False)

    def _remote_caches(self, socket: zmq.Socket, load: KVTransferLoad
                       ) -> list[torch.Tensor] | None:
        """The producer's cache tensors mapped here (CUDA IPC), when both caches are on
        GPUs of this host; None otherwise, or when mapping failed once (the bytes then go
        through host memory). Asked once per producer engine."""
        if self._stream is None or not load.remote_engine_id \
                or not ipaddress_is_loopback(load.host):
            return None
        key = (load.host, load.port + self._rank, load.remote_engine_id)
        with self._ipc_lock:
            if key in self._ipc:
                return self._ipc[key]
            tensors = None
            try:
                socket.send(msgspec.msgpack.encode(_FetchRequest("handles", load.transfer_id)))
                header = msgspec.msgpack.decode(self._answer(socket, load)[0].buffer,
                                                type=_FetchReply)
                if header.error == _NOT_HELD:
                    return None        # its hold is not announced yet: asked again next time
                if not header.ok or header.layout_id != self._layout_id:
                    raise ValueError(header.error or "another model, dtype or KV layout")
                tensors = import_tensors(header.ipc)
                caches = self._kv_caches()
                if len(tensors) != len(caches) or any(
                        t.dtype != c.dtype or t.shape[0] != c.shape[0]
                        or t.shape[2:] != c.shape[2:] for t, c in zip(tensors, caches)):
                    raise ValueError("the producer's cache tensors do not match this one's")
                logger.info("KV transfer: CUDA IPC with the producer at %s:%d", key[0], key[1])
            except TimeoutError:
                raise
            except Exception as exc:      # noqa: BLE001 - the bytes go through the host
                logger.info("KV transfer: no CUDA IPC with %s:%d (%s); through host memory",
                            key[0], key[1], exc)
                tensors = None
            self._ipc[key] = tensors
            return tensors

    def _copy_on_gpu(self, remote: list[torch.Tensor], load: KVTransferLoad) -> None:
        caches = self._kv_caches()
        device = caches[0].device
        local = torch.tensor(load.local_block_ids, dtype=torch.int64, device=device)
        with torch.inference_mode(), _on_stream(self._stream):
            theirs = torch.tensor(load.remote_block_ids, dtype=torch.int64,
                                  device=remote[0].device)
            for cache, source in zip(caches, remote):
                if max(load.remote_block_ids) >= source.shape[1]:
                    raise ValueError("remote block ids past the producer's cache")
                cache.index_copy_(1, local, source.index_select(1, theirs).to(device))
            self._stream.synchronize()

    def _write_blocks(self, header: _FetchReply, frames: list, block_ids: list[int]) -> None:
        if header.layout_id != self._layout_id:
            raise ValueError("the producer runs another model, dtype or KV layout")
        caches = self._kv_caches()
        if len(frames) != len(caches) or len(header.shapes) != len(caches):
            raise ValueError(f"{len(frames)} layers sent, {len(caches)} expected")
        device = caches[0].device
        index = torch.tensor(block_ids, dtype=torch.int64, device=device)
        with torch.inference_mode(), _on_stream(self._stream):
            for cache, frame, shape, dtype in zip(caches, frames, header.shapes, header.dtypes):
                want = [cache.shape[0], len(block_ids), *cache.shape[2:]]
                if shape != want or dtype != str(cache.dtype).removeprefix("torch."):
                    raise ValueError(f"a layer came as {dtype} {shape}, expected {want}")
                data = torch.frombuffer(frame.buffer, dtype=torch.uint8)
                if data.numel() != cache[:, :len(block_ids)].numel() * cache.element_size():
                    raise ValueError("a layer's bytes do not match its shape")
                blocks = data.view(cache.dtype).view(want)
                cache.index_copy_(1, index, blocks.to(device, non_blocking=True)
                                  if device.type == "cuda" else blocks)
            if self._stream is not None:
                self._stream.synchronize()


class _on_stream:
    """`torch.cuda.stream(s)` when there is a side stream, else nothing (the CPU)."""

    def __init__(self, stream) -> None:
        self._context = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        if self._context is not None:
            self._context.__enter__()

    def __exit__(self, *exc) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)


def ipaddress_is_loopback(host: str) -> bool:
    """Whether `host` is this machine (CUDA IPC needs the producer on the same host)."""
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
