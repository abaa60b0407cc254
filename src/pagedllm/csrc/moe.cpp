#include "gemv.h"

// ---- Mixture-of-experts in one call (layers/moe.py): N tokens, each routed to k of E experts
// with weights, through every expert's gated MLP `down(act(gate(x)) * up(x))`, the k outputs
// of each token weighted and summed in fp32. The (token, k) pairs are grouped by expert (a
// counting sort: "slots", each expert's consecutive, its tokens in order), then:
//   1. each expert's rows of x gathered in fp32 (and rounded to int8 for a quantized w13);
//   2. gate/up: tiles of (expert, block of rows of I), the block's gate rows and up rows
//      against the expert's rows of x, + bias, act(gate) * up into h (slots, I);
//   3. down: tiles of (expert, block of rows of H), the expert's rows of h (rounded first for
//      a quantized w2) into y (slots, H) + bias; then each token's k rows of y weighted and
//      summed into the output, in x's dtype.
// The tiles of all experts are shared out to the threads at once (at batch 1 with top-8 each
// expert has one row: no expert alone keeps two threads busy) by parallel_for_rows (vec.h):
// in equal ranges where every expert has one row (long sequential reads: 5-15% faster at
// batch 1 than chunks), else in chunks of consecutive tiles to whichever thread is free. Each
// thread so reads the experts' weights in memory order, a tile's rows after the previous
// tile's. The dense kernel is moe_gemm.cpp's (fp32 / bf16 / fp16: register tiles of 4 rows of
// W against up to 6 of x, prefetching ahead of the stream); the quantized ones qgemv.cpp's
// (int8 / int4 rows, x rounded to int8 in groups of 32; qgemv_row.cpp's for an expert's single
// row) on a range of rows of one expert's weight. Packed weights are not taken.

