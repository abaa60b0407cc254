#include "gemv.h"

// ---- Quantized linear layers for few rows (decode): y[M, N] = x[M, K] @ W[N, K]^T (+ bias)
// for int8 / int4 weights (formats: gemv.h), as llama.cpp computes them: x is rounded to int8
// in groups of 32 (d = max |x| / 127, q = round(x * 127 / max |x|), ties to even; the same
// rounding as layers/quant.py's `round_activations`, which the other paths apply), and each
// group of weights meets its activations in integer dot products, scaled by the weight's and
// the activations' scales in fp32. Rows of W are spread over threads, each read front to back
// once per call; two rows of W at a time meet the rows of x four at a time, each vector of W
// loaded once for all of them (the pair stays in L1 for the next four). One row of x goes to
// qgemv_row.cpp instead.
//
// One SIMD vector covers kGV groups of 32 (8 int32 / fp32 lanes each): 2 with AVX-512 VNNI
// (vpdpbusd on 64 bytes), else 1 (AVX2; portable vector extensions elsewhere). int8 weights
// meet x + 128 as unsigned bytes (vpdpbusd multiplies unsigned by signed), the 128 * sum(w)
// taken back out; without VNNI, |w| meets x with w's sign (maddubs / madd).

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kGV = 2;
using fv = __m512;
using iv = __m512i;
inline fv fzero() { return _mm512_setzero_ps(); }
inline fv fload(const float* p) { return _mm512_loadu_ps(p); }
inline fv ffma(fv a, fv b, fv c) { return _mm512_fmadd_ps(a, b, c); }
inline fv fmul(fv a, fv b) { return _mm512_mul_ps(a, b); }
inline float fsum(fv a) { return _mm512_reduce_add_ps(a); }
inline fv to_float(iv a) { return _mm512_cvtepi32_ps(a); }
// Lanes of group p[0] and group p[1]: lanes 0-7 and 8-15, or (interleaved) 0-3 and 8-11, and
// 4-7 and 12-15.
inline fv pair_lanes(const float* p, bool interleaved) {
  const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
  const __m512i idx = interleaved ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                                  : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(two));
}
constexpr bool kInterleave4 = true;  // int4 vectors hold two groups' low nibbles, then high
// int8: w and -128 * sum(w) (lanes of four).
struct W8 {
  iv w, corr;
};
inline W8 w8_load(const int8_t* p, bool both) {
  const iv w = _mm512_maskz_loadu_epi8(both ? ~0ULL : 0xFFFFFFFFULL, p);  // or the first group
  const iv sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(-128), w);
  return {w, _mm512_sub_epi32(_mm512_setzero_si512(), sums)};
}
inline iv w8_dot(const W8& w, const int8_t*, const uint8_t* xu) {
  return _mm512_dpbusd_epi32(w.corr, _mm512_loadu_si512(xu), w.w);
}
// int4: 32 packed bytes (two groups) -> their low nibbles, then their high ones 16 times over
// (x is stored in that order for int4: elements 0-15 of both groups, then 16-31; and the
// activations' scales of lanes 8-15 carry the 1 / 16). vpdpbusd sums into int32: 240 * 127
// * 4 fits.
inline iv w4_load(const uint8_t* p, bool both) {
  const __m256i b = both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                         : _mm256_maskz_loadu_epi8(0xFFFF, p);
  const iv mask = _mm512_set_epi64(-0x0F0F0F0F0F0F0F10LL, -0x0F0F0F0F0F0F0F10LL,
                                   -0x0F0F0F0F0F0F0F10LL, -0x0F0F0F0F0F0F0F10LL,
                                   0x0F0F0F0F0F0F0F0FLL, 0x0F0F0F0F0F0F0F0FLL,
                                   0x0F0F0F0F0F0F0F0FLL, 0x0F0F0F0F0F0F0F0FLL);
  return _mm512_and_si512(_mm512_broadcast_i64x4(b), mask);
}
inline iv w4_dot(iv w, const int8_t* xs) {
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(xs));
}
#else
constexpr int kGV = 1;
using fv = v8;
inline fv fzero() { return zero8(); }
inline fv fload(const float* p) { return load8(p); }
inline fv ffma(fv a, fv b, fv c) { return fma8(a, b, c); }
inline fv fmul(fv a, fv b) { return a * b; }
inline float fsum(fv a) { return hsum8(a); }
inline fv pair_lanes(const float* p, bool) { return splat8(*p); }
constexpr bool kInterleave4 = false;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using iv = __m256i;
inline fv to_float(iv a) { return _mm256_cvtepi32_ps(a); }
struct W8 {
  iv abs, w;  // |w| and w
};
inline W8 w8_load(const int8_t* p, bool) {
  const iv w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_sign_epi8(w, w), w};
}
inline iv w8_dot(const W8& w, const int8_t* xs, const uint8_t*) {
  const iv x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs));
  return u8s8_lanes(w.abs, _mm256_sign_epi8(x, w.w));  // qgemv_row.cpp
}
inline iv w4_load(const uint8_t* p, bool) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  return _mm256_set_m128i(hi, lo);
}
inline iv w4_dot(iv w, const int8_t* xs) {
  return u8s8_lanes(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs)));
}
#else
typedef int32_t iv __attribute__((vector_size(32)));
inline fv to_float(iv a) { return __builtin_convertvector(a, fv); }
struct W8 {
  const int8_t* w;
};
inline W8 w8_load(const int8_t* p, bool) { return {p}; }
inline iv w8_dot(const W8& w, const int8_t* xs, const uint8_t*) {
  iv out{};
  for (int j = 0; j < kGroup; ++j) out[j / 4] += int32_t{w.w[j]} * xs[j];
  return out;
}
struct W4 {
  const uint8_t* w;
};
inline W4 w4_load(const uint8_t* p, bool) { return {p}; }
inline iv w4_dot(const W4& w, const int8_t* xs) {
  iv out{};
  for (int j = 0; j < kGroup / 2; ++j)
    out[j / 4] += (w.w[j] & 0xF) * xs[j], out[4 + j / 4] += (w.w[j] >> 4) * xs[j + 16];
  return out;
}
#endif
#endif

