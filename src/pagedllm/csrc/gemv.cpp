#include "gemv.h"

// ---- Dense linear layers for few rows (decode): y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
// reading each weight once per call, at the memory-bandwidth bound; and the quantized
// formats decoded whole (for many rows of x, where a dense matmul wins). Formats: gemv.h.
// Rows of W are spread over threads, each thread reading its rows front to back (one
// sequential stream: interleaving several rows starves the hardware prefetcher). Each group of
// W is converted to fp32 lanes in registers and multiplied with up to 8 rows of x at once;
// from `kTileRows` rows of x on, tiles: four rows of W against four of x on AVX-512, three
// on 8 lanes (FMA-bound rather than load-bound). Sums in fp32; x and y in fp32 / bf16 /
// fp16. K must be a multiple of 32 (callers fall back to PyTorch otherwise).

namespace {

// From how many rows of x gemm_small takes the tiles (gemm_blocks). AVX-512's 4 x 4: already
// at 2 they pass gemv_rows a little, at 32 by 1.7x (benchmarks/gemv_bench.py, fp32). AVX2's
// 4 x 3 (AMD EPYC Zen 3, fp32): 1.1-1.4x at 16 rows, 1.4-1.7x at 32, but at 8 and fewer,
// where memory rather than the FMAs sets the pace, gemv_rows's one sequential stream per
// thread wins on the tall lm_head (8.6 against 9.6 ms at 8 rows).
#if defined(__AVX512F__)
constexpr int64_t kTileRows = 2;
#else
constexpr int64_t kTileRows = 12;
#endif

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

#if defined(__AVX512F__)
// [sum a, sum b, sum c, sum d] of four 16-lane vectors: halves, then quarters added across
// the four, then within each 128-bit lane (14 instructions for four sums, not four reductions).
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v));
}

// out[c] = the sum of a[c]'s lanes, c < 4.
inline void sums4(const __m512* a, float* out) {
  _mm_storeu_ps(out, hsum4(a[0], a[1], a[2], a[3]));
}
#else
inline void sums4(const vw* a, float* out) {
  for (int c = 0; c < 4; ++c) out[c] = hsum8(a[c]);
}
#endif

// Rows of x per tile: four rows of W against four of x take 16 sums and 4 of the 32 vector
// registers of AVX-512; on 8 lanes (AVX2: 16 registers) three, 12 sums.
#if defined(__AVX512F__)
constexpr int kTileX = 4;
#else
constexpr int kTileX = 3;
#endif

// Four rows of W (from w, k apart) against MX <= kTileX rows of x: out[4r + c] = x_r . w_c.
// Each step of kLanesW loads 4 + MX vectors for 4 * MX FMAs (gemv_rows loads 1 + M for M):
// with several rows of x the FMAs, not the loads, set the pace (AVX2 at 32 rows: 1.4-1.7x
// gemv_rows). Meanwhile it prefetches into L2 the next four rows' lines of every `period`-th
// step from `phase`: the passes of all rows of x over one block share the next block's
// reads, so memory works while the FMAs do.
template <int MX, typename T>
void gemm_tile(const T* w, int64_t k, const float* x, float* out, int64_t phase,
               int64_t period) {
  vw acc[MX][4];
  for (int r = 0; r < MX; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = zerow();
  for (int64_t i = 0, step = 0; i < k; i += kLanesW, ++step) {
    vw wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = loadw(w + c * k + i);
    if (step % period == phase)
      for (int c = 0; c < 4; ++c) __builtin_prefetch(w + (c + 4) * k + i, 0, 2);
    for (int r = 0; r < MX; ++r) {
      const vw xv = loadw(x + r * k + i);
      for (int c = 0; c < 4; ++c) acc[r][c] = fmaw(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < MX; ++r) sums4(acc[r], out + 4 * r);
}

// Rows [4 * b0, 4 * b1) of y (m, n): each block of four rows of W against the rows of x
// kTileX at a time (the block, 4 rows of K, stays in L1 while all of x passes it).
template <typename T>
void gemm_blocks(const DenseW<T>& w, const float* x, int64_t m, int64_t k, int64_t n,
                 int64_t b0, int64_t b1, float* y) {
  float out[4 * kTileX];
  const int64_t passes = (m + kTileX - 1) / kTileX;
  for (int64_t b = b0; b < b1; ++b) {
    const T* wb = w.w + 4 * b * k;
    for (int64_t i0 = 0; i0 < m; i0 += kTileX) {
      const int64_t rows = std::min<int64_t>(kTileX, m - i0), pass = i0 / kTileX;
      const float* xs = x + i0 * k;
      switch (rows) {
        case 1: gemm_tile<1>(wb, k, xs, out, pass, passes); break;
        case 2: gemm_tile<2>(wb, k, xs, out, pass, passes); break;
        case 3: gemm_tile<3>(wb, k, xs, out, pass, passes); break;
        default: gemm_tile<kTileX>(wb, k, xs, out, pass, passes);
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int c = 0; c < 4; ++c) y[(i0 + r) * n + 4 * b + c] = out[4 * r + c];
    }
  }
}

// y (m, n) fp32 = x (m, k) fp32 @ W^T for a dense W, rows of W spread over threads: one row
// of x streams W a row at a time (bandwidth-bound); from kTileRows on they go through
// gemm_blocks, where the FMAs bound it.
template <typename T>
void gemm_small(const DenseW<T>& w, const float* x, int64_t m, int64_t k, int64_t n, float* y) {
  // at least ~64 KiB of weights per thread: a small matrix is not worth waking the others
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (k * static_cast<int64_t>(sizeof(T))));
  if (m >= kTileRows && k % kLanesW == 0) {
    const int64_t blocks = n / 4;
    parallel_chunks(0, blocks, std::max<int64_t>(1, grain / 4), [&](int64_t b0, int64_t b1) {
      gemm_blocks(w, x, m, k, n, b0, b1, y);
    });
    if (n % 4) gemv_block(w, x, m, k, n, 4 * blocks, n, y);
    return;
  }
  parallel_for_rows(m, 0, n, grain,
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
  ReleaseGil no_gil;
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
  ReleaseGil no_gil;
  const auto w = int8_weight(q, scales);
  if (!w) return std::nullopt;
  return decode_all(*w, q.size(0), w->k, scales.options());
}

std::optional<torch::Tensor> dequantize_int4(torch::Tensor q, torch::Tensor scales,
                                             torch::Tensor mins) {
  ReleaseGil no_gil;
  const auto w = int4_weight(q, scales, mins);
  if (!w) return std::nullopt;
  return decode_all(*w, q.size(0), w->k, scales.options());
}
