// Weight-only quantized GEMMs y = x @ W.T for CPUs with AVX2 + FMA (hicache/model/kernels/native.py
// builds this file; ops.py's NativeInt8Backend / NativeInt4Backend call it). Integer arithmetic, as
// llama.cpp's CPU kernels: each row of x is quantized in groups of 32 inputs, a group's products are
// integer dot products (exact), scaled to float once per group.
//
// Weights (hicache/model/kernels/quant.py's two kernel formats), in panels of 8 output rows. Within a
// panel's group of 32 inputs the codes are in "steps" of 4 inputs: step s holds 32 bytes, byte b the code
// of output row b / 4 for input 32g + 4s + b % 4, so that one broadcast of 4 activation bytes meets the
// panel's 8 outputs in one instruction, the 8 outputs in the 8 lanes of one accumulator:
//   int8: codes [N/8, K/32, 8 steps, 32] int8, scale [N] float32: w = code * scale
//   int4: codes [N/8, K/32, 4, 32] uint8, byte b of chunk t holding step 2t's code in its low nibble and
//         step 2t + 1's in its high; scale and offset [N/8, K/32, 8] float32: w = code * scale + offset;
//         or float16 where every one is a float16 (a GGUF Q4_1's are): widened exactly as they are loaded,
//         the same arithmetic at 5/6 of the bytes a weight (one-row calls stream their weights)
// Activations x [M, K] float32 (bf16 is widened exactly before and the result rounded after).
//
// Activation quantization (`quantize_rows`; bitwise native.quantize_activations in Python): per row and
// group of 32 inputs a scale e = max|x| / 32385 and 16-bit codes Q = round(x * (1 / e)) in [-32385, 32385]
// (1 / e = 0 where e is below the smallest normal float), rounded half to even, so x = e Q to 2^-16 of the
// group's largest input (llama.cpp's Q8_1 codes keep 2^-8); Q is kept whole as int16 (int8 weights) or as
// two int8 halves Q = 255 h + l, h = round(Q / 255) and l in [-127, 127] (int4 weights: maddubs multiplies
// bytes); and s = e * sum(Q).
//
// Arithmetic of one output n of row m, group by group in increasing g (two explicit FMAs a group), with
// dot = sum_i c_i Q_i over the group in int32 (exact: int4 as the halves' integer dot products, the high
// one times 255 in the multiply-add; int8 as the int16 Q times the codes widened to int16, vpmaddwd) and
// float(dot) its conversion (exact for int4, below 2^24):
//   int4: acc = fma(float(dot), scale[n,g] * e[g], acc); acc = fma(offset[n,g], s[g], acc); y = acc
//   int8: acc = fma(float(dot), e[g], acc); y = acc * scale[n]
// The integer sums are exact (int4's 16-bit partial sums are at most 16 * 15 * 127 < 2^15), so the order
// in which the instructions add them does not matter; the float steps are one fixed sequence per output.
//
// On CPUs with AVX-512 VNNI (`vnni()`) int4 takes two panels a pass on 512-bit registers (`pass_pair`: a
// broadcast meets 16 outputs, and vpdpbusd multiplies and adds a lane's 4 bytes into an int32 in one
// instruction where AVX2 takes two): the same exact integers and the same float steps per output, hence
// the same bits as the AVX2 pass, which a thread's odd last panel still takes (tests/model/
// test_native_kernels.py compares the two). int8 keeps its AVX2 pass: at one row it reads weights at the
// memory's rate either way.
//
// Batch invariance by construction: a row's quantization depends on that row alone, each output's float
// steps are the same whatever the call (the register blocking only decides which rows share a pass over a
// panel), and threads split the outputs N only (and the rows' quantization by row). Hence a row's bits
// do not depend on M, on its position in the call, on the other rows, or on the thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t GROUP = 32;  // inputs per activation scale and per int4 weight scale
constexpr int64_t STEPS = GROUP / 4;  // 4-input steps a group
constexpr int64_t PANEL = 8;   // output rows stored together; threads split whole panels
constexpr int32_t HIGH_WEIGHT = 255;  // an activation code Q = 255 h + l, h and l int8 in [-127, 127]
constexpr int32_t CODE_MAX = 127 * HIGH_WEIGHT;
constexpr int64_t ROWS = 4;    // rows of x that share one pass over a panel
// Quantized rows (2 bytes an input) kept in L2 while the weights stream by.
constexpr int64_t X_BLOCK_BYTES = 128 * 1024;

