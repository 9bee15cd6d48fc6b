"""The KV tiers behind the server (issue 23): `folio serve --kv-offloading-size ...
--kv-disk-path DIR --kv-disk-size ...` with a small device cache. A long prompt's blocks
travel device -> host -> disk as later prompts arrive; after a restart on the same
directory the same prompt's prefill reads them from disk (/metrics says so) and the answer
is the one the first server gave."""
from __future__ import annotations

import random
import urllib.request

import pytest

from server_utils import RemoteServer

pytestmark = pytest.mark.slow

PROMPT_LEN = 8 * 16 + 1


def _metric(server, name: str) -> float:
    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_a_restarted_server_reads_the_disk_tier(tmp_path):
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(4)]
    # SmolLM2's float16 KV: 368,640 bytes a block; ten host slots
    args = ["--max-model-len", "192", "--num-gpu-blocks-override", "12", "--max-num-seqs", "1",
            "--kv-offloading-size", str(10 * 368640 / 2**30), "--kv-disk-path", str(tmp_path),
            "--kv-disk-size", "0.5"]
    with RemoteServer(args) as server:
        client = server.client()
        model = client.models.list().data[0].id
        first = None
        for prompt in prompts:
            out = client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                            temperature=0)
            first = first or out.choices[0].text
        assert _metric(server, "folio:kv_offload_saved_bytes_total") > 0
    with RemoteServer(args) as server:
        client = server.client()
        out = client.completions.create(model=model, prompt=prompts[0], max_tokens=8,
                                        temperature=0)
        assert out.choices[0].text == first
        assert _metric(server, "folio:kv_disk_read_blocks_total") >= 1
        assert out.usage.prompt_tokens_details is None or \
            out.usage.prompt_tokens_details.cached_tokens >= 16
