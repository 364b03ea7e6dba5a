// Lesson 03 — block attention with LSE and the merge, against float64 LibTorch attention.
#include <torch/types.h>

#include <algorithm>
#include <functional>
#include <random>

#include "block_attention.h"
#include "common/error.h"
#include "common/tensor_checks.h"
#include "testing/device_buffer.h"
#include "testing/harness.h"
#include "testing/oracle.h"

#if CP_WITH_CUDA
#include "block_attention.cuh"
#endif

namespace cp {
namespace {

using testing::all_close;
using testing::all_close_or_nan;
using testing::expect_error;
using testing::oracle_attention;

const std::vector<std::string> kDims = {"b", "h", "s", "d"};

struct Case {
  int64_t batch, heads_q, heads_kv, seq_q, seq_k, head_dim;
  bool causal;
};

struct Inputs {
  torch::Tensor q, k, v;
};

Inputs random_inputs(const Case& c, uint64_t seed, torch::ScalarType dtype = torch::kFloat) {
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  auto make = [&](int64_t heads, int64_t seq) {
    return torch::randn({c.batch, heads, seq, c.head_dim}, gen, torch::kFloat).to(dtype);
  };
  return {make(c.heads_q, c.seq_q), make(c.heads_kv, c.seq_k), make(c.heads_kv, c.seq_k)};
}

std::string describe(const Case& c) {
  return "B=" + std::to_string(c.batch) + " Hq=" + std::to_string(c.heads_q) + " Hkv=" + std::to_string(c.heads_kv) +
         " Sq=" + std::to_string(c.seq_q) + " Sk=" + std::to_string(c.seq_k) + " D=" + std::to_string(c.head_dim) +
         (c.causal ? " causal" : "");
}

/// One way of running the forward on rounded inputs (dtype tensors on the CPU): the public
/// function on a device, or the kernel on device buffers. `mask` may leave positions undefined;
/// q_pos and k_pos are the positions it stands for.
using ForwardFn = std::function<AttnResult(const Inputs& in, const AttentionMask& mask, const torch::Tensor& q_pos,
                                           const torch::Tensor& k_pos, double scale)>;

/// attention_block_forward on `device`.
ForwardFn forward_on(torch::Device device) {
  return [device](const Inputs& in, const AttentionMask& mask, const torch::Tensor&, const torch::Tensor&, double) {
    AttentionMask on_device = mask;
    if (mask.q_positions.defined()) on_device.q_positions = mask.q_positions.to(device);
    if (mask.k_positions.defined()) on_device.k_positions = mask.k_positions.to(device);
    return attention_block_forward(in.q.to(device), in.k.to(device), in.v.to(device), on_device);
  };
}

/// `forward` against the oracle, out and lse.
void check_forward_with(const ForwardFn& forward, const Case& c, const AttentionMask& mask, torch::ScalarType dtype,
                        uint64_t seed, const std::string& what) {
  const Inputs in = random_inputs(c, seed, dtype);
  const torch::Tensor q_pos = mask.q_positions.defined() ? mask.q_positions : torch::arange(c.seq_q);
  const torch::Tensor k_pos = mask.k_positions.defined() ? mask.k_positions : torch::arange(c.seq_k);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const auto [out, lse] =
      oracle_attention(in.q, in.k, in.v, {mask.causal, q_pos, k_pos, mask.window, mask.documents}, scale);
  const AttnResult r = forward(in, mask, q_pos, k_pos, scale);
  EXPECT_EQ(r.out.scalar_type(), dtype);
  EXPECT_EQ(r.lse.scalar_type(), torch::kFloat);
  const std::string where = what + " " + std::string(c10::toString(dtype)) + " " + describe(c);
  CP_EXPECT_CLOSE(r.out, out, "out " + where, kDims);
  CP_EXPECT_CLOSE(r.lse, lse, "lse " + where, {"b", "h", "s"});
}

void check_forward(const Case& c, const AttentionMask& mask, torch::Device device, torch::ScalarType dtype,
                   uint64_t seed, const std::string& what) {
  check_forward_with(forward_on(device), c, mask, dtype, seed, what);
}

/// Shapes from 1 to 1000+, never multiples of the 32-key tile or the 64-row block only.
const std::vector<Case> kCases = {
    {1, 1, 1, 1, 1, 32, false},      {1, 1, 1, 1, 1, 32, true},      {2, 4, 2, 33, 65, 64, false},
    {2, 4, 2, 65, 33, 64, true},     {1, 8, 1, 100, 257, 32, true},  {1, 6, 3, 129, 127, 128, false},
    {2, 2, 2, 70, 70, 128, true},    {1, 1, 1, 1030, 1100, 32, true}, {1, 2, 1, 1000, 1001, 64, false},
};

/// Empty shapes: no keys (every row attends to nothing: out 0, lse -inf), no queries, no batch.
const std::vector<Case> kEmptyCases = {
    {1, 2, 1, 10, 0, 32, false}, {1, 2, 1, 0, 10, 64, true}, {0, 2, 2, 5, 5, 128, false}};

/// The causal position layouts of the oracle, as masks.
std::vector<std::pair<std::string, AttentionMask>> position_layouts(int64_t s) {
  std::vector<std::pair<std::string, AttentionMask>> masks;
  for (const testing::PositionLayout& l : testing::causal_position_layouts(s))
    masks.push_back({l.name, {true, l.q_pos, l.k_pos}});
  return masks;
}

/// The oracle's window and document masks (testing::window_and_document_masks) as AttentionMasks.
std::vector<std::pair<std::string, AttentionMask>> window_and_document_masks(int64_t s) {
  std::vector<std::pair<std::string, AttentionMask>> masks;
  for (const auto& [name, m] : testing::window_and_document_masks(s)) {
    AttentionMask mask{m.causal, m.q_pos, m.k_pos};
    mask.window = m.window;
    mask.documents = m.documents;
    masks.push_back({name, mask});
  }
  return masks;
}

/// One non-finite value put into q, k or v: the rule of the course is the float64 reference's
/// (a NaN reaches every row that sees it, a +inf score gives lse +inf and out NaN, a -inf score
/// is a masked key), and a hidden key never reaches a row, whatever it holds.
struct Poison {
  std::string name;
  char tensor;  // 'q', 'k' or 'v'
  int64_t row;  // query row (q) or key (k, v), of head 0 of batch 0
  int64_t dim;
  float value;
};

std::vector<Poison> poisons(int64_t seq_q, int64_t seq_k) {
  const int64_t i = seq_q * 2 / 3, j = seq_k / 2;
  return {{"NaN in q", 'q', i, 3, NAN},        {"NaN in k", 'k', j, 5, NAN},         {"NaN in v", 'v', j, 2, NAN},
          {"+inf in q", 'q', i, 1, INFINITY},  {"-inf in q", 'q', i, 1, -INFINITY}, {"+inf in k", 'k', j, 4, INFINITY},
          {"-inf in k", 'k', j, 4, -INFINITY}};
}

Inputs poisoned(const Inputs& in, const Poison& p) {
  Inputs out{in.q.clone(), in.k.clone(), in.v.clone()};
  torch::Tensor& t = p.tensor == 'q' ? out.q : p.tensor == 'k' ? out.k : out.v;
  t[0][0][p.row][p.dim] = p.value;
  return out;
}

/// `forward` on inputs with one non-finite value, without and with causal masks of every layout,
/// against the oracle (NaN where it has NaN, else within the tolerance).
void check_non_finite_with(const ForwardFn& forward, int64_t s, int64_t d, const std::string& what) {
  const Case c{1, 2, 1, s, s, d, false};
  const Inputs clean = random_inputs(c, 31);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<std::pair<std::string, AttentionMask>> masks = position_layouts(s);
  masks.insert(masks.begin(), std::pair<std::string, AttentionMask>{"full", causal_mask(false)});
  for (const Poison& p : poisons(s, s)) {
    const Inputs in = poisoned(clean, p);
    for (const auto& [layout, mask] : masks) {
      const torch::Tensor q_pos = mask.q_positions.defined() ? mask.q_positions : torch::arange(s);
      const torch::Tensor k_pos = mask.k_positions.defined() ? mask.k_positions : torch::arange(s);
      const auto [out, lse] = oracle_attention(in.q, in.k, in.v, mask.causal, q_pos, k_pos, scale);
      if (layout == "contiguous")  // the test means something: some rows are NaN, some are not
        EXPECT_TRUE(out.isnan().any().item<bool>() && !out.isnan().all().item<bool>()) << p.name;
      const AttnResult r = forward(in, mask, q_pos, k_pos, scale);
      const std::string where = what + ", " + p.name + ", " + layout + " D=" + std::to_string(d);
      CP_EXPECT_RESULT(all_close_or_nan(r.out, out, "out " + where, kDims));
      CP_EXPECT_RESULT(all_close_or_nan(r.lse, lse, "lse " + where, {"b", "h", "s"}));
    }
  }
}

// ── Task 1: the merge ─────────────────────────────────────────────────────────────────────────

CP_TEST(Lesson03, Task1_MergeOfTwoKeySplitsEqualsTheWhole) {
  const Case c{2, 4, 2, 37, 90, 32, false};
  const Inputs in = random_inputs(c, 5);
  const double scale = 1.0 / std::sqrt(32.0);
  const torch::Tensor q_pos = torch::arange(c.seq_q) + 60, k_pos = torch::arange(c.seq_k);
  for (bool causal : {false, true}) {
    const auto [out, lse] = oracle_attention(in.q, in.k, in.v, causal, q_pos, k_pos, scale);
    for (int64_t split : {0, 1, 45, 89, 90}) {  // 0 and 90: one side is empty
      auto part = [&](int64_t from, int64_t to) {
        return oracle_attention(in.q, in.k.narrow(2, from, to - from), in.v.narrow(2, from, to - from), causal, q_pos,
                                k_pos.narrow(0, from, to - from), scale);
      };
      auto [out_a, lse_a] = part(0, split);
      auto [out_b, lse_b] = part(split, c.seq_k);
      torch::Tensor out_acc = out_a.to(torch::kFloat), lse_acc = lse_a.to(torch::kFloat);
      merge_attention(out_acc, lse_acc, out_b.to(torch::kFloat), lse_b.to(torch::kFloat));
      const std::string what = "split at " + std::to_string(split) + (causal ? " causal" : "");
      CP_EXPECT_CLOSE(out_acc, out, "merged out, " + what, kDims);
      CP_EXPECT_CLOSE(lse_acc, lse, "merged lse, " + what);
    }
  }
}

CP_TEST(Lesson03, Task1_MergeIsMinusInfSafeOnEitherSide) {
  const torch::Tensor some_out = torch::randn({1, 1, 3, 4});
  const torch::Tensor some_lse = torch::tensor({0.5f, -INFINITY, 2.0f}).view({1, 1, 3});
  const torch::Tensor none_out = torch::zeros({1, 1, 3, 4});
  const torch::Tensor none_lse = torch::full({1, 1, 3}, -INFINITY);
  for (bool empty_first : {true, false}) {
    torch::Tensor out_acc = (empty_first ? none_out : some_out).clone();
    torch::Tensor lse_acc = (empty_first ? none_lse : some_lse).clone();
    merge_attention(out_acc, lse_acc, empty_first ? some_out : none_out, empty_first ? some_lse : none_lse);
    EXPECT_FALSE(out_acc.isnan().any().item<bool>());
    CP_EXPECT_CLOSE(lse_acc, some_lse, "lse after merging with an empty side");
    // Row 1 is empty on both sides: it stays (0, -inf); the others keep their values.
    const torch::Tensor expected = some_out.clone().index_put_({0, 0, 1}, 0.0f);
    CP_EXPECT_CLOSE(out_acc, expected, "out after merging with an empty side", kDims);
  }
}

CP_TEST(Lesson03, Task1_MergeWithLseBeyondTheExpRange) {
  // lse of ±100 and more, as scores of that size give: e^lse overflows float32 above 88.7 and is
  // 0 below -103.3, so the sides must be weighed by e^(lse - max), never by e^lse itself.
  const torch::Tensor out_a = torch::randn({1, 1, 3, 4}), out_b = torch::randn({1, 1, 3, 4});
  const torch::Tensor lse_a = torch::tensor({100.0f, -120.0f, 95.0f}).view({1, 1, 3});
  const torch::Tensor lse_b = torch::tensor({101.0f, -121.0f, 300.0f}).view({1, 1, 3});
  torch::Tensor out_acc = out_a.clone(), lse_acc = lse_a.clone();
  merge_attention(out_acc, lse_acc, out_b, lse_b);
  // The merge in float64: lse = log(e^lse_a + e^lse_b), out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b.
  const torch::Tensor a = lse_a.to(torch::kDouble), b = lse_b.to(torch::kDouble);
  const torch::Tensor lse = torch::logsumexp(torch::stack({a, b}), 0);
  const torch::Tensor out = torch::exp(a - lse).unsqueeze(-1) * out_a.to(torch::kDouble) +
                            torch::exp(b - lse).unsqueeze(-1) * out_b.to(torch::kDouble);
  CP_EXPECT_CLOSE(out_acc, out, "out after merging sides with lse of ±100 and 300", kDims);
  CP_EXPECT_CLOSE(lse_acc, lse, "lse after merging sides with lse of ±100 and 300", {"b", "h", "s"});
}

CP_TEST(Lesson03, Task1_MergePropagatesNanAndInf) {
  // Key splits of inputs with a NaN or an inf: the merge of the two sides' results must give the
  // whole's, NaN and +inf included (a side with lse = NaN or +inf is never an empty side).
  const Case c{1, 2, 1, 12, 40, 32, false};
  const Inputs clean = random_inputs(c, 8);
  const double scale = 1.0 / std::sqrt(32.0);
  const torch::Tensor q_pos = torch::arange(c.seq_q) + 20, k_pos = torch::arange(c.seq_k);
  for (const Poison& p : poisons(c.seq_q, c.seq_k)) {
    const Inputs in = poisoned(clean, p);
    for (bool causal : {false, true}) {
      const auto [out, lse] = oracle_attention(in.q, in.k, in.v, causal, q_pos, k_pos, scale);
      for (int64_t split : {0, 10, 21, 40}) {
        auto part = [&](int64_t from, int64_t to) {
          return oracle_attention(in.q, in.k.narrow(2, from, to - from), in.v.narrow(2, from, to - from), causal,
                                  q_pos, k_pos.narrow(0, from, to - from), scale);
        };
        auto [out_a, lse_a] = part(0, split);
        auto [out_b, lse_b] = part(split, c.seq_k);
        for (bool swap : {false, true}) {
          torch::Tensor out_acc = (swap ? out_b : out_a).to(torch::kFloat), lse_acc = (swap ? lse_b : lse_a).to(torch::kFloat);
          merge_attention(out_acc, lse_acc, (swap ? out_a : out_b).to(torch::kFloat), (swap ? lse_a : lse_b).to(torch::kFloat));
          const std::string what = p.name + ", split at " + std::to_string(split) + (causal ? " causal" : "") +
                                   (swap ? ", sides swapped" : "");
          CP_EXPECT_RESULT(all_close_or_nan(out_acc, out, "merged out, " + what, kDims));
          CP_EXPECT_RESULT(all_close_or_nan(lse_acc, lse, "merged lse, " + what, {"b", "h", "s"}));
        }
      }
    }
  }
}

CP_TEST(Lesson03, Task1_MergeRejectsWrongShapesAndDtypes) {
  torch::Tensor out = torch::zeros({1, 2, 3, 4}), lse = torch::zeros({1, 2, 3});
  merge_attention(out, lse, out.clone(), lse.clone());  // counts once implemented
  expect_error([&] { torch::Tensor o = out.to(torch::kDouble); merge_attention(o, lse, out, lse); }, "out_acc: the accumulator must be float32");
  expect_error([&] { torch::Tensor l = torch::zeros({1, 2, 4}); merge_attention(out, l, out, lse); }, "lse_acc: shape must be");
  expect_error([&] { merge_attention(out, lse, torch::zeros({1, 2, 3, 5}), lse); }, "out_blk: shape must be");
  expect_error([&] { merge_attention(out, lse, out, lse.to(torch::kDouble)); }, "lse_blk: must be float32");
}

// ── Task 2: the CPU forward ───────────────────────────────────────────────────────────────────

CP_TEST(Lesson03, Task2_ForwardMatchesTorch) {
  uint64_t seed = 10;
  for (const Case& c : kCases) check_forward(c, {c.causal, {}, {}}, torch::kCPU, torch::kFloat, seed++, "cpu");
  check_forward({1, 3, 1, 45, 50, 24, true}, causal_mask(true), torch::kCPU, torch::kDouble, 3, "cpu");
}

CP_TEST(Lesson03, Task2_CausalMaskFromGlobalPositions) {
  const int64_t s = 75;
  for (const auto& [name, mask] : position_layouts(s))
    check_forward({1, 2, 1, s, s, 32, true}, mask, torch::kCPU, torch::kFloat, 21, name);
}

CP_TEST(Lesson03, Task2_WindowsAndDocumentsFromGlobalPositions) {
  const int64_t s = 75;
  for (const auto& [name, mask] : window_and_document_masks(s))
    for (int64_t d : {32, 64})
      check_forward({1, 2, 1, s, s, d, mask.causal}, mask, torch::kCPU, torch::kFloat, 23, name);
}

CP_TEST(Lesson03, Task2_WindowAsLongAsTheSequenceIsExactlyCausal) {
  const Case c{1, 2, 1, 70, 70, 32, true};
  const Inputs in = random_inputs(c, 9);
  AttentionMask window = causal_mask(true);
  window.window = c.seq_k;  // the oldest key is 69 behind the newest query: inside a window of 70
  const AttnResult causal = attention_block_forward(in.q, in.k, in.v, causal_mask(true));
  const AttnResult windowed = attention_block_forward(in.q, in.k, in.v, window);
  EXPECT_TRUE(torch::equal(causal.out, windowed.out) && torch::equal(causal.lse, windowed.lse))
      << "a window of S keys must be the causal mask, bit for bit";
}

CP_TEST(Lesson03, Task2_TilesTheMaskHidesAreSkipped) {
  // S = 256: 8 × 8 tiles of 32 × 32 per head, 2 heads. Causal: the 36 tiles on or below the
  // diagonal. A window of 32 keys: the diagonal and the tile before it (8 + 7). Four documents of
  // 64 tokens: 3 tiles per document.
  const Case c{1, 2, 1, 256, 256, 32, true};
  const Inputs in = random_inputs(c, 14);
  AttentionMask window = causal_mask(true), documents = causal_mask(true);
  window.window = 32;
  documents.documents = torch::tensor(std::vector<int64_t>{0, 64, 128, 192, 256});
  for (const auto& [name, mask, computed] : {std::tuple{"causal", causal_mask(true), 36}, std::tuple{"window 32", window, 15},
                                              std::tuple{"4 documents of 64", documents, 12}}) {
    const AttnResult r = attention_block_forward(in.q, in.k, in.v, mask);
    EXPECT_EQ(r.tiles_computed, 2 * computed) << name;
    EXPECT_EQ(r.tiles_skipped, 2 * (64 - computed)) << name;
  }
}

CP_TEST(Lesson03, Task2_FullyMaskedRowsGiveZeroAndMinusInf) {
  const Case c{1, 2, 2, 40, 40, 32, true};
  const Inputs in = random_inputs(c, 8);
  // Queries 0..39 at positions 0..39, keys at 20..59: queries 0..19 see nothing.
  const AttnResult r = attention_block_forward(in.q, in.k, in.v, {true, torch::arange(40), torch::arange(40) + 20});
  EXPECT_FALSE(r.out.isnan().any().item<bool>());
  EXPECT_TRUE(torch::equal(r.out.narrow(2, 0, 20), torch::zeros({1, 2, 20, 32})));
  EXPECT_TRUE((r.lse.narrow(2, 0, 20) == -INFINITY).all().item<bool>());
  EXPECT_TRUE((r.lse.narrow(2, 20, 20) > -INFINITY).all().item<bool>());
}

CP_TEST(Lesson03, Task2_NanAndInfInputsFollowTheDefinition) {
  // 40 keys: two tiles; a NaN is never taken for a masked key, a hidden key never reaches a row.
  check_non_finite_with(forward_on(torch::kCPU), 40, 16, "cpu");
}

CP_TEST(Lesson03, Task2_CpuForwardAtEverySimdLevel) {
  // The loop is compiled for each vector width (4, 8, 16 floats): each copy must hold the same
  // rules. Last query tiles of 1, 4, 6 and 11 rows (groups of four or eight cut short), D = 32 to
  // 128, a causal diagonal, rows with no visible key, and the NaN and inf cases on 43 rows.
  testing::for_each_simd_level([](const std::string& at) {
    uint64_t seed = 60;
    for (const Case& c : std::vector<Case>{{2, 4, 2, 33, 65, 64, false}, {1, 6, 3, 129, 127, 128, false},
                                           {2, 2, 2, 70, 70, 128, true}, {1, 8, 1, 100, 257, 32, true}})
      check_forward(c, {c.causal, {}, {}}, torch::kCPU, torch::kFloat, seed++, "cpu" + at);
    check_forward({1, 2, 2, 40, 40, 32, true}, {true, torch::arange(40), torch::arange(40) + 20}, torch::kCPU,
                  torch::kFloat, seed++, "rows 0-19 see no key" + at);
    check_non_finite_with(forward_on(torch::kCPU), 43, 16, "cpu" + at);
  });
}

CP_TEST(Lesson03, Task2_EmptyShapes) {
  for (const Case& c : kEmptyCases) check_forward(c, {c.causal, {}, {}}, torch::kCPU, torch::kFloat, 5, "cpu, empty");
}

CP_TEST(Lesson03, Task2_SplitKEquivalenceInAnyOrder) {
  // Attention over all keys equals the merge of attention over any partition of the keys, in
  // any order: the property every ring step relies on.
  const Case c{1, 4, 2, 50, 160, 64, true};
  const Inputs in = random_inputs(c, 12);
  const torch::Tensor q_pos = torch::arange(c.seq_q) + 100, k_pos = torch::arange(c.seq_k);
  const AttnResult whole = attention_block_forward(in.q, in.k, in.v, {true, q_pos, k_pos});
  std::mt19937 gen(3);
  for (int trial = 0; trial < 4; ++trial) {
    std::vector<int64_t> cuts = {0, c.seq_k};
    for (int i = 0; i < 3; ++i) cuts.push_back(std::uniform_int_distribution<int64_t>(0, c.seq_k)(gen));
    std::sort(cuts.begin(), cuts.end());
    std::vector<size_t> order(cuts.size() - 1);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), gen);
    torch::Tensor out_acc = torch::zeros({1, 4, c.seq_q, 64}), lse_acc = torch::full({1, 4, c.seq_q}, -INFINITY);
    for (size_t piece : order) {
      const int64_t from = cuts[piece], len = cuts[piece + 1] - cuts[piece];
      const AttnResult part = attention_block_forward(in.q, in.k.narrow(2, from, len), in.v.narrow(2, from, len),
                                                      {true, q_pos, k_pos.narrow(0, from, len)});
      merge_attention(out_acc, lse_acc, part.out, part.lse);
    }
    CP_EXPECT_CLOSE(out_acc, whole.out, "merged out, trial " + std::to_string(trial), kDims);
    CP_EXPECT_CLOSE(lse_acc, whole.lse, "merged lse, trial " + std::to_string(trial));
  }
}

