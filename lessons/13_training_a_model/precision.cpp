// GENERATED from solutions/13_training_a_model/precision.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 13, task 5 — the merge in its sigmoid form, and the experiment that measures how
// bfloat16 partial results drift as the ring grows.
#include <cmath>

#include "block_attention.h"
#include "common/error.h"
#include "training.h"

namespace cp {

void merge_attention_sigmoid(torch::Tensor& out_acc, torch::Tensor& lse_acc, const torch::Tensor& out_blk,
                             const torch::Tensor& lse_blk) {
  check_merge_inputs(out_acc, lse_acc, out_blk, lse_blk);
  // BEGIN YOUR CODE task 5: the sigmoid form
  // TODO(lesson 13, task 5): out_acc − s (out_acc − out_blk) and the log-sigmoid lse, in place; both
  // sides empty stays empty, and no −inf − (−inf) anywhere. README, "Task 5 — `merge_attention_sigmoid`".
  throw NotImplemented("lesson 13, task 5: merge_attention_sigmoid");
  // END YOUR CODE
}

std::string to_string(Accumulator accumulator) {
  return accumulator == Accumulator::Bfloat16 ? "bfloat16" : "float32";
}

std::string to_string(MergeForm form) { return form == MergeForm::Exp ? "exp" : "sigmoid"; }

namespace {

/// What a bfloat16 kernel returns: t rounded to bfloat16 (kept as float32 to compute on).
torch::Tensor round_bf16(const torch::Tensor& t) { return t.to(torch::kBFloat16).to(torch::kFloat); }

/// mean |a − b| / mean |b|, in float64.
double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor bd = b.to(torch::kDouble);
  const double size = bd.abs().mean().item<double>();
  return (a.to(torch::kDouble) - bd).abs().mean().item<double>() / (size > 0 ? size : 1.0);
}

/// Query chunk qi against key chunk kj of `c` tokens: the scores, −inf above the diagonal when
/// qi == kj (causal; qi < kj is never asked).
torch::Tensor block_scores(const torch::Tensor& q, const torch::Tensor& k, int64_t qi, int64_t kj, int64_t c,
                           double scale) {
  torch::Tensor s = q.narrow(1, qi * c, c).matmul(k.narrow(1, kj * c, c).transpose(-1, -2)) * scale;
  if (qi == kj) s = s.masked_fill(torch::ones({c, c}, torch::kBool).triu(1), -INFINITY);
  return s;
}

/// Keeps a running result as `accumulator` does after each update: rounded to bfloat16, or as is.
void store(torch::Tensor& acc, Accumulator accumulator) {
  if (accumulator == Accumulator::Bfloat16) acc.copy_(round_bf16(acc));
}

/// The partials added in order in `accumulator`, rounded to bfloat16 at the end.
torch::Tensor sum_in(const std::vector<torch::Tensor>& partials, Accumulator accumulator) {
  torch::Tensor acc = torch::zeros_like(partials[0]);
  for (const torch::Tensor& partial : partials) {
    acc.add_(partial);
    store(acc, accumulator);
  }
  return round_bf16(acc);
}

}  // namespace

