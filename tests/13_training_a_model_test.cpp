// Lesson 13 — training a small language model under context parallelism: rotary embeddings
// against the formula, the shards against the whole sequence's labels, the loss and its gradient
// against float64 cross-entropy over all tokens, k AdamW steps on N ranks against the same model
// trained on one device in float64 (local worlds of 1, 2, 3, 4, 8 ranks and mpirun, every
// strategy), and the bfloat16 ring's drift against float64 attention.
#include <torch/optim/adamw.h>
#include <torch/types.h>

#include <cmath>
#include <map>

#include "common/error.h"
#include "common/world.h"
#include "hybrid.h"
#include "testing/harness.h"
#include "testing/oracle.h"
#include "training.h"
#include "ulysses.h"
#include "windows_and_documents.h"

namespace cp {
namespace {

using testing::expect_error;
using testing::for_each_world;

const std::vector<TokenLayout> kLayouts = {TokenLayout::Contiguous, TokenLayout::ZigZag, TokenLayout::Stripe};

// ── The float64 reference: the same model written with plain LibTorch ops on the whole sequence ─

/// The labels of the whole batch, by the definition: the next token, none at the end or before
/// padding.
torch::Tensor reference_labels(const torch::Tensor& tokens, int64_t pad) {
  torch::Tensor labels = torch::full_like(tokens, kIgnoreLabel);
  auto t = tokens.accessor<int64_t, 2>();
  auto l = labels.accessor<int64_t, 2>();
  for (int64_t b = 0; b < tokens.size(0); ++b)
    for (int64_t i = 0; i + 1 < tokens.size(1); ++i)
      if (t[b][i + 1] != pad) l[b][i] = t[b][i + 1];
  return labels;
}

/// Rotary embeddings of x [..., L, D] at positions 0 … L − 1 in float64 (the formula of
/// training.h, element by element).
torch::Tensor reference_rotary(const torch::Tensor& x, const torch::Tensor& positions, double base) {
  const int64_t d = x.size(-1), h = d / 2, l = x.size(-2);
  torch::Tensor cos = torch::empty({l, h}, torch::kDouble), sin = torch::empty({l, h}, torch::kDouble);
  for (int64_t p = 0; p < l; ++p)
    for (int64_t i = 0; i < h; ++i) {
      const double angle = static_cast<double>(positions[p].item<int64_t>()) *
                           std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d));
      cos[p][i] = std::cos(angle);
      sin[p][i] = std::sin(angle);
    }
  const torch::Tensor x1 = x.narrow(-1, 0, h), x2 = x.narrow(-1, h, h);
  return torch::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
}

using Params = std::map<std::string, torch::Tensor>;

Params parameters_of(TinyLM& model) {
  Params params;
  for (const auto& item : model->named_parameters()) params[item.key()] = item.value().detach().clone();
  return params;
}

/// The mean cross-entropy over the valid labels of the whole batch, from the model's weights.
torch::Tensor reference_loss(const Params& w, const torch::Tensor& tokens, const torch::Tensor& labels,
                             const TinyLMOptions& o, int64_t window) {
  const int64_t b = tokens.size(0), s = tokens.size(1), hq = o.heads_q, hkv = o.heads_kv, d = o.embed_dim / hq;
  auto rms = [](const torch::Tensor& x, const torch::Tensor& g) {
    return x / (x.pow(2).mean(-1, true) + 1e-5).sqrt() * g;
  };
  auto heads = [&](const torch::Tensor& t, int64_t h) { return t.view({b, s, h, d}).transpose(1, 2); };
  const torch::Tensor positions = torch::arange(s, torch::kLong);
  const torch::Tensor qpos = positions.unsqueeze(1), kpos = positions.unsqueeze(0);
  torch::Tensor visible = kpos <= qpos;
  if (window > 0) visible = visible & (kpos > qpos - window);
  torch::Tensor x = w.at("embed.weight").index_select(0, tokens.reshape({-1})).view({b, s, o.embed_dim});
  for (int64_t l = 0; l < o.layers; ++l) {
    auto p = [&](const std::string& name) { return w.at("blocks." + std::to_string(l) + "." + name); };
    const torch::Tensor n = rms(x, p("attn_norm.weight"));
    const torch::Tensor q = reference_rotary(heads(n.matmul(p("q_proj.weight").t()), hq), positions, o.rope_base);
    const torch::Tensor k = reference_rotary(heads(n.matmul(p("k_proj.weight").t()), hkv), positions, o.rope_base)
                                .repeat_interleave(hq / hkv, 1);
    const torch::Tensor v = heads(n.matmul(p("v_proj.weight").t()), hkv).repeat_interleave(hq / hkv, 1);
    const torch::Tensor scores =
        q.matmul(k.transpose(-1, -2)).div(std::sqrt(static_cast<double>(d))).masked_fill(visible.logical_not(), -INFINITY);
    const torch::Tensor a = scores.softmax(-1).matmul(v).transpose(1, 2).reshape({b, s, hq * d});
    x = x + a.matmul(p("o_proj.weight").t());
    const torch::Tensor m = rms(x, p("mlp_norm.weight"));
    x = x + (torch::silu(m.matmul(p("gate.weight").t())) * m.matmul(p("up.weight").t())).matmul(p("down.weight").t());
  }
  const torch::Tensor logp = rms(x, w.at("norm.weight")).matmul(w.at("lm_head.weight").t()).log_softmax(-1);
  const torch::Tensor valid = labels != kIgnoreLabel;
  const torch::Tensor picked = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1);
  return -(picked * valid).sum() / valid.sum().clamp_min(1);
}

