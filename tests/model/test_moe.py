"""The mixture-of-experts pieces against plain references: routing (softmax, sigmoid with a
correction bias and expert groups), the token permutation, and the experts' CPU path against a
per-token, per-slot loop (random, skewed and sparse routes, so some experts see many tokens and
some none). The Triton kernel's checks are test_triton_fused_moe.py; the families' parity with
transformers is test_models_vs_transformers.py."""
from __future__ import annotations

import pytest
import torch

from folio.model.families import ExpertActivation, MoEScoring
from folio.model.moe.dispatch import align_to_blocks, max_padded_rows, sort_by_expert
from folio.model.moe.layer import FusedMoE
from folio.model.moe.routing import RouterConfig, select_experts
from moe_reference import experts_loop, make_routes, route_loop, swiglu_oai


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_routing(renormalize: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 8, generator=gen)
    w, ids = select_experts(logits, RouterConfig(8, 2, renormalize=renormalize))
    ref_w, ref_ids = route_loop(logits, 2, renormalize=renormalize)
    assert torch.equal(ids, ref_ids)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(37))


def test_sigmoid_bias_grouped_routing() -> None:
    """DeepSeek-V3's rule: groups scored by their two best biased experts, top-k among the
    kept groups on the biased scores, weights from the unbiased ones, renormalized, scaled."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(29, 16, generator=gen)
    bias = torch.randn(16, generator=gen) * 0.5
    cfg = RouterConfig(16, 4, scoring=MoEScoring.SIGMOID, renormalize=True, num_groups=4,
                       topk_groups=2, routed_scaling_factor=2.5)
    w, ids = select_experts(logits, cfg, bias)
    ref_w, ref_ids = route_loop(logits, 4, "sigmoid", True, bias, 4, 2, 2.5)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    order = ids.argsort(-1)
    ref_order = ref_ids.argsort(-1)
    torch.testing.assert_close(w.gather(1, order).double(), ref_w.gather(1, ref_order),
                               rtol=1e-6, atol=1e-7)
    # the chosen experts come from two groups of four at most
    assert all(len({int(e) // 4 for e in row}) <= 2 for row in ids)


def test_grouped_softmax_routing() -> None:
    """DeepSeek-V2's group-limited greedy choice: a group scores its best expert."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(23, 12, generator=gen)
    cfg = RouterConfig(12, 3, renormalize=False, num_groups=3, topk_groups=1)
    w, ids = select_experts(logits, cfg)
    ref_w, ref_ids = route_loop(logits, 3, renormalize=False, num_groups=3, topk_groups=1)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    torch.testing.assert_close(w.sort(-1).values.double(), ref_w.sort(-1).values,
                               rtol=1e-6, atol=1e-7)


