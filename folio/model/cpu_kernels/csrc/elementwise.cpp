// The decoder layer's small float32 ops on the CPU, each one pass where torch's eager code
// takes a chain of ops (and a dispatch per op, which is most of their time at decode sizes):
// RMSNorm with the residual add, neox rotary embedding, SiLU-and-mul. They compute
// what folio/model/layers.py's torch code computes, in the same order, so float32 results
// differ only by summation order (the norm's sum of squares).
#include "ops.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace {

void check_rows(const at::Tensor& x, const char* name) {
  FOLIO_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "%s must be float32 [rows, features] with contiguous rows", name);
}

using folio_cpu::simd::Vf;
using folio_cpu::simd::kLanes;
namespace simd = folio_cpu::simd;

// silu(g) * u, kLanes at a time, as torch computes it: g / (1 + e^-g), rounded, times u,
// e^-g from simd.h's exp_torch (SLEEF's, as ATen's vectorized silu takes it; a row's
// remainder below goes through libm's, as ATen's does). std::exp does
// not vectorize: one call an element took 1.6 ms of a 5-row verify step of the default model.
inline Vf silu_mul(Vf g, Vf u) {
  const Vf one = simd::set1(1.0f);
  const Vf e = simd::exp_torch(simd::sub(simd::zero(), g));
  return simd::mul(simd::div(g, simd::add(one, e)), u);
}

}  // namespace

std::vector<at::Tensor> rms_norm(at::Tensor x, at::Tensor weight, double eps,
                                 c10::optional<at::Tensor> residual) {
  check_rows(x, "x");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.numel() == D, "weight must be float32 [features]");
  auto out = at::empty({T, D}, x.options());
  at::Tensor sum;
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->size(0) == T && residual->size(1) == D, "residual must match x");
    sum = at::empty({T, D}, x.options());
  }
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = sum.defined() ? sum.data_ptr<float>() : nullptr;
  const int64_t xs = x.stride(0), rs = residual.has_value() ? residual->stride(0) : 0;
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = xp + t * xs;
      float* o = op + t * D;
      if (sp != nullptr) {
        float* s = sp + t * D;
        const float* r = rp + t * rs;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) s[d] = row[d] + r[d];
        row = s;
      }
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < D; ++d) squares += row[d] * row[d];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(D) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] = w[d] * (row[d] * inv);
    }
  });
  if (sum.defined()) return {out, sum};
  return {out};
}

std::vector<at::Tensor> rotary_neox(at::Tensor positions, at::Tensor q, at::Tensor k,
                                    at::Tensor cos, at::Tensor sin, int64_t rotary_dim) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.dim() == 1, "positions must be contiguous int64 [T]");
  const int64_t T = positions.size(0);
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->stride(2) == 1 &&
                    t->size(0) == T, "q and k must be float32 [T, heads, head_dim]");
  }
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.size(1) == rotary_dim &&
                  rotary_dim % 2 == 0 && rotary_dim <= q.size(2) && rotary_dim <= k.size(2),
              "cos and sin must be float32 [positions, rotary_dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0), half = rotary_dim / 2;
  for (int64_t t = 0; t < T; ++t) {
    FOLIO_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position %lld out of range",
                static_cast<long long>(pos[t]));
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  auto rotate = [&](const at::Tensor& x) {
    const int64_t H = x.size(1), D = x.size(2), s0 = x.stride(0), s1 = x.stride(1);
    auto out = at::empty({T, H, D}, x.options());
    const float* in = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* c = cp + pos[t] * rotary_dim;
        const float* s = sp + pos[t] * rotary_dim;
        for (int64_t h = 0; h < H; ++h) {
          const float* v = in + t * s0 + h * s1;
          float* o = op + (t * H + h) * D;
          // (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), the table repeating its halves.
#pragma omp simd
          for (int64_t d = 0; d < half; ++d) {
            o[d] = v[d] * c[d] - v[d + half] * s[d];
            o[d + half] = v[d + half] * c[d + half] + v[d] * s[d + half];
          }
          for (int64_t d = rotary_dim; d < D; ++d) o[d] = v[d];
        }
      }
    });
    return out;
  };
  return {rotate(q), rotate(k)};
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must hold gate and up halves");
  auto out = at::empty({T, I}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = gate_up.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = in + t * s0;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
      for (; i + kLanes <= I; i += kLanes)
        simd::store(o + i, silu_mul(simd::load(g + i), simd::load(u + i)));
      // the last few one at a time with libm's exp, as ATen's vectorized loops take a row's
      // remainder (so a tail element is torch's bits too)
      for (; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}
