// folio's C++ CPU kernels: the functions bindings.cpp exposes to Python.
#pragma once

// ATen's tensor and the few ops the kernels call, not <torch/extension.h> (torch's C++ API and
// pybind11, which only bindings.cpp needs): each source then compiles in a few seconds rather
// than ~25, which a first start and the tests building other variants wait for.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>

#include <cstdio>
#include <vector>

// TORCH_CHECK with a printf-formatted message, handed to torch as one C string. A TORCH_CHECK
// whose message has more than one part is joined into a std::string in this library and
// passed to libtorch; on the lent GPU's host (torch 2.11, Python 3.12, its own compiler) every
// such failing check crashed the process with SIGSEGV (a minimal extension did too), while
// one-string checks raised RuntimeError (tools/diag_cpu_ext_errors.py). So every check whose
// message carries values goes through here.
#define FOLIO_CHECK(cond, ...)                                             \
  do {                                                                     \
    if (!(cond)) {                                                         \
      char folio_check_message[512];                                       \
      std::snprintf(folio_check_message, sizeof folio_check_message,       \
                    __VA_ARGS__);                                          \
      TORCH_CHECK(false, static_cast<const char*>(folio_check_message));  \
    }                                                                      \
  } while (0)

// y [M, N] = x [M, K] @ W^T for W the sum of 4-bit planes (q4_matmul.cpp).
at::Tensor q4_matmul(at::Tensor x, at::Tensor codes, at::Tensor scale, at::Tensor zero);

// y [M, N] = x [M, K] @ W^T for W = int8 codes [N, K] * float32 scales [N, G] per group of
// K / G along K (int8_matmul.cpp).
at::Tensor int8_matmul(at::Tensor x, at::Tensor codes, at::Tensor scale);

// Writes this step's K/V into the paged cache, then attends every query token over its
// request's visible context; an FP8 cache scaled by k_scale / v_scale; scores soft-capped
// (logits_soft_cap > 0) and per-head sink logits in the denominator (sinks) when given
// (paged_attention.cpp).
void paged_attention(at::Tensor out, at::Tensor query, at::Tensor key,
                     at::Tensor value, at::Tensor kv_cache, at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor query_start_loc,
                     at::Tensor seq_lens, double scale, int64_t sliding_window,
                     at::Tensor k_scale, at::Tensor v_scale, double logits_soft_cap,
                     c10::optional<at::Tensor> sinks);

// RMSNorm of each row of x (after adding residual when given: returns {out, x + residual}),
// float32 (elementwise.cpp).
std::vector<at::Tensor> rms_norm(at::Tensor x, at::Tensor weight, double eps,
                                 c10::optional<at::Tensor> residual);

// Neox rotary embedding of q [T, H, D] and k [T, KVH, D] (strided rows allowed) over their
// first rotary_dim elements, into new contiguous tensors {q, k} (elementwise.cpp).
std::vector<at::Tensor> rotary_neox(at::Tensor positions, at::Tensor q, at::Tensor k,
                                    at::Tensor cos, at::Tensor sin, int64_t rotary_dim);

// silu(gate) * up for gate_up [T, 2I] = [gate | up] (elementwise.cpp).
at::Tensor silu_and_mul(at::Tensor gate_up);
