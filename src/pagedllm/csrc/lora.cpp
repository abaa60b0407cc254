#include "vec.h"

// ---- A step's LoRA deltas (src/pagedllm/lora/ops.py): out[n] += B[s] (A[s] x[n]) for each
// token n whose slot s = token_slots[n] is >= 0, every adapter of the step in one call (punica's
// BGMV on the CPU). A: (slots, R, k), B: (slots, m, R); the R-vector A[s] x[n] in fp32, each
// output summed in fp32 and rounded once to the dtype. Tokens are spread over the threads.

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

// One token: t = A x (the fp32 rank vector), then out += B t, each output's row of B against t
// in SIMD lanes; the rows of part j (from parts[j]; one part where `parts` is empty) against
// t's j-th 1/parts only: a fused module's B is block-diagonal (lora/slots.py), the rest zeros.
template <typename T>
void lora_token(const T* x, const T* a, const T* b, T* out, int64_t rank, int64_t k, int64_t m,
                const std::vector<int64_t>& parts, float* t) {
  for (int64_t r = 0; r < rank; ++r) t[r] = dot_k(a + r * k, x, k);
  const auto n_parts = std::max<int64_t>(1, static_cast<int64_t>(parts.size()));
  const int64_t width = rank / n_parts;
  for (int64_t j = 0; j < n_parts; ++j) {
    const int64_t begin = parts.empty() ? 0 : parts[j];
    const int64_t end = j + 1 < n_parts ? parts[j + 1] : m;
    const float* tj = t + j * width;
    for (int64_t o = begin; o < end; ++o) {
      const float delta = dot_k(b + o * rank + j * width, tj, width);
      out[o] = static_cast<T>(static_cast<float>(out[o]) + delta);
    }
  }
}

template <typename T>
void lora_tokens(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor b,
                 const int64_t* slots, const std::vector<int64_t>& parts) {
  const int64_t n = x.size(0), k = x.size(1), rank = a.size(1), m = b.size(1);
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, rank * (k + m)));
  at::parallel_for(0, n, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> t(rank);
    for (int64_t i = t0; i < t1; ++i) {
      const int64_t s = slots[i];
      if (s < 0) continue;
      lora_token(xp + i * k, ap + s * rank * k, bp + s * m * rank, op + i * m, rank, k, m, parts,
                 t.data());
    }
  });
}

}  // namespace

// parts: the first output row of each projection fused in the module (lora/slots.py's part
// rows: [0, q, q + kv] for q/k/v), B's columns split evenly between them; empty: one part.
// False (nothing done) for what it does not handle: another device, dtypes that differ,
// layouts that are not contiguous, parts that do not split B; the caller then runs the torch
// path.
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
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  switch (dtype) {
    case torch::kFloat:
      lora_tokens<float>(out, x, a, b, slots, parts);
      return true;
    case torch::kBFloat16:
      lora_tokens<at::BFloat16>(out, x, a, b, slots, parts);
      return true;
    case torch::kHalf:
      lora_tokens<at::Half>(out, x, a, b, slots, parts);
      return true;
    default:
      return false;
  }
}
