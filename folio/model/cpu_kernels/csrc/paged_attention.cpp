// Paged attention on the CPU, for the whole flat batch in one call (decodes and prefill
// chunks alike), as folio/model/attention/backend.py defines it:
//   1. this step's K/V rows go into the cache at slot_mapping (converted to the cache's dtype);
//   2. query token i of request b, at position p = seq_lens[b] - (its request's query count)
//      + (i's index among them), attends the keys at positions [lo, p] of b's blocks, lo = 0,
//      or p - sliding_window + 1 with a window.
// One task per (query token, KV head), shared out dynamically (parallel.h): the query heads
// sharing a KV head read each key and value row once. Scores for the task's keys go to a scratch row, then one softmax, then the
// weighted sum of value rows; everything in float32, the cache in float32, bfloat16, float16
// or FP8 (e4m3fn / e5m2: folio/model/attention/fp8.py). An FP8 cache holds K / k_scale and
// V / v_scale (one scale per KV head): written as the float32 quotient clamped to the format's
// largest value and rounded by c10's conversion, read as the exact float8 value times the
// scale, element by element: the arithmetic of a float32 cache holding the dequantized values,
// and the torch reference's. The kernel reads only visible slots, so the cache need not be
// zeroed.
// Two optional changes to the softmax: a soft cap (Gemma 2: each scaled score s becomes
// cap * tanh(s / cap) before the softmax) and attention sinks (GPT-OSS: a learned logit per
// query head that joins the softmax's denominator and carries no value, so the weights of a
// row sum to less than one).
#include "ops.h"
#include "parallel.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#endif

template <typename T>
constexpr bool kIsFp8 =
    std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
// Sixteen float8 elements as float32, exactly, through float16's bits. e5m2 is float16's top
// byte. e4m3fn's exponent (bias 7) and mantissa shifted into float16's places (bias 15) make
// the value / 2^8, subnormals included, which times 256 restores exactly. (e4m3fn's NaN, never
// written, would read as 480.)
template <typename T>
inline __m512 fp8x16_to_float(const T* src) {
  const __m256i w =
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
  } else {
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7);
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.0f));
  }
}
#endif

// A row of D cache elements as float32 (a copy unless the cache is float32); an FP8 row times
// `scale` (dequantized), which the other dtypes ignore.
template <typename T>
inline const float* row_as_float(const T* src, int64_t D, float* scratch, float scale) {
  int64_t d = 0;
#if defined(__AVX512F__)
  if constexpr (kIsFp8<T>) {
    const __m512 vs = _mm512_set1_ps(scale);
    for (; d + kLanes <= D; d += kLanes) {
      _mm512_storeu_ps(scratch + d, _mm512_mul_ps(fp8x16_to_float(src + d), vs));
    }
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // bfloat16 is float32's top half: widen and shift.
    for (; d + kLanes <= D; d += kLanes) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
      _mm512_storeu_ps(scratch + d, _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    for (; d + kLanes <= D; d += kLanes) {
      _mm512_storeu_ps(scratch + d, _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d))));
    }
  }
#endif
  if constexpr (kIsFp8<T>) {
    for (; d < D; ++d) scratch[d] = to_float(src[d]) * scale;
  } else {
    for (; d < D; ++d) scratch[d] = to_float(src[d]);
  }
  return scratch;
}
template <>
inline const float* row_as_float<float>(const float* src, int64_t, float*, float) {
  return src;
}

inline float dot(const float* a, const float* b, int64_t D) {
  int64_t d = 0;
  float acc = 0.0f;
#if defined(__AVX512F__)
  __m512 v = _mm512_setzero_ps();
  for (; d + kLanes <= D; d += kLanes) {
    v = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), v);
  }
  acc = _mm512_reduce_add_ps(v);
#endif
  for (; d < D; ++d) acc += a[d] * b[d];
  return acc;
}

inline void axpy(float w, const float* x, float* y, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 vw = _mm512_set1_ps(w);
  for (; d + kLanes <= D; d += kLanes) {
    _mm512_storeu_ps(y + d, _mm512_fmadd_ps(vw, _mm512_loadu_ps(x + d), _mm512_loadu_ps(y + d)));
  }
#endif
  for (; d < D; ++d) y[d] += w * x[d];
}

#if defined(__AVX512F__)
// exp(x) for x <= 0 (scores minus their maximum): x = n ln2 + f with |f| <= ln2 / 2, e^f by
// its Taylor series to degree 7 (truncation below 1e-8 relative, under float32's rounding),
// times 2^n by vscalefps.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

