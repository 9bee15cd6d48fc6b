"""The decoder layer as one C++ call on the CPU (folio/model/cpu_layer.py,
cpu_kernels/csrc/decoder_layer.cpp) against the Python layer it stands for:

- one layer of the default model (SmolLM2-135M, its Q4_1 matrices kept packed) on a mixed step
  (a decode, a prefill chunk over a cached prefix, a fresh prompt): the output, the residual
  stream and the KV cache written are the Python path's bit for bit, with the attention options
  the layer passes on (sliding window, soft cap, sinks, FP8 and float16 caches with per-head
  scales), with biases (Qwen2's q/k/v) and with the projections in the other packed forms (a
  concatenation of 4-bit and int8 parts);
- through the engine: greedy tokens and logprobs with the C++ layer equal the Python path's,
  batched, with prefix caching and chunked prefill, and every layer of the model ran it;
- a layer that does not qualify (a bias not in float32, LoRA, q/k norms, FOLIO_KERNELS=torch
  or FOLIO_CPU_LAYER=0) or a step the C++ layer does not take runs the Python path; a replaced
  projection is rebuilt."""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from folio.model.attention import AttentionMetadata
from folio.model.cpu_layer import CpuLayerRunner, build_layer_kernel
from folio.model.decoder import DecoderLayer

LAYER = 3
BS = 16


