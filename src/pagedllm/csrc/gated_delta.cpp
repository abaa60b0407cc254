#include "vec.h"

// ---- Gated-DeltaNet's decode step (layers/gated_delta.py `_recurrent_step`): one token per
// request, each continuing (or, `has_initial_state` 0, starting from zeros in) its slot of the
// fp32 state pool (slots, Hv, Dk, Dv). Per (request, value head h), with key head h / group:
//
//   q, k l2-normalized (rsqrt(sum x^2 + 1e-6)), q scaled by Dk^-0.5, a = exp(g);
//   S = a S;  d = beta (v - k^T S);  S += k d^T;  o = q^T S
//
// in one pass over S: each column of S is independent, so S is walked in blocks of columns
// (64 with AVX-512: a (Dk, 64) fp32 block is 32 KB at Dk 128, held in L1 between its two
// sweeps): the first sweep takes k^T S and q^T S of the block in registers, then d and the
// output o = a q^T S + (q . k) d, the second writes a S + k d^T. Tasks are the (request, value
// head) pairs, shared out to the threads by parallel_chunks (vec.h); each prepares its q, k
// (shared by the `group` value heads of a key head: a few hundred flops, redone per task).
// fp32 state and math; activations fp32, bf16 or fp16, the output rounded once to their dtype.

namespace {

constexpr int64_t kGdnMaxKeyDim = 1024;

// Sizes and pointers of one call; strides in elements.
struct GdnDecode {
  int64_t value_heads, group, dk, dv;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head, g_row, beta_row;
  const float* g;
  const float* beta;
  float* state;
  const int32_t* slots;
  const int32_t* init;  // nullable: every request continues its slot
};

// One block of NV * kLanes columns of S (row stride dv): the update and the block's outputs.
template <int NV, typename scalar_t>
inline void delta_block(float* s, int64_t dk, int64_t dv, const float* q, const float* k,
                        float qk, float a, float beta, const scalar_t* v, scalar_t* out) {
  fvec ks[NV], qs[NV], d[NV];
  for (int n = 0; n < NV; ++n) ks[n] = qs[n] = fvec{};
  for (int64_t i = 0; i < dk; ++i) {
    const float* row = s + i * dv;
    for (int n = 0; n < NV; ++n) {
      const fvec x = load(row + n * kLanes);
      ks[n] += k[i] * x;
      qs[n] += q[i] * x;
    }
  }
  for (int n = 0; n < NV; ++n) {
    d[n] = (load(v + n * kLanes) - a * ks[n]) * beta;
    store(out + n * kLanes, a * qs[n] + qk * d[n]);
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv;
    for (int n = 0; n < NV; ++n) store(row + n * kLanes, a * load(row + n * kLanes) + k[i] * d[n]);
  }
}

// The same for one column (the tail of a Dv that is not a multiple of kLanes).
template <typename scalar_t>
inline void delta_column(float* s, int64_t dk, int64_t dv, const float* q, const float* k,
                         float qk, float a, float beta, const scalar_t* v, scalar_t* out) {
  float ks = 0.f, qs = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    ks += k[i] * s[i * dv];
    qs += q[i] * s[i * dv];
  }
  const float d = (static_cast<float>(*v) - a * ks) * beta;
  *out = static_cast<scalar_t>(a * qs + qk * d);
  for (int64_t i = 0; i < dk; ++i) s[i * dv] = a * s[i * dv] + k[i] * d;
}

// x (Dk) in fp32, times rsqrt(sum x^2 + 1e-6) if l2norm, times `scale`.
template <typename scalar_t>
void prepare_vector(const scalar_t* x, int64_t n, bool l2norm, float scale, float* out) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<float>(x[i]);
    sum += out[i] * out[i];
  }
  const float norm = l2norm ? 1.f / std::sqrt(sum + 1e-6f) : 1.f;
  for (int64_t i = 0; i < n; ++i) out[i] = out[i] * norm * scale;
}

template <typename scalar_t>
void gdn_decode_task(const GdnDecode& p, int64_t r, int64_t h, const scalar_t* q,
                     const scalar_t* k, const scalar_t* v, scalar_t* out, bool l2norm) {
  const int64_t dk = p.dk, dv = p.dv, kh = h / p.group;
  float qf[kGdnMaxKeyDim], kf[kGdnMaxKeyDim];
  prepare_vector(q + r * p.q_row + kh * p.q_head, dk, l2norm,
                 1.f / std::sqrt(static_cast<float>(dk)), qf);
  prepare_vector(k + r * p.k_row + kh * p.k_head, dk, l2norm, 1.f, kf);
  float qk = 0.f;
  for (int64_t i = 0; i < dk; ++i) qk += qf[i] * kf[i];
  float* s = p.state + (static_cast<int64_t>(p.slots[r]) * p.value_heads + h) * dk * dv;
  if (p.init && !p.init[r]) std::fill(s, s + dk * dv, 0.f);  // a new request: zeros
  const float a = std::exp(p.g[r * p.g_row + h]), beta = p.beta[r * p.beta_row + h];
  const scalar_t* vh = v + r * p.v_row + h * p.v_head;
  scalar_t* oh = out + (r * p.value_heads + h) * dv;
  int64_t c = 0;
  for (; c + 4 * kLanes <= dv; c += 4 * kLanes)
    delta_block<4>(s + c, dk, dv, qf, kf, qk, a, beta, vh + c, oh + c);
  for (; c + kLanes <= dv; c += kLanes)
    delta_block<1>(s + c, dk, dv, qf, kf, qk, a, beta, vh + c, oh + c);
  for (; c < dv; ++c) delta_column(s + c, dk, dv, qf, kf, qk, a, beta, vh + c, oh + c);
}

