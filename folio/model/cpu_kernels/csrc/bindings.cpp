// The Python face of folio's C++ CPU kernels (loaded by folio/model/cpu_kernels/__init__.py).
#include "ops.h"
#ifndef FOLIO_SIMD_KERNELS_ONLY
#include "decoder_layer.h"
#endif

// pybind11 with torch's tensor casters, the part of <torch/extension.h> a module definition
// needs (the whole header costs this file ~10 s more to compile)
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_matmul", &q4_matmul, "4-bit-plane matmul, float32", py::arg("x"), py::arg("codes"),
        py::arg("scale"), py::arg("zero"));
  m.def("int8_matmul", &int8_matmul, "int8 weight-only matmul, float32", py::arg("x"),
        py::arg("codes"), py::arg("scale"));
  m.def("paged_attention", &paged_attention,
        "write K/V into the paged cache (FP8: scaled by k_scale / v_scale), then causal "
        "attention over it, float32 queries; optional soft cap and attention sinks");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up, float32");
#ifndef FOLIO_SIMD_KERNELS_ONLY  // simd.h's kernels alone: cpu_kernels._build, for tests
  m.def("rms_norm", &rms_norm, "RMSNorm (with the residual add), float32", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("rotary_neox", &rotary_neox, "neox rotary embedding, float32");

  using folio_cpu::PackedLinear;
  using folio_cpu::PackedPart;
  py::class_<PackedPart>(m, "PackedPart", "one packed weight as decoder_layer takes it");
  m.def("q4_part", [](at::Tensor codes, at::Tensor scale, at::Tensor zero) {
    return PackedPart{codes, scale, zero};
  }, "4-bit planes (q4_matmul's weight)", py::arg("codes"), py::arg("scale"), py::arg("zero"));
  m.def("int8_part", [](at::Tensor codes, at::Tensor scale) {
    return PackedPart{codes, scale, at::Tensor()};
  }, "int8 rows (int8_matmul's weight)", py::arg("codes"), py::arg("scale"));

  using folio_cpu::DecoderLayerKernel;
  py::class_<DecoderLayerKernel>(m, "DecoderLayerKernel",
                                 "a Llama-form decoder layer in one call")
      .def("forward", &DecoderLayerKernel::forward, py::arg("positions"), py::arg("hidden"),
           py::arg("residual"), py::arg("kv_cache"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("query_start_loc"), py::arg("seq_lens"));
  m.def("decoder_layer",
        [](at::Tensor input_norm, at::Tensor post_attention_norm, double eps,
           std::vector<PackedPart> qkv, std::vector<PackedPart> o,
           std::vector<PackedPart> gate_up, std::vector<PackedPart> down, at::Tensor cos,
           at::Tensor sin, int64_t rotary_dim,
           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
           int64_t sliding_window, at::Tensor k_scale, at::Tensor v_scale,
           double logits_soft_cap, c10::optional<at::Tensor> sinks,
           std::vector<c10::optional<at::Tensor>> biases) {
          TORCH_CHECK(biases.size() == 4, "biases: one (or None) per projection, qkv, o, "
                      "gate_up, down");
          auto bias = [&](size_t i) {
            return biases[i].has_value() ? *biases[i] : at::Tensor();
          };
          return DecoderLayerKernel(
              folio_cpu::LayerNorms{input_norm, post_attention_norm, eps},
              folio_cpu::LayerProjections{PackedLinear{std::move(qkv), bias(0)},
                                          PackedLinear{std::move(o), bias(1)},
                                          PackedLinear{std::move(gate_up), bias(2)},
                                          PackedLinear{std::move(down), bias(3)}},
              folio_cpu::LayerAttention{cos, sin, rotary_dim, num_heads, num_kv_heads,
                                        head_dim, scale, sliding_window, k_scale, v_scale,
                                        logits_soft_cap, sinks});
        },
        "a Llama-form decoder layer's weights and options, for one call per step",
        py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("eps"), py::arg("qkv"),
        py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("cos"), py::arg("sin"),
        py::arg("rotary_dim"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("head_dim"), py::arg("scale"), py::arg("sliding_window"), py::arg("k_scale"),
        py::arg("v_scale"), py::arg("logits_soft_cap"), py::arg("sinks"), py::arg("biases"));
#endif
}
