// One key block of attention for CPUs with AVX2 + FMA (hicache/model/kernels/native.py builds this file
// beside qgemm.cpp; native_attention.py calls it for every plan call on a CPU: decode, prefill, verify).
//
//   block_attend(q [E, n, H, d], k [N, Hkv, d], v [N, Hkv, dv], index B x [E, keys] int64, seen [E, n]
//                int64 or empty, rows [E] int64, scale) -> (out [B E, n, H, dv] in q's dtype, lse [B E, n, H]
//                float32)
//
// The call attends each query entry e over each of the B reads' keys index[b][e] (a decode batch's
// consecutive key blocks in one call, without repeating its queries): out entry b E + e. Entry e's first
// rows[e] rows are computed; the rest (a plan's padding) are left unwritten. k and v are q's dtype, or bf16
// under float32 q (a `--kv-cache-dtype bfloat16` pool): widened to float32 as they are loaded, exactly, so
// the result is the float32 kernel's on the widened values.
// Row (e, i) of read b attends with query head h over keys index[b][e, 0 .. seen[e, i]) (all `keys`
// when seen is empty) of k/v's KV head h / (H / Hkv): the softmax-normalized output and the natural
// log-sum-exp of the scaled scores, as aten's flash kernel returns them, for the float32 block combine
// (key_block_attention.py, `combine_blocks` below). `index` names the rows of k and v to read, so a caller
// can pass the pool itself and its slots: the keys are read in place, from the rows themselves (bf16 widened
// in registers): neither a gathered copy nor a tile buffer, whose stores cost more than the loads they saved
// (BENCHMARKS 38), and no software prefetch (the hardware's streams did better on this machine). A unit of
// several rows of one KV head (a prefill) is the exception: each tile's keys are transposed and its values
// copied once for all its rows, which score 4 (row, head)s a pass (tile_rows.h, BENCHMARKS 42).
//
// Batch invariance by construction: a (row, query head)'s result is a function of its query, its seen
// keys and nothing else. Its keys are visited in tiles of TILE keys from key 0 of the block (a fixed
// position, whatever the call's length); a score is one dot product over d, lane i holding inputs
// i mod 8, FMAs in increasing d, the 8 lanes summed by one fixed tree, then one multiply by the scale;
// a tile updates the running maximum, rescales the running sum and output once, then adds the tile's
// weights in key order and its weighted values in two FMA chains (even and odd keys, in key order) that
// are added last (keys past seen contribute nothing: never read, except by a prefill unit's shared pass,
// whose scores past a row's seen that row overwrites with -inf before it uses them). Threads split (entry, KV
// heads, group of rows) units only, so a row's reduction is never split; the rows of a unit share each
// tile's keys through the L1 cache, never an accumulator (tile_rows.h's scores are this arithmetic, a key
// in each lane instead of a dimension, the partial sums the same). The file is compiled with -ffp-contract=off:
// every multiply and add is the one written here.
//
//   combine_blocks(top [R, H], total [R, H], acc [R, H, dv] float32, dest [m] int64 or empty, out [B, m, H, dv],
//                  lse [B, m, H] float32) -> None
//
// Folds B block results of m rows into the running combine of key_block_attention.py's `_Combined`, in
// place, block 0 first: row dest[i] (i when dest is empty) takes now = max(top, lse), kept = e^(top -
// now), added = e^(lse - now), acc = acc kept + out added, total = total kept + added, top = now, each
// element by itself with exp8 below, so a row's combine is the same arithmetic in any call.
//
//   replay_attention(q [R, H, d], kv [T, w], dst [N, w], where [T], k [N, Hkv, d], v [N, Hkv, dv], then per
//                    recorded call c: rows[c] [E, n], reads[c] of `keys`' [E, keys] views, seen[c], live[c],
//                    pick[c] and dest[c] (empty: none, every row in order), single, scale) -> [R, H, dv]
//
// A layer of a forward pass whose key-block plan an earlier layer ran (native_attention.Replay): the step's
// packed KV rows written to the pool (as dst.index_copy_(0, where, kv), DeviceKVPool.write_rows), then each
// recorded call attended in place and combined as key_block_attention.py's `_Combined` does, by the same ops
// in the same order (q.index_select, block_attend, the pick, `combine_blocks`; a one-block plan's output + 0.0
// and its rows copied in): the Python replay's bits, without its ~100 us of Python a layer.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"
#include "tile_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t LANES = 8;
constexpr int64_t TILE = 64;        // keys per online-softmax step (a fixed grid from the block's key 0)
constexpr int64_t ROW_GROUP = 16;   // rows of one entry a thread unit takes (they share each key tile)