struct ReferenceRun {
  std::vector<double> losses;
  std::vector<Params> grads;  // per step
  Params weights;             // after the last step
};

/// AdamW divides each step by √v + eps: where a gradient is near zero, its rounding would become
/// a whole step of lr. The lse of every strategy is float32 (so even a float64 model's gradients
/// carry ~1e-8 of rounding): eps = 1e-4 bounds what that rounding moves a weight to lr · 1e-4.
torch::optim::AdamWOptions adamw_options() {
  return torch::optim::AdamWOptions(3e-3).eps(1e-4).weight_decay(0.1);
}

/// `steps` AdamW steps of the model whose initial weights are `initial`, on the whole batch, in
/// float64 with LibTorch's autograd.
ReferenceRun reference_training(const Params& initial, const torch::Tensor& tokens, int64_t pad, const TinyLMOptions& o,
                                int64_t window, int steps) {
  Params w;
  std::vector<torch::Tensor> leaves;
  for (const auto& [name, p] : initial) leaves.push_back(w[name] = p.to(torch::kDouble).clone().requires_grad_());
  torch::optim::AdamW adamw(leaves, adamw_options());
  const torch::Tensor labels = reference_labels(tokens, pad);
  ReferenceRun run;
  for (int step = 0; step < steps; ++step) {
    adamw.zero_grad();
    const torch::Tensor loss = reference_loss(w, tokens, labels, o, window);
    loss.backward();
    run.losses.push_back(loss.item<double>());
    Params g;
    for (const auto& [name, p] : w) g[name] = p.grad().clone();
    run.grads.push_back(g);
    adamw.step();
  }
  for (const auto& [name, p] : w) run.weights[name] = p.detach().clone();
  return run;
}

/// A batch of 2 sequences of S tokens: the first full, the second padding (token 0) from 3S/8 on,
/// so that the ranks hold different numbers of valid labels in every layout.
constexpr int64_t kPad = 0;
torch::Tensor training_batch(int64_t s, int64_t vocab, uint64_t seed) {
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  torch::Tensor tokens = torch::randint(1, vocab, {2, s}, gen, torch::kLong);
  tokens[1].narrow(0, 3 * s / 8, s - 3 * s / 8).fill_(kPad);
  return tokens;
}

struct TrainingCase {
  Strategy strategy;
  int64_t heads_q, heads_kv;
  int64_t window = 0;  // the strategy's sliding window, for the reference
};

/// The strategies of the course on `world` ranks, with heads that suit each (Ulysses and the
/// hybrid split 2N query heads over the ranks).
std::vector<TrainingCase> training_cases(int world) {
  std::vector<TrainingCase> cases;
  for (const Strategy& s : all_strategies()) cases.push_back({s, 4, 2});
  cases.push_back({stripe_ring_strategy(), 4, 2});  // the stripe layout (lesson 07)
  cases.push_back({ulysses_strategy(), 2 * world, 1});
  cases.push_back({hybrid_strategy(default_hybrid_mesh(world, 2 * world, 1)), 2 * world, 1});
  SequenceMask window;
  window.window = 5;
  cases.push_back({masked_ring_strategy(TokenLayout::ZigZag, window), 4, 2, 5});
  return cases;
}

