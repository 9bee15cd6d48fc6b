"""Pipeline parallelism behind the server (issue 22, item 2): `folio serve
--pipeline-parallel-size 2` on the default model (two stages of 15 layers, gloo on the CPU);
the official client's plain and streamed requests get the answers one rank gives."""
from __future__ import annotations

import pytest

from folio import LLM, SamplingParams
from folio.model.default_model import default_model_path

from server_utils import RemoteServer

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def test_pp2_server_answers_as_one_rank():
    llm = LLM(default_model_path(), max_model_len=512, quantization="none",
              num_gpu_blocks_override=128)
    want = [o.outputs[0].text for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)]
    llm.llm_engine.shutdown()
    with RemoteServer(["--max-model-len", "512", "--pipeline-parallel-size", "2",
                       "--num-gpu-blocks-override", "128"]) as server:
        client = server.client()
        model = client.models.list().data[0].id
        got = client.completions.create(model=model, prompt=PROMPTS, max_tokens=16,
                                        temperature=0)
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
        stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want[0]
