"""Disaggregated prefill on a CUDA GPU (bf16, CUDA graphs): a producer engine and a consumer
engine in one process, the consumer fetching each prompt's KV from the producer's worker
(side-stream copies through host memory) and computing only the last prompt token; the
greedy answers equal a plain engine's. Skipped without a GPU; run through the device tool
(tools/device_issue23.sh)."""
from __future__ import annotations

import gc
import random
import threading
import time

import pytest
import torch

from test_gpu_engine import VOCAB, _build

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _build("llama", str(tmp_path_factory.mktemp("llama_disagg")))


def _engine(model_dir: str, role: str | None):
    from folio import LLM
    kw = {} if role is None else {"kv_transfer_config": {"kv_connector": "P2pConnector",
                                                         "kv_role": role}}
    return LLM(model_dir, dtype="bfloat16", max_model_len=512, device="cuda",
               kv_cache_memory_bytes=256 * 2**20, **kw)


def test_prompts_fetched_from_a_producer_on_cuda(model_dir) -> None:
    from folio import SamplingParams
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (17, 100, 257, 300)]
    params = SamplingParams(temperature=0, max_tokens=16)
    plain = _engine(model_dir, None)
    want = [list(plain.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
                 .outputs[0].token_ids) for p in prompts]
    plain.llm_engine.shutdown()
    del plain
    gc.collect()

    producer, consumer = _engine(model_dir, "kv_producer"), _engine(model_dir, "kv_consumer")
    pe, ce = producer.llm_engine, consumer.llm_engine
    stop = threading.Event()

    def pump() -> None:          # the producer's engine loop (its worker serves the holds)
        while not stop.is_set():
            if pe.has_unfinished_requests() or pe.engine_core.has_pending_notifications():
                pe.step()
            else:
                time.sleep(0.002)
    try:
        got = []
        for prompt in prompts:
            pe.add_request(None, {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=1),
                           kv_transfer_params={"do_remote_decode": True})
            params_out = None
            while params_out is None:
                for out in pe.step():
                    if out.finished:
                        params_out = out.kv_transfer_params
            thread = threading.Thread(target=pump)
            stop.clear()
            thread.start()
            ce.add_request(None, {"prompt_token_ids": prompt}, params,
                           kv_transfer_params=params_out)
            final, deadline = None, time.monotonic() + 60
            while final is None and time.monotonic() < deadline:
                for out in ce.step():
                    if out.finished:
                        final = out
            stop.set()
            thread.join()
            assert final is not None, "the consumer never finished"
            assert final.num_cached_tokens == len(prompt) - 1    # fetched, not computed
            got.append(list(final.outputs[0].token_ids))
        assert got == want
        stats = ce.engine_core.scheduler.stats()
        assert stats.kv_transfer_received_requests == len(prompts)
        assert stats.kv_transfer_failed_requests == 0
    finally:
        stop.set()
        pe.shutdown()
        ce.shutdown()
