// ---- The decoder layers of a decode step in one call: for D tokens, each the next token of its
// request, every layer's norm, q/k/v, rotary, KV write, paged attention, o, norm, gate/up,
// SiLU-and-mul and down, and the final norm, without going back to Python between ops (at
// batch 1 the ~10 ops of 30 layers cost as much in Python as the attention itself). The same
// kernels as the op-by-op path, in the same order: the results are the same bits.

namespace {

// Tensors per layer in `weights`: the two norms, then (w0, w1, w2, bias) for each of q/k/v,
// o, gate/up and down: (w, -, -) dense, (q, scales, -) int8, (q, scales, mins) int4; an empty
// tensor stands for what is absent.
constexpr int64_t kPerLayer = 2 + 4 * 4;

struct Linear {
  const torch::Tensor* t;  // its 4 tensors
  std::optional<torch::Tensor> bias() const {
    return t[3].numel() ? std::optional<torch::Tensor>(t[3]) : std::nullopt;
  }
};

torch::Tensor apply(Linear w, const torch::Tensor& x) {
  std::optional<torch::Tensor> out;
  switch (w.t[0].scalar_type()) {
    case torch::kChar: out = linear_int8(x, w.t[0], w.t[1], w.bias()); break;
    case torch::kByte: out = linear_int4(x, w.t[0], w.t[1], w.t[2], w.bias()); break;
    default: out = linear_dense(x, w.t[0], w.bias());
  }
  TORCH_CHECK(out.has_value(), "decode_layers: a linear layer the kernels do not take");
  return *out;
}

}  // namespace

// x: (D, hidden) the tokens' embeddings (consumed); cos_sin: (D, head_dim / 2, 2) fp32;
// slot_mapping (D,), block_tables (>= D, max_blocks), context_lens (D,): int64, as for
// write_kv and paged_decode_attention. Returns the last layer's output after the final norm.
torch::Tensor decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights,
                            std::vector<torch::Tensor> kv_caches, torch::Tensor cos_sin,
                            torch::Tensor slot_mapping, torch::Tensor block_tables,
                            torch::Tensor context_lens, torch::Tensor final_norm, double eps,
                            double scale, int64_t heads, int64_t kv_heads,
                            int64_t sliding_window) {
  ReleaseGil no_gil;  // the whole step: other Python threads run meanwhile
  const int64_t layers = static_cast<int64_t>(kv_caches.size()), d = x.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer,
              "decode_layers: ", kPerLayer, " weight tensors per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layers: x (D, hidden), contiguous");
  const auto fail = [](const char* op) { TORCH_CHECK(false, "decode_layers: ", op, " refused"); };
  torch::Tensor residual;
  for (int64_t i = 0; i < layers; ++i) {
    const torch::Tensor* w = weights.data() + i * kPerLayer;
    const torch::Tensor& cache = kv_caches[i];
    torch::Tensor h;
    if (i == 0) {
      auto normed = rms_norm(x, w[0], eps);
      if (!normed) fail("rms_norm");
      h = *normed, residual = x;
    } else {
      if (!fused_add_rms_norm(x, residual, w[0], eps)) fail("fused_add_rms_norm");
      h = x;
    }
    // (D, heads + 2 * kv_heads, head_dim): q heads, then k heads, then v heads
    const torch::Tensor qkv = apply(Linear{w + 2}, h).view({d, heads + 2 * kv_heads, -1});
    const int64_t head_dim = qkv.size(2);
    if (!rotary_embedding(qkv, cos_sin, heads + kv_heads)) fail("rotary_embedding");
    const torch::Tensor kv = qkv.narrow(1, heads, 2 * kv_heads).view({d, 2, kv_heads, head_dim});
    if (!write_kv(kv, cache, slot_mapping)) fail("write_kv");
    torch::Tensor attn = torch::empty({d, heads, head_dim}, qkv.options());
    paged_decode_attention(attn, qkv.narrow(1, 0, heads), cache, block_tables, context_lens,
                           scale, sliding_window);
    x = apply(Linear{w + 6}, attn.view({d, heads * head_dim}));
    if (!fused_add_rms_norm(x, residual, w[1], eps)) fail("fused_add_rms_norm");
    auto act = silu_and_mul(apply(Linear{w + 10}, x));
    if (!act) fail("silu_and_mul");
    x = apply(Linear{w + 14}, *act);
  }
  if (!fused_add_rms_norm(x, residual, final_norm, eps)) fail("fused_add_rms_norm");
  return x;
}
