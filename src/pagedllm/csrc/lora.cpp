#include "vec.h"

// ---- A step's LoRA deltas (src/pagedllm/lora/ops.py): out[n] += B[s] (A[s] x[n]) for each
// token n whose slot s = token_slots[n] is >= 0, every adapter of the step in one call, A: (slots,
// R, k), B: (slots, m, R). Punica's SGMV on the CPU: the tokens grouped by slot (once per call),
// then per slot the shrink T = X A[s]^T ((tokens, R) fp32, each row of A read once for all the
// slot's tokens) and the expand, B[s] in blocks of kLanes output rows transposed in registers
// (lanes = outputs) and each token's T broadcast against them: each row of B read once per call
// whatever the slot's tokens, no horizontal sums, out's rows updated kLanes outputs at a time.
// Threads split the (slot, A row) and (slot, row block) work, not the tokens. Each output is
// summed in fp32 in a fixed order (T: dot_k's; the expand: even and odd r apart, then added) and
// rounded once to the dtype: a token's deltas do not depend on the other tokens of the step.

namespace {

// a . x over k values, in fp32 (two accumulators of kLanes lanes, a scalar tail).
template <typename T, typename U>
float dot_k(const T* a, const U* x, int64_t k) {
  fvec acc0{}, acc1{};
  int64_t c = 0;
  for (; c + 2 * kLanes <= k; c += 2 * kLanes) {
    acc0 += load(a + c) * load(x + c);
    acc1 += load(a + c + kLanes) * load(x + c + kLanes);
  }
  for (; c + kLanes <= k; c += kLanes) acc0 += load(a + c) * load(x + c);
  float s = hsum(acc0 + acc1);
  for (; c < k; ++c) s += static_cast<float>(a[c]) * static_cast<float>(x[c]);
  return s;
}

// The call's tokens grouped by slot (a counting sort, in token order within a slot): group g
// is slot slot[g], its tokens order[begin[g] .. begin[g + 1]); its T block, (tokens, R) fp32,
// starts at t[begin[g] * R].
struct SlotGroups {
  std::vector<int64_t> slot, begin, order;
};

// Empty where a slot lies past the pool (`slots` of them): the call is refused.
std::optional<SlotGroups> group_by_slot(const int64_t* token_slots, int64_t n, int64_t slots) {
  std::vector<int64_t> count(slots, 0), next(slots);
  for (int64_t i = 0; i < n; ++i) {
    if (token_slots[i] >= slots) return std::nullopt;
    if (token_slots[i] >= 0) ++count[token_slots[i]];
  }
  SlotGroups g;
  g.begin.push_back(0);
  for (int64_t s = 0; s < slots; ++s) {
    next[s] = g.begin.back();
    if (count[s] == 0) continue;
    g.slot.push_back(s);
    g.begin.push_back(g.begin.back() + count[s]);
  }
  g.order.resize(g.begin.back());
  for (int64_t i = 0; i < n; ++i) {
    if (token_slots[i] >= 0) g.order[next[token_slots[i]]++] = i;
  }
  return g;
}

// A block of at most kLanes output rows [o0, o1) of part `part` (B's columns [col, col + width)).
struct RowBlock {
  int64_t col, o0, o1;
};

// B's rows in blocks of kLanes within each part (from parts[j]; one part where `parts` is
// empty), part j against T's j-th 1/parts only: a fused module's B is block-diagonal
// (lora/slots.py), the rest zeros.
std::vector<RowBlock> row_blocks(const std::vector<int64_t>& parts, int64_t m, int64_t rank) {
  const auto n_parts = std::max<int64_t>(1, static_cast<int64_t>(parts.size()));
  const int64_t width = rank / n_parts;
  std::vector<RowBlock> blocks;
  for (int64_t j = 0; j < n_parts; ++j) {
    const int64_t begin = parts.empty() ? 0 : parts[j];
    const int64_t end = j + 1 < n_parts ? parts[j + 1] : m;
    for (int64_t o = begin; o < end; o += kLanes)
      blocks.push_back({j * width, o, std::min(end, o + kLanes)});
  }
  return blocks;
}

// kLanes vectors transposed in place, v[r][l] -> v[l][r]: log2(kLanes) rounds of interleaving
// the first half's vectors with the second half's.
inline void transpose(fvec* v) {
#if defined(__AVX512F__)
  constexpr i32vec lo = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  constexpr i32vec hi = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
#else
  constexpr i32vec lo = {0, 8, 1, 9, 2, 10, 3, 11};
  constexpr i32vec hi = {4, 12, 5, 13, 6, 14, 7, 15};
#endif
  for (int64_t round = 1; round < kLanes; round *= 2) {
    fvec w[kLanes];
    for (int64_t i = 0; i < kLanes / 2; ++i) {
      w[2 * i] = __builtin_shuffle(v[i], v[i + kLanes / 2], lo);
      w[2 * i + 1] = __builtin_shuffle(v[i], v[i + kLanes / 2], hi);
    }
    std::copy(w, w + kLanes, v);
  }
}

// One block of B's rows for a group's tokens: bt = the block transposed (width rows of kLanes
// output lanes, fp32, zeros past o1), then per token out[token, o0:o1] += sum_r bt[r] T[token,
// r], T's r-th value broadcast: SIMD across the outputs, no horizontal sums.
template <typename T>
void expand_block(const T* b, const float* t, int64_t rank, int64_t width, const RowBlock& blk,
                  const int64_t* tokens, int64_t n_g, T* out, int64_t m, float* bt) {
  const int64_t rows = blk.o1 - blk.o0;
  const T* rows_b = b + blk.o0 * rank + blk.col;
  int64_t r0 = 0;
  for (; r0 + kLanes <= width; r0 += kLanes) {  // kLanes x kLanes tiles in registers
    fvec v[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) v[l] = l < rows ? load(rows_b + l * rank + r0) : fvec{};
    transpose(v);
    for (int64_t l = 0; l < kLanes; ++l) store(bt + (r0 + l) * kLanes, v[l]);
  }
  for (int64_t l = 0; l < kLanes; ++l) {
    for (int64_t r = r0; r < width; ++r)
      bt[r * kLanes + l] = l < rows ? static_cast<float>(rows_b[l * rank + r]) : 0.f;
  }
  for (int64_t i = 0; i < n_g; ++i) {
    const float* ti = t + i * rank + blk.col;
    fvec acc0{}, acc1{};
    int64_t r = 0;
    for (; r + 2 <= width; r += 2) {
      acc0 += load(bt + r * kLanes) * ti[r];
      acc1 += load(bt + (r + 1) * kLanes) * ti[r + 1];
    }
    if (r < width) acc0 += load(bt + r * kLanes) * ti[r];
    const fvec acc = acc0 + acc1;
    T* dst = out + tokens[i] * m + blk.o0;
    if (rows == kLanes) {
      store(dst, load(dst) + acc);
    } else {
      for (int64_t l = 0; l < rows; ++l)
        dst[l] = static_cast<T>(static_cast<float>(dst[l]) + acc[l]);
    }
  }
}

template <typename T>
void lora_groups(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor b,
                 const SlotGroups& g, const std::vector<int64_t>& parts) {
  const int64_t k = x.size(1), rank = a.size(1), m = b.size(1);
  const auto groups = static_cast<int64_t>(g.slot.size());
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* op = out.data_ptr<T>();
  std::vector<float> t(g.begin.back() * rank);
  // shrink: work items (group, rank row r), each row of A[s] read once for the group's tokens
  const int64_t tokens_per_group = std::max<int64_t>(1, g.begin.back() / groups);
  parallel_chunks(0, groups * rank, std::max<int64_t>(1, 16384 / (k * tokens_per_group)),
                  [&](int64_t i0, int64_t i1) {
                    for (int64_t i = i0; i < i1; ++i) {
                      const int64_t gi = i / rank, r = i % rank;
                      const T* row = ap + (g.slot[gi] * rank + r) * k;
                      for (int64_t j = g.begin[gi]; j < g.begin[gi + 1]; ++j)
                        t[j * rank + r] = dot_k(row, xp + g.order[j] * k, k);
                    }
                  });
  // expand: work items (group, block of B's rows), each row of B[s] read once
  const auto n_parts = std::max<int64_t>(1, static_cast<int64_t>(parts.size()));
  const int64_t width = rank / n_parts;
  const auto blocks = row_blocks(parts, m, rank);
  const auto n_blocks = static_cast<int64_t>(blocks.size());
  parallel_chunks(0, groups * n_blocks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> bt(width * kLanes);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t gi = i / n_blocks;
      expand_block(bp + g.slot[gi] * m * rank, t.data() + g.begin[gi] * rank, rank, width,
                   blocks[i % n_blocks], g.order.data() + g.begin[gi],
                   g.begin[gi + 1] - g.begin[gi], op, m, bt.data());
    }
  });
}

}  // namespace

