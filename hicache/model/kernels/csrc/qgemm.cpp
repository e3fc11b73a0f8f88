// Weight-only quantized GEMMs y = x @ W.T for CPUs with AVX2 + FMA (hicache/model/kernels/native.py
// builds this file; ops.py's NativeInt8Backend / NativeInt4Backend call it).
//
// Weights (hicache/model/kernels/quant.py's two kernel formats), in panels of 8 output rows so that a
// pass over a panel reads one contiguous stream (native.py lays them out):
//   int8: codes [N/8, K/32, 8, 32] int8 (panel, group, row, input), scale [N] float32: w = code * scale
//   int4: codes [N/8, K/32, 8, 16] uint8, byte j of a row's group holding inputs 32g+j (low nibble)
//         and 32g+16+j (high nibble) (GGUF Q4_1's order); scale and offset [N/8, K/32, 8] float32:
//         w = code * scale + offset
// Activations x [M, K] float32 (bf16 is widened exactly before and the result rounded after).
//
// Batch invariance by construction: every output y[m, n] is one dot product over K computed by the
// same sequence of instructions whatever the call: input k goes to SIMD lane k mod 8 of one
// accumulator, the lane accumulates with one FMA per 8 inputs in increasing k, each weight is first
// dequantized exactly as QuantizedWeight.dequantize() does (a multiply, then an add: no contraction,
// the file is compiled with -ffp-contract=off), and the 8 lanes are summed by one fixed tree at the
// end. The register blocking (how many rows and outputs share a pass over K) only decides which
// accumulators are live together, never an accumulator's arithmetic; threads split the outputs N
// only, so no reduction is ever split. Hence a row's bits do not depend on M, on its position in the
// call, on the other rows, or on the thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t LANES = 8;
constexpr int64_t GROUP = 32;  // int4 group, and the unit of every loop over K
constexpr int64_t PANEL = 8;   // output rows stored together; threads split whole panels
constexpr int64_t X_BLOCK_BYTES = 128 * 1024;  // activation rows kept in L2 while the weights stream by

inline float sum_lanes(__m256 v) {
  // One fixed tree: (lane i + lane i+4), then pairs, then the last two.
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

// A format's weights: `load(p, g, r, part)` = the dequantized weights of panel p's row r, inputs
// 32g + 8 part .. 32g + 8 part + 7, computed exactly as QuantizedWeight.dequantize() computes them;
// `load_group(p, g, r, w)` the four parts of group g at once, each by the same instructions as `load`
// (the codes read once: a one-row call is bound by these instructions, not by its bytes).
struct Int8Weights {
  const int8_t* codes;
  const float* scale;
  int64_t groups;
  inline __m256 load(int64_t p, int64_t g, int64_t r, int part) const {
    const int8_t* at = codes + ((p * groups + g) * PANEL + r) * GROUP + part * LANES;
    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at))));
    return _mm256_mul_ps(v, _mm256_broadcast_ss(scale + p * PANEL + r));
  }
  inline void load_group(int64_t p, int64_t g, int64_t r, __m256* w) const {
    const int8_t* at = codes + ((p * groups + g) * PANEL + r) * GROUP;
    const __m256i all = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
    const __m128i low = _mm256_castsi256_si128(all), high = _mm256_extracti128_si256(all, 1);
    const __m128i quarters[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    const __m256 s = _mm256_broadcast_ss(scale + p * PANEL + r);
    for (int part = 0; part < 4; ++part)
      w[part] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(quarters[part])), s);
  }
};

struct Int4Weights {
  const uint8_t* codes;
  const float* scale;
  const float* offset;
  int64_t groups;
  inline __m256 load(int64_t p, int64_t g, int64_t r, int part) const {
    const int64_t row = (p * groups + g) * PANEL + r;
    const uint8_t* at = codes + row * (GROUP / 2) + (part & 1) * LANES;
    __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)));
    __m256i code = part < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0xF)) : _mm256_srli_epi32(bytes, 4);
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(code), _mm256_broadcast_ss(scale + row));
    return _mm256_add_ps(v, _mm256_broadcast_ss(offset + row));
  }
  inline void load_group(int64_t p, int64_t g, int64_t r, __m256* w) const {
    const int64_t row = (p * groups + g) * PANEL + r;
    const __m128i all = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + row * (GROUP / 2)));
    const __m256i first = _mm256_cvtepu8_epi32(all), second = _mm256_cvtepu8_epi32(_mm_srli_si128(all, 8));
    const __m256i mask = _mm256_set1_epi32(0xF);
    const __m256i code[4] = {_mm256_and_si256(first, mask), _mm256_and_si256(second, mask), _mm256_srli_epi32(first, 4),
                             _mm256_srli_epi32(second, 4)};
    const __m256 s = _mm256_broadcast_ss(scale + row), o = _mm256_broadcast_ss(offset + row);
    for (int part = 0; part < 4; ++part) w[part] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(code[part]), s), o);
  }
};

// One panel's weights dequantized once into floats [8, K], for calls with several rows to share.
struct DequantizedPanel {
  const float* values;
  int64_t k;
  inline __m256 load(int64_t, int64_t g, int64_t r, int part) const {
    return _mm256_loadu_ps(values + r * k + g * GROUP + part * LANES);
  }
};

template <typename W>
void dequantize_panel(const W& w, int64_t p, int64_t k, float* out) {
  for (int64_t r = 0; r < PANEL; ++r)
    for (int64_t g = 0; g < k / GROUP; ++g)
      for (int part = 0; part < 4; ++part) _mm256_storeu_ps(out + r * k + g * GROUP + part * LANES, w.load(p, g, r, part));
}

