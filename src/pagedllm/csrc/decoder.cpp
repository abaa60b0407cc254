// ---- The decoder layers of a decode step in one call: for D tokens, each the next token of its
// request, every layer's norms, q/k/v, q/k norms, rotary, KV write, paged attention, o,
// gate/up, activation-and-mul and down (or the mixture of experts: router, routing, the
// experts in moe.cpp's fused_moe, the shared expert), and the final norm, without going back
// to Python between ops (at batch 1 the ~10 ops of 30 layers cost as much in Python as the
// attention itself). Every family (model/decoder.py, model/moe_block.py; DeepSeek's latent
// attention in mla_decode.cpp, its grouped sigmoid router here): the same kernels (or ATen
// ops) as its op-by-op path, in the same order, so the results are the same bits (torch.topk's
// own tie order included). A step's LoRA adapters too: after each adapted linear, its tokens'
// deltas by lora.cpp's lora_bgmv, as lora/ops.py's LoraStep adds them op by op.

namespace {

// Tensors per layer in `weights`: the norms before attention, after it, before the MLP, after
// it, the q and k norms (an empty tensor where the family has none), then (w0, w1, w2, bias)
// for each of q/k/v, o, gate/up and down: (w, -, -) dense, (q, scales, -) int8,
// (q, scales, mins) int4, an empty tensor for what is absent; then the attention sinks (fp32,
// one logit per query head; empty: none); last, for a mixture of experts in place of the MLP
// (all empty for a dense MLP), (w0, w1, w2, bias) of the router, the experts' stacked gate/up
// (E, 2I, H) and down (E, H, I) (moe.cpp's formats), the shared expert's gate/up and down, its
// gate (1, H) (empty: no shared expert, no gate) and the grouped router's score correction
// bias (E,) fp32 (empty: none); then a latent-attention layer's MlaSlots in place of q/k/v
// (all empty for the others: mla_decode.cpp).
enum Slot : int64_t {
  kLn1,
  kPost1,
  kLn2,
  kPost2,
  kQNorm,
  kKNorm,
  kQkv,
  kO = kQkv + 4,
  kGateUp = kO + 4,
  kDown = kGateUp + 4,
  kSinks = kDown + 4,
  kRouter,
  kExperts13 = kRouter + 4,
  kExperts2 = kExperts13 + 4,
  kSharedGateUp = kExperts2 + 4,
  kSharedDown = kSharedGateUp + 4,
  kSharedGate = kSharedDown + 4,
  kScoreBias = kSharedGate + 4,
  kMla,
  kPerLayer = kMla + kMlaSlots,
};

// The LoRA modules of a layer in the step's `lora` (lora/ops.py's MODULES): (A, B) each.
enum LoraModule : int64_t { kLoraQkv, kLoraO, kLoraGateUp, kLoraDown, kLoraPerLayer };

// A step's LoRA (lora/ops.py's LoraStep): per layer, (A, B) of each LoraModule (A (slots, R, in),
// B (slots, out, R); empty where no adapter of the step adapts the module), and each token's
// slot (-1: the base model); `ab` null: no adapter in the step; per LoraModule, the first row of
// each projection fused in it (lora_bgmv's parts).
struct Lora {
  const torch::Tensor* ab;
  const torch::Tensor& slots;
  const std::vector<std::vector<int64_t>>& parts;
};

// out (D, out) += the deltas of `module` of layer `layer` for x (D, in), in place: lora.cpp's
// grouped kernel over every token, as LoraStep.add runs it op by op after the same linear.
void add_lora(const Lora& lora, int64_t layer, LoraModule module, torch::Tensor& out,
              const torch::Tensor& x) {
  if (lora.ab == nullptr) return;
  const torch::Tensor* ab = lora.ab + (layer * kLoraPerLayer + module) * 2;
  if (!present(ab[0])) return;
  if (!lora_bgmv(out, x, ab[0], ab[1], lora.slots, lora.parts.at(module))) refused("lora_bgmv");
}

// `_join` of model/decoder.py: the pending block output x (normed by `post` where the family
// norms after a block) joins the stream `residual` (undefined before the first block: x
// starts it); returns the next block's input, the stream normed by `pre` (the stream itself
// where `pre` is empty). May overwrite x and residual in place, as the op-by-op path does.
torch::Tensor join(torch::Tensor x, torch::Tensor& residual, const torch::Tensor& post,
                   const torch::Tensor& pre, double eps) {
  if (present(post)) x = norm(x, post, eps);
  if (!present(pre)) {
    residual = residual.defined() ? residual + x : x;  // at::add, as Python's `+`
    return residual;
  }
  if (!residual.defined()) {
    residual = x;
    return norm(x, pre, eps);
  }
  if (!fused_add_rms_norm(x, residual, pre, eps)) refused("fused_add_rms_norm");
  return x;
}

// RMSNorm in place of `heads` heads of qkv (D, >= first + heads, head_dim), from head `first`,
// with rows contiguous: over each head (weight of head_dim) or over all of them (weight of
// heads * head_dim), `_qk_norm` of model/decoder.py. normalize_row, as rms_norm runs it, on
// the same values: the same bits without its copies.
void norm_heads(torch::Tensor& qkv, int64_t first, int64_t heads, const torch::Tensor& weight,
                double eps) {
  const int64_t d = qkv.size(0), head_dim = qkv.size(2), cols = weight.numel();
  TORCH_CHECK(cols == head_dim || cols == heads * head_dim,
              "decode_layers: a q/k norm weight of head_dim or heads * head_dim");
  TORCH_CHECK(weight.scalar_type() == qkv.scalar_type() && weight.is_contiguous(),
              "decode_layers: a q/k norm weight contiguous, of the model's dtype");
  const int64_t per_token = heads * head_dim / cols, stride = qkv.stride(0);
  const auto feps = static_cast<float>(eps);
  dispatch_float_dtype(qkv, [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* base = qkv.data_ptr<scalar_t>() + first * head_dim;
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, d, row_grain(heads * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t j = 0; j < per_token; ++j) {
          scalar_t* row = base + t * stride + j * cols;
          normalize_row(row, w, row, cols, feps);
        }
    });
  });
}

