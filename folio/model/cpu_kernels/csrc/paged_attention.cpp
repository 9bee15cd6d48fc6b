// Paged attention on the CPU, for the whole flat batch in one call (decodes and prefill
// chunks alike), as folio/model/attention/backend.py defines it:
//   1. this step's K/V rows go into the cache at slot_mapping (converted to the cache's dtype);
//   2. query token i of request b, at position p = seq_lens[b] - (its request's query count)
//      + (i's index among them), attends the keys at positions [lo, p] of b's blocks, lo = 0,
//      or p - sliding_window + 1 with a window.
// One task per (block of a request's query tokens, KV head), shared out dynamically
// (parallel.h): the query heads sharing a KV head, and the block's tokens, read each key and
// value row from memory once. Scores for the task's keys go to a scratch row, then one
// softmax, then the weighted sum of value rows; everything in float32, the cache in float32,
// bfloat16, float16 or FP8 (e4m3fn / e5m2: folio/model/attention/fp8.py). An FP8 cache
// holds K / k_scale and V / v_scale (one scale per KV head): written as the float32 quotient
// clamped to the format's largest value and rounded by c10's conversion, read as the exact
// float8 value times the scale, element by element: the arithmetic of a float32 cache
// holding the dequantized values, and the torch reference's. The kernel reads only visible
// slots, so the cache need not be zeroed.
// Two optional changes to the softmax: a soft cap (Gemma 2: each scaled score s becomes
// cap * tanh(s / cap) before the softmax) and attention sinks (GPT-OSS: a learned logit per
// query head that joins the softmax's denominator and carries no value, so the weights of a
// row sum to less than one).
#include "ops.h"
#include "parallel.h"
#include "simd.h"

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

namespace {

namespace simd = folio_cpu::simd;
using simd::Vf;
constexpr int64_t kLanes = simd::kLanes;

template <typename T>
constexpr bool kIsFp8 =
    std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

// kLanes cache elements from `src` as float32; FP8 ones dequantized (times `scale`, which the
// other dtypes ignore).
template <typename T>
inline Vf load_row(const T* src, Vf scale) {
  if constexpr (std::is_same_v<T, float>) {
    return simd::load(src);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return simd::load_bf16(reinterpret_cast<const uint16_t*>(src));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return simd::load_f16(reinterpret_cast<const uint16_t*>(src));
  } else {
    constexpr bool kE4M3 = std::is_same_v<T, c10::Float8_e4m3fn>;
    return simd::mul(simd::load_fp8<kE4M3>(reinterpret_cast<const uint8_t*>(src)), scale);
  }
}

// A row of D cache elements as float32 (a copy unless the cache is float32); an FP8 row times
// `scale` (dequantized), which the other dtypes ignore.
template <typename T>
inline const float* row_as_float(const T* src, int64_t D, float* scratch, float scale) {
  int64_t d = 0;
  const Vf vs = simd::set1(scale);
  for (; d + kLanes <= D; d += kLanes) simd::store(scratch + d, load_row(src + d, vs));
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
  Vf v = simd::zero();
  for (; d + kLanes <= D; d += kLanes) v = simd::fma(simd::load(a + d), simd::load(b + d), v);
  float acc = simd::reduce_add(v);
  for (; d < D; ++d) acc += a[d] * b[d];
  return acc;
}

inline void axpy(float w, const float* x, float* y, int64_t D) {
  int64_t d = 0;
  const Vf vw = simd::set1(w);
  for (; d + kLanes <= D; d += kLanes)
    simd::store(y + d, simd::fma(vw, simd::load(x + d), simd::load(y + d)));
  for (; d < D; ++d) y[d] += w * x[d];
}

// s[i] = softmax(s)[i] over n scores, in place. cap > 0 soft-caps the scores first (a scalar
// tanh pass: only capped models pay for it); sink (-inf: none) is one more logit in the
// denominator, with no value of its own.
inline void softmax(float* s, int64_t n, float cap, float sink) {
  if (cap > 0.0f) {
    const float inv_cap = 1.0f / cap;
    for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] * inv_cap);
  }
  // the maximum, kLanes at a time (a scalar running maximum is a chain of dependent steps)
  float m = sink;
  int64_t first = 0;
  if (n >= kLanes) {
    Vf vm = simd::load(s);
    for (first = kLanes; first + kLanes <= n; first += kLanes)
      vm = simd::max(vm, simd::load(s + first));
    float lanes[kLanes];
    simd::store(lanes, vm);
    for (float x : lanes) m = std::max(m, x);
  }
  for (int64_t i = first; i < n; ++i) m = std::max(m, s[i]);
  const Vf vm = simd::set1(m);
  Vf vt = simd::zero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vf e = simd::exp_nonpositive(simd::sub(simd::load(s + i), vm));
    simd::store(s + i, e);
    vt = simd::add(vt, e);
  }
  if (i < n) {  // the last few: padded with the maximum, their exps then zeroed before the sum
    const int count = static_cast<int>(n - i);
    float tail[kLanes];
    std::fill(tail, tail + kLanes, m);
    std::copy(s + i, s + n, tail);
    simd::store(tail, simd::exp_nonpositive(simd::sub(simd::load(tail), vm)));
    std::fill(tail + count, tail + kLanes, 0.0f);
    vt = simd::add(vt, simd::load(tail));
    std::copy(tail, tail + count, s + i);
  }
  float total = simd::reduce_add(vt);
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