bool unit_last(const torch::Tensor& t, int64_t dim) {
  return t.device().is_cpu() && t.dim() == dim && t.stride(-1) == 1;
}

}  // namespace

// The decode step of R requests, in place on `state`; writes `out`. out: contiguous (R, Hv,
// Dv), v's dtype; q, k (R, Hk, Dk), v (R, Hv, Dv): one dtype (fp32 / bf16 / fp16), any row
// and head strides with a unit last one (views of the conv output); g, beta: fp32 (R, Hv),
// unit last stride; state: contiguous fp32 (slots, Hv, Dk, Dv); state_indices: contiguous
// int32 (R,); has_initial_state: contiguous int32 (R,) or None (all continue). False
// (nothing written) for what it does not handle.
bool gated_delta_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                        torch::Tensor g, torch::Tensor beta, torch::Tensor state,
                        torch::Tensor state_indices, std::optional<torch::Tensor> has_initial_state,
                        bool l2norm) {
  if (!supported(v) || q.scalar_type() != v.scalar_type() || k.scalar_type() != v.scalar_type() ||
      out.scalar_type() != v.scalar_type())
    return false;
  if (!unit_last(q, 3) || !unit_last(k, 3) || !unit_last(v, 3) || !unit_last(g, 2) ||
      !unit_last(beta, 2) || !out.device().is_cpu() || !out.is_contiguous())
    return false;
  const int64_t r = v.size(0), hv = v.size(1), dv = v.size(2), hk = q.size(1), dk = q.size(2);
  if (g.scalar_type() != torch::kFloat || beta.scalar_type() != torch::kFloat) return false;
  if (!state.device().is_cpu() || state.scalar_type() != torch::kFloat || state.dim() != 4 ||
      !state.is_contiguous() || state.size(1) != hv || state.size(2) != dk || state.size(3) != dv)
    return false;
  if (!state_indices.device().is_cpu() || state_indices.scalar_type() != torch::kInt ||
      !state_indices.is_contiguous() || state_indices.numel() != r)
    return false;
  if (has_initial_state &&
      (!has_initial_state->device().is_cpu() || has_initial_state->scalar_type() != torch::kInt ||
       !has_initial_state->is_contiguous() || has_initial_state->numel() != r))
    return false;
  if (q.sizes() != k.sizes() || q.size(0) != r || hk == 0 || hv % hk != 0 || dk > kGdnMaxKeyDim ||
      g.size(0) != r || g.size(1) != hv || beta.sizes() != g.sizes() || out.sizes() != v.sizes())
    return false;
  const int32_t* slots = state_indices.data_ptr<int32_t>();
  for (int64_t i = 0; i < r; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < state.size(0), "gated_delta_decode: slot ",
                slots[i], " outside the pool of ", state.size(0));
  const GdnDecode p{hv, hv / hk, dk, dv, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                    v.stride(0), v.stride(1), g.stride(0), beta.stride(0), g.data_ptr<float>(),
                    beta.data_ptr<float>(), state.data_ptr<float>(), slots,
                    has_initial_state ? has_initial_state->data_ptr<int32_t>() : nullptr};
  dispatch_float_dtype(v, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    ReleaseGil no_gil;
    parallel_chunks(0, r * hv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        gdn_decode_task(p, t / hv, t % hv, qp, kp, vp, op, l2norm);
    });
  });
  return true;
}

// ---- The causal conv1d's decode update (layers/gated_delta.py `_conv_update`): per request
// and channel, the window (the slot's K-1 previous inputs, oldest first, zeros for a new
// request; then x) dotted with the channel's K taps in fp32, + bias, SiLU, rounded once to x's
// dtype; the slot keeps the window's last K-1. Tasks of (request, block of channels). Separate
// from the rule's pass: the q / k channels of a key head serve `group` value heads, and each
// slot's inputs must shift once.

