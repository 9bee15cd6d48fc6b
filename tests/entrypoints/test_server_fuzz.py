"""Property-based fuzzing of a live `folio serve` from its own OpenAPI schema (schemathesis):
every route, schema-conforming and schema-violating bodies; no response may be a 5xx, the
engine process must survive, and /health is green after.

The server runs a tiny random model with a short context, so that whatever the fuzzer asks
for (n, max_tokens, logprobs...) is cheap to serve. Marked slow; CI runs it."""
from __future__ import annotations

import collections
import json
import os

import httpx
import psutil
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from server_utils import RemoteServer  # noqa: E402

pytestmark = pytest.mark.slow

# Examples per route and mode; FOLIO_FUZZ_EXAMPLES raises it for a longer local run.
EXAMPLES = int(os.environ.get("FOLIO_FUZZ_EXAMPLES", "40"))


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with RemoteServer([tiny_model_dir("llama"), "--max-model-len", "128",
                       "--num-gpu-blocks-override", "128", "--max-num-seqs", "16"]) as srv:
        yield srv


def _engine_pids(server) -> list[int]:
    return [c.pid for c in psutil.Process(server.proc.pid).children()
            if "spawn_main" in " ".join(c.cmdline())]


def test_openapi_schema_has_request_bodies(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith("/ChatCompletionRequest")
    assert "messages" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]


def test_fuzz_every_route_no_5xx(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    engines = _engine_pids(server)
    assert engines
    tried: collections.Counter = collections.Counter()
    statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        label = operation.label
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                strategy = operation.as_strategy(generation_mode=mode)
            except Exception:  # noqa: BLE001 - e.g. no negative cases for a GET with no inputs
                continue

            @given(case=strategy)
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def run(case):
                response = case.call(base_url=server.url, timeout=60)
                tried[label] += 1
                statuses[label][response.status_code] += 1
                if os.environ.get("FOLIO_FUZZ_VERBOSE") and response.status_code == 400:
                    print(label, mode.value, response.text[:160])
                if response.status_code >= 500:
                    body = case.body if not isinstance(case.body, bytes) else case.body[:200]
                    failures.append(f"{label} {response.status_code}: "
                                    f"{json.dumps(body, default=str)[:300]} -> {response.text[:300]}")

            try:
                run()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # a route with no inputs to violate
    summary = {label: (tried[label], dict(statuses[label])) for label in sorted(tried)}
    print("\nfuzz cases per route (tried, statuses):", json.dumps(summary, indent=1))
    assert not failures, "\n".join(failures[:10])
    # Every route was exercised, the engine process is the same one, and it is healthy.
    assert len(tried) >= 8, summary
    assert _engine_pids(server) == engines
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