// Asks for the cache rows (D elements each) at offs[0..count) into L1.
template <typename T, int64_t D>
inline void prefetch_rows(const T* base, const int64_t* offs, int64_t count) {
  for (int64_t i = 0; i < count; ++i) simd::prefetch_bytes(base + offs[i], D * sizeof(T));
}

// One query vector of a task: a (query token, query head) pair, the keys it sees as a range
// [start, start + count) of the task's key offsets, and where its output row goes.
struct QueryRow {
  const float* q;
  float* out;
  int64_t start, count;
  float sink;  // -inf: none
};

constexpr int64_t kValueChunk = 16;  // value rows taken by every query row in turn
constexpr int64_t kKeysAhead = 4;    // chunks of key rows prefetched ahead
constexpr int64_t kValuesAhead = 2;  // chunks of value rows prefetched ahead

// The attention of one task's query rows for head_dim D = kLanes * NV. The rows share one KV
// head and one request (the query heads of that KV head, for a block of its query tokens),
// so they read one range of the cache's key and value rows. Both passes go over that range a
// chunk at a time, every row taking the chunk while it is in L1: a row at a time over the
// whole range read it from L2 (or memory) once per row, and L2's 32 bytes a cycle, not the
// FMAs, set the pace (measured ~2.5x slower on AVX2).
//   * scores: kLanes keys against each row's q (kLanes independent FMA chains, one
//     reduce_lanes), written to the row's scratch; each row's softmax over its own keys;
//   * values: kValueChunk value rows into each row's accumulators (NV vectors, kept in
//     `accum` between chunks), a row taking only the keys of its own range.
// A row's arithmetic is the same whatever the other rows are: each key's score is its own
// FMA chain and lane of reduce_lanes, and each row's sum takes its keys in order.
template <typename T, int NV>
void attend_task(const QueryRow* rows, int64_t num_rows, const T* k_base, const T* v_base,
                 const int64_t* offs, int64_t n_all, float scale, float k_scale, float v_scale,
                 float cap, float* scores, int64_t stride, float* accum) {
  constexpr int64_t D = kLanes * NV;
  const Vf ks = simd::set1(k_scale), vs = simd::set1(v_scale);
  // Keys and values of the range's positions: per chunk, each row whose range meets it.
  // Key rows kKeysAhead chunks ahead of the one scored: a request's blocks lie anywhere in
  // the cache, so the hardware prefetcher misses every block's start, and at one query row a
  // chunk is scored in about one memory latency (one chunk ahead measured ~15 % slower on a
  // cold cache).
  prefetch_rows<T, D>(k_base, offs, std::min<int64_t>(kKeysAhead * kLanes, n_all));
  for (int64_t j0 = 0; j0 < n_all; j0 += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, n_all - j0);
    const int64_t ahead = j0 + kKeysAhead * kLanes;
    if (ahead < n_all)
      prefetch_rows<T, D>(k_base, offs + ahead, std::min<int64_t>(kLanes, n_all - ahead));
    // A short last chunk repeats its last key (scored into the scratch's padding), so that
    // every chunk is the same straight code.
    const T* keys[kLanes];
    for (int i = 0; i < kLanes; ++i) keys[i] = k_base + offs[j0 + std::min<int64_t>(i, count - 1)];
    for (int64_t r = 0; r < num_rows; ++r) {
      const QueryRow& row = rows[r];
      if (j0 + kLanes <= row.start || j0 >= row.start + row.count) continue;
      // one piece of q against that piece of kLanes keys at a time: kLanes FMA chains side by
      // side (a chain per key of NV FMAs in a row waited on each FMA, 3-4x slower)
      Vf acc[kLanes];
      for (int i = 0; i < kLanes; ++i) acc[i] = simd::zero();
      const Vf sv = simd::set1(scale);
      for (int v = 0; v < NV; ++v) {
        const Vf qv = simd::mul(simd::load(row.q + kLanes * v), sv);
        for (int i = 0; i < kLanes; ++i)
          acc[i] = simd::fma(qv, load_row(keys[i] + kLanes * v, ks), acc[i]);
      }
      simd::store(scores + r * stride + j0, simd::reduce_lanes(acc));
    }
  }
  for (int64_t r = 0; r < num_rows; ++r)
    softmax(scores + r * stride + rows[r].start, rows[r].count, cap, rows[r].sink);
  for (int64_t r = 0; r < num_rows; ++r)
    for (int v = 0; v < NV; ++v) simd::store(accum + r * D + kLanes * v, simd::zero());
  prefetch_rows<T, D>(v_base, offs, std::min<int64_t>(kValuesAhead * kValueChunk, n_all));
  for (int64_t j0 = 0; j0 < n_all; j0 += kValueChunk) {
    const int64_t j1 = std::min<int64_t>(n_all, j0 + kValueChunk);
    const int64_t ahead = j0 + kValuesAhead * kValueChunk;
    if (ahead < n_all)
      prefetch_rows<T, D>(v_base, offs + ahead, std::min<int64_t>(kValueChunk, n_all - ahead));
    for (int64_t r = 0; r < num_rows; ++r) {
      const QueryRow& row = rows[r];
      const int64_t a = std::max(j0, row.start), b = std::min(j1, row.start + row.count);
      if (a >= b) continue;
      const float* w = scores + r * stride;
      float* sum = accum + r * D;
      Vf acc[NV];
      for (int v = 0; v < NV; ++v) acc[v] = simd::load(sum + kLanes * v);
      for (int64_t j = a; j < b; ++j) {
        const T* vr = v_base + offs[j];
        const Vf wj = simd::set1(w[j]);
        for (int v = 0; v < NV; ++v) acc[v] = simd::fma(wj, load_row(vr + kLanes * v, vs), acc[v]);
      }
      for (int v = 0; v < NV; ++v) simd::store(sum + kLanes * v, acc[v]);
    }
  }
  for (int64_t r = 0; r < num_rows; ++r)
    std::copy(accum + r * D, accum + (r + 1) * D, rows[r].out);
}

