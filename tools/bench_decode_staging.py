"""Host cost of staging a decode step's inputs for the CUDA-graph runner (DecodeInputStager),
steady state: 256 requests decoding with 200-1800-token contexts, each step one position
further (a new block every 16 steps). CPU only; prints ms per step."""
from __future__ import annotations

import random
import sys
import time

import numpy as np

from folio.core.request import Request
from folio.core.scheduler import ScheduledRequest
from folio.sampling_params import SamplingParams
from folio.worker.cuda_graphs import DecodeInputStager

num = int(sys.argv[1]) if len(sys.argv) > 1 else 256
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
bs, width = 16, 160
rng = random.Random(0)
stager = DecodeInputStager(np.zeros(num, np.int64), np.zeros(num, np.int64),
                           np.zeros(num, np.int64), np.zeros(num, np.int32),
                           np.zeros((num, width), np.int32), bs)
items, next_block = [], 0
for i in range(num):
    length = rng.randint(200, 1800)
    req = Request(f"r{i}", list(range(length)), SamplingParams(), block_size=bs,
                  max_model_len=width * bs)
    blocks = list(range(next_block, next_block + length // bs + 1))
    next_block += len(blocks)
    items.append(ScheduledRequest(req, length - 1, 1, blocks, samples=True))


def advance() -> None:
    global next_block
    for item in items:
        item.request.append_output_token(7)
        item.num_computed_tokens += 1
        if item.num_computed_tokens // bs >= len(item.block_ids):
            item.block_ids.append(next_block)
            next_block += 1


total = 0.0
for _ in range(steps):
    start = time.perf_counter()
    stager.fill(items, num)
    total += time.perf_counter() - start
    advance()
print(f"{num} requests: {1e3 * total / steps:.3f} ms per step to stage decode inputs")