constexpr int kLanesV = 8 * kGV;         // fp32 lanes of a vector
constexpr int64_t kBytesV = kGroup * kGV;  // int8 values of a vector

// K's groups of 32 and one more, padded to a whole number of kLanes (fp32 vectors of vec.h).
inline int64_t padded_groups(int64_t k) { return (k / kGroup + kLanes) / kLanes * kLanes; }

// x (m, k) fp32 rounded per group of 32, its groups padded to a whole number of vectors
// (padding: q = 0, d = 0), laid out as the weights' vectors are (interleaved: each pair of
// groups as elements 0-15 of both, then 16-31 of both): q as int8 (s) and as q + 128 in uint8
// (u), (m, kp); each lane's group's d (int4 interleaved: / 16 for the high nibbles' lanes)
// (m, kp / 4); and each group's d * sum(q) (m, gp: the
// groups padded to a whole number of kLanes).
struct QuantizedRows {
  int64_t kp, gp;
  std::vector<int8_t> s;
  std::vector<uint8_t> u;
  std::vector<float> d, dsum;
  QuantizedRows(const float* x, int64_t m, int64_t k, bool interleaved)
      : kp((k + kBytesV - 1) / kBytesV * kBytesV), gp(padded_groups(k)), s(m * kp),
        u(m * kp, 128), d(m * kp / 4), dsum(m * gp) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t g = 0; g < k / kGroup; ++g) {
        const float* xg = x + i * k + g * kGroup;
        float amax = 0.f;
        for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::abs(xg[j]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        // where element j of group g goes: its vector, then its place in it
        const int64_t vec = i * kp + g / kGV * kBytesV, second = g % kGV;
        const auto at = [&](int64_t j) {
          return vec + (interleaved ? j % 16 + 16 * second + 32 * (j / 16) : second * kGroup + j);
        };
        int32_t sum = 0;
        for (int64_t j = 0; j < kGroup; ++j) {
          const auto v = static_cast<int8_t>(std::nearbyint(xg[j] * inv));
          s[at(j)] = v;
          u[at(j)] = static_cast<uint8_t>(v + 128);
          sum += v;
        }
        for (int64_t j = 0; j < kGroup; j += 4)  // each 4's lane (interleaved: high nibbles x 16)
          d[at(j) / 4] = amax / 127.f / (interleaved && j >= 16 ? 16.f : 1.f);
        dsum[i * gp + g] = amax / 127.f * static_cast<float>(sum);
      }
  }
};

// Rows of W ahead of the reads that are prefetched: the rows are short (a few hundred bytes),
// too short for the hardware prefetcher to reach full speed on its own (int8: 1.35x).
constexpr int64_t kAhead = 8;

// The formats' rows: `begin(n, sc)` writes row n's per-group fp32 scales into sc (a zero
// after them) and int4's mins from sc + padded_groups(k) (zeros after them);
// `load(n, v, both, sc, sv)` loads vector v of row n and (grouped formats) its groups' scales
// as lanes (sv); `dot` is its integer dots with a row of x; `finish` scales a row's sum (per
// channel).