// 8 keys' lane sums [l0..l7] -> one vector of their 8 sums, each by the tree ((l0+l1)+(l2+l3)) +
// ((l4+l5)+(l6+l7)) whatever key sits in which position.
inline __m256 sum8(const __m256* a) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 lo4 = _mm256_hadd_ps(h01, h23), hi4 = _mm256_hadd_ps(h45, h67);
  // lo4 = [k0 (l0..3), k1, k2, k3 | k0 (l4..7), k1, k2, k3]; hi4 the same for keys 4..7.
  const __m256 first = _mm256_permute2f128_ps(lo4, hi4, 0x20), second = _mm256_permute2f128_ps(lo4, hi4, 0x31);
  return _mm256_add_ps(first, second);
}


inline float max_lanes(__m256 v) {  // a maximum is exact in any order
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

// Scaled scores of query qr [8 ND] against the tile's first `visible` keys (kt[j]: key j's row of this
// KV head, in place), 8 keys at a time (a short last group computes the tile's key 0 in its unused
// positions, then ignores them).
template <int ND, typename T>
inline void scores_of(const float* qr, const T* const* kt, int64_t visible, float scale, float* score) {
  __m256 qv[ND];
  for (int c = 0; c < ND; ++c) qv[c] = load8(qr + c * LANES);
  for (int64_t j0 = 0; j0 < visible; j0 += LANES) {
    __m256 lanes[LANES];
    for (int64_t j = 0; j < LANES; ++j) {
      const T* kr = kt[j0 + j < visible ? j0 + j : 0];
      __m256 a = _mm256_mul_ps(qv[0], load8(kr));
      for (int c = 1; c < ND; ++c) a = _mm256_fmadd_ps(qv[c], load8(kr + c * LANES), a);
      lanes[j] = a;
    }
    _mm256_store_ps(score + j0, _mm256_mul_ps(sum8(lanes), _mm256_set1_ps(scale)));
  }
}

// The same arithmetic for any width: the query held in registers for the usual widths, else re-read.
template <typename T>
inline void tile_scores(const float* qr, const T* const* kt, int64_t visible, int64_t nd, float scale, float* score) {
  switch (nd) {
    case 2: return scores_of<2>(qr, kt, visible, scale, score);
    case 4: return scores_of<4>(qr, kt, visible, scale, score);
    case 6: return scores_of<6>(qr, kt, visible, scale, score);
    case 8: return scores_of<8>(qr, kt, visible, scale, score);
    default: break;
  }
  for (int64_t j0 = 0; j0 < visible; j0 += LANES) {
    __m256 lanes[LANES];
    for (int64_t j = 0; j < LANES; ++j) {
      const T* kr = kt[j0 + j < visible ? j0 + j : 0];
      __m256 a = _mm256_mul_ps(load8(qr), load8(kr));
      for (int64_t c = 1; c < nd; ++c) a = _mm256_fmadd_ps(load8(qr + c * LANES), load8(kr + c * LANES), a);
      lanes[j] = a;
    }
    _mm256_store_ps(score + j0, _mm256_mul_ps(sum8(lanes), _mm256_set1_ps(scale)));
  }
}

// out[8 W] = out * kept + (sum over even keys j of p_j v_j + sum over odd keys), each sum one chain of
// FMAs in key order: two chains per vector, so the FMA latency is hidden, in an order fixed by the tile.
template <int W, typename T>
inline void weigh_values(float* out, const T* const* vt, int64_t c0, const float* p, int64_t visible, float kept) {
  __m256 even[W], odd[W];
  for (int c = 0; c < W; ++c) even[c] = odd[c] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 1 < visible; j += 2) {
    const __m256 pe = _mm256_set1_ps(p[j]), po = _mm256_set1_ps(p[j + 1]);
    for (int c = 0; c < W; ++c) {
      even[c] = _mm256_fmadd_ps(pe, load8(vt[j] + c0 + c * LANES), even[c]);
      odd[c] = _mm256_fmadd_ps(po, load8(vt[j + 1] + c0 + c * LANES), odd[c]);
    }
  }
  if (j < visible) {
    const __m256 pe = _mm256_set1_ps(p[j]);
    for (int c = 0; c < W; ++c) even[c] = _mm256_fmadd_ps(pe, load8(vt[j] + c0 + c * LANES), even[c]);
  }
  const __m256 kept_v = _mm256_set1_ps(kept);
  for (int c = 0; c < W; ++c) {
    const __m256 before = _mm256_mul_ps(load8(out + c * LANES), kept_v);
    _mm256_storeu_ps(out + c * LANES, _mm256_add_ps(before, _mm256_add_ps(even[c], odd[c])));
  }
}

