"""A norm handing a W8A8 projection its input already quantized (QuantizedRows): the decoder
layer's choice (`DecoderLayer._norm_into`), the projections taking the rows (`Linear`,
`GatedMLP`), and when a projection asks for them (`Linear.quantized_input_dtype`). The fused
kernel's bytes are checked under the interpreter (test_quant_kernels.py, int8) and on the GPU
(tests/gpu/test_gpu_quant.py: FP8 and int8, and a whole decoder layer with and without the
fusion, bit for bit); CPU tensors never take the path, so the choice is driven here by fakes."""
from __future__ import annotations

import torch

from folio.model.decoder import DecoderLayer
from folio.model.kernels.act_quant import quantize_activations_reference
from folio.model.layers import GatedMLP, Linear, QuantizedRows, RMSNorm
from folio.model.quant.eight_bit_linear import EightBitLinear
from folio.model.quant.formats import EightBitWeight


class _Norm(RMSNorm):
    def __init__(self, ok: bool):
        super().__init__(8)
        self.ok = ok
        self.calls = []

    def quantized_output_ok(self, x):
        return self.ok

    def forward_quantized(self, x, residual, dtype):
        self.calls.append(("quantized", dtype, residual is not None))
        stream = None if residual is None else x + residual
        return QuantizedRows(torch.zeros(x.shape, dtype=dtype), torch.ones(x.shape[0], 1),
                             x.dtype), stream

    def forward(self, x, residual=None):
        self.calls.append(("plain", None, residual is not None))
        if residual is None:
            return x * 2
        return (x + residual) * 2, x + residual


class _Proj:
    def __init__(self, dtype):
        self.dtype = dtype

    def quantized_input_dtype(self, x):
        return self.dtype


def test_norm_into_quantizes_only_for_a_projection_that_asks():
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    for residual in (None, r):
        norm = _Norm(ok=True)
        rows, stream = DecoderLayer._norm_into(norm, _Proj(torch.int8), x, residual)
        assert type(rows) is QuantizedRows and rows.codes.dtype == torch.int8
        assert rows.dtype == x.dtype and rows.shape == x.shape
        # the stream is the layer's input (first layer) or the sum the norm computed
        assert torch.equal(stream, x if residual is None else x + r)
        assert norm.calls == [("quantized", torch.int8, residual is not None)]
    for norm, proj in ((_Norm(ok=True), _Proj(None)), (_Norm(ok=True), None),
                       (_Norm(ok=False), _Proj(torch.int8))):
        out, stream = DecoderLayer._norm_into(norm, proj, x, r)
        assert torch.equal(out, (x + r) * 2) and torch.equal(stream, x + r)
        assert norm.calls == [("plain", None, True)]
    # a norm that is not folio's RMSNorm (EAGLE's head stands in an identity) runs as it is
    identity = lambda h, res=None: h if res is None else (h + res, h + res)  # noqa: E731
    out, stream = DecoderLayer._norm_into(identity, _Proj(torch.int8), x, r)
    assert torch.equal(out, x + r) and torch.equal(stream, x + r)


def _int8_linear(n: int, k: int, bias: bool) -> Linear:
    torch.manual_seed(n + k)
    linear = Linear(k, n, bias=bias)
    w = torch.randn(n, k) * 0.05
    s = w.abs().amax(dim=1) / 127
    linear.packed = EightBitLinear(EightBitWeight(torch.round(w / s[:, None]).to(torch.int8), s),
                                   "int8")
    return linear


def test_linear_takes_quantized_rows_through_its_w8a8_product():
    linear = _int8_linear(24, 64, bias=True)
    x = torch.randn(20, 64)
    codes, scale = quantize_activations_reference(x, torch.int8)
    out = linear(QuantizedRows(codes, scale, torch.float32))
    ref = linear.packed.forward_quantized(codes, scale, linear.bias, torch.float32)
    assert torch.equal(out, ref)
    # the same product the projection makes of the 16-bit rows, up to float rounding
    assert torch.allclose(out, linear(x), rtol=1e-4, atol=1e-4)


def test_a_projection_that_needs_its_16_bit_input_does_not_ask():
    linear = _int8_linear(24, 64, bias=False)
    x = torch.randn(20, 64)
    assert linear.quantized_input_dtype(x) is None       # CPU: the reference path
    linear.packed.quantized_input_dtype = lambda x: torch.int8   # as on CUDA at prefill rows
    assert linear.quantized_input_dtype(x) == torch.int8
    linear.lora = object()                                # LoRA adds its delta from x
    assert linear.quantized_input_dtype(x) is None
    linear.lora, linear.tp_reduce = None, object()        # row-parallel: not its input
    assert linear.quantized_input_dtype(x) is None
    assert Linear(64, 24).quantized_input_dtype(x) is None   # 16-bit weights


def test_gated_mlp_takes_quantized_rows():
    mlp = GatedMLP(64, 48, bias=False, act="silu")
    mlp.gate_up_proj = _int8_linear(96, 64, bias=False)
    x = torch.randn(20, 64)
    codes, scale = quantize_activations_reference(x, torch.int8)
    out = mlp(QuantizedRows(codes, scale, torch.float32))
    gate_up = mlp.gate_up_proj.packed.forward_quantized(codes, scale, None, torch.float32)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = mlp.down_proj(torch.nn.functional.silu(gate) * up)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(out, mlp(x), rtol=1e-4, atol=1e-4)


def test_gated_mlp_does_not_ask_where_its_fused_gemv_serves_the_rows():
    mlp = GatedMLP(64, 48, bias=False, act="silu")
    mlp.gate_up_proj = _int8_linear(96, 64, bias=False)
    packed = mlp.gate_up_proj.packed
    packed.quantized_input_dtype = lambda x: torch.int8      # as on CUDA
    x = torch.randn(4, 64)
    packed.gate_up_silu_wanted = lambda x, bias: True         # decode rows: the fused GEMV
    assert mlp.quantized_input_dtype(x) is None
    packed.gate_up_silu_wanted = lambda x, bias: False        # prefill rows
    assert mlp.quantized_input_dtype(x) == torch.int8
    mlp.fused_silu = False                                    # another activation: no fused GEMV
    packed.gate_up_silu_wanted = lambda x, bias: True
    assert mlp.quantized_input_dtype(x) == torch.int8


def test_gated_mlp_hands_quantized_rows_to_no_norm_epilogue():
    """A layer chaining its norms (DecoderLM.run_layers) may hand its MLP the norm's
    QuantizedRows (a W8A8 MLP at prefill rows): forward_add_norm then runs the MLP as forward
    does and leaves the add and norm to the caller (None), where it had crashed reading
    QuantizedRows as a tensor (the 8-bit gate_up's fused-activation check)."""
    mlp = GatedMLP(64, 48, bias=False, act="silu")
    mlp.gate_up_proj = _int8_linear(96, 64, bias=False)
    x = torch.randn(20, 64)
    codes, scale = quantize_activations_reference(x, torch.int8)
    rows = QuantizedRows(codes, scale, torch.float32)
    out, stream = mlp.forward_add_norm(rows, torch.randn(20, 64), RMSNorm(64))
    assert stream is None
    assert torch.equal(out, mlp(rows))
