// ---- Multi-head latent attention (DeepSeek-V2/V3) of a step of decodes, for decoder.cpp's
// decode_layers: model/mla.py's `mla_forward` on its CPU path (the torch backend's cache of
// latents, (blocks, block_size, rank + rope) per layer), by the same ATen ops on the same
// views in the same order, so the same bits: the queries through q_a_proj / q_a_layernorm /
// q_b_proj (or q_proj), the latent and rope key from kv_a_proj_with_mqa, the rope dims rotated
// as complex pairs in fp32, the new rows written into their slots, then the absorbed decode:
// W_uk folded into the query, scaled_dot_product_attention against the gathered cache rows
// (one shared key/value "head" of the latents), W_uv after. o_proj is the caller's.

namespace {

// A latent-attention layer's tensors in decode_layers' `weights` (from its kMla slot): (w0, w1,
// w2, bias) of q_a_proj (all empty: q_proj straight from the hidden state), q_a_layernorm,
// (w0, w1, w2, bias) of q_b_proj (or q_proj), of kv_a_proj_with_mqa, kv_a_layernorm, then
// kv_b_proj's per-head key rows W_uk (heads, nope, rank) and value rows W_uv (heads, v, rank).
enum MlaSlot : int64_t {
  kQA,
  kQANorm = kQA + 4,
  kQB,
  kKvA = kQB + 4,
  kKvANorm = kKvA + 4,
  kUk,
  kUv,
  kMlaSlots,
};

// What the step's latent-attention layers share: the decodes' slots, their blocks flattened
// (D * max_blocks) and the mask of their keys (D, 1, 1, max_blocks * block_size), True up to
// each context length (the torch backend's `masks_for(None)`).
struct MlaStep {
  torch::Tensor slot_mapping, block_ids, mask;
  double eps, scale;

  MlaStep(const torch::Tensor& slots, const torch::Tensor& block_tables,
          const torch::Tensor& context_lens, int64_t block_size, double eps, double scale)
      : slot_mapping(slots), block_ids(block_tables.flatten()), eps(eps), scale(scale) {
    const auto key_pos = at::arange(block_tables.size(1) * block_size, context_lens.options());
    mask = (key_pos < context_lens.view({-1, 1})).unsqueeze(1).unsqueeze(1);
  }
};

// `_rotate` of model/mla.py: (N, heads, rope) with each head's interleaved pairs times
// `rotary` (N, 1, rope / 2) complex, in fp32, rounded once to t's dtype; a new tensor.
torch::Tensor rotate(const torch::Tensor& t, const std::optional<torch::Tensor>& rotary) {
  if (!rotary) return t.contiguous();
  auto shape = t.sizes().vec();
  shape.back() = -1;
  shape.push_back(2);
  const auto pairs = at::view_as_complex(t.to(torch::kFloat).reshape(shape));
  return at::view_as_real(pairs * *rotary).flatten(-2).to(t.scalar_type());
}

// x (D, hidden) -> (D, heads * v_head_dim), o_proj's input; writes the tokens' latents and
// rotated keys into `cache`. `rotary`: (D, 1, rope / 2, 2) fp32 (view_as_real of the complex
// table rows), none for no rotation.
torch::Tensor mla_attention(const MlaStep& s, const torch::Tensor* w, const torch::Tensor& x,
                            const torch::Tensor& cache, const torch::Tensor* rotary) {
  const int64_t d = x.size(0), nope = w[kUk].size(1), rank = w[kUk].size(2);
  const int64_t cache_dim = cache.size(-1), rope = cache_dim - rank;
  const auto rot = rotary ? std::optional<torch::Tensor>(at::view_as_complex(*rotary))
                          : std::nullopt;
  torch::Tensor q_in = x;
  if (present(w[kQA])) q_in = norm(apply(w + kQA, x), w[kQANorm], s.eps);
  const auto q = apply(w + kQB, q_in).view({d, -1, nope + rope});  // (D, heads, nope + rope)
  const auto q_nope = q.narrow(-1, 0, nope), q_rope = rotate(q.narrow(-1, nope, rope), rot);
  const auto kv_a = apply(w + kKvA, x);  // (D, rank + rope)
  const auto latent = norm(kv_a.narrow(1, 0, rank).contiguous(), w[kKvANorm], s.eps);
  const auto k_rope = rotate(kv_a.unsqueeze(1).narrow(2, rank, rope), rot).select(1, 0);
  const auto fresh = at::cat({latent, k_rope}, -1).to(cache.scalar_type());
  cache.view({-1, cache_dim}).index_copy_(0, s.slot_mapping, fresh);
  const auto ctx = cache.index_select(0, s.block_ids).view({d, -1, cache_dim});  // (D, T, dim)
  // (D, 1, heads, rank + rope): the heads are the query rows of the one key/value "head"
  const auto q_lat = at::einsum("dhn,hnr->dhr", {q_nope, w[kUk].to(q_nope.scalar_type())});
  const auto query = at::cat({q_lat, q_rope}, -1).unsqueeze(1);
  const auto keys = ctx.unsqueeze(1), values = keys.narrow(-1, 0, rank);
  const auto o_lat =
      at::scaled_dot_product_attention(query, keys, values, s.mask, 0.0, false, s.scale);
  const auto out = at::einsum("dhr,hvr->dhv", {o_lat.select(1, 0), w[kUv].to(o_lat.scalar_type())});
  return out.reshape({d, -1});
}

}  // namespace