// The running state of one (row, query head): maximum score, sum of weights, unnormalized output.
struct State {
  float top = -std::numeric_limits<float>::infinity();
  float total = 0.0f;
};

template <typename TQ, typename TKV>
struct Operands {
  const TQ* q;
  const TKV* k;
  const TKV* v;
  const int64_t* const* index;  // entry u's keys: index[u][0 .. keys)
  const int64_t* seen;          // null: every row sees all keys
  TQ* out;
  float* lse;
  int64_t E, n, H, Hkv, d, dv, keys;  // entry u takes query entry u % E
  int64_t k_row, k_head, v_row, v_head;  // strides of k and v (their last dimension is contiguous)
  float scale;
};

// Rows [r0, r1) of entry u (query entry e = u % E) with KV heads [g0, g1): every query head of their
// groups, tile by tile.
template <typename TQ, typename TKV>
void attend_unit(const Operands<TQ, TKV>& o, int64_t u, int64_t g0, int64_t g1, int64_t r0, int64_t r1) {
  const int64_t e = u % o.E;
  const int64_t group = o.H / o.Hkv, heads = g1 - g0, d = o.d, dv = o.dv, nd = d / LANES, nv = dv / LANES;
  const int64_t rows = (r1 - r0) * heads * group;  // vector r: row r0 + r / (heads group), head g0 group + r % ..
  std::vector<float> qf(rows * d), acc(rows * dv, 0.0f);
  std::vector<const TKV*> kt(heads * TILE), vt(heads * TILE);
  std::vector<State> state(rows);
  std::vector<int64_t> seen(r1 - r0);
  int64_t most = 0;
  for (int64_t i = r0; i < r1; ++i) {
    seen[i - r0] = o.seen ? o.seen[e * o.n + i] : o.keys;
    most = std::max(most, seen[i - r0]);
    for (int64_t h = 0; h < heads * group; ++h) {
      const TQ* src = o.q + ((e * o.n + i) * o.H + g0 * group + h) * d;
      float* dst = qf.data() + ((i - r0) * heads * group + h) * d;
      for (int64_t c = 0; c < nd; ++c) _mm256_storeu_ps(dst + c * LANES, load8(src + c * LANES));
    }
  }
  const int64_t* index = o.index[u];
  // A unit of several rows of one KV head meets each tile as a RowTile (tile_rows.h): its keys transposed and
  // its values copied once, every row's scores computed SCORE_ROWS (row, head)s a pass; the same bits.
  const bool blocked = heads == 1 && rows >= SCORE_ROWS;
  RowTile row_tile(blocked ? rows : 0, d, dv, TILE);
  alignas(32) float own_score[TILE];
  for (int64_t t0 = 0; t0 < most; t0 += TILE) {
    const int64_t tile_keys = std::min(TILE, most - t0);
    for (int64_t j = 0; j < tile_keys; ++j) {  // the tile's rows of each KV head, read in place
      const int64_t at = index[t0 + j];
      for (int64_t g = g0; g < g1; ++g) {
        kt[(g - g0) * TILE + j] = o.k + at * o.k_row + g * o.k_head;
        vt[(g - g0) * TILE + j] = o.v + at * o.v_row + g * o.v_head;
      }
    }
    if (blocked) {
      row_tile.load(kt.data(), vt.data(), tile_keys);
      for (int64_t r = 0; r < rows; r += SCORE_ROWS) {
        const int64_t count = std::min(SCORE_ROWS, rows - r);
        int64_t widest = 0;  // the most keys a row of the pass sees in this tile
        for (int64_t i = 0; i < count; ++i)
          widest = std::max(widest, std::min(seen[(r + i) / group] - t0, tile_keys));
        row_tile.score(qf.data() + r * d, r, count, widest, o.scale);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min(seen[r / (heads * group)] - t0, tile_keys);
      if (visible <= 0) continue;
      const TKV* const* kg = kt.data() + r / group % heads * TILE;
      const TKV* const* vg = vt.data() + r / group % heads * TILE;
      float* const score = blocked ? row_tile.scores(r) : own_score;
      if (!blocked) tile_scores(qf.data() + r * d, kg, visible, nd, o.scale, score);
      const int64_t padded = (visible + LANES - 1) / LANES * LANES;
      for (int64_t j = visible; j < padded; ++j) score[j] = -std::numeric_limits<float>::infinity();
      __m256 top8 = _mm256_load_ps(score);
      for (int64_t j0 = LANES; j0 < padded; j0 += LANES) top8 = _mm256_max_ps(top8, _mm256_load_ps(score + j0));
      State& s = state[r];
      const float top = std::max(s.top, max_lanes(top8));
      // The first tile has nothing to rescale (and e^(-inf - top) must be 0, not the clamp's).
      const float kept = s.top == -std::numeric_limits<float>::infinity()
                             ? 0.0f
                             : _mm256_cvtss_f32(exp8(_mm256_set1_ps(s.top - top)));
      const __m256 top_v = _mm256_set1_ps(top);
      __m256 weights = _mm256_setzero_ps();
      for (int64_t j0 = 0; j0 < padded; j0 += LANES) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(score + j0), top_v));  // -inf lanes give 0
        _mm256_store_ps(score + j0, p);
        weights = _mm256_add_ps(weights, p);
      }
      s.total = s.total * kept + sum_lanes(weights);
      s.top = top;
      float* out = acc.data() + r * dv;
      const auto weigh = [&](const auto* const* values) {
        for (int64_t c = 0; c < nv; c += 4) {  // four output vectors at a time, each its own two chains
          switch (std::min<int64_t>(4, nv - c)) {
            case 4: weigh_values<4>(out + c * LANES, values, c * LANES, score, visible, kept); break;
            case 3: weigh_values<3>(out + c * LANES, values, c * LANES, score, visible, kept); break;
            case 2: weigh_values<2>(out + c * LANES, values, c * LANES, score, visible, kept); break;
            default: weigh_values<1>(out + c * LANES, values, c * LANES, score, visible, kept);
          }
        }
      };
      if (blocked) weigh(row_tile.values());
      else weigh(vg);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r0 + r / (heads * group), h = g0 * group + r % (heads * group);
    const State& s = state[r];
    TQ* dst = o.out + ((u * o.n + i) * o.H + h) * dv;
    const float* src = acc.data() + r * dv;
    for (int64_t c = 0; c < dv; ++c) dst[c] = static_cast<TQ>(src[c] / s.total);
    o.lse[(u * o.n + i) * o.H + h] = s.top + std::log(s.total);
  }
}