std::vector<PrecisionResult> ring_precision(int world, const PrecisionSetup& setup) {
  CP_CHECK(world >= 1, "world: must be at least 1, got ", world);
  CP_CHECK(setup.chunk >= 1 && setup.heads >= 1 && setup.dim >= 1, "setup: chunk, heads and dim must be positive, got ",
           setup.chunk, ", ", setup.heads, ", ", setup.dim);
  const int64_t n = world, c = setup.chunk, s = n * c, last = n - 1;
  const double scale = 1.0 / std::sqrt(static_cast<double>(setup.dim));
  torch::Generator gen = at::detail::createCPUGenerator(setup.seed);
  auto input = [&] { return round_bf16(torch::randn({setup.heads, s, setup.dim}, gen)); };
  const torch::Tensor q = input(), k = input(), v = input(), dout = input();

  // The float64 reference, one query chunk at a time (a whole S × S matrix would not fit at
  // N = 64): out and lse of every row, dq of the last chunk, dk and dv of the first.
  const torch::Tensor qd = q.to(torch::kDouble), kd = k.to(torch::kDouble), vd = v.to(torch::kDouble),
                      dod = dout.to(torch::kDouble);
  torch::Tensor ref_out = torch::empty_like(qd), ref_lse = torch::empty({setup.heads, s}, torch::kDouble);
  torch::Tensor ref_dq, ref_dk = torch::zeros({setup.heads, c, setup.dim}, torch::kDouble),
                        ref_dv = torch::zeros_like(ref_dk);
  for (int64_t i = 0; i < n; ++i) {
    torch::Tensor sc = qd.narrow(1, i * c, c).matmul(kd.narrow(1, 0, (i + 1) * c).transpose(-1, -2)) * scale;
    sc = sc.masked_fill(torch::ones({c, (i + 1) * c}, torch::kBool).triu(i * c + 1), -INFINITY);
    const torch::Tensor lse = sc.logsumexp(-1), p = (sc - lse.unsqueeze(-1)).exp();
    const torch::Tensor o = p.matmul(vd.narrow(1, 0, (i + 1) * c)), g = dod.narrow(1, i * c, c);
    ref_out.narrow(1, i * c, c).copy_(o);
    ref_lse.narrow(1, i * c, c).copy_(lse);
    const torch::Tensor ds = p * (g.matmul(vd.narrow(1, 0, (i + 1) * c).transpose(-1, -2)) -
                                  (g * o).sum(-1, true));
    ref_dk += ds.narrow(2, 0, c).transpose(-1, -2).matmul(qd.narrow(1, i * c, c)) * scale;
    ref_dv += p.narrow(2, 0, c).transpose(-1, -2).matmul(g);
    if (i == last) ref_dq = ds.matmul(kd.narrow(1, 0, s)) * scale;
  }

  // Backward, from the exact forward as the kernels would return it (out in bfloat16, lse in
  // float32), so that the errors below are the backward's own. P = exp(S − lse),
  // dS = P ∘ (dout vᵀ − rowsum(dout ∘ out)); dq = dS k, dk = dSᵀ q, dv = Pᵀ dout (times the scale
  // for dq and dk).
  const torch::Tensor fwd_out = round_bf16(ref_out), fwd_lse = ref_lse.to(torch::kFloat);
  auto block_grads = [&](int64_t i, int64_t j) {  // query chunk i, key chunk j: P and dS
    const torch::Tensor p = (block_scores(q, k, i, j, c, scale) - fwd_lse.narrow(1, i * c, c).unsqueeze(-1)).exp();
    const torch::Tensor g = dout.narrow(1, i * c, c);
    const torch::Tensor delta = (g * fwd_out.narrow(1, i * c, c)).sum(-1, true);
    return std::make_pair(p, p * (g.matmul(v.narrow(1, j * c, c).transpose(-1, -2)) - delta));
  };
  // Every block's partial result as a bfloat16 kernel returns it, computed once for all the
  // accumulators. The last rank's blocks in ring order, its own first (step t brings the chunk of
  // rank N − 1 − t): out and lse (forward), dq (backward). Chunk 0's dK/dV start on rank 0 and
  // travel the ring: rank i adds its queries' share at step i.
  std::vector<torch::Tensor> block_out, block_lse, block_dq, block_dk, block_dv;
  for (int64_t j = last; j >= 0; --j) {
    const torch::Tensor sc = block_scores(q, k, last, j, c, scale);
    block_lse.push_back(sc.logsumexp(-1));
    block_out.push_back(round_bf16((sc - block_lse.back().unsqueeze(-1)).exp().matmul(v.narrow(1, j * c, c))));
    block_dq.push_back(round_bf16(block_grads(last, j).second.matmul(k.narrow(1, j * c, c)) * scale));
  }
  for (int64_t i = 0; i < n; ++i) {
    const auto [p, ds] = block_grads(i, 0);
    block_dk.push_back(round_bf16(ds.transpose(-1, -2).matmul(q.narrow(1, i * c, c)) * scale));
    block_dv.push_back(round_bf16(p.transpose(-1, -2).matmul(dout.narrow(1, i * c, c))));
  }

  std::vector<PrecisionResult> results;
  for (Accumulator accumulator : {Accumulator::Bfloat16, Accumulator::Float32}) {
    PrecisionErrors backward;  // the backward's sums have no form
    backward.dq = relative_error(sum_in(block_dq, accumulator), ref_dq);
    backward.dk = relative_error(sum_in(block_dk, accumulator), ref_dk);
    backward.dv = relative_error(sum_in(block_dv, accumulator), ref_dv);
    for (MergeForm form : {MergeForm::Exp, MergeForm::Sigmoid}) {
      torch::Tensor out = torch::zeros({setup.heads, c, setup.dim}), lse = torch::full({setup.heads, c}, -INFINITY);
      for (size_t b = 0; b < block_out.size(); ++b) {
        if (form == MergeForm::Exp)
          merge_attention(out, lse, block_out[b], block_lse[b]);
        else
          merge_attention_sigmoid(out, lse, block_out[b], block_lse[b]);
        store(out, accumulator);
      }
      PrecisionErrors errors = backward;
      errors.out = relative_error(round_bf16(out), ref_out.narrow(1, last * c, c));
      errors.lse = (lse.to(torch::kDouble) - ref_lse.narrow(1, last * c, c)).abs().mean().item<double>();
      results.push_back({accumulator, form, errors});
    }
  }
  return results;
}

}  // namespace cp
