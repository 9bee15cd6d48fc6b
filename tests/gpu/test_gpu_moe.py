"""The MoE layer's Triton paths on a CUDA GPU at Qwen3-30B-A3B's expert shapes (128 experts,
hidden 2048, expert width 768, top 8), bf16: the few-token form (kernels/moe_gemv.py) and the
grouped GEMMs (kernels/fused_moe.py) against the per-expert torch path, with and without
biases, inside a CUDA graph as decode replays them. Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

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
    # the torch reference: per expert, float32, no bias support there: add it by hand
    gu = torch.einsum("th,tkih->tki", x.float(), moe.gate_up_proj[ids].float())
    if bias:
        gu = gu + b13[ids].float()
    gu = gu.to(torch.bfloat16).float()
    gate, up = gu[..., :768], gu[..., 768:]
    act = (torch.nn.functional.silu(gate).to(torch.bfloat16).float() * up).to(torch.bfloat16)
    down = torch.einsum("tki,tkhi->tkh", act.float(), moe.down_proj[ids].float())
    if bias:
        down = down + b2[ids].float()
    ref = (down * w[..., None]).sum(1)
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