enum class Activation { kSilu, kGeluTanh, kGelu };

Activation parse_activation(const std::string& name) {
  if (name == "silu") return Activation::kSilu;
  if (name == "gelu_tanh") return Activation::kGeluTanh;
  TORCH_CHECK(name == "gelu", "decode_layers: activation silu, gelu_tanh or gelu, not ", name);
  return Activation::kGelu;
}

// `_act_and_mul` of model/decoder.py: act(gate) * up, gate and up the halves of gate_up;
// `kernel` false: ATen's silu, as layers/moe.py's gated_act (a shared expert's) computes it.
torch::Tensor act_and_mul(const torch::Tensor& gate_up, Activation act, bool kernel = true) {
  if (act == Activation::kSilu && kernel) {
    auto out = silu_and_mul(gate_up);
    if (!out) refused("silu_and_mul");
    return *out;
  }
  const int64_t half = gate_up.size(-1) / 2;
  const auto gate = gate_up.narrow(-1, 0, half), up = gate_up.narrow(-1, half, half);
  if (act == Activation::kSilu) return at::silu(gate) * up;
  return at::gelu(gate, act == Activation::kGeluTanh ? "tanh" : "none") * up;
}

// The mixture-of-experts settings of the model (moe_config.MoeConfig), shared by its layers.
struct MoeStep {
  // "softmax", "topk_softmax" or "sigmoid_grouped" (empty: the model has no experts)
  std::string router;
  int64_t top_k;
  bool norm_topk_prob, weights_in_model_dtype;
  std::string activation;  // the experts' (moe.cpp's names)
  double limit;
  int64_t n_group, topk_group;  // sigmoid_grouped's
  double routed_scaling;
};

// `_grouped` of model/moe_block.py (DeepSeek-V3): sigmoid scores; the experts chosen by score
// + `bias` among the best `topk_group` groups (ranked by the sum of their two best); weights
// the chosen unbiased scores, renormalised, times routed_scaling.
std::tuple<torch::Tensor, torch::Tensor> route_grouped(const torch::Tensor& logits,
                                                       const MoeStep& m,
                                                       const torch::Tensor& bias) {
  const int64_t n = logits.size(0), per_group = logits.size(1) / m.n_group;
  const auto scores = logits.to(torch::kFloat).sigmoid();
  auto choice = present(bias) ? scores + bias : scores;
  const auto group_scores =
      std::get<0>(choice.view({n, m.n_group, per_group}).topk(2, -1)).sum(-1);
  const auto groups = std::get<1>(at::topk(group_scores, m.topk_group, -1, true, false));
  const auto keep = at::zeros_like(group_scores).scatter_(1, groups, 1).to(torch::kBool);
  choice = choice.masked_fill(keep.bitwise_not().repeat_interleave(per_group, 1),
                              -std::numeric_limits<double>::infinity());
  const auto ids = std::get<1>(at::topk(choice, m.top_k, -1, true, false));
  auto weights = scores.gather(1, ids);
  if (m.norm_topk_prob) weights = weights / (weights.sum(-1, true) + 1e-20);
  return {weights * m.routed_scaling, ids};
}

