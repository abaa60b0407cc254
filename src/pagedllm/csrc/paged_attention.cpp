// Paged decode attention on the CPU (see layers/attention/cpu_kernels.py).
#include "vec.h"

namespace {

constexpr int64_t kMaxGroup = 16;
constexpr int64_t kMaxVecs = 256 / kLanes;  // head_dim <= 256
constexpr int64_t kTile = 32;  // keys per online-softmax update
constexpr int64_t kMaxRows = 64;  // query heads attended in one pass over the keys
constexpr int64_t kScratchVecs = 8192 / kLanes;  // query (and accumulator) vectors of a pass

template <typename scalar_t>
struct Args {
  const scalar_t* q;
  int64_t q_stride_req, q_stride_head;
  const scalar_t* cache;
  int64_t block_size, slot_stride, kv_heads, nv, group;  // nv = head_dim / kLanes
  const int64_t* block_tables;
  int64_t table_stride;
  const int64_t* context_lens;
  scalar_t* out;  // contiguous (D, H, head_dim)
  float scale;
  int64_t window;  // 0: no sliding window
};

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

template <typename scalar_t>
void load_queries(const Args<scalar_t>& a, const Pass& p, int64_t nv, Scratch& s) {
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
template <typename scalar_t>
void locate_keys(const Args<scalar_t>& a, int64_t b, int64_t t0, int64_t n,
                 const scalar_t** slots) {
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
template <typename scalar_t, int64_t NV>
void score_tile(const Args<scalar_t>& a, const Pass& p, const scalar_t* const* slots,
                int64_t n, int64_t nv, Scratch& s, const scalar_t* const* ahead, int64_t n_ahead,
                const Pass& next_pass) {
  // of each slot ahead, the keys and the values of the next pass's KV heads: the whole slot
  // where they are all of them
  const int64_t head_bytes = nv * kLanes * static_cast<int64_t>(sizeof(scalar_t));
  const bool whole = next_pass.h0 == 0 && next_pass.h1 == a.kv_heads;
  const int64_t span = whole ? 2 * a.kv_heads * head_bytes : (next_pass.h1 - next_pass.h0) * head_bytes;
  const int64_t k0 = next_pass.h0 * head_bytes, v0 = (a.kv_heads + next_pass.h0) * head_bytes;
  for (int64_t i = 0; i < n; ++i) {
    if (i < n_ahead) {
      const char* next = reinterpret_cast<const char*>(ahead[i]);
      prefetch_lines(next + k0, span);
      if (!whole) prefetch_lines(next + v0, span);
    }
    for (int64_t h = p.h0; h < p.h1; ++h) {
      fvec key[NV > 0 ? NV : kMaxVecs];
      for (int64_t c = 0; c < nv; ++c) key[c] = load(slots[i] + (h * nv + c) * kLanes);
      for (int64_t r = (h - p.h0) * a.group; r < (h - p.h0 + 1) * a.group; ++r) {
        fvec dot = s.q[r * nv] * key[0];
        for (int64_t c = 1; c < nv; ++c) dot += s.q[r * nv + c] * key[c];
        s.scores[r * kTile + i] = hsum(dot);
      }
    }
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
template <typename scalar_t, int64_t NV, int64_t R>
void accumulate_rows(const scalar_t* const* slots, int64_t n, int64_t nv, int64_t v_offset,
                     int64_t r0, Scratch& s) {
  constexpr int64_t kVecs = NV > 0 ? NV : kMaxVecs;
  fvec acc[R][kVecs];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < nv; ++c) acc[r][c] = s.acc[(r0 + r) * nv + c] * s.alpha[r0 + r];
  for (int64_t i = 0; i < n; ++i) {
    fvec value[kVecs];
    for (int64_t c = 0; c < nv; ++c) value[c] = load(slots[i] + v_offset + c * kLanes);
    for (int64_t r = 0; r < R; ++r) {
      const float prob = s.scores[(r0 + r) * kTile + i];
      for (int64_t c = 0; c < nv; ++c) acc[r][c] += prob * value[c];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < nv; ++c) s.acc[(r0 + r) * nv + c] = acc[r][c];
}

// The rows of each KV head in runs of up to 4 (head_dim 64) or 2 (128), so that their
// accumulators stay in registers; one row at a time for other head dims.
template <typename scalar_t, int64_t NV>
void accumulate_values(const Args<scalar_t>& a, const Pass& p, const scalar_t* const* slots,
                       int64_t n, int64_t nv, Scratch& s) {
  constexpr int64_t kRun = NV == 4 ? 4 : NV == 8 ? 2 : 1;
  for (int64_t h = p.h0; h < p.h1; ++h) {
    const int64_t v_offset = (a.kv_heads + h) * nv * kLanes;
    const int64_t last = (h - p.h0 + 1) * a.group;
    for (int64_t r0 = (h - p.h0) * a.group; r0 < last;) {
      const int64_t rows = std::min(kRun, last - r0);
      if (rows >= 4) accumulate_rows<scalar_t, NV, kRun>(slots, n, nv, v_offset, r0, s);
      else if (rows == 3) accumulate_rows<scalar_t, NV, 3>(slots, n, nv, v_offset, r0, s);
      else if (rows == 2) accumulate_rows<scalar_t, NV, 2>(slots, n, nv, v_offset, r0, s);
      else accumulate_rows<scalar_t, NV, 1>(slots, n, nv, v_offset, r0, s);
      r0 += rows;
    }
  }
}

template <typename scalar_t>
void store_output(const Args<scalar_t>& a, const Pass& p, int64_t nv, Scratch& s) {
  const int64_t num_heads = a.kv_heads * a.group;
  scalar_t* out = a.out + (p.b * num_heads + p.h0 * a.group) * nv * kLanes;
  for (int64_t r = 0; r < p.rows; ++r) {
    const float inv = s.sum[r] > 0.f ? 1.f / s.sum[r] : 0.f;  // no keys: zeros
    for (int64_t c = 0; c < nv; ++c)
      store(out + (r * nv + c) * kLanes, s.acc[r * nv + c] * inv);
  }
}

// The first key attended in request b's context.
template <typename scalar_t>
int64_t first_key(const Args<scalar_t>& a, int64_t b) {
  return a.window > 0 ? std::max<int64_t>(0, a.context_lens[b] - a.window) : 0;
}

// NV = head_dim / kLanes fixed at compile time (registers, full unrolling), or 0: from the args.
// The cache is paged, so the hardware cannot guess where the next keys are: while a tile is
// scored, the next one's slots are prefetched, one slot per key (all at once would fill the
// line-fill buffers the tile's own loads need), only the keys and values of the pass's KV
// heads (a pass of fewer heads than the slot holds would pull in lines it never reads); the
// next tile of the last one is the first of `next`, the thread's next pass (if any). Keys [start, end) of request p.b, into s (the
// queries loaded, the sums running).
template <typename scalar_t, int64_t NV>
void attend_keys(const Args<scalar_t>& a, const Pass& p, int64_t start, int64_t end,
                 const Pass* next, Scratch& s) {
  const int64_t nv = NV > 0 ? NV : a.nv;
  const scalar_t* tiles[2][kTile];  // this tile's slots and the next one's
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
    score_tile<scalar_t, NV>(a, p, tiles[k], n, nv, s, tiles[k ^ 1], n_ahead, last ? *next : p);
    softmax_update(p.rows, n, s);
    accumulate_values<scalar_t, NV>(a, p, tiles[k], n, nv, s);
  }
}

template <typename scalar_t, int64_t NV>
void attend(const Args<scalar_t>& a, const Pass& p, const Pass* next, Scratch& s) {
  const int64_t nv = NV > 0 ? NV : a.nv;
  load_queries(a, p, nv, s);
  attend_keys<scalar_t, NV>(a, p, first_key(a, p.b), a.context_lens[p.b], next, s);
  store_output(a, p, nv, s);
}

// Tasks are (request, KV head) pairs; a thread attends its consecutive tasks of one request
// in a single pass over the keys, which reads each cache slot as one contiguous run.
template <typename scalar_t, int64_t NV>
void run(const Args<scalar_t>& a, int64_t num_reqs) {
  const int64_t max_heads = std::min(kMaxRows, kScratchVecs / a.nv) / a.group;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t per = num_reqs >= 2 * threads ? a.kv_heads : 1;  // tasks handed out together
  parallel_for_rows(num_reqs, 0, num_reqs * a.kv_heads / per, 1, [&](int64_t u0, int64_t u1) {
    const int64_t begin = u0 * per, end = u1 * per;
    Scratch s;  // on the thread's stack
    const auto pass_at = [&](int64_t task) {
      const int64_t b = task / a.kv_heads, h0 = task % a.kv_heads;
      const int64_t h1 = std::min({a.kv_heads, h0 + max_heads, end - b * a.kv_heads});
      return Pass{b, h0, h1, (h1 - h0) * a.group};
    };
    for (int64_t task = begin; task < end;) {
      const Pass pass = pass_at(task);
      task += pass.h1 - pass.h0;
      const Pass next = task < end ? pass_at(task) : pass;
      attend<scalar_t, NV>(a, pass, task < end ? &next : nullptr, s);
    }
  });
}

// A run of request b's keys, [k0, k1), attended for all its heads.
struct KeyRun {
  int64_t b, k0, k1;
};

// Where (request, KV head) tasks are too few for the threads (batch 1: SmolLM2's 3 KV heads
// on 2 threads leave one a third of the time idle), each request's keys are cut into up to
// one run per thread, of at least a tile each; every run is attended for all the heads, and
// the runs' partial softmax sums merged after (flash-decoding). False where no request has
// keys enough to cut: run() then.
template <typename scalar_t, int64_t NV>
bool run_split(const Args<scalar_t>& a, int64_t num_reqs, int64_t threads) {
  std::vector<KeyRun> runs;
  std::vector<int64_t> first_run(num_reqs + 1);
  for (int64_t b = 0; b < num_reqs; ++b) {
    first_run[b] = static_cast<int64_t>(runs.size());
    const int64_t k0 = first_key(a, b), n = a.context_lens[b] - k0;
    const int64_t parts = std::clamp<int64_t>(n / kTile, 1, threads);
    for (int64_t i = 0; i < parts; ++i)
      runs.push_back({b, k0 + n * i / parts, k0 + n * (i + 1) / parts});
  }
  first_run[num_reqs] = static_cast<int64_t>(runs.size());
  if (first_run[num_reqs] == num_reqs) return false;
  const int64_t nv = NV > 0 ? NV : a.nv, heads = a.kv_heads * a.group;
  const int64_t max_heads = std::min(kMaxRows, kScratchVecs / nv) / a.group;
  // each run's unnormalized outputs, running max and sum, per head
  std::vector<fvec> acc(runs.size() * heads * nv);
  std::vector<float> run_max(runs.size() * heads), run_sum(runs.size() * heads);
  at::parallel_for(0, static_cast<int64_t>(runs.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch s;  // on the thread's stack
    for (int64_t i = begin; i < end; ++i) {
      const KeyRun& run = runs[i];
      for (int64_t h0 = 0; h0 < a.kv_heads; h0 += max_heads) {
        const int64_t h1 = std::min(a.kv_heads, h0 + max_heads);
        const Pass p{run.b, h0, h1, (h1 - h0) * a.group};
        load_queries(a, p, nv, s);
        attend_keys<scalar_t, NV>(a, p, run.k0, run.k1, nullptr, s);
        const int64_t row0 = i * heads + h0 * a.group;
        std::copy(s.acc, s.acc + p.rows * nv, acc.data() + row0 * nv);
        std::copy(s.max, s.max + p.rows, run_max.data() + row0);
        std::copy(s.sum, s.sum + p.rows, run_sum.data() + row0);
      }
    }
  });
  for (int64_t b = 0; b < num_reqs; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      float top = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t i = first_run[b]; i < first_run[b + 1]; ++i)
        top = std::max(top, run_max[i * heads + h]);
      fvec out[kMaxVecs] = {};
      for (int64_t i = first_run[b]; i < first_run[b + 1]; ++i) {
        const int64_t row = i * heads + h;
        if (run_sum[row] == 0.f) continue;  // no keys in this run
        const float w = std::exp(run_max[row] - top);
        total += run_sum[row] * w;
        for (int64_t c = 0; c < nv; ++c) out[c] += acc[row * nv + c] * w;
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;  // no keys: zeros
      scalar_t* o = a.out + (b * heads + h) * nv * kLanes;
      for (int64_t c = 0; c < nv; ++c) store(o + c * kLanes, out[c] * inv);
    }
  }
  return true;
}

template <typename scalar_t, int64_t NV>
void run_any(const Args<scalar_t>& a, int64_t num_reqs) {
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const bool few_tasks = threads > 1 && num_reqs * a.kv_heads < 2 * threads;
  if (few_tasks && run_split<scalar_t, NV>(a, num_reqs, threads)) return;
  run<scalar_t, NV>(a, num_reqs);
}

template <typename scalar_t>
void dispatch_head_dim(const Args<scalar_t>& a, int64_t num_reqs) {
  switch (a.nv) {
    case 64 / kLanes: return run_any<scalar_t, 64 / kLanes>(a, num_reqs);
    case 128 / kLanes: return run_any<scalar_t, 128 / kLanes>(a, num_reqs);
    default: return run_any<scalar_t, 0>(a, num_reqs);
  }
}

// Every context length fits its block-table row, every block id used is in the cache.
void check_tables(const torch::Tensor& tables, const torch::Tensor& lens, int64_t block_size,
                  int64_t num_blocks, int64_t window) {
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < lens.size(0); ++b) {
    TORCH_CHECK(len[b] >= 0 && len[b] <= tables.size(1) * block_size,
                "context length ", len[b], " of request ", b, " exceeds its block table");
    const int64_t start = window > 0 ? std::max<int64_t>(0, len[b] - window) : 0;
    for (int64_t k = start / block_size; k * block_size < len[b]; ++k) {
      const int64_t id = table[b * tables.stride(0) + k];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " out of range");
    }
  }
}

void check_inputs(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& cache,
                  const torch::Tensor& tables, const torch::Tensor& lens) {
  for (const auto* t : {&out, &q, &cache, &tables, &lens})
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q: (D, H, head_dim), last dim contiguous");
  TORCH_CHECK(cache.dim() == 5 && cache.size(2) == 2 && cache.is_contiguous(),
              "kv_cache: contiguous (num_blocks, block_size, 2, kv_heads, head_dim)");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, kv_cache and out must share a dtype");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out: contiguous, shaped as q");
  TORCH_CHECK(cache.size(4) == q.size(2), "head_dim of q and kv_cache differ");
  TORCH_CHECK(q.size(1) % cache.size(3) == 0, "num_heads must be a multiple of kv_heads");
  TORCH_CHECK(q.size(1) / cache.size(3) <= kMaxGroup, "more than 16 query heads per KV head");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) <= kMaxVecs * kLanes,
              "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(tables.scalar_type() == torch::kInt64 && tables.dim() == 2 &&
                  tables.stride(1) == 1 && tables.size(0) >= q.size(0),
              "block_tables: int64 (D, max_blocks), rows contiguous");
  TORCH_CHECK(lens.scalar_type() == torch::kInt64 && lens.dim() == 1 && lens.is_contiguous() &&
                  lens.size(0) == q.size(0),
              "context_lens: contiguous int64 (D,)");
}