// Consecutive query tokens of one request, [t0, t1): one task per KV head.
struct QueryBlock {
  int64_t t0, t1;
};

// At most this many query tokens in a block: its scores (tokens x query heads x keys floats)
// are one thread's scratch.
constexpr int64_t kMaxBlockTokens = 8;
constexpr int64_t kMaxBlockScores = int64_t{1} << 20;

// The step's query tokens cut into blocks: a request's tokens (a verify step's drafts, a
// prefill chunk) read the same keys, so one task reading them once for several tokens saves
// the memory traffic of reading them per token. Blocks are cut smaller while there would be
// fewer tasks than twice the threads (a lone verify step would otherwise leave a thread
// idle), and so that the scores of a long context fit the scratch bound.
std::vector<QueryBlock> query_blocks(const int64_t* token_req, const int64_t* token_pos,
                                     int64_t T_tokens, int64_t KVH, int64_t G,
                                     int64_t window) {
  std::vector<std::pair<int64_t, int64_t>> runs;  // each request's tokens
  for (int64_t t = 0; t < T_tokens;) {
    int64_t e = t + 1;
    while (e < T_tokens && token_req[e] == token_req[t]) ++e;
    runs.emplace_back(t, e);
    t = e;
  }
  const int64_t threads = at::get_num_threads();
  int64_t size = kMaxBlockTokens;
  auto tasks = [&](int64_t s) {
    int64_t n = 0;
    for (const auto& run : runs) n += (run.second - run.first + s - 1) / s;
    return n * KVH;
  };
  while (size > 1 && tasks(size) < 2 * threads) size /= 2;
  std::vector<QueryBlock> blocks;
  for (const auto& run : runs) {
    // the most keys a block's rows may span: its last token's, or the window and the block
    const int64_t len = run.second - run.first;
    const int64_t keys = window > 0 ? window + size : token_pos[run.second - 1] + 1;
    const int64_t most = std::clamp<int64_t>(kMaxBlockScores / (G * keys), 1, size);
    // as many blocks as `most` tokens a block needs, their sizes differing by one at most
    const int64_t count = (len + most - 1) / most;
    for (int64_t i = 0; i < count; ++i)
      blocks.push_back({run.first + len * i / count, run.first + len * (i + 1) / count});
  }
  return blocks;
}