namespace {

enum class MoeAct { kSilu, kGeluTanh, kGelu, kSwigluOai };
constexpr float kOaiAlpha = 1.702f;  // gpt-oss's sigmoid slope (layers/moe.py OAI_ALPHA)

std::optional<MoeAct> moe_activation(const std::string& name) {
  if (name == "silu") return MoeAct::kSilu;
  if (name == "gelu_tanh") return MoeAct::kGeluTanh;
  if (name == "gelu") return MoeAct::kGelu;
  if (name == "swiglu_oai") return MoeAct::kSwigluOai;
  return std::nullopt;
}

// out[c] = act(gate[c]) * up[c] for c < n (a multiple of kLanes), in fp32 (layers/moe.py's
// gated_act).
void gated_row(const float* gate, const float* up, float* out, int64_t n, MoeAct act, float limit) {
  const fvec lim = fvec{} + limit;
  for (int64_t c = 0; c < n; c += kLanes) {
    fvec g = load(gate + c), u = load(up + c);
    if (act == MoeAct::kSilu) {
      g = g / (1.f + exp_vec(-g));
    } else if (act == MoeAct::kGeluTanh) {
      g = 0.5f * g * (1.f + tanh_vec(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    } else if (act == MoeAct::kGelu) {  // erf lane by lane
      for (int64_t l = 0; l < kLanes; ++l) g[l] = 0.5f * g[l] * (1.f + std::erf(g[l] * 0.70710678f));
    } else {
      g = g < lim ? g : lim;
      u = u < lim ? u : lim;
      u = (u > -lim ? u : -lim) + 1.f;
      g = g / (1.f + exp_vec(-kOaiAlpha * g));
    }
    store(out + c, g * u);
  }
}

// The rows of x (or h) that meet one expert's weight: m rows of k fp32 values, and (for a
// quantized weight) the same rounded to int8 as qgemv.cpp takes them, or as qgemv_row.cpp
// takes a single row (as linear_int8 / int4 do: its kernel is the faster on one row).
struct ExpertRows {
  const float* x = nullptr;
  int64_t m = 0;
  std::optional<QuantizedRows> q;
  std::optional<RoundedRow> one;
};

// One layer of every expert, stacked (E, n, k), in a format of gemv.h:
// `rows(e, in, r0, r1, y, ld)` computes rows [r0, r1) (r0 a multiple of 4) of expert e's
// weight against its rows: y[i * ld + r] = in_i . w_r.
template <typename T>
struct DenseExperts {
  const T* w;
  int64_t n, k;
  static constexpr bool kRounded = false, kInterleaved = false;
  int64_t row_bytes() const { return k * static_cast<int64_t>(sizeof(T)); }
  void rows(int64_t e, const ExpertRows& in, int64_t r0, int64_t r1, float* y, int64_t ld) const {
    expert_gemm(w + e * n * k, k, in.x, in.m, r0, r1, y, ld);  // moe_gemm.cpp
  }
};

// Rows [r0, r1) of a quantized weight against one rounded row (qgemv_one's loop).
template <typename W>
void quantized_one(const W& w, const RoundedRow& x, int64_t r0, int64_t r1, float* y) {
  const int64_t groups = w.k / kGroup;
  thread_local std::vector<float> comb;
  if (static_cast<int64_t>(comb.size()) < groups) comb.resize(groups);
  for (int64_t r = r0; r < r1; ++r)
    y[r] = fold_row(w, r, x, comb.data()) + group_sum(w, r, x.q.data(), groups, comb.data());
}

struct Int8Experts {
  Int8W w;  // expert 0's
  int64_t n;
  static constexpr bool kRounded = true, kInterleaved = false;
  int64_t row_bytes() const { return w.k; }
  void rows(int64_t e, const ExpertRows& in, int64_t r0, int64_t r1, float* y, int64_t ld) const {
    Int8W we = w;
    we.q += e * n * w.k;
    we.scales += e * n * w.scales_per_row;
    if (in.one)
      quantized_one(we, *in.one, r0, r1, y);
    else if (w.scales_per_row == 1)
      quantized_rows(Int8Rows<true>{we}, *in.q, in.m, w.k, r0, r1, y, ld);
    else
      quantized_rows(Int8Rows<false>{we}, *in.q, in.m, w.k, r0, r1, y, ld);
  }
};

struct Int4Experts {
  Int4W w;  // expert 0's
  int64_t n;
  static constexpr bool kRounded = true, kInterleaved = Int4Rows::kInterleaved;
  int64_t row_bytes() const { return w.k / 2 + 4 * w.k / kGroup; }
  void rows(int64_t e, const ExpertRows& in, int64_t r0, int64_t r1, float* y, int64_t ld) const {
    Int4W we = w;
    we.q += e * n * (w.k / 2);
    we.scales += e * n * (w.k / kGroup);
    we.mins += e * n * (w.k / kGroup);
    if (in.one)
      quantized_one(we, *in.one, r0, r1, y);
    else
      quantized_rows(Int4Rows{we}, *in.q, in.m, w.k, r0, r1, y, ld);
  }
};

// Calls fn(experts) for the stacked weight `parts` of E experts of (n, k): [w] dense, or
// [q, scales] int8 or [q, scales, mins] int4 (3-D, contiguous, the expert dim leading; empty
// tensors for what is absent). False, without calling it, for what the kernels do not take.
template <typename Fn>
bool with_experts(const std::vector<torch::Tensor>& parts, int64_t experts, int64_t n, int64_t k,
                  Fn&& fn) {
  const torch::Tensor& w = parts.at(0);
  const auto stacked = [&](size_t i) {
    return parts.size() > i && parts[i].device().is_cpu() && parts[i].dim() == 3 &&
           parts[i].size(0) == experts && parts[i].is_contiguous();
  };
  if (experts == 0 || !stacked(0) || w.size(1) != n || k % kGroup != 0) return false;
  switch (w.scalar_type()) {
    case torch::kChar: {
      const auto one = stacked(1) ? int8_weight(w[0], parts[1][0]) : std::nullopt;
      if (!one || one->k != k) return false;
      fn(Int8Experts{*one, n});
      return true;
    }
    case torch::kByte: {
      const auto one = stacked(1) && stacked(2) ? int4_weight(w[0], parts[1][0], parts[2][0])
                                                : std::nullopt;
      if (!one || one->k != k) return false;
      fn(Int4Experts{*one, n});
      return true;
    }
    default: break;
  }
  if (w.size(2) != k || !supported(w)) return false;
  dispatch_float_dtype(w, [&](auto tag) {
    fn(DenseExperts<decltype(tag)>{w.data_ptr<decltype(tag)>(), n, k});
  });
  return true;
}

// The (token, k) pairs grouped by expert: pair p = t * k + j is at slot[p]; token[s] is the
// token at slot s; the a-th expert that has tokens, expert[a], holds slots [start[a],
// start[a + 1]) (its tokens in order).
struct Routing {
  std::vector<int64_t> slot, token, expert, start;
  int64_t max_rows = 0;  // the most slots of one expert
};

Routing route(const torch::Tensor& ids, int64_t experts) {
  const int64_t pairs = ids.numel(), k = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> next(experts + 1, 0);  // counts, then each expert's next free slot
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < experts, "fused_moe: expert id ", id[p], " of ", experts);
    ++next[id[p] + 1];
  }
  Routing r;
  for (int64_t e = 0; e < experts; ++e) {
    if (next[e + 1] > 0) {
      r.expert.push_back(e);
      r.start.push_back(next[e]);
      r.max_rows = std::max(r.max_rows, next[e + 1]);
    }
    next[e + 1] += next[e];
  }
  r.start.push_back(pairs);
  r.slot.resize(pairs);
  r.token.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t s = next[id[p]]++;
    r.slot[p] = s;
    r.token[s] = p / k;
  }
  return r;
}