@contextlib.contextmanager
def _swapped(obj: nn.Module, **values):
    """obj's attributes set to `values`, then back. Not monkeypatch.setattr: pytest now
    restores the instance __dict__ entry, and an nn.Module keeps its parameters and
    submodules in dicts of their own, so its undo deleted them."""
    saved = {name: getattr(obj, name) for name in values}
    try:
        for name, value in values.items():
            setattr(obj, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


class _PythonPath:
    """A runner that never runs: the layer's forward is the Python path."""

    def run(self, *args):
        return None


@pytest.fixture(scope="module")
def packed_model():
    from folio.model.default_model import default_gguf_path
    from folio.model.discovery import load_hf_config, resolve_model_source
    from folio.model.loader import load_model
    source = resolve_model_source(default_gguf_path())
    hf_config, _ = load_hf_config(source)
    model, _ = load_model(source, hf_config, torch.float32, torch.device("cpu"), 256,
                          quantization="gguf")
    return model


def _step(spec, kv_dtype: torch.dtype, seed: int = 0):
    """A mixed step of three requests over a randomly filled cache: request 0 decodes one
    token after 20 cached, request 1 prefills 10 tokens after 7 cached, request 2 prefills 5
    fresh ones. Returns (positions, hidden, residual, kv_cache, metadata)."""
    g = torch.Generator().manual_seed(seed)
    cached, new = [20, 7, 0], [1, 10, 5]
    tables = torch.tensor([[0, 1, 0], [2, 0, 0], [3, 0, 0]])
    slots, positions = [], []
    for r in range(3):
        for p in range(cached[r], cached[r] + new[r]):
            slots.append(int(tables[r, p // BS]) * BS + p % BS)
            positions.append(p)
    T = len(slots)
    kv = torch.randn(2, 4, BS, spec.num_kv_heads, spec.head_dim, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=[0, 1, 11, 16],
        seq_lens=[c + n for c, n in zip(cached, new)], num_computed_tokens=cached,
        block_tables=tables, block_size=BS)
    hidden = torch.randn(T, spec.hidden_size, generator=g)
    residual = torch.randn(T, spec.hidden_size, generator=g)
    return torch.tensor(positions), hidden, residual, kv.to(kv_dtype), meta


def _both_paths(layer: DecoderLayer, step, first_layer: bool):
    """(Python path's output, stream, cache), (C++ layer's), on copies of one step."""
    positions, hidden, residual, kv, meta = step
    residual = None if first_layer else residual
    results = []
    try:
        for runner in (_PythonPath(), CpuLayerRunner()):
            layer.cpu_runner = runner
            cache = kv.clone()
            with torch.inference_mode():
                out, stream = layer(positions, hidden.clone(),
                                    None if residual is None else residual.clone(), cache,
                                    dataclasses.replace(meta, cache={}))
            results.append((out, stream, cache))
        assert runner._kernel is not None, "the C++ layer did not run"
    finally:
        layer.cpu_runner = CpuLayerRunner()
    return results


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_identical(python, fused) -> None:
    for a, b, what in zip(python, fused, ("output", "residual stream", "kv cache")):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(_bits(a), _bits(b)), what


OPTIONS = {
    "plain": {},
    "sliding_window": {"sliding_window": 6},
    "soft_cap": {"logits_soft_cap": 3.0},
    "sinks": {"sinks": "random"},
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("first_layer", [False, True])
def test_layer_is_the_python_layer_bit_for_bit(packed_model, option: str,
                                               first_layer: bool) -> None:
    layer = packed_model.layers[LAYER]
    attn = layer.self_attn
    values = {name: nn.Parameter(torch.randn(attn.num_heads), requires_grad=False)
              if value == "random" else value for name, value in OPTIONS[option].items()}
    with _swapped(attn, **values):
        python, fused = _both_paths(layer, _step(packed_model.spec, torch.float32),
                                    first_layer)
    _assert_identical(python, fused)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_layer_with_16_and_8_bit_caches(packed_model, kv_dtype: torch.dtype) -> None:
    layer = packed_model.layers[LAYER]
    attn = layer.self_attn
    if kv_dtype == torch.float8_e4m3fn:   # per-head scales, updated in place as a checkpoint's
        attn.k_scale.copy_(torch.tensor([0.02, 0.03, 0.05]))
        attn.v_scale.copy_(torch.tensor([0.01, 0.02, 0.04]))
    try:
        python, fused = _both_paths(layer, _step(packed_model.spec, kv_dtype), False)
    finally:
        attn.k_scale.fill_(1.0)
        attn.v_scale.fill_(1.0)
    _assert_identical(python, fused)


def _int8_rows(weight: torch.Tensor):
    from folio.model.quant.gguf_int8 import Int8Rows
    from folio.model.quant.int8_packed import PackedInt8Weight
    w = weight.numpy()
    scale = np.abs(w).reshape(w.shape[0], -1, 32).max(-1) / 127 + 1e-12
    codes = np.clip(np.round(w / np.repeat(scale, 32, axis=1)), -127, 127).astype(np.int8)
    return PackedInt8Weight(Int8Rows(codes, scale.astype(np.float32)))


def test_concatenated_and_int8_projections(packed_model) -> None:
    """qkv as a concatenation (4-bit q/k rows, int8 v rows: a Q4_K_M file's layout), down_proj
    as int8 rows."""
    from folio.model.quant.gguf_planes import Plane
    from folio.model.quant.int4_packed import PackedInt4Weight
    from folio.model.quant.packed import PackedConcat
    layer = packed_model.layers[LAYER]
    attn, mlp = layer.self_attn, layer.mlp
    qkv = attn.qkv_proj.packed
    spec = packed_model.spec
    qk_rows = (spec.num_heads + spec.num_kv_heads) * spec.head_dim
    # 4-bit codes [N, K] (not in the file's order: any codes do, both paths read the same)
    codes = torch.cat([qkv.codes[0] & 0x0F, qkv.codes[0] >> 4], dim=-1)
    planes = [Plane(codes[:qk_rows].numpy(), qkv.scale[0, :qk_rows].numpy(),
                    qkv.zero[0, :qk_rows].numpy())]
    concat = PackedConcat([PackedInt4Weight(planes), _int8_rows(qkv.dequantize()[qk_rows:])])
    with _swapped(attn.qkv_proj, packed=concat), \
            _swapped(mlp.down_proj, packed=_int8_rows(mlp.down_proj.packed.dequantize())):
        python, fused = _both_paths(layer, _step(spec, torch.float32), False)
    _assert_identical(python, fused)


def test_projections_with_biases(packed_model) -> None:
    """Qwen2's q/k/v biases (and, here, biases on every projection): added after the product
    as the Python path adds them."""
    layer = packed_model.layers[LAYER]
    attn, mlp = layer.self_attn, layer.mlp
    g = torch.Generator().manual_seed(7)

    def bias(proj) -> nn.Parameter:
        return nn.Parameter(torch.randn(proj.out_features, generator=g) * 0.1,
                            requires_grad=False)

    with _swapped(attn.qkv_proj, bias=bias(attn.qkv_proj)):
        python, fused = _both_paths(layer, _step(packed_model.spec, torch.float32), False)
        _assert_identical(python, fused)
        with _swapped(attn.o_proj, bias=bias(attn.o_proj)), \
                _swapped(mlp.gate_up_proj, bias=bias(mlp.gate_up_proj)), \
                _swapped(mlp.down_proj, bias=bias(mlp.down_proj)):
            python, fused = _both_paths(layer, _step(packed_model.spec, torch.float32), True)
    _assert_identical(python, fused)


def test_a_replaced_projection_is_rebuilt(packed_model) -> None:
    layer = packed_model.layers[LAYER]
    runner = CpuLayerRunner()
    positions, hidden, residual, kv, meta = _step(packed_model.spec, torch.float32)
    with torch.inference_mode():
        first = runner.run(layer, positions, hidden, residual, kv.clone(), meta)
        kernel = runner._kernel
        assert first is not None and kernel is not None
        assert runner.run(layer, positions, hidden, residual, kv.clone(), meta) is not None
        assert runner._kernel is kernel          # nothing replaced: not rebuilt
        with _swapped(layer.mlp.down_proj,
                      packed=_int8_rows(layer.mlp.down_proj.packed.dequantize())):
            second = runner.run(layer, positions, hidden, residual, kv.clone(), meta)
            assert runner._kernel is not kernel
            assert not torch.equal(first[0], second[0])   # int8 rows: another product
        # LoRA on a projection: the layer no longer qualifies
        with _swapped(layer.self_attn.o_proj, lora=nn.Identity()):
            assert runner.run(layer, positions, hidden, residual, kv.clone(), meta) is None
        # and back as it was: built again
        assert runner.run(layer, positions, hidden, residual, kv.clone(), meta) is not None


class _Wrapped(nn.Module):
    """A module around a packed weight that does more than multiply by it."""

    def __init__(self, packed: nn.Module) -> None:
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = packed.in_features, packed.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.forward(x.flip(-1))


def test_layers_that_do_not_qualify(packed_model) -> None:
    from folio.model.quant.packed import PackedConcat
    layer = packed_model.layers[LAYER]
    assert build_layer_kernel(layer) is not None
    proj = layer.self_attn.qkv_proj
    with _swapped(proj, bias=nn.Parameter(torch.zeros(proj.out_features,
                                                      dtype=torch.bfloat16))):
        assert build_layer_kernel(layer) is None   # a bias not in float32
    with _swapped(layer.self_attn, q_norm=nn.Identity()):
        assert build_layer_kernel(layer) is None
    torch_kernels = dataclasses.replace(layer.input_layernorm.kernels, kernels="torch")
    assert not torch_kernels.fused_kernels
    with _swapped(layer.input_layernorm, kernels=torch_kernels):   # FOLIO_KERNELS=torch
        assert build_layer_kernel(layer) is None
    from folio.model.kernel_config import resolve_kernel_config
    layer_off = resolve_kernel_config({"FOLIO_CPU_LAYER": "0"})
    assert layer_off.fused_kernels and not layer_off.cpu_layer_on
    with _swapped(layer.input_layernorm, kernels=layer_off):          # FOLIO_CPU_LAYER=0
        assert build_layer_kernel(layer) is None
    with _swapped(proj, packed=None):   # a float weight
        assert build_layer_kernel(layer) is None
    wrapped = _Wrapped(proj.packed)       # e.g. an act-order permutation around a packed weight
    with _swapped(proj, packed=PackedConcat([wrapped])):
        assert build_layer_kernel(layer) is None
    assert build_layer_kernel(layer) is not None


def test_steps_the_layer_does_not_take(packed_model) -> None:
    layer = packed_model.layers[LAYER]
    runner = CpuLayerRunner()
    positions, hidden, residual, kv, meta = _step(packed_model.spec, torch.float32)
    with torch.inference_mode():
        # M-RoPE positions (three rows), int32 positions, bfloat16 activations
        assert runner.run(layer, positions.expand(3, -1), hidden, residual, kv, meta) is None
        assert runner.run(layer, positions.int(), hidden, residual, kv, meta) is None
        assert runner.run(layer, positions, hidden.bfloat16(), residual.bfloat16(), kv,
                          meta) is None
        # the step that computes FP8 scales from its keys
        fp8 = kv.to(torch.float8_e4m3fn)
        meta.calculate_kv_scales = True
        assert runner.run(layer, positions, hidden, residual, fp8, meta) is None


def _assert_engine_matches_the_python_path(llm, prompts, sp, monkeypatch) -> None:
    """`llm.generate` twice: with the C++ layers (every layer of the model built one), then
    with the Python path; greedy tokens and logprobs equal."""
    model = llm.llm_engine.engine_core.executor.worker.runner.model

    def run() -> list:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return [(o.outputs[0].token_ids,
                 [{k: v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs])
                for o in outs]

    fused = run()
    assert all(layer.cpu_runner._kernel is not None for layer in model.layers)
    monkeypatch.setattr(CpuLayerRunner, "run", lambda self, *args: None)
    assert run() == fused


def test_engine_tokens_and_logprobs_equal_the_python_path(monkeypatch) -> None:
    """The default model through LLM.generate: three prompts sharing a prefix (prefix
    caching), chunked prefill of 24 tokens a step, greedy with logprobs — once with the C++
    layers, once with the Python path."""
    from folio import LLM, SamplingParams
    llm = LLM(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24,
              enable_chunked_prefill=True, enable_prefix_caching=True)
    prefix = list(range(2000, 2040))
    prompts = [{"prompt_token_ids": prefix + list(range(3000 + 50 * i, 3010 + 50 * i))}
               for i in range(3)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    _assert_engine_matches_the_python_path(llm, prompts, sp, monkeypatch)


def test_qwen2_with_int8_weights_through_the_engine(tiny_model_dir, monkeypatch) -> None:
    """A tiny random Qwen2 (q/k/v biases) quantized to int8 rows on load (`quantization
    "int8"`): every layer runs as one C++ call, and greedy tokens and logprobs equal the
    Python path's."""
    from folio import LLM, SamplingParams
    # no prefix caching: the second run's steps must have the first's shapes (a cached prefix
    # would turn a 52-row prefill, tiles and torch's GEMM, into a 20-row blocked step)
    llm = LLM(model=tiny_model_dir("qwen2"), quantization="int8", dtype="float32",
              device="cpu", max_model_len=128, num_gpu_blocks_override=32,
              enable_prefix_caching=False)
    model = llm.llm_engine.engine_core.executor.worker.runner.model
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    gen = torch.Generator().manual_seed(11)
    prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=gen).tolist()}
               for n in (5, 17, 30)]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    _assert_engine_matches_the_python_path(llm, prompts, sp, monkeypatch)
