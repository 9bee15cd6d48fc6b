"""Stored responses keep their KV blocks pinned in the prefix cache (--responses-kv-pin-ttl):
the front end's side in process (the engine request carries the time-to-live only for
store=true; the store's deletions unpin), the flags, and end to end on a real `folio serve`
with a small KV cache, where unrelated traffic flushes the prefix cache between a stored
response and its continuation: with pins the continuation finds the whole first prompt
cached, without them next to nothing.

The servers run with OMP_NUM_THREADS=1 (a busy 2-core machine; see test_responses_api.py).
"""
from __future__ import annotations

import argparse
import asyncio
import time
from array import array

import httpx
import pytest

from server_utils import RemoteServer
from test_openai_serving import tokenizer  # noqa: F401
from test_responses_api import MODEL, QUESTION, _scripted_client

from folio.entrypoints.openai.responses_store import (ResponsesConfig, ResponseStore,
                                                      StoredResponse)


def _entry(response_id: str) -> StoredResponse:
    return StoredResponse(response_id, {"id": response_id, "output": []}, [], array("i"))


def test_store_reports_each_entry_that_goes():
    gone: list[str] = []
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=60, clock=lambda: now[0], on_delete=gone.append)
    store.put(_entry("a"))
    store.put(_entry("a"))             # stored again under its own id: not a deletion
    store.put(_entry("b"))
    store.put(_entry("c"))             # LRU: a goes
    assert store.delete("b") and not store.delete("b")
    now[0] += 61
    assert store.get("c") is None      # expired
    assert gone == ["a", "b", "c"]


def test_stored_responses_carry_the_pin_ttl_and_deletions_unpin(tokenizer):  # noqa: F811
    client, engine = _scripted_client(
        tokenizer, "Fine.", responses=ResponsesConfig(store_max_entries=2, kv_pin_ttl_s=42.0))

    async def run() -> list[str]:
        kept = [await client.responses.create(model=MODEL, input=QUESTION) for _ in range(3)]
        await client.responses.create(model=MODEL, input=QUESTION, store=False)
        await client.responses.delete(kept[2].id)
        await asyncio.sleep(0)         # the unpin calls run as tasks
        return [r.id for r in kept]

    ids = asyncio.run(run())
    assert [call["kv_pin_ttl"] for call in engine.calls] == [42.0, 42.0, 42.0, None]
    # The first was evicted by the third (two entries at most); the third was deleted.
    assert engine.unpinned == [ids[0], ids[2]]


def test_pin_ttl_zero_pins_nothing(tokenizer):  # noqa: F811
    client, engine = _scripted_client(
        tokenizer, "Fine.", responses=ResponsesConfig(kv_pin_ttl_s=0))

    async def run() -> None:
        response = await client.responses.create(model=MODEL, input=QUESTION)
        await client.responses.delete(response.id)

    asyncio.run(run())
    assert engine.calls[0]["kv_pin_ttl"] is None and engine.unpinned == []


def test_pin_flags():
    from folio.entrypoints.openai.cli_args import add_serve_args, build_engine_config
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    defaults = parser.parse_args([])
    assert ResponsesConfig.from_args(defaults).kv_pin_ttl_s == 300.0
    assert build_engine_config(defaults).cache.kv_pin_max_fraction == 0.5
    args = parser.parse_args(["--responses-kv-pin-ttl", "0",
                              "--responses-kv-pin-max-fraction", "0.25"])
    assert ResponsesConfig.from_args(args).kv_pin_ttl_s == 0.0
    assert build_engine_config(args).cache.kv_pin_max_fraction == 0.25
    with pytest.raises(ValueError, match="--responses-kv-pin-ttl"):
        ResponsesConfig(kv_pin_ttl_s=-1)
    with pytest.raises(ValueError, match="kv_pin_max_fraction"):
        build_engine_config(parser.parse_args(["--responses-kv-pin-max-fraction", "1.5"]))


# ---- end to end ----------------------------------------------------------------------------

BLOCK = 16
# 64 blocks of 16 tokens: the flood below (about 1,800 tokens) goes round the cache twice.
SERVER_ARGS = ["--max-model-len", "1024", "--num-gpu-blocks-override", "64", "--dtype",
               "float32", "--max-num-seqs", "4"]
NOTES = "Notes for the trip: " + "; ".join(
    f"day {i} we visit the {place} and eat {food}" for i, (place, food) in enumerate(
        [("museum", "bread"), ("harbour", "fish"), ("old town", "cheese"), ("castle", "soup"),
         ("market", "fruit"), ("cathedral", "pasta"), ("park", "salad"), ("river", "rice"),
         ("gallery", "cake"), ("bridge", "stew"), ("garden", "pie"), ("tower", "noodles")]))


def _kv_usage(server: RemoteServer) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("folio:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("folio:kv_cache_usage_perc not in /metrics")


def _kv_usage_drops_to_zero(server: RemoteServer, timeout_s: float = 10.0) -> bool:
    """Whether the idle server's KV cache use reaches 0 (the unpin calls run as tasks; the
    engine reports its stats after each change)."""
    deadline = time.monotonic() + timeout_s
    while _kv_usage(server) != 0.0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _continuation_cached_tokens(pin_ttl: str) -> tuple[int, int, float, bool]:
    """A stored response, a flood of unrelated completions, then its continuation: the
    first response's prompt tokens, the continuation's cached tokens, the idle KV cache use
    (pinned blocks count as used), and whether it drops to 0 once both responses are
    deleted."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        server = RemoteServer(SERVER_ARGS + ["--responses-kv-pin-ttl", pin_ttl])
    with server:
        client = server.client(timeout=120)
        first = client.responses.create(model=MODEL, input=NOTES, max_output_tokens=8,
                                        temperature=0)
        for i in range(6):   # 300-token prompts, nothing in common with the conversation
            prompt = " ".join(f"{chr(97 + i)}{j}" for j in range(150))
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                         input="Which day has fish?", max_output_tokens=4,
                                         temperature=0)
        held = _kv_usage(server)
        client.responses.delete(second.id)
        client.responses.delete(first.id)
        return (first.usage.input_tokens, second.usage.input_tokens_details.cached_tokens,
                held, _kv_usage_drops_to_zero(server))


def test_a_pinned_conversation_survives_other_traffic():
    prompt_tokens, pinned, held, released = _continuation_cached_tokens("300")
    assert prompt_tokens > 8 * BLOCK
    # Every full block of the first prompt (and maybe of its output) was found.
    assert pinned >= prompt_tokens // BLOCK * BLOCK
    # Idle, the pins still hold the two responses' blocks; deleting the responses unpins.
    assert held > 0 and released
    _, unpinned, held, _ = _continuation_cached_tokens("0")
    assert unpinned < pinned // 4 and held == 0