// The register block: ROWS rows of x (from m0) times COLS rows of panel p (from r0), over all of K.
template <int ROWS, int COLS, typename W>
inline void block(const W& w, const float* x, float* y, int64_t m0, int64_t p, int64_t r0, int64_t k, int64_t n) {
  __m256 acc[ROWS][COLS];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < k / GROUP; ++g) {
    for (int part = 0; part < 4; ++part) {
      __m256 xs[ROWS];
      for (int i = 0; i < ROWS; ++i) xs[i] = _mm256_loadu_ps(x + (m0 + i) * k + g * GROUP + part * LANES);
      for (int j = 0; j < COLS; ++j) {
        const __m256 wv = w.load(p, g, r0 + j, part);
        for (int i = 0; i < ROWS; ++i) acc[i][j] = _mm256_fmadd_ps(xs[i], wv, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) y[(m0 + i) * n + p * PANEL + r0 + j] = sum_lanes(acc[i][j]);
}

// One row times the 8 outputs of panel p straight from the codes (each weight is used once): a group's
// four parts dequantized together, then each output's four FMAs in increasing k, as `block` orders them.
template <typename W>
inline void one_row(const W& w, const float* x, float* y, int64_t p, int64_t k) {
  __m256 acc[PANEL];
  for (int r = 0; r < PANEL; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < k / GROUP; ++g) {
    __m256 xs[4];
    for (int part = 0; part < 4; ++part) xs[part] = _mm256_loadu_ps(x + g * GROUP + part * LANES);
    for (int r = 0; r < PANEL; ++r) {
      __m256 wv[4];
      w.load_group(p, g, r, wv);
      for (int part = 0; part < 4; ++part) acc[r] = _mm256_fmadd_ps(xs[part], wv[part], acc[r]);
    }
  }
  for (int r = 0; r < PANEL; ++r) y[p * PANEL + r] = sum_lanes(acc[r]);
}

// Rows [m0, m1) times the 8 outputs of panel p: blocks of 4 rows, then the rest.
template <typename W>
void rows_times_panel(const W& w, const float* x, float* y, int64_t m0, int64_t m1, int64_t p, int64_t k, int64_t n) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4)
    for (int64_t r = 0; r < PANEL; r += 2) block<4, 2>(w, x, y, m, p, r, k, n);
  switch (m1 - m) {
    case 3:
      for (int64_t r = 0; r < PANEL; r += 2) block<3, 2>(w, x, y, m, p, r, k, n);
      break;
    case 2:
      for (int64_t r = 0; r < PANEL; r += 4) block<2, 4>(w, x, y, m, p, r, k, n);
      break;
    case 1:
      block<1, 8>(w, x, y, m, p, 0, k, n);
      break;
  }
}

template <typename W>
at::Tensor run(const W& w, const at::Tensor& x_in, int64_t n, int64_t k, int64_t panel_bytes) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "qgemm: x must be [M, ", k, "]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y.to(x_in.scalar_type());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Blocking and thread split: caches and cores only, never arithmetic (see the file's header).
  const int64_t m_block = std::max<int64_t>(4, X_BLOCK_BYTES / (k * 4) / 4 * 4);
  // A thread takes at least ~64 KB of weights: below that, waking a second one costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, 65536 / panel_bytes);
  at::parallel_for(0, n / PANEL, grain, [&](int64_t p0, int64_t p1) {
    if (m == 1) {  // one row: each weight is used once, straight from its codes
      for (int64_t p = p0; p < p1; ++p) one_row(w, xp, yp, p, k);
      return;
    }
    std::vector<float> panel(PANEL * k);
    const DequantizedPanel dequantized{panel.data(), k};
    for (int64_t mb = 0; mb < m; mb += m_block)
      for (int64_t p = p0; p < p1; ++p) {
        dequantize_panel(w, p, k, panel.data());
        rows_times_panel(dequantized, xp, yp, mb, std::min(m, mb + m_block), p, k, n);
      }
  });
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == PANEL && codes.size(3) == GROUP &&
                  codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "int8 codes [N/8, K/32, 8, 32] int8");
  const int64_t n = codes.size(0) * PANEL, groups = codes.size(1), k = groups * GROUP;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n, "int8 scale [N] float32");
  const Int8Weights w{codes.data_ptr<int8_t>(), scale.data_ptr<float>(), groups};
  return run(w, x, n, k, PANEL * (k + 4));
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& offset) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == PANEL && codes.size(3) == GROUP / 2 &&
                  codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "int4 codes [N/8, K/32, 8, 16] uint8");
  const int64_t n = codes.size(0) * PANEL, groups = codes.size(1), k = groups * GROUP;
  for (const at::Tensor* t : {&scale, &offset})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n * groups,
                "int4 scale and offset [N/8, K/32, 8] float32");
  const Int4Weights w{codes.data_ptr<uint8_t>(), scale.data_ptr<float>(), offset.data_ptr<float>(), groups};
  return run(w, x, n, k, PANEL * (k / 2 + groups * 8));
}

}  // namespace

// The library name carries the kernel's version (native.py's VERSION): two builds never collide.
TORCH_LIBRARY(HICACHE_QGEMM_LIBRARY, m) {
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scale) -> Tensor", &int8_linear);
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor", &int4_linear);
}
