"""C++ paged decode attention for the CPU, compiled on first use with `load_inline`.

The kernel reads each request's keys/values straight from the paged cache (no gather into a
padded tensor). Tasks are (request, KV head) pairs spread over the threads by
`at::parallel_for`; a thread attends its consecutive tasks of one request in a single pass over
the keys (each cache slot read as one contiguous run), and each key is loaded once for the
`group` query heads of its KV head (and each value once for up to 4 of them); the next tile's
slots are prefetched while a tile is scored (the cache is paged: the hardware prefetcher
cannot follow it). Online softmax in fp32 over tiles of 32 keys; fp32, bf16 and fp16 caches, accumulation in fp32, head_dim a
multiple of 16 up to 256. `write_kv` stores a step's new keys and values in their slots (one
copy per token).

The same extension holds the decoder layers' fused elementwise ops (`rms_norm`,
`fused_add_rms_norm`, `silu_and_mul`, `rotary_embedding` in place on q and k): one pass per
row in fp32, rounded once to the dtype, rows spread over threads only above ~16k elements (a
decode of one row stays on the caller's thread). Their wrappers fall back to plain PyTorch for what the kernels do not handle
(no extension, another device or dtype, a layout that cannot be written in place).

Built with `-O3 -march=native`, so the extension's name carries a hash of the source, the
flags, the torch version and the CPU's identity: another CPU (or source) compiles its own.
If the build fails (no compiler, no `ninja`, ...) `load_kernels()` returns None once with a
warning and callers fall back to pure PyTorch; `PAGEDLLM_CPU_KERNEL=0` forces that fallback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def _put_venv_bin_on_path() -> None:
    """The build runs `ninja` from PATH; pip installs it next to this interpreter, which a
    virtual environment used without activation (e.g. `.venv/bin/python ...`) lacks on PATH."""
    bindir = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.exists(os.path.join(bindir, "ninja")):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


_put_venv_bin_on_path()

MAX_GROUP = 16  # query heads per KV head
MAX_HEAD_DIM = 256
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno") + (
    # gcc tunes recent x86 for 256-bit vectors; the kernel's 16-lane vectors want 512
    ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()
)
_LDFLAGS = ("-fopenmp",)  # resolves to the libgomp that torch already loaded (same soname)

_CPP_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// GCC/Clang vector extensions: 16 fp32 lanes, lowered to whatever SIMD the CPU has
// (intrinsics only where gcc lowers a 16-bit -> fp32 conversion poorly).
constexpr int64_t kLanes = 16;
typedef float fvec __attribute__((vector_size(64)));
typedef float fvec8 __attribute__((vector_size(32)));
typedef float fvec4 __attribute__((vector_size(16)));
typedef uint16_t u16vec __attribute__((vector_size(32)));
typedef uint32_t u32vec __attribute__((vector_size(64)));

constexpr int64_t kMaxGroup = 16;
constexpr int64_t kMaxVecs = 16;  // head_dim <= 256
constexpr int64_t kTile = 32;  // keys per online-softmax update
constexpr int64_t kMaxRows = 64;  // query heads attended in one pass over the keys
constexpr int64_t kScratchVecs = 512;  // query (and accumulator) vectors of a pass

template <typename scalar_t>
struct Args {
  const scalar_t* q;
  int64_t q_stride_req, q_stride_head;
  const scalar_t* cache;
  int64_t block_size, slot_stride, kv_heads, nv, group;  // nv = head_dim / kLanes
  const int64_t* block_tables;
  int64_t table_stride;
  const int64_t* context_lens;
  scalar_t* out;  // contiguous (D, H, head_dim)
  float scale;
  int64_t window;  // 0: no sliding window
};

// Request b, KV heads [h0, h1): query heads ("rows") [h0 * group, h1 * group).
struct Pass {
  int64_t b, h0, h1, rows;
};

struct Scratch {
  fvec q[kScratchVecs];  // the rows' queries, scaled: row r at q[r * nv]
  fvec acc[kScratchVecs];  // their unnormalized outputs
  float scores[kMaxRows * kTile];
  float max[kMaxRows];
  float sum[kMaxRows];
  float alpha[kMaxRows];  // rescaling of acc by the last max update
};

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

// 16 values as fp32.
inline fvec load(const float* p) { return load_raw<fvec>(p); }

inline fvec load(const at::BFloat16* p) {
#if defined(__AVX512F__)
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return bit_cast<fvec>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#else
  return bit_cast<fvec>(__builtin_convertvector(load_raw<u16vec>(p), u32vec) << 16);
#endif
}

inline fvec load(const at::Half* p) {
#if defined(__AVX512F__)
  return bit_cast<fvec>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  const auto* h = reinterpret_cast<const __m128i*>(p);
  return bit_cast<fvec>(std::array<__m256, 2>{_mm256_cvtph_ps(_mm_loadu_si128(h)),
                                              _mm256_cvtph_ps(_mm_loadu_si128(h + 1))});
#else
  fvec v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

// 16 fp32 values rounded to the cache dtype (to nearest even, like c10's conversions).
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
  const auto halves = bit_cast<std::array<fvec8, 2>>(v);
  const auto quarters = bit_cast<std::array<fvec4, 2>>(halves[0] + halves[1]);
  const fvec4 s = quarters[0] + quarters[1];
  return (s[0] + s[2]) + (s[1] + s[3]);
}

typedef int32_t i32vec __attribute__((vector_size(64)));

// exp(x) on 16 lanes (Cephes polynomial, rel. error ~1e-7), x clamped to [-87, 88].
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

inline float hmax(fvec v) {
  float m = v[0];
  for (int64_t l = 1; l < kLanes; ++l) m = v[l] > m ? v[l] : m;
  return m;
}

template <typename scalar_t>
void load_queries(const Args<scalar_t>& a, const Pass& p, int64_t nv, Scratch& s) {
  const scalar_t* q = a.q + p.b * a.q_stride_req + p.h0 * a.group * a.q_stride_head;
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < nv; ++c) {
      s.q[r * nv + c] = load(q + r * a.q_stride_head + c * kLanes) * a.scale;
      s.acc[r * nv + c] = fvec{};
    }
    s.max[r] = -std::numeric_limits<float>::infinity();
    s.sum[r] = 0.f;
  }
}

// Cache slot of each key in [t0, t0 + n): rows[i] points at its keys, then its values.
template <typename scalar_t>
void locate_keys(const Args<scalar_t>& a, int64_t b, int64_t t0, int64_t n,
                 const scalar_t** slots) {
  const int64_t* table = a.block_tables + b * a.table_stride;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = t0 + i;
    const int64_t slot = table[t / a.block_size] * a.block_size + t % a.block_size;
    slots[i] = a.cache + slot * a.slot_stride;
  }
}

// Each key is loaded (and converted) once for all the query heads of its KV head.
template <typename scalar_t, int64_t NV>
void score_tile(const Args<scalar_t>& a, const Pass& p, const scalar_t* const* slots,
                int64_t n, int64_t nv, Scratch& s, const scalar_t* const* ahead, int64_t n_ahead) {
  const int64_t slot_bytes = a.slot_stride * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t i = 0; i < n; ++i) {
    if (i < n_ahead) {
      const char* next = reinterpret_cast<const char*>(ahead[i]);
      for (int64_t b = 0; b < slot_bytes; b += 64) __builtin_prefetch(next + b, 0, 2);
    }
    for (int64_t h = p.h0; h < p.h1; ++h) {
      fvec key[NV > 0 ? NV : kMaxVecs];
      for (int64_t c = 0; c < nv; ++c) key[c] = load(slots[i] + (h * nv + c) * kLanes);
      for (int64_t r = (h - p.h0) * a.group; r < (h - p.h0 + 1) * a.group; ++r) {
        fvec dot = s.q[r * nv] * key[0];
        for (int64_t c = 1; c < nv; ++c) dot += s.q[r * nv + c] * key[c];
        s.scores[r * kTile + i] = hsum(dot);
      }
    }
  }
}

// Scores -> probabilities under the running max; alpha rescales what was accumulated.
// 16 scores at a time: the tile's unused tail is -inf, then probability 0.
inline void softmax_update(int64_t rows, int64_t n, Scratch& s) {
  const int64_t vecs = (n + kLanes - 1) / kLanes;
  const i32vec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t r = 0; r < rows; ++r) {
    float* sc = s.scores + r * kTile;
    for (int64_t i = n; i < vecs * kLanes; ++i) sc[i] = -std::numeric_limits<float>::infinity();
    fvec top = load(sc);
    for (int64_t v = 1; v < vecs; ++v) {
      const fvec x = load(sc + v * kLanes);
      top = x > top ? x : top;
    }
    const float new_max = std::max(s.max[r], hmax(top));
    fvec sum{};
    for (int64_t v = 0; v < vecs; ++v) {
      const fvec e = exp_vec(load(sc + v * kLanes) - new_max);
      const fvec p = lane + static_cast<int32_t>(v * kLanes) < static_cast<int32_t>(n) ? e : fvec{};
      store(sc + v * kLanes, p);
      sum += p;
    }
    s.alpha[r] = std::exp(s.max[r] - new_max);  // 0 on the first tile
    s.sum[r] = s.sum[r] * s.alpha[r] + hsum(sum);
    s.max[r] = new_max;
  }
}

// Rows [r0, r0 + R) of one KV head (values at `v_offset` in each slot), their accumulators
// in registers: each value vector is loaded (and converted) once for the R rows.
template <typename scalar_t, int64_t NV, int64_t R>
void accumulate_rows(const scalar_t* const* slots, int64_t n, int64_t nv, int64_t v_offset,
                     int64_t r0, Scratch& s) {
  constexpr int64_t kVecs = NV > 0 ? NV : kMaxVecs;
  fvec acc[R][kVecs];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < nv; ++c) acc[r][c] = s.acc[(r0 + r) * nv + c] * s.alpha[r0 + r];
  for (int64_t i = 0; i < n; ++i) {
    fvec value[kVecs];
    for (int64_t c = 0; c < nv; ++c) value[c] = load(slots[i] + v_offset + c * kLanes);
    for (int64_t r = 0; r < R; ++r) {
      const float prob = s.scores[(r0 + r) * kTile + i];
      for (int64_t c = 0; c < nv; ++c) acc[r][c] += prob * value[c];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < nv; ++c) s.acc[(r0 + r) * nv + c] = acc[r][c];
}

// The rows of each KV head in runs of up to 4 (head_dim 64) or 2 (128), so that their
// accumulators stay in registers; one row at a time for other head dims.
template <typename scalar_t, int64_t NV>
void accumulate_values(const Args<scalar_t>& a, const Pass& p, const scalar_t* const* slots,
                       int64_t n, int64_t nv, Scratch& s) {
  constexpr int64_t kRun = NV == 4 ? 4 : NV == 8 ? 2 : 1;
  for (int64_t h = p.h0; h < p.h1; ++h) {
    const int64_t v_offset = (a.kv_heads + h) * nv * kLanes;
    const int64_t last = (h - p.h0 + 1) * a.group;
    for (int64_t r0 = (h - p.h0) * a.group; r0 < last;) {
      const int64_t rows = std::min(kRun, last - r0);
      if (rows >= 4) accumulate_rows<scalar_t, NV, kRun>(slots, n, nv, v_offset, r0, s);
      else if (rows == 3) accumulate_rows<scalar_t, NV, 3>(slots, n, nv, v_offset, r0, s);
      else if (rows == 2) accumulate_rows<scalar_t, NV, 2>(slots, n, nv, v_offset, r0, s);
      else accumulate_rows<scalar_t, NV, 1>(slots, n, nv, v_offset, r0, s);
      r0 += rows;
    }
  }
}

template <typename scalar_t>
void store_output(const Args<scalar_t>& a, const Pass& p, int64_t nv, Scratch& s) {
  const int64_t num_heads = a.kv_heads * a.group;
  scalar_t* out = a.out + (p.b * num_heads + p.h0 * a.group) * nv * kLanes;
  for (int64_t r = 0; r < p.rows; ++r) {
    const float inv = s.sum[r] > 0.f ? 1.f / s.sum[r] : 0.f;  // no keys: zeros
    for (int64_t c = 0; c < nv; ++c)
      store(out + (r * nv + c) * kLanes, s.acc[r * nv + c] * inv);
  }
}

// The first key attended in request b's context.
template <typename scalar_t>
int64_t first_key(const Args<scalar_t>& a, int64_t b) {
  return a.window > 0 ? std::max<int64_t>(0, a.context_lens[b] - a.window) : 0;
}

// NV = head_dim / 16 fixed at compile time (registers, full unrolling), or 0: from the args.
// The cache is paged, so the hardware cannot guess where the next keys are: while a tile is
// scored, the next one's slots are prefetched, one slot per key (all at once would fill the
// line-fill buffers the tile's own loads need); the next tile of the last one is the first
// of `next`, the thread's next pass (if any).
template <typename scalar_t, int64_t NV>
void attend(const Args<scalar_t>& a, const Pass& p, const Pass* next, Scratch& s) {
  const int64_t nv = NV > 0 ? NV : a.nv;
  load_queries(a, p, nv, s);
  const int64_t ctx = a.context_lens[p.b];
  const int64_t start = first_key(a, p.b);
  const scalar_t* tiles[2][kTile];  // this tile's slots and the next one's
  if (start < ctx) locate_keys(a, p.b, start, std::min(kTile, ctx - start), tiles[0]);
  for (int64_t t0 = start, k = 0; t0 < ctx; t0 += kTile, k ^= 1) {
    const int64_t n = std::min(kTile, ctx - t0);
    int64_t n_ahead = 0;
    if (t0 + kTile < ctx) {
      n_ahead = std::min(kTile, ctx - t0 - kTile);
      locate_keys(a, p.b, t0 + kTile, n_ahead, tiles[k ^ 1]);
    } else if (next != nullptr) {
      const int64_t next_start = first_key(a, next->b);
      n_ahead = std::max<int64_t>(0, std::min(kTile, a.context_lens[next->b] - next_start));
      locate_keys(a, next->b, next_start, n_ahead, tiles[k ^ 1]);
    }
    score_tile<scalar_t, NV>(a, p, tiles[k], n, nv, s, tiles[k ^ 1], n_ahead);
    softmax_update(p.rows, n, s);
    accumulate_values<scalar_t, NV>(a, p, tiles[k], n, nv, s);
  }
  store_output(a, p, nv, s);
}

// Tasks are (request, KV head) pairs; a thread attends its consecutive tasks of one request
// in a single pass over the keys, which reads each cache slot as one contiguous run.
template <typename scalar_t, int64_t NV>
void run(const Args<scalar_t>& a, int64_t num_reqs) {
  const int64_t max_heads = std::min(kMaxRows, kScratchVecs / a.nv) / a.group;
  at::parallel_for(0, num_reqs * a.kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch s;  // on the thread's stack
    const auto pass_at = [&](int64_t task) {
      const int64_t b = task / a.kv_heads, h0 = task % a.kv_heads;
      const int64_t h1 = std::min({a.kv_heads, h0 + max_heads, end - b * a.kv_heads});
      return Pass{b, h0, h1, (h1 - h0) * a.group};
    };
    for (int64_t task = begin; task < end;) {
      const Pass pass = pass_at(task);
      task += pass.h1 - pass.h0;
      const Pass next = task < end ? pass_at(task) : pass;
      attend<scalar_t, NV>(a, pass, task < end ? &next : nullptr, s);
    }
  });
}

template <typename scalar_t>
void dispatch_head_dim(const Args<scalar_t>& a, int64_t num_reqs) {
  switch (a.nv) {
    case 4: return run<scalar_t, 4>(a, num_reqs);  // head_dim 64
    case 8: return run<scalar_t, 8>(a, num_reqs);  // head_dim 128
    default: return run<scalar_t, 0>(a, num_reqs);
  }
}

// Every context length fits its block-table row, every block id used is in the cache.
void check_tables(const torch::Tensor& tables, const torch::Tensor& lens, int64_t block_size,
                  int64_t num_blocks, int64_t window) {
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < lens.size(0); ++b) {
    TORCH_CHECK(len[b] >= 0 && len[b] <= tables.size(1) * block_size,
                "context length ", len[b], " of request ", b, " exceeds its block table");
    const int64_t start = window > 0 ? std::max<int64_t>(0, len[b] - window) : 0;
    for (int64_t k = start / block_size; k * block_size < len[b]; ++k) {
      const int64_t id = table[b * tables.stride(0) + k];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " out of range");
    }
  }
}

void check_inputs(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& cache,
                  const torch::Tensor& tables, const torch::Tensor& lens) {
  for (const auto* t : {&out, &q, &cache, &tables, &lens})
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q: (D, H, head_dim), last dim contiguous");
  TORCH_CHECK(cache.dim() == 5 && cache.size(2) == 2 && cache.is_contiguous(),
              "kv_cache: contiguous (num_blocks, block_size, 2, kv_heads, head_dim)");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, kv_cache and out must share a dtype");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out: contiguous, shaped as q");
  TORCH_CHECK(cache.size(4) == q.size(2), "head_dim of q and kv_cache differ");
  TORCH_CHECK(q.size(1) % cache.size(3) == 0, "num_heads must be a multiple of kv_heads");
  TORCH_CHECK(q.size(1) / cache.size(3) <= kMaxGroup, "more than 16 query heads per KV head");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= kMaxVecs * kLanes,
              "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(tables.scalar_type() == torch::kInt64 && tables.dim() == 2 &&
                  tables.stride(1) == 1 && tables.size(0) >= q.size(0),
              "block_tables: int64 (D, max_blocks), rows contiguous");
  TORCH_CHECK(lens.scalar_type() == torch::kInt64 && lens.dim() == 1 && lens.is_contiguous() &&
                  lens.size(0) == q.size(0),
              "context_lens: contiguous int64 (D,)");
}

template <typename scalar_t>
Args<scalar_t> make_args(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& cache,
                         const torch::Tensor& tables, const torch::Tensor& lens, double scale,
                         int64_t window) {
  const int64_t kv_heads = cache.size(3), head_dim = cache.size(4);
  return Args<scalar_t>{q.data_ptr<scalar_t>(), q.stride(0), q.stride(1),
                        cache.data_ptr<scalar_t>(), cache.size(1), 2 * kv_heads * head_dim,
                        kv_heads, head_dim / kLanes, q.size(1) / kv_heads,
                        tables.data_ptr<int64_t>(), tables.stride(0),
                        lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                        static_cast<float>(scale), window};
}

template <typename scalar_t>
void launch(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& cache,
            const torch::Tensor& tables, const torch::Tensor& lens, double scale,
            int64_t window) {
  const auto args = make_args<scalar_t>(out, q, cache, tables, lens, scale, window);
  pybind11::gil_scoped_release no_gil;
  dispatch_head_dim(args, q.size(0));
}

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache,
                            torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                            int64_t sliding_window) {
  check_inputs(out, q, kv_cache, block_tables, context_lens);
  const int64_t window = std::max<int64_t>(sliding_window, 0);
  check_tables(block_tables, context_lens, kv_cache.size(1), kv_cache.size(0), window);
  const auto launch_as = [&](auto dtype_tag) {
    launch<decltype(dtype_tag)>(out, q, kv_cache, block_tables, context_lens, scale, window);
  };
  switch (q.scalar_type()) {
    case torch::kFloat: return launch_as(float{});
    case torch::kBFloat16: return launch_as(at::BFloat16{});
    case torch::kHalf: return launch_as(at::Half{});
    default: TORCH_CHECK(false, "paged_decode_attention: fp32, bf16 or fp16 only");
  }
}

// ---- Fused elementwise ops of the decoder layers: RMSNorm (optionally after the residual
// add) and SiLU-and-mul. Row-wise over 2-D tensors whose rows are contiguous, in fp32, each
// result rounded once to the tensor dtype.

namespace {


// A call smaller than this many elements (per thread) runs on the calling thread alone.
constexpr int64_t kElementwiseGrain = 16384;

int64_t row_grain(int64_t cols) {
  return std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(cols, 1));
}

template <typename scalar_t>
inline float to_float(scalar_t v) { return static_cast<float>(v); }

template <typename scalar_t>
float sum_squares(const scalar_t* x, int64_t n) {
  fvec acc0{}, acc1{};
  int64_t c = 0;
  for (; c + 2 * kLanes <= n; c += 2 * kLanes) {
    const fvec a = load(x + c), b = load(x + c + kLanes);
    acc0 += a * a;
    acc1 += b * b;
  }
  for (; c + kLanes <= n; c += kLanes) {
    const fvec a = load(x + c);
    acc0 += a * a;
  }
  float s = hsum(acc0 + acc1);
  for (; c < n; ++c) s += to_float(x[c]) * to_float(x[c]);
  return s;
}

// out = (x * rsqrt(mean(x^2) + eps)) * weight, the order of transformers' LlamaRMSNorm.
template <typename scalar_t>
void normalize_row(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) store(out + c, (load(x + c) * inv) * load(w + c));
  for (; c < n; ++c) out[c] = static_cast<scalar_t>((to_float(x[c]) * inv) * to_float(w[c]));
}

// residual += x (rounded to the dtype), then x = the normalized residual.
template <typename scalar_t>
void add_normalize_row(scalar_t* x, scalar_t* res, const scalar_t* w, int64_t n, float eps) {
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) store(res + c, load(res + c) + load(x + c));
  for (; c < n; ++c) res[c] = static_cast<scalar_t>(to_float(res[c]) + to_float(x[c]));
  normalize_row(res, w, x, n, eps);  // the norm of the rounded sum, as unfused
}

template <typename scalar_t>
void silu_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t n) {
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    const fvec g = load(gate + c);
    store(out + c, g / (1.f + exp_vec(-g)) * load(up + c));
  }
  for (; c < n; ++c) {
    const float g = to_float(gate[c]);
    out[c] = static_cast<scalar_t>(g / (1.f + std::exp(-g)) * to_float(up[c]));
  }
}

// Rotates the interleaved pairs (x[2i], x[2i+1]) of one head by (cos, sin)[i], in fp32:
// (x0 c - x1 s, x0 s + x1 c), the complex multiply (x0 + i x1)(c + i s).
template <typename scalar_t>
void rotate_row(scalar_t* x, const float* cos_sin, int64_t n) {
  for (int64_t i = 0; i < n; i += 2) {
    const float x0 = to_float(x[i]), x1 = to_float(x[i + 1]);
    const float c = cos_sin[i], s = cos_sin[i + 1];
    x[i] = static_cast<scalar_t>(x0 * c - x1 * s);
    x[i + 1] = static_cast<scalar_t>(x0 * s + x1 * c);
  }
}

// Whether the kernels handle t: a CPU tensor of one of their dtypes.
bool supported(const torch::Tensor& t) {
  const auto dtype = t.scalar_type();
  return t.device().is_cpu() &&
         (dtype == torch::kFloat || dtype == torch::kBFloat16 || dtype == torch::kHalf);
}

// t as rows of its last dim, each contiguous, `stride` apart: 2-D with a unit last stride, or
// contiguous. False otherwise.
struct Rows {
  int64_t rows = 0, cols = 0, stride = 0;
};

bool as_rows(const torch::Tensor& t, Rows& r) {
  if (t.dim() == 0 || t.size(-1) == 0 || t.stride(-1) != 1) return false;
  r.cols = t.size(-1);
  r.rows = t.numel() / r.cols;
  if (t.dim() == 2) {
    r.stride = t.stride(0);
    return true;
  }
  r.stride = r.cols;
  return t.is_contiguous();
}

bool norm_weight_ok(const torch::Tensor& x, const torch::Tensor& weight) {
  return weight.device().is_cpu() && weight.scalar_type() == x.scalar_type() &&
         weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1);
}

// Calls f(dtype_tag) for the fp32/bf16/fp16 dtype of t.
template <typename F>
void dispatch_float_dtype(const torch::Tensor& t, F&& f) {
  switch (t.scalar_type()) {
    case torch::kFloat: return f(float{});
    case torch::kBFloat16: return f(at::BFloat16{});
    default: return f(at::Half{});
  }
}

}  // namespace

// The three ops return None (false) for what they do not handle (device, dtype, layout,
// weight), so that the caller falls back to PyTorch without checking first.

std::optional<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  if (!supported(x) || x.dim() == 0 || !norm_weight_ok(x, weight)) return std::nullopt;
  Rows in;
  if (!as_rows(x, in)) {
    x = x.contiguous();
    if (!as_rows(x, in)) return std::nullopt;  // no columns
  }
  auto out = torch::empty(x.sizes(), x.options());
  dispatch_float_dtype(x, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const float feps = static_cast<float>(eps);
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, in.rows, row_grain(in.cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        normalize_row(xp + r * in.stride, wp, op + r * in.cols, in.cols, feps);
    });
  });
  return out;
}

bool fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                        double eps) {
  if (!supported(x) || x.dim() == 0 || !norm_weight_ok(x, weight)) return false;
  if (!residual.device().is_cpu() || residual.scalar_type() != x.scalar_type() ||
      residual.sizes() != x.sizes())
    return false;
  Rows xr, rr;
  if (!as_rows(x, xr) || !as_rows(residual, rr)) return false;  // not writable in place
  dispatch_float_dtype(x, [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const float feps = static_cast<float>(eps);
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, xr.rows, row_grain(xr.cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        add_normalize_row(xp + r * xr.stride, rp + r * rr.stride, wp, xr.cols, feps);
    });
  });
  return true;
}

std::optional<torch::Tensor> silu_and_mul(torch::Tensor gate_up) {
  if (!supported(gate_up) || gate_up.dim() == 0) return std::nullopt;
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "silu_and_mul: an even number of columns");
  Rows in;
  if (!as_rows(gate_up, in)) {
    gate_up = gate_up.contiguous();
    if (!as_rows(gate_up, in)) return std::nullopt;  // no columns
  }
  auto sizes = gate_up.sizes().vec();
  const int64_t cols = sizes.back() / 2;
  sizes.back() = cols;
  auto out = torch::empty(sizes, gate_up.options());
  dispatch_float_dtype(gate_up, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, in.rows, row_grain(cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        silu_mul_row(gp + r * in.stride, gp + r * in.stride + cols, op + r * cols, cols);
    });
  });
  return out;
}

// Rotary embedding in place: the first `heads` heads of each token of qkv (N, >= heads,
// head_dim), rows contiguous, by that token's cos_sin (N, head_dim / 2, 2) fp32 contiguous.
// False (untouched) for what it does not handle.
bool rotary_embedding(torch::Tensor qkv, torch::Tensor cos_sin, int64_t heads) {
  if (!supported(qkv) || qkv.dim() != 3 || !cos_sin.device().is_cpu()) return false;
  const int64_t n = qkv.size(0), head_dim = qkv.size(2);
  if (head_dim % 2 != 0 || qkv.stride(2) != 1 || qkv.stride(1) != head_dim ||
      heads < 0 || heads > qkv.size(1) || cos_sin.scalar_type() != torch::kFloat ||
      !cos_sin.is_contiguous() || cos_sin.numel() != n * head_dim)
    return false;
  const float* cs = cos_sin.data_ptr<float>();
  const int64_t stride = qkv.stride(0);
  dispatch_float_dtype(qkv, [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* x = qkv.data_ptr<scalar_t>();
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, n, row_grain(heads * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h)
          rotate_row(x + t * stride + h * head_dim, cs + t * head_dim, head_dim);
    });
  });
  return true;
}

// Stores each token's new keys and values, kv (N, 2, kv_heads, head_dim) with each token's
// 2 * kv_heads * head_dim values contiguous, into its slot of the cache (num_blocks,
// block_size, 2, kv_heads, head_dim). False (nothing written) for what it does not handle.
bool write_kv(torch::Tensor kv, torch::Tensor kv_cache, torch::Tensor slot_mapping) {
  if (!supported(kv) || kv.dim() != 4 || kv_cache.dim() != 5 || !kv_cache.device().is_cpu() ||
      kv_cache.scalar_type() != kv.scalar_type() || !kv_cache.is_contiguous() ||
      !slot_mapping.device().is_cpu() || slot_mapping.scalar_type() != torch::kInt64 ||
      slot_mapping.dim() != 1 || slot_mapping.size(0) != kv.size(0) ||
      !slot_mapping.is_contiguous())
    return false;
  const int64_t n = kv.size(0), row = kv_cache.stride(1);  // one slot's values
  if (kv.numel() != n * row || kv.stride(3) != 1 || kv.stride(2) != kv.size(3) ||
      kv.stride(1) != kv.size(2) * kv.size(3) || kv.size(1) * kv.stride(1) != row)
    return false;
  const int64_t num_slots = kv_cache.size(0) * kv_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv: slot ", slots[t],
                " out of range");
  const auto* src = static_cast<const char*>(kv.data_ptr());
  auto* dst = static_cast<char*>(kv_cache.data_ptr());
  const int64_t bytes = row * kv.element_size(), src_stride = kv.stride(0) * kv.element_size();
  for (int64_t t = 0; t < n; ++t) std::memcpy(dst + slots[t] * bytes, src + t * src_stride, bytes);
  return true;
}
"""

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "module" (the extension or None) once the first load was tried


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def extension_name() -> str:
    key = "\n".join([_CPP_SOURCE, *_CFLAGS, *_LDFLAGS, torch.__version__, _cpu_identity()])
    return "pagedllm_cpu_attention_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _build() -> Any:
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name=extension_name(),
        cpp_sources=[_CPP_SOURCE],
        functions=[
            "paged_decode_attention",
            "rms_norm",
            "fused_add_rms_norm",
            "silu_and_mul",
            "rotary_embedding",
            "write_kv",
        ],
        extra_cflags=list(_CFLAGS),
        extra_ldflags=list(_LDFLAGS),  # copies: load_inline appends to them
        verbose=False,
    )