CP_TEST(Lesson03, Task2_BadInputGivesClearErrors) {
  const torch::Tensor q = torch::zeros({1, 4, 8, 32}), kv = torch::zeros({1, 2, 8, 32});
  attention_block_forward(q, kv, kv);  // counts once implemented
  expect_error([&] { attention_block_forward(q, torch::zeros({1, 3, 8, 32}), torch::zeros({1, 3, 8, 32})); },
               "H_q (4) must be divisible by H_kv (3)");
  expect_error([&] { attention_block_forward(q.view({4, 8, 32}), kv, kv); }, "q: expected at least 4 dimension(s)");
  expect_error([&] { attention_block_forward(q, kv, torch::zeros({1, 2, 9, 32})); }, "v: shape must be k's");
  expect_error([&] { attention_block_forward(q, kv.to(torch::kDouble), kv.to(torch::kDouble)); }, "k, v: dtype must be q's");
  expect_error([&] { attention_block_forward(q, torch::zeros({1, 2, 8, 16}), torch::zeros({1, 2, 8, 16})); },
               "k: head dim 16 differs from q's 32");
  expect_error([&] { attention_block_forward(q, kv, kv, {true, torch::arange(7), {}}); },
               "mask.q_positions: expected an int64 tensor of shape [8]");
  AttentionMask int32_keys = causal_mask(true);
  int32_keys.k_positions = torch::arange(8).to(torch::kInt);
  expect_error([&] { attention_block_forward(q, kv, kv, int32_keys); }, "mask.k_positions: expected an int64 tensor");
  // Lesson 12's masks: a window needs causal and at least one key; documents are cu_seqlens.
  auto with = [](bool causal, int64_t window, const torch::Tensor& documents) {
    AttentionMask m = causal_mask(causal);
    m.window = window;
    m.documents = documents;
    return m;
  };
  expect_error([&] { attention_block_forward(q, kv, kv, with(true, -1, {})); }, "mask.window: must be at least 1");
  expect_error([&] { attention_block_forward(q, kv, kv, with(false, 4, {})); }, "mask.window: a sliding window (4) needs causal");
  expect_error([&] { attention_block_forward(q, kv, kv, with(true, 0, torch::tensor(std::vector<int64_t>{2, 8}))); },
               "mask.documents: must start at 0");
  expect_error([&] { attention_block_forward(q, kv, kv, with(true, 0, torch::tensor(std::vector<int64_t>{0, 6, 3, 8}))); },
               "mask.documents: must be non-decreasing");
  expect_error([&] { attention_block_forward(q, kv, kv, with(true, 0, torch::tensor({0, 8}).to(torch::kInt))); },
               "mask.documents: expected cu_seqlens, an int64 tensor");
  expect_error([&] { attention_block_forward(q, kv, kv, with(true, 0, torch::tensor(std::vector<int64_t>{0}))); },
               "mask.documents: expected cu_seqlens");
  AttentionMask negative = with(true, 0, torch::tensor(std::vector<int64_t>{0, 8}));
  negative.q_positions = torch::arange(8) - 1;
  expect_error([&] { attention_block_forward(q, kv, kv, negative); }, "mask.q_positions: a negative position");
}

