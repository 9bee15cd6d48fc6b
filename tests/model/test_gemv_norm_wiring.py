"""The decoder's hand-offs to the skinny GEMV's residual add + RMSNorm epilogue (a CUDA
kernel: tests/gpu/test_gpu_engine.py compares it bit for bit): o_proj with the post-attention
norm (`Linear.forward_add_norm`) and the MLP's down projection with the next layer's input norm
(`GatedMLP.forward_add_norm`, chained by `DecoderLM.run_layers`). Here, on the CPU, the methods
are stood in for by the same math in torch (and the chain, CUDA-only, is allowed), and the
model must give what it gives without them."""
from __future__ import annotations

import pytest

from folio import LLM, SamplingParams
from folio.model.decoder import DecoderLM
from folio.model.layers import GatedMLP, Linear


def _answers(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8)
    outs = llm.generate(["the layer hands over", "one two three"], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _in_torch(calls: list):
    """A stand-in for forward_add_norm: the module, then the norm with the residual (the
    epilogue's math), counting its calls."""
    def forward_add_norm(self, x, residual, norm):
        calls.append(tuple(x.shape))
        return norm(self(x), residual)
    return forward_add_norm


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_layers_take_the_norm_from_o_proj(tiny_model_dir, monkeypatch, arch) -> None:
    path = tiny_model_dir(arch)
    want = _answers(LLM(path, device="cpu", max_num_seqs=2))
    calls = []
    monkeypatch.setattr(Linear, "forward_add_norm", _in_torch(calls))
    llm = LLM(path, device="cpu", max_num_seqs=2, enforce_eager=True)
    assert _answers(llm) == want
    assert calls, "no layer handed o_proj the norm"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_down_projections_hand_the_next_layer_its_normed_input(tiny_model_dir, monkeypatch,
                                                               arch) -> None:
    path = tiny_model_dir(arch)
    want = _answers(LLM(path, device="cpu", max_num_seqs=2))
    calls = []
    original = DecoderLM._norm_chain
    monkeypatch.setattr(GatedMLP, "forward_add_norm", _in_torch(calls))
    monkeypatch.setattr(DecoderLM, "_norm_chain", lambda self, hidden: original(self, _OnCuda))
    monkeypatch.setenv("FOLIO_GEMV_NORM", "1")   # the chain is built only with it on
    llm = LLM(path, device="cpu", max_num_seqs=2, enforce_eager=True)
    assert _answers(llm) == want
    layers = llm.llm_engine.engine_core.executor.worker.model.spec.num_layers
    assert len(calls) >= layers - 1, "the layers did not chain their norms"


class _OnCuda:
    """Passes the chain's device check."""
    is_cuda = True
