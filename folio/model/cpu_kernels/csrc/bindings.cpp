// The Python face of folio's C++ CPU kernels (loaded by folio/model/cpu_kernels/__init__.py).
#include "ops.h"

// pybind11 with torch's tensor casters, the part of <torch/extension.h> a module definition
// needs (the whole header costs this file ~10 s more to compile)
#include <torch/csrc/utils/pybind.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_matmul", &q4_matmul, "4-bit-plane matmul, float32", py::arg("x"), py::arg("codes"),
        py::arg("scale"), py::arg("zero"));
  m.def("int8_matmul", &int8_matmul, "int8 weight-only matmul, float32", py::arg("x"),
        py::arg("codes"), py::arg("scale"));
  m.def("paged_attention", &paged_attention,
        "write K/V into the paged cache (FP8: scaled by k_scale / v_scale), then causal "
        "attention over it, float32 queries; optional soft cap and attention sinks");
#ifndef FOLIO_SIMD_KERNELS_ONLY  // simd.h's kernels alone: cpu_kernels._build, for tests
  m.def("rms_norm", &rms_norm, "RMSNorm (with the residual add), float32", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("rotary_neox", &rotary_neox, "neox rotary embedding, float32");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up, float32");
#endif
}
