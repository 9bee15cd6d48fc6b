// 4-bit-plane matmul on the CPU in float32: y = x @ W^T, W the sum of planes whose weights are
// (code - 8) * s + z, one s and z per group of 32 (folio/model/quant/gguf_planes.py).
//
// Codes are two to a byte in ggml's order within a group: byte i holds element i (low nibble)
// and element i + 16 (high nibble). A group's weights come from a 16-entry table of its
// (code - 8) * s + z values, indexed by the nibbles (group_table): one FMA builds the table,
// two permutes read it, where converting codes to float would take a mask and two conversions
// on the port the FMAs need. Activations, weights and accumulation stay float32, so the only
// error against dequantize-then-matmul is float32 rounding order. Three paths by the number of
// rows M of x, all splitting the rows of W over torch's threads (at::parallel_for):
//   * M = 1 (decode): four rows of W at a time, so eight independent FMA chains hide the FMA
//     latency and each group of x is loaded once for the four;
//   * 1 < M < kTileRows: per row of W, its weights built once per group for up to kMaxRows
//     rows of x (one chain each);
//   * M >= kTileRows (prefill, large batches): each task rebuilds a tile of W's rows in float32
//     (it stays in L2) and multiplies it with torch's GEMM, so the 4-bit bytes are read once
//     and the product runs at GEMM speed.
// Written for AVX-512 where the build machine has it (-march=native), portable loops otherwise.
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kGroup = 32;
constexpr int kHalf = 16;
constexpr int kMaxRows = 16;   // rows of x per pass over a weight row (16 accumulators fit)
constexpr int kRowBlock = 4;   // rows of W per pass at M = 1
constexpr int64_t kTileRows = 8;       // from this many rows of x on, dequantize tiles + GEMM
constexpr int64_t kTileBytes = 1 << 20;  // float32 bytes of one tile of W (fits L2)

struct PlaneView {
  const uint8_t* codes;  // [N, K/2]
  const float* scale;    // [N, G]
  const float* zero;     // [N, G]
};

#if defined(__AVX512F__)
// A group's 16 code bytes widened to 16 int32 lanes: lane i holds element i in bits 0-3 and
// element i + 16 in bits 4-7.
inline __m512i load_group(const uint8_t* b) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
}

// The group's 16 possible weights, (code - 8) * s + z for code 0..15, as a lookup table:
// vpermps reads only the low 4 bits of each index lane, so a nibble indexes it directly (no
// mask, no int-to-float conversion), and the weights come out scaled and offset.
inline __m512 group_table(float s, float z) {
  const __m512 codes = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  return _mm512_fmadd_ps(codes, _mm512_set1_ps(s), _mm512_set1_ps(z));
}

// The group's 32 weights as two 16-lane float vectors (elements 0..15, 16..31).
inline void group_weights(const uint8_t* b, float s, float z, __m512& lo, __m512& hi) {
  const __m512i v = load_group(b);
  const __m512 table = group_table(s, z);
  lo = _mm512_permutexvar_ps(v, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}

// M = 1: rows [n, n + kRowBlock) of W against x.
inline void gemv_rows4(const float* x, int64_t G, const PlaneView& p, int64_t n,
                       int64_t row_bytes, float* out) {
  __m512 acc_lo[kRowBlock], acc_hi[kRowBlock];
  for (int r = 0; r < kRowBlock; ++r) acc_lo[r] = acc_hi[r] = _mm512_setzero_ps();
  const uint8_t* codes = p.codes + n * row_bytes;
  const float* scale = p.scale + n * G;
  const float* zero = p.zero + n * G;
  for (int64_t g = 0; g < G; ++g) {
    const __m512 xlo = _mm512_loadu_ps(x + g * kGroup);
    const __m512 xhi = _mm512_loadu_ps(x + g * kGroup + kHalf);
    for (int r = 0; r < kRowBlock; ++r) {
      __m512 lo, hi;
      group_weights(codes + r * row_bytes + g * kHalf, scale[r * G + g], zero[r * G + g], lo, hi);
      acc_lo[r] = _mm512_fmadd_ps(lo, xlo, acc_lo[r]);
      acc_hi[r] = _mm512_fmadd_ps(hi, xhi, acc_hi[r]);
    }
  }
  for (int r = 0; r < kRowBlock; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[r], acc_hi[r]));
}
#endif