/// `steps` train_step calls on comm's ranks against reference_training: the loss of every step,
/// every parameter's all-reduced gradient at every step, and the weights at the end.
void expect_training_matches_one_device(Comm& comm, const TrainingCase& c, torch::ScalarType dtype, int steps,
                                        uint64_t seed) {
  const int n = comm.size();
  const int64_t s = 8 * n;
  TinyLMOptions o;
  o.vocab = 16;
  o.embed_dim = 8 * c.heads_q;  // D = 8
  o.heads_q = c.heads_q;
  o.heads_kv = c.heads_kv;
  o.mlp_dim = 32;
  o.seed = seed;
  o.strategy = c.strategy;
  const torch::Tensor tokens = training_batch(s, o.vocab, seed + 1);
  TinyLM model(comm, o);
  model->to(dtype);
  const ReferenceRun ref = reference_training(parameters_of(model), tokens, kPad, o, c.window, steps);
  const TokenShard shard = shard_batch(tokens, layout_of(c.strategy), n, comm.rank(), kPad);
  torch::optim::AdamW adamw(model->parameters(), adamw_options());
  const std::string what = to_string(c.strategy) + ", " + std::string(c10::toString(dtype)) + ", rank " +
                           std::to_string(comm.rank()) + " of " + std::to_string(n);
  for (int step = 0; step < steps; ++step) {
    const ShardedLoss loss = train_step(comm, model, adamw, shard);
    const double expected = ref.losses[step];
    const Tolerance tol = tolerance_for(dtype);  // lse is float32 whatever the dtype: so is the loss's rounding
    EXPECT_NEAR(loss.loss, expected, tol.abs + tol.rel * std::abs(expected))
        << "the loss of step " << step + 1 << ", " << what;
    for (const auto& item : model->named_parameters()) {
      const torch::Tensor& g = ref.grads[step].at(item.key());
      CP_EXPECT_CLOSE(item.value().grad(), g,
                      "the gradient of " + item.key() + " at step " + std::to_string(step + 1) + ", " + what, {},
                      gradient_tolerance(dtype, g));
    }
  }
  for (const auto& item : model->named_parameters())
    CP_EXPECT_CLOSE(item.value(), ref.weights.at(item.key()),
                    "the weights " + item.key() + " after " + std::to_string(steps) + " steps, " + what);
}

// ── Task 1: rotary embeddings ───────────────────────────────────────────────────────────────

CP_TEST(Lesson13, Task1_RotaryMatchesTheFormula) {
  // Positions as a rank holds them: not contiguous, and far from 0 (the angles reach 10⁵ rad).
  const torch::Tensor positions = torch::tensor(std::vector<int64_t>{0, 1, 7, 8, 40, 41, 99999, 100000});
  for (torch::ScalarType dtype : {torch::kFloat, torch::kDouble}) {
    const torch::Tensor x = testing::random_with_outliers({2, 3, 8, 16}, 131).to(dtype);
    for (double base : {10000.0, 500000.0})
      CP_EXPECT_CLOSE(apply_rotary(x, positions, base), reference_rotary(x.to(torch::kDouble), positions, base),
                      "rotary, " + std::string(c10::toString(dtype)) + ", base " + std::to_string(base),
                      {"b", "h", "s", "d"});
  }
}

CP_TEST(Lesson13, Task1_ScoresDependOnlyOnTheDistance) {
  // q at position p and k at position p' score the same as at p + δ and p' + δ: the model sees
  // where a key is relative to the query, wherever the rank's tokens sit in the sequence.
  const torch::Tensor q = testing::random_with_outliers({1, 1, 4, 16}, 132).to(torch::kDouble);
  const torch::Tensor k = testing::random_with_outliers({1, 1, 4, 16}, 133).to(torch::kDouble);
  const torch::Tensor pq = torch::tensor(std::vector<int64_t>{3, 9, 10, 30});
  const torch::Tensor pk = torch::tensor(std::vector<int64_t>{0, 2, 9, 12});
  auto scores = [&](int64_t shift) {
    return apply_rotary(q, pq + shift).matmul(apply_rotary(k, pk + shift).transpose(-1, -2));
  };
  CP_EXPECT_CLOSE(scores(1000), scores(0), "q·k with both positions moved by 1000");
  EXPECT_FALSE(torch::allclose(apply_rotary(q, pq + 1000), apply_rotary(q, pq)))
      << "the rotation must change with the position";
}