template <typename TQ, typename TKV>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<const int64_t*>& index,
         int64_t keys, const at::Tensor& seen, const int64_t* live, float scale, at::Tensor& out, at::Tensor& lse) {
  const int64_t E = q.size(0), n = q.size(1), Hkv = k.size(1), entries = static_cast<int64_t>(index.size());
  const Operands<TQ, TKV> o{q.data_ptr<TQ>(), k.data_ptr<TKV>(), v.data_ptr<TKV>(), index.data(),
                      seen.numel() ? seen.data_ptr<int64_t>() : nullptr, out.data_ptr<TQ>(), lse.data_ptr<float>(),
                      E, n, q.size(2), Hkv, q.size(3), v.size(2), keys,
                      k.stride(0), k.stride(1), v.stride(0), v.stride(1), scale};
  // One query row per entry (decode; a plan pads it to 8): a unit reads its entry's rows of every KV head together (a pool
  // row is one stream) unless that leaves threads idle. Several rows: a unit takes one KV head, so its
  // tile of keys and values (64 keys) stays in L1 while each of its rows meets it. Either way a
  // (row, head)'s arithmetic is the same (the file's header).
  const int64_t row_groups = (n + ROW_GROUP - 1) / ROW_GROUP;
  const bool one_row_each = std::all_of(live, live + E, [](int64_t rows) { return rows <= 1; });
  const int64_t splits = one_row_each && entries >= at::get_num_threads() ? 1 : Hkv;
  at::parallel_for(0, entries * splits * row_groups, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t u = w / (splits * row_groups), part = w / row_groups % splits, r0 = w % row_groups * ROW_GROUP;
      const int64_t r1 = std::min({live[u % E], n, r0 + ROW_GROUP});  // rows past an entry's live ones are padding
      const int64_t g0 = part * Hkv / splits, g1 = (part + 1) * Hkv / splits;
      if (r0 < r1) attend_unit(o, u, g0, g1, r0, r1);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> block_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const std::vector<at::Tensor>& index, const at::Tensor& seen,
                                                const at::Tensor& rows, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous(), "block_attend: q [E, n, H, d] contiguous");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1,
              "block_attend: k [N, Hkv, d] and v [N, Hkv, dv], the last dimension contiguous");
  TORCH_CHECK(v.scalar_type() == k.scalar_type() &&
                  (k.scalar_type() == q.scalar_type() || (q.scalar_type() == at::kFloat && k.scalar_type() == at::kBFloat16)),
              "block_attend: k and v of q's dtype, or bf16 under float32 q");
  const int64_t E = q.size(0), n = q.size(1), H = q.size(2), d = q.size(3), Hkv = k.size(1), dv = v.size(2);
  TORCH_CHECK(k.size(2) == d && v.size(1) == Hkv && k.size(0) == v.size(0) && H % Hkv == 0,
              "block_attend: head shapes");
  TORCH_CHECK(d % LANES == 0 && dv % LANES == 0, "block_attend: head sizes a multiple of 8");
  TORCH_CHECK(!index.empty(), "block_attend: at least one index");
  const int64_t keys = index[0].dim() == 2 ? index[0].size(1) : -1;
  std::vector<const int64_t*> entries;  // entry b E + e reads index[b][e]
  for (const at::Tensor& read : index) {
    TORCH_CHECK(read.dim() == 2 && read.size(0) == E && read.size(1) == keys && read.scalar_type() == at::kLong &&
                    (keys <= 1 || read.stride(1) == 1),
                "block_attend: each index [E, keys] int64, one keys, its rows contiguous");
    for (int64_t e = 0; e < E; ++e) {
      const int64_t* row = read.data_ptr<int64_t>() + e * read.stride(0);
      TORCH_CHECK(std::all_of(row, row + keys, [&](int64_t x) { return x >= 0 && x < k.size(0); }),
                  "block_attend: an index outside k and v");
      entries.push_back(row);
    }
  }
  const bool masked = seen.numel() > 0;
  TORCH_CHECK(!masked || (seen.scalar_type() == at::kLong && seen.is_contiguous() && seen.numel() == E * n),
              "block_attend: seen [E, n] int64");
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == E && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "block_attend: rows [E] int64");
  if (masked) {  // a row reads index[e, 0 .. seen): never past the keys it was given
    const int64_t* s = seen.data_ptr<int64_t>();
    TORCH_CHECK(std::all_of(s, s + E * n, [&](int64_t x) { return x >= 0 && x <= keys; }),
                "block_attend: a row sees more keys than index holds");
  }
  const int64_t B = static_cast<int64_t>(index.size());
  at::Tensor out = at::empty({B * E, n, H, dv}, q.options());
  at::Tensor lse = at::empty({B * E, n, H}, q.options().dtype(at::kFloat));
  const int64_t* live = rows.data_ptr<int64_t>();
  const float factor = static_cast<float>(scale);
  // bf16 keys and values under float32 queries (--kv-cache-dtype bfloat16) are widened as they are loaded,
  // exactly: the arithmetic is the float32 kernel's on those widened values.
  if (q.scalar_type() == at::kFloat && k.scalar_type() == at::kBFloat16) {
    run<float, c10::BFloat16>(q, k, v, entries, keys, seen, live, factor, out, lse);
    return {out, lse};
  }
  AT_DISPATCH_SWITCH(q.scalar_type(), "block_attend",
    AT_DISPATCH_CASE(at::kFloat, [&] { run<float, float>(q, k, v, entries, keys, seen, live, factor, out, lse); })
    AT_DISPATCH_CASE(at::kBFloat16,
                     [&] { run<c10::BFloat16, c10::BFloat16>(q, k, v, entries, keys, seen, live, factor, out, lse); }));
  return {out, lse};
}