// `route` of model/moe_block.py: router logits (D, E) -> the top-k experts' weights (fp32) and
// ids, by the same ATen ops (torch.topk's ties).
std::tuple<torch::Tensor, torch::Tensor> route_tokens(const torch::Tensor& logits,
                                                      const MoeStep& m, const torch::Tensor& bias) {
  if (m.router == "sigmoid_grouped") return route_grouped(logits, m, bias);
  if (m.router == "topk_softmax") {
    auto [values, ids] = at::topk(logits, m.top_k, -1);
    return {at::softmax(values, -1).to(torch::kFloat), ids};
  }
  TORCH_CHECK(m.router == "softmax",
              "decode_layers: router softmax, topk_softmax or sigmoid_grouped");
  auto [weights, ids] = at::topk(at::softmax(logits.to(torch::kFloat), -1), m.top_k, -1);
  if (m.norm_topk_prob) weights.div_(weights.sum(-1, true));
  if (m.weights_in_model_dtype) weights = weights.to(logits.scalar_type()).to(torch::kFloat);
  return {weights, ids};
}

// `moe_forward` of model/moe_block.py (no tensor parallelism) on x (D, hidden): the experts
// (fused_moe, always: the caller keeps D within its row limit), plus the shared expert.
torch::Tensor moe_block(const torch::Tensor* w, const torch::Tensor& x, const MoeStep& m,
                        Activation act) {
  const torch::Tensor router_x = w[kRouter].scalar_type() == torch::kFloat ? x.to(torch::kFloat) : x;
  auto [weights, ids] = route_tokens(apply(w + kRouter, router_x), m, w[kScoreBias]);
  const torch::Tensor *w13 = w + kExperts13, *w2 = w + kExperts2;
  auto out = fused_moe(x, weights.to(torch::kFloat).contiguous(), ids.to(torch::kLong).contiguous(),
                       {w13[0], w13[1], w13[2]}, given(w13[3]), {w2[0], w2[1], w2[2]},
                       given(w2[3]), m.activation, m.limit, -1);
  if (!out) refused("fused_moe");
  if (!present(w[kSharedGateUp])) return *out;
  auto shared = apply(w + kSharedDown, act_and_mul(apply(w + kSharedGateUp, x), act, false));
  if (present(w[kSharedGate])) shared = at::sigmoid(apply(w + kSharedGate, x)) * shared;
  return *out + shared;
}

// What every layer of the step shares.
struct Step {
  const std::vector<torch::Tensor>& rotary;  // (D, head_dim / 2, 2) fp32 per rope
  const torch::Tensor &slot_mapping, &block_tables, &context_lens;
  double eps, scale, softcap;
  int64_t heads, kv_heads;
  Lora lora;
};

// `_attention` of model/decoder.py on x (D, hidden) with the CPU backend's decode: the
// attention output before o (D, heads * head_dim).
torch::Tensor attention(const Step& s, const torch::Tensor* w, const torch::Tensor& x,
                        const torch::Tensor& cache, std::optional<int64_t> rope, int64_t window,
                        int64_t layer) {
  const int64_t d = x.size(0), heads = s.heads, kv_heads = s.kv_heads;
  torch::Tensor qkv = apply(w + kQkv, x);
  add_lora(s.lora, layer, kLoraQkv, qkv, x);
  // (D, heads + 2 * kv_heads, head_dim): q heads, then k heads, then v heads
  qkv = qkv.view({d, heads + 2 * kv_heads, -1});
  const int64_t head_dim = qkv.size(2);
  if (present(w[kQNorm]) && present(w[kKNorm])) {
    norm_heads(qkv, 0, heads, w[kQNorm], s.eps);
    norm_heads(qkv, heads, kv_heads, w[kKNorm], s.eps);
  }
  if (rope && !rotary_embedding(qkv, s.rotary.at(*rope), heads + kv_heads))
    refused("rotary_embedding");
  const torch::Tensor kv = qkv.narrow(1, heads, 2 * kv_heads).view({d, 2, kv_heads, head_dim});
  if (!write_kv(kv, cache, s.slot_mapping)) refused("write_kv");
  torch::Tensor out = torch::empty({d, heads, head_dim}, qkv.options());
  const auto sinks =
      present(w[kSinks]) ? std::optional<torch::Tensor>(w[kSinks]) : std::nullopt;
  paged_decode_attention(out, qkv.narrow(1, 0, heads), cache, s.block_tables, s.context_lens,
                         s.scale, window, s.softcap, sinks);
  return out.view({d, heads * head_dim});
}

}  // namespace

