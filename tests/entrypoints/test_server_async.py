"""The server with async scheduling (the GPU default) forced on the CPU: the engine-core process
keeps one step in flight and returns each step's tokens a call later. Replies must equal the
offline synchronous engine's, stop strings (found by the front end while the next step is
already queued) and client disconnects must finish requests cleanly, and concurrent streams
must equal the same requests alone."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from folio import LLM, SamplingParams
from server_utils import RemoteServer
from test_server import MODEL, QUESTION, _metric


@pytest.fixture(scope="module")
def server():
    with RemoteServer(["--max-model-len", "512", "--num-gpu-blocks-override", "256",
                       "--dtype", "float32", "--max-num-seqs", "32",
                       "--async-scheduling"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_replies_equal_the_synchronous_engine(client):
    llm = LLM(max_model_len=512, num_gpu_blocks_override=64, dtype="float32",
              async_scheduling=False)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    offline = llm.chat(QUESTION, greedy, use_tqdm=False)[0].outputs[0].text
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                           max_tokens=24)
    assert reply.choices[0].message.content == offline
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=5)
    offline = llm.generate("Once upon a time", seeded, use_tqdm=False)[0].outputs[0].text
    served = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=1.0,
                                       max_tokens=12, seed=5)
    assert served.choices[0].text == offline
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=1.0,
                                         max_tokens=12, seed=5, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == offline


def test_stop_string_and_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                         max_tokens=32, stop=["France"], logprobs=True,
                                         top_logprobs=2)
    assert out.choices[0].message.content == "The capital of "
    assert out.choices[0].finish_reason == "stop"
    assert all(len(e.top_logprobs) == 2 for e in out.choices[0].logprobs.content)


def test_concurrent_streams_equal_alone(server, client):
    async def run() -> list[str]:
        aclient = server.async_client()

        async def one(i: int) -> str:
            stream = await aclient.completions.create(model=MODEL, prompt=f"Count from {i}:",
                                                      temperature=0, max_tokens=10 + i % 5,
                                                      stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream])
        return await asyncio.gather(*(one(i) for i in range(24)))
    results = asyncio.run(run())
    for i in (0, 7, 23):
        alone = client.completions.create(model=MODEL, prompt=f"Count from {i}:", temperature=0,
                                          max_tokens=10 + i % 5)
        assert results[i] == alone.choices[0].text


def test_disconnect_frees_blocks(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Write a long story:", "max_tokens": 400,
                            "ignore_eos": True, "stream": True}) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 3:
                break
    deadline = time.time() + 20
    while time.time() < deadline:
        if _metric(server, "folio:num_requests_running") == 0 and \
                _metric(server, "folio:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.2)
    assert _metric(server, "folio:num_requests_running") == 0
    assert _metric(server, "folio:kv_cache_usage_perc") == 0


def test_flag_reaches_the_engine_config():
    from folio.entrypoints.cli import build_parser
    from folio.entrypoints.openai.cli_args import build_engine_config
    for flag, expected in (("--async-scheduling", True), ("--no-async-scheduling", False),
                           (None, None)):
        args = build_parser().parse_args(["serve"] + ([flag] if flag else []))
        assert build_engine_config(args).scheduler.async_scheduling is expected
