// The float vector folio's CPU kernels (the matmuls, paged attention) are written in, so that
// one kernel body serves every machine the extension is built on (-march=native picks the
// branch):
//   * AVX-512: 16 lanes (__m512);
//   * AVX2 + FMA (+ F16C, which every such chip has): 8 lanes (__m256) — most AMD EPYC/Ryzen
//     before Zen 4 and many Intel client chips. Before this branch existed those machines ran
//     the kernels' scalar loops, whose float sums the compiler may not vectorize: 1.2 GFLOP/s
//     where the vector kernel makes tens;
//   * anything else (e.g. Arm): 8 plain floats whose element-wise loops the compiler vectorizes
//     for the target's own registers (NEON and the like).
// Only what the kernels use: loads and stores, FMA, horizontal sums, int8 widening, the 4-bit
// group weights of q4_matmul.cpp (make_group, half_to_float for float16 group parameters), and
// for paged_attention.cpp the KV cache's 16- and 8-bit floats widened exactly, the lane sums of
// kLanes vectors, and exp.
#pragma once

#include <cstdint>

#include <cmath>
#include <cstring>

#if defined(__AVX512F__)
#define FOLIO_SIMD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FOLIO_SIMD_AVX2 1
#endif
#if defined(FOLIO_SIMD_AVX512) || defined(FOLIO_SIMD_AVX2)
#include <immintrin.h>
#endif

namespace folio_cpu::simd {

#if defined(FOLIO_SIMD_AVX512)
constexpr int kLanes = 16;
using Vf = __m512;
inline Vf zero() { return _mm512_setzero_ps(); }
inline Vf set1(float s) { return _mm512_set1_ps(s); }
inline Vf load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vf v) { _mm512_storeu_ps(p, v); }
inline Vf add(Vf a, Vf b) { return _mm512_add_ps(a, b); }
inline Vf sub(Vf a, Vf b) { return _mm512_sub_ps(a, b); }
inline Vf max(Vf a, Vf b) { return _mm512_max_ps(a, b); }
inline Vf mul(Vf a, Vf b) { return _mm512_mul_ps(a, b); }
inline Vf fma(Vf a, Vf b, Vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline float reduce_add(Vf v) { return _mm512_reduce_add_ps(v); }
inline Vf div(Vf a, Vf b) { return _mm512_div_ps(a, b); }
inline Vf neg_abs(Vf x) { return _mm512_or_ps(x, _mm512_set1_ps(-0.0f)); }  // -|x|
// a where x >= 0 (or NaN), b where x < 0
inline Vf where_negative(Vf x, Vf a, Vf b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), a, b);
}
// kLanes int8 values widened to float (exact)
inline Vf load_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(FOLIO_SIMD_AVX2)
constexpr int kLanes = 8;
using Vf = __m256;
inline Vf zero() { return _mm256_setzero_ps(); }
inline Vf set1(float s) { return _mm256_set1_ps(s); }
inline Vf load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vf v) { _mm256_storeu_ps(p, v); }
inline Vf add(Vf a, Vf b) { return _mm256_add_ps(a, b); }
inline Vf sub(Vf a, Vf b) { return _mm256_sub_ps(a, b); }
inline Vf max(Vf a, Vf b) { return _mm256_max_ps(a, b); }
inline Vf mul(Vf a, Vf b) { return _mm256_mul_ps(a, b); }
inline Vf fma(Vf a, Vf b, Vf c) { return _mm256_fmadd_ps(a, b, c); }
inline Vf div(Vf a, Vf b) { return _mm256_div_ps(a, b); }
inline Vf neg_abs(Vf x) { return _mm256_or_ps(x, _mm256_set1_ps(-0.0f)); }  // -|x|
// a where x >= 0 (or NaN), b where x < 0
inline Vf where_negative(Vf x, Vf a, Vf b) {
  return _mm256_blendv_ps(a, b, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}
inline float reduce_add(Vf v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
inline Vf load_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
constexpr int kLanes = 8;
struct Vf {
  float v[kLanes];
};
inline Vf zero() { return Vf{}; }
inline Vf set1(float s) {
  Vf r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = s;
  return r;
}
inline Vf load(const float* p) {
  Vf r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = p[i];
  return r;
}
inline void store(float* p, Vf v) {
  for (int i = 0; i < kLanes; ++i) p[i] = v.v[i];
}
inline Vf add(Vf a, Vf b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
  return a;
}
inline Vf sub(Vf a, Vf b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] -= b.v[i];
  return a;
}
inline Vf mul(Vf a, Vf b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] *= b.v[i];
  return a;
}
inline Vf max(Vf a, Vf b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
  return a;
}
inline Vf fma(Vf a, Vf b, Vf c) {
  for (int i = 0; i < kLanes; ++i) c.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline float reduce_add(Vf v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v.v[i];
  return s;
}
inline Vf div(Vf a, Vf b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] /= b.v[i];
  return a;
}
inline Vf neg_abs(Vf x) {
  for (int i = 0; i < kLanes; ++i) x.v[i] = -std::fabs(x.v[i]);
  return x;
}
inline Vf where_negative(Vf x, Vf a, Vf b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] = x.v[i] < 0.0f ? b.v[i] : a.v[i];
  return a;
}
inline Vf load_i8(const int8_t* p) {
  Vf r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
#endif

// A 4-bit group (q4_matmul.cpp): 32 weights from 16 bytes in ggml's order (byte i holds
// element i in its low nibble, element i + 16 in its high one), each (code - kBias) * s + z
// with one rounding, the value dequantization gives: folio's float32 group parameters are
// (scale, the weight at code 8): kBias 8; its float16 ones ggml's (d, m): kBias 0.
// kGroupVecs vectors, elements in order.
constexpr int kGroupVecs = 32 / kLanes;

#if defined(FOLIO_SIMD_AVX512)
// The group's 16 possible weights as a table that vpermps indexes with a nibble (it reads
// only an index lane's low 4 bits): no mask and no int-to-float conversion per weight.
template <int kBias>
inline void make_group(const uint8_t* b, float s, float z, Vf w[kGroupVecs]) {
  const __m512 codes = _mm512_sub_ps(
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_ps(static_cast<float>(kBias)));
  const __m512 table = _mm512_fmadd_ps(codes, _mm512_set1_ps(s), _mm512_set1_ps(z));
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  w[0] = _mm512_permutexvar_ps(v, table);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#elif defined(FOLIO_SIMD_AVX2)
// AVX2's permute indexes 8 entries, not 16: each nibble is converted instead (mask or shift,
// convert, subtract the bias — exact — then one FMA).
template <int kBias>
inline void make_group(const uint8_t* b, float s, float z, Vf w[kGroupVecs]) {
  const __m256i low = _mm256_set1_epi32(0x0F);
  const __m256 bias = _mm256_set1_ps(static_cast<float>(kBias));
  const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
  for (int half = 0; half < 2; ++half) {  // bytes 0-7, then 8-15
    const __m256i v =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * half)));
    __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    if (kBias != 0) {
      lo = _mm256_sub_ps(lo, bias);
      hi = _mm256_sub_ps(hi, bias);
    }
    w[half] = _mm256_fmadd_ps(lo, vs, vz);      // elements 8 half .. 8 half + 7
    w[2 + half] = _mm256_fmadd_ps(hi, vs, vz);  // elements 16 + 8 half ..
  }
}
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
template <int kBias>
inline void make_group(const uint8_t* b, float s, float z, Vf w[kGroupVecs]) {
  for (int i = 0; i < 16; ++i) {
    w[i / kLanes].v[i % kLanes] =
        __builtin_fmaf(static_cast<float>(b[i] & 0x0F) - static_cast<float>(kBias), s, z);
    w[(16 + i) / kLanes].v[(16 + i) % kLanes] =
        __builtin_fmaf(static_cast<float>(b[i] >> 4) - static_cast<float>(kBias), s, z);
  }
}
inline float half_bits_to_float(uint16_t h);  // below, with the other 16-bit loads
inline float half_to_float(uint16_t h) { return half_bits_to_float(h); }
#endif

