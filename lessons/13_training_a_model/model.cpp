// GENERATED from solutions/13_training_a_model/model.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 13, task 1 — rotary position embeddings, and the small language model around them.
#include <torch/nn/functional/activation.h>

#include <cmath>

#include "common/error.h"
#include "common/tensor_checks.h"
#include "training.h"

namespace cp {

torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& positions, double base) {
  check_defined(x, "x", 1);
  check_float_dtype(x, "x");
  const int64_t d = x.size(-1);
  CP_CHECK(d % 2 == 0, "x: the head dim D must be even for rotary embeddings (pairs i, i + D/2), got D = ", d);
  check_defined(positions, "positions", 1);
  CP_CHECK(positions.dim() == 1 && positions.scalar_type() == torch::kLong, "positions: expected int64 [L], got ",
           positions.dtype(), " ", positions.sizes());
  CP_CHECK(x.dim() >= 2 && positions.size(0) == x.size(-2), "positions: one per token of x (x's dim −2 = ",
           x.dim() >= 2 ? x.size(-2) : 0, "), got ", positions.size(0));
  CP_CHECK(base > 1, "base: must be > 1, got ", base);
  // BEGIN YOUR CODE task 1: the rotation
  // TODO(lesson 13, task 1): rotate the pairs (x[..., i], x[..., i + D/2]) by positions · θ_i.
  // README, "Task 1 — `apply_rotary`".
  throw NotImplemented("lesson 13, task 1: apply_rotary");
  // END YOUR CODE
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * weight;
}

namespace {

torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

void check_options(const TinyLMOptions& o) {
  CP_CHECK(o.vocab > 0 && o.embed_dim > 0 && o.layers >= 0 && o.heads_q > 0 && o.heads_kv > 0 && o.mlp_dim > 0,
           "TinyLMOptions: vocab, embed_dim, heads_q, heads_kv and mlp_dim must be positive and layers >= 0; got ",
           o.vocab, ", ", o.embed_dim, ", ", o.heads_q, ", ", o.heads_kv, ", ", o.mlp_dim, ", ", o.layers);
  CP_CHECK(o.embed_dim % o.heads_q == 0, "TinyLMOptions: embed_dim ", o.embed_dim, " is not divisible by heads_q ",
           o.heads_q);
  CP_CHECK((o.embed_dim / o.heads_q) % 2 == 0, "TinyLMOptions: the head dim embed_dim / heads_q = ",
           o.embed_dim / o.heads_q, " must be even (rotary embeddings rotate pairs)");
  CP_CHECK(o.heads_q % o.heads_kv == 0, "TinyLMOptions: heads_q ", o.heads_q, " is not divisible by heads_kv ",
           o.heads_kv);
}

}  // namespace

DecoderBlockImpl::DecoderBlockImpl(Comm& comm, const TinyLMOptions& options) : comm_(&comm), options_(options) {
  const int64_t e = options.embed_dim, d = e / options.heads_q;
  attn_norm = register_module("attn_norm", RMSNorm(e));
  q_proj = register_module("q_proj", linear(e, options.heads_q * d));
  k_proj = register_module("k_proj", linear(e, options.heads_kv * d));
  v_proj = register_module("v_proj", linear(e, options.heads_kv * d));
  o_proj = register_module("o_proj", linear(options.heads_q * d, e));
  mlp_norm = register_module("mlp_norm", RMSNorm(e));
  gate = register_module("gate", linear(e, options.mlp_dim));
  up = register_module("up", linear(e, options.mlp_dim));
  down = register_module("down", linear(options.mlp_dim, e));
}

torch::Tensor DecoderBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& positions) {
  const int64_t b = x.size(0), s = x.size(1), hq = options_.heads_q, d = options_.embed_dim / hq;
  auto heads = [&](const torch::Tensor& t, int64_t h) { return t.view({b, s, h, d}).transpose(1, 2); };
  const torch::Tensor n = attn_norm(x);
  const torch::Tensor q = apply_rotary(heads(q_proj(n), hq), positions, options_.rope_base);
  const torch::Tensor k = apply_rotary(heads(k_proj(n), options_.heads_kv), positions, options_.rope_base);
  const torch::Tensor o = context_parallel_attention(*comm_, q, k, heads(v_proj(n), options_.heads_kv),
                                                     options_.strategy);  // [B, Hq, S/N, D]
  const torch::Tensor h = x + o_proj(o.transpose(1, 2).reshape({b, s, hq * d}));
  const torch::Tensor m = mlp_norm(h);
  return h + down(torch::silu(gate(m)) * up(m));
}

TinyLMImpl::TinyLMImpl(Comm& comm, const TinyLMOptions& options) : options_(options) {
  check_options(options);
  embed = register_module("embed", torch::nn::Embedding(options.vocab, options.embed_dim));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < options.layers; ++i) blocks->push_back(DecoderBlock(comm, options));
  norm = register_module("norm", RMSNorm(options.embed_dim));
  lm_head = register_module("lm_head", linear(options.embed_dim, options.vocab));
  // Weights from the seed alone, with a generator of our own: every rank (thread or process)
  // starts from the same model without a broadcast, and LibTorch's global generator, which
  // threads share, is never touched. Matrices ~ N(0, 1/fan_in) (embeddings N(0, 1)); norms 1.
  torch::NoGradGuard no_grad;
  torch::Generator gen = at::detail::createCPUGenerator(options.seed);
  for (torch::Tensor& p : parameters()) {
    if (p.dim() == 1) continue;
    const bool embedding = p.is_same(embed->weight);
    p.copy_(torch::randn(p.sizes(), gen) / (embedding ? 1.0 : std::sqrt(static_cast<double>(p.size(1)))));
  }
}

torch::Tensor TinyLMImpl::forward(const torch::Tensor& tokens, const torch::Tensor& positions) {
  check_defined(tokens, "tokens", 2);
  CP_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong, "tokens: expected int64 [B, S/N], got ",
           tokens.dtype(), " ", tokens.sizes());
  CP_CHECK(tokens.numel() == 0 || (tokens.min().item<int64_t>() >= 0 && tokens.max().item<int64_t>() < options_.vocab),
           "tokens: ids must lie in 0 … vocab − 1 = ", options_.vocab - 1);
  torch::Tensor x = embed(tokens);
  for (const auto& block : *blocks) x = block->as<DecoderBlockImpl>()->forward(x, positions);
  return lm_head(norm(x));
}

}  // namespace cp