// x: (D, hidden) the tokens' embeddings (consumed); weights: kPerLayer tensors per layer;
// rotary: per rope of the model, (D, head_dim / 2, 2) fp32, each token's rotation; per layer,
// its sliding window (None: global) and the index of its rope in `rotary` (None: NoPE);
// slot_mapping (D,), block_tables (>= D, max_blocks), context_lens (D,): int64, as for write_kv
// and paged_decode_attention (a latent-attention model: block_tables (D, max_blocks) the
// decodes' blocks covering the longest context, MlaStep); softcap 0: none; moe_router ...
// routed_scaling: the mixture of experts' settings (MoeStep; moe_router empty where the model
// has none); lora: a step's LoRA, per layer
// kLoraPerLayer (A, B) pairs (Lora; empty: no adapter in the step), lora_slots (D,) int64 each
// token's slot, lora_parts each LoraModule's parts. Returns the last layer's output after the
// final norm.
torch::Tensor decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights,
                            std::vector<torch::Tensor> kv_caches, std::vector<torch::Tensor> rotary,
                            std::vector<std::optional<int64_t>> windows,
                            std::vector<std::optional<int64_t>> ropes, torch::Tensor slot_mapping,
                            torch::Tensor block_tables, torch::Tensor context_lens,
                            torch::Tensor final_norm, double eps, double scale, double softcap,
                            int64_t heads, int64_t kv_heads, std::string activation,
                            std::string moe_router, int64_t top_k, bool norm_topk_prob,
                            bool weights_in_model_dtype, std::string expert_activation,
                            double limit, int64_t n_group, int64_t topk_group,
                            double routed_scaling, std::vector<torch::Tensor> lora,
                            torch::Tensor lora_slots,
                            std::vector<std::vector<int64_t>> lora_parts) {
  ReleaseGil no_gil;  // the whole step: other Python threads run meanwhile
  const auto layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer,
              "decode_layers: ", static_cast<int64_t>(kPerLayer), " weight tensors per layer");
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == layers &&
                  static_cast<int64_t>(ropes.size()) == layers,
              "decode_layers: a window and a rope per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layers: x (D, hidden), contiguous");
  const Activation act = parse_activation(activation);
  const MoeStep moe{moe_router, top_k,   norm_topk_prob, weights_in_model_dtype, expert_activation,
                    limit,      n_group, topk_group,     routed_scaling};
  TORCH_CHECK(lora.empty() || (static_cast<int64_t>(lora.size()) == layers * kLoraPerLayer * 2 &&
                                static_cast<int64_t>(lora_parts.size()) == kLoraPerLayer),
              "decode_layers: ", static_cast<int64_t>(kLoraPerLayer * 2),
              " LoRA tensors per layer, the parts of each LoRA module");
  const Lora step_lora{lora.empty() ? nullptr : lora.data(), lora_slots, lora_parts};
  const Step step{rotary, slot_mapping, block_tables, context_lens, eps, scale, softcap,
                  heads, kv_heads, step_lora};
  const torch::Tensor none;
  torch::Tensor residual;
  const torch::Tensor* post = &none;  // the norm the pending output takes before it joins
  std::optional<MlaStep> mla;  // made at the first latent-attention layer
  for (int64_t i = 0; i < layers; ++i) {
    const torch::Tensor* w = weights.data() + i * kPerLayer;
    x = join(x, residual, *post, w[kLn1], eps);
    if (present(w[kMla + kKvA])) {  // latent attention: its o takes no adapter (mla_forward)
      if (!mla)
        mla.emplace(slot_mapping, block_tables, context_lens, kv_caches[i].size(1), eps, scale);
      const auto* rot = ropes[i] ? &rotary.at(*ropes[i]) : nullptr;
      x = apply(w + kO, mla_attention(*mla, w + kMla, x, kv_caches[i], rot));
    } else {
      const auto o_in = attention(step, w, x, kv_caches[i], ropes[i], windows[i].value_or(0), i);
      x = apply(w + kO, o_in);
      add_lora(step.lora, i, kLoraO, x, o_in);
    }
    x = join(x, residual, w[kPost1], w[kLn2], eps);
    if (present(w[kRouter])) {
      x = moe_block(w, x, moe, act);  // an MoE layer's MLP takes no adapter
    } else {
      auto gate_up = apply(w + kGateUp, x);
      add_lora(step.lora, i, kLoraGateUp, gate_up, x);
      const auto down_in = act_and_mul(gate_up, act);
      x = apply(w + kDown, down_in);
      add_lora(step.lora, i, kLoraDown, x, down_in);
    }
    post = &w[kPost2];
  }
  return join(x, residual, *post, final_norm, eps);
}