template <typename scalar_t>
Args<scalar_t> make_args(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& cache,
                         const torch::Tensor& tables, const torch::Tensor& lens, double scale,
                         int64_t window) {
  const int64_t kv_heads = cache.size(3), head_dim = cache.size(4);
  return Args<scalar_t>{q.data_ptr<scalar_t>(), q.stride(0), q.stride(1),
                        cache.data_ptr<scalar_t>(), cache.size(1), 2 * kv_heads * head_dim,
                        kv_heads, head_dim / kLanes, q.size(1) / kv_heads,
                        tables.data_ptr<int64_t>(), tables.stride(0),
                        lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                        static_cast<float>(scale), window};
}

template <typename scalar_t>
void launch(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& cache,
            const torch::Tensor& tables, const torch::Tensor& lens, double scale,
            int64_t window) {
  const auto args = make_args<scalar_t>(out, q, cache, tables, lens, scale, window);
  ReleaseGil no_gil;
  dispatch_head_dim(args, q.size(0));
}

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache,
                            torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                            int64_t sliding_window) {
  check_inputs(out, q, kv_cache, block_tables, context_lens);
  const int64_t window = std::max<int64_t>(sliding_window, 0);
  check_tables(block_tables, context_lens, kv_cache.size(1), kv_cache.size(0), window);
  const auto launch_as = [&](auto dtype_tag) {
    launch<decltype(dtype_tag)>(out, q, kv_cache, block_tables, context_lens, scale, window);
  };
  switch (q.scalar_type()) {
    case torch::kFloat: return launch_as(float{});
    case torch::kBFloat16: return launch_as(at::BFloat16{});
    case torch::kHalf: return launch_as(at::Half{});
    default: TORCH_CHECK(false, "paged_decode_attention: fp32, bf16 or fp16 only");
  }
}
