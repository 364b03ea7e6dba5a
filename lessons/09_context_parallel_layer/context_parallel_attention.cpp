// GENERATED from solutions/09_context_parallel_layer/context_parallel_attention.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 09 — the strategies of the course as one autograd operation, inside an attention layer
// whose weights are replicated and whose sequence is sharded.
#include "context_parallel_attention.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "common/error.h"
#include "common/tensor_checks.h"

namespace cp {

namespace {

// Lesson 08 works on packed documents: a batch of B zig-zag shards [B, H, S/N, D] is B documents
// of S tokens, and rank r's packed rows are exactly its shards, sequence after sequence.
torch::Tensor to_packed(const torch::Tensor& t) {  // [B, H, S/N, D] → [B·S/N, H, D]
  return t.transpose(1, 2).reshape({t.size(0) * t.size(2), t.size(1), t.size(3)});
}
torch::Tensor from_packed(const torch::Tensor& p, int64_t batch, int64_t seq) {  // inverse of to_packed
  return p.view({batch, seq, p.size(1), p.size(2)}).transpose(1, 2).contiguous();
}
torch::Tensor lse_to_packed(const torch::Tensor& lse) {  // [B, H, S/N] → [H, B·S/N]
  return lse.transpose(0, 1).reshape({lse.size(1), lse.size(0) * lse.size(2)});
}
torch::Tensor lse_from_packed(const torch::Tensor& lse, int64_t batch, int64_t seq) {  // inverse of lse_to_packed
  return lse.view({lse.size(0), batch, seq}).transpose(0, 1).contiguous();
}
// B documents of S tokens. No token at all (B = 0 or S = 0) is zero documents, [0]: empty input
// is valid for every strategy, as it is for the ring.
torch::Tensor batch_cu_seqlens(int64_t batch, int64_t seq) {
  if (batch == 0 || seq == 0) return torch::zeros({1}, torch::kLong);
  return torch::arange(batch + 1, torch::kLong) * seq;
}

int64_t ring_pairs(const RingStats& stats, int64_t batch) {
  int64_t pairs = 0;
  for (const StepWork& step : stats.steps) pairs += step.pairs;
  return pairs * batch;  // StepWork counts per batch element
}

/// Llama3Options by name: the default scale, this trace.
Llama3Options llama3_options(Trace* trace) {
  Llama3Options options;
  options.trace = trace;
  return options;
}

}  // namespace

Strategy ring_family_strategy(const std::string& name, TokenLayout layout, RingForward forward, RingBackward backward) {
  return {name, layout,
          [forward](Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, Trace* trace) {
            const RingResult r = forward(comm, q, k, v, ring_options(true, trace));
            return StrategyForward{r.out, r.lse, {ring_pairs(r.stats, q.size(0)), r.stats.bytes_sent},
                                   {q, k, v, r.out, r.lse}};
          },
          [backward, name](Comm& comm, const torch::Tensor& dout, const std::vector<torch::Tensor>& saved,
                           Trace* trace) {
            check_saved(saved, 5, name);
            const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
            check_attention_inputs(q, k, v);
            const RingGrads g = backward(comm, dout, q, k, v, saved[3], saved[4], ring_options(true, trace));
            return StrategyBackward{g.dq, g.dk, g.dv, {ring_pairs(g.stats, q.size(0)), g.stats.bytes_sent}};
          }};
}

Strategy ring_strategy() {
  return ring_family_strategy("ring", TokenLayout::Contiguous, ring_attention_forward, ring_attention_backward);
}

Strategy zigzag_ring_strategy() {
  return ring_family_strategy("zig-zag ring", TokenLayout::ZigZag, zigzag_ring_attention_forward,
                              zigzag_ring_attention_backward);
}

Strategy stripe_ring_strategy() {
  return ring_family_strategy(
      "stripe ring", TokenLayout::Stripe,
      [](Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, RingOptions options) {
        options.schedule = stripe_schedule();
        return ring_attention_forward(comm, q, k, v, options);
      },
      [](Comm& comm, const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
         const torch::Tensor& out, const torch::Tensor& lse, RingOptions options) {
        options.schedule = stripe_schedule();
        return ring_attention_backward(comm, dout, q, k, v, out, lse, options);
      });
}

Strategy llama3_strategy(Llama3Mode mode) {
  auto forward = [mode](Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        Trace* trace) {
    const int64_t batch = q.size(0), seq = q.size(2);
    const torch::Tensor cu = batch_cu_seqlens(batch, seq * comm.size());
    const Llama3Result r = zigzag_llama3_attention_forward(comm, to_packed(q), to_packed(k), to_packed(v), cu, mode,
                                                           llama3_options(trace));
    const torch::Tensor out = from_packed(r.out, batch, seq), lse = lse_from_packed(r.lse, batch, seq);
    return StrategyForward{out, lse, {r.stats.pairs, r.stats.bytes_sent}, {q, k, v, out, lse}};
  };
  const std::string name = mode == Llama3Mode::Fused ? "llama3 fused" : "llama3 two kernels";
  auto backward = [mode, name](Comm& comm, const torch::Tensor& dout, const std::vector<torch::Tensor>& saved,
                               Trace* trace) {
    check_saved(saved, 5, name);
    const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    check_attention_inputs(q, k, v);
    const int64_t batch = q.size(0), seq = q.size(2);
    const torch::Tensor cu = batch_cu_seqlens(batch, seq * comm.size());
    const Llama3Grads g = zigzag_llama3_attention_backward(comm, to_packed(dout), to_packed(q), to_packed(k),
                                                           to_packed(v), to_packed(out), lse_to_packed(lse), cu, mode,
                                                           llama3_options(trace));
    return StrategyBackward{from_packed(g.dq, batch, seq), from_packed(g.dk, batch, seq),
                            from_packed(g.dv, batch, seq), {g.stats.pairs, g.stats.bytes_sent}};
  };
  return {name, TokenLayout::ZigZag, forward, backward};
}

const std::vector<Strategy>& all_strategies() {
  static const std::vector<Strategy> strategies = {ring_strategy(), zigzag_ring_strategy(),
                                                   llama3_strategy(Llama3Mode::TwoKernels),
                                                   llama3_strategy(Llama3Mode::Fused)};
  return strategies;
}

std::string to_string(const Strategy& strategy) { return strategy.name; }

TokenLayout layout_of(const Strategy& strategy) { return strategy.layout; }

StrategyForward strategy_forward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const Strategy& strategy, Trace* trace) {
  check_attention_inputs(q, k, v);
  return strategy.forward(comm, q, k, v, trace);
}

