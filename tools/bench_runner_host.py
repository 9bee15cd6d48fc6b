"""Host cost of the model runner's per-step Python, CPU only (no model, tiny logits), at 256
requests with 200-1800-token contexts:
  * staging a decode step's inputs for the CUDA-graph runner (DecodeInputStager), steady
    state, each step one position further (a new block every 16 steps);
  * building a mixed step's inputs (255 decodes + one 1,793-token prefill chunk);
  * the sampler's set-up around its tensor ops (256 rows x 64 logits: greedy, T=1, and
    Qwen3's defaults top_k 20 / top_p 0.95 / T 0.6).
Prints ms per step for each."""
from __future__ import annotations

import random
import sys
import time

import numpy as np
import torch

from folio.core.request import Request
from folio.core.scheduler import ScheduledRequest
from folio.sampling_params import SamplingParams
from folio.worker.cuda_graphs import DecodeInputStager
from folio.worker.model_runner import ModelRunner
from folio.worker.sampler import Sampler, SamplingState

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


# Mixed step: the eager path's input building.
runner = ModelRunner.__new__(ModelRunner)  # only the input builder is used
runner.block_size, runner.device = bs, torch.device("cpu")
runner._prev_rows, runner._prev_sampled = {}, None
mixed = [ScheduledRequest(item.request, item.num_computed_tokens, 1, item.block_ids, samples=True)
         for item in items[:num - 1]]
chunk = Request("chunk", list(range(3000)), SamplingParams(), block_size=bs,
                max_model_len=width * bs)
mixed.append(ScheduledRequest(chunk, 1000, 1793, list(range(next_block, next_block + 188))))
for _ in range(5):
    runner._build_inputs(mixed)
start = time.perf_counter()
for _ in range(50):
    runner._build_inputs(mixed)
print(f"{num - 1} decodes + a 1,793-token chunk: {1e3 * (time.perf_counter() - start) / 50:.3f} "
      "ms to build a mixed step's inputs")

sampler = Sampler()
for name, params in (("greedy", SamplingParams(temperature=0, max_tokens=10)),
                     ("T=1", SamplingParams(temperature=1.0, max_tokens=10)),
                     ("top_k 20, top_p 0.95, T 0.6",
                      SamplingParams(temperature=0.6, top_k=20, top_p=0.95, max_tokens=10))):
    states = [SamplingState(params, [1, 2, 3], [], None) for _ in range(num)]
    logits = torch.randn(num, 64)
    for _ in range(20):
        sampler.sample(logits, states)
    start = time.perf_counter()
    for _ in range(200):
        sampler.sample(logits, states)
    print(f"sampler, {num} rows, {name}: {1e3 * (time.perf_counter() - start) / 200:.3f} ms")
