// Paged decode attention on the CPU, one pass of a thread (see layers/attention/cpu_kernels.py):
// the queries of some KV heads of one request against a run of its keys, tile by tile, with
// an online softmax. paged_attention.cpp spreads the passes over the threads.
#pragma once

#include "vec.h"

namespace {

constexpr int64_t kMaxGroup = 16;
constexpr int64_t kMaxVecs = 256 / kLanes;  // head_dim <= 256
constexpr int64_t kTile = 32;  // keys per online-softmax update
constexpr int64_t kMaxRows = 64;  // query heads attended in one pass over the keys
constexpr int64_t kScratchVecs = 8192 / kLanes;  // query (and accumulator) vectors of a pass

template <typename scalar_t, typename cache_t>
struct Args {
  const scalar_t* q;
  int64_t q_stride_req, q_stride_head;
  const cache_t* cache;  // scalar_t, or int8_t: rows of head_dim values and their scale
  int64_t block_size, slot_stride, kv_heads, nv, group;  // nv = head_dim / kLanes
  const int64_t* block_tables;
  int64_t table_stride;
  const int64_t* context_lens;
  scalar_t* out;  // contiguous (D, H, head_dim)
  float scale;
  int64_t window;  // 0: no sliding window
  float softcap;  // 0: none; else each scaled score s becomes softcap * tanh(s / softcap)
  const float* sinks;  // nullptr: none; else (H,) one logit per query head (see sink_norm)
  int64_t row_stride;  // cache elements of one (K/V, head) row: head_dim (+ 4 for int8)
};

// An int8 cache's rows are head_dim values and then their fp32 scale (kv_cache_dtype.py):
// the row is values * scale. Other caches' rows are the values themselves.
template <typename cache_t>
constexpr bool kScaledRows = std::is_same_v<cache_t, int8_t>;

template <typename cache_t>
inline float row_scale(const cache_t* row, int64_t head_dim) {
  float scale = 1.f;
  if constexpr (kScaledRows<cache_t>) std::memcpy(&scale, row + head_dim, sizeof(scale));
  return scale;
}

// Request b, KV heads [h0, h1): query heads ("rows") [h0 * group, h1 * group).
struct Pass {
  int64_t b, h0, h1, rows;
};

struct Scratch {
  fvec q[kScratchVecs];  // the rows' queries, scaled: row r at q[r * nv]
  fvec acc[kScratchVecs];  // their unnormalized outputs
  float scores[kMaxRows * kTile];
  float max[kMaxRows];
  float sum[kMaxRows];
  float alpha[kMaxRows];  // rescaling of acc by the last max update
};

template <typename scalar_t, typename cache_t>
void load_queries(const Args<scalar_t, cache_t>& a, const Pass& p, int64_t nv, Scratch& s) {
  const scalar_t* q = a.q + p.b * a.q_stride_req + p.h0 * a.group * a.q_stride_head;
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < nv; ++c) {
      s.q[r * nv + c] = load(q + r * a.q_stride_head + c * kLanes) * a.scale;
      s.acc[r * nv + c] = fvec{};
    }
    s.max[r] = -std::numeric_limits<float>::infinity();
    s.sum[r] = 0.f;
  }
}

// Cache slot of each key in [t0, t0 + n): rows[i] points at its keys, then its values.
template <typename scalar_t, typename cache_t>
void locate_keys(const Args<scalar_t, cache_t>& a, int64_t b, int64_t t0, int64_t n,
                 const cache_t** slots) {
  const int64_t* table = a.block_tables + b * a.table_stride;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = t0 + i;
    const int64_t slot = table[t / a.block_size] * a.block_size + t % a.block_size;
    slots[i] = a.cache + slot * a.slot_stride;
  }
}

// Every cache line of [p, p + bytes) into L2.
inline void prefetch_lines(const char* p, int64_t bytes) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t at = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}; at < end; at += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(at), 0, 2);
}

// Each key is loaded (and converted) once for all the query heads of its KV head.
template <typename scalar_t, typename cache_t, int64_t NV>
void score_tile(const Args<scalar_t, cache_t>& a, const Pass& p, const cache_t* const* slots,
                int64_t n, int64_t nv, Scratch& s, const cache_t* const* ahead, int64_t n_ahead,
                const Pass& next_pass) {
  // of each slot ahead, the keys and the values of the next pass's KV heads: the whole slot
  // where they are all of them
  const int64_t head_bytes = a.row_stride * static_cast<int64_t>(sizeof(cache_t));
  const bool whole = next_pass.h0 == 0 && next_pass.h1 == a.kv_heads;
  const int64_t span =
      (whole ? 2 * a.kv_heads : next_pass.h1 - next_pass.h0) * head_bytes;
  const int64_t k0 = next_pass.h0 * head_bytes, v0 = (a.kv_heads + next_pass.h0) * head_bytes;
  for (int64_t i = 0; i < n; ++i) {
    if (i < n_ahead) {
      const char* next = reinterpret_cast<const char*>(ahead[i]);
      prefetch_lines(next + k0, span);
      if (!whole) prefetch_lines(next + v0, span);
    }
    for (int64_t h = p.h0; h < p.h1; ++h) {
      const cache_t* row = slots[i] + h * a.row_stride;
      fvec key[NV > 0 ? NV : kMaxVecs];
      for (int64_t c = 0; c < nv; ++c) key[c] = load(row + c * kLanes);
      const float key_scale = row_scale(row, nv * kLanes);  // 1 but for int8 rows
      for (int64_t r = (h - p.h0) * a.group; r < (h - p.h0 + 1) * a.group; ++r) {
        fvec dot = s.q[r * nv] * key[0];
        for (int64_t c = 1; c < nv; ++c) dot += s.q[r * nv + c] * key[c];
        if constexpr (kScaledRows<cache_t>)
          s.scores[r * kTile + i] = hsum(dot) * key_scale;
        else
          s.scores[r * kTile + i] = hsum(dot);
      }
    }
  }
}

