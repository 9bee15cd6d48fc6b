"""Disaggregated prefill on the worker's side (folio/worker/kv_p2p.py), on the CPU: a producer
serves held blocks over ZMQ on 127.0.0.1, a consumer fetches them into its own blocks; an
unknown transfer, another layout, a host outside producer_hosts or blocks outside the hold
fail the fetch (the scheduler then computes the prompt); a fetch that comes before its hold
waits for it."""
from __future__ import annotations

import time

import pytest
import torch

from folio.config import KVTransferConfig
from folio.core.step_messages import KVTransferHold, KVTransferLoad
from folio.worker.kv_p2p import P2PKVTransfer

LAYERS, BS, HEADS, WIDTH = 2, 4, 2, 8
WAIT = 15.0                     # generous: the machine may be busy


def _caches(num_blocks: int, random: bool) -> list[torch.Tensor]:
    make = torch.randn if random else torch.zeros
    return [make(2, num_blocks, BS, HEADS, WIDTH, dtype=torch.float32) for _ in range(LAYERS)]


@pytest.fixture
def make_pair():
    """make_pair(...) -> (producer, consumer, producer caches, consumer caches); both
    transfers are closed when the test ends, passed or not."""
    made: list[P2PKVTransfer] = []

    def make(consumer_extra: dict | None = None, consumer_layout: str = "model-a",
             consumer_blocks: int = 6, timeout: float = 5.0):
        pcache, ccache = _caches(8, True), _caches(consumer_blocks, False)
        producer = P2PKVTransfer(
            KVTransferConfig("P2pConnector", "kv_producer", {"transfer_timeout": timeout},
                             kv_ip="127.0.0.1", kv_port=0), lambda: pcache, 0, "model-a")
        made.append(producer)
        consumer = P2PKVTransfer(
            KVTransferConfig("P2pConnector", "kv_consumer",
                             {"transfer_timeout": timeout, **(consumer_extra or {})},
                             kv_ip="127.0.0.1", kv_port=0), lambda: ccache, 0, consumer_layout)
        made.append(consumer)
        assert producer.port > 0
        return producer, consumer, pcache, ccache

    yield make
    for transfer in made:
        transfer.close()


def _results(transfer: P2PKVTransfer, sent: int = 0, received: int = 0,
             timeout: float = WAIT) -> tuple[list[str], list[tuple[str, bool]]]:
    """take_results until `sent` and `received` results came (or the timeout)."""
    all_sent, all_received = [], []
    deadline = time.monotonic() + timeout
    while (len(all_sent) < sent or len(all_received) < received) and time.monotonic() < deadline:
        got_sent, got_received = transfer.take_results(wait=0.05)
        all_sent += got_sent
        all_received += got_received
        if not got_sent and not got_received:
            time.sleep(0.01)
    return all_sent, all_received


def _load(producer: P2PKVTransfer, remote: list[int], local: list[int], req_id: str = "r1",
          transfer_id: str = "t1", host: str = "127.0.0.1") -> KVTransferLoad:
    return KVTransferLoad(req_id, transfer_id, host, producer.port, remote, local)


def _assert_untouched(ccache: list[torch.Tensor]) -> None:
    assert all(not layer.any() for layer in ccache)


def test_fetch_copies_the_held_blocks(make_pair) -> None:
    producer, consumer, pcache, ccache = make_pair()
    remote, local = [5, 2, 7], [0, 3, 1]
    producer.apply([KVTransferHold("t1", remote)], [], [])
    assert producer.busy
    consumer.apply([], [], [_load(producer, remote, local)])
    assert _results(consumer, received=1)[1] == [("r1", True)]
    assert _results(producer, sent=1)[0] == ["t1"]
    for p_layer, c_layer in zip(pcache, ccache):
        assert torch.equal(c_layer[:, local], p_layer[:, remote])
        assert not c_layer[:, [2, 4, 5]].any()          # no other block written
    assert not producer.busy and not consumer.busy
    assert not torch.equal(pcache[0][:, 5], pcache[0][:, 2])   # the blocks tell apart


def test_a_fetch_before_its_hold_waits_for_it(make_pair) -> None:
    producer, consumer, pcache, ccache = make_pair()
    consumer.apply([], [], [_load(producer, [1, 6], [4, 5])])
    time.sleep(0.2)
    assert consumer.take_results() == ([], [])          # still waiting for the hold
    producer.apply([KVTransferHold("t1", [1, 6])], [], [])
    assert _results(consumer, received=1)[1] == [("r1", True)]
    assert _results(producer, sent=1)[0] == ["t1"]
    for p_layer, c_layer in zip(pcache, ccache):
        assert torch.equal(c_layer[:, [4, 5]], p_layer[:, [1, 6]])