// s[i] = softmax(s)[i] over n scores, in place. cap > 0 soft-caps the scores first (a scalar
// tanh pass: only capped models pay for it); sink (-inf: none) is one more logit in the
// denominator, with no value of its own.
inline void softmax(float* s, int64_t n, float cap, float sink) {
  if (cap > 0.0f) {
    const float inv_cap = 1.0f / cap;
    for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] * inv_cap);
  }
  float m = sink;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
  int64_t i = 0;
  float total = 0.0f;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vt = _mm512_setzero_ps();
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
    _mm512_storeu_ps(s + i, e);
    vt = _mm512_add_ps(vt, e);
  }
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), vm));
    _mm512_mask_storeu_ps(s + i, k, e);
    vt = _mm512_add_ps(vt, _mm512_maskz_mov_ps(k, e));
    i = n;
  }
  total = _mm512_reduce_add_ps(vt);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    total += s[i];
  }
  if (sink > -std::numeric_limits<float>::infinity()) total += std::exp(sink - m);
  const float inv = 1.0f / total;
  for (int64_t j = 0; j < n; ++j) s[j] *= inv;
}

// A [T, heads, D] float32 tensor whose rows may be strided (q, k and v are views into the
// fused qkv projection's output), its last dimension contiguous.
struct Heads {
  const float* data;
  int64_t s0, s1;
  const float* at(int64_t t, int64_t h) const { return data + t * s0 + h * s1; }
};

// An FP8 cache element: x / scale, clamped to the format's largest finite value (a cast of a
// larger one may give NaN or infinity), rounded to nearest even.
template <typename T>
inline T to_cache(float x, float scale) {
  if constexpr (kIsFp8<T>) {
    const float limit = static_cast<float>(std::numeric_limits<T>::max());
    return static_cast<T>(std::clamp(x / scale, -limit, limit));
  } else {
    return static_cast<T>(x);
  }
}

template <typename T>
void write_cache(const Heads& key, const Heads& value, T* cache, const int64_t* slots,
                 int64_t T_tokens, int64_t plane, int64_t KVH, int64_t D,
                 const float* k_scale, const float* v_scale) {
  const int64_t row = KVH * D;
  T* k_cache = cache;
  T* v_cache = cache + plane;
  at::parallel_for(0, T_tokens, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < KVH; ++h) {
        const float* k = key.at(t, h);
        const float* v = value.at(t, h);
        T* kc = k_cache + slot * row + h * D;
        T* vc = v_cache + slot * row + h * D;
        const float ks = k_scale[h], vs = v_scale[h];
        for (int64_t d = 0; d < D; ++d) {
          kc[d] = to_cache<T>(k[d], ks);
          vc[d] = to_cache<T>(v[d], vs);
        }
      }
    }
  });
}

#if defined(__AVX512F__)
// Sixteen cache elements from `src` as float32; FP8 ones dequantized (times `scale`, which the
// other dtypes ignore).
template <typename T>
inline __m512 load16(const T* src, __m512 scale) {
  if constexpr (kIsFp8<T>) {
    return _mm512_mul_ps(fp8x16_to_float(src), scale);
  } else if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(src);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  }
}

