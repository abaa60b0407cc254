// 8-lane fp32 SIMD and the weight formats shared by the linear-layer kernels (gemv.cpp:
// dense and decoded weights in fp32; qgemv.cpp: int8 / int4 weights against int8 activations).
//   dense   fp32 / bf16 / fp16 (N, K);
//   int8    q int8 (N, K), scales fp32 (N, K / G): w = q * scale of its group of G (G a
//           multiple of 32: G = K is per output channel, G = 32 is GGUF's Q8_0);
//   int4    q uint8 (N, K / 2), scales and mins fp16 (N, K / 32): w = q * scale + min, each
//           group of 32 packed as GGUF's Q4_1 (byte j: element j in its low nibble, element
//           j + 16 in its high one).
#pragma once

#include "vec.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;  // weights decoded at a time: four 8-lane vectors

// How far ahead of its reads one row of x prefetches the weight stream (rows are contiguous
// and read front to back, one at a time): the hardware prefetcher alone leaves bandwidth
// unused on rows of a few KiB (Intel with AVX-512: lm_head 16 -> 21 GB/s in fp32,
// benchmarks/gemv_bench.py) or of a few hundred bytes (AMD EPYC, int8 batch-1 step).
constexpr int64_t kPrefetchBytes = 8192;

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
// prepares what a row's groups share (fp32 scales of each group of 32, and int4's mins);
// the integer dots of the quantized formats are csrc/qgemv.cpp's.
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
    int64_t g = 0;
    for (; g + kLanes <= groups; g += kLanes) {
      store(sc + g, load(scales + n * groups + g));
      store(mn + g, load(mins + n * groups + g));
    }
    for (; g < groups; ++g) {
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

inline bool weight_ok(const torch::Tensor& t, int64_t rows, int64_t cols, c10::ScalarType dtype) {
  return t.device().is_cpu() && t.dim() == 2 && t.size(0) == rows && t.size(1) == cols &&
         t.scalar_type() == dtype && t.is_contiguous();
}

// The formats over their tensors, or nullopt where these do not fit them.
inline std::optional<Int8W> int8_weight(const torch::Tensor& q, const torch::Tensor& scales) {
  const int64_t n = q.size(0), k = q.size(1);
  if (k % kGroup != 0 || !weight_ok(q, n, k, torch::kChar) || scales.dim() != 2 ||
      scales.size(1) == 0 || k % scales.size(1) != 0 || (k / scales.size(1)) % kGroup != 0 ||
      !weight_ok(scales, n, scales.size(1), torch::kFloat))
    return std::nullopt;
  const int64_t per_scale = k / scales.size(1) / kGroup;  // groups of 32 sharing a scale
  return Int8W{q.data_ptr<int8_t>(), scales.data_ptr<float>(), k, per_scale, scales.size(1)};
}

inline std::optional<Int4W> int4_weight(const torch::Tensor& q, const torch::Tensor& scales,
                                        const torch::Tensor& mins) {
  const int64_t n = q.size(0), k = q.size(1) * 2;
  if (k % kGroup != 0 || !weight_ok(q, n, k / 2, torch::kByte) ||
      !weight_ok(scales, n, k / kGroup, torch::kHalf) ||
      !weight_ok(mins, n, k / kGroup, torch::kHalf))
    return std::nullopt;
  return Int4W{q.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(), k};
}

// dst[i] = src[i] for `count` values between fp32 and bf16 / fp16, rounded as c10 rounds
// (vec.h's lanes): inline for a decode step's few rows (a torch conversion costs ~4 us of
// dispatch, two per linear layer), on all threads for a long prefill.
template <typename From, typename To>
void convert(const From* src, To* dst, int64_t count) {
  at::parallel_for(0, count, 1 << 16, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) store(dst + i, load(src + i));
    for (; i < end; ++i) dst[i] = static_cast<To>(static_cast<float>(src[i]));
  });
}

// Up to how many fp32 values (x and y of a 16-bit linear) go through the calling thread's
// scratch, kept between calls: allocating both per call held SmolLM2's bf16 decode matmuls
// to 18.7 GB/s, against 19.3 with the scratch and 20.4 for the bare kernel.
constexpr int64_t kScratchFloats = 1 << 20;

// on_fp32_rows for x in bf16 / fp16 (T): x and y in fp32 through the scratch (past it, a
// tensor), y rounded once into the result.
template <typename T, typename F>
torch::Tensor on_16bit_rows(const torch::Tensor& x, int64_t n,
                            const std::optional<torch::Tensor>& bias, const F& fn) {
  const int64_t m = x.size(0), k = x.size(1), floats = m * (k + n);
  const torch::Tensor xc = x.contiguous();
  thread_local std::vector<float> scratch;
  torch::Tensor large;
  float* xf;
  if (floats <= kScratchFloats) {
    if (static_cast<int64_t>(scratch.size()) < floats) scratch.resize(floats);
    xf = scratch.data();
  } else {
    large = torch::empty({floats}, x.options().dtype(torch::kFloat));
    xf = large.data_ptr<float>();
  }
  float* y = xf + m * k;
  convert(xc.data_ptr<T>(), xf, m * k);
  if (m > 0) fn(xf, m, k, y);
  if (bias.has_value()) torch::from_blob(y, {m, n}, torch::kFloat).add_(*bias);
  torch::Tensor out = torch::empty({m, n}, x.options());
  convert(y, out.data_ptr<T>(), m * n);
  return out;
}

// y = fn(x) + bias for x (M, K) of any float dtype: fn(x fp32, m, k, y fp32 (m, n)) fills y
// (when m > 0); y comes back in x's dtype, rounded once.
template <typename F>
torch::Tensor on_fp32_rows(const torch::Tensor& x, int64_t n,
                           const std::optional<torch::Tensor>& bias, const F& fn) {
  switch (x.scalar_type()) {
    case torch::kBFloat16: return on_16bit_rows<at::BFloat16>(x, n, bias, fn);
    case torch::kHalf: return on_16bit_rows<at::Half>(x, n, bias, fn);
    default: break;
  }
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "linear kernels: x in fp32, bf16 or fp16");
  const torch::Tensor xf = x.contiguous();
  torch::Tensor y = torch::empty({x.size(0), n}, xf.options());
  if (x.size(0) > 0) fn(xf.data_ptr<float>(), x.size(0), x.size(1), y.data_ptr<float>());
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// x (a few rows, any float dtype) is what the linear kernels take.
inline bool gemv_input_ok(const torch::Tensor& x, int64_t k) {
  const auto dtype = x.scalar_type();
  return x.device().is_cpu() && x.dim() == 2 && x.size(1) == k && k % kGroup == 0 &&
         (dtype == torch::kFloat || dtype == torch::kBFloat16 || dtype == torch::kHalf);
}

}  // namespace