// The tile's scores of each row soft-capped, cap * tanh(s / cap) (the queries carry the scale
// already), kLanes at a time: the tail past n is overwritten by softmax_update.
inline void cap_scores(int64_t rows, int64_t n, float cap, Scratch& s) {
  const int64_t vecs = (n + kLanes - 1) / kLanes;
  const float inv = 1.f / cap;
  for (int64_t r = 0; r < rows; ++r) {
    float* sc = s.scores + r * kTile;
    for (int64_t v = 0; v < vecs; ++v)
      store(sc + v * kLanes, tanh_vec(load(sc + v * kLanes) * inv) * cap);
  }
}

// Scores -> probabilities under the running max; alpha rescales what was accumulated.
// kLanes scores at a time: the tile's unused tail is -inf, then probability 0.
inline void softmax_update(int64_t rows, int64_t n, Scratch& s) {
  const int64_t vecs = (n + kLanes - 1) / kLanes;
  i32vec lane;
  for (int32_t l = 0; l < kLanes; ++l) lane[l] = l;
  for (int64_t r = 0; r < rows; ++r) {
    float* sc = s.scores + r * kTile;
    for (int64_t i = n; i < vecs * kLanes; ++i) sc[i] = -std::numeric_limits<float>::infinity();
    fvec top = load(sc);
    for (int64_t v = 1; v < vecs; ++v) {
      const fvec x = load(sc + v * kLanes);
      top = x > top ? x : top;
    }
    const float new_max = std::max(s.max[r], hmax(top));
    fvec sum{};
    for (int64_t v = 0; v < vecs; ++v) {
      const fvec e = exp_vec(load(sc + v * kLanes) - new_max);
      const fvec p = lane + static_cast<int32_t>(v * kLanes) < static_cast<int32_t>(n) ? e : fvec{};
      store(sc + v * kLanes, p);
      sum += p;
    }
    s.alpha[r] = std::exp(s.max[r] - new_max);  // 0 on the first tile
    s.sum[r] = s.sum[r] * s.alpha[r] + hsum(sum);
    s.max[r] = new_max;
  }
}

// Rows [r0, r0 + R) of one KV head (values at `v_offset` in each slot), their accumulators
// in registers: each value vector is loaded (and converted) once for the R rows.
template <typename cache_t, int64_t NV, int64_t R>
void accumulate_rows(const cache_t* const* slots, int64_t n, int64_t nv, int64_t v_offset,
                     int64_t r0, Scratch& s) {
  constexpr int64_t kVecs = NV > 0 ? NV : kMaxVecs;
  fvec acc[R][kVecs];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < nv; ++c) acc[r][c] = s.acc[(r0 + r) * nv + c] * s.alpha[r0 + r];
  for (int64_t i = 0; i < n; ++i) {
    fvec value[kVecs];
    const cache_t* row = slots[i] + v_offset;
    for (int64_t c = 0; c < nv; ++c) value[c] = load(row + c * kLanes);
    const float value_scale = row_scale(row, nv * kLanes);  // 1 but for int8 rows
    for (int64_t r = 0; r < R; ++r) {
      float prob = s.scores[(r0 + r) * kTile + i];
      if constexpr (kScaledRows<cache_t>) prob *= value_scale;
      for (int64_t c = 0; c < nv; ++c) acc[r][c] += prob * value[c];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < nv; ++c) s.acc[(r0 + r) * nv + c] = acc[r][c];
}