// One ExpertRows per expert with tokens over rows (slots, k) fp32: `fill(a)` first writes
// expert a's rows (or nothing), then (quantized formats) they are rounded.
template <typename S, typename Fill>
std::vector<ExpertRows> expert_rows(const Routing& r, const float* rows, int64_t k, const Fill& fill) {
  const auto active = static_cast<int64_t>(r.expert.size());
  std::vector<ExpertRows> in(active);
  const auto prepare = [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {
      fill(a);
      in[a] = {rows + r.start[a] * k, r.start[a + 1] - r.start[a]};
      if (!S::kRounded) continue;
      if (in[a].m == 1)
        in[a].one.emplace(in[a].x, k);
      else
        in[a].q.emplace(in[a].x, in[a].m, k, S::kInterleaved);
    }
  };
  const int64_t per_expert = r.start.back() * k / std::max<int64_t>(active, 1);  // values
  at::parallel_for(0, active, std::max<int64_t>(1, 16384 / std::max<int64_t>(per_expert, 1)), prepare);
  return in;
}

// Rows of W per tile: about 32 KiB of weights, a multiple of 32 (I and H are too): whole
// blocks of 4 for gemm_blocks, whole vectors for the activation and the sums.
int64_t tile_rows(int64_t row_bytes) {
  return std::max<int64_t>(kGroup, (32 << 10) / row_bytes / kGroup * kGroup);
}

// row[c] += bias[e, c] for c in [c0, c1), bias (E, n) of a float dtype.
void add_bias(float* row, const torch::Tensor& bias, int64_t e, int64_t c0, int64_t c1) {
  dispatch_float_dtype(bias, [&](auto tag) {
    const auto* b = bias.data_ptr<decltype(tag)>() + e * bias.size(1);
    for (int64_t c = c0; c < c1; ++c) row[c] += static_cast<float>(b[c]);
  });
}

// Step 2: h (slots, inter) = act(gate) * up, gate_up (slots, 2 * inter) the scratch.
template <typename S>
void moe_gate_up(const S& w, const Routing& r, const std::vector<ExpertRows>& in,
                 const std::optional<torch::Tensor>& bias, MoeAct act, float limit, int64_t inter,
                 float* gate_up, float* h) {
  const int64_t block = tile_rows(w.row_bytes()), blocks = (inter + block - 1) / block;
  const auto tiles = static_cast<int64_t>(r.expert.size()) * blocks;
  parallel_for_rows(r.max_rows, 0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t a = t / blocks, j0 = t % blocks * block, j1 = std::min(inter, j0 + block);
      const int64_t e = r.expert[a], s0 = r.start[a];
      float* y = gate_up + s0 * 2 * inter;
      w.rows(e, in[a], j0, j1, y, 2 * inter);
      w.rows(e, in[a], inter + j0, inter + j1, y, 2 * inter);
      for (int64_t i = 0; i < in[a].m; ++i) {
        float* row = y + i * 2 * inter;
        if (bias) {
          add_bias(row, *bias, e, j0, j1);
          add_bias(row, *bias, e, inter + j0, inter + j1);
        }
        gated_row(row + j0, row + inter + j0, h + (s0 + i) * inter + j0, j1 - j0, act, limit);
      }
    }
  });
}

// Step 3: y (slots, hidden) = down(h) + bias, in tiles of (expert, block of rows of H); then
// out (tokens, hidden) in T = the sum over each token's k slots of weight * y.
template <typename S, typename T>
void moe_down(const S& w, const Routing& r, const std::vector<ExpertRows>& in,
              const std::optional<torch::Tensor>& bias, const float* weights, int64_t k,
              int64_t hidden, float* y, T* out) {
  const int64_t block = tile_rows(w.row_bytes()), blocks = (hidden + block - 1) / block;
  const auto tiles = static_cast<int64_t>(r.expert.size()) * blocks;
  parallel_for_rows(r.max_rows, 0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t a = t / blocks, c0 = t % blocks * block, c1 = std::min(hidden, c0 + block);
      const int64_t e = r.expert[a], s0 = r.start[a];
      w.rows(e, in[a], c0, c1, y + s0 * hidden, hidden);
      if (bias)
        for (int64_t i = 0; i < in[a].m; ++i) add_bias(y + (s0 + i) * hidden, *bias, e, c0, c1);
    }
  });
  const auto tokens = static_cast<int64_t>(r.slot.size()) / k;
  at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / (k * hidden)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t* slots = r.slot.data() + t * k;
      const float* wt = weights + t * k;
      for (int64_t c = 0; c < hidden; c += kLanes) {
        fvec acc{};
        for (int64_t j = 0; j < k; ++j) acc += wt[j] * load(y + slots[j] * hidden + c);
        store(out + t * hidden + c, acc);
      }
    }
  });
}