// Which form of the codes Q a weight format reads: int4's byte multiply-adds the two int8 halves, int8's
// word multiply-adds Q whole. A call quantizes x in its format's form only.
enum class Codes { halves, whole };

// Rows of x quantized (the file's header): codes [2, M, K] int8 (high, then low) or [M, K] int16 (Q whole),
// and scales [2, M, K/32] float32 (e, then s), with pointers to each part (null: the form not made).
struct QuantizedRows {
  at::Tensor codes, scales;
  int8_t *high = nullptr, *low = nullptr;
  int16_t* whole = nullptr;
  float *e, *s;
  int64_t m, k, groups;  // rows, inputs, groups a row
};

// One group's codes: Q whole where `whole` is given, else its halves.
void quantize_group(const float* x, int8_t* high, int8_t* low, int16_t* whole, float* e_out, float* s_out) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  const float e = _mm_cvtss_f32(m) / static_cast<float>(CODE_MAX);
  const __m256 inverse = _mm256_set1_ps(e >= FLT_MIN ? 1.0f / e : 0.0f), base = _mm256_set1_ps(HIGH_WEIGHT);
  const __m256i top = _mm256_set1_epi32(CODE_MAX), bottom = _mm256_set1_epi32(-CODE_MAX);
  __m256i sum = _mm256_setzero_si256();
  alignas(32) int32_t lanes[2][8];
  for (int i = 0; i < 4; ++i) {
    // cvtps rounds half to even (the default rounding mode). Q / 255 is never within float rounding of a
    // half-integer, so |Q - 255 h| <= 127.
    const __m256i q = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse)), top), bottom);
    sum = _mm256_add_epi32(sum, q);
    if (whole) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[0]), q);
      for (int j = 0; j < 8; ++j) whole[8 * i + j] = static_cast<int16_t>(lanes[0][j]);
      continue;
    }
    const __m256i h = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_cvtepi32_ps(q), base));
    const __m256i l = _mm256_sub_epi32(q, _mm256_mullo_epi32(h, _mm256_set1_epi32(HIGH_WEIGHT)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[0]), h);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[1]), l);
    for (int j = 0; j < 8; ++j) {
      high[8 * i + j] = static_cast<int8_t>(lanes[0][j]);
      low[8 * i + j] = static_cast<int8_t>(lanes[1][j]);
    }
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[0]), sum);
  int32_t total = 0;
  for (int j = 0; j < 8; ++j) total += lanes[0][j];
  *e_out = e;
  *s_out = e * static_cast<float>(total);
}

QuantizedRows quantize_rows(const at::Tensor& x, Codes form) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / GROUP;
  QuantizedRows rows{form == Codes::whole ? at::empty({m, k}, x.options().dtype(at::kShort))
                                          : at::empty({2, m, k}, x.options().dtype(at::kChar)),
                     at::empty({2, m, groups}, x.options())};
  if (form == Codes::whole) rows.whole = rows.codes.data_ptr<int16_t>();
  else rows.high = rows.codes.data_ptr<int8_t>(), rows.low = rows.high + m * k;
  rows.e = rows.scales.data_ptr<float>(), rows.s = rows.e + m * groups;
  rows.m = m, rows.k = k, rows.groups = groups;
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / k), [&](int64_t m0, int64_t m1) {
    for (int64_t i = m0; i < m1; ++i)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = i * k + g * GROUP, scale_at = i * groups + g;
        float *e = rows.e + scale_at, *s = rows.s + scale_at;
        if (rows.whole) quantize_group(xp + at, nullptr, nullptr, rows.whole + at, e, s);
        else quantize_group(xp + at, rows.high + at, rows.low + at, nullptr, e, s);
      }
  });
  return rows;
}

