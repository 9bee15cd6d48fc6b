// 4-bit-plane matmul on the CPU in float32: y[m, n] = sum over planes and groups g of
//   s[n, g] * (codes[n, g, :] . x[m, g, :] - 8 * xsum[m, g]) + z[n, g] * xsum[m, g],
// the weights being (code - 8) * s + z per group of 32 (folio/model/quant/gguf_planes.py).
//
// Codes are two to a byte in ggml's order within a group: byte i holds element i (low nibble)
// and element i + 16 (high nibble). Activations, scales and accumulation stay float32, so the
// only error against dequantize-then-matmul is float32 summation order. Written for the
// AVX-512 where the build machine has it (-march=native): a group's 32 codes become two
// 16-lane float vectors, one FMA chain per row of x with the group's scale broadcast; the
// portable loop otherwise. Rows of W are split over torch's threads (at::parallel_for).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kGroup = 32;
constexpr int kHalf = 16;
constexpr int kMaxRows = 16;  // rows of x per pass over a weight row (16 accumulators + 4 fit AVX-512's 32 registers)

#if defined(__AVX512F__)
// One group of 32 codes as two 16-lane float vectors (elements 0..15, 16..31).
inline void unpack_group(const uint8_t* b, __m512& lo, __m512& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m128i mask = _mm_set1_epi8(0x0F);
  lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
}
#endif

void q4_rows(const float* x, int64_t m_rows, int64_t K, const float* xsum,
             const uint8_t* codes, const float* scale, const float* zero,
             float* y, int64_t N, int64_t n0, int64_t n1, bool accumulate) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = codes + n * (K / 2);
    const float* s_row = scale + n * G;
    const float* z_row = zero + n * G;
    for (int64_t m0 = 0; m0 < m_rows; m0 += kMaxRows) {
      const int64_t mb = std::min<int64_t>(kMaxRows, m_rows - m0);
      float offset[kMaxRows] = {};
      float total[kMaxRows];
#if defined(__AVX512F__)
      __m512 acc[kMaxRows];
      for (int64_t j = 0; j < mb; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        __m512 lo, hi;
        unpack_group(row + g * kHalf, lo, hi);
        const __m512 s = _mm512_set1_ps(s_row[g]);
        const float zs = z_row[g] - 8.0f * s_row[g];
        for (int64_t j = 0; j < mb; ++j) {
          const float* xg = x + (m0 + j) * K + g * kGroup;
          const __m512 t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + kHalf),
                                           _mm512_mul_ps(lo, _mm512_loadu_ps(xg)));
          acc[j] = _mm512_fmadd_ps(s, t, acc[j]);
          offset[j] += zs * xsum[(m0 + j) * G + g];
        }
      }
      for (int64_t j = 0; j < mb; ++j) total[j] = offset[j] + _mm512_reduce_add_ps(acc[j]);
#else
      alignas(64) float acc[kMaxRows][kHalf] = {};
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* b = row + g * kHalf;
        alignas(64) float lo[kHalf], hi[kHalf];
        for (int i = 0; i < kHalf; ++i) {
          lo[i] = static_cast<float>(b[i] & 0x0F);
          hi[i] = static_cast<float>(b[i] >> 4);
        }
        const float s = s_row[g];
        const float zs = z_row[g] - 8.0f * s;
        for (int64_t j = 0; j < mb; ++j) {
          const float* xg = x + (m0 + j) * K + g * kGroup;
          float* a = acc[j];
#pragma omp simd
          for (int i = 0; i < kHalf; ++i) {
            a[i] += s * (lo[i] * xg[i] + hi[i] * xg[i + kHalf]);
          }
          offset[j] += zs * xsum[(m0 + j) * G + g];
        }
      }
      for (int64_t j = 0; j < mb; ++j) {
        total[j] = offset[j];
        for (int i = 0; i < kHalf; ++i) total[j] += acc[j][i];
      }
#endif
      for (int64_t j = 0; j < mb; ++j) {
        float* out = y + (m0 + j) * N + n;
        *out = accumulate ? *out + total[j] : total[j];
      }
    }
  }
}

}  // namespace

// x [M, K] float32 contiguous; planes: lists of codes [N, K/2] uint8, scale [N, K/32] and
// zero [N, K/32] float32. Returns y [M, N] float32.
torch::Tensor q4_matmul(torch::Tensor x, std::vector<torch::Tensor> codes,
                        std::vector<torch::Tensor> scale, std::vector<torch::Tensor> zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [M, K]");
  TORCH_CHECK(!codes.empty() && codes.size() == scale.size() && codes.size() == zero.size(),
              "one scale and one zero tensor per plane");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32");
  const int64_t N = codes[0].size(0), G = K / kGroup;
  for (size_t p = 0; p < codes.size(); ++p) {
    TORCH_CHECK(codes[p].scalar_type() == torch::kUInt8 && codes[p].is_contiguous() &&
                    codes[p].size(0) == N && codes[p].size(1) == K / 2,
                "codes must be contiguous uint8 [N, K/2]");
    TORCH_CHECK(scale[p].scalar_type() == torch::kFloat32 && scale[p].is_contiguous() &&
                    zero[p].scalar_type() == torch::kFloat32 && zero[p].is_contiguous() &&
                    scale[p].size(0) == N && scale[p].size(1) == G && zero[p].size(0) == N &&
                    zero[p].size(1) == G,
                "scale and zero must be contiguous float32 [N, K/32]");
  }
  auto y = torch::empty({M, N}, x.options());
  auto xsum = x.view({M, G, kGroup}).sum(-1).contiguous();
  const float* xp = x.data_ptr<float>();
  const float* xs = xsum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Enough rows per task to amortize the split; at least one task per thread.
  const int64_t grain = std::max<int64_t>(16, N / (4 * at::get_num_threads()));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (size_t p = 0; p < codes.size(); ++p) {
      q4_rows(xp, M, K, xs, codes[p].data_ptr<uint8_t>(), scale[p].data_ptr<float>(),
              zero[p].data_ptr<float>(), yp, N, n0, n1, p > 0);
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_matmul", &q4_matmul, "4-bit-plane matmul, float32 (folio.model.quant)");
}