template <typename T>
void fold(float* top, float* total, float* acc, const int64_t* dest, const T* out, const float* lse, int64_t B,
          int64_t m, int64_t H, int64_t dv) {
  // One (row, head) a unit: its blocks in order. Under ~16K values the call stays on one thread.
  at::parallel_for(0, m * H, std::max<int64_t>(1, 16384 / (B * dv)), [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t i = u / H, h = u % H, at = (dest ? dest[i] : i) * H + h;
      float* a = acc + at * dv;
      for (int64_t b = 0; b < B; ++b) {
        const float block = lse[(b * m + i) * H + h], now = std::max(top[at], block);
        const __m256 both = exp8(_mm256_setr_ps(top[at] - now, block - now, 0, 0, 0, 0, 0, 0));
        alignas(32) float e[LANES];
        _mm256_store_ps(e, both);
        const __m256 kept = _mm256_set1_ps(e[0]), added = _mm256_set1_ps(e[1]);
        const T* o = out + ((b * m + i) * H + h) * dv;
        for (int64_t c = 0; c < dv; c += LANES)
          _mm256_storeu_ps(a + c, _mm256_add_ps(_mm256_mul_ps(load8(a + c), kept), _mm256_mul_ps(load8(o + c), added)));
        total[at] = total[at] * e[0] + e[1];
        top[at] = now;
      }
    }
  });
}

