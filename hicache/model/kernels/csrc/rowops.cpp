// The decoder's per-row ops for CPUs with AVX2 + FMA (hicache/model/kernels/native.py builds this file
// beside qgemm.cpp; ops.py calls it where the native build exists), each one call instead of several torch
// ops a layer. Activations float32 or bfloat16; every intermediate is rounded to the activation dtype where
// the torch expression it replaces rounds it.
//
//   rms_norm(x [R, D], weight [D], eps) -> [R, D]: per row, ss = the sum of x_i * x_i with input i in lane
//       i mod 8 (adds in increasing i) and the 8 lanes summed by one fixed tree, r = 1 / sqrt(ss / D + eps),
//       y_i = weight_i * round(x_i * r). Its own arithmetic (torch's reduction order is torch's), so part of
//       the native family a model's identity names (native_attention.attention_family, ROW_OPS_VERSION).
//   silu_mul(x [R, G, 2C]) -> [R, G C]: y = round(g / (1 + e^-g)) * u of each group's gate g = x[.., :C]
//       and up u = x[.., C:], with simd.h's exp8: likewise its own arithmetic.
//   rope(x [T, H, D], cos [T, D], sin [T, D]) -> [T, H, D]: round(x * cos) + round(rotate_half(x) * sin),
//       rotate_half(x) = (-x[D/2:], x[:D/2]): bit for bit rope.py's torch expression (a negation is exact).
//
// Batch invariance by construction: each row's (token's) result is a function of that row alone, the
// same instructions in any call; threads split rows only.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace {

constexpr int64_t LANES = 8;

// Rounds 8 floats to the activation dtype and back (the identity for float32).
inline __m256 round8(__m256 v, const float*) { return v; }
inline __m256 round8(__m256 v, const c10::BFloat16*) {
  alignas(32) float lanes[LANES];
  _mm256_store_ps(lanes, v);
  for (float& lane : lanes) lane = static_cast<float>(c10::BFloat16(lane));
  return _mm256_load_ps(lanes);
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {  // v already holds bf16 values: the truncation is exact
  alignas(32) float lanes[LANES];
  _mm256_store_ps(lanes, v);
  for (int i = 0; i < LANES; ++i) p[i] = c10::BFloat16(lanes[i]);
}

// Rows split among threads in units of at least ~16K elements.
template <typename F>
void for_rows(int64_t rows, int64_t width, const F& f) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* y, int64_t rows, int64_t d, float eps) {
  for_rows(rows, d, [&](int64_t r) {
    const T* xr = x + r * d;
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += LANES) {
      const __m256 v = load8(xr + i);
      ss = _mm256_add_ps(ss, _mm256_mul_ps(v, v));
    }
    const float scale = 1.0f / std::sqrt(sum_lanes(ss) / static_cast<float>(d) + eps);
    const __m256 s = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < d; i += LANES)
      store8(y + r * d + i, round8(_mm256_mul_ps(load8(weight + i), round8(_mm256_mul_ps(load8(xr + i), s), xr)), xr));
  });
}

template <typename T>
void silu_mul_rows(const T* x, T* y, int64_t pieces, int64_t c) {
  for_rows(pieces, 2 * c, [&](int64_t p) {
    const T *gate = x + p * 2 * c, *up = gate + c;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < c; i += LANES) {
      const __m256 g = load8(gate + i);
      const __m256 silu = round8(_mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign)))), gate);
      store8(y + p * c + i, round8(_mm256_mul_ps(silu, load8(up + i)), gate));
    }
  });
}

template <typename T>
void rope_rows(const T* x, const T* cos, const T* sin, T* y, int64_t tokens, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for_rows(tokens * heads, d, [&](int64_t row) {
    const T *xr = x + row * d, *c = cos + (row / heads) * d, *s = sin + (row / heads) * d;
    for (int64_t i = 0; i < d; i += LANES) {
      const __m256 other = load8(xr + (i < half ? i + half : i - half));
      const __m256 rotated = i < half ? _mm256_xor_ps(other, sign) : other;
      const __m256 a = round8(_mm256_mul_ps(load8(xr + i), load8(c + i)), xr);
      const __m256 b = round8(_mm256_mul_ps(rotated, load8(s + i)), xr);
      store8(y + row * d + i, round8(_mm256_add_ps(a, b), xr));
    }
  });
}

void check(const at::Tensor& t, const at::Tensor& like, int64_t width, const char* what) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type() && t.is_contiguous(), what, ": tensors of one dtype, contiguous");
  TORCH_CHECK(width % LANES == 0, what, ": widths a multiple of 8");
}

template <typename F>
void dispatch(const at::Tensor& x, const F& f) {
  if (x.scalar_type() == at::kFloat) return f(static_cast<float*>(nullptr));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "row ops: float32 or bfloat16 activations");
  f(static_cast<c10::BFloat16*>(nullptr));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: x [R, D], weight [D]");
  check(x, x, x.size(1), "rms_norm");
  check(weight, x, x.size(1), "rms_norm");
  at::Tensor y = at::empty_like(x);
  dispatch(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    rms_norm_rows(x.const_data_ptr<T>(), weight.const_data_ptr<T>(), y.data_ptr<T>(), x.size(0), x.size(1),
                  static_cast<float>(eps));
  });
  return y;
}

at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "silu_mul: x [R, G, 2C]");
  check(x, x, x.size(2) / 2, "silu_mul");
  at::Tensor y = at::empty({x.size(0), x.size(1) * x.size(2) / 2}, x.options());
  dispatch(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    silu_mul_rows(x.const_data_ptr<T>(), y.data_ptr<T>(), x.size(0) * x.size(1), x.size(2) / 2);
  });
  return y;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && cos.numel() == x.size(0) * x.size(2) && sin.numel() == cos.numel(),
              "rope: x [T, H, D], cos and sin [T, D]");
  check(x, x, x.size(2) / 2, "rope");
  check(cos, x, x.size(2), "rope");
  check(sin, x, x.size(2), "rope");
  at::Tensor y = at::empty_like(x);
  dispatch(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    rope_rows(x.const_data_ptr<T>(), cos.const_data_ptr<T>(), sin.const_data_ptr<T>(), y.data_ptr<T>(), x.size(0),
              x.size(1), x.size(2));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(HICACHE_QGEMM_LIBRARY, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("silu_mul(Tensor x) -> Tensor", &silu_mul);
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &rope);
}
