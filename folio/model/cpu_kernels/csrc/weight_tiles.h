// What the quantized matmuls (q4_matmul.cpp, int8_matmul.cpp) share: the many-row path that
// rebuilds tiles of W in float32 and multiplies them with torch's GEMM, and the split of W's
// rows over torch's threads for the few-row paths.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>

#include "parallel.h"

#include <algorithm>
#include <vector>

namespace folio_cpu {

// From this many rows of x on, the matmuls rebuild tiles of W and run torch's GEMM; below it
// their register-blocked kernels are faster (measured on a 2-vCPU AVX-512 VM: equal at 32
// rows, the blocked kernels 1.5-2x faster at 4-16; on an AVX2 EPYC VM equal at 32-33 rows:
// tools/bench_cpu_kernels.py).
constexpr int64_t kTileRows = 33;
constexpr int64_t kTileBytes = 1 << 20;  // float32 bytes of one tile of W (fits L2)
constexpr int64_t kRowTask = 64;         // rows of W per task of the few-row paths

// y [M, N] = x [M, K] @ W^T, W's rows [n0, n1) rebuilt into a float32 buffer by
// dequantize(n0, n1, out) ([n1 - n0, K] row-major): each task rebuilds its tile and runs one
// single-threaded GEMM into its columns of y (torch's GEMM runs on the calling thread inside
// a parallel region), so the quantized bytes are read once and the product runs at GEMM speed.
template <typename Dequantize>
void tiled_gemm(const at::Tensor& x, at::Tensor& y, int64_t N, int64_t K,
                const Dequantize& dequantize) {
  const int threads = at::get_num_threads();
  const int64_t tile = std::max<int64_t>(
      16, std::min<int64_t>(kTileBytes / (K * 4), (N + threads - 1) / threads) / 16 * 16);
  parallel_tasks((N + tile - 1) / tile, [&](const auto& take) {
    // Worker threads do not inherit the caller's inference mode; inside it, writing into y
    // (an inference tensor when the caller is in inference mode) is allowed either way.
    c10::InferenceMode inference;
    std::vector<float> buffer(tile * K);
    auto w = at::from_blob(buffer.data(), {tile, K}, x.options());
    for (int64_t t; (t = take()) >= 0;) {
      const int64_t n0 = t * tile, n1 = std::min<int64_t>(N, n0 + tile);
      dequantize(n0, n1, buffer.data());
      auto out = y.narrow(1, n0, n1 - n0);
      at::mm_out(out, x, w.narrow(0, 0, n1 - n0).t());
    }
  });
}

// rows(n0, n1) over W's rows in tasks of kRowTask rows (a multiple of every kernel's row
// block), shared out dynamically (parallel.h).
template <typename Rows>
void split_rows(int64_t N, const Rows& rows) {
  parallel_tasks((N + kRowTask - 1) / kRowTask, [&](const auto& take) {
    for (int64_t t; (t = take()) >= 0;) rows(t * kRowTask, std::min<int64_t>(N, (t + 1) * kRowTask));
  });
}

}  // namespace folio_cpu