// Functions compiled for AVX-512 VNNI (called only where `vnni()` holds).
#define VNNI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

// Whether this process runs the VNNI passes: the CPU has them, and ATEN_CPU_CAPABILITY (which forces
// torch's own kernels down to an ISA) does not ask for AVX2 or less, so one variable forces every path.
bool vnni() {
  static const bool chosen = [] {
    const char* forced = std::getenv("ATEN_CPU_CAPABILITY");
    if (forced && (std::strcmp(forced, "avx2") == 0 || std::strcmp(forced, "default") == 0)) return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }();
  return chosen;
}

// An empty asm that takes and gives back a register: the compiler keeps a pass's integer sums in the order
// written instead of reassociating them into a tree whose partial products spill to the stack (gcc 12, 4
// rows: an int4 pass 1.3x, an int8 one 1.2x the time without it, BENCHMARKS 42). Integer sums are exact,
// so either order has the same bits; this is speed only.
inline void keep_in_order(__m256i& accumulator) { __asm__("" : "+x"(accumulator)); }

inline __m256i broadcast_step(const int8_t* q) {
  int32_t four;
  std::memcpy(&four, q, 4);
  return _mm256_set1_epi32(four);
}

VNNI_TARGET inline __m512i broadcast_step16(const int8_t* q) {
  int32_t four;
  std::memcpy(&four, q, 4);
  return _mm512_set1_epi32(four);
}

VNNI_TARGET inline __m512 both_panels(__m256 first, __m256 second) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(first)), _mm256_castps_pd(second), 1));
}

// R rows of quantized x, from group 0, and where their 8 outputs of a panel go.
template <int R>
struct Rows {
  const int8_t *high[R], *low[R];
  const int16_t* whole[R];
  const float *e[R], *s[R];
  float* y[R];
};

