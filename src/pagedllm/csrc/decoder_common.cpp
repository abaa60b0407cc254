// ---- What the one-call decode step (decoder.cpp, mla_decode.cpp) shares: a decoder's linears
// in every weight format, its RMSNorm, optional weights; each refuses loudly (flatten in
// model/decoder_kernel.py keeps out what a kernel would refuse).

namespace {

// An optional weight of `weights`: given (a defined, non-empty tensor).
bool present(const torch::Tensor& t) { return t.defined() && t.numel() > 0; }

[[noreturn]] void refused(const char* op) {
  TORCH_CHECK(false, "decode_layers: ", op, " refused");
  __builtin_unreachable();
}

torch::Tensor apply(const torch::Tensor* w, const torch::Tensor& x) {
  const auto bias = present(w[3]) ? std::optional<torch::Tensor>(w[3]) : std::nullopt;
  std::optional<torch::Tensor> out;
  switch (w[0].scalar_type()) {
    case torch::kChar: out = linear_int8(x, w[0], w[1], bias); break;
    case torch::kByte: out = linear_int4(x, w[0], w[1], w[2], bias); break;
    default: out = linear_dense(x, w[0], bias);
  }
  if (!out) refused("a linear layer");
  return *out;
}

torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  auto out = rms_norm(x, weight, eps);
  if (!out) refused("rms_norm");
  return *out;
}

std::optional<torch::Tensor> given(const torch::Tensor& t) {
  return present(t) ? std::optional<torch::Tensor>(t) : std::nullopt;
}

}  // namespace