// ── Task 3: the CUDA kernel through attention_block_forward() on CUDA tensors (GPU + CUDA LibTorch) ──

CP_TEST(Lesson03Cuda, Task3_ForwardMatchesTorchForEveryDtypeAndHeadDim) {
  CP_REQUIRE_GPU();
  uint64_t seed = 40;
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16})
    for (const Case& c : kCases) check_forward(c, {c.causal, {}, {}}, torch::kCUDA, dtype, seed++, "cuda");
}

CP_TEST(Lesson03Cuda, Task3_CausalMaskFromGlobalPositions) {
  CP_REQUIRE_GPU();
  const int64_t s = 150;
  for (const auto& [name, mask] : position_layouts(s))
    for (int64_t d : {32, 128}) check_forward({1, 4, 2, s, s, d, true}, mask, torch::kCUDA, torch::kFloat, 22, name);
}

CP_TEST(Lesson03Cuda, Task3_EmptyShapesOnCuda) {
  CP_REQUIRE_GPU();
  for (const Case& c : kEmptyCases) check_forward(c, {c.causal, {}, {}}, torch::kCUDA, torch::kFloat, 5, "cuda, empty");
}

CP_TEST(Lesson03Cuda, Task3_SplitKMergeOnCudaAndUnsupportedHeadDim) {
  CP_REQUIRE_GPU();
  const Case c{2, 4, 4, 70, 130, 64, true};
  const Inputs in = random_inputs(c, 30);
  const torch::Tensor q = in.q.cuda(), k = in.k.cuda(), v = in.v.cuda();
  const AttnResult whole = attention_block_forward(q, k, v, causal_mask(true));
  const torch::Tensor q_pos = torch::arange(c.seq_q, torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA));
  torch::Tensor out_acc = torch::zeros({2, 4, 70, 64}, torch::kCUDA), lse_acc = torch::full({2, 4, 70}, -INFINITY, torch::kCUDA);
  for (int64_t from : {64, 0}) {  // the later half first
    const int64_t len = from == 0 ? 64 : c.seq_k - 64;
    const AttnResult part = attention_block_forward(q, k.narrow(2, from, len), v.narrow(2, from, len),
                                                    {true, q_pos, torch::arange(from, from + len, q_pos.options())});
    merge_attention(out_acc, lse_acc, part.out, part.lse);
  }
  CP_EXPECT_CLOSE(out_acc, whole.out.cpu(), "merged out on cuda", kDims);
  CP_EXPECT_CLOSE(lse_acc, whole.lse.cpu(), "merged lse on cuda");
  try {
    attention_block_forward(torch::zeros({1, 1, 4, 48}, torch::kCUDA), torch::zeros({1, 1, 4, 48}, torch::kCUDA),
                            torch::zeros({1, 1, 4, 48}, torch::kCUDA));
    ADD_FAILURE() << "D = 48 must be rejected on CUDA";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head dim 48 is not supported by the CUDA kernel"), std::string::npos) << e.what();
  }
}