// Sixteen vectors -> one: lane i holds the sum of a[i]'s lanes. Halving in four rounds (256-,
// 128-, 64-, 32-bit pieces of pairs added), 46 instructions for the sixteen sums where one
// horizontal sum each takes about ten.
inline __m512 reduce16(const __m512* a) {
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

// Asks for the cache rows (16 * NV elements each) at offs[0..count) into L1.
template <typename T, int NV>
inline void prefetch_rows_n(const T* base, const int64_t* offs, int64_t count) {
  constexpr int64_t kRowBytes = 16 * NV * sizeof(T);
  for (int64_t i = 0; i < count; ++i) {
    const char* row = reinterpret_cast<const char*>(base + offs[i]);
    for (int64_t b = 0; b < kRowBytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
  }
}

constexpr int64_t kValueAhead = 8;  // value rows prefetched this many keys ahead

// The attention of one (query token, KV head) task for head_dim D = 16 * NV: each query
// head's scores sixteen keys at a time (sixteen independent FMA chains, one reduce16), then
// the weighted sum of value rows with the accumulators of up to kHeadsPerPass heads held in
// registers, each value row read once for them.
template <typename T, int NV>
void attend_task(float* out, const float* const* q_heads, const T* k_base, const T* v_base,
                 const int64_t* offs, int64_t n, int64_t G, float scale, float k_scale,
                 float v_scale, float cap, const float* sinks, float* scores) {
  const auto prefetch_rows = prefetch_rows_n<T, NV>;
  const __m512 ks = _mm512_set1_ps(k_scale), vs = _mm512_set1_ps(v_scale);
  for (int64_t g = 0; g < G; ++g) {
    __m512 q[NV];
    for (int v = 0; v < NV; ++v)
      q[v] = _mm512_mul_ps(_mm512_loadu_ps(q_heads[g] + 16 * v), _mm512_set1_ps(scale));
    float* sg = scores + g * n;
    if (g == 0) prefetch_rows(k_base, offs, std::min<int64_t>(16, n));
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t count = std::min<int64_t>(16, n - j0);
      // The next sixteen key rows while these are scored: a request's blocks lie anywhere in
      // the cache, so the hardware prefetcher misses every block's start. (The first head
      // brings them in; the others find them in cache.)
      if (g == 0 && j0 + 16 < n)
        prefetch_rows(k_base, offs + j0 + 16, std::min<int64_t>(16, n - j0 - 16));
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) {
        acc[i] = _mm512_setzero_ps();
        if (i < count) {
          const T* k = k_base + offs[j0 + i];
          for (int v = 0; v < NV; ++v) {
            acc[i] = _mm512_fmadd_ps(q[v], load16(k + 16 * v, ks), acc[i]);
          }
        }
      }
      _mm512_mask_storeu_ps(sg + j0, static_cast<__mmask16>((1u << count) - 1), reduce16(acc));
    }
    softmax(sg, n, cap, sinks ? sinks[g] : -std::numeric_limits<float>::infinity());
  }
  constexpr int kHeadsPerPass = NV <= 4 ? 3 : 1;  // accumulators: at most 12 registers
  for (int64_t g0 = 0; g0 < G; g0 += kHeadsPerPass) {
    const int heads = static_cast<int>(std::min<int64_t>(kHeadsPerPass, G - g0));
    __m512 acc[kHeadsPerPass][NV];
    for (int h = 0; h < kHeadsPerPass; ++h)
      for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_setzero_ps();
    if (g0 == 0) prefetch_rows(v_base, offs, std::min<int64_t>(kValueAhead, n));
    for (int64_t j = 0; j < n; ++j) {
      if (g0 == 0 && j + kValueAhead < n) prefetch_rows(v_base, offs + j + kValueAhead, 1);
      const T* vr = v_base + offs[j];
      __m512 row[NV];
      for (int v = 0; v < NV; ++v) row[v] = load16(vr + 16 * v, vs);
      for (int h = 0; h < kHeadsPerPass; ++h) {
        if (h >= heads) break;
        const __m512 w = _mm512_set1_ps(scores[(g0 + h) * n + j]);
        for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_fmadd_ps(w, row[v], acc[h][v]);
      }
    }
    for (int h = 0; h < heads; ++h)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + (g0 + h) * NV * 16 + 16 * v, acc[h][v]);
  }
}
#endif