// One row n of W against rows [m0, m0 + mb) of x: each group's weights are built once and
// used for every row of x.
inline void row_dot(const float* x, int64_t K, int64_t m0, int64_t mb, const PlaneView& p,
                    int64_t n, float* total) {
  const int64_t G = K / kGroup;
  const uint8_t* row = p.codes + n * (K / 2);
  const float* s_row = p.scale + n * G;
  const float* z_row = p.zero + n * G;
#if defined(__AVX512F__)
  __m512 acc[kMaxRows];
  for (int64_t j = 0; j < mb; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 lo, hi;
    group_weights(row + g * kHalf, s_row[g], z_row[g], lo, hi);
    for (int64_t j = 0; j < mb; ++j) {
      const float* xg = x + (m0 + j) * K + g * kGroup;
      acc[j] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + kHalf),
                               _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg), acc[j]));
    }
  }
  for (int64_t j = 0; j < mb; ++j) total[j] = _mm512_reduce_add_ps(acc[j]);
#else
  alignas(64) float acc[kMaxRows][kHalf] = {};
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = row + g * kHalf;
    alignas(64) float lo[kHalf], hi[kHalf];
    for (int i = 0; i < kHalf; ++i) {
      lo[i] = (static_cast<float>(b[i] & 0x0F) - 8.0f) * s_row[g] + z_row[g];
      hi[i] = (static_cast<float>(b[i] >> 4) - 8.0f) * s_row[g] + z_row[g];
    }
    for (int64_t j = 0; j < mb; ++j) {
      const float* xg = x + (m0 + j) * K + g * kGroup;
      float* a = acc[j];
#pragma omp simd
      for (int i = 0; i < kHalf; ++i) a[i] += lo[i] * xg[i] + hi[i] * xg[i + kHalf];
    }
  }
  for (int64_t j = 0; j < mb; ++j) {
    total[j] = 0.0f;
    for (int i = 0; i < kHalf; ++i) total[j] += acc[j][i];
  }
#endif
}

// Rows [n0, n1) of y for every row of x (the M < kTileRows paths).
void dot_rows(const float* x, int64_t M, int64_t K, const std::vector<PlaneView>& planes,
              float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup, row_bytes = K / 2;
  int64_t n = n0;
#if defined(__AVX512F__)
  if (M == 1) {
    for (; n + kRowBlock <= n1; n += kRowBlock) {
      float total[kRowBlock] = {};
      for (const PlaneView& p : planes) {
        float part[kRowBlock];
        gemv_rows4(x, G, p, n, row_bytes, part);
        for (int r = 0; r < kRowBlock; ++r) total[r] += part[r];
      }
      for (int r = 0; r < kRowBlock; ++r) y[n + r] = total[r];
    }
  }
#endif
  for (; n < n1; ++n) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t mb = std::min<int64_t>(kMaxRows, M - m0);
      float total[kMaxRows] = {};
      for (const PlaneView& p : planes) {
        float part[kMaxRows];
        row_dot(x, K, m0, mb, p, n, part);
        for (int64_t j = 0; j < mb; ++j) total[j] += part[j];
      }
      for (int64_t j = 0; j < mb; ++j) y[(m0 + j) * N + n] = total[j];
    }
  }
}

