// folio's C++ CPU kernels: the functions bindings.cpp exposes to Python.
#pragma once

#include <torch/extension.h>

#include <vector>

// y [M, N] = x [M, K] @ W^T for W the sum of 4-bit planes (q4_matmul.cpp).
torch::Tensor q4_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scale,
                        torch::Tensor zero);

// y [M, N] = x [M, K] @ W^T for W = int8 codes [N, K] * float32 scales [N, G] per group of
// K / G along K (int8_matmul.cpp).
torch::Tensor int8_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scale);

// Writes this step's K/V into the paged cache, then attends every query token over its
// request's visible context; an FP8 cache scaled by k_scale / v_scale; scores soft-capped
// (logits_soft_cap > 0) and per-head sink logits in the denominator (sinks) when given
// (paged_attention.cpp).
void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key,
                     torch::Tensor value, torch::Tensor kv_cache, torch::Tensor slot_mapping,
                     torch::Tensor block_tables, torch::Tensor query_start_loc,
                     torch::Tensor seq_lens, double scale, int64_t sliding_window,
                     torch::Tensor k_scale, torch::Tensor v_scale, double logits_soft_cap,
                     c10::optional<torch::Tensor> sinks);

// RMSNorm of each row of x (after adding residual when given: returns {out, x + residual}),
// float32 (elementwise.cpp).
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                    c10::optional<torch::Tensor> residual);

// Neox rotary embedding of q [T, H, D] and k [T, KVH, D] (strided rows allowed) over their
// first rotary_dim elements, into new contiguous tensors {q, k} (elementwise.cpp).
std::vector<torch::Tensor> rotary_neox(torch::Tensor positions, torch::Tensor q,
                                       torch::Tensor k, torch::Tensor cos, torch::Tensor sin,
                                       int64_t rotary_dim);

// silu(gate) * up for gate_up [T, 2I] = [gate | up] (elementwise.cpp).
torch::Tensor silu_and_mul(torch::Tensor gate_up);
