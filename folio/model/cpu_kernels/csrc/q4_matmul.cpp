// 4-bit-plane matmul on the CPU in float32: y = x @ W^T, W the sum of planes whose weights are
// (code - 8) * s + z, one s and z per group of 32 (folio/model/quant/gguf_planes.py), the group
// parameters in float32; or, in float16, ggml's d and m with weights code * d + m (half the
// parameter bytes: a decode step reads 0.625 bytes a weight instead of 0.75;
// folio/model/quant/int4_packed.py picks it where the weights come out the same).
//
// Codes are two to a byte in ggml's order within a group: byte i holds element i (low nibble)
// and element i + 16 (high nibble). A group's weights are built as (code - 8) * s + z with one
// rounding (simd.h's make_group: on AVX-512 a 16-entry table the nibbles index). Activations,
// weights and accumulation stay float32, so the only error against dequantize-then-matmul is
// float32 rounding order. Two paths by the number of
// rows M of x, both splitting the rows of W over torch's threads (at::parallel_for):
//   * M < kTileRows (decode, batched decode): a register-blocked kernel (block_kernel) takes
//     up to 8 rows of x against 1-4 rows of W at a time, so each group's weights are built
//     once for every row of the block and 8-16 independent FMA chains hide the FMA latency;
//   * M >= kTileRows (prefill): each task rebuilds a tile of W's rows in float32 (it stays in
//     L2) and multiplies it with torch's GEMM (weight_tiles.h).
// One body for every instruction set (simd.h: AVX-512, AVX2 + FMA, or plain loops).
#include "ops.h"
#include "simd.h"
#include "weight_tiles.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

using namespace folio_cpu::simd;

constexpr int kGroup = 32;
constexpr int kHalf = 16;
constexpr int kPrefetchRows = 16;  // how far ahead (rows of W) the blocked kernel prefetches

// One plane's rows; Param float (scale, the weight at code 8) or uint16_t (float16 bits of
// ggml's d and m: the weight at code 0).
template <typename Param>
struct PlaneView {
  const uint8_t* codes;  // [N, K/2]
  const Param* scale;    // [N, G]
  const Param* zero;     // [N, G]
};

inline float param(float p) { return p; }
inline float param(uint16_t h) { return half_to_float(h); }
template <typename Param>
constexpr int kCodeBias = std::is_same<Param, float>::value ? 8 : 0;

// Rows [n, n + NB) of W against MB rows of x (x points at the first, y at its row of the
// output): each group's NB weight rows are built once and used for all MB rows of x. MB * NB
// accumulators make as many independent FMA chains, enough to hide the FMA latency; the x
// block (MB rows of K floats) stays in L1 while the W rows stream past it.
template <int MB, int NB, typename Param>
inline void block_kernel(const float* x, int64_t K, const std::vector<PlaneView<Param>>& planes,
                         int64_t n, float* y, int64_t N, bool prefetch) {
  const int64_t G = K / kGroup, row_bytes = K / 2;
  Vf acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NB; ++r) acc[m][r] = zero();
  for (const PlaneView<Param>& p : planes) {
    const uint8_t* codes = p.codes + n * row_bytes;
    const Param* scale = p.scale + n * G;
    const Param* zero_pt = p.zero + n * G;
    for (int64_t g = 0; g < G; ++g) {
      // The rows kPrefetchRows ahead, a cache line at a time as this block goes: the hardware
      // prefetcher alone keeps a decode step's weight stream well under the memory's
      // bandwidth (measured: spread out like this beats one burst per block here).
      if (prefetch && (g & 3) == 0)
        for (int r = 0; r < NB; ++r)
          __builtin_prefetch(codes + (r + kPrefetchRows) * row_bytes + g * kHalf, 0, 3);
      if (prefetch && (g & 15) == 0)
        for (int r = 0; r < NB; ++r) {
          __builtin_prefetch(scale + (r + kPrefetchRows) * G + g, 0, 3);
          __builtin_prefetch(zero_pt + (r + kPrefetchRows) * G + g, 0, 3);
        }
      Vf w[NB][kGroupVecs];
      for (int r = 0; r < NB; ++r)
        make_group<kCodeBias<Param>>(codes + r * row_bytes + g * kHalf, param(scale[r * G + g]),
                                     param(zero_pt[r * G + g]), w[r]);
      for (int m = 0; m < MB; ++m)
        for (int j = 0; j < kGroupVecs; ++j) {
          const Vf xv = load(x + m * K + g * kGroup + j * kLanes);
          for (int r = 0; r < NB; ++r) acc[m][r] = fma(w[r][j], xv, acc[m][r]);
        }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NB; ++r) y[m * N + n + r] = reduce_add(acc[m][r]);
}

// Rows of W per block for MB rows of x: as many as the vector registers hold beside the
// MB * NB accumulators (32 registers of AVX-512; 16 of AVX2, whose group is 4 vectors).
template <int MB>
constexpr int rows_per_block() {
  if (kLanes == 16) return MB <= 4 ? 4 : 2;
  return MB == 1 ? 4 : (MB <= 4 ? 2 : 1);
}

// MB rows of x (1..kBlockRows) against W rows [n0, n1): blocks of NB rows, then single rows.
template <int MB, typename Param>
void rows_block(const float* x, int64_t K, const std::vector<PlaneView<Param>>& planes, float* y,
                int64_t N, int64_t n0, int64_t n1, bool prefetch) {
  constexpr int NB = rows_per_block<MB>();
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) block_kernel<MB, NB>(x, K, planes, n, y, N, prefetch);
  for (; n < n1; ++n) block_kernel<MB, 1>(x, K, planes, n, y, N, prefetch);
}