namespace {

constexpr int64_t kConvBlock = 512;  // channels per task

// kLanes channels of a width-4 conv, their 3 inputs (s) and 4 taps (w) contiguous: all loaded
// and stored as vectors (converted once), the per-channel sums over fp32 copies; y: the sums.
template <typename scalar_t>
inline void conv4_lanes(const scalar_t* x, const scalar_t* w, scalar_t* s, bool init, float* y) {
  float win[3 * kLanes], taps[4 * kLanes], xs[kLanes], next[3 * kLanes];
  for (int j = 0; j < 3; ++j) store(win + j * kLanes, init ? load(s + j * kLanes) : fvec{});
  for (int j = 0; j < 4; ++j) store(taps + j * kLanes, load(w + j * kLanes));
  store(xs, load(x));
  for (int l = 0; l < kLanes; ++l) {
    const float* p = win + 3 * l;
    const float* t = taps + 4 * l;
    y[l] = ((p[0] * t[0] + p[1] * t[1]) + p[2] * t[2]) + xs[l] * t[3];
    next[3 * l] = p[1];
    next[3 * l + 1] = p[2];
    next[3 * l + 2] = xs[l];
  }
  for (int j = 0; j < 3; ++j) store(s + j * kLanes, load(next + j * kLanes));
}

// TAPS: the kernel width as a constant (Qwen3.5's 4: the channel loops unrolled), or 0 to
// read it from `taps`.
template <int TAPS, typename scalar_t>
void conv_update_block(const scalar_t* x, const scalar_t* w, const scalar_t* bias,
                       scalar_t* state, bool init, bool silu, int64_t c0, int64_t c1,
                       int64_t taps, scalar_t* out) {
  if (TAPS) taps = TAPS;
  const int64_t kept = taps - 1;
  float y[kLanes];
  for (int64_t c = c0; c < c1; c += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, c1 - c);
    if (TAPS == 4 && n == kLanes) conv4_lanes(x + c, w + c * 4, state + c * 3, init, y);
    for (int64_t l = TAPS == 4 && n == kLanes ? n : 0; l < n; ++l) {
      scalar_t* s = state + (c + l) * kept;
      const scalar_t* wc = w + (c + l) * taps;
      if (!init) std::fill(s, s + kept, static_cast<scalar_t>(0.f));
      float acc = 0.f;
      for (int64_t j = 0; j < kept; ++j)
        acc += static_cast<float>(s[j]) * static_cast<float>(wc[j]);
      acc += static_cast<float>(x[c + l]) * static_cast<float>(wc[kept]);
      y[l] = acc;
      for (int64_t j = 0; j + 1 < kept; ++j) s[j] = s[j + 1];
      s[kept - 1] = x[c + l];
    }
    if (bias)
      for (int64_t l = 0; l < n; ++l) y[l] += static_cast<float>(bias[c + l]);
    if (n == kLanes) {
      fvec v = load(y);
      store(out + c, silu ? v / (1.f + exp_vec(-v)) : v);
    } else {
      for (int64_t l = 0; l < n; ++l)
        out[c + l] = static_cast<scalar_t>(silu ? y[l] / (1.f + std::exp(-y[l])) : y[l]);
    }
  }
}

}  // namespace

// The conv update of R decode tokens: x (R, C) with a unit last stride; weight contiguous
// (C, K), bias contiguous (C,) or None, conv_state contiguous (slots, C, K-1), all x's dtype;
// state_indices / has_initial_state as gated_delta_decode's; out contiguous (R, C). False
// (nothing written) for what it does not handle.
bool gdn_conv_update(torch::Tensor out, torch::Tensor x, torch::Tensor weight,
                     std::optional<torch::Tensor> bias, torch::Tensor conv_state,
                     torch::Tensor state_indices, std::optional<torch::Tensor> has_initial_state,
                     bool silu) {
  if (!supported(x) || !unit_last(x, 2)) return false;
  const int64_t r = x.size(0), c = x.size(1), taps = weight.dim() == 2 ? weight.size(1) : 0;
  const auto same = [&](const torch::Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == x.scalar_type() && t.is_contiguous();
  };
  if (!same(out) || out.sizes() != x.sizes() || !same(weight) || weight.size(0) != c || taps < 2)
    return false;
  if (bias && (!same(*bias) || bias->numel() != c)) return false;
  if (!same(conv_state) || conv_state.dim() != 3 || conv_state.size(1) != c ||
      conv_state.size(2) != taps - 1)
    return false;
  for (const auto* t : {&state_indices, has_initial_state ? &*has_initial_state : nullptr})
    if (t && (!t->device().is_cpu() || t->scalar_type() != torch::kInt || !t->is_contiguous() ||
              t->numel() != r))
      return false;
  const int32_t* slots = state_indices.data_ptr<int32_t>();
  const int32_t* init = has_initial_state ? has_initial_state->data_ptr<int32_t>() : nullptr;
  for (int64_t i = 0; i < r; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < conv_state.size(0), "gdn_conv_update: slot ",
                slots[i], " outside the pool of ", conv_state.size(0));
  dispatch_float_dtype(x, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const scalar_t* bp = bias ? bias->data_ptr<scalar_t>() : nullptr;
    scalar_t* sp = conv_state.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t blocks = (c + kConvBlock - 1) / kConvBlock, row = x.stride(0);
    ReleaseGil no_gil;
    parallel_chunks(0, r * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t i = t / blocks, c0 = (t % blocks) * kConvBlock;
        const auto block = taps == 4 ? conv_update_block<4, scalar_t>
                                     : conv_update_block<0, scalar_t>;
        block(xp + i * row, wp, bp, sp + slots[i] * c * (taps - 1), !init || init[i], silu, c0,
              std::min(c, c0 + kConvBlock), taps, op + i * c);
      }
    });
  });
  return true;
}