def test_topk_softmax_routing() -> None:
    """GPT-OSS's rule: top-k on the raw logits, softmax over the k chosen."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(19, 6, generator=gen)
    w, ids = select_experts(logits, RouterConfig(6, 3, scoring=MoEScoring.TOPK_SOFTMAX,
                                                 renormalize=False))
    for t in range(19):
        order = sorted(range(6), key=lambda e: -float(logits[t, e]))[:3]
        assert ids[t].tolist() == order
        ref = torch.softmax(logits[t, order].double(), -1)
        torch.testing.assert_close(w[t].double(), ref, rtol=1e-6, atol=1e-7)


def test_router_config_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        RouterConfig(4, 5)
    with pytest.raises(ValueError, match="groups"):
        RouterConfig(10, 2, num_groups=3)


def test_sort_by_expert() -> None:
    ids = torch.tensor([[3, 0], [0, 2], [3, 1]])
    order, counts = sort_by_expert(ids, 5)
    assert counts == [2, 1, 1, 2, 0]
    assert ids.reshape(-1)[order].tolist() == [0, 0, 1, 2, 3, 3]
    assert order.tolist() == [1, 2, 5, 3, 0, 4]  # stable: token order within an expert


@pytest.mark.parametrize("kind", ["random", "skewed", "sparse"])
@pytest.mark.parametrize("block_m", [4, 16])
def test_align_to_blocks(kind: str, block_m: int) -> None:
    gen = torch.Generator().manual_seed(3)
    ids = make_routes(kind, 21, 2, 8, gen)
    al = align_to_blocks(ids, 8, block_m)
    pairs = ids.numel()
    assert al.sorted_pairs.numel() == max_padded_rows(pairs, 8, block_m)
    real = al.sorted_pairs[al.sorted_pairs < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    flat = ids.reshape(-1)
    for b, expert in enumerate(al.block_expert.tolist()):
        rows = al.sorted_pairs[b * block_m:(b + 1) * block_m]
        rows = rows[rows < pairs]
        if expert < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0, "a used block holds at least one pair"
            assert (flat[rows] == expert).all()


@pytest.mark.parametrize("kind", ["random", "skewed", "sparse"])
@pytest.mark.parametrize("tokens,top_k,experts", [(1, 2, 4), (13, 2, 8), (40, 4, 16)])
def test_cpu_experts_match_loop(kind: str, tokens: int, top_k: int, experts: int) -> None:
    gen = torch.Generator().manual_seed(tokens * 7 + top_k)
    hidden, inter = 32, 24
    moe = FusedMoE(experts, hidden, inter, "silu")
    with torch.no_grad():
        moe.gate_up_proj.copy_(torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2)
        moe.down_proj.copy_(torch.randn(experts, hidden, inter, generator=gen) * 0.2)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = make_routes(kind, tokens, top_k, experts, gen)
    w = torch.rand(tokens, top_k, generator=gen)
    with torch.no_grad():
        out = moe(x, w, ids)
    ref = experts_loop(x, moe.gate_up_proj.data, moe.down_proj.data, w, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_cpu_experts_gelu_bfloat16() -> None:
    gen = torch.Generator().manual_seed(5)
    moe = FusedMoE(4, 16, 8, "gelu_pytorch_tanh")
    with torch.no_grad():
        moe.gate_up_proj.copy_(torch.randn(4, 16, 16, generator=gen) * 0.3)
        moe.down_proj.copy_(torch.randn(4, 16, 8, generator=gen) * 0.3)
    x = torch.randn(9, 16, generator=gen)
    ids = make_routes("random", 9, 2, 4, gen)
    w = torch.rand(9, 2, generator=gen)
    ref = experts_loop(x, moe.gate_up_proj.data, moe.down_proj.data, w, ids,
                       act=lambda h: torch.nn.functional.gelu(h, approximate="tanh"))
    moe = moe.to(torch.bfloat16)
    with torch.no_grad():
        out = moe(x.to(torch.bfloat16), w, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2)


def test_expert_shards_load_and_check_shapes() -> None:
    moe = FusedMoE(3, 8, 4, "silu")
    gate, up, down = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 4)
    moe.load_shard("2.gate", "gate_up_proj", gate)
    moe.load_shard("2.up", "gate_up_proj", up)
    moe.load_shard("2.down", "down_proj", down)
    assert torch.equal(moe.gate_up_proj.data[2], torch.cat([gate, up]))
    assert torch.equal(moe.down_proj.data[2], down)
    with pytest.raises(ValueError, match="shape"):
        moe.load_shard("1.up", "gate_up_proj", torch.randn(5, 8))
    with pytest.raises(ValueError, match="out of range"):
        moe.load_shard("3.gate", "gate_up_proj", gate)
    shards = moe.checkpoint_shards()
    assert len(shards["gate_up_proj"]) == 6 and len(shards["down_proj"]) == 3


# ---- loading ----------------------------------------------------------------------------------

def _stacked_copy(src: str, dst) -> str:
    """The checkpoint of `src` rewritten with each layer's experts stacked, as transformers 5
    names them in memory (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj
    [E, H, I])."""
    import re
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    state = load_file(str(Path(src) / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in state.items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = tensor
        else:
            out[name] = tensor
    assert experts, "the source has no per-expert weights"
    for prefix, by_expert in experts.items():
        order = sorted(by_expert)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in order])
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in order])
    dst = Path(dst)
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_stacked_expert_checkpoint_loads_the_same(tiny_model_dir, tmp_path) -> None:
    """Per-expert tensors (Qwen's names) and stacked ones give the same weights; a missing
    expert is named."""
    from folio.model.discovery import resolve_model_source
    from folio.model.loader import load_model
    from transformers import AutoConfig

    src = tiny_model_dir("qwen2_moe")
    stacked = _stacked_copy(src, tmp_path / "stacked")
    cfg = AutoConfig.from_pretrained(src)
    models = [load_model(resolve_model_source(d), cfg, torch.float32, torch.device("cpu"), 64)[0]
              for d in (src, stacked)]
    a, b = (dict(m.named_parameters()) for m in models)
    assert a.keys() == b.keys()
    assert "layers.0.mlp.experts.gate_up_proj" in a and "layers.1.mlp.gate_up_proj.weight" in a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_missing_expert_is_named(tiny_model_dir, tmp_path) -> None:
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from folio.model.discovery import resolve_model_source
    from folio.model.loader import load_model
    from transformers import AutoConfig

    src = tiny_model_dir("mixtral")
    dst = tmp_path / "partial"
    shutil.copytree(src, dst)
    state = load_file(str(Path(src) / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.gate_up_proj:3\.up"):
        load_model(resolve_model_source(str(dst)), AutoConfig.from_pretrained(src),
                   torch.float32, torch.device("cpu"), 64)


def test_quantized_moe_is_refused(tiny_model_dir) -> None:
    from folio.model.discovery import resolve_model_source
    from folio.model.loader import load_model
    from transformers import AutoConfig

    src = tiny_model_dir("mixtral")
    with pytest.raises(ValueError, match="mixture-of-experts"):
        load_model(resolve_model_source(src), AutoConfig.from_pretrained(src), torch.float32,
                   torch.device("cpu"), 64, quantization="int8")


def test_cpu_experts_with_biases_and_clamped_swiglu() -> None:
    """GPT-OSS's experts: biases on both projections and the clamped SwiGLU (a low limit, so
    the clamp changes values)."""
    gen = torch.Generator().manual_seed(6)
    E, Hd, I, T, k = 5, 24, 16, 17, 2
    moe = FusedMoE(E, Hd, I, "silu", bias=True, activation=ExpertActivation.SWIGLU_OAI,
                   swiglu_alpha=1.702, swiglu_limit=0.8)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    x = torch.randn(T, Hd, generator=gen)
    ids = make_routes("skewed", T, k, E, gen)
    w = torch.rand(T, k, generator=gen)
    with torch.no_grad():
        out = moe(x, w, ids)
    ref = experts_loop(x, moe.gate_up_proj.data, moe.down_proj.data, w, ids,
                       gated=lambda g, u: swiglu_oai(g, u, 1.702, 0.8),
                       b13=moe.gate_up_proj_bias.data, b2=moe.down_proj_bias.data)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    unclamped = experts_loop(x, moe.gate_up_proj.data, moe.down_proj.data, w, ids,
                             gated=lambda g, u: swiglu_oai(g, u, 1.702, 100.0),
                             b13=moe.gate_up_proj_bias.data, b2=moe.down_proj_bias.data)
    assert (unclamped - ref).abs().max() > 1e-2   # the clamp mattered


def test_transposed_interleaved_checkpoint_layout() -> None:
    """GPT-OSS stores gate_up [E, H, 2I] with gate/up interleaved by column, down [E, I, H]."""
    moe = FusedMoE(2, 3, 2, "silu", bias=True, transposed_interleaved_checkpoint=True)
    gate = torch.randn(2, 2, 3)      # [E, I, H] in folio's orientation
    up = torch.randn(2, 2, 3)
    stored = torch.stack([gate, up], dim=2).reshape(2, 4, 3).transpose(1, 2)  # [E, H, 2I]
    assert torch.equal(moe.convert_checkpoint_tensor("gate_up_proj", stored),
                       torch.cat([gate, up], dim=1))
    bias = torch.tensor([[0., 10., 1., 11.], [2., 12., 3., 13.]])
    assert moe.convert_checkpoint_tensor("gate_up_proj_bias", bias).tolist() == \
        [[0., 1., 10., 11.], [2., 3., 12., 13.]]
    down = torch.randn(2, 2, 3)
    assert torch.equal(moe.convert_checkpoint_tensor("down_proj", down), down.transpose(1, 2))