CP_TEST(Lesson13, Task1_BadInputGivesClearErrors) {
  const torch::Tensor x = torch::zeros({1, 1, 4, 8}), positions = torch::arange(4);
  apply_rotary(x, positions);  // counts once implemented
  testing::expect_errors({
      {"odd D", [] { apply_rotary(torch::zeros({1, 1, 4, 7}), torch::arange(4)); }, "x: the head dim D must be even"},
      {"one position too few", [&] { apply_rotary(x, torch::arange(3)); }, "positions: one per token"},
      {"float positions", [&] { apply_rotary(x, torch::arange(4).to(torch::kFloat)); }, "positions: expected int64"},
      {"integer x", [&] { apply_rotary(x.to(torch::kLong), positions); }, "x"},
  });
}

// ── Task 2: tokens, positions and labels ────────────────────────────────────────────────────

/// The values of an int64 1-D tensor on one line ("0, 1, 6, 7"; "undefined").
std::string list(const torch::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::string s;
  const torch::Tensor flat = t.reshape({-1}).to(torch::kCPU, torch::kLong);
  for (int64_t i = 0; i < flat.numel(); ++i) s += (i ? ", " : "") + std::to_string(flat[i].item<int64_t>());
  return s;
}

CP_TEST(Lesson13, Task2_LabelsAreMadeBeforeSharding) {
  const int64_t s = 48, pad = 0;
  torch::Generator gen = at::detail::createCPUGenerator(134);
  torch::Tensor tokens = torch::randint(1, 50, {2, s}, gen, torch::kLong);
  tokens[1].narrow(0, 30, s - 30).fill_(pad);
  const torch::Tensor labels = reference_labels(tokens, pad);
  for (TokenLayout layout : kLayouts) {
    for (int world : {1, 2, 3, 4, 8}) {
      for (int r = 0; r < world; ++r) {
        const std::string what = to_string(layout) + ", rank " + std::to_string(r) + " of " + std::to_string(world);
        const TokenShard shard = shard_batch(tokens, layout, world, r, pad);
        const torch::Tensor expected_positions = layout_positions(layout, s, world, r);
        if (!shard.positions.defined() || !shard.positions.equal(expected_positions)) {
          ADD_FAILURE() << "positions, " << what << ": expected the tokens' positions in the whole sequence, "
                        << list(expected_positions) << " (layout_positions), got " << list(shard.positions)
                        << ". Rotary embeddings need the global positions: local ones give another model.";
          return;
        }
        if (!shard.tokens.equal(tokens.index_select(1, expected_positions))) {
          ADD_FAILURE() << "tokens, " << what << ": expected the tokens at positions " << list(expected_positions);
          return;
        }
        const torch::Tensor expected = labels.index_select(1, expected_positions);
        if (!shard.labels.defined() || shard.labels.sizes() != expected.sizes()) {
          ADD_FAILURE() << "labels, " << what << ": expected int64 " << expected.sizes() << ", got "
                        << (shard.labels.defined() ? shard.labels.sizes() : torch::IntArrayRef{});
          return;
        }
        if (!shard.labels.equal(expected)) {  // name the first wrong label, and its likely cause
          const torch::Tensor wrong = (shard.labels != expected).nonzero()[0];
          const int64_t b = wrong[0].item<int64_t>(), i = wrong[1].item<int64_t>();
          const int64_t p = expected_positions[i].item<int64_t>(), want = expected[b][i].item<int64_t>();
          const bool before_padding = p + 1 < s && tokens[b][p + 1].item<int64_t>() == pad;
          const bool next_is_here = i + 1 < expected_positions.size(0) && expected_positions[i + 1].item<int64_t>() == p + 1;
          ADD_FAILURE() << "labels, " << what << ": the token at position " << p << " of sequence " << b << " must be "
                        << "labelled " << want << ", got " << shard.labels[b][i].item<int64_t>() << ". "
                        << (p + 1 == s ? "It is the last token of the sequence: nothing follows it (kIgnoreLabel)."
                            : before_padding
                                ? "Padding follows it, and padding is never predicted (kIgnoreLabel)."
                                : "Its label is the token at position " + std::to_string(p + 1) +
                                      " of the whole sequence" +
                                      (next_is_here ? "." : ", which is not next to it in this rank's shard: shift "
                                                            "the whole sequence first, then shard."));
          return;
        }
      }
    }
  }
}

