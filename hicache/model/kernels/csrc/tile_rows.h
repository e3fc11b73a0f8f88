// A key tile met by many query rows at once (attention.cpp's units of several rows): the tile's keys
// transposed once, then the scores of 4 (row, head)s by 16 keys a pass, a key in each lane. Each score is
// the arithmetic of attention.cpp's `scores_of`, the same bits: lane l of a key's 8 partial sums is
// q[l] k[l], then + q[8c + l] k[8c + l] by one FMA each in increasing c; the 8 partials are added by the
// tree ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)) and the sum multiplied by the scale. Here the
// 8 partials of 8 keys are 8 vectors, so the tree is 7 vertical adds instead of `sum8`'s horizontal ones,
// and the keys loaded are shared by the 4 rows instead of re-read by each.
// Compiled with -ffp-contract=off (native.py): every multiply and add is the one written.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t SCORE_ROWS = 4;  // (row, head)s a pass of `block_scores` (4 x 2 accumulators)
constexpr int64_t SCORE_KEYS = 16;  // keys a pass: two vectors

// 8 vectors, rows of an 8 x 8 matrix, replaced by its columns (moves only).
inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// kT[dim * stride + j] = k_j[dim] (widened to float32) for the tile's `keys` keys (kt[j]: key j's row of one KV
// head, in place), 0 for keys <= j < a multiple of SCORE_KEYS: those scores are computed and never used.
template <typename T>
inline void transpose_keys(const T* const* kt, int64_t keys, int64_t d, int64_t stride, float* kT) {
  const int64_t padded = (keys + SCORE_KEYS - 1) / SCORE_KEYS * SCORE_KEYS;
  for (int64_t j0 = 0; j0 < padded; j0 += 8)
    for (int64_t c = 0; c < d; c += 8) {
      __m256 r[8];
      for (int64_t j = 0; j < 8; ++j) r[j] = j0 + j < keys ? load8(kt[j0 + j] + c) : _mm256_setzero_ps();
      transpose8(r);
      for (int64_t l = 0; l < 8; ++l) _mm256_storeu_ps(kT + (c + l) * stride + j0, r[l]);
    }
}

// score[i][j] for keys j0 .. j0 + 16 of R (row, head)s of one KV head: q[i] their float32 queries [d], kT the
// transposed keys (`transpose_keys`, its row stride `stride`), the file's header's arithmetic.
template <int R>
inline void block_scores(const float* const* q, const float* kT, int64_t stride, int64_t d, int64_t j0, float scale,
                         float* const* score) {
  __m256 part[8][R][2];  // lane l's partial sums of the 16 keys, per l
  for (int64_t l = 0; l < 8; ++l) {
    const float* k = kT + l * stride + j0;
    __m256 k0 = _mm256_loadu_ps(k), k1 = _mm256_loadu_ps(k + 8), acc[R][2];
    for (int i = 0; i < R; ++i) {
      const __m256 qb = _mm256_broadcast_ss(q[i] + l);
      acc[i][0] = _mm256_mul_ps(qb, k0), acc[i][1] = _mm256_mul_ps(qb, k1);
    }
    for (int64_t c = 8; c < d; c += 8) {
      k = kT + (c + l) * stride + j0;
      k0 = _mm256_loadu_ps(k), k1 = _mm256_loadu_ps(k + 8);
      for (int i = 0; i < R; ++i) {
        const __m256 qb = _mm256_broadcast_ss(q[i] + c + l);
        acc[i][0] = _mm256_fmadd_ps(qb, k0, acc[i][0]), acc[i][1] = _mm256_fmadd_ps(qb, k1, acc[i][1]);
      }
    }
    for (int i = 0; i < R; ++i) part[l][i][0] = acc[i][0], part[l][i][1] = acc[i][1];
  }
  const __m256 scale_v = _mm256_set1_ps(scale);
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < 2; ++h) {
      const __m256 low = _mm256_add_ps(_mm256_add_ps(part[0][i][h], part[1][i][h]),
                                       _mm256_add_ps(part[2][i][h], part[3][i][h]));
      const __m256 high = _mm256_add_ps(_mm256_add_ps(part[4][i][h], part[5][i][h]),
                                        _mm256_add_ps(part[6][i][h], part[7][i][h]));
      _mm256_storeu_ps(score[i] + j0 + 8 * h, _mm256_mul_ps(_mm256_add_ps(low, high), scale_v));
    }
}

// The buffers of one unit's tiles: the keys transposed [d, tile], every (row, head)'s scores [rows, tile] and
// the values copied [tile, dv] (contiguous: a pool's rows of one head, 1.5 KB apart in a GQA pool, fall into
// a quarter of the L1 cache's sets; each is read by every row of the unit).
class RowTile {
 public:
  RowTile(int64_t rows, int64_t d, int64_t dv, int64_t tile)
      : rows_(rows), d_(d), dv_(dv), tile_(tile), buffer_(rows ? (d + rows + dv) * tile / 8 : 0),
        value_rows_(rows ? tile : 0) {}

  // The tile's `keys` keys and values (kt[j], vt[j]: key j's rows of this unit's KV head, in place).
  template <typename T>
  void load(const T* const* kt, const T* const* vt, int64_t keys) {
    transpose_keys(kt, keys, d_, tile_, transposed());
    float* values = transposed() + (d_ + rows_) * tile_;
    for (int64_t j = 0; j < keys; ++j) {
      for (int64_t c = 0; c < dv_; c += 8) _mm256_store_ps(values + j * dv_ + c, load8(vt[j] + c));
      value_rows_[j] = values + j * dv_;
    }
  }

  // Scores of (row, head)s first .. first + count (count <= SCORE_ROWS; q: theirs, [count, d]) against the
  // tile's keys 0 .. widest (and the rest of their last pass).
  void score(const float* q, int64_t first, int64_t count, int64_t widest, float scale) {
    const float* rows_q[SCORE_ROWS];
    float* rows_score[SCORE_ROWS];
    for (int64_t i = 0; i < count; ++i) rows_q[i] = q + i * d_, rows_score[i] = scores(first + i);
    for (int64_t j0 = 0; j0 < widest; j0 += SCORE_KEYS) switch (count) {
        case 4: block_scores<4>(rows_q, transposed(), tile_, d_, j0, scale, rows_score); break;
        case 3: block_scores<3>(rows_q, transposed(), tile_, d_, j0, scale, rows_score); break;
        case 2: block_scores<2>(rows_q, transposed(), tile_, d_, j0, scale, rows_score); break;
        default: block_scores<1>(rows_q, transposed(), tile_, d_, j0, scale, rows_score);
      }
  }

  float* scores(int64_t r) { return transposed() + (d_ + r) * tile_; }  // 32-byte aligned
  const float* const* values() const { return value_rows_.data(); }

 private:
  float* transposed() { return reinterpret_cast<float*>(buffer_.data()); }

  int64_t rows_, d_, dv_, tile_;
  std::vector<__m256> buffer_;  // kT [d, tile], scores [rows, tile], values [tile, dv]
  std::vector<const float*> value_rows_;
};

}  // namespace
