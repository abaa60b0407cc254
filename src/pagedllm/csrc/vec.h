// SIMD helpers shared by the CPU kernels: GCC/Clang vector types, loads and stores of
// fp32/bf16/fp16 as 16 fp32 lanes, horizontal sum/max, exp. Built into one extension with
// the kernels (layers/attention/cpu_kernels.py concatenates the sources).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// Releases the GIL for its scope when this thread holds it: a kernel called from Python lets
// the process's other Python threads run meanwhile (the served engine's sender thread builds
// and sends the last step's responses while this step computes); inside another kernel, which
// released it already, it does nothing.
class ReleaseGil {
 public:
  ReleaseGil() {
    if (PyGILState_Check()) released_.emplace();
  }

 private:
  std::optional<pybind11::gil_scoped_release> released_;
};

// at::parallel_for(begin, end, grain, fn) with the work handed out in chunks (at least `grain`,
// about eight per thread) to whichever thread is free, not split in equal halves up front: a
// thread that the OS takes away for a while (another process waking on a 2-core host, a
// slower memory channel) leaves its chunks to the others instead of keeping them waiting.
template <typename F>
void parallel_chunks(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  const int64_t n = end - begin, threads = at::get_num_threads();
  if (n <= 0) return;
  const int64_t chunk = std::max<int64_t>({grain, 1, (n + threads * 8 - 1) / (threads * 8)});
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (chunks == 1 || threads == 1 || at::in_parallel_region()) return fn(begin, end);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, chunks), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;)
        fn(begin + c * chunk, std::min(end, begin + (c + 1) * chunk));
  });
}

// For work over `rows` rows of x (a linear layer's, attention's requests): parallel_chunks
// where several rows make it compute-bound; one row streams the weights (the KV) at the
// bandwidth bound, where each thread's one long sequential read (at::parallel_for's equal
// split) is worth more than the balance.
template <typename F>
void parallel_for_rows(int64_t rows, int64_t begin, int64_t end, int64_t grain, const F& fn) {
  if (rows > 1)
    parallel_chunks(begin, end, grain, fn);
  else
    at::parallel_for(begin, end, grain, fn);
}

// GCC/Clang vector extensions: one register of fp32 lanes (16 with AVX-512, else 8: a wider
// vector than the registers goes through the stack), lowered to whatever SIMD the CPU has
// (intrinsics only where gcc lowers a 16-bit -> fp32 conversion poorly).
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float fvec __attribute__((vector_size(kLanes * 4)));
typedef float fvec4 __attribute__((vector_size(16)));
typedef uint16_t u16vec __attribute__((vector_size(kLanes * 2)));
typedef uint32_t u32vec __attribute__((vector_size(kLanes * 4)));
typedef int32_t i32vec __attribute__((vector_size(kLanes * 4)));

template <typename To, typename From>
inline To bit_cast(const From& from) {
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

// An unaligned vector load.
template <typename V>
inline V load_raw(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// kLanes values as fp32.
inline fvec load(const float* p) { return load_raw<fvec>(p); }

inline fvec load(const at::BFloat16* p) {
#if defined(__AVX512F__)
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return bit_cast<fvec>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#elif defined(__AVX2__)  // one widening load (gcc's generic conversion takes five ops)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return bit_cast<fvec>(_mm256_slli_epi32(wide, 16));
#else
  return bit_cast<fvec>(__builtin_convertvector(load_raw<u16vec>(p), u32vec) << 16);
#endif
}

inline fvec load(const at::Half* p) {
#if defined(__AVX512F__)
  return bit_cast<fvec>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return bit_cast<fvec>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  fvec v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

// kLanes int8 values (an int8 KV cache's, before their row's scale) as fp32.
typedef int8_t i8vec __attribute__((vector_size(kLanes)));
inline fvec load(const int8_t* p) { return __builtin_convertvector(load_raw<i8vec>(p), fvec); }

// kLanes fp32 values rounded to the cache dtype (to nearest even, like c10's conversions).
inline void store(float* p, fvec v) { std::memcpy(p, &v, sizeof(v)); }

inline void store(at::BFloat16* p, fvec v) {
  const auto bits = bit_cast<u32vec>(v);
  const u32vec rounded = bits + (((bits >> 16) & 1) + 0x7fff);
  const u32vec word = (v == v) ? rounded : u32vec{} + 0x7fc00000;  // NaN: canonical NaN
  const u16vec half = __builtin_convertvector(word >> 16, u16vec);
  std::memcpy(p, &half, sizeof(half));
}

inline void store(at::Half* p, fvec v) {
#if defined(__AVX512F__)
  const __m256i h = _mm512_cvtps_ph(bit_cast<__m512>(v), _MM_FROUND_TO_NEAREST_INT);
  std::memcpy(p, &h, sizeof(h));
#else
  for (int64_t l = 0; l < kLanes; ++l) p[l] = static_cast<at::Half>(v[l]);
#endif
}

inline float hsum(fvec v) {
  auto quarters = bit_cast<std::array<fvec4, kLanes / 4>>(v);
  for (int64_t half = kLanes / 8; half > 0; half /= 2)  // pairwise, halving the width
    for (int64_t i = 0; i < half; ++i) quarters[i] += quarters[i + half];
  const fvec4 s = quarters[0];
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// exp(x) on kLanes lanes (Cephes polynomial, rel. error ~1e-7), x clamped to [-87, 88].
inline fvec exp_vec(fvec x) {
  const fvec kRound = fvec{} + 12582912.f;
  x = x < -87.f ? fvec{} - 87.f : x;
  x = x > 88.f ? fvec{} + 88.f : x;
  const fvec shifted = x * 1.44269504088896341f + kRound;
  const fvec n = shifted - kRound;
  const i32vec ni = bit_cast<i32vec>(shifted) - bit_cast<i32vec>(kRound);
  const fvec r = x - n * 0.693359375f + n * 2.12194440e-4f;
  fvec p = fvec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * bit_cast<fvec>((ni + 127) << 23);
}

// tanh(x) on kLanes lanes: Eigen's rational approximation (error ~4e-7), odd polynomials of
// x clamped to +-7.9053 (where tanh rounds to +-1 in fp32) over even ones; x itself near 0.
inline fvec tanh_vec(fvec x) {
  const fvec c = x > 7.90531110763549805f ? fvec{} + 7.90531110763549805f
                 : x < -7.90531110763549805f ? fvec{} - 7.90531110763549805f
                                              : x;
  const fvec x2 = c * c;
  fvec p = x2 * -2.76076847742355e-16f + 2.00018790482477e-13f;
  p = p * x2 + -8.60467152213735e-11f;
  p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f;
  p = p * x2 + 6.37261928875436e-04f;
  p = p * x2 + 4.89352455891786e-03f;
  fvec q = x2 * 1.19825839466702e-06f + 1.18534705686654e-04f;
  q = q * x2 + 2.26843463243900e-03f;
  q = q * x2 + 4.89352518554385e-03f;
  const fvec t = c * p / q;
  const fvec ax = x < 0.f ? -x : x;
  return ax < 0.0004f ? x : t;
}

inline float hmax(fvec v) {
  float m = v[0];
  for (int64_t l = 1; l < kLanes; ++l) m = v[l] > m ? v[l] : m;
  return m;
}

}  // namespace