// ── Task 3: the CUDA kernel on device buffers (a GPU, or CUDA on the CPU) ─────────────────────
//
// launch_block_attention_forward is called directly on cudaMalloc'd copies of the inputs: no
// LibTorch CUDA is needed, so these run on a GPU and, without one, on the CPU (chipStar + PoCL).

#if CP_WITH_CUDA

AttnResult forward_kernel(const Inputs& in, const AttentionMask& mask, const torch::Tensor& q_pos,
                          const torch::Tensor& k_pos, double scale) {
  const VisibleKeys keys = visible_keys(mask, q_pos);
  const BlockAttentionParams p{in.q.size(0), in.q.size(1), in.k.size(1), in.q.size(2), in.k.size(2), in.q.size(3),
                               static_cast<float>(scale), keys.masked};
  CudaStream stream;
  DeviceBuffer q(in.q), k(in.k), v(in.v), k_pos_dev(k_pos);
  DeviceBuffer first(keys.masked ? keys.first : q_pos), last(keys.masked ? keys.last : q_pos);  // unread unless masked
  DeviceBuffer out(in.q.sizes().vec(), in.q.scalar_type()), lse({p.batch, p.heads_q, p.seq_q}, torch::kFloat);
  launch_block_attention_forward(q.get(), k.get(), v.get(), out.get(), lse.as<float>(), first.as<int64_t>(),
                                 last.as<int64_t>(), k_pos_dev.as<int64_t>(), p, kernel_dtype(in.q, "q"), stream.get());
  return {out.to_host(stream.get()), lse.to_host(stream.get())};
}