void combine_blocks(at::Tensor& top, at::Tensor& total, at::Tensor& acc, const at::Tensor& dest, const at::Tensor& out,
                    const at::Tensor& lse) {
  TORCH_CHECK(out.dim() == 4 && out.is_contiguous() && lse.dim() == 3 && lse.is_contiguous() &&
                  lse.scalar_type() == at::kFloat && lse.sizes() == out.sizes().slice(0, 3),
              "combine_blocks: out [B, m, H, dv] and lse [B, m, H] float32, contiguous");
  const int64_t B = out.size(0), m = out.size(1), H = out.size(2), dv = out.size(3);
  TORCH_CHECK(dv % LANES == 0, "combine_blocks: a value width a multiple of 8");
  TORCH_CHECK(acc.dim() == 3 && acc.size(1) == H && acc.size(2) == dv && top.dim() == 2 && top.size(0) == acc.size(0) &&
                  top.size(1) == H && total.sizes() == top.sizes(),
              "combine_blocks: acc [R, H, dv], top and total [R, H]");
  for (const at::Tensor* t : {&top, &total, &acc})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "combine_blocks: float32 contiguous state");
  const int64_t R = acc.size(0);
  const int64_t* rows = nullptr;
  if (dest.numel()) {
    TORCH_CHECK(dest.dim() == 1 && dest.size(0) == m && dest.scalar_type() == at::kLong && dest.is_contiguous(),
                "combine_blocks: dest [m] int64");
    rows = dest.data_ptr<int64_t>();
    TORCH_CHECK(std::all_of(rows, rows + m, [&](int64_t r) { return r >= 0 && r < R; }),
                "combine_blocks: a row outside");
  } else {
    TORCH_CHECK(m == R, "combine_blocks: without dest, the blocks hold every row");
  }
  float *tp = top.data_ptr<float>(), *sp = total.data_ptr<float>(), *ap = acc.data_ptr<float>();
  const float* lp = lse.data_ptr<float>();
  AT_DISPATCH_SWITCH(out.scalar_type(), "combine_blocks",
    AT_DISPATCH_CASE(at::kFloat, [&] { fold(tp, sp, ap, rows, out.data_ptr<float>(), lp, B, m, H, dv); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { fold(tp, sp, ap, rows, out.data_ptr<c10::BFloat16>(), lp, B, m, H, dv); }));
}

