"""`python -m folio.bench.step_transport`: how long one step's messages take to cross to a
worker process and back, over the mp executor's transport (ZMQ ipc PUSH/PULL) and over a
shared-memory mailbox (a sequence counter and a length in front of the payload, both sides
spinning on the counter), for realistic step messages: a decode step of N requests (each a
diff of one token, every 16th a new block) and its reply, and a step that admits N new
requests (their prompts and sampling parameters) — plus the msgpack encode/decode itself.

What the numbers decide: the mp executor broadcasts each step to its workers; the transport
is worth optimizing only if a round trip is a noticeable part of a step (≈1 ms at batch 1 on
the H200)."""
from __future__ import annotations

import argparse
import os
import statistics
import struct
import time
from multiprocessing import get_context, shared_memory

from folio.core.step_messages import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                      SchedulerOutput)
from folio.executor import step_codec
from folio.sampling_params import SamplingParams

# The mailbox: [sequence number][payload length][payload]. The writer puts the payload, then
# the length, then the sequence number, each its own store; the reader reads the number first.
_SEQ = struct.Struct("<Q")
_HEADER_SIZE = 16
_STOP = 2**63  # the sequence number that ends the far side


def decode_step_message(num_reqs: int) -> SchedulerOutput:
    cached = [CachedRequestData(f"req-{i}", [[1000 + i] if i % 16 == 0 else []], [7], 500 + i)
              for i in range(num_reqs)]
    rids = [c.req_id for c in cached]
    return SchedulerOutput(1, [], cached, dict.fromkeys(rids, 1), num_reqs, rids, [], [])


def prefill_step_message(num_reqs: int, prompt_len: int) -> SchedulerOutput:
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=256)
    new = [NewRequestData(f"req-{i}", list(range(prompt_len)), params, [2],
                          [list(range(i * 40, i * 40 + prompt_len // 16 + 1))], 0)
           for i in range(num_reqs)]
    rids = [n.req_id for n in new]
    return SchedulerOutput(1, new, [], dict.fromkeys(rids, prompt_len), num_reqs * prompt_len,
                           rids, [], [])


def reply_message(num_reqs: int) -> ModelRunnerOutput:
    return ModelRunnerOutput([f"req-{i}" for i in range(num_reqs)], [[9]] * num_reqs)


# ---- the far side, in a spawned process --------------------------------------------------

def _zmq_echo(in_addr: str, out_addr: str, reply: bytes) -> None:
    import zmq
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    while True:
        data = inbox.recv(copy=False)
        if len(data) == 0:
            break
        step_codec.decode_step(data.buffer)
        outbox.send(reply)
    inbox.close(0)
    outbox.close(0)
    ctx.term()


def _shm_echo(in_name: str, out_name: str, reply: bytes) -> None:
    inbox = shared_memory.SharedMemory(in_name)
    outbox = shared_memory.SharedMemory(out_name)
    seen = 0
    try:
        while True:
            seq = _SEQ.unpack_from(inbox.buf, 0)[0]
            if seq == seen:
                # Spin (a worker waiting for its next step has nothing else to do), yielding
                # the core: two spinning processes on a small host otherwise starve each other.
                os.sched_yield()
                continue
            seen = seq
            if seq == _STOP:
                break
            length = _SEQ.unpack_from(inbox.buf, 8)[0]
            if length == 0:  # the stop message's empty payload (no step is empty)
                break
            step_codec.decode_step(bytes(inbox.buf[_HEADER_SIZE:_HEADER_SIZE + length]))
            _shm_write(outbox, seen, reply)
    finally:
        inbox.close()
        outbox.close()


def _shm_write(box: shared_memory.SharedMemory, seq: int, payload: bytes) -> None:
    box.buf[_HEADER_SIZE:_HEADER_SIZE + len(payload)] = payload
    _SEQ.pack_into(box.buf, 8, len(payload))
    # The number last: the reader sees it only once the payload and its length are in place.
    _SEQ.pack_into(box.buf, 0, seq)


def _shm_read(box: shared_memory.SharedMemory, seq: int) -> bytes:
    while True:
        if _SEQ.unpack_from(box.buf, 0)[0] == seq:
            length = _SEQ.unpack_from(box.buf, 8)[0]
            return bytes(box.buf[_HEADER_SIZE:_HEADER_SIZE + length])
        os.sched_yield()


# ---- the near side -------------------------------------------------------------------------

def time_zmq(step: bytes, reply: bytes, iters: int) -> list[float]:
    import tempfile
    import zmq
    ctx = zmq.Context()
    tmp = tempfile.mkdtemp(prefix="folio-transport-")
    out_addr, in_addr = f"ipc://{tmp}/step", f"ipc://{tmp}/reply"
    outbox, inbox = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    outbox.bind(out_addr)
    inbox.bind(in_addr)
    proc = get_context("spawn").Process(target=_zmq_echo, args=(out_addr, in_addr, reply))
    proc.start()
    times = []
    for i in range(iters + 10):
        start = time.perf_counter()
        outbox.send(step, copy=False)
        step_codec.decode_output(inbox.recv())
        if i >= 10:
            times.append(time.perf_counter() - start)
    outbox.send(b"")
    proc.join()
    outbox.close(0)
    inbox.close(0)
    ctx.term()
    return times


def time_shm(step: bytes, reply: bytes, iters: int) -> list[float]:
    size = _HEADER_SIZE + max(len(step), len(reply)) + 64
    out_box = shared_memory.SharedMemory(create=True, size=size)
    in_box = shared_memory.SharedMemory(create=True, size=size)
    out_box.buf[:_HEADER_SIZE] = bytes(_HEADER_SIZE)
    in_box.buf[:_HEADER_SIZE] = bytes(_HEADER_SIZE)
    proc = get_context("spawn").Process(target=_shm_echo,
                                        args=(out_box.name, in_box.name, reply))
    proc.start()
    times = []
    try:
        for i in range(iters + 10):
            start = time.perf_counter()
            _shm_write(out_box, i + 1, step)
            step_codec.decode_output(_shm_read(in_box, i + 1))
            if i >= 10:
                times.append(time.perf_counter() - start)
        _shm_write(out_box, _STOP, b"")
        proc.join()
    finally:
        for box in (out_box, in_box):
            box.close()
            box.unlink()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m folio.bench.step_transport")
    parser.add_argument("--num-reqs", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--iters", type=int, default=500)
    args = parser.parse_args(argv)
    reply_cache: dict[int, bytes] = {}
    print("message | bytes | encode+decode µs | ZMQ ipc round trip µs (median) | "
          "shared memory round trip µs (median)")
    for n in args.num_reqs:
        for label, message in ((f"decode step, {n} requests", decode_step_message(n)),
                               (f"{n} new requests of 512 tokens", prefill_step_message(n, 512))):
            data = step_codec.encode(message)
            reply = reply_cache.setdefault(n, step_codec.encode(reply_message(n)))
            start = time.perf_counter()
            for _ in range(50):
                step_codec.decode_step(step_codec.encode(message))
            codec_us = (time.perf_counter() - start) / 50 * 1e6
            zmq_us = statistics.median(time_zmq(data, reply, args.iters)) * 1e6
            shm_us = statistics.median(time_shm(data, reply, args.iters)) * 1e6
            print(f"{label} | {len(data)} | {codec_us:.1f} | {zmq_us:.1f} | {shm_us:.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