// Rows [n0, n1) of W rebuilt in float32 into `w` ([n1 - n0, K]): the sum of the planes.
void dequantize_rows(const std::vector<PlaneView>& planes, int64_t K, int64_t n0, int64_t n1,
                     float* w) {
  const int64_t G = K / kGroup, row_bytes = K / 2;
  for (size_t p = 0; p < planes.size(); ++p) {
    const PlaneView& pl = planes[p];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = pl.codes + n * row_bytes;
      float* out = w + (n - n0) * K;
      for (int64_t g = 0; g < G; ++g) {
        const float s = pl.scale[n * G + g];
        const float z = pl.zero[n * G + g];
        float* o = out + g * kGroup;
#if defined(__AVX512F__)
        __m512 wlo, whi;
        group_weights(row + g * kHalf, s, z, wlo, whi);
        if (p > 0) {
          wlo = _mm512_add_ps(wlo, _mm512_loadu_ps(o));
          whi = _mm512_add_ps(whi, _mm512_loadu_ps(o + kHalf));
        }
        _mm512_storeu_ps(o, wlo);
        _mm512_storeu_ps(o + kHalf, whi);
#else
        const uint8_t* b = row + g * kHalf;
        for (int i = 0; i < kHalf; ++i) {
          const float lo = (static_cast<float>(b[i] & 0x0F) - 8.0f) * s + z;
          const float hi = (static_cast<float>(b[i] >> 4) - 8.0f) * s + z;
          o[i] = p > 0 ? o[i] + lo : lo;
          o[i + kHalf] = p > 0 ? o[i + kHalf] + hi : hi;
        }
#endif
      }
    }
  }
}

}  // namespace

// x [M, K] float32 contiguous; the P planes stacked: codes [P, N, K/2] uint8, scale and zero
// [P, N, K/32] float32, all contiguous. Returns y [M, N] float32.
torch::Tensor q4_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scale,
                        torch::Tensor zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32");
  const int64_t G = K / kGroup;
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() &&
                  codes.size(0) >= 1 && codes.size(2) == K / 2,
              "codes must be contiguous uint8 [planes, N, K/2]");
  const int64_t P = codes.size(0), N = codes.size(1);
  for (const torch::Tensor* t : {&scale, &zero}) {
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == torch::kFloat32 && t->is_contiguous() &&
                    t->size(0) == P && t->size(1) == N && t->size(2) == G,
                "scale and zero must be contiguous float32 [planes, N, K/32]");
  }
  std::vector<PlaneView> planes;
  for (int64_t p = 0; p < P; ++p) {
    planes.push_back({codes.data_ptr<uint8_t>() + p * N * (K / 2),
                      scale.data_ptr<float>() + p * N * G, zero.data_ptr<float>() + p * N * G});
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int threads = at::get_num_threads();

  if (M >= kTileRows) {
    // Tiles of W's rows: each task rebuilds its tile and runs one single-threaded GEMM into
    // its columns of y (torch's GEMM runs on the calling thread inside a parallel region).
    const int64_t tile = std::max<int64_t>(
        16, std::min<int64_t>(kTileBytes / (K * 4), (N + threads - 1) / threads) / 16 * 16);
    at::parallel_for(0, (N + tile - 1) / tile, 1, [&](int64_t t0, int64_t t1) {
      // Worker threads do not inherit the caller's inference mode; inside it, writing into
      // y (an inference tensor when the caller is in inference mode) is allowed either way.
      c10::InferenceMode inference;
      std::vector<float> buffer(tile * K);
      auto w = torch::from_blob(buffer.data(), {tile, K}, x.options());
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * tile, n1 = std::min<int64_t>(N, n0 + tile);
        dequantize_rows(planes, K, n0, n1, buffer.data());
        auto out = y.narrow(1, n0, n1 - n0);
        at::mm_out(out, x, w.narrow(0, 0, n1 - n0).t());
      }
    });
    return y;
  }

  // Enough rows per task to amortize the split (a multiple of the M = 1 row block); at least
  // one task per thread.
  const int64_t grain = std::max<int64_t>(16, N / (4 * threads) / kRowBlock * kRowBlock);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    dot_rows(xp, M, K, planes, yp, N, n0, n1);
  });
  return y;
}