// dst.index_copy_(0, where, kv.to(dst's dtype)): a row copy each where the dtypes agree (the same bytes,
// without index_copy_'s ~7 us of dispatch for a decode step's row or two).
void write_rows(at::Tensor& dst, const at::Tensor& where, const at::Tensor& kv) {
  TORCH_CHECK(dst.dim() == 2 && kv.dim() == 2 && kv.size(1) == dst.size(1) && where.dim() == 1 &&
                  where.size(0) == kv.size(0) && where.scalar_type() == at::kLong,
              "replay_attention: kv [T, w], dst [N, w] and where [T] int64");
  if (kv.scalar_type() != dst.scalar_type() || kv.stride(1) != 1 || dst.stride(1) != 1 || !where.is_contiguous()) {
    dst.index_copy_(0, where, kv.to(dst.scalar_type()));
    return;
  }
  const int64_t* rows = where.data_ptr<int64_t>();
  const int64_t N = dst.size(0), bytes = kv.size(1) * kv.element_size();
  auto* base = static_cast<char*>(dst.data_ptr());
  const auto* src = static_cast<const char*>(kv.data_ptr());
  for (int64_t i = 0; i < kv.size(0); ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < N, "replay_attention: a row outside the pool");
    std::memcpy(base + rows[i] * dst.stride(0) * dst.element_size(), src + i * kv.stride(0) * kv.element_size(),
                bytes);
  }
}

at::Tensor replay_attention(const at::Tensor& q, const at::Tensor& kv, at::Tensor dst, const at::Tensor& where,
                            const at::Tensor& k, const at::Tensor& v, at::TensorList rows, at::TensorList keys,
                            at::IntArrayRef reads, at::TensorList seen, at::TensorList live, at::TensorList pick,
                            at::TensorList dest, bool single, double scale) {
  const size_t calls = rows.size();
  TORCH_CHECK(calls > 0 && reads.size() == calls && seen.size() == calls && live.size() == calls &&
                  pick.size() == calls && dest.size() == calls,
              "replay_attention: rows, reads, seen, live, pick and dest per call");
  TORCH_CHECK(q.dim() == 3, "replay_attention: q [R, H, d]");
  write_rows(dst, where, kv);
  const int64_t R = q.size(0), H = q.size(1), d = q.size(2), dv = v.size(2);
  at::Tensor out, top, total, acc;
  if (!single) {
    const auto f32 = q.options().dtype(at::kFloat);
    top = at::full({R, H}, -std::numeric_limits<double>::infinity(), f32);
    total = at::zeros({R, H}, f32);
    acc = at::zeros({R, H, dv}, f32);
  }
  int64_t first = 0;  // the first of call c's views in `keys`
  for (size_t c = 0; c < calls; ++c) {
    const int64_t E = rows[c].size(0), n = rows[c].size(1), B = reads[c];
    TORCH_CHECK(B > 0 && first + B <= static_cast<int64_t>(keys.size()), "replay_attention: reads beyond keys");
    const std::vector<at::Tensor> index(keys.begin() + first, keys.begin() + first + B);
    first += B;
    auto [outs, lses] = block_attend(q.index_select(0, rows[c].view(-1)).view({E, n, H, d}), k, v, index, seen[c],
                                     live[c], scale);
    outs = outs.view({B, E * n, H, -1});
    lses = lses.view({B, E * n, H});
    if (pick[c].numel()) {
      outs = outs.index_select(1, pick[c]);
      lses = lses.index_select(1, pick[c]);
    }
    if (!single) {
      combine_blocks(top, total, acc, dest[c], outs.contiguous(), lses.contiguous());
      continue;
    }
    const at::Tensor block = outs[0] + 0.0;  // as the one block's result in Python (`_Combined.add`)
    if (!dest[c].numel()) {
      out = block;
      continue;
    }
    if (!out.defined()) out = at::empty({R, H, dv}, block.options());
    out.index_copy_(0, dest[c], block);
  }
  TORCH_CHECK(first == static_cast<int64_t>(keys.size()), "replay_attention: keys beyond the calls' reads");
  return single ? out : (acc / total.unsqueeze(-1)).to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(HICACHE_QGEMM_LIBRARY, m) {
  m.def("block_attend(Tensor q, Tensor k, Tensor v, Tensor[] index, Tensor seen, Tensor rows, float scale)"
        " -> (Tensor, Tensor)", &block_attend);
  m.def("combine_blocks(Tensor(a!) top, Tensor(b!) total, Tensor(c!) acc, Tensor dest, Tensor out, Tensor lse) -> ()",
        &combine_blocks);
  m.def("replay_attention(Tensor q, Tensor kv, Tensor(a!) dst, Tensor where, Tensor k, Tensor v, Tensor[] rows, "
        "Tensor[] keys, int[] reads, Tensor[] seen, Tensor[] live, Tensor[] pick, Tensor[] dest, bool single, "
        "float scale) -> Tensor",
        &replay_attention);
}
