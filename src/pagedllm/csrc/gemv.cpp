#include "gemv.h"

// ---- Dense linear layers for few rows (decode): y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
// reading each weight once per call, at the memory-bandwidth bound; and the quantized
// formats decoded whole (for many rows of x, where a dense matmul wins). Formats: gemv.h.
// Rows of W are spread over threads, each thread reading its rows front to back (one
// sequential stream: interleaving several rows starves the hardware prefetcher). Each group of
// W is converted to fp32 lanes in registers and multiplied with up to 8 rows of x at once. Sums in fp32; x and y in fp32 / bf16 / fp16. K must be a multiple of 32 (callers fall
// back to PyTorch otherwise).

namespace {

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

// The widest fp32 vector: 16 lanes on AVX-512, else gemv.h's 8.
#if defined(__AVX512F__)
using vw = __m512;
constexpr int kLanesW = 16;
inline vw zerow() { return _mm512_setzero_ps(); }
inline vw fmaw(vw a, vw b, vw c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsumw(vw a, vw b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
inline vw loadw(const float* p) { return _mm512_loadu_ps(p); }
inline vw loadw(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vw loadw(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
using vw = v8;
constexpr int kLanesW = 8;
inline vw zerow() { return zero8(); }
inline vw fmaw(vw a, vw b, vw c) { return fma8(a, b, c); }
inline float hsumw(vw a, vw b) { return hsum8(a + b); }
template <typename T>
inline vw loadw(const T* p) { return load8(p); }
#endif

// M rows of x (k apart) against row n of a dense W: out[r] = x_r . w_n, each weight loaded
// once for all M (x stays in L1). Up to 4 rows, two accumulators per row (two FMA chains);
// past that one each, so that they stay in registers.
template <int M, typename T>
void gemv_rows(const DenseW<T>& w, const float* x, int64_t k, int64_t n, float* out) {
  constexpr int kAcc = M > 4 ? 1 : 2;
  vw acc[M][2];
  for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = zerow();
  const T* p = w.w + n * k;
  for (int64_t i = 0; i < k; i += kGroup) {
    prefetch_group(p + i);
    for (int j = 0; j < kGroup / kLanesW; ++j) {
      const vw wv = loadw(p + i + j * kLanesW);
      for (int r = 0; r < M; ++r)
        acc[r][j % kAcc] = fmaw(wv, loadw(x + r * k + i + j * kLanesW), acc[r][j % kAcc]);
    }
  }
  for (int r = 0; r < M; ++r) out[r] = hsumw(acc[r][0], acc[r][1]);
}

// Rows [r0, r1) of y (m, n): each row of W against the rows of x 8 at a time (a row of W
// read from memory once: it stays in L1 for the next 8).
template <typename T>
void gemv_block(const DenseW<T>& w, const float* x, int64_t m, int64_t k, int64_t n,
                int64_t r0, int64_t r1, float* y) {
  float out[8];
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t i0 = 0; i0 < m; i0 += 8) {
      const float* xs = x + i0 * k;
      const int64_t rows = std::min<int64_t>(8, m - i0);
      switch (rows) {
        case 1: gemv_rows<1>(w, xs, k, r, out); break;
        case 2: gemv_rows<2>(w, xs, k, r, out); break;
        case 3: gemv_rows<3>(w, xs, k, r, out); break;
        case 4: gemv_rows<4>(w, xs, k, r, out); break;
        case 5: gemv_rows<5>(w, xs, k, r, out); break;
        case 6: gemv_rows<6>(w, xs, k, r, out); break;
        case 7: gemv_rows<7>(w, xs, k, r, out); break;
        default: gemv_rows<8>(w, xs, k, r, out);
      }
      for (int64_t i = 0; i < rows; ++i) y[(i0 + i) * n + r] = out[i];
    }
  }
}

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

// y (m, n) fp32 = x (m, k) fp32 @ W^T for a dense W, rows of W spread over threads.
template <typename T>
void gemm_small(const DenseW<T>& w, const float* x, int64_t m, int64_t k, int64_t n, float* y) {
  // at least ~64 KiB of weights per thread: a small matrix is not worth waking the others
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (k * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, n, grain,
                   [&](int64_t r0, int64_t r1) { gemv_block(w, x, m, k, n, r0, r1, y); });
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