def load_kernels() -> Any | None:
    """The compiled extension (built or loaded from the torch extensions cache on the first
    call), or None if it cannot be built or `PAGEDLLM_CPU_KERNEL=0`."""
    with _lock:
        if "module" not in _state:
            _state["module"] = None
            if os.environ.get("PAGEDLLM_CPU_KERNEL", "1") == "0":
                logger.info("PAGEDLLM_CPU_KERNEL=0: CPU attention kernel disabled")
            else:
                try:
                    _state["module"] = _build()
                except Exception as e:  # any build failure means: use the fallback
                    logger.warning("CPU attention kernel unavailable (%s); using PyTorch", e)
        return _state["module"]


def kernel_available() -> bool:
    return load_kernels() is not None


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these shapes/dtypes (else use the PyTorch path)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = kv_cache.shape[3]
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and kv_cache.dtype == q.dtype
        and kv_cache.is_contiguous()
        and num_heads % kv_heads == 0
        and num_heads // kv_heads <= MAX_GROUP
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
    )


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per request over its paged context, written into `out`.

    out: contiguous (D, H, head_dim), dtype of q; q: (D, H, head_dim), any strides with a
    contiguous last dim; kv_cache: contiguous (num_blocks, block_size, 2, kv_heads, head_dim);
    block_tables: int64 (>= D, max_blocks) with contiguous rows; context_lens: int64 (D,), the
    tokens in the cache including the new one. Only keys at positions >= ctx - sliding_window
    are attended if a window is given. Raises RuntimeError if the kernel is unavailable.
    """
    module = load_kernels()
    if module is None:
        raise RuntimeError("CPU attention kernel unavailable (see the logged build error)")
    if q.stride(-1) != 1:
        q = q.contiguous()
    module.paged_decode_attention(
        out, q, kv_cache, block_tables, context_lens, float(scale), sliding_window or 0
    )
    return out


# ---- Fused elementwise ops of the decoder layers (the model calls these on any device: they
# run the kernel for CPU tensors of a supported dtype, else plain PyTorch).


def _module() -> Any | None:
    try:
        return _state["module"]
    except KeyError:
        return load_kernels()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`(x * rsqrt(mean(x^2, -1) + eps)) * weight` over the last dim, in fp32, rounded once to
    x's dtype (transformers' LlamaRMSNorm in fp32). A new tensor."""
    module = _module()
    out = None if module is None else module.rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps) if out is None else out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual = residual + x; x = rms_norm(residual, weight, eps)`: returns (x, residual).

    Consumes its inputs: the kernel overwrites them in place (and returns them), the PyTorch
    fallback returns new tensors, so use the returned ones. The norm is that of the sum rounded
    to the dtype, as unfused."""
    module = _module()
    if module is not None and module.fused_add_rms_norm(x, residual, weight, eps):
        return x, residual
    residual = residual + x
    return F.rms_norm(residual, weight.shape, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` where `gate, up = gate_up.chunk(2, -1)`, in fp32, rounded once."""
    module = _module()
    out = None if module is None else module.silu_and_mul(gate_up)
    if out is None:
        gate, up = gate_up.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out


def rotary_embedding(qk: torch.Tensor, rotary: torch.Tensor) -> None:
    """Rotates `qk` (N, heads, head_dim) in place: each head's interleaved pairs
    (x[2i], x[2i+1]) as complex numbers times `rotary` (N, 1, head_dim / 2) complex64, in fp32,
    rounded once to qk's dtype."""
    module = _module()
    n, heads, head_dim = qk.shape
    if module is not None and module.rotary_embedding(qk, torch.view_as_real(rotary), heads):
        return
    rotated = torch.view_as_complex(qk.float().view(n, heads, head_dim // 2, 2)) * rotary
    qk.copy_(torch.view_as_real(rotated).view(n, heads, head_dim))


def write_kv(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`kv_cache` (num_blocks, block_size, 2, kv_heads, head_dim) gets each token's keys and
    values `kv` (N, 2, kv_heads, head_dim) in its slot (block * block_size + offset)."""
    module = _module()
    if module is None or not module.write_kv(kv, kv_cache, slot_mapping):
        kv_cache.view(-1, *kv_cache.shape[2:]).index_copy_(0, slot_mapping, kv)