// int8 weights, symmetric: per output channel (the scale applied once, at the end) or per
// group (each group's scale times the activations').
template <bool kPerChannel>
struct Int8Rows {
  const Int8W& w;
  using State = W8;
  static constexpr bool kChannel = kPerChannel, kMins = false, kInterleaved = false;
  const void* at(int64_t n, int64_t v) const { return w.q + n * w.k + v * kBytesV; }
  void begin(int64_t n, float* sc) const {
    if (kPerChannel) return;
    w.begin_row(n, sc, nullptr);
    sc[w.k / kGroup] = 0.f;
  }
  W8 load(int64_t n, int64_t v, bool both, const float* sc, fv& sv) const {
    if (!kPerChannel) sv = pair_lanes(sc + v * kGV, false);
    return w8_load(w.q + n * w.k + v * kBytesV, both);
  }
  static iv dot(const W8& wv, const int8_t* xs, const uint8_t* xu) { return w8_dot(wv, xs, xu); }
  float finish(int64_t n, float sum) const { return kPerChannel ? w.scales[n] * sum : sum; }
};

// int4 weights, affine: w = q * scale + min per group.
struct Int4Rows {
  const Int4W& w;
  using State = decltype(w4_load(nullptr, true));
  static constexpr bool kChannel = false, kMins = true, kInterleaved = kInterleave4;
  const void* at(int64_t n, int64_t v) const { return w.q + n * (w.k / 2) + v * kBytesV / 2; }
  void begin(int64_t n, float* sc) const {
    const int64_t groups = w.k / kGroup;
    float* mn = sc + padded_groups(w.k);
    w.begin_row(n, sc, mn);
    std::fill(mn + groups, mn + padded_groups(w.k), 0.f);
    sc[groups] = 0.f;
  }
  State load(int64_t n, int64_t v, bool both, const float* sc, fv& sv) const {
    sv = pair_lanes(sc + v * kGV, kInterleaved);
    return w4_load(w.q + n * (w.k / 2) + v * kBytesV / 2, both);
  }
  static iv dot(const State& wv, const int8_t* xs, const uint8_t*) { return w4_dot(wv, xs); }
  float finish(int64_t, float sum) const { return sum; }
};

// Rows r .. r + R of W (their scales sc, `stride` apart) against rows i0 .. i0 + M of x:
// out[j * R + a] = x_{i0 + j} . w_{r + a}. With a single product in flight, two accumulators
// (two FMA chains).
template <int R, int M, typename F>
void qdot_block(const F& f, const QuantizedRows& x, int64_t i0, int64_t k, int64_t r,
                const float* sc, int64_t stride, float* out) {
  constexpr int kAcc = R * M < 4 ? 2 : 1;
  const int64_t groups = k / kGroup, vectors = (groups + kGV - 1) / kGV;
  fv acc[R][M][kAcc];
  for (int a = 0; a < R; ++a)
    for (int j = 0; j < M; ++j)
      for (int c = 0; c < kAcc; ++c) acc[a][j][c] = fzero();
  const int8_t* xs[M];
  const uint8_t* xu[M];
  const float* d[M];
  for (int j = 0; j < M; ++j) {
    const int64_t row = (i0 + j) * x.kp;
    xs[j] = x.s.data() + row, xu[j] = x.u.data() + row, d[j] = x.d.data() + row / 4;
  }
  for (int64_t v = 0; v < vectors; ++v) {
    const bool both = (v + 1) * kGV <= groups;
    typename F::State wv[R];
    fv sv[R];
    for (int a = 0; a < R; ++a) {
      __builtin_prefetch(f.at(r + a + kAhead, v), 0, 0);
      wv[a] = f.load(r + a, v, both, sc + a * stride, sv[a]);
    }
    for (int j = 0; j < M; ++j) {
      const fv dv = fload(d[j] + v * kLanesV);
      for (int a = 0; a < R; ++a) {
        const fv dots = to_float(F::dot(wv[a], xs[j] + v * kBytesV, xu[j] + v * kBytesV));
        fv& c = acc[a][j][v % kAcc];
        if constexpr (F::kChannel)
          c = ffma(dots, dv, c);
        else
          c = ffma(dots, fmul(dv, sv[a]), c);
      }
    }
  }
  const int64_t gp = padded_groups(k);
  for (int a = 0; a < R; ++a)
    for (int j = 0; j < M; ++j) {
      fv sum = acc[a][j][0];
      if constexpr (kAcc == 2) sum = sum + acc[a][j][1];
      float total = fsum(sum);
      if constexpr (F::kMins) {  // + the sum over groups of min * d * sum(q)
        const float* mn = sc + a * stride + gp;
        const float* ds = x.dsum.data() + (i0 + j) * x.gp;
        fvec mins{};
        for (int64_t g = 0; g < gp; g += kLanes) mins += load(mn + g) * load(ds + g);
        total += hsum(mins);
      }
      out[j * R + a] = f.finish(r + a, total);
    }
}

