"""The decoder layer's hand-off to `Linear.forward_add_norm` (o_proj's GEMV ending with the
post-attention residual add + RMSNorm, a CUDA kernel: tests/gpu/test_gpu_engine.py compares
it bit for bit). Here, on the CPU, the method is stood in for by the same math in torch, and
the layer must give what it gives without it: the normed sum to the MLP, the sum as the
stream."""
from __future__ import annotations

import pytest

from folio import LLM, SamplingParams
from folio.model.layers import Linear


def _answers(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8)
    outs = llm.generate(["the layer hands over", "one two three"], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_layers_take_the_norm_from_o_proj(tiny_model_dir, monkeypatch, arch) -> None:
    path = tiny_model_dir(arch)
    want = _answers(LLM(path, device="cpu", max_num_seqs=2))
    calls = []

    def in_torch(self, x, residual, norm):
        calls.append(tuple(x.shape))
        return norm(self(x), residual)

    monkeypatch.setattr(Linear, "forward_add_norm", in_torch)
    llm = LLM(path, device="cpu", max_num_seqs=2, enforce_eager=True)
    assert _answers(llm) == want
    assert calls, "no layer handed o_proj the norm"