template <typename T>
void attend(float* out, const Heads& query, const T* cache, const int64_t* tables,
            int64_t max_blocks, const int64_t* token_req, const int64_t* token_pos,
            int64_t T_tokens, int64_t H, int64_t KVH, int64_t D, int64_t num_blocks,
            int64_t plane, int64_t block_size, float scale, int64_t window,
            const float* k_scale, const float* v_scale, float cap, const float* sinks) {
  const int64_t G = H / KVH;
  const int64_t row = KVH * D;              // elements of one cache slot
  // head_dim as vectors, where attend_task has a build for it (4..32 vectors: head_dim 64 to
  // 512 with AVX-512's 16 lanes, 32 to 256 with 8); other head dims take the plain loop below
  const int64_t nv = D % kLanes == 0 ? D / kLanes : 0;
  const int64_t task_nv = (nv == 4 || nv == 8 || nv == 16 || nv == 32) ? nv : 0;
  const std::vector<QueryBlock> blocks =
      query_blocks(token_req, token_pos, T_tokens, KVH, G, window);
  const float no_sink = -std::numeric_limits<float>::infinity();
  folio_cpu::parallel_tasks(static_cast<int64_t>(blocks.size()) * KVH, [&](const auto& take) {
    std::vector<float> q(G * D), acc(G * D), kv_row(D), scores, accum;
    std::vector<int64_t> offs;
    std::vector<QueryRow> rows;
    for (int64_t w; (w = take()) >= 0;) {
      const QueryBlock& qb = blocks[w / KVH];
      const int64_t kvh = w % KVH;
      const int64_t b = token_req[qb.t0];
      const int64_t* table = tables + b * max_blocks;
      const float ks = k_scale[kvh], vs = v_scale[kvh];
      const float* group_sinks = sinks ? sinks + kvh * G : nullptr;  // this task's G heads
      auto first_key = [&](int64_t pos) {
        return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      };
      if (task_nv > 0) {
        // The keys any of the block's tokens sees, [lo, hi]; each one's element offset in the
        // cache plane, once for the K and V passes of every row.
        const int64_t lo = first_key(token_pos[qb.t0]), hi = token_pos[qb.t1 - 1];
        const int64_t n_all = hi - lo + 1;
        offs.resize(n_all);
        for (int64_t j = lo; j <= hi;) {
          const int64_t block = table[j / block_size];
          FOLIO_CHECK(block >= 0 && block < num_blocks, "block id %lld out of range",
                      static_cast<long long>(block));
          const int64_t end = std::min<int64_t>(hi + 1, (j / block_size + 1) * block_size);
          for (; j < end; ++j) offs[j - lo] = (block * block_size + j % block_size) * row + kvh * D;
        }
        rows.clear();
        for (int64_t t = qb.t0; t < qb.t1; ++t) {
          const int64_t start = first_key(token_pos[t]) - lo;
          for (int64_t g = 0; g < G; ++g)
            rows.push_back({query.at(t, kvh * G + g), out + (t * H + kvh * G + g) * D, start,
                            token_pos[t] - lo - start + 1,
                            group_sinks ? group_sinks[g] : no_sink});
        }
        // each row's scores over the whole range, padded for the last chunk's full store
        const int64_t stride = n_all + kLanes;
        scores.resize(rows.size() * stride);
        accum.resize(rows.size() * D);
        auto task = [&](auto nv) {
          attend_task<T, decltype(nv)::value>(rows.data(), static_cast<int64_t>(rows.size()),
                                              cache, cache + plane, offs.data(), n_all, scale,
                                              ks, vs, cap, scores.data(), stride, accum.data());
        };
        switch (task_nv) {
          case 4: task(std::integral_constant<int, 4>{}); break;
          case 8: task(std::integral_constant<int, 8>{}); break;
          case 16: task(std::integral_constant<int, 16>{}); break;
          default: task(std::integral_constant<int, 32>{}); break;
        }
        continue;
      }
      for (int64_t t = qb.t0; t < qb.t1; ++t) {
        const int64_t pos = token_pos[t], lo = first_key(pos), n = pos - lo + 1;
        for (int64_t g = 0; g < G; ++g) {
          const float* src = query.at(t, kvh * G + g);
          for (int64_t d = 0; d < D; ++d) q[g * D + d] = src[d] * scale;
        }
        scores.resize(G * n);
        // Scores, block by block (one table lookup per block).
        for (int64_t j = lo; j <= pos;) {
          const int64_t block = table[j / block_size];
          FOLIO_CHECK(block >= 0 && block < num_blocks, "block id %lld out of range",
                      static_cast<long long>(block));
          const int64_t end = std::min<int64_t>(pos + 1, (j / block_size + 1) * block_size);
          for (; j < end; ++j) {
            const T* k = cache + (block * block_size + j % block_size) * row + kvh * D;
            const float* kf = row_as_float(k, D, kv_row.data(), ks);
            for (int64_t g = 0; g < G; ++g)
              scores[g * n + (j - lo)] = dot(q.data() + g * D, kf, D);
          }
        }
        for (int64_t g = 0; g < G; ++g)
          softmax(scores.data() + g * n, n, cap, group_sinks ? group_sinks[g] : no_sink);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = lo; j <= pos;) {
          const int64_t block = table[j / block_size];
          const int64_t end = std::min<int64_t>(pos + 1, (j / block_size + 1) * block_size);
          for (; j < end; ++j) {
            const T* v = cache + plane + (block * block_size + j % block_size) * row + kvh * D;
            const float* vf = row_as_float(v, D, kv_row.data(), vs);
            for (int64_t g = 0; g < G; ++g)
              axpy(scores[g * n + (j - lo)], vf, acc.data() + g * D, D);
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          std::copy(acc.begin() + g * D, acc.begin() + (g + 1) * D,
                    out + (t * H + kvh * G + g) * D);
        }
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
    FOLIO_CHECK(slots[t] >= 0 && slots[t] < slots_total, "slot %lld out of range",
                static_cast<long long>(slots[t]));
  }
  // Each token's request and position.
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t max_ctx = block_tables.size(1) * kv_cache.size(2);
  TORCH_CHECK(qsl[0] == 0 && qsl[B] == T_tokens, "query_start_loc must run from 0 to T");
  std::vector<int64_t> token_req(T_tokens), token_pos(T_tokens);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = qsl[b + 1] - qsl[b];
    FOLIO_CHECK(n >= 0 && lens[b] >= n && lens[b] <= max_ctx,
                "request %lld: seq_len %lld does not hold its %lld query tokens",
                static_cast<long long>(b), static_cast<long long>(lens[b]),
                static_cast<long long>(n));
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