constexpr int kRowsX = 4;  // rows of x per block

template <int R, typename F>
void qdot_rows(const F& f, const QuantizedRows& x, int64_t i0, int64_t rows, int64_t k,
               int64_t r, const float* sc, int64_t stride, float* out) {
  switch (rows) {
    case 1: return qdot_block<R, 1>(f, x, i0, k, r, sc, stride, out);
    case 2: return qdot_block<R, 2>(f, x, i0, k, r, sc, stride, out);
    case 3: return qdot_block<R, 3>(f, x, i0, k, r, sc, stride, out);
    default: return qdot_block<R, 4>(f, x, i0, k, r, sc, stride, out);
  }
}

// Rows [r0, r1) of a quantized weight against m rounded rows into y (row stride ld), two rows
// of W at a time against four of x (qgemm's loop; csrc/moe.cpp's experts too).
template <typename F>
void quantized_rows(const F& f, const QuantizedRows& x, int64_t m, int64_t k, int64_t r0,
                    int64_t r1, float* y, int64_t ld) {
  const int64_t stride = 2 * padded_groups(k);  // a row's scales and mins
  thread_local std::vector<float> sc;
  if (static_cast<int64_t>(sc.size()) < 2 * stride) sc.resize(2 * stride);
  float out[2 * kRowsX];
  for (int64_t r = r0; r < r1; r += 2) {
    const int R = r + 1 < r1 ? 2 : 1;
    for (int a = 0; a < R; ++a) f.begin(r + a, sc.data() + a * stride);
    for (int64_t i0 = 0; i0 < m; i0 += kRowsX) {
      const int64_t rows = std::min<int64_t>(kRowsX, m - i0);
      if (R == 2)
        qdot_rows<2>(f, x, i0, rows, k, r, sc.data(), stride, out);
      else
        qdot_rows<1>(f, x, i0, rows, k, r, sc.data(), stride, out);
      for (int64_t j = 0; j < rows; ++j)
        for (int a = 0; a < R; ++a) y[(i0 + j) * ld + r + a] = out[j * R + a];
    }
  }
}

// y (m, n) fp32 = rows of x against rows of W, two rows of W at a time.
template <typename F>
void qgemm(const F& f, const QuantizedRows& x, int64_t m, int64_t k, int64_t n, float* y,
           int64_t bytes_per_row) {
  // at least ~64 KiB of weights per thread: a small matrix is not worth waking the others
  const int64_t grain = std::max<int64_t>(2, (64 << 10) / bytes_per_row);
  parallel_chunks(0, (n + 1) / 2, grain / 2, [&](int64_t p0, int64_t p1) {
    quantized_rows(f, x, m, k, 2 * p0, std::min(n, 2 * p1), y, n);
  });
}

template <typename F>
torch::Tensor run_qlinear(const F& f, const torch::Tensor& x, int64_t n,
                          const std::optional<torch::Tensor>& bias, int64_t bytes_per_row) {
  return on_fp32_rows(x, n, bias, [&](const float* xf, int64_t m, int64_t k, float* y) {
    if (m == 1)
      qgemv_one(f.w, xf, k, n, y, bytes_per_row);  // qgemv_row.cpp
    else
      qgemm(f, QuantizedRows(xf, m, k, F::kInterleaved), m, k, n, y, bytes_per_row);
  });
}

}  // namespace

// Each returns None for what it does not handle (device, dtype, layout, K not a multiple of
// 32), so that the caller falls back to PyTorch.

std::optional<torch::Tensor> linear_int8(torch::Tensor x, torch::Tensor q, torch::Tensor scales,
                                         std::optional<torch::Tensor> bias) {
  ReleaseGil no_gil;
  if (q.dim() == 3) return packed_linear_int8(x, q, scales, bias);  // qgemv_packed.cpp
  const auto w = int8_weight(q, scales);
  if (!w || !gemv_input_ok(x, w->k)) return std::nullopt;
  if (w->scales_per_row == 1) return run_qlinear(Int8Rows<true>{*w}, x, q.size(0), bias, w->k);
  return run_qlinear(Int8Rows<false>{*w}, x, q.size(0), bias, w->k);
}

std::optional<torch::Tensor> linear_int4(torch::Tensor x, torch::Tensor q, torch::Tensor scales,
                                         torch::Tensor mins, std::optional<torch::Tensor> bias) {
  ReleaseGil no_gil;
  if (q.dim() == 3) return packed_linear_int4(x, q, scales, mins, bias);
  const auto w = int4_weight(q, scales, mins);
  if (!w || !gemv_input_ok(x, w->k)) return std::nullopt;
  return run_qlinear(Int4Rows{*w}, x, q.size(0), bias, w->k / 2 + 4 * w->k / kGroup);
}