StrategyBackward strategy_backward(Comm& comm, const torch::Tensor& dout, const std::vector<torch::Tensor>& saved,
                                   const Strategy& strategy, Trace* trace) {
  check_defined(dout, "dout", 4);
  return strategy.backward(comm, dout, saved, trace);
}

void check_saved(const std::vector<torch::Tensor>& saved, size_t count, const std::string& strategy) {
  const bool all_defined = std::all_of(saved.begin(), saved.end(), [](const torch::Tensor& t) { return t.defined(); });
  CP_CHECK(saved.size() == count && all_defined, "saved: the backward of '", strategy, "' takes the ", count,
           " tensors its forward returned in StrategyForward::saved; got ", saved.size(),
           all_defined ? "" : ", not all of them defined");
}

namespace {

/// What the backward needs besides tensors; autograd keeps it in the context as a capsule.
struct AttentionSetup : torch::CustomClassHolder {
  AttentionSetup(Comm* comm, Strategy strategy) : comm(comm), strategy(std::move(strategy)) {}
  Comm* comm;
  Strategy strategy;
};

class ContextParallelAttentionFunction : public torch::autograd::Function<ContextParallelAttentionFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, Comm* comm, const Strategy& strategy) {
    // BEGIN YOUR CODE task 1: the autograd function
    // TODO(lesson 09, task 1a): run strategy_forward, save what the backward needs (the strategy's saved
    // tensors and the setup), return out.
    // README, "Task 1 — the autograd function (1a forward, 1b backward)", 1a, and "The capsule".
    (void)ctx, (void)q, (void)k, (void)v, (void)comm, (void)strategy;
    throw NotImplemented("lesson 09, task 1a: the forward of the autograd function");
    // END YOUR CODE
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_outputs) {
    // BEGIN YOUR CODE task 1: the autograd function
    // TODO(lesson 09, task 1b): get the saved tensors and the setup back, run strategy_backward, return 5 gradients.
    // README, "Task 1 — the autograd function (1a forward, 1b backward)", 1b, and "The capsule".
    (void)ctx, (void)grad_outputs;
    throw NotImplemented("lesson 09, task 1b: the backward of the autograd function");
    // END YOUR CODE
  }
};

}  // namespace