CP_TEST(Lesson03Kernels, Task3_KernelMatchesTorchForEveryDtypeHeadDimAndGroup) {
  CP_REQUIRE_CUDA_RUNTIME();
  std::vector<Case> cases = kCases;             // Hq/Hkv = 1, 2 and 8; D = 32, 64, 128
  cases.push_back({2, 8, 2, 50, 77, 64, true});  // Hq/Hkv = 4
  uint64_t seed = 40;
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16})
    for (const Case& c : cases) check_forward_with(forward_kernel, c, {c.causal, {}, {}}, dtype, seed++, "kernel");
}

CP_TEST(Lesson03Kernels, Task3_KernelCausalMaskFromGlobalPositions) {
  CP_REQUIRE_CUDA_RUNTIME();
  const int64_t s = 150;  // more than two 64-row blocks and four 32-key tiles, a multiple of neither
  for (const auto& [name, mask] : position_layouts(s))
    for (int64_t d : {32, 64, 128})
      check_forward_with(forward_kernel, {1, 4, 2, s, s, d, true}, mask, d == 64 ? torch::kBFloat16 : torch::kFloat,
                         22, "kernel, " + name);
}

CP_TEST(Lesson03Kernels, Task3_KernelWindowsAndDocumentsForEveryDtypeAndHeadDim) {
  CP_REQUIRE_CUDA_RUNTIME();
  const int64_t s = 150;  // tiles and blocks cut through windows and documents
  for (const auto& [name, mask] : window_and_document_masks(s))
    for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16})
      for (int64_t d : {32, 64, 128})
        check_forward_with(forward_kernel, {1, 4, 2, s, s, d, mask.causal}, mask, dtype, 24, "kernel, " + name);
}