// A group's 8 int4 scales (or offsets) of a panel as float32: stored so, or float16 widened (exact).
inline __m256 load_scales(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_scales(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A format's panel pass: R rows times the 8 outputs of panel p over all groups, each output's arithmetic as
// in the file's header (the high codes' partial sums times 255 in the integer multiply-add).
template <typename Scale, bool Vnni>
struct Int4Weights {
  static constexpr Codes codes_form = Codes::halves;
  static constexpr bool pairs = Vnni;  // two panels a pass on 512-bit registers (`pass_pair`)
  const uint8_t* codes;
  const Scale* scale;
  const Scale* offset;
  int64_t groups, n;
  int64_t k() const { return groups * GROUP; }
  int64_t panel_bytes() const { return PANEL * (k() / 2 + groups * 2 * static_cast<int64_t>(sizeof(Scale))); }
  template <int R>
  inline void pass(int64_t p, const Rows<R>& x) const {
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i high_weight = _mm256_set1_epi16(HIGH_WEIGHT);
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = p * groups + g;
      const uint8_t* c = codes + at * (GROUP / 2) * PANEL;
      __m256i high[R], low[R];  // 16-bit partial sums: at most 16 products of 15 * 127 each
      for (int i = 0; i < R; ++i) high[i] = low[i] = _mm256_setzero_si256();
      for (int t = 0; t < STEPS / 2; ++t) {
        const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * t));
        const __m256i first = _mm256_and_si256(both, nibble);
        const __m256i second = _mm256_and_si256(_mm256_srli_epi16(both, 4), nibble);
        for (int i = 0; i < R; ++i) {
          const int64_t k = g * GROUP + 8 * t;
          high[i] = _mm256_add_epi16(high[i], _mm256_maddubs_epi16(first, broadcast_step(x.high[i] + k)));
          high[i] = _mm256_add_epi16(high[i], _mm256_maddubs_epi16(second, broadcast_step(x.high[i] + k + 4)));
          low[i] = _mm256_add_epi16(low[i], _mm256_maddubs_epi16(first, broadcast_step(x.low[i] + k)));
          low[i] = _mm256_add_epi16(low[i], _mm256_maddubs_epi16(second, broadcast_step(x.low[i] + k + 4)));
          keep_in_order(high[i]), keep_in_order(low[i]);
        }
      }
      const __m256 scales = load_scales(scale + at * PANEL), offsets = load_scales(offset + at * PANEL);
      for (int i = 0; i < R; ++i) {
        const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(high[i], high_weight), _mm256_madd_epi16(low[i], ones));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scales, _mm256_set1_ps(x.e[i][g])), acc[i]);
        acc[i] = _mm256_fmadd_ps(offsets, _mm256_set1_ps(x.s[i][g]), acc[i]);
      }
    }
    for (int i = 0; i < R; ++i) _mm256_storeu_ps(x.y[i], acc[i]);
  }
  // Panels p and p + 1 in one pass on 512-bit registers, p's outputs in lanes 0-7 and p + 1's in lanes 8-15:
  // each lane's integer sums and float steps are `pass`'s (the same bits), and one broadcast of 4 activation
  // bytes meets 16 outputs instead of 8.
  template <int R>
  VNNI_TARGET void pass_pair(int64_t p, const Rows<R>& x) const {
    const __m512i nibble = _mm512_set1_epi8(0x0F), high_weight = _mm512_set1_epi32(HIGH_WEIGHT);
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = p * groups + g, next = at + groups;
      const uint8_t *c = codes + at * (GROUP / 2) * PANEL, *c_next = codes + next * (GROUP / 2) * PANEL;
      __m512i high[R], low[R];
      for (int i = 0; i < R; ++i) high[i] = low[i] = _mm512_setzero_si512();
      for (int t = 0; t < STEPS / 2; ++t) {
        const __m512i both = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * t))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c_next + 32 * t)), 1);
        const __m512i first = _mm512_and_si512(both, nibble);
        const __m512i second = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
        for (int i = 0; i < R; ++i) {
          const int64_t k = g * GROUP + 8 * t;
          high[i] = _mm512_dpbusd_epi32(high[i], first, broadcast_step16(x.high[i] + k));
          high[i] = _mm512_dpbusd_epi32(high[i], second, broadcast_step16(x.high[i] + k + 4));
          low[i] = _mm512_dpbusd_epi32(low[i], first, broadcast_step16(x.low[i] + k));
          low[i] = _mm512_dpbusd_epi32(low[i], second, broadcast_step16(x.low[i] + k + 4));
        }
      }
      const __m512 scales = both_panels(load_scales(scale + at * PANEL), load_scales(scale + next * PANEL));
      const __m512 offsets = both_panels(load_scales(offset + at * PANEL), load_scales(offset + next * PANEL));
      for (int i = 0; i < R; ++i) {
        const __m512i sum = _mm512_add_epi32(_mm512_mullo_epi32(high[i], high_weight), low[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scales, _mm512_set1_ps(x.e[i][g])), acc[i]);
        acc[i] = _mm512_fmadd_ps(offsets, _mm512_set1_ps(x.s[i][g]), acc[i]);
      }
    }
    for (int i = 0; i < R; ++i) {
      _mm256_storeu_ps(x.y[i], _mm512_castps512_ps256(acc[i]));
      _mm256_storeu_ps(x.y[i] + PANEL, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1)));
    }
  }
};

