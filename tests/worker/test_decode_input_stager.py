"""DecodeInputStager (the CUDA-graph runner's host-side input fill) keeps block-table rows
between steps and rewrites only what changed; over random step sequences — requests
finishing, joining, changing rows, growing, being preempted (a new block list) — every step's
staged inputs must equal a from-scratch fill. Pure numpy: runs on the CPU."""
from __future__ import annotations

import random

import numpy as np
import pytest

from folio.core.request import Request
from folio.core.scheduler import ScheduledRequest
from folio.sampling_params import SamplingParams
from folio.worker.cuda_graphs import DecodeInputStager

BS = 4
N, W = 16, 12


def _buffers():
    return (np.full(N, 99, np.int64), np.full(N, 99, np.int64), np.full(N, 99, np.int64),
            np.full(N, 99, np.int32), np.full((N, W), 99, np.int32))


def _expected(scheduled, padded):
    ids, pos, slots, seq = [], [], [], []
    for item in scheduled:
        p = item.num_computed_tokens
        known = item.request.all_token_ids
        ids.append(known[p] if p < len(known) else 0)
        pos.append(p)
        slots.append(item.block_ids[p // BS] * BS + p % BS)
        seq.append(p + 1)
    pad = padded - len(scheduled)
    return (ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad, seq + [1] * pad)


@pytest.mark.parametrize("seed", range(20))
def test_staged_inputs_equal_a_fresh_fill(seed):
    rng = random.Random(seed)
    stager = DecodeInputStager(*_buffers(), block_size=BS)
    live: dict[str, tuple[Request, list[int]]] = {}
    next_block = [0]

    def new_blocks(count):
        out = list(range(next_block[0], next_block[0] + count))
        next_block[0] += count
        return out

    counter = 0
    for _ in range(60):
        # Requests leave, join, get preempted (their block list replaced by a new object).
        for rid in list(live):
            if rng.random() < 0.15:
                del live[rid]
            elif rng.random() < 0.1:
                req, blocks = live[rid]
                live[rid] = (req, list(blocks))
        while len(live) < rng.randint(1, N):
            counter += 1
            length = rng.randint(1, W * BS - 2)
            req = Request(f"r{counter}", list(range(10, 10 + length)), SamplingParams(),
                          block_size=BS, max_model_len=W * BS)
            live[req.request_id] = (req, new_blocks(-(-(length + 1) // BS)))
        # Each decodes its next position; some grow past their last block.
        order = list(live)
        rng.shuffle(order)
        scheduled = []
        for rid in order:
            req, blocks = live[rid]
            if len(req.all_token_ids) >= W * BS - 1:
                del live[rid]
                continue
            p = len(req.all_token_ids) - (0 if rng.random() < 0.3 else 1)  # 30%: pending input
            while len(blocks) * BS < p + 1:
                blocks.extend(new_blocks(1))
            scheduled.append(ScheduledRequest(req, p, 1, blocks, samples=True))
        if not scheduled:
            continue
        padded = min(N, len(scheduled) + rng.choice([0, 0, 1, 3]))
        stager.fill(scheduled, padded)
        ids, pos, slots, seq = _expected(scheduled, padded)
        assert stager.ids[:padded].tolist() == ids
        assert stager.pos[:padded].tolist() == pos
        assert stager.slots[:padded].tolist() == slots
        assert stager.seq[:padded].tolist() == seq
        for i, item in enumerate(scheduled):
            used = -(-(item.num_computed_tokens + 1) // BS)  # the columns the kernel reads
            assert stager.bt[i, :used].tolist() == item.block_ids[:used], f"row {i}"
        assert (stager.bt[len(scheduled):padded, 0] == 0).all()
        # Requests append a token now and then (their list of known tokens grows).
        for item in scheduled:
            if rng.random() < 0.7:
                item.request.append_output_token(rng.randrange(5, 50))
