#include "gemv.h"

// ---- The experts' small GEMMs (csrc/moe.cpp): one expert's few rows of x (the tokens routed
// to it: ~4 each at batch 32 with top-8 of 64, 1..~70 in general) against a range of rows of
// its dense weight (fp32 / bf16 / fp16), y[i, r] = x_i . w_r. At these sizes the step reads
// every expert's weights once and the read sets the pace, so the kernel is built around one
// long sequential stream per thread:
//   - register tiles of 4 rows of W against up to kMoeTileX rows of x: each weight vector is
//     loaded once for all of them (x stays in L1); an expert with more rows takes several
//     passes over the same 4 rows of W (from L1), its rows split evenly between the passes
//     (7 rows: 4 + 3, not 6 + 1);
//   - a software prefetch `kMoePrefetch` bytes ahead of the reads, in the weight's memory
//     order, on the first pass: the next blocks, the next tile's rows (a thread takes
//     consecutive tiles: parallel_chunks), where gemv.cpp's gemm_tile only reaches the next
//     four rows (3 KiB for a 192-wide down projection: too close to hide the memory's
//     latency).
// Sums in fp32 (fmaw / sums4 of gemv.cpp), the same order for any number of rows of x.

namespace {

// Rows of x per register tile: 4 x 6 sums take 24 of AVX-512's 32 vector registers (plus 4
// of W and one of x); on 8 lanes (AVX2: 16 registers) 4 x 3, as gemv.cpp's kTileX.
#if defined(__AVX512F__)
constexpr int kMoeTileX = 6;
#else
constexpr int kMoeTileX = 3;
#endif

// How far ahead of its reads the kernel prefetches the weight stream, into L2 (AMD EPYC Zen 4
// with AVX-512, one thread, 64 experts of 192 x 512 fp32 with 1, 4 or 8 rows each: 8-16 KiB
// ahead read 14-18% faster than gemm_tile's next four rows; 2-4 KiB ahead, or into L1, no
// faster than those).
constexpr int64_t kMoePrefetch = 16384;

// Four rows of W (from w, k apart) against MX rows of x (k apart): out[4r + c] = x_r . w_c.
// `pf` (or nullptr): the bytes to prefetch alongside, as many per step as the step reads.
template <int MX, typename T>
void expert_tile(const T* w, int64_t k, const float* x, float* out, const char* pf) {
  constexpr int64_t kStepBytes = 4 * kLanesW * static_cast<int64_t>(sizeof(T));
  vw acc[MX][4];
  for (int r = 0; r < MX; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = zerow();
  for (int64_t i = 0; i < k; i += kLanesW) {
    vw wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = loadw(w + c * k + i);
    if (pf) {
      const char* p = pf + i / kLanesW * kStepBytes;
      for (int64_t b = 0; b < kStepBytes; b += 64) __builtin_prefetch(p + b, 0, 2);
    }
    for (int r = 0; r < MX; ++r) {
      const vw xv = loadw(x + r * k + i);
      for (int c = 0; c < 4; ++c) acc[r][c] = fmaw(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < MX; ++r) sums4(acc[r], out + 4 * r);
}

template <typename T>
void expert_tile_rows(int64_t rows, const T* w, int64_t k, const float* x, float* out,
                      const char* pf) {
  switch (rows) {
    case 1: return expert_tile<1>(w, k, x, out, pf);
    case 2: return expert_tile<2>(w, k, x, out, pf);
#if defined(__AVX512F__)
    case 3: return expert_tile<3>(w, k, x, out, pf);
    case 4: return expert_tile<4>(w, k, x, out, pf);
    case 5: return expert_tile<5>(w, k, x, out, pf);
#endif
    default: return expert_tile<kMoeTileX>(w, k, x, out, pf);
  }
}

// Rows [r0, r1) of one expert's weight w (n, k; r0, r1 multiples of 4) against its m rows of
// x (fp32, k apart): y[i * ld + r] = x_i . w_r.
template <typename T>
void expert_gemm(const T* w, int64_t k, const float* x, int64_t m, int64_t r0, int64_t r1,
                 float* y, int64_t ld) {
  const int64_t passes = (m + kMoeTileX - 1) / kMoeTileX;
  float out[4 * kMoeTileX];
  for (int64_t b = r0; b < r1; b += 4) {
    const T* wb = w + b * k;
    for (int64_t p = 0, i0 = 0; p < passes; ++p) {
      const int64_t rows = (m - i0) / (passes - p);  // the rest, evenly
      const char* pf = p == 0 ? reinterpret_cast<const char*>(wb) + kMoePrefetch : nullptr;
      expert_tile_rows(rows, wb, k, x + i0 * k, out, pf);
      for (int64_t i = 0; i < rows; ++i)
        for (int c = 0; c < 4; ++c) y[(i0 + i) * ld + b + c] = out[4 * i + c];
      i0 += rows;
    }
  }
}

}  // namespace