// parts: the first output row of each projection fused in the module (lora/slots.py's part
// rows: [0, q, q + kv] for q/k/v), B's columns split evenly between them; empty: one part.
// False (nothing done) for what it does not handle: another device, dtypes that differ,
// layouts that are not contiguous, parts that do not split B, a slot past the pool; the
// caller then runs the torch path.
bool lora_bgmv(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor b,
               torch::Tensor token_slots, std::vector<int64_t> parts) {
  ReleaseGil no_gil;
  const auto dtype = x.scalar_type();
  for (const auto& t : {out, x, a, b}) {
    if (!t.device().is_cpu() || t.scalar_type() != dtype || !t.is_contiguous()) return false;
  }
  if (x.dim() != 2 || a.dim() != 3 || b.dim() != 3 || out.dim() != 2 ||
      token_slots.scalar_type() != torch::kLong || !token_slots.is_contiguous() ||
      token_slots.numel() != x.size(0) || out.size(0) != x.size(0) || a.size(2) != x.size(1) ||
      b.size(2) != a.size(1) || out.size(1) != b.size(1) || a.size(0) != b.size(0)) {
    return false;
  }
  if (!parts.empty()) {
    const auto n = static_cast<int64_t>(parts.size());
    if (parts[0] != 0 || a.size(1) % n != 0) return false;
    for (int64_t j = 1; j < n; ++j) {
      if (parts[j] < parts[j - 1] || parts[j] > b.size(1)) return false;
    }
  }
  const auto groups =
      group_by_slot(token_slots.data_ptr<int64_t>(), x.size(0), a.size(0));
  if (!groups) return false;
  if (groups->slot.empty()) return true;
  switch (dtype) {
    case torch::kFloat:
      lora_groups<float>(out, x, a, b, *groups, parts);
      return true;
    case torch::kBFloat16:
      lora_groups<at::BFloat16>(out, x, a, b, *groups, parts);
      return true;
    case torch::kHalf:
      lora_groups<at::Half>(out, x, a, b, *groups, parts);
      return true;
    default:
      return false;
  }
}