def test_an_unknown_transfer_fails_after_the_timeout(make_pair) -> None:
    producer, consumer, _, ccache = make_pair(timeout=1.0)
    producer.apply([KVTransferHold("t1", [1])], [], [])
    consumer.apply([], [], [_load(producer, [1], [0], transfer_id="not-held")])
    assert _results(consumer, received=1)[1] == [("r1", False)]
    _assert_untouched(ccache)
    assert _results(producer, timeout=0.2) == ([], []) and producer.busy   # t1 still held


def test_another_layout_fails_and_the_hold_stays(make_pair) -> None:
    producer, consumer, _, ccache = make_pair(consumer_layout="model-b")
    producer.apply([KVTransferHold("t1", [1, 2])], [], [])
    consumer.apply([], [], [_load(producer, [1, 2], [0, 1])])
    assert _results(consumer, received=1)[1] == [("r1", False)]
    _assert_untouched(ccache)
    # never "done": the producer keeps the blocks until the scheduler releases them
    assert _results(producer, timeout=0.3) == ([], [])
    producer.apply([], ["t1"], [])
    assert _results(producer, sent=1)[0] == ["t1"] and not producer.busy


def test_a_host_outside_producer_hosts_fails(make_pair) -> None:
    producer, consumer, _, ccache = make_pair(consumer_extra={"producer_hosts": ["10.0.0.1"]})
    producer.apply([KVTransferHold("t1", [1])], [], [])
    consumer.apply([], [], [_load(producer, [1], [0])])
    assert _results(consumer, received=1, timeout=3.0)[1] == [("r1", False)]
    _assert_untouched(ccache)
    assert _results(producer, timeout=0.3) == ([], [])   # never connected


def test_blocks_outside_the_hold_and_mismatched_lists_fail(make_pair) -> None:
    producer, consumer, _, ccache = make_pair()
    producer.apply([KVTransferHold("t1", [1, 2])], [], [])
    consumer.apply([], [], [_load(producer, [1, 3], [0, 1], req_id="outside"),
                            _load(producer, [1, 2], [0], req_id="counts")])
    assert sorted(_results(consumer, received=2)[1]) == [("counts", False), ("outside", False)]
    _assert_untouched(ccache)
    assert consumer.take_results() == ([], []) and not consumer.busy


def test_a_producer_only_fails_loads_and_reports_releases(make_pair) -> None:
    producer, _, _, _ = make_pair()
    producer.apply([KVTransferHold("t1", [1]), KVTransferHold("t2", [2])], ["t1", "unknown"],
                   [KVTransferLoad("r9", "x", "127.0.0.1", 1, [0], [0])])
    sent, received = _results(producer, sent=1, received=1)
    assert (sent, received) == (["t1"], [("r9", False)]) and producer.busy     # t2 held


def test_a_stray_multi_frame_message_does_not_stop_the_server(make_pair) -> None:
    import zmq
    producer, consumer, pcache, ccache = make_pair(timeout=1.0)
    context = zmq.Context()
    stray = context.socket(zmq.DEALER)
    try:
        stray.setsockopt(zmq.LINGER, 0)
        stray.connect(f"tcp://127.0.0.1:{producer.port}")
        stray.send_multipart([b"not", b"a fetch"])    # e.g. what a REQ socket sends
        time.sleep(0.2)
    finally:
        stray.close()
        context.term()
    producer.apply([KVTransferHold("t1", [3])], [], [])
    consumer.apply([], [], [_load(producer, [3], [0])])
    assert _results(consumer, received=1)[1] == [("r1", True)]
    assert torch.equal(ccache[0][:, 0], pcache[0][:, 3])


def test_cuda_ipc_handles_need_a_held_transfer_and_a_gpu(make_pair) -> None:
    """A "handles" request (CUDA IPC) is answered only for a transfer held now, and a
    producer whose cache is not on a GPU refuses it (the consumer then fetches bytes)."""
    import msgspec
    import zmq

    from folio.worker.kv_p2p import ipaddress_is_loopback
    producer, _, _, _ = make_pair()
    producer.apply([KVTransferHold("t1", [1, 2])], [], [])
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.connect(f"tcp://127.0.0.1:{producer.port}")
    try:
        for transfer_id, error in (("nope", "transfer not held"),
                                   ("t1", "not on a GPU")):
            socket.send(msgspec.msgpack.encode(["handles", transfer_id, [], False]))
            assert socket.poll(5000)
            ok, message = msgspec.msgpack.decode(socket.recv())[:2]
            assert not ok and error in message
    finally:
        socket.close(0)
    assert ipaddress_is_loopback("127.0.0.1") and ipaddress_is_loopback("::1")
    assert ipaddress_is_loopback("localhost") and not ipaddress_is_loopback("10.0.0.2")
    assert not ipaddress_is_loopback("example.com")