constexpr int kBlockRows = 8;  // rows of x per block (MB)
constexpr int64_t kRowChunk = 16;  // rows of W taken by every block of x in turn

// Every row of x (M < kTileRows) against W rows [n0, n1): W in chunks of kRowChunk rows, each
// chunk taken by every block of up to kBlockRows rows of x while it is in L1 (W is read from
// memory once, whatever M is; the first block prefetches it).
template <typename Param>
void dot_rows(const float* x, int64_t M, int64_t K, const std::vector<PlaneView<Param>>& planes,
              float* y, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t c0 = n0; c0 < n1; c0 += kRowChunk) {
    const int64_t c1 = std::min<int64_t>(n1, c0 + kRowChunk);
    for (int64_t m0 = 0; m0 < M; m0 += kBlockRows) {
      const float* xb = x + m0 * K;
      float* yb = y + m0 * N;
      switch (std::min<int64_t>(kBlockRows, M - m0)) {
        case 1: rows_block<1>(xb, K, planes, yb, N, c0, c1, m0 == 0); break;
        case 2: rows_block<2>(xb, K, planes, yb, N, c0, c1, m0 == 0); break;
        case 3: rows_block<3>(xb, K, planes, yb, N, c0, c1, m0 == 0); break;
        case 4: rows_block<4>(xb, K, planes, yb, N, c0, c1, m0 == 0); break;
        case 5: rows_block<5>(xb, K, planes, yb, N, c0, c1, m0 == 0); break;
        case 6: rows_block<6>(xb, K, planes, yb, N, c0, c1, m0 == 0); break;
        case 7: rows_block<7>(xb, K, planes, yb, N, c0, c1, m0 == 0); break;
        default: rows_block<8>(xb, K, planes, yb, N, c0, c1, m0 == 0); break;
      }
    }
  }
}

// Rows [n0, n1) of W rebuilt in float32 into `w` ([n1 - n0, K]): the sum of the planes.
template <typename Param>
void dequantize_rows(const std::vector<PlaneView<Param>>& planes, int64_t K, int64_t n0,
                     int64_t n1, float* w) {
  const int64_t G = K / kGroup, row_bytes = K / 2;
  for (size_t p = 0; p < planes.size(); ++p) {
    const PlaneView<Param>& pl = planes[p];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = pl.codes + n * row_bytes;
      float* out = w + (n - n0) * K;
      for (int64_t g = 0; g < G; ++g) {
        Vf v[kGroupVecs];
        make_group<kCodeBias<Param>>(row + g * kHalf, param(pl.scale[n * G + g]),
                                     param(pl.zero[n * G + g]), v);
        float* o = out + g * kGroup;
        for (int j = 0; j < kGroupVecs; ++j)
          store(o + j * kLanes, p > 0 ? add(v[j], load(o + j * kLanes)) : v[j]);
      }
    }
  }
}

// y [M, N] from the planes in `planes` (one parameter type)
template <typename Param>
void multiply(const at::Tensor& x, at::Tensor& y, const std::vector<PlaneView<Param>>& planes) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  if (M == 0 || N == 0) return;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M >= folio_cpu::kTileRows) {
    folio_cpu::tiled_gemm(x, y, N, K, [&](int64_t n0, int64_t n1, float* w) {
      dequantize_rows(planes, K, n0, n1, w);
    });
    return;
  }
  folio_cpu::split_rows(N, [&](int64_t n0, int64_t n1) {
    dot_rows(xp, M, K, planes, yp, N, n0, n1);
  });
}

template <typename Param>
std::vector<PlaneView<Param>> plane_views(const at::Tensor& codes, const at::Tensor& scale,
                                          const at::Tensor& zero) {
  const int64_t P = codes.size(0), N = codes.size(1), row_bytes = codes.size(2),
                G = scale.size(2);
  const Param* s = static_cast<const Param*>(scale.data_ptr());
  const Param* z = static_cast<const Param*>(zero.data_ptr());
  std::vector<PlaneView<Param>> planes;
  for (int64_t p = 0; p < P; ++p) {
    planes.push_back({codes.data_ptr<uint8_t>() + p * N * row_bytes, s + p * N * G,
                      z + p * N * G});
  }
  return planes;
}

}  // namespace

// x [M, K] float32 contiguous; the P planes stacked: codes [P, N, K/2] uint8, scale and zero
// [P, N, K/32], both float32 (weights (code - 8) * scale + zero) or both float16 (code * scale
// + zero), all contiguous. Returns y [M, N] float32.
at::Tensor q4_matmul(at::Tensor x, at::Tensor codes, at::Tensor scale, at::Tensor zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32");
  const int64_t G = K / kGroup;
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(0) >= 1 && codes.size(2) == K / 2,
              "codes must be contiguous uint8 [planes, N, K/2]");
  const int64_t P = codes.size(0), N = codes.size(1);
  const bool half = scale.scalar_type() == at::kHalf;
  for (const at::Tensor* t : {&scale, &zero}) {
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == (half ? at::kHalf : at::kFloat) &&
                    t->is_contiguous() && t->size(0) == P && t->size(1) == N &&
                    t->size(2) == G,
                "scale and zero must be contiguous [planes, N, K/32], both float32 or both "
                "float16");
  }
  auto y = at::empty({M, N}, x.options());
  if (half) {
    multiply(x, y, plane_views<uint16_t>(codes, scale, zero));
  } else {
    multiply(x, y, plane_views<float>(codes, scale, zero));
  }
  return y;
}
