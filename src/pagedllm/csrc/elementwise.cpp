#include "vec.h"

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
    ReleaseGil no_gil;
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
    ReleaseGil no_gil;
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
    ReleaseGil no_gil;
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
    ReleaseGil no_gil;
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
// write_kv into an int8 cache (kv_cache_dtype.py): each (token, K/V, head) row of head_dim
// values becomes int8 q = round(x / s), to nearest even, and its fp32 scale
// s = max(max|x| / 127, FLT_MIN) after them: the same bits as layers/attention/kv_quant.py.
bool write_kv_int8(const torch::Tensor& kv, torch::Tensor& kv_cache, const torch::Tensor& slots) {
  const int64_t n = kv.size(0), rows = kv.size(1) * kv.size(2), head_dim = kv.size(3);
  if (kv.stride(3) != 1 || kv.stride(2) != head_dim || kv.stride(1) != kv.size(2) * head_dim ||
      kv_cache.size(4) != head_dim + 4 || kv_cache.stride(1) != rows * (head_dim + 4))
    return false;
  const int64_t num_slots = kv_cache.size(0) * kv_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv: slot ", slot[t], " out of range");
  auto* cache = kv_cache.data_ptr<int8_t>();
  dispatch_float_dtype(kv, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* src = kv.data_ptr<scalar_t>();
    for (int64_t t = 0; t < n; ++t)
      for (int64_t r = 0; r < rows; ++r) {
        const scalar_t* x = src + t * kv.stride(0) + r * head_dim;
        int8_t* out = cache + (slot[t] * rows + r) * (head_dim + 4);
        float top = 0.f;
        for (int64_t i = 0; i < head_dim; ++i) top = std::max(top, std::abs(static_cast<float>(x[i])));
        const float scale = std::max(top / 127.f, std::numeric_limits<float>::min());
        for (int64_t i = 0; i < head_dim; ++i) {
          const float q = std::nearbyint(static_cast<float>(x[i]) / scale);
          out[i] = static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
        }
        std::memcpy(out + head_dim, &scale, sizeof(scale));
      }
  });
  return true;
}

bool write_kv(torch::Tensor kv, torch::Tensor kv_cache, torch::Tensor slot_mapping) {
  if (kv_cache.scalar_type() == torch::kChar && supported(kv) && kv.dim() == 4 &&
      kv_cache.dim() == 5 && kv_cache.device().is_cpu() && kv_cache.is_contiguous() &&
      slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == torch::kInt64 &&
      slot_mapping.dim() == 1 && slot_mapping.size(0) == kv.size(0) &&
      slot_mapping.is_contiguous())
    return write_kv_int8(kv, kv_cache, slot_mapping);
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

// The first index of each row's maximum of x (rows, cols) fp32, contiguous, as torch.argmax
// (a NaN counts as the maximum: the first NaN wins). Two passes over the row, the max, then
// its first position; torch's argmax takes ~3 ns per element here (0.16 ms for one row of a
// 49k vocabulary), this ~0.1. None for what it does not handle.
std::optional<torch::Tensor> argmax_rows(torch::Tensor x) {
  if (!x.device().is_cpu() || x.scalar_type() != torch::kFloat || x.dim() != 2 ||
      !x.is_contiguous() || x.size(1) == 0)
    return std::nullopt;
  const int64_t rows = x.size(0), cols = x.size(1), body = cols / kLanes * kLanes;
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  ReleaseGil no_gil;
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* p = xp + r * cols;
      float m = p[0];
      bool any_nan = false;
      if (body) {
        fvec mv = load(p), nan = fvec{};
        for (int64_t i = 0; i < body; i += kLanes) {
          const fvec v = load(p + i);
          mv = v > mv ? v : mv;
          nan = v != v ? fvec{} + 1.f : nan;
        }
        m = hmax(mv), any_nan = hmax(nan) > 0.f;
      }
      for (int64_t i = body; i < cols; ++i) {
        any_nan = any_nan || p[i] != p[i];
        m = p[i] > m ? p[i] : m;
      }
      int64_t at = 0;
      if (any_nan)
        while (p[at] == p[at]) ++at;
      else
        while (p[at] != m) ++at;
      op[r] = at;
    }
  });
  return out;
}