struct Int8Weights {
  static constexpr Codes codes_form = Codes::whole;
  static constexpr bool pairs = false;
  const int8_t* codes;
  const float* scale;
  int64_t groups, n;
  int64_t k() const { return groups * GROUP; }
  int64_t panel_bytes() const { return PANEL * (k() + 4); }
  // A step's 32 codes widened to int16 in two halves, outputs 0-3 and 4-7, each output's 4 inputs adjacent:
  // vpmaddwd against the row's 4 Q of the step (repeated) adds a pair of products into each int32 lane, an
  // output's two lanes summed once a group (|dot| <= 32 * 128 * 32385 < 2^31: exact).
  template <int R>
  inline void pass(int64_t p, const Rows<R>& x) const {
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);  // hadd's lanes back to outputs 0-7
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* c = codes + (p * groups + g) * GROUP * PANEL;
      __m256i first[R], second[R];  // outputs 0-3 and 4-7, two lanes an output
      for (int i = 0; i < R; ++i) first[i] = second[i] = _mm256_setzero_si256();
      for (int step = 0; step < STEPS; ++step) {
        const __m128i* w = reinterpret_cast<const __m128i*>(c + 32 * step);
        const __m256i low_half = _mm256_cvtepi8_epi16(_mm_loadu_si128(w));
        const __m256i high_half = _mm256_cvtepi8_epi16(_mm_loadu_si128(w + 1));
        for (int i = 0; i < R; ++i) {
          int64_t four;
          std::memcpy(&four, x.whole[i] + g * GROUP + 4 * step, 8);
          const __m256i q = _mm256_set1_epi64x(four);
          first[i] = _mm256_add_epi32(first[i], _mm256_madd_epi16(low_half, q));
          second[i] = _mm256_add_epi32(second[i], _mm256_madd_epi16(high_half, q));
          keep_in_order(first[i]), keep_in_order(second[i]);
        }
      }
      for (int i = 0; i < R; ++i) {
        const __m256i dot = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(first[i], second[i]), order);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(x.e[i][g]), acc[i]);
      }
    }
    const __m256 scales = _mm256_loadu_ps(scale + p * PANEL);
    for (int i = 0; i < R; ++i) _mm256_storeu_ps(x.y[i], _mm256_mul_ps(acc[i], scales));
  }
};

// Rows m0 .. m0 + R of x, its inputs from `first` on, times panel p of w.
template <int R, typename W>
inline void rows_pass(const W& w, const QuantizedRows& x, int64_t first, float* y, int64_t m0, int64_t p, bool pair) {
  Rows<R> rows;
  for (int i = 0; i < R; ++i) {
    if constexpr (W::codes_form == Codes::whole) {
      rows.whole[i] = x.whole + (m0 + i) * x.k + first;
    } else {
      rows.high[i] = x.high + (m0 + i) * x.k + first;
      rows.low[i] = x.low + (m0 + i) * x.k + first;
    }
    rows.e[i] = x.e + (m0 + i) * x.groups + first / GROUP;
    rows.s[i] = x.s + (m0 + i) * x.groups + first / GROUP;
    rows.y[i] = y + (m0 + i) * w.n + p * PANEL;
  }
  if constexpr (W::pairs) {
    if (pair) return w.template pass_pair<R>(p, rows);
  }
  w.template pass<R>(p, rows);
}

