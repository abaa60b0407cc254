#include "gemv.h"

// ---- Quantized linear layers on weights packed for AVX-512 VNNI (layers/quant.py `pack`):
// sixteen rows of W side by side, one row per int32 lane, so that one vpdpbusd multiplies
// four consecutive inputs of all sixteen rows by the same four bytes of x (broadcast) and the
// group's sum stays in its lane: no per-row horizontal sums, and per 64 bytes of weights one
// load and one vpdpbusd per row of x. Block b holds rows 16b .. 16b + 15:
//   int8  q (N/16, K/4, 64): byte 4r + j of [b, c] is row r's input 4c + j, stored as w ^ 0x80
//         (w + 128 as an unsigned byte: vpdpbusd multiplies unsigned by signed; each group's
//         dot starts at -128 * the sum of x's group, so it comes out exact); scales (N/16, S, 16) fp32, [b, s, r];
//   int4  q (N/16, K/8, 64): [b, 4g + j] holds bytes 4j .. 4j + 3 of each row's Q4_1 group g
//         (low nibbles: inputs 32g + 4j + t, high ones: 32g + 16 + 4j + t); scales and mins
//         (N/16, K/32, 16) fp16.
// x is rounded to int8 in groups of 32 as by every quantized path (qgemv_row.cpp's
// RoundedRow). Rows of x meet a block four at a time; blocks are spread over threads.

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define PAGEDLLM_PACKED 1
#endif

namespace {

constexpr int64_t kPackRows = 16;
constexpr int kPackX = 4;  // rows of x per pass over a block

#ifdef PAGEDLLM_PACKED
inline __m512i x4(const int8_t* p) {  // four bytes of x in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

struct Packed8 {
  const uint8_t* q;
  const float* scales;
  int64_t k, groups_per_scale, scale_groups;
};

// y[i][16b .. 16b + 16) for the MX rows x[0 .. MX) against block b.
template <int MX>
void block8(const Packed8& w, int64_t b, const RoundedRow* x, float* const* y) {
  const int64_t groups = w.k / kGroup;
  const uint8_t* q = w.q + b * w.k * kPackRows;
  const float* sc = w.scales + b * w.scale_groups * kPackRows;
  __m512 acc[MX];
  for (int i = 0; i < MX; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, q += kGroup * kPackRows) {
    __m512i dot[MX];
    for (int i = 0; i < MX; ++i) dot[i] = _mm512_set1_epi32(-128 * x[i].sum[g]);
    for (int c = 0; c < kGroup / 4; ++c) {
      const __m512i wv = _mm512_loadu_si512(q + 64 * c);
      for (int i = 0; i < MX; ++i)
        dot[i] = _mm512_dpbusd_epi32(dot[i], wv, x4(x[i].q.data() + g * kGroup + 4 * c));
    }
    const __m512 s = _mm512_loadu_ps(sc + (g / w.groups_per_scale) * kPackRows);
    for (int i = 0; i < MX; ++i) {
      const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(x[i].d[g]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), sd, acc[i]);
    }
  }
  for (int i = 0; i < MX; ++i) _mm512_storeu_ps(y[i] + b * kPackRows, acc[i]);
}

struct Packed4 {
  const uint8_t* q;
  const at::Half* scales;
  const at::Half* mins;
  int64_t k;
};

inline __m512 half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int MX>
void block4(const Packed4& w, int64_t b, const RoundedRow* x, float* const* y) {
  const int64_t groups = w.k / kGroup;
  const uint8_t* q = w.q + b * (w.k / 2) * kPackRows;
  const at::Half* sc = w.scales + b * groups * kPackRows;
  const at::Half* mn = w.mins + b * groups * kPackRows;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[MX];
  for (int i = 0; i < MX; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, q += kGroup / 2 * kPackRows) {
    __m512i dot[MX];
    for (int i = 0; i < MX; ++i) dot[i] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i wv = _mm512_loadu_si512(q + 64 * j);
      const __m512i lo = _mm512_and_si512(wv, mask);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), mask);
      for (int i = 0; i < MX; ++i) {
        const int8_t* xq = x[i].q.data() + g * kGroup + 4 * j;
        dot[i] = _mm512_dpbusd_epi32(dot[i], lo, x4(xq));
        dot[i] = _mm512_dpbusd_epi32(dot[i], hi, x4(xq + 16));
      }
    }
    const __m512 s = half16(sc + g * kPackRows), m = half16(mn + g * kPackRows);
    for (int i = 0; i < MX; ++i) {
      const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(x[i].d[g]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), sd, acc[i]);
      acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[i].dsum[g]), acc[i]);
    }
  }
  for (int i = 0; i < MX; ++i) _mm512_storeu_ps(y[i] + b * kPackRows, acc[i]);
}