// A bias (E, n) the kernel takes: absent, or contiguous of a float dtype (elementwise.cpp).
bool moe_bias_ok(const std::optional<torch::Tensor>& b, int64_t experts, int64_t n) {
  return !b || (supported(*b) && b->dim() == 2 && b->size(0) == experts && b->size(1) == n &&
                b->is_contiguous());
}

// Up to how many fp32 values of scratch stay with the calling thread between calls.
constexpr int64_t kMoeScratchFloats = 1 << 22;

}  // namespace

// x (N, H) fp32 / bf16 / fp16; topk_weights (N, k) fp32 and topk_ids (N, k) int64, contiguous;
// w13 the experts' gate/up (E, 2I, H) and w2 their down (E, H, I), each [w] dense or
// [q, scales(, mins)] quantized (gemv.h's formats with the expert dim leading, in rows; empty
// tensors for what is absent); b13 (E, 2I) and b2 (E, H) or None; activation "silu",
// "gelu_tanh", "gelu" or "swiglu_oai" (gate clamped above at `limit`, up to +-limit).
// Returns (N, H) in x's dtype, or None for what the kernel does not take (a format, dtype or
// shape; an expert with more than max_rows tokens where max_rows >= 0): the caller's loop.
std::optional<torch::Tensor> fused_moe(torch::Tensor x, torch::Tensor topk_weights,
                                       torch::Tensor topk_ids, std::vector<torch::Tensor> w13,
                                       std::optional<torch::Tensor> b13,
                                       std::vector<torch::Tensor> w2,
                                       std::optional<torch::Tensor> b2, std::string activation,
                                       double limit, int64_t max_rows) {
  ReleaseGil no_gil;
  const auto act = moe_activation(activation);
  if (!act || x.dim() != 2 || !supported(x) || w13.empty() || w2.empty() || w13[0].dim() != 3)
    return std::nullopt;
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = w13[0].size(0);
  const int64_t inter = w13[0].size(1) / 2;
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == tokens &&
                  topk_ids.scalar_type() == torch::kLong && topk_ids.is_contiguous() &&
                  topk_weights.sizes() == topk_ids.sizes() &&
                  topk_weights.scalar_type() == torch::kFloat && topk_weights.is_contiguous(),
              "fused_moe: topk_ids int64 and topk_weights fp32, (N, k), contiguous");
  const auto check_only = [](const auto&) {};
  if (!with_experts(w2, experts, hidden, inter, check_only) ||
      !with_experts(w13, experts, 2 * inter, hidden, check_only) ||
      !moe_bias_ok(b13, experts, 2 * inter) || !moe_bias_ok(b2, experts, hidden))
    return std::nullopt;
  const int64_t k = topk_ids.size(1), slots = tokens * k;
  const Routing r = route(topk_ids, experts);
  if (max_rows >= 0 && r.max_rows > max_rows) return std::nullopt;
  x = x.contiguous();
  torch::Tensor out = torch::empty({tokens, hidden}, x.options());
  if (slots == 0) return out.zero_();

  // scratch: rows of x (slots, H), reused for y (slots, H); gate_up (slots, 2I); h (slots, I)
  const int64_t floats = slots * (hidden + 3 * inter);
  thread_local std::vector<float> scratch;
  torch::Tensor large;
  float* xs;
  if (floats <= kMoeScratchFloats) {
    if (static_cast<int64_t>(scratch.size()) < floats) scratch.resize(floats);
    xs = scratch.data();
  } else {
    large = torch::empty({floats}, x.options().dtype(torch::kFloat));
    xs = large.data_ptr<float>();
  }
  float *gate_up = xs + slots * hidden, *h = gate_up + slots * 2 * inter;
  const auto fl = static_cast<float>(limit);

  dispatch_float_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const auto gather = [&](int64_t a) {  // expert a's rows of x, in fp32
      for (int64_t s = r.start[a]; s < r.start[a + 1]; ++s) {
        const T* src = xp + r.token[s] * hidden;
        for (int64_t c = 0; c < hidden; c += kLanes) store(xs + s * hidden + c, load(src + c));
      }
    };
    with_experts(w13, experts, 2 * inter, hidden, [&](const auto& w) {
      using S = std::decay_t<decltype(w)>;
      const auto in = expert_rows<S>(r, xs, hidden, gather);
      moe_gate_up(w, r, in, b13, *act, fl, inter, gate_up, h);
    });
    with_experts(w2, experts, hidden, inter, [&](const auto& w) {
      using S = std::decay_t<decltype(w)>;
      const auto in = expert_rows<S>(r, h, inter, [](int64_t) {});
      moe_down(w, r, in, b2, topk_weights.data_ptr<float>(), k, hidden, xs, out.data_ptr<T>());
    });
  });
  return out;
}