// y [M, w.n] float32 = x[:, first : first + w.k] @ W.T.
template <typename W>
void multiply(const W& w, const QuantizedRows& x, int64_t first, float* y) {
  const int64_t m = x.m;
  // Blocking and thread split: caches and cores only, never arithmetic (see the file's header).
  const int64_t m_block = std::max<int64_t>(ROWS, X_BLOCK_BYTES / (2 * w.k()) / ROWS * ROWS);
  // A thread takes at least ~64 KB of weights: below that, waking a second one costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, 65536 / w.panel_bytes());
  at::parallel_for(0, w.n / PANEL, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t mb = 0; mb < m; mb += m_block) {
      const int64_t m1 = std::min(m, mb + m_block);
      for (int64_t p = p0; p < p1;) {
        const bool pair = W::pairs && p + 1 < p1;  // two panels a pass where the format has such a pass
        int64_t i = mb;
        for (; i + ROWS <= m1; i += ROWS) rows_pass<ROWS>(w, x, first, y, i, p, pair);
        switch (m1 - i) {
          case 3: rows_pass<3>(w, x, first, y, i, p, pair); break;
          case 2: rows_pass<2>(w, x, first, y, i, p, pair); break;
          case 1: rows_pass<1>(w, x, first, y, i, p, pair); break;
        }
        p += pair ? 2 : 1;
      }
    }
  });
}

at::Tensor as_float_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "qgemm: x must be [M, ", k, "]");
  return x.to(at::kFloat).contiguous();
}

// x @ W.T in x's dtype.
template <typename W>
at::Tensor run(const W& w, const at::Tensor& x_in) {
  const at::Tensor x = as_float_rows(x_in, w.k());
  at::Tensor y = at::empty({x.size(0), w.n}, x.options());
  if (x.size(0) > 0) multiply(w, quantize_rows(x, W::codes_form), 0, y.data_ptr<float>());
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

// Row-parallel groups (hicache/model/kernels/tp_groups.py's RowGroups): group g's weights times x's g-th
// slice of inputs, each partial rounded to x's dtype as its own call would return it, then added in
// float32 adjacent pair by adjacent pair, level by level, an odd last one carried up (`pairwise_sum`):
// the bits of the calls one by one and their sum. One quantization of x serves every slice, since a
// slice starts on a 32-input group and a group's codes are its own inputs' alone.
template <typename W>
at::Tensor run_sum(const std::vector<W>& ws, const at::Tensor& x_in) {
  const int64_t width = ws[0].k();
  for (const W& w : ws) TORCH_CHECK(w.k() == width && w.n == ws[0].n, "qgemm: groups of one shape");
  const at::Tensor x = as_float_rows(x_in, width * static_cast<int64_t>(ws.size()));
  const int64_t count = static_cast<int64_t>(ws.size()), size = x.size(0) * ws[0].n;
  at::Tensor partials = at::empty({count, x.size(0), ws[0].n}, x.options());
  if (size == 0) return partials[0];
  const QuantizedRows rows = quantize_rows(x, W::codes_form);
  for (int64_t g = 0; g < count; ++g) multiply(ws[g], rows, g * width, partials.data_ptr<float>() + g * size);
  if (x_in.scalar_type() != at::kFloat) partials = partials.to(x_in.scalar_type()).to(at::kFloat);
  // The pairwise order, each sum written over its left operand (plain float adds, as torch's).
  std::vector<float*> level;
  for (int64_t g = 0; g < count; ++g) level.push_back(partials.data_ptr<float>() + g * size);
  while (level.size() > 1) {
    std::vector<float*> paired;
    for (size_t i = 0; i + 1 < level.size(); i += 2) {
      float *a = level[i], *b = level[i + 1];
      at::parallel_for(0, size, 16384, [&](int64_t j0, int64_t j1) {
        for (int64_t j = j0; j < j1; ++j) a[j] += b[j];
      });
      paired.push_back(a);
    }
    if (level.size() % 2) paired.push_back(level.back());
    level = std::move(paired);
  }
  return partials[0];
}

Int8Weights int8_weights(const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == STEPS && codes.size(3) == 4 * PANEL &&
                  codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "int8 codes [N/8, K/32, 8, 32] int8");
  const int64_t n = codes.size(0) * PANEL;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
              "int8 scale [N] float32");
  return Int8Weights{codes.data_ptr<int8_t>(), scale.data_ptr<float>(), codes.size(1), n};
}