CP_TEST(Lesson13, Task2_BadInputGivesClearErrors) {
  const torch::Tensor tokens = torch::zeros({1, 8}, torch::kLong);
  shard_batch(tokens, TokenLayout::ZigZag, 2, 0);  // counts once implemented
  testing::expect_errors({
      {"float tokens", [] { shard_batch(torch::zeros({1, 8}), TokenLayout::Contiguous, 2, 0); }, "tokens: expected int64"},
      {"1-D tokens", [] { shard_batch(torch::zeros({8}, torch::kLong), TokenLayout::Contiguous, 2, 0); }, "tokens"},
      {"rank outside the world", [&] { shard_batch(tokens, TokenLayout::Contiguous, 2, 2); }, "rank: expected 0"},
      {"S not divisible by 2N", [&] { shard_batch(tokens, TokenLayout::ZigZag, 3, 0); }, "divisible"},
  });
}

// ── Task 3: the loss ────────────────────────────────────────────────────────────────────────

CP_TEST(Lesson13, Task3_TheLossIsWeightedByTheTokensOfAllRanks) {
  // Contiguous shards of 2 × 48 tokens whose second half is mostly ignored: rank N − 1 holds far
  // fewer valid labels than rank 0, so a mean of the ranks' means is visibly wrong.
  for_each_world([](Comm& comm) {
    const int n = comm.size();
    const int64_t s = 48, v = 11;
    const torch::Tensor logits = testing::random_with_outliers({2, s, v}, 135).to(torch::kDouble);
    torch::Generator gen = at::detail::createCPUGenerator(136);
    torch::Tensor labels = torch::randint(0, v, {2, s}, gen, torch::kLong);
    labels.narrow(1, s / 2, s / 2).masked_fill_(torch::rand({2, s / 2}, gen) < 0.8, kIgnoreLabel);
    const torch::Tensor full = logits.clone().requires_grad_();
    const torch::Tensor valid = labels != kIgnoreLabel;
    const torch::Tensor picked = full.log_softmax(-1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1);
    const torch::Tensor ref = -(picked * valid).sum() / valid.sum();
    ref.backward();
    auto mine = [&](const torch::Tensor& t) { return shard_sequence(t, TokenLayout::Contiguous, n, comm.rank(), 1); };
    const std::string what = "rank " + std::to_string(comm.rank()) + " of " + std::to_string(n);
    const torch::Tensor local = mine(logits).clone().requires_grad_();
    const ShardedLoss loss = sharded_cross_entropy(comm, local, mine(labels));
    EXPECT_NEAR(loss.loss, ref.item<double>(), 1e-12) << "the loss, " << what << ": the mean over the valid tokens of "
                                                      << "every rank (sum of all losses / count of all valid tokens)";
    EXPECT_EQ(loss.tokens, valid.sum().item<int64_t>()) << "the valid tokens of all ranks, " << what;
    loss.objective.backward();
    // all_reduce_gradients divides the sum over the ranks by N: the gradient a rank contributes
    // for its own logits, divided by N, is the global loss's gradient for them.
    CP_EXPECT_CLOSE(local.grad() / n, mine(full.grad()),
                    "d loss / d logits after the average over the ranks, " + what, {"b", "s", "v"});
  });
}

CP_TEST(Lesson13, Task3_NoValidTokenGivesZeroNotNaN) {
  for_each_world([](Comm& comm) {
    const torch::Tensor logits = torch::randn({1, 4, 5}, torch::kDouble).requires_grad_();
    const ShardedLoss loss = sharded_cross_entropy(comm, logits, torch::full({1, 4}, kIgnoreLabel, torch::kLong));
    EXPECT_EQ(loss.loss, 0.0) << "rank " << comm.rank() << " of " << comm.size();
    EXPECT_EQ(loss.tokens, 0);
    loss.objective.backward();
    EXPECT_TRUE(logits.grad().eq(0).all().item<bool>()) << "the gradient must be 0 when no token counts";
  });
}