// ---- For paged_attention.cpp ----
// kLanes cache elements widened to float32 exactly: bfloat16 and float16 from their bits;
// float8 e5m2 is float16's top byte; float8 e4m3fn's exponent (bias 7) and mantissa shifted
// into float16's places (bias 15) make the value / 2^8, subnormals included, which times 256
// restores exactly (e4m3fn's NaN, never written, would read as 480).
#if defined(FOLIO_SIMD_AVX512)
inline Vf load_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vf load_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <bool kE4M3>
inline Vf load_fp8(const uint8_t* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if constexpr (!kE4M3) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
  } else {
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7);
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.0f));
  }
}
// kLanes vectors -> one whose lane i holds the sum of a[i]'s lanes: halving in four rounds
// (256-, 128-, 64-, 32-bit pieces of pairs added), 46 instructions where sixteen horizontal
// sums take about ten each.
inline Vf reduce_lanes(const Vf* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88),
                                 _mm512_shuffle_ps(d[0], d[1], 0xDD));
  // e's element 4j + t holds the sum of a[4t + j].
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}
inline Vf round_nearest(Vf x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Vf scale_pow2(Vf p, Vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
inline void store_first(float* p, Vf v, int count) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << count) - 1), v);
}
#elif defined(FOLIO_SIMD_AVX2)
inline Vf load_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vf load_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <bool kE4M3>
inline Vf load_fp8(const uint8_t* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if constexpr (!kE4M3) {
    return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
  } else {
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
    const __m128i rest = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7);
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(256.0f));
  }
}
// Eight vectors -> one whose lane i holds the sum of a[i]'s lanes: pairwise horizontal adds
// within each 128-bit half, then the halves added.
inline Vf reduce_lanes(const Vf* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // u0 = [a0..a3 over lanes 0-3 | a0..a3 over lanes 4-7], u1 the same for a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}
inline Vf round_nearest(Vf x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// p * 2^n for integral n in [-126, 127]: 2^n built in the exponent field
inline Vf scale_pow2(Vf p, Vf n) {
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
// A masked store (a copy of `count` floats through memory compiled to `rep movs`, whose
// start-up cost was most of a chunk of eight keys' scoring).
inline void store_first(float* p, Vf v, int count) {
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(count),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  _mm256_maskstore_ps(p, mask, v);
}
#else
// float16 bits -> float, exactly (normals, subnormals, infinities, NaN)
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline Vf load_bf16(const uint16_t* p) {
  Vf r;
  for (int i = 0; i < kLanes; ++i) {
    const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    std::memcpy(&r.v[i], &bits, sizeof(float));
  }
  return r;
}
inline Vf load_f16(const uint16_t* p) {
  Vf r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = half_bits_to_float(p[i]);
  return r;
}
template <bool kE4M3>
inline Vf load_fp8(const uint8_t* p) {
  Vf r;
  for (int i = 0; i < kLanes; ++i) {
    const uint16_t w = p[i];
    r.v[i] = kE4M3 ? half_bits_to_float(static_cast<uint16_t>(((w & 0x80) << 8) |
                                                              ((w & 0x7F) << 7))) * 256.0f
                   : half_bits_to_float(static_cast<uint16_t>(w << 8));
  }
  return r;
}
inline Vf reduce_lanes(const Vf* a) {
  Vf r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = reduce_add(a[i]);
  return r;
}
inline Vf round_nearest(Vf x) {
  for (int i = 0; i < kLanes; ++i) x.v[i] = std::nearbyint(x.v[i]);
  return x;
}
inline Vf scale_pow2(Vf p, Vf n) {
  for (int i = 0; i < kLanes; ++i) p.v[i] = std::ldexp(p.v[i], static_cast<int>(n.v[i]));
  return p;
}
inline void store_first(float* p, Vf v, int count) {
  for (int i = 0; i < count; ++i) p[i] = v.v[i];
}
#endif

// e^x for x <= 0 (scores minus their maximum): x = n ln2 + f with |f| <= ln2 / 2, e^f by its
// Taylor series to degree 7 (truncation below 1e-8 relative, under float32's rounding), times
// 2^n. The same arithmetic on every branch.
inline Vf exp_nonpositive(Vf x) {
  x = max(x, set1(-87.0f));
  const Vf n = round_nearest(mul(x, set1(1.44269504088896341f)));
  // f = x - n ln2, ln2 in two parts (the first exact in float32) so that f keeps its bits
  Vf f = fma(n, set1(-0.693359375f), x);
  f = fma(n, set1(2.12194440e-4f), f);
  Vf p = set1(1.0f / 5040);
  p = fma(p, f, set1(1.0f / 720));
  p = fma(p, f, set1(1.0f / 120));
  p = fma(p, f, set1(1.0f / 24));
  p = fma(p, f, set1(1.0f / 6));
  p = fma(p, f, set1(0.5f));
  p = fma(p, f, set1(1.0f));
  p = fma(p, f, set1(1.0f));
  return scale_pow2(p, n);
}

// e^x for any x (below -87 it underflows to ~0, above 88 to inf): e^(-|x|) from
// exp_nonpositive, inverted for positive x.
inline Vf exp_polynomial(Vf x) {
  const Vf e = exp_nonpositive(neg_abs(x));
  return where_negative(x, div(set1(1.0f), e), e);
}

// e^x as torch's CPU kernels compute it (ATen's Vectorized<float>::exp is SLEEF's 1-ulp
// expf, which libtorch_cpu exports): so SiLU-and-mul gives torch's F.silu bits. Declared weak:
// a torch build without those symbols still loads the extension, and gets exp_polynomial.
#if defined(FOLIO_SIMD_AVX512)
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
inline Vf exp_torch(Vf x) {
  return Sleef_expf16_u10 != nullptr ? Sleef_expf16_u10(x) : exp_polynomial(x);
}
#elif defined(FOLIO_SIMD_AVX2)
extern "C" __m256 Sleef_expf8_u10(__m256) __attribute__((weak));
inline Vf exp_torch(Vf x) {
  return Sleef_expf8_u10 != nullptr ? Sleef_expf8_u10(x) : exp_polynomial(x);
}
#else
inline Vf exp_torch(Vf x) {
  for (int i = 0; i < kLanes; ++i) x.v[i] = std::exp(x.v[i]);
  return x;
}
#endif

// Asks for `bytes` from `p` on into L1, a cache line at a time (a hint: addresses past the
// end of an array are harmless).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

}  // namespace folio_cpu::simd