template <typename Scale, bool Vnni>
Int4Weights<Scale, Vnni> int4_weights(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == STEPS / 2 && codes.size(3) == 4 * PANEL &&
                  codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "int4 codes [N/8, K/32, 4, 32] uint8");
  const int64_t n = codes.size(0) * PANEL, groups = codes.size(1);
  for (const at::Tensor* t : {&scale, &offset})
    TORCH_CHECK(t->scalar_type() == c10::CppTypeToScalarType<Scale>::value && t->is_contiguous() &&
                    t->numel() == n * groups,
                "int4 scale and offset [N/8, K/32, 8], both float32 or both float16 (every group's alike)");
  return Int4Weights<Scale, Vnni>{codes.data_ptr<uint8_t>(), scale.data_ptr<Scale>(), offset.data_ptr<Scale>(),
                                  groups, n};
}

// f(std::bool_constant<vnni()>{}): a call's passes picked once, at its entry.
template <typename F>
auto with_isa(F&& f) {
  return vnni() ? f(std::true_type{}) : f(std::false_type{});
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  return run(int8_weights(codes, scale), x);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& offset) {
  return with_isa([&](auto isa) {
    if (scale.scalar_type() == at::kHalf) return run(int4_weights<at::Half, isa()>(codes, scale, offset), x);
    return run(int4_weights<float, isa()>(codes, scale, offset), x);
  });
}

at::Tensor int8_linear_sum(const at::Tensor& x, at::TensorList codes, at::TensorList scale) {
  TORCH_CHECK(!codes.empty() && scale.size() == codes.size(), "int8_linear_sum: one scale per group's codes");
  std::vector<Int8Weights> ws;
  for (size_t g = 0; g < codes.size(); ++g) ws.push_back(int8_weights(codes[g], scale[g]));
  return run_sum(ws, x);
}

at::Tensor int4_linear_sum(const at::Tensor& x, at::TensorList codes, at::TensorList scale, at::TensorList offset) {
  TORCH_CHECK(!codes.empty() && scale.size() == codes.size() && offset.size() == codes.size(),
              "int4_linear_sum: one scale and offset per group's codes");
  return with_isa([&](auto isa) {
    const auto groups = [&](auto scale_type) {
      using Scale = decltype(scale_type);
      std::vector<Int4Weights<Scale, isa()>> ws;
      for (size_t g = 0; g < codes.size(); ++g) ws.push_back(int4_weights<Scale, isa()>(codes[g], scale[g], offset[g]));
      return run_sum(ws, x);
    };
    return scale[0].scalar_type() == at::kHalf ? groups(at::Half{}) : groups(float{});
  });
}

// Which passes this process's calls run: "avx512-vnni" or "avx2" (the start-up line and /health say it).
std::string kernel_isa() { return vnni() ? "avx512-vnni" : "avx2"; }

// The kernels' first stage alone, for tests: (high, low, e, s) of x [M, K] float32 (the file's header).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % GROUP == 0 && x.scalar_type() == at::kFloat,
              "quantize_activations: x must be [M, K] float32 with K a multiple of 32");
  const QuantizedRows rows = quantize_rows(x.contiguous(), Codes::halves);
  return {rows.codes[0], rows.codes[1], rows.scales[0], rows.scales[1]};
}

}  // namespace

// The library name carries the kernel's version (native.py's VERSION): two builds never collide.
TORCH_LIBRARY(HICACHE_QGEMM_LIBRARY, m) {
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scale) -> Tensor", &int8_linear);
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor", &int4_linear);
  m.def("int8_linear_sum(Tensor x, Tensor[] codes, Tensor[] scale) -> Tensor", &int8_linear_sum);
  m.def("int4_linear_sum(Tensor x, Tensor[] codes, Tensor[] scale, Tensor[] offset) -> Tensor", &int4_linear_sum);
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor, Tensor)", &quantize_activations);
  m.def("kernel_isa() -> str", &kernel_isa);
}