// The rows of each KV head in runs of up to 4 (head_dim 64) or 2 (128), so that their
// accumulators stay in registers; one row at a time for other head dims.
template <typename scalar_t, typename cache_t, int64_t NV>
void accumulate_values(const Args<scalar_t, cache_t>& a, const Pass& p, const cache_t* const* slots,
                       int64_t n, int64_t nv, Scratch& s) {
  constexpr int64_t kRun = NV == 4 ? 4 : NV == 8 ? 2 : 1;
  for (int64_t h = p.h0; h < p.h1; ++h) {
    const int64_t v_offset = (a.kv_heads + h) * a.row_stride;
    const int64_t last = (h - p.h0 + 1) * a.group;
    for (int64_t r0 = (h - p.h0) * a.group; r0 < last;) {
      const int64_t rows = std::min(kRun, last - r0);
      if (rows >= 4) accumulate_rows<cache_t, NV, kRun>(slots, n, nv, v_offset, r0, s);
      else if (rows == 3) accumulate_rows<cache_t, NV, 3>(slots, n, nv, v_offset, r0, s);
      else if (rows == 2) accumulate_rows<cache_t, NV, 2>(slots, n, nv, v_offset, r0, s);
      else accumulate_rows<cache_t, NV, 1>(slots, n, nv, v_offset, r0, s);
      r0 += rows;
    }
  }
}

// The factor of a row's unnormalized output (its keys' running max m and their sum under it)
// once its head's sink logit joins the softmax denominator, as one more key without a value:
// 1 / (sum + exp(sink - m)), computed under max(m, sink) so that nothing overflows. No keys:
// zeros (the sink takes all the probability).
inline float sink_norm(float max, float sum, float sink) {
  if (sum == 0.f) return 0.f;
  const float top = std::max(max, sink), alpha = std::exp(max - top);
  return alpha / (sum * alpha + std::exp(sink - top));
}

template <typename scalar_t, typename cache_t>
void store_output(const Args<scalar_t, cache_t>& a, const Pass& p, int64_t nv, Scratch& s) {
  const int64_t num_heads = a.kv_heads * a.group, head0 = p.h0 * a.group;
  scalar_t* out = a.out + (p.b * num_heads + head0) * nv * kLanes;
  for (int64_t r = 0; r < p.rows; ++r) {
    const float inv = a.sinks != nullptr ? sink_norm(s.max[r], s.sum[r], a.sinks[head0 + r])
                      : s.sum[r] > 0.f  ? 1.f / s.sum[r]
                                        : 0.f;  // no keys: zeros
    for (int64_t c = 0; c < nv; ++c)
      store(out + (r * nv + c) * kLanes, s.acc[r * nv + c] * inv);
  }
}

// The first key attended in request b's context.
template <typename scalar_t, typename cache_t>
int64_t first_key(const Args<scalar_t, cache_t>& a, int64_t b) {
  return a.window > 0 ? std::max<int64_t>(0, a.context_lens[b] - a.window) : 0;
}

// NV = head_dim / kLanes fixed at compile time (registers, full unrolling), or 0: from the args.
// The cache is paged, so the hardware cannot guess where the next keys are: while a tile is
// scored, the next one's slots are prefetched, one slot per key (all at once would fill the
// line-fill buffers the tile's own loads need), only the keys and values of the pass's KV
// heads (a pass of fewer heads than the slot holds would pull in lines it never reads); the
// next tile of the last one is the first of `next`, the thread's next pass (if any). Keys
// [start, end) of request p.b, into s (the queries loaded, the sums running).
template <typename scalar_t, typename cache_t, int64_t NV>
void attend_keys(const Args<scalar_t, cache_t>& a, const Pass& p, int64_t start, int64_t end,
                 const Pass* next, Scratch& s) {
  const int64_t nv = NV > 0 ? NV : a.nv;
  const cache_t* tiles[2][kTile];  // this tile's slots and the next one's
  if (start < end) locate_keys(a, p.b, start, std::min(kTile, end - start), tiles[0]);
  for (int64_t t0 = start, k = 0; t0 < end; t0 += kTile, k ^= 1) {
    const int64_t n = std::min(kTile, end - t0);
    int64_t n_ahead = 0;
    if (t0 + kTile < end) {
      n_ahead = std::min(kTile, end - t0 - kTile);
      locate_keys(a, p.b, t0 + kTile, n_ahead, tiles[k ^ 1]);
    } else if (next != nullptr) {
      const int64_t next_start = first_key(a, next->b);
      n_ahead = std::max<int64_t>(0, std::min(kTile, a.context_lens[next->b] - next_start));
      locate_keys(a, next->b, next_start, n_ahead, tiles[k ^ 1]);
    }
    const bool last = t0 + kTile >= end && next != nullptr;
    score_tile<scalar_t, cache_t, NV>(a, p, tiles[k], n, nv, s, tiles[k ^ 1], n_ahead, last ? *next : p);
    if (a.softcap > 0.f) cap_scores(p.rows, n, a.softcap, s);  // one branch per tile
    softmax_update(p.rows, n, s);
    accumulate_values<scalar_t, cache_t, NV>(a, p, tiles[k], n, nv, s);
  }
}

template <typename scalar_t, typename cache_t, int64_t NV>
void attend(const Args<scalar_t, cache_t>& a, const Pass& p, const Pass* next, Scratch& s) {
  const int64_t nv = NV > 0 ? NV : a.nv;
  load_queries(a, p, nv, s);
  attend_keys<scalar_t, cache_t, NV>(a, p, first_key(a, p.b), a.context_lens[p.b], next, s);
  store_output(a, p, nv, s);
}

}  // namespace
