// int8 weight-only matmul on the CPU in float32: y = x @ W^T, W [N, K] = codes * scale, an
// int8 code per weight and a float32 scale per group of GS = K / G weights along K (G groups per
// row; GS a multiple of 16). One format serves GGUF Q8_0 (GS 32, the block's d), Q6_K (GS 16,
// d * the sub-block's scale, codes q - 32) and per-channel int8 (G = 1, `--quantization int8`).
//
// Each weight is rebuilt exactly as dequantization does (float(code) * scale, one rounding) —
// per-channel rows instead scale the finished dot product — so the error against
// dequantize-then-matmul is float32 summation order. Paths as in q4_matmul.cpp: a
// register-blocked kernel below kTileRows rows of x (up to 8 rows of x against 2-4 rows of W:
// each 16 weights widened and scaled once for every row of the block), tiles rebuilt in float32
// for torch's GEMM from there on (weight_tiles.h). One body for every instruction set (simd.h).
#include "ops.h"
#include "simd.h"
#include "weight_tiles.h"

#include <algorithm>
#include <cstring>

namespace {

using namespace folio_cpu::simd;

constexpr int kVec = 16;           // K / G must be a multiple of this (every kLanes divides it)
constexpr int kPrefetchRows = 16;  // how far ahead (rows of W) the blocked kernel prefetches

struct Int8View {
  const int8_t* codes;  // [N, K]
  const float* scale;   // [N, G]
  int64_t K, G;
};

// Rows [n, n + NB) of W against MB rows of x (x points at the first row of the block, y at its
// row of the output). PerRow: one scale per row (G = 1), applied to the finished dot.
template <int MB, int NB, bool PerRow>
inline void block_kernel(const float* x, const Int8View& w, int64_t n, float* y, int64_t N,
                         bool prefetch) {
  const int64_t K = w.K, G = w.G, GS = K / G;
  Vf acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NB; ++r) acc[m][r] = zero();
  const int8_t* codes = w.codes + n * K;
  const float* scale = w.scale + n * G;
  if (prefetch) {  // the rows kPrefetchRows ahead (as in q4_matmul.cpp)
    prefetch_bytes(codes + kPrefetchRows * K, NB * K);
    prefetch_bytes(scale + kPrefetchRows * G, NB * G * sizeof(float));
  }
  for (int64_t g = 0; g < G; ++g) {
    Vf s[NB];
    if (!PerRow)
      for (int r = 0; r < NB; ++r) s[r] = set1(scale[r * G + g]);
    for (int64_t k = g * GS; k < (g + 1) * GS; k += kLanes) {
      Vf wv[NB];
      for (int r = 0; r < NB; ++r) {
        wv[r] = load_i8(codes + r * K + k);
        if (!PerRow) wv[r] = mul(wv[r], s[r]);
      }
      for (int m = 0; m < MB; ++m) {
        const Vf xv = load(x + m * K + k);
        for (int r = 0; r < NB; ++r) acc[m][r] = fma(wv[r], xv, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NB; ++r) {
      const float dot = reduce_add(acc[m][r]);
      y[m * N + n + r] = PerRow ? dot * scale[r] : dot;
    }
}

template <int MB, bool PerRow>
void rows_block(const float* x, const Int8View& w, float* y, int64_t N, int64_t n0, int64_t n1,
                bool prefetch) {
  // as many rows of W as the registers hold beside the MB * NB accumulators (simd.h)
  constexpr int NB = kLanes == 16 ? (MB <= 4 ? 4 : 2) : (MB <= 2 ? 4 : (MB <= 4 ? 2 : 1));
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) block_kernel<MB, NB, PerRow>(x, w, n, y, N, prefetch);
  for (; n < n1; ++n) block_kernel<MB, 1, PerRow>(x, w, n, y, N, prefetch);
}

constexpr int kBlockRows = 8;     // rows of x per block (MB)
constexpr int64_t kRowChunk = 16;  // rows of W taken by every block of x in turn

// W in chunks of kRowChunk rows, each taken by every block of x while it is in L1.
template <bool PerRow>
void dot_rows_t(const float* x, int64_t M, const Int8View& w, float* y, int64_t N, int64_t n0,
                int64_t n1) {
  for (int64_t c0 = n0; c0 < n1; c0 += kRowChunk) {
    const int64_t c1 = std::min<int64_t>(n1, c0 + kRowChunk);
    for (int64_t m0 = 0; m0 < M; m0 += kBlockRows) {
      const float* xb = x + m0 * w.K;
      float* yb = y + m0 * N;
      switch (std::min<int64_t>(kBlockRows, M - m0)) {
        case 1: rows_block<1, PerRow>(xb, w, yb, N, c0, c1, m0 == 0); break;
        case 2: rows_block<2, PerRow>(xb, w, yb, N, c0, c1, m0 == 0); break;
        case 3: rows_block<3, PerRow>(xb, w, yb, N, c0, c1, m0 == 0); break;
        case 4: rows_block<4, PerRow>(xb, w, yb, N, c0, c1, m0 == 0); break;
        case 5: rows_block<5, PerRow>(xb, w, yb, N, c0, c1, m0 == 0); break;
        case 6: rows_block<6, PerRow>(xb, w, yb, N, c0, c1, m0 == 0); break;
        case 7: rows_block<7, PerRow>(xb, w, yb, N, c0, c1, m0 == 0); break;
        default: rows_block<8, PerRow>(xb, w, yb, N, c0, c1, m0 == 0); break;
      }
    }
  }
}

void dot_rows(const float* x, int64_t M, const Int8View& w, float* y, int64_t N, int64_t n0,
              int64_t n1) {
  if (w.G == 1) dot_rows_t<true>(x, M, w, y, N, n0, n1);
  else dot_rows_t<false>(x, M, w, y, N, n0, n1);
}

// Rows [n0, n1) of W rebuilt in float32 into `out` ([n1 - n0, K]).
void dequantize_rows(const Int8View& w, int64_t n0, int64_t n1, float* out) {
  const int64_t K = w.K, G = w.G, GS = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* codes = w.codes + n * K;
    float* o = out + (n - n0) * K;
    for (int64_t g = 0; g < G; ++g) {
      const float s = w.scale[n * G + g];
      for (int64_t k = g * GS; k < (g + 1) * GS; ++k) o[k] = static_cast<float>(codes[k]) * s;
    }
  }
}

}  // namespace

at::Tensor int8_matmul(at::Tensor x, at::Tensor codes, at::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  codes.size(1) == K,
              "codes must be contiguous int8 [N, K]");
  const int64_t N = codes.size(0);
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.size(0) == N && scale.size(1) >= 1 && K % scale.size(1) == 0 &&
                  (K / scale.size(1)) % kVec == 0,
              "scale must be contiguous float32 [N, G] with K / G a multiple of 16");
  const Int8View w{codes.data_ptr<int8_t>(), scale.data_ptr<float>(), K, scale.size(1)};
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (M >= folio_cpu::kTileRows) {
    folio_cpu::tiled_gemm(x, y, N, K, [&](int64_t n0, int64_t n1, float* out) {
      dequantize_rows(w, n0, n1, out);
    });
    return y;
  }
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  folio_cpu::split_rows(N, [&](int64_t n0, int64_t n1) { dot_rows(xp, M, w, yp, N, n0, n1); });
  return y;
}
