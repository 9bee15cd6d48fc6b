// folio's C++ CPU kernels: the functions bindings.cpp exposes to Python.
#pragma once

#include <torch/extension.h>

#include <vector>

// y [M, N] = x [M, K] @ W^T for W the sum of 4-bit planes (q4_matmul.cpp).
torch::Tensor q4_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scale,
                        torch::Tensor zero);

// Writes this step's K/V into the paged cache, then attends every query token over its
// request's visible context (paged_attention.cpp).
void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key,
                     torch::Tensor value, torch::Tensor kv_cache, torch::Tensor slot_mapping,
                     torch::Tensor block_tables, torch::Tensor query_start_loc,
                     torch::Tensor seq_lens, double scale, int64_t sliding_window);
