// The float vector folio's CPU matmul kernels are written in, so that one kernel body serves
// every machine the extension is built on (-march=native picks the branch):
//   * AVX-512: 16 lanes (__m512);
//   * AVX2 + FMA: 8 lanes (__m256) — most AMD EPYC/Ryzen before Zen 4 and many Intel client
//     chips. Before this branch existed those machines ran the kernels' scalar loops, whose
//     float sums the compiler may not vectorize: 1.2 GFLOP/s where the vector kernel makes tens;
//   * anything else (e.g. Arm): 8 plain floats whose element-wise loops the compiler vectorizes
//     for the target's own registers (NEON and the like).
// Only what the kernels use: loads and stores, FMA, a horizontal sum, int8/uint8 widening, and
// the 4-bit group weights of q4_matmul.cpp (make_group, below).
#pragma once

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace folio_cpu::simd {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using Vf = __m512;
inline Vf zero() { return _mm512_setzero_ps(); }
inline Vf set1(float s) { return _mm512_set1_ps(s); }
inline Vf load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vf v) { _mm512_storeu_ps(p, v); }
inline Vf add(Vf a, Vf b) { return _mm512_add_ps(a, b); }
inline Vf mul(Vf a, Vf b) { return _mm512_mul_ps(a, b); }
inline Vf fma(Vf a, Vf b, Vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline float reduce_add(Vf v) { return _mm512_reduce_add_ps(v); }
// kLanes int8 values widened to float (exact)
inline Vf load_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
using Vf = __m256;
inline Vf zero() { return _mm256_setzero_ps(); }
inline Vf set1(float s) { return _mm256_set1_ps(s); }
inline Vf load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vf v) { _mm256_storeu_ps(p, v); }
inline Vf add(Vf a, Vf b) { return _mm256_add_ps(a, b); }
inline Vf mul(Vf a, Vf b) { return _mm256_mul_ps(a, b); }
inline Vf fma(Vf a, Vf b, Vf c) { return _mm256_fmadd_ps(a, b, c); }
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
inline Vf mul(Vf a, Vf b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] *= b.v[i];
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
inline Vf load_i8(const int8_t* p) {
  Vf r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
#endif

// A 4-bit group (q4_matmul.cpp): 32 weights from 16 bytes in ggml's order (byte i holds
// element i in its low nibble, element i + 16 in its high one), each (code - 8) * s + z with
// one rounding, the value dequantization gives. kGroupVecs vectors, elements in order.
constexpr int kGroupVecs = 32 / kLanes;

#if defined(__AVX512F__)
// The group's 16 possible weights as a table that vpermps indexes with a nibble (it reads
// only an index lane's low 4 bits): no mask and no int-to-float conversion per weight.
inline void make_group(const uint8_t* b, float s, float z, Vf w[kGroupVecs]) {
  const __m512 codes = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512 table = _mm512_fmadd_ps(codes, _mm512_set1_ps(s), _mm512_set1_ps(z));
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  w[0] = _mm512_permutexvar_ps(v, table);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2's permute indexes 8 entries, not 16: each nibble is converted instead (mask or shift,
// convert, subtract 8 — exact — then one FMA).
inline void make_group(const uint8_t* b, float s, float z, Vf w[kGroupVecs]) {
  const __m256i low = _mm256_set1_epi32(0x0F);
  const __m256 eight = _mm256_set1_ps(8.0f), vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
  for (int half = 0; half < 2; ++half) {  // bytes 0-7, then 8-15
    const __m256i v =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * half)));
    const __m256 lo = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), eight);
    const __m256 hi = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), eight);
    w[half] = _mm256_fmadd_ps(lo, vs, vz);      // elements 8 half .. 8 half + 7
    w[2 + half] = _mm256_fmadd_ps(hi, vs, vz);  // elements 16 + 8 half ..
  }
}
#else
inline void make_group(const uint8_t* b, float s, float z, Vf w[kGroupVecs]) {
  for (int i = 0; i < 16; ++i) {
    w[i / kLanes].v[i % kLanes] = __builtin_fmaf(static_cast<float>(b[i] & 0x0F) - 8.0f, s, z);
    w[(16 + i) / kLanes].v[(16 + i) % kLanes] =
        __builtin_fmaf(static_cast<float>(b[i] >> 4) - 8.0f, s, z);
  }
}
#endif

// Asks for `bytes` from `p` on into L1, a cache line at a time (a hint: addresses past the
// end of an array are harmless).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

}  // namespace folio_cpu::simd