torch::Tensor context_parallel_attention(Comm& comm, const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const Strategy& strategy) {
  return ContextParallelAttentionFunction::apply(q, k, v, &comm, strategy);
}

ContextParallelAttentionImpl::ContextParallelAttentionImpl(Comm& comm, const ContextParallelAttentionOptions& options)
    : comm_(&comm), options_(options) {
  const int64_t e = options.embed_dim, hq = options.heads_q, hkv = options.heads_kv;
  CP_CHECK(e > 0 && hq > 0 && hkv > 0, "ContextParallelAttention: embed_dim, heads_q and heads_kv must be positive; got ",
           e, ", ", hq, ", ", hkv);
  CP_CHECK(e % hq == 0, "ContextParallelAttention: embed_dim ", e, " is not divisible by heads_q ", hq);
  CP_CHECK(hq % hkv == 0, "ContextParallelAttention: heads_q ", hq, " is not divisible by heads_kv ", hkv);
  const int64_t d = e / hq;
  auto linear = [](int64_t in, int64_t out) { return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)); };
  q_proj = register_module("q_proj", linear(e, hq * d));
  k_proj = register_module("k_proj", linear(e, hkv * d));
  v_proj = register_module("v_proj", linear(e, hkv * d));
  o_proj = register_module("o_proj", linear(hq * d, e));
}

torch::Tensor ContextParallelAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t e = options_.embed_dim, hq = options_.heads_q, hkv = options_.heads_kv, d = e / hq;
  CP_CHECK(x.defined() && x.dim() == 3 && x.size(2) == e, "x: expected [B, S/N, E = ", e, "], got ",
           x.defined() ? x.sizes() : torch::IntArrayRef{});
  const torch::Tensor& w = q_proj->weight;
  CP_CHECK(x.scalar_type() == w.scalar_type() && x.device() == w.device(), "x: expected the layer's dtype and device (",
           w.dtype(), " on ", w.device(), "), got ", x.dtype(), " on ", x.device(), "; convert x or move the layer with .to()");
  // BEGIN YOUR CODE task 2: the layer
  // TODO(lesson 09, task 2): project x, split the heads, context_parallel_attention, merge the heads, o_proj.
  // README, "Task 2 — the layer's forward" and "The layer".
  (void)hkv, (void)d;
  throw NotImplemented("lesson 09, task 2: ContextParallelAttention::forward");
  // END YOUR CODE
}

void broadcast_parameters(Comm& comm, torch::nn::Module& module, int root) {
  torch::NoGradGuard no_grad;
  for (torch::Tensor& p : module.parameters()) {
    torch::Tensor data = p.detach();  // shares p's storage: the broadcast writes into p
    comm.broadcast(data, root);
  }
}

void all_reduce_gradients(Comm& comm, torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (torch::Tensor& p : module.parameters()) {
    // BEGIN YOUR CODE task 3: the gradient all-reduce
    // TODO(lesson 09, task 3): average p's gradient over the ranks (a missing gradient takes part as zeros).
    // README, "Task 3 — `all_reduce_gradients`".
    (void)p, (void)comm;
    throw NotImplemented("lesson 09, task 3: all_reduce_gradients");
    // END YOUR CODE
  }
}

}  // namespace cp