CP_TEST(Lesson13, Task3_BadInputGivesClearErrors) {
  run_local_world(1, [](Comm& comm) {  // counts once implemented
    sharded_cross_entropy(comm, torch::zeros({1, 2, 3}), torch::zeros({1, 2}, torch::kLong));
  });
  auto call = [](torch::Tensor logits, torch::Tensor labels) {
    return [logits, labels] { run_local_world(1, [&](Comm& comm) { sharded_cross_entropy(comm, logits, labels); }); };
  };
  const torch::Tensor logits = torch::zeros({1, 2, 3});
  testing::expect_errors({
      {"labels of another shape", call(logits, torch::zeros({1, 3}, torch::kLong)), "labels: expected int64 [1, 2]"},
      {"a label past V", call(logits, torch::full({1, 2}, 3, torch::kLong)), "labels: each must be kIgnoreLabel"},
      {"float labels", call(logits, torch::zeros({1, 2})), "labels: expected int64"},
      {"2-D logits", call(torch::zeros({2, 3}), torch::zeros({2}, torch::kLong)), "logits"},
  });
}

// ── Task 4: training ────────────────────────────────────────────────────────────────────────

CP_TEST(Lesson13, Task4_TrainingOnNRanksEqualsOneDevice) {
  // Three AdamW steps in float64 on every strategy of the course (and the stripe layout, and
  // lesson 12's window), on every world, against the whole model trained on one device: losses,
  // gradients, weights.
  for_each_world([](Comm& comm) {
    for (const TrainingCase& c : training_cases(comm.size()))
      expect_training_matches_one_device(comm, c, torch::kDouble, 3, 137);
  });
}

CP_TEST(Lesson13, Task4_Float32TrainingEqualsOneDevice) {
  for_each_world([](Comm& comm) {
    expect_training_matches_one_device(comm, {zigzag_ring_strategy(), 4, 2}, torch::kFloat, 4, 138);
  });
}

// ── Task 5: the merge's forms and the precision of the ring ──────────────────────────────────

CP_TEST(Lesson13, Task5_SigmoidMergeIsTheMerge) {
  // Rows 0–3: both sides, the accumulator empty, the block empty, both empty; then large gaps
  // between the two lse (+100: float32's largest value is about e^88.7, so e^100 overflows and a
  // naive log(exp(a) + exp(b)) gives inf in rows 4 and 5).
  const torch::Tensor out_a = testing::random_with_outliers({2, 8, 16}, 139), out_b = testing::random_with_outliers({2, 8, 16}, 140);
  torch::Tensor lse_a = testing::random_with_outliers({2, 8}, 141), lse_b = testing::random_with_outliers({2, 8}, 142);
  lse_a.select(1, 1).fill_(-INFINITY);
  lse_b.select(1, 2).fill_(-INFINITY);
  lse_a.select(1, 3).fill_(-INFINITY);
  lse_b.select(1, 3).fill_(-INFINITY);
  lse_a.select(1, 4).add_(100);
  lse_b.select(1, 5).add_(100);
  torch::Tensor acc_a = torch::where(lse_a.unsqueeze(-1) == -INFINITY, torch::zeros_like(out_a), out_a);
  const torch::Tensor blk = torch::where(lse_b.unsqueeze(-1) == -INFINITY, torch::zeros_like(out_b), out_b);
  // The float64 definition: the softmax-weighted average of the two sides, and the log of the sum.
  const torch::Tensor a = lse_a.to(torch::kDouble), b = lse_b.to(torch::kDouble);
  const torch::Tensor m = torch::maximum(a, b), m_safe = torch::where(m == -INFINITY, torch::zeros_like(m), m);
  const torch::Tensor wa = (a - m_safe).exp(), wb = (b - m_safe).exp(), total = wa + wb;
  const torch::Tensor denom = torch::where(total == 0, torch::ones_like(total), total).unsqueeze(-1);
  const torch::Tensor expected_out = (wa.unsqueeze(-1) * acc_a.to(torch::kDouble) + wb.unsqueeze(-1) * blk.to(torch::kDouble)) / denom;
  const torch::Tensor expected_lse = m_safe + total.log();
  for (bool sigmoid : {false, true}) {
    torch::Tensor out = acc_a.clone(), lse = lse_a.clone();
    if (sigmoid)
      merge_attention_sigmoid(out, lse, blk, lse_b);
    else
      merge_attention(out, lse, blk, lse_b);
    const std::string form = sigmoid ? "sigmoid" : "exp";
    // out_acc − s (out_acc − out_blk) rounds at the size of the operands, not of the result (a
    // row whose accumulator is an outlier the block outweighs): the tolerance of a sum of terms.
    const Tolerance tol = sigmoid ? gradient_tolerance(torch::kFloat, torch::cat({acc_a, blk}).to(torch::kDouble))
                                  : tolerance_for(torch::kFloat);
    CP_EXPECT_CLOSE(out, expected_out, "out of the " + form + " merge", {"h", "s", "d"}, tol);
    CP_EXPECT_CLOSE(lse, expected_lse, "lse of the " + form + " merge", {"h", "s"});
  }
}