template <typename T>
void attend(float* out, const Heads& query, const T* cache, const int64_t* tables,
            int64_t max_blocks, const int64_t* token_req, const int64_t* token_pos,
            int64_t T_tokens, int64_t H, int64_t KVH, int64_t D, int64_t num_blocks,
            int64_t plane, int64_t block_size, float scale, int64_t window,
            const float* k_scale, const float* v_scale, float cap, const float* sinks) {
  const int64_t G = H / KVH;
  const int64_t row = KVH * D;              // elements of one cache slot
  folio_cpu::parallel_tasks(T_tokens * KVH, [&](const auto& take) {
    std::vector<float> q(G * D), acc(G * D), kv_row(D), scores;
    std::vector<int64_t> offs;
    std::vector<const float*> q_heads(G);
    for (int64_t w; (w = take()) >= 0;) {
      const int64_t t = w / KVH, kvh = w % KVH;
      const int64_t b = token_req[t], pos = token_pos[t];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t n = pos - lo + 1;
      const int64_t* table = tables + b * max_blocks;
      const float ks = k_scale[kvh], vs = v_scale[kvh];
      const float* group_sinks = sinks ? sinks + kvh * G : nullptr;  // this task's G heads
#if defined(__AVX512F__)
      if (D == 64 || D == 128) {
        // Each visible key's element offset in the cache plane, once for the K and V passes.
        offs.resize(n);
        for (int64_t j = lo; j <= pos;) {
          const int64_t block = table[j / block_size];
          TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range");
          const int64_t end = std::min<int64_t>(pos + 1, (j / block_size + 1) * block_size);
          for (; j < end; ++j) offs[j - lo] = (block * block_size + j % block_size) * row + kvh * D;
        }
        for (int64_t g = 0; g < G; ++g) q_heads[g] = query.at(t, kvh * G + g);
        scores.resize(G * n);
        float* o = out + (t * H + kvh * G) * D;
        if (D == 64)
          attend_task<T, 4>(o, q_heads.data(), cache, cache + plane, offs.data(), n, G, scale,
                            ks, vs, cap, group_sinks, scores.data());
        else
          attend_task<T, 8>(o, q_heads.data(), cache, cache + plane, offs.data(), n, G, scale,
                            ks, vs, cap, group_sinks, scores.data());
        continue;
      }
#endif
      for (int64_t g = 0; g < G; ++g) {
        const float* src = query.at(t, kvh * G + g);
        for (int64_t d = 0; d < D; ++d) q[g * D + d] = src[d] * scale;
      }
      scores.resize(G * n);
      // Scores, block by block (one table lookup per block).
      for (int64_t j = lo; j <= pos;) {
        const int64_t block = table[j / block_size];
        TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range");
        const int64_t end = std::min<int64_t>(pos + 1, (j / block_size + 1) * block_size);
        for (; j < end; ++j) {
          const T* k = cache + (block * block_size + j % block_size) * row + kvh * D;
          const float* kf = row_as_float(k, D, kv_row.data(), ks);
          for (int64_t g = 0; g < G; ++g) scores[g * n + (j - lo)] = dot(q.data() + g * D, kf, D);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        softmax(scores.data() + g * n, n, cap,
                group_sinks ? group_sinks[g] : -std::numeric_limits<float>::infinity());
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = lo; j <= pos;) {
        const int64_t block = table[j / block_size];
        const int64_t end = std::min<int64_t>(pos + 1, (j / block_size + 1) * block_size);
        for (; j < end; ++j) {
          const T* v = cache + plane + (block * block_size + j % block_size) * row + kvh * D;
          const float* vf = row_as_float(v, D, kv_row.data(), vs);
          for (int64_t g = 0; g < G; ++g) axpy(scores[g * n + (j - lo)], vf, acc.data() + g * D, D);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        std::copy(acc.begin() + g * D, acc.begin() + (g + 1) * D,
                  out + (t * H + kvh * G + g) * D);
      }
    }
  });
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& key,
         const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slots,
         const at::Tensor& tables, const std::vector<int64_t>& token_req,
         const std::vector<int64_t>& token_pos, double scale, int64_t window,
         const at::Tensor& k_scale, const at::Tensor& v_scale, float cap,
         const float* sinks) {
  const int64_t T_tokens = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t KVH = kv_cache.size(3);
  T* cache = static_cast<T*>(kv_cache.data_ptr());
  const float* ks = k_scale.data_ptr<float>();
  const float* vs = v_scale.data_ptr<float>();
  auto heads = [](const at::Tensor& x) {
    return Heads{x.data_ptr<float>(), x.stride(0), x.stride(1)};
  };
  // The V plane's offset: the K plane's size, or 0 where one latent plane serves as both
  // (multi-head latent attention, whose values are its keys)
  const int64_t plane = kv_cache.stride(0);
  write_cache<T>(heads(key), heads(value), cache, slots.data_ptr<int64_t>(), T_tokens,
                 plane, KVH, D, ks, vs);
  attend<T>(out.data_ptr<float>(), heads(query), cache, tables.data_ptr<int64_t>(),
            tables.size(1), token_req.data(), token_pos.data(), T_tokens, H, KVH, D,
            num_blocks, plane, block_size, static_cast<float>(scale), window, ks, vs, cap,
            sinks);
}

}  // namespace

// out [T, H, D] float32 contiguous; query [T, H, D] and key/value [T, KVH, D] float32 with
// a contiguous last dimension (rows may be strided); kv_cache [2, num_blocks,
// block_size, KVH, D] (contiguous, or one contiguous plane viewed twice: stride 0 on the
// first dimension) float32/bfloat16/float16/float8_e4m3fn/float8_e5m2; slot_mapping [T]
// int64; block_tables [B, max_blocks] int64; query_start_loc [B + 1] int64; seq_lens [B]
// int64 (CPU tensors, all contiguous); sliding_window <= 0 for none; k_scale / v_scale [KVH]
// float32, read for an FP8 cache only; logits_soft_cap <= 0 for none; sinks [H] float32 or
// None.
void paged_attention(at::Tensor out, at::Tensor query, at::Tensor key,
                     at::Tensor value, at::Tensor kv_cache, at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor query_start_loc,
                     at::Tensor seq_lens, double scale, int64_t sliding_window,
                     at::Tensor k_scale, at::Tensor v_scale, double logits_soft_cap,
                     c10::optional<at::Tensor> sinks) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 3,
              "out must be contiguous float32 [T, heads, head_dim]");
  for (const at::Tensor* t : {&query, &key, &value}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->stride(2) == 1,
                "query, key and value must be float32 [T, heads, head_dim], the last "
                "dimension contiguous");
  }
  for (const at::Tensor* t : {&slot_mapping, &block_tables, &query_start_loc, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "slot_mapping, block_tables, query_start_loc and seq_lens must be contiguous int64");
  }
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache[0].is_contiguous() &&
                  (kv_cache.stride(0) == 0 || kv_cache.stride(0) == kv_cache[0].numel()),
              "kv_cache must be a contiguous [2, num_blocks, block_size, kv_heads, head_dim] "
              "(or one plane expanded to two)");
  const int64_t T_tokens = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && key.size(1) == KVH && key.size(2) == D &&
                  value.sizes() == key.sizes() && key.size(0) == T_tokens &&
                  out.sizes() == query.sizes() && H % KVH == 0,
              "head counts or head_dim disagree between query, key/value and the cache");
  for (const at::Tensor* t : {&k_scale, &v_scale}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == KVH,
                "k_scale and v_scale must be contiguous float32 [kv_heads]");
  }
  const float* sink_data = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->numel() == H,
                "sinks must be contiguous float32 [heads]");
    sink_data = sinks->data_ptr<float>();
  }
  const float cap = logits_soft_cap > 0.0 ? static_cast<float>(logits_soft_cap) : 0.0f;
  const int64_t B = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == B + 1 && block_tables.dim() == 2 &&
                  block_tables.size(0) >= B && slot_mapping.size(0) == T_tokens,
              "batch layout tensors disagree in size");
  const int64_t slots_total = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < slots_total, "slot ", slots[t], " out of range");
  }
  // Each token's request and position.
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t max_ctx = block_tables.size(1) * kv_cache.size(2);
  TORCH_CHECK(qsl[0] == 0 && qsl[B] == T_tokens, "query_start_loc must run from 0 to T");
  std::vector<int64_t> token_req(T_tokens), token_pos(T_tokens);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = qsl[b + 1] - qsl[b];
    TORCH_CHECK(n >= 0 && lens[b] >= n && lens[b] <= max_ctx,
                "request ", b, ": seq_len ", lens[b], " does not hold its ", n, " query tokens");
    for (int64_t i = 0; i < n; ++i) {
      token_req[qsl[b] + i] = b;
      token_pos[qsl[b] + i] = lens[b] - n + i;
    }
  }
  switch (kv_cache.scalar_type()) {
    case at::kFloat:
      run<float>(out, query, key, value, kv_cache, slot_mapping, block_tables, token_req,
                 token_pos, scale, sliding_window, k_scale, v_scale, cap, sink_data);
      break;
    case at::kBFloat16:
      run<c10::BFloat16>(out, query, key, value, kv_cache, slot_mapping, block_tables,
                         token_req, token_pos, scale, sliding_window, k_scale, v_scale, cap, sink_data);
      break;
    case at::kHalf:
      run<c10::Half>(out, query, key, value, kv_cache, slot_mapping, block_tables, token_req,
                     token_pos, scale, sliding_window, k_scale, v_scale, cap, sink_data);
      break;
    case at::kFloat8_e4m3fn:
      run<c10::Float8_e4m3fn>(out, query, key, value, kv_cache, slot_mapping, block_tables,
                              token_req, token_pos, scale, sliding_window, k_scale, v_scale, cap, sink_data);
      break;
    case at::kFloat8_e5m2:
      run<c10::Float8_e5m2>(out, query, key, value, kv_cache, slot_mapping, block_tables,
                            token_req, token_pos, scale, sliding_window, k_scale, v_scale, cap, sink_data);
      break;
    default:
      TORCH_CHECK(false, "the KV cache must be float32, bfloat16, float16, float8_e4m3fn or "
                         "float8_e5m2");
  }
}