CP_TEST(Lesson03Kernels, Task3_KernelEmptyShapes) {
  CP_REQUIRE_CUDA_RUNTIME();
  for (const Case& c : kEmptyCases) check_forward_with(forward_kernel, c, {c.causal, {}, {}}, torch::kFloat, 5, "kernel, empty");
}

CP_TEST(Lesson03Kernels, Task3_KernelRejectsAnUnsupportedHeadDim) {
  CP_REQUIRE_CUDA_RUNTIME();
  const Case c{1, 1, 1, 4, 4, 48, false};
  check_forward_with(forward_kernel, {1, 1, 1, 4, 4, 32, false}, {}, torch::kFloat, 1, "kernel");  // counts once implemented
  expect_error([&] { forward_kernel(random_inputs(c, 1), {}, torch::arange(4), torch::arange(4), 1.0); },
               "unsupported head dim 48");
}
CP_TEST(Lesson03Kernels, Task3_KernelNanAndInfInputsFollowTheDefinition) {
  CP_REQUIRE_CUDA_RUNTIME();
  check_non_finite_with(forward_kernel, 70, 32, "kernel");  // two 64-row blocks, three 32-key tiles
}
#else
CP_KERNEL_TESTS_NEED_CUDA(Lesson03Kernels)
#endif

}  // namespace
}  // namespace cp