CP_TEST(Lesson13, Task5_EqualPartialsMergeToTheirOwnBits) {
  // Two partial results that agree on out (lse apart by anything, an empty side included): their
  // average is that out, and the sigmoid form keeps it to the bit, since it only adds
  // s · (out_a − out_b) = 0 to out_a. The weighted sum of the exp form rounds its two products
  // and its division, and misses by an ulp in many elements.
  const torch::Tensor out = testing::random_with_outliers({2, 8, 16}, 144);
  torch::Tensor lse_a = testing::random_with_outliers({2, 8}, 145), lse_b = testing::random_with_outliers({2, 8}, 146);
  lse_b.select(1, 0).fill_(-INFINITY);
  lse_a.select(1, 1).add_(100);
  torch::Tensor merged = out.clone(), lse = lse_a.clone();
  merge_attention_sigmoid(merged, lse, out, lse_b);
  const int64_t differ = merged.ne(out).sum().item<int64_t>();
  EXPECT_EQ(differ, 0) << differ << " of " << out.numel() << " elements of out changed when both sides held the same "
                       << "out: out_a − s·(out_a − out_b) leaves them as they are (is this the exp form's weighted "
                       << "sum?)";
}

PrecisionErrors errors_of(const std::vector<PrecisionResult>& results, Accumulator accumulator, MergeForm form) {
  for (const PrecisionResult& r : results)
    if (r.accumulator == accumulator && r.form == form) return r.errors;
  ADD_FAILURE() << "ring_precision returned no result for " << to_string(accumulator) << ", " << to_string(form);
  return {};
}

CP_TEST(Lesson13, Task5_TheFloat32AccumulatorStaysWithinOneRounding) {
  // 64 ranks of 32 tokens (S = 2048): the course's default, float32 accumulators, stays within
  // one bfloat16 rounding of float64 attention (u = 2⁻⁸ relative, 0.0039), forward and
  // backward, with either form.
  const std::vector<PrecisionResult> results = ring_precision(64, {32, 2, 64, 143});
  for (MergeForm form : {MergeForm::Exp, MergeForm::Sigmoid}) {
    const PrecisionErrors e = errors_of(results, Accumulator::Float32, form);
    const double u = std::ldexp(1.0, -8);
    for (const auto& [name, error] : std::vector<std::pair<std::string, double>>{
             {"out", e.out}, {"dq", e.dq}, {"dk", e.dk}, {"dv", e.dv}})
      EXPECT_LT(error, u) << name << ", N = 64, " << to_string(form) << " form: mean relative error";
    EXPECT_LT(e.lse, 1e-5) << "lse stays float32";
  }
}

CP_TEST(Lesson13, Task5_TheBfloat16AccumulatorDrifts) {
  torch::Tensor o = torch::zeros({1, 1}), l = torch::full({1}, -INFINITY);
  merge_attention_sigmoid(o, l, o, l);  // counts once implemented
  // The same ring with the sums kept in bfloat16: the error grows with N and, at N = 64, is
  // several times the float32 accumulator's.
  const PrecisionSetup setup{32, 2, 64, 143};
  const std::vector<PrecisionResult> one = ring_precision(1, setup), many = ring_precision(64, setup);
  const PrecisionErrors f32 = errors_of(many, Accumulator::Float32, MergeForm::Exp);
  for (MergeForm form : {MergeForm::Exp, MergeForm::Sigmoid}) {
    const PrecisionErrors bf16 = errors_of(many, Accumulator::Bfloat16, form);
    const std::string what = ", " + to_string(form) + " form";
    EXPECT_GT(bf16.out, 3 * f32.out) << "out, N = 64" << what;
    EXPECT_GT(bf16.out, 3 * errors_of(one, Accumulator::Bfloat16, form).out) << "out: N = 64 against N = 1" << what;
    EXPECT_GT(bf16.dq, 3 * f32.dq) << "dq, N = 64";
    EXPECT_GT(bf16.dk, 3 * f32.dk) << "dk, N = 64";
    EXPECT_GT(bf16.dv, 3 * f32.dv) << "dv, N = 64";
  }
}

}  // namespace
}  // namespace cp
