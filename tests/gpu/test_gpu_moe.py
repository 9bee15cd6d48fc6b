"""The MoE layer's Triton paths on a CUDA GPU at Qwen3-30B-A3B's expert shapes (128 experts,
hidden 2048, expert width 768, top 8), bf16: the few-token form (kernels/moe_gemv.py) and the
grouped GEMMs (kernels/fused_moe.py) against the per-expert torch path, with and without
biases, inside a CUDA graph as decode replays them. Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch
from word_tokenizer import save_word_tokenizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def moe():
    from folio.model.kernel_config import resolve_kernel_config
    from folio.model.moe.layer import FusedMoE
    torch.manual_seed(0)
    layer = FusedMoE(128, 2048, 768, "silu", resolve_kernel_config()).to(CUDA, torch.bfloat16)
    with torch.no_grad():
        layer.gate_up_proj.normal_(0, 0.02)
        layer.down_proj.normal_(0, 0.02)
    return layer


def _reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, w: torch.Tensor,
               ids: torch.Tensor, b13: torch.Tensor | None = None,
               b2: torch.Tensor | None = None) -> torch.Tensor:
    """Per (token, slot) in float32 on float32 weights, rounding gate, up and the activation to
    bf16 where the kernels (and silu_and_mul) round them."""
    gu = torch.einsum("th,tkih->tki", x.float(), gate_up[ids])
    if b13 is not None:
        gu = gu + b13[ids].float()
    gu = gu.to(torch.bfloat16).float()
    inter = gu.shape[-1] // 2
    gate, up = gu[..., :inter], gu[..., inter:]
    act = (torch.nn.functional.silu(gate).to(torch.bfloat16).float() * up).to(torch.bfloat16)
    out = torch.einsum("tki,tkhi->tkh", act.float(), down[ids])
    if b2 is not None:
        out = out + b2[ids].float()
    return (out * w[..., None]).sum(1)


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("bias", [False, True])
def test_few_token_form_matches_torch(moe, tokens: int, bias: bool) -> None:
    from folio.model.kernels import moe_gemv
    from folio.model.kernels.fused_moe import fused_experts
    x = torch.randn(tokens, 2048, device=CUDA, dtype=torch.bfloat16)
    ids = torch.rand(tokens, 128, device=CUDA).topk(8, dim=-1).indices
    w = torch.rand(tokens, 8, device=CUDA).softmax(-1)
    b13 = torch.randn(128, 1536, device=CUDA, dtype=torch.bfloat16) * 0.1 if bias else None
    b2 = torch.randn(128, 2048, device=CUDA, dtype=torch.bfloat16) * 0.1 if bias else None
    with torch.no_grad():
        few = fused_experts(x, moe.gate_up_proj, moe.down_proj, w, ids, None, b13, b2,
                            few_tokens=True)
        grouped = fused_experts(x, moe.gate_up_proj, moe.down_proj, w, ids, None, b13, b2,
                                few_tokens=False)
        auto = fused_experts(x, moe.gate_up_proj, moe.down_proj, w, ids, None, b13, b2)
    ref = _reference(x, moe.gate_up_proj.float(), moe.down_proj.float(), w, ids, b13, b2)
    assert _rel(few, ref) < 5e-3 and _rel(grouped, ref) < 5e-3
    assert torch.equal(auto, few if tokens <= moe_gemv.MAX_TOKENS else grouped)


def test_few_token_form_in_a_cuda_graph(moe) -> None:
    """Routes rewritten in place between replays (as the router writes them): the graph's
    output follows them."""
    from folio.model.kernels.fused_moe import fused_experts
    x = torch.randn(1, 2048, device=CUDA, dtype=torch.bfloat16)
    w = torch.rand(1, 8, device=CUDA).softmax(-1)
    ids = torch.rand(1, 128, device=CUDA).topk(8, dim=-1).indices
    with torch.no_grad():
        fused_experts(x, moe.gate_up_proj, moe.down_proj, w, ids)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_experts(x, moe.gate_up_proj, moe.down_proj, w, ids)
        for _ in range(3):
            ids.copy_(torch.rand(1, 128, device=CUDA).topk(8, dim=-1).indices)
            graph.replay()
            want = fused_experts(x, moe.gate_up_proj, moe.down_proj, w, ids.clone())
            assert torch.equal(out, want)


@pytest.fixture(scope="module")
def moe_fp8(moe):
    """The same experts as FP8 codes with a scale per expert row (--quantization fp8)."""
    import copy
    layer = copy.deepcopy(moe)
    layer.quantize_fp8()
    return layer


@pytest.mark.parametrize("tokens", [1, 4, 5, 16])
def test_fp8_experts_match_their_dequantized_weights(moe_fp8, tokens: int) -> None:
    """Both Triton forms and the layer on the codes against the reference on the weights they
    stand for (codes * scale in float32: widened to bf16 they take one more rounding, and the
    error against FusedMoE._grouped_torch, which widens so, read 0.0051-0.0053); the codes
    read half the bytes."""
    from folio.model.kernels import moe_gemv
    from folio.model.kernels.fused_moe import fused_experts
    assert moe_fp8.gate_up_proj.dtype == torch.float8_e4m3fn
    assert moe_fp8.gate_up_proj.element_size() == 1
    x = torch.randn(tokens, 2048, device=CUDA, dtype=torch.bfloat16)
    ids = torch.rand(tokens, 128, device=CUDA).topk(8, dim=-1).indices
    w = torch.rand(tokens, 8, device=CUDA).softmax(-1)
    scales = dict(gate_up_scale=moe_fp8.gate_up_scale, down_scale=moe_fp8.down_scale)
    with torch.no_grad():
        ref = _reference(x, moe_fp8.gate_up_proj.float() * moe_fp8.gate_up_scale[..., None],
                         moe_fp8.down_proj.float() * moe_fp8.down_scale[..., None], w, ids)
        torch_path = moe_fp8._grouped_torch(x, w, ids)
        assert _rel(torch_path, ref) < 1e-2
        grouped = fused_experts(x, moe_fp8.gate_up_proj, moe_fp8.down_proj, w, ids,
                                few_tokens=False, **scales)
        layer = moe_fp8(x, w, ids)
        assert _rel(grouped, ref) < 5e-3
        assert _rel(layer, ref) < 5e-3
        if tokens <= moe_gemv.MAX_TOKENS:
            few = fused_experts(x, moe_fp8.gate_up_proj, moe_fp8.down_proj, w, ids,
                                few_tokens=True, **scales)
            assert _rel(few, ref) < 5e-3
            assert torch.equal(layer, few)


def test_fp8_experts_in_a_cuda_graph(moe_fp8) -> None:
    x = torch.randn(1, 2048, device=CUDA, dtype=torch.bfloat16)
    w = torch.rand(1, 8, device=CUDA).softmax(-1)
    ids = torch.rand(1, 128, device=CUDA).topk(8, dim=-1).indices
    with torch.no_grad():
        moe_fp8(x, w, ids)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_fp8(x, w, ids)
        for _ in range(3):
            ids.copy_(torch.rand(1, 128, device=CUDA).topk(8, dim=-1).indices)
            graph.replay()
            assert torch.equal(out, moe_fp8(x, w, ids.clone()))


def test_engine_fp8_moe_model(tmp_path) -> None:
    """A tiny Qwen3-MoE served with --quantization fp8 on the GPU: its experts are FP8, and
    each prompt's next-token distribution stays near the float engine's (a random model's
    greedy answers part at near-ties within a few tokens, so the first step is compared:
    the float engine's choice among the FP8 engine's top 5, its logprob close)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from folio import LLM, SamplingParams
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024,
                            moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                            head_dim=64, max_position_embeddings=1024, bos_token_id=1,
                            eos_token_id=2, initializer_range=0.05)
    path = str(tmp_path / "qwen3moe")
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    save_word_tokenizer(path, 2048)
    gen = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 2048, (n,), generator=gen).tolist()}
               for n in (3, 9, 30, 70, 150, 300)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    steps = {}
    for q in ("none", "fp8"):
        llm = LLM(path, quantization=None if q == "none" else q, max_model_len=512,
                  gpu_memory_utilization=0.3)
        try:
            if q == "fp8":
                model = llm.llm_engine.engine_core.executor.worker.model
                experts = [m for m in model.modules() if type(m).__name__ == "FusedMoE"]
                assert experts and all(m.gate_up_proj.dtype == torch.float8_e4m3fn
                                       for m in experts)
            steps[q] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()
    gaps = []
    for i, (plain, fp8) in enumerate(zip(steps["none"], steps["fp8"])):
        token = plain.token_ids[0]
        top = fp8.logprobs[0]
        assert token in top, (i, token, list(top))
        gaps.append(abs(top[token].logprob - plain.logprobs[0][token].logprob))
    # On the CPU (W8A16) the gaps read 0.03-0.27, mean 0.11; a wrong scale moves logits by
    # orders of magnitude (the kernels' exact checks are the tests above)
    assert max(gaps) < 0.6 and sum(gaps) / len(gaps) < 0.3, gaps
