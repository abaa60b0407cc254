#include "gemv.h"

// ---- Dense linear layers for few rows (decode): y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
// reading each weight once per call, at the memory-bandwidth bound; and the quantized
// formats decoded whole (for many rows of x, where a dense matmul wins). Formats: gemv.h.
// Rows of W are spread over threads, each thread reading its rows front to back (one
// sequential stream: interleaving several rows starves the hardware prefetcher). One row of x:
// each group of W is converted to fp32 lanes in registers and multiplied at once; several
// rows: a block of 4 rows of W is converted once into a small buffer and reused by every row
// of x. Sums in fp32; x and y in fp32 / bf16 / fp16. K must be a multiple of 32 (callers fall
// back to PyTorch otherwise).

namespace {

constexpr int64_t kRowBlock = 4;  // rows of W converted at once for several rows of x

// How far ahead of its reads one row of x prefetches the weight stream (rows are contiguous
// and read front to back): the hardware prefetcher alone leaves bandwidth unused on rows of a
// few KiB (Intel with AVX-512: lm_head 16 -> 21 GB/s in fp32, benchmarks/gemv_bench.py).
constexpr int64_t kPrefetchBytes = 8192;

template <typename T>
inline void prefetch_group(const T* p) {
  const char* ahead = reinterpret_cast<const char*>(p) + kPrefetchBytes;
  for (int64_t b = 0; b < kGroup * static_cast<int64_t>(sizeof(T)); b += 64)
    __builtin_prefetch(ahead + b, 0, 3);  // past the weight's end it is a no-op
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One row of x, one row n of a dense W: its dot product, 16 lanes wide.
template <typename T>
float gemv_row(const DenseW<T>& w, const float* x, int64_t k, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  const T* p = w.w + n * k;
  for (int64_t i = 0; i < k; i += kGroup) {
    prefetch_group(p + i);
    a0 = _mm512_fmadd_ps(load16(p + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(load16(p + i + 16), _mm512_loadu_ps(x + i + 16), a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
#else
// One row of x, one row n of a dense W: its dot product (four accumulators in flight).
template <typename T>
float gemv_row(const DenseW<T>& w, const float* x, int64_t k, int64_t n) {
  v8 acc[4] = {zero8(), zero8(), zero8(), zero8()};
  for (int64_t g = 0; g < k / kGroup; ++g) {
    prefetch_group(w.w + n * k + g * kGroup);
    v8 wv[4];
    w.group(n, g, nullptr, nullptr, wv);
    for (int i = 0; i < 4; ++i) acc[i] = fma8(wv[i], load8(x + g * kGroup + 8 * i), acc[i]);
  }
  return hsum8((acc[0] + acc[1]) + (acc[2] + acc[3]));
}
#endif

// Row n of W decoded to fp32 into out (k values).
template <typename W>
void decode_row(const W& w, int64_t n, int64_t k, float* out, float* sc, float* mn) {
  w.begin_row(n, sc, mn);
  for (int64_t g = 0; g < k / kGroup; ++g) {
    v8 wv[4];
    w.group(n, g, sc, mn, wv);
    for (int i = 0; i < 4; ++i) store8(out + g * kGroup + 8 * i, wv[i]);
  }
}

// R dot products of x with R decoded rows (x read once for all of them).
template <int R>
void dots(const float* x, const float* rows, int64_t k, float* y) {
  v8 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zero8();
  for (int64_t i = 0; i < k; i += 8) {
    const v8 xv = load8(x + i);
    for (int r = 0; r < R; ++r) acc[r] = fma8(load8(rows + r * k + i), xv, acc[r]);
  }
  for (int r = 0; r < R; ++r) y[r] = hsum8(acc[r]);
}

// y (m, n) fp32 = x (m, k) fp32 @ W^T for a dense W, rows of W spread over threads.
template <typename T>
void gemm_small(const DenseW<T>& w, const float* x, int64_t m, int64_t k, int64_t n, float* y) {
  const int64_t bytes_per_row = k * static_cast<int64_t>(sizeof(T));
  const int64_t blocks = (n + kRowBlock - 1) / kRowBlock;
  // at least ~64 KiB of weights per thread: a small matrix is not worth waking the others
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (bytes_per_row * kRowBlock));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> rows(m > 1 ? kRowBlock * k : 0);
    float out[kRowBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * kRowBlock, count = std::min(kRowBlock, n - r0);
      if (m == 1) {
        for (int64_t r = r0; r < r0 + count; ++r) y[r] = gemv_row(w, x, k, r);
        continue;
      }
      for (int64_t r = 0; r < count; ++r)
        decode_row(w, r0 + r, k, rows.data() + r * k, nullptr, nullptr);  // no scales
      for (int64_t i = 0; i < m; ++i) {
        if (count == kRowBlock) {
          dots<kRowBlock>(x + i * k, rows.data(), k, out);
        } else {
          for (int64_t r = 0; r < count; ++r) dots<1>(x + i * k, rows.data() + r * k, k, out + r);
        }
        for (int64_t r = 0; r < count; ++r) y[i * n + r0 + r] = out[r];
      }
    }
  });
}

// gemm_small on x (any float dtype): y in x's dtype, plus the bias.
template <typename T>
torch::Tensor run_linear(const DenseW<T>& w, const torch::Tensor& x, int64_t n,
                         const std::optional<torch::Tensor>& bias) {
  return on_fp32_rows(x, n, bias, [&](const float* xf, int64_t m, int64_t k, float* y) {
    gemm_small(w, xf, m, k, n, y);
  });
}

}  // namespace

// Each returns None for what it does not handle (device, dtype, layout, K not a multiple of
// 32), so that the caller falls back to PyTorch.

std::optional<torch::Tensor> linear_dense(torch::Tensor x, torch::Tensor w,
                                          std::optional<torch::Tensor> bias) {
  const int64_t n = w.size(0), k = w.size(1);
  if (!gemv_input_ok(x, k) || !weight_ok(w, n, k, w.scalar_type())) return std::nullopt;
  switch (w.scalar_type()) {
    case torch::kFloat:
      return run_linear(DenseW<float>{w.data_ptr<float>(), k}, x, n, bias);
    case torch::kBFloat16:
      return run_linear(DenseW<at::BFloat16>{w.data_ptr<at::BFloat16>(), k}, x, n, bias);
    case torch::kHalf:
      return run_linear(DenseW<at::Half>{w.data_ptr<at::Half>(), k}, x, n, bias);
    default:
      return std::nullopt;
  }
}

namespace {

// The whole weight decoded to fp32 (n, k), rows spread over threads.
template <typename W>
torch::Tensor decode_all(const W& w, int64_t n, int64_t k, const torch::TensorOptions& options) {
  torch::Tensor out = torch::empty({n, k}, options.dtype(torch::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / k), [&](int64_t r0, int64_t r1) {
    std::vector<float> sc(k / kGroup), mn(k / kGroup);
    for (int64_t r = r0; r < r1; ++r) decode_row(w, r, k, o + r * k, sc.data(), mn.data());
  });
  return out;
}

}  // namespace

// The whole int8 / int4 weight decoded to fp32 (N, K): for many rows of x, where a dense
// matmul (oneDNN) beats decoding each weight per call.
std::optional<torch::Tensor> dequantize_int8(torch::Tensor q, torch::Tensor scales) {
  const auto w = int8_weight(q, scales);
  if (!w) return std::nullopt;
  return decode_all(*w, q.size(0), w->k, scales.options());
}

std::optional<torch::Tensor> dequantize_int4(torch::Tensor q, torch::Tensor scales,
                                             torch::Tensor mins) {
  const auto w = int4_weight(q, scales, mins);
  if (!w) return std::nullopt;
  return decode_all(*w, q.size(0), w->k, scales.options());
}