template <typename W>
void block_rows(const W& w, int64_t b, const RoundedRow* x, int rows, float* const* y) {
  constexpr bool k8 = std::is_same_v<W, Packed8>;
  auto run = [&](auto mx) {
    if constexpr (k8)
      block8<decltype(mx)::value>(w, b, x, y);
    else
      block4<decltype(mx)::value>(w, b, x, y);
  };
  switch (rows) {
    case 1: return run(std::integral_constant<int, 1>{});
    case 2: return run(std::integral_constant<int, 2>{});
    case 3: return run(std::integral_constant<int, 3>{});
    default: return run(std::integral_constant<int, 4>{});
  }
}

template <typename W>
torch::Tensor packed_linear(const W& w, const torch::Tensor& x, int64_t n,
                            const std::optional<torch::Tensor>& bias, int64_t bytes_per_block) {
  return on_fp32_rows(x, n, bias, [&](const float* xf, int64_t m, int64_t k, float* y) {
    std::vector<RoundedRow> rows;
    rows.reserve(m);
    for (int64_t i = 0; i < m; ++i) rows.emplace_back(xf + i * k, k);
    // at least ~64 KiB of weights per thread: a small matrix is not worth waking the others
    const int64_t grain = std::max<int64_t>(1, (64 << 10) / bytes_per_block);
    parallel_for_rows(m, 0, n / kPackRows, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t i0 = 0; i0 < m; i0 += kPackX) {
          float* out[kPackX];
          const int r = static_cast<int>(std::min<int64_t>(kPackX, m - i0));
          for (int i = 0; i < r; ++i) out[i] = y + (i0 + i) * n;
          block_rows(w, b, rows.data() + i0, r, out);
        }
    });
  });
}

bool packed_ok(const torch::Tensor& t, int64_t d0, int64_t d1, int64_t d2, c10::ScalarType dtype) {
  return t.device().is_cpu() && t.dim() == 3 && t.size(0) == d0 && t.size(1) == d1 &&
         t.size(2) == d2 && t.scalar_type() == dtype && t.is_contiguous();
}
#endif

std::optional<torch::Tensor> packed_linear_int8(const torch::Tensor& x, const torch::Tensor& q,
                                                const torch::Tensor& scales,
                                                const std::optional<torch::Tensor>& bias) {
#ifdef PAGEDLLM_PACKED
  const int64_t blocks = q.size(0), k = q.size(1) * 4;
  const int64_t s = scales.dim() == 3 ? scales.size(1) : 0;
  if (s == 0 || k % s != 0 || (k / s) % kGroup != 0 || !packed_ok(q, blocks, k / 4, 64, torch::kChar) ||
      !packed_ok(scales, blocks, s, kPackRows, torch::kFloat) || !gemv_input_ok(x, k))
    return std::nullopt;
  const Packed8 w{reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>()), scales.data_ptr<float>(),
                  k, k / s / kGroup, s};
  return packed_linear(w, x, blocks * kPackRows, bias, kPackRows * (k + 4 * s));
#else
  return std::nullopt;
#endif
}

std::optional<torch::Tensor> packed_linear_int4(const torch::Tensor& x, const torch::Tensor& q,
                                                const torch::Tensor& scales,
                                                const torch::Tensor& mins,
                                                const std::optional<torch::Tensor>& bias) {
#ifdef PAGEDLLM_PACKED
  const int64_t blocks = q.size(0), k = q.size(1) * 8;
  if (!packed_ok(q, blocks, k / 8, 64, torch::kByte) ||
      !packed_ok(scales, blocks, k / kGroup, kPackRows, torch::kHalf) ||
      !packed_ok(mins, blocks, k / kGroup, kPackRows, torch::kHalf) || !gemv_input_ok(x, k))
    return std::nullopt;
  const Packed4 w{q.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(), k};
  return packed_linear(w, x, blocks * kPackRows, bias, kPackRows * (k / 2 + k / 8));
#else
  return std::nullopt;
#endif
}

}  // namespace

// 16 where the quantized kernels take weights packed sixteen rows at a time (AVX-512 VNNI),
// else 0: layers/quant.py packs a CPU model's quantized weights only where this says so.
int64_t packed_rows() {
#ifdef PAGEDLLM_PACKED
  return kPackRows;
#else
  return 0;
#endif
}
