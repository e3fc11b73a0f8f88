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
//   rope_qkv(columns [T, G, nq + 2 nkv, D], cos, sin, nq, nkv) -> (q [T, G nq, D], kv [T, 2 G nkv D]): the q/k/v
//       projection's heads split as layer_head (csrc/layer.cpp) needs them, q and k rotated as `rope` rotates,
//       v copied, kv packed k's heads then v's (KVLayout.mha's row): the slices, copies and concatenation
//       of LlamaModel._qkv and the pack in one pass, the same values.
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
#include <cstring>
#include <tuple>

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

// One head's rotation (the file's header): y = round(x cos) + round(rotate_half(x) sin), d inputs.
template <typename T>
inline void rope_row(const T* x, const T* c, const T* s, T* y, int64_t d) {
  const int64_t half = d / 2;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < d; i += LANES) {
    const __m256 other = load8(x + (i < half ? i + half : i - half));
    const __m256 rotated = i < half ? _mm256_xor_ps(other, sign) : other;
    const __m256 a = round8(_mm256_mul_ps(load8(x + i), load8(c + i)), x);
    const __m256 b = round8(_mm256_mul_ps(rotated, load8(s + i)), x);
    store8(y + i, round8(_mm256_add_ps(a, b), x));
  }
}

template <typename T>
void rope_rows(const T* x, const T* cos, const T* sin, T* y, int64_t tokens, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for_rows(tokens * heads, d, [&](int64_t row) {
    rope_row(x + row * d, cos + (row / heads) * d, sin + (row / heads) * d, y + row * d, d);
  });
}

template <typename T>
void rope_qkv_rows(const T* columns, const T* cos, const T* sin, T* q, T* kv, int64_t tokens, int64_t groups,
                   int64_t nq, int64_t nkv, int64_t d) {
  const int64_t per_group = (nq + 2 * nkv) * d, kv_width = 2 * groups * nkv * d;
  for_rows(tokens, groups * per_group, [&](int64_t t) {
    const T *c = cos + t * d, *s = sin + t * d;
    for (int64_t g = 0; g < groups; ++g) {
      const T* heads = columns + (t * groups + g) * per_group;
      for (int64_t h = 0; h < nq; ++h) rope_row(heads + h * d, c, s, q + ((t * groups + g) * nq + h) * d, d);
      T* k = kv + t * kv_width + g * nkv * d;
      for (int64_t h = 0; h < nkv; ++h) rope_row(heads + (nq + h) * d, c, s, k + h * d, d);
      std::memcpy(k + groups * nkv * d, heads + (nq + nkv) * d, nkv * d * sizeof(T));
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

std::tuple<at::Tensor, at::Tensor> rope_qkv(const at::Tensor& columns, const at::Tensor& cos, const at::Tensor& sin,
                                            int64_t nq, int64_t nkv) {
  TORCH_CHECK(columns.dim() == 4 && columns.size(2) == nq + 2 * nkv && nq > 0 && nkv > 0,
              "rope_qkv: columns [T, G, nq + 2 nkv, D]");
  const int64_t tokens = columns.size(0), groups = columns.size(1), d = columns.size(3);
  TORCH_CHECK(cos.numel() == tokens * d && sin.numel() == cos.numel(), "rope_qkv: cos and sin [T, D]");
  check(columns, columns, d / 2, "rope_qkv");
  check(cos, columns, d, "rope_qkv");
  check(sin, columns, d, "rope_qkv");
  at::Tensor q = at::empty({tokens, groups * nq, d}, columns.options());
  at::Tensor kv = at::empty({tokens, 2 * groups * nkv * d}, columns.options());
  dispatch(columns, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    rope_qkv_rows(columns.const_data_ptr<T>(), cos.const_data_ptr<T>(), sin.const_data_ptr<T>(), q.data_ptr<T>(),
                  kv.data_ptr<T>(), tokens, groups, nq, nkv, d);
  });
  return {q, kv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(HICACHE_QGEMM_LIBRARY, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("silu_mul(Tensor x) -> Tensor", &silu_mul);
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &rope);
  m.def("rope_qkv(Tensor columns, Tensor cos, Tensor sin, int nq, int nkv) -> (Tensor, Tensor)", &rope_qkv);
}
