#include "gemv.h"

// ---- Quantized linear layers for one row of x (decode at batch 1): y[N] = W[N, K] @ x[K].
// x rounded to int8 in groups of 32 as in qgemv.cpp; each row of W first folds its groups'
// scales with x's into one fp32 per group (and int4's mins into one sum), so that the loop
// over its groups is an integer dot and one FMA with that broadcast from memory, in 8 lanes,
// two accumulators. (With one row of x this is faster than qgemv.cpp's vectors of two groups,
// whose scales are per lane: benchmarks/gemv_bench.py.) Each thread reads its rows of W one
// at a time, front to back, prefetching kPrefetchBytes ahead as the dense kernel does: two
// rows interleaved, prefetched 8 rows ahead, left the int8 step at ~8 GB/s on an AMD EPYC.

namespace {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// 8 int32 lanes summing to the dot of 32 unsigned by 32 signed bytes: no pair of products
// overflows int16 here (|w| <= 127 against |x| <= 127, or 15 against 127). Also qgemv.cpp's.
inline __m256i u8s8_lanes(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
inline v8 dot_u8s8(__m256i u, __m256i s) { return _mm256_cvtepi32_ps(u8s8_lanes(u, s)); }
inline v8 group_dot(const int8_t* w, const int8_t* x) {  // |w| against x with w's sign
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return dot_u8s8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
}
inline v8 group_dot(const uint8_t* w, const int8_t* x) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  return dot_u8s8(_mm256_set_m128i(hi, lo), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
#else
inline v8 group_dot(const int8_t* w, const int8_t* x) {
  v8 out{};
  for (int j = 0; j < kGroup; ++j) out[j / 4] += static_cast<float>(int32_t{w[j]} * x[j]);
  return out;
}
inline v8 group_dot(const uint8_t* w, const int8_t* x) {
  v8 out{};
  for (int j = 0; j < kGroup / 2; ++j)
    out[j / 2] += static_cast<float>((w[j] & 0xF) * x[j] + (w[j] >> 4) * x[j + 16]);
  return out;
}
#endif

// x (k) fp32 rounded per group of 32: q (k), and per group d, sum(q) and d * sum(q).
struct RoundedRow {
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
  std::vector<int32_t> sum;
  RoundedRow(const float* x, int64_t k) : q(k), d(k / kGroup), dsum(k / kGroup), sum(k / kGroup) {
    for (int64_t g = 0; g < k / kGroup; ++g) {
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
      this->sum[g] = sum;
      dsum[g] = d[g] * static_cast<float>(sum);
    }
  }
};

// Row n of W against x's scales: comb[g] = the weight's scale of group g times x's; returns
// what the integer dots leave out (int4: the sum over groups of min * d * sum(q)).
inline float fold_row(const Int8W& w, int64_t n, const RoundedRow& x, float* comb) {
  const int64_t groups = w.k / kGroup;
  const float* s = w.scales + n * w.scales_per_row;
  const float* d = x.d.data();
  int64_t g = 0;
  if (w.scales_per_row == 1) {
    for (const v8 sv = splat8(s[0]); g + 8 <= groups; g += 8) store8(comb + g, sv * load8(d + g));
  } else if (w.groups_per_scale == 1) {
    for (; g + 8 <= groups; g += 8) store8(comb + g, load8(s + g) * load8(d + g));
  }
  for (; g < groups; ++g) comb[g] = s[g / w.groups_per_scale] * d[g];
  return 0.f;
}

inline float fold_row(const Int4W& w, int64_t n, const RoundedRow& x, float* comb) {
  const int64_t groups = w.k / kGroup;
  const at::Half* s = w.scales + n * groups;
  const at::Half* m = w.mins + n * groups;
  const float *d = x.d.data(), *dsum = x.dsum.data();
  v8 acc = zero8();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    store8(comb + g, load8(s + g) * load8(d + g));
    acc = fma8(load8(m + g), load8(dsum + g), acc);
  }
  float out = hsum8(acc);
  for (; g < groups; ++g) {
    comb[g] = static_cast<float>(s[g]) * d[g];
    out += static_cast<float>(m[g]) * dsum[g];
  }
  return out;
}

inline const int8_t* group_at(const Int8W& w, int64_t n, int64_t g) { return w.q + n * w.k + g * kGroup; }
inline const uint8_t* group_at(const Int4W& w, int64_t n, int64_t g) {
  return w.q + n * (w.k / 2) + g * (kGroup / 2);
}

// The sum over the groups of row n of W of dot(group, x's group) * per_group[g].
template <typename W>
float group_sum(const W& w, int64_t n, const int8_t* xq, int64_t groups, const float* per_group) {
  v8 acc0 = zero8(), acc1 = zero8();
  int64_t g = 0;
  for (; g + 1 < groups; g += 2) {
    __builtin_prefetch(reinterpret_cast<const char*>(group_at(w, n, g)) + kPrefetchBytes, 0, 3);
    acc0 = fma8(group_dot(group_at(w, n, g), xq + g * kGroup), splat8(per_group[g]), acc0);
    acc1 = fma8(group_dot(group_at(w, n, g + 1), xq + (g + 1) * kGroup), splat8(per_group[g + 1]),
                acc1);
  }
  if (g < groups)
    acc0 = fma8(group_dot(group_at(w, n, g), xq + g * kGroup), splat8(per_group[g]), acc0);
  return hsum8(acc0 + acc1);
}

// y (n) = W x for one row x (k), rows of W spread over threads.
template <typename W>
void qgemv_one(const W& w, const float* xf, int64_t k, int64_t n, float* y, int64_t bytes_per_row) {
  const RoundedRow x(xf, k);
  const int64_t groups = k / kGroup;
  // at least ~64 KiB of weights per thread: a small matrix is not worth waking the others
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / bytes_per_row);
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> comb(groups);
    for (int64_t r = r0; r < r1; ++r) {
      const float rest = fold_row(w, r, x, comb.data());
      y[r] = rest + group_sum(w, r, x.q.data(), groups, comb.data());
    }
  });
}

}  // namespace
