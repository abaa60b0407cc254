// Paged decode attention on the CPU (see layers/attention/cpu_kernels.py): the passes of
// paged_attention.h spread over the threads, the inputs checked, the entry point.
#include "paged_attention.h"

namespace {

// Tasks are (request, KV head) pairs; a thread attends its consecutive tasks of one request
// in a single pass over the keys, which reads each cache slot as one contiguous run.
template <typename scalar_t, typename cache_t, int64_t NV>
void run(const Args<scalar_t, cache_t>& a, int64_t num_reqs, int64_t threads) {
  const int64_t max_heads = std::min(kMaxRows, kScratchVecs / a.nv) / a.group;
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
      attend<scalar_t, cache_t, NV>(a, pass, task < end ? &next : nullptr, s);
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
template <typename scalar_t, typename cache_t, int64_t NV>
bool run_split(const Args<scalar_t, cache_t>& a, int64_t num_reqs, int64_t threads) {
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
        attend_keys<scalar_t, cache_t, NV>(a, p, run.k0, run.k1, nullptr, s);
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
      if (a.sinks != nullptr) {  // one more key in the denominator, without a value
        top = std::max(top, a.sinks[h]);
        total = std::exp(a.sinks[h] - top);
      }
      fvec out[kMaxVecs] = {};
      for (int64_t i = first_run[b]; i < first_run[b + 1]; ++i) {
        const int64_t row = i * heads + h;
        if (run_sum[row] == 0.f) continue;  // no keys in this run
        const float w = std::exp(run_max[row] - top);
        total += run_sum[row] * w;
        for (int64_t c = 0; c < nv; ++c) out[c] += acc[row * nv + c] * w;
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;  // no keys: zeros (or sink only)
      scalar_t* o = a.out + (b * heads + h) * nv * kLanes;
      for (int64_t c = 0; c < nv; ++c) store(o + c * kLanes, out[c] * inv);
    }
  }
  return true;
}

template <typename scalar_t, typename cache_t, int64_t NV>
void run_any(const Args<scalar_t, cache_t>& a, int64_t num_reqs) {
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const bool few_tasks = threads > 1 && num_reqs * a.kv_heads < 2 * threads;
  if (few_tasks && run_split<scalar_t, cache_t, NV>(a, num_reqs, threads)) return;
  run<scalar_t, cache_t, NV>(a, num_reqs, threads);
}

template <typename scalar_t, typename cache_t>
void dispatch_head_dim(const Args<scalar_t, cache_t>& a, int64_t num_reqs) {
  switch (a.nv) {
    case 64 / kLanes: return run_any<scalar_t, cache_t, 64 / kLanes>(a, num_reqs);
    case 128 / kLanes: return run_any<scalar_t, cache_t, 128 / kLanes>(a, num_reqs);
    default: return run_any<scalar_t, cache_t, 0>(a, num_reqs);
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
                  const torch::Tensor& tables, const torch::Tensor& lens,
                  const std::optional<torch::Tensor>& sinks) {
  if (sinks)
    TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == torch::kFloat &&
                    sinks->dim() == 1 && sinks->is_contiguous() && sinks->size(0) == q.size(1),
                "sinks: contiguous fp32 (H,) on the CPU, one per query head");
  for (const auto* t : {&out, &q, &cache, &tables, &lens})
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q: (D, H, head_dim), last dim contiguous");
  TORCH_CHECK(cache.dim() == 5 && cache.size(2) == 2 && cache.is_contiguous(),
              "kv_cache: contiguous (num_blocks, block_size, 2, kv_heads, head_dim)");
  const bool int8 = cache.scalar_type() == torch::kChar;  // rows of values, then their scale
  TORCH_CHECK((int8 || cache.scalar_type() == q.scalar_type()) &&
                  out.scalar_type() == q.scalar_type(),
              "q and out must share a dtype, and kv_cache too unless it is int8");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out: contiguous, shaped as q");
  TORCH_CHECK(cache.size(4) == q.size(2) + (int8 ? 4 : 0),
              "kv_cache rows: head_dim (+ 4 bytes of scale for int8) of q");
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

template <typename scalar_t, typename cache_t>
Args<scalar_t, cache_t> make_args(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& cache,
                         const torch::Tensor& tables, const torch::Tensor& lens, double scale,
                         int64_t window, double softcap, const float* sinks) {
  const int64_t kv_heads = cache.size(3), head_dim = q.size(2), row = cache.size(4);
  return Args<scalar_t, cache_t>{q.data_ptr<scalar_t>(), q.stride(0), q.stride(1),
                                 cache.data_ptr<cache_t>(), cache.size(1), 2 * kv_heads * row,
                                 kv_heads, head_dim / kLanes, q.size(1) / kv_heads,
                                 tables.data_ptr<int64_t>(), tables.stride(0),
                                 lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                                 static_cast<float>(scale), window, static_cast<float>(softcap),
                                 sinks, row};
}

template <typename scalar_t, typename cache_t>
void launch(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& cache,
            const torch::Tensor& tables, const torch::Tensor& lens, double scale,
            int64_t window, double softcap, const float* sinks) {
  const auto args =
      make_args<scalar_t, cache_t>(out, q, cache, tables, lens, scale, window, softcap, sinks);
  ReleaseGil no_gil;
  dispatch_head_dim(args, q.size(0));
}

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache,
                            torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                            int64_t sliding_window, double softcap,
                            std::optional<torch::Tensor> sinks) {
  check_inputs(out, q, kv_cache, block_tables, context_lens, sinks);
  TORCH_CHECK(softcap >= 0.0, "paged_decode_attention: softcap must be >= 0 (0: none)");
  const int64_t window = std::max<int64_t>(sliding_window, 0);
  check_tables(block_tables, context_lens, kv_cache.size(1), kv_cache.size(0), window);
  const float* sink_logits = sinks ? sinks->data_ptr<float>() : nullptr;
  const bool int8 = kv_cache.scalar_type() == torch::kChar;
  const auto launch_as = [&](auto dtype_tag) {
    using scalar_t = decltype(dtype_tag);
    if (int8)
      launch<scalar_t, int8_t>(out, q, kv_cache, block_tables, context_lens, scale, window,
                               softcap, sink_logits);
    else
      launch<scalar_t, scalar_t>(out, q, kv_cache, block_tables, context_lens, scale, window,
                                 softcap, sink_logits);
  };
  switch (q.scalar_type()) {
    case torch::kFloat: return launch_as(float{});
    case torch::kBFloat16: return launch_as(at::BFloat16{});
    case torch::kHalf: return launch_as(at::Half{});
    default: TORCH_CHECK(false, "paged_decode_attention: fp32, bf16 or fp16 only");
  }
}
