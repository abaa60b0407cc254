#include "gemv.h"

// ---- Quantized linear layers for few rows (decode): y[M, N] = x[M, K] @ W[N, K]^T (+ bias)
// for int8 / int4 weights (formats: gemv.h), as llama.cpp computes them: x is rounded to int8
// in groups of 32 (d = max |x| / 127, q = round(x * 127 / max |x|), ties to even; the same
// rounding as layers/quant.py's `round_activations`, which the other paths apply), and each
// group of weights meets its activations in integer dot products (AVX2: maddubs / madd),
// scaled by the weight's and the activations' scales in fp32. Rows of W are spread over
// threads, each read front to back once per call; every row of x meets a row of W while it
// is in L1.

namespace {

// x (m, k) fp32 rounded per group of 32: q (m, k), scales d (m, G), and d * sum(q) (m, G).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
  QuantizedRows(const float* x, int64_t m, int64_t k)
      : q(m * k), d(m * k / kGroup), dsum(m * k / kGroup) {
    for (int64_t g = 0; g < m * k / kGroup; ++g) {
      const float* xg = x + g * kGroup;
      float amax = 0.f;
      for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::abs(xg[j]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int64_t j = 0; j < kGroup; ++j) {
        const auto v = static_cast<int8_t>(std::nearbyint(xg[j] * inv));
        q[g * kGroup + j] = v;
        sum += v;
      }
      d[g] = amax / 127.f;
      dsum[g] = d[g] * static_cast<float>(sum);
    }
  }
};

// Rows of W ahead of the reads that are prefetched: the rows are short (a few hundred bytes),
// too short for the hardware prefetcher to reach full speed on its own (int8: 1.35x).
constexpr int64_t kAhead = 8;

// R rows of W from row r against row i of x: y[r .. r + R) of that row.
template <int R, typename W>
void qdot_rows(const W& w, const QuantizedRows& x, int64_t i, int64_t k, int64_t r, float* comb,
               float* y) {
  const int64_t groups = k / kGroup;
  const int8_t* xq = x.q.data() + i * k;
  float out[R];
  v8 acc[R][2];
  for (int j = 0; j < R; ++j) {
    out[j] = w.prepare(r + j, x.d.data() + i * groups, x.dsum.data() + i * groups,
                       comb + j * groups);
    acc[j][0] = acc[j][1] = zero8();
  }
  int64_t g = 0;
  for (; g + 1 < groups; g += 2) {
    for (int j = 0; j < R; ++j) {
      __builtin_prefetch(w.at(r + j + kAhead, g), 0, 0);
      acc[j][0] = fma8(w.dot(r + j, g, xq + g * kGroup), splat8(comb[j * groups + g]), acc[j][0]);
      acc[j][1] = fma8(w.dot(r + j, g + 1, xq + (g + 1) * kGroup),
                       splat8(comb[j * groups + g + 1]), acc[j][1]);
    }
  }
  for (int j = 0; j < R; ++j) {
    if (g < groups)
      acc[j][0] = fma8(w.dot(r + j, g, xq + g * kGroup), splat8(comb[j * groups + g]), acc[j][0]);
    y[j] = out[j] + hsum8(acc[j][0] + acc[j][1]);
  }
}

// y (m, n) fp32 = rows of x against rows of W, two rows of W at a time.
template <typename W>
void qgemm(const W& w, const QuantizedRows& x, int64_t m, int64_t k, int64_t n, float* y,
           int64_t bytes_per_row) {
  // at least ~64 KiB of weights per thread: a small matrix is not worth waking the others
  const int64_t grain = std::max<int64_t>(2, (64 << 10) / bytes_per_row);
  at::parallel_for(0, (n + 1) / 2, grain / 2, [&](int64_t p0, int64_t p1) {
    std::vector<float> comb(2 * k / kGroup);
    float out[2];
    for (int64_t r = 2 * p0; r < std::min(n, 2 * p1); r += 2) {
      for (int64_t i = 0; i < m; ++i) {
        if (r + 1 < n) {
          qdot_rows<2>(w, x, i, k, r, comb.data(), out);
          y[i * n + r + 1] = out[1];
        } else {
          qdot_rows<1>(w, x, i, k, r, comb.data(), out);
        }
        y[i * n + r] = out[0];
      }
    }
  });
}

template <typename W>
torch::Tensor run_qlinear(const W& w, const torch::Tensor& x, int64_t n,
                          const std::optional<torch::Tensor>& bias, int64_t bytes_per_row) {
  return on_fp32_rows(x, n, bias, [&](const float* xf, int64_t m, int64_t k, float* y) {
    qgemm(w, QuantizedRows(xf, m, k), m, k, n, y, bytes_per_row);
  });
}

}  // namespace

// Each returns None for what it does not handle (device, dtype, layout, K not a multiple of
// 32), so that the caller falls back to PyTorch.

std::optional<torch::Tensor> linear_int8(torch::Tensor x, torch::Tensor q, torch::Tensor scales,
                                         std::optional<torch::Tensor> bias) {
  const auto w = int8_weight(q, scales);
  if (!w || !gemv_input_ok(x, w->k)) return std::nullopt;
  return run_qlinear(*w, x, q.size(0), bias, w->k);
}

std::optional<torch::Tensor> linear_int4(torch::Tensor x, torch::Tensor q, torch::Tensor scales,
                                         torch::Tensor mins, std::optional<torch::Tensor> bias) {
  const auto w = int4_weight(q, scales, mins);
  if (!w || !gemv_input_ok(x, w->k)) return std::nullopt;
  return run_qlinear(*w, x, q.size(0), bias, w->k / 2 + 4 * w->k / kGroup);
}
