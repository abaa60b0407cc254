"""C++ paged decode attention for the CPU, compiled on first use with `load_inline`.

The kernel reads each request's keys/values straight from the paged cache (no gather into a
padded tensor). Tasks are (request, KV head) pairs spread over the threads by
`at::parallel_for`; a thread attends its consecutive tasks of one request in a single pass over
the keys (each cache slot read as one contiguous run), and each key is loaded once for the
`group` query heads of its KV head. Online softmax in fp32 over tiles of 32 keys; fp32, bf16
and fp16 caches, accumulation in fp32, head_dim a multiple of 16 up to 256.

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
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)

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

// exp(x) for x <= 0 (Cephes polynomial, rel. error ~1e-7): plain arithmetic, so the loop
// calling it vectorizes. Inputs below -87 flush to ~1e-38.
inline float exp_nonpositive(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  x = x < -87.f ? -87.f : x;
  const float shifted = x * 1.44269504088896341f + kRound;
  const float n = shifted - kRound;
  const int32_t ni = bit_cast<int32_t>(shifted) - bit_cast<int32_t>(kRound);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * bit_cast<float>((ni + 127) << 23);
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
                int64_t n, int64_t nv, Scratch& s) {
  for (int64_t i = 0; i < n; ++i) {
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
inline void softmax_update(int64_t rows, int64_t n, Scratch& s) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sc = s.scores + r * kTile;
    float tile_max = sc[0];
    for (int64_t i = 1; i < n; ++i) tile_max = sc[i] > tile_max ? sc[i] : tile_max;
    const float new_max = std::max(s.max[r], tile_max);
    for (int64_t i = 0; i < n; ++i) sc[i] = exp_nonpositive(sc[i] - new_max);
    float tile_sum = 0.f;  // a separate loop, so that the exp loop vectorizes
    for (int64_t i = 0; i < n; ++i) tile_sum += sc[i];
    s.alpha[r] = std::exp(s.max[r] - new_max);  // 0 on the first tile
    s.sum[r] = s.sum[r] * s.alpha[r] + tile_sum;
    s.max[r] = new_max;
  }
}

// One query head at a time, so that its accumulator stays in registers.
template <typename scalar_t, int64_t NV>
void accumulate_values(const Args<scalar_t>& a, const Pass& p, const scalar_t* const* slots,
                       int64_t n, int64_t nv, Scratch& s) {
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t v_offset = (a.kv_heads + p.h0 + r / a.group) * nv * kLanes;
    fvec acc[NV > 0 ? NV : kMaxVecs];
    for (int64_t c = 0; c < nv; ++c) acc[c] = s.acc[r * nv + c] * s.alpha[r];
    for (int64_t i = 0; i < n; ++i) {
      const float prob = s.scores[r * kTile + i];
      for (int64_t c = 0; c < nv; ++c) acc[c] += prob * load(slots[i] + v_offset + c * kLanes);
    }
    for (int64_t c = 0; c < nv; ++c) s.acc[r * nv + c] = acc[c];
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

// NV = head_dim / 16 fixed at compile time (registers, full unrolling), or 0: from the args.
template <typename scalar_t, int64_t NV>
void attend(const Args<scalar_t>& a, const Pass& p, Scratch& s) {
  const int64_t nv = NV > 0 ? NV : a.nv;
  load_queries(a, p, nv, s);
  const int64_t ctx = a.context_lens[p.b];
  const int64_t start = a.window > 0 ? std::max<int64_t>(0, ctx - a.window) : 0;
  const scalar_t* slots[kTile];
  for (int64_t t0 = start; t0 < ctx; t0 += kTile) {
    const int64_t n = std::min(kTile, ctx - t0);
    locate_keys(a, p.b, t0, n, slots);
    score_tile<scalar_t, NV>(a, p, slots, n, nv, s);
    softmax_update(p.rows, n, s);
    accumulate_values<scalar_t, NV>(a, p, slots, n, nv, s);
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
    for (int64_t task = begin; task < end;) {
      const int64_t b = task / a.kv_heads, h0 = task % a.kv_heads;
      const int64_t h1 = std::min({a.kv_heads, h0 + max_heads, end - b * a.kv_heads});
      attend<scalar_t, NV>(a, Pass{b, h0, h1, (h1 - h0) * a.group}, s);
      task += h1 - h0;
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
        functions=["paged_decode_attention"],
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
