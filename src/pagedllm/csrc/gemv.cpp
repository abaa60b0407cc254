#include "vec.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// ---- Linear layers for few rows (decode): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), reading
// each weight once per call, at the memory-bandwidth bound. W is one of:
//   dense   fp32 / bf16 / fp16 (N, K);
//   int8    q int8 (N, K), scales fp32 (N, K / G): w = q * scale of its group of G (G a
//           multiple of 32: G = K is per output channel, G = 32 is GGUF's Q8_0);
//   int4    q uint8 (N, K / 2), scales and mins fp16 (N, K / 32): w = q * scale + min, each
//           group of 32 packed as GGUF's Q4_1 (byte j: element j in its low nibble, element
//           j + 16 in its high one).
// Rows of W are spread over threads. One row of x: each group of W is decoded to fp32 lanes
// in registers and multiplied at once; several rows: a block of 4 rows of W is decoded once
// into a small buffer and reused by every row of x. Sums in fp32; x and y in fp32 / bf16 /
// fp16. K must be a multiple of 32 (callers fall back to PyTorch otherwise).

namespace {

constexpr int64_t kGroup = 32;  // weights decoded at a time: four 8-lane vectors
constexpr int64_t kRowBlock = 4;

// 8 fp32 lanes: AVX2 registers where the CPU has them (the 16-lane fvec of vec.h goes through
// the stack on AVX2), else GCC/Clang vector extensions with scalar conversions.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using v8 = __m256;
inline v8 zero8() { return _mm256_setzero_ps(); }
inline v8 splat8(float v) { return _mm256_set1_ps(v); }
inline v8 load8(const float* p) { return _mm256_loadu_ps(p); }
inline void store8(float* p, v8 v) { _mm256_storeu_ps(p, v); }
inline v8 fma8(v8 a, v8 b, v8 c) { return _mm256_fmadd_ps(a, b, c); }
inline v8 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline v8 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline v8 load8(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
// The 32 4-bit values of a Q4_1 group (16 bytes) as four vectors: low nibbles, then high.
inline void nibbles(const uint8_t* p, v8 out[4]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
inline float hsum8(v8 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#else
typedef float v8 __attribute__((vector_size(32)));
inline v8 zero8() { return v8{}; }
inline v8 splat8(float v) { return v8{} + v; }
inline v8 load8(const float* p) { return load_raw<v8>(p); }
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }
inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }
template <typename T>
inline v8 load8(const T* p) {
  v8 v;
  for (int l = 0; l < 8; ++l) v[l] = static_cast<float>(p[l]);
  return v;
}
inline void nibbles(const uint8_t* p, v8 out[4]) {
  for (int l = 0; l < 16; ++l) {
    out[l / 8][l % 8] = static_cast<float>(p[l] & 0xF);
    out[2 + l / 8][l % 8] = static_cast<float>(p[l] >> 4);
  }
}
inline float hsum8(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
#endif

// Formats: `group(n, g, w)` decodes weights [32g, 32g + 32) of row n into w[4]; `begin_row`
// prepares what a row's groups share (fp32 copies of int4's fp16 scales and mins).
template <typename T>
struct DenseW {
  const T* w;
  int64_t k;
  void begin_row(int64_t, float*, float*) const {}
  void group(int64_t n, int64_t g, const float*, const float*, v8 out[4]) const {
    const T* p = w + n * k + g * kGroup;
    for (int i = 0; i < 4; ++i) out[i] = load8(p + 8 * i);
  }
};

struct Int8W {
  const int8_t* q;
  const float* scales;
  int64_t k, groups_per_scale, scales_per_row;
  // The scale of each group of 32 of row n, into sc.
  void begin_row(int64_t n, float* sc, float*) const {
    for (int64_t i = 0, g = 0; i < scales_per_row; ++i)
      for (int64_t j = 0; j < groups_per_scale; ++j) sc[g++] = scales[n * scales_per_row + i];
  }
  void group(int64_t n, int64_t g, const float* sc, const float*, v8 out[4]) const {
    const int8_t* p = q + n * k + g * kGroup;
    const v8 s = splat8(sc[g]);
    for (int i = 0; i < 4; ++i) out[i] = load8(p + 8 * i) * s;
  }
};

struct Int4W {
  const uint8_t* q;
  const at::Half* scales;
  const at::Half* mins;
  int64_t k;
  void begin_row(int64_t n, float* sc, float* mn) const {
    const int64_t groups = k / kGroup;
    for (int64_t g = 0; g < groups; ++g) {
      sc[g] = static_cast<float>(scales[n * groups + g]);
      mn[g] = static_cast<float>(mins[n * groups + g]);
    }
  }
  void group(int64_t n, int64_t g, const float* sc, const float* mn, v8 out[4]) const {
    nibbles(q + n * (k / 2) + g * (kGroup / 2), out);
    const v8 s = splat8(sc[g]), m = splat8(mn[g]);
    for (int i = 0; i < 4; ++i) out[i] = fma8(out[i], s, m);
  }
};

// One row of x: R rows of W from row n, each group decoded in registers; y[r] = sums.
template <int R, typename W>
void gemv_rows(const W& w, const float* x, int64_t k, int64_t n, float* y, float* sc,
               float* mn) {
  const int64_t groups = k / kGroup;
  v8 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = acc[r][1] = zero8();
    w.begin_row(n + r, sc + r * groups, mn + r * groups);
  }
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * kGroup;
    for (int r = 0; r < R; ++r) {
      v8 wv[4];
      w.group(n + r, g, sc + r * groups, mn + r * groups, wv);
      acc[r][0] = fma8(wv[0], load8(xg), acc[r][0]);
      acc[r][1] = fma8(wv[1], load8(xg + 8), acc[r][1]);
      acc[r][0] = fma8(wv[2], load8(xg + 16), acc[r][0]);
      acc[r][1] = fma8(wv[3], load8(xg + 24), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hsum8(acc[r][0] + acc[r][1]);
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

// y (m, n) fp32 = x (m, k) fp32 @ W^T, rows of W spread over threads.
template <typename W>
void gemm_small(const W& w, const float* x, int64_t m, int64_t k, int64_t n, float* y,
                int64_t bytes_per_row) {
  const int64_t blocks = (n + kRowBlock - 1) / kRowBlock;
  // at least ~64 KiB of weights per thread: a small matrix is not worth waking the others
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (bytes_per_row * kRowBlock));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t groups = k / kGroup;
    std::vector<float> sc(kRowBlock * groups), mn(kRowBlock * groups);
    std::vector<float> rows(m > 1 ? kRowBlock * k : 0);
    float out[kRowBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * kRowBlock, count = std::min(kRowBlock, n - r0);
      if (m == 1) {
        if (count == kRowBlock) {
          gemv_rows<kRowBlock>(w, x, k, r0, out, sc.data(), mn.data());
        } else {
          for (int64_t r = 0; r < count; ++r)
            gemv_rows<1>(w, x, k, r0 + r, out + r, sc.data(), mn.data());
        }
        for (int64_t r = 0; r < count; ++r) y[r0 + r] = out[r];
        continue;
      }
      for (int64_t r = 0; r < count; ++r)
        decode_row(w, r0 + r, k, rows.data() + r * k, sc.data(), mn.data());
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

bool gemv_input_ok(const torch::Tensor& x, int64_t k) {
  const auto dtype = x.scalar_type();
  return x.device().is_cpu() && x.dim() == 2 && x.size(1) == k && k % kGroup == 0 &&
         (dtype == torch::kFloat || dtype == torch::kBFloat16 || dtype == torch::kHalf);
}

// Runs gemm_small on x (any float dtype) and returns y in x's dtype, plus the bias.
template <typename W>
torch::Tensor run_linear(const W& w, const torch::Tensor& x, int64_t n,
                         const std::optional<torch::Tensor>& bias, int64_t bytes_per_row) {
  const int64_t m = x.size(0), k = x.size(1);
  const torch::Tensor xf = x.to(torch::kFloat).contiguous();
  torch::Tensor y = torch::empty({m, n}, xf.options());
  if (m > 0) gemm_small(w, xf.data_ptr<float>(), m, k, n, y.data_ptr<float>(), bytes_per_row);
  if (bias.has_value()) y.add_(*bias);
  return x.scalar_type() == torch::kFloat ? y : y.to(x.scalar_type());
}

bool weight_ok(const torch::Tensor& t, int64_t rows, int64_t cols, c10::ScalarType dtype) {
  return t.device().is_cpu() && t.dim() == 2 && t.size(0) == rows && t.size(1) == cols &&
         t.scalar_type() == dtype && t.is_contiguous();
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
      return run_linear(DenseW<float>{w.data_ptr<float>(), k}, x, n, bias, k * 4);
    case torch::kBFloat16:
      return run_linear(DenseW<at::BFloat16>{w.data_ptr<at::BFloat16>(), k}, x, n, bias, k * 2);
    case torch::kHalf:
      return run_linear(DenseW<at::Half>{w.data_ptr<at::Half>(), k}, x, n, bias, k * 2);
    default:
      return std::nullopt;
  }
}

std::optional<torch::Tensor> linear_int8(torch::Tensor x, torch::Tensor q, torch::Tensor scales,
                                         std::optional<torch::Tensor> bias) {
  const int64_t n = q.size(0), k = q.size(1);
  if (!gemv_input_ok(x, k) || !weight_ok(q, n, k, torch::kChar) || scales.dim() != 2 ||
      scales.size(1) == 0 || k % scales.size(1) != 0 || (k / scales.size(1)) % kGroup != 0 ||
      !weight_ok(scales, n, scales.size(1), torch::kFloat))
    return std::nullopt;
  const int64_t per_scale = k / scales.size(1) / kGroup;  // groups of 32 sharing a scale
  const Int8W w{q.data_ptr<int8_t>(), scales.data_ptr<float>(), k, per_scale, scales.size(1)};
  return run_linear(w, x, n, bias, k);
}

std::optional<torch::Tensor> linear_int4(torch::Tensor x, torch::Tensor q, torch::Tensor scales,
                                         torch::Tensor mins, std::optional<torch::Tensor> bias) {
  const int64_t n = q.size(0), k = q.size(1) * 2;
  if (!gemv_input_ok(x, k) || !weight_ok(q, n, k / 2, torch::kByte) ||
      !weight_ok(scales, n, k / kGroup, torch::kHalf) ||
      !weight_ok(mins, n, k / kGroup, torch::kHalf))
    return std::nullopt;
  const Int4W w{q.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(), k};
  return run_linear(w, x, n, bias, k / 2 + 4 * k / kGroup);
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
  const int64_t n = q.size(0), k = q.size(1);
  if (k % kGroup != 0 || !weight_ok(q, n, k, torch::kChar) || scales.dim() != 2 ||
      scales.size(1) == 0 || k % scales.size(1) != 0 || (k / scales.size(1)) % kGroup != 0 ||
      !weight_ok(scales, n, scales.size(1), torch::kFloat))
    return std::nullopt;
  const int64_t per_scale = k / scales.size(1) / kGroup;
  const Int8W w{q.data_ptr<int8_t>(), scales.data_ptr<float>(), k, per_scale, scales.size(1)};
  return decode_all(w, n, k, scales.options());
}

std::optional<torch::Tensor> dequantize_int4(torch::Tensor q, torch::Tensor scales,
                                             torch::Tensor mins) {
  const int64_t n = q.size(0), k = q.size(1) * 2;
  if (k % kGroup != 0 || !weight_ok(q, n, k / 2, torch::kByte) ||
      !weight_ok(scales, n, k / kGroup, torch::kHalf) ||
      !weight_ok(mins, n, k / kGroup, torch::kHalf))
    return std::nullopt;
  const Int4W w{q.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(), k};
  return decode_all(w, n, k, scales.options());
}
