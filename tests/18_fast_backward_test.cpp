// Lesson 18 — the backward on the matrix units against float64 gradients: task 1's P and dS on a
// tile in both layouts through a probe kernel; the key kernel's dK, dV (task 2) and the query
// kernel's dQ (task 3) on device buffers (a GPU, or CUDA on the CPU) over lesson 16's shapes
// (float16 and bfloat16, D = 64 and 128, GQA and MQA, lengths that are not multiples of the
// tiles), the rings' causal layouts, windows and documents, rows whose scores lie far from 0
// with a scale of the caller's; and on CUDA tensors, the switch under lesson 04/05's ring.
#include <torch/types.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "attention_kernel_suite.h"
#include "common/error.h"
#include "common/tolerance.h"
#include "common/world.h"
#include "fast_backward.h"
#include "ring_attention_backward.h"
#include "testing/device_buffer.h"
#include "testing/harness.h"
#include "testing/oracle.h"

#if CP_WITH_CUDA
#include "18_fast_backward_probes.cuh"
#include "fast_backward.cuh"
#endif

namespace cp {
namespace {

using testing::KernelCase;
using testing::KernelInputs;
using testing::OracleMask;

const std::vector<std::string> kDims = {"b", "h", "s", "d"};

/// Everything a backward needs, in float64 on the CPU: the inputs (rounded to the dtype under
/// test), the forward's out and lse, Δ, the three gradients, and the sums the tolerance model
/// needs (matrix_unit_gradient_tolerance).
struct BackwardCase {
  KernelInputs in;
  torch::Tensor dout, out, lse, delta, dq, dk, dv;
  double p_sum_per_key, ds_sum_per_key, ds_sum_per_row, scale;
};

BackwardCase backward_case(const KernelCase& c, torch::ScalarType dtype, uint64_t seed, OracleMask mask,
                           double scale, KernelInputs in) {
  if (!mask.q_pos.defined()) mask.q_pos = torch::arange(c.seq_q);
  if (!mask.k_pos.defined()) mask.k_pos = torch::arange(c.seq_k);
  BackwardCase b;
  b.in = in;
  b.scale = scale;
  b.dout = testing::random_with_outliers({c.batch, c.heads_q, c.seq_q, c.head_dim}, seed * 7 + 5, 1.0, 0.0).to(dtype);
  const torch::Tensor q = in.q.to(torch::kDouble), k = in.k.to(torch::kDouble), v = in.v.to(torch::kDouble);
  const torch::Tensor dout = b.dout.to(torch::kDouble);
  std::tie(b.out, b.lse) = testing::oracle_attention(q, k, v, mask, scale);
  b.delta = (dout * b.out).sum(-1);
  std::tie(b.dq, b.dk, b.dv) = testing::oracle_attention_grads(q, k, v, dout, mask, scale);
  // P and dS in float64, each query head against its K/V head, for the rounding model.
  const int64_t group = c.heads_q / c.heads_kv;
  const torch::Tensor ke = k.repeat_interleave(group, 1), ve = v.repeat_interleave(group, 1);
  const torch::Tensor visible = testing::oracle_visible(mask).to(torch::kDouble);
  const torch::Tensor lse = b.lse.unsqueeze(-1).clamp_min(-1e300);  // rows that see nothing: P = 0 below
  const torch::Tensor p = torch::exp(torch::matmul(q, ke.transpose(2, 3)) * scale - lse).nan_to_num(0.0) * visible;
  const torch::Tensor ds = p * (torch::matmul(dout, ve.transpose(2, 3)) - b.delta.unsqueeze(-1));
  auto per_kv_head = [&](const torch::Tensor& t) {  // [B, Hq, Sq, Sk] -> summed over rows and the group
    return t.abs().sum(2).view({c.batch, c.heads_kv, group, c.seq_k}).sum(2);
  };
  auto largest = [](const torch::Tensor& t) { return t.numel() ? t.max().item<double>() : 0.0; };
  b.p_sum_per_key = largest(per_kv_head(p));
  b.ds_sum_per_key = largest(per_kv_head(ds));
  b.ds_sum_per_row = largest(ds.abs().sum(3));
  return b;
}

double largest_abs(const torch::Tensor& t) { return t.numel() ? t.abs().max().item<double>() : 0.0; }

#if CP_WITH_CUDA

// ── Task 1: P and dS of a tile, in either layout ─────────────────────────────────────────────

CP_TEST(Lesson18Kernels, Task1_TileGradientsInBothLayouts) {
  CP_REQUIRE_CUDA_RUNTIME();
  // 64 query rows against 64 keys: scores far from 0, a different lse and Δ in every row, 50 keys
  // that exist, rows that see a causal range, rows 60-63 past Sq (nothing), and NaN scores on
  // every hidden pair (they must come out 0, and never NaN).
  const torch::Tensor s = testing::random_with_outliers({64, 64}, 181, 1.0, 0.0) * 20;
  const torch::Tensor dp = testing::random_with_outliers({64, 64}, 182, 1.0, 0.0);
  const torch::Tensor lse = torch::linspace(-3, 12, 64, torch::kFloat);
  const torch::Tensor delta = torch::linspace(-1, 1, 64, torch::kFloat);
  const torch::Tensor key_pos = torch::arange(64, torch::kLong) * 2;  // positions 0, 2, …, 126
  torch::Tensor first = torch::zeros({64}, torch::kLong), last = torch::arange(64, torch::kLong) * 2 + 1;
  first.narrow(0, 60, 4).fill_(INT64_MAX);
  last.narrow(0, 60, 4).fill_(INT64_MIN);
  const int n_keys = 50;
  const float scale = 0.3f;
  torch::Tensor visible = torch::zeros({64, 64}, torch::kBool);  // [query row][key]
  for (int64_t i = 0; i < 64; ++i)
    for (int64_t j = 0; j < n_keys; ++j)
      visible[i][j] = first[i].item<int64_t>() <= key_pos[j].item<int64_t>() &&
                      key_pos[j].item<int64_t>() <= last[i].item<int64_t>();
  const torch::Tensor s_in = torch::where(visible, s, torch::full({}, NAN));
  const torch::Tensor p_expected = torch::where(
      visible, torch::exp(s_in.to(torch::kDouble) * scale - lse.to(torch::kDouble).unsqueeze(1)), torch::zeros({}, torch::kDouble));
  const torch::Tensor ds_expected = p_expected * (dp.to(torch::kDouble) - delta.to(torch::kDouble).unsqueeze(1));
  for (bool key_rows : {false, true}) {
    auto layout = [&](const torch::Tensor& t) { return (key_rows ? t.t() : t).contiguous(); };
    CudaStream stream;
    DeviceBuffer s_dev(layout(s_in)), dp_dev(layout(dp)), lse_dev(lse), delta_dev(delta), first_dev(first),
        last_dev(last), pos_dev(key_pos), p_out({64, 64}, torch::kFloat), ds_out({64, 64}, torch::kFloat);
    testing::launch_lesson18_task1_probe({s_dev.as<float>(), dp_dev.as<float>(), lse_dev.as<float>(),
                                          delta_dev.as<float>(), first_dev.as<int64_t>(), last_dev.as<int64_t>(),
                                          pos_dev.as<int64_t>(), n_keys, scale, key_rows, p_out.as<float>(),
                                          ds_out.as<float>()},
                                         stream.get());
    const std::string what = key_rows ? "rows are keys (Sᵀ, dPᵀ)" : "rows are query rows (S, dP)";
    const std::vector<std::string> dims = key_rows ? std::vector<std::string>{"key", "row"}
                                                   : std::vector<std::string>{"row", "key"};
    CP_EXPECT_CLOSE(p_out.to_host(stream.get()), layout(p_expected), "P, " + what, dims, tolerance_for(torch::kFloat));
    CP_EXPECT_CLOSE(ds_out.to_host(stream.get()), layout(ds_expected), "dS, " + what, dims,
                    tolerance_for(torch::kFloat));
  }
}

// ── Tasks 2 and 3: the two kernels against float64 gradients ─────────────────────────────────

enum class Half { kKeys, kQueries };

/// One half of the backward on device copies of `b`, against the oracle's gradients.
void expect_half_matches_oracle(Half half, const BackwardCase& b, const OracleMask& mask_in, const std::string& what) {
  OracleMask mask = mask_in;
  if (!mask.q_pos.defined()) mask.q_pos = torch::arange(b.in.q.size(2));
  if (!mask.k_pos.defined()) mask.k_pos = torch::arange(b.in.k.size(2));
  AttentionMask am;
  am.causal = mask.causal;
  am.q_positions = mask.q_pos;
  am.k_positions = mask.k_pos;
  am.window = mask.window;
  am.documents = mask.documents;
  const VisibleKeys keys = visible_keys(am, mask.q_pos);
  const torch::Tensor& q = b.in.q;
  const BlockAttentionParams p{q.size(0), q.size(1), b.in.k.size(1), q.size(2), b.in.k.size(2), q.size(3),
                               static_cast<float>(b.scale), keys.masked};
  CudaStream stream;
  DeviceBuffer q_dev(q), k_dev(b.in.k), v_dev(b.in.v), dout_dev(b.dout), lse(b.lse.to(torch::kFloat)),
      delta(b.delta.to(torch::kFloat)), k_pos(mask.k_pos);
  DeviceBuffer first(keys.masked ? keys.first : mask.q_pos), last(keys.masked ? keys.last : mask.q_pos);
  const torch::ScalarType dtype = q.scalar_type();
  if (half == Half::kKeys) {
    DeviceBuffer dk(b.in.k.sizes().vec(), torch::kFloat), dv(b.in.k.sizes().vec(), torch::kFloat);
    launch_fast_backward_keys(q_dev.get(), k_dev.get(), v_dev.get(), dout_dev.get(), lse.as<float>(),
                              delta.as<float>(), first.as<int64_t>(), last.as<int64_t>(), k_pos.as<int64_t>(),
                              dk.as<float>(), dv.as<float>(), p, kernel_dtype(q, "q"), stream.get());
    CP_EXPECT_CLOSE(dv.to_host(stream.get()), b.dv, "dV, " + what, kDims,
                    matrix_unit_gradient_tolerance(dtype, b.dv, b.p_sum_per_key, largest_abs(b.dout)));
    CP_EXPECT_CLOSE(dk.to_host(stream.get()), b.dk, "dK, " + what, kDims,
                    matrix_unit_gradient_tolerance(dtype, b.dk, b.ds_sum_per_key, b.scale * largest_abs(q)));
  } else {
    DeviceBuffer dq(q.sizes().vec(), torch::kFloat);
    launch_fast_backward_queries(q_dev.get(), k_dev.get(), v_dev.get(), dout_dev.get(), lse.as<float>(),
                                 delta.as<float>(), first.as<int64_t>(), last.as<int64_t>(), k_pos.as<int64_t>(),
                                 dq.as<float>(), p, kernel_dtype(q, "q"), stream.get());
    CP_EXPECT_CLOSE(dq.to_host(stream.get()), b.dq, "dQ, " + what, kDims,
                    matrix_unit_gradient_tolerance(dtype, b.dq, b.ds_sum_per_row, b.scale * largest_abs(b.in.k)));
  }
}

/// Lesson 16's suite, for one half: shapes, dtypes and head dims (GQA 2 and 4, MQA); the rings'
/// layouts; windows and documents; rows far from 0 with a scale of the caller's.
void expect_half_passes_the_suite(Half half) {
  const std::string who = half == Half::kKeys ? "key kernel" : "query kernel";
  const std::vector<KernelCase> cases = {
      {1, 1, 1, 1, 1, 64}, {2, 4, 2, 70, 130, 64}, {1, 8, 1, 64, 64, 128}, {1, 4, 4, 17, 200, 128},
      {1, 8, 2, 100, 90, 128}};  // the last: GQA 4:1, each K/V head's gradients summed over 4 query heads
  uint64_t seed = 180;
  for (auto dtype : {torch::kHalf, torch::kBFloat16})
    for (const KernelCase& c : cases)
      for (bool causal : {false, true}) {
        const OracleMask mask{causal, {}, {}};
        const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
        expect_half_matches_oracle(half, backward_case(c, dtype, seed, mask, scale,
                                                       testing::random_kernel_inputs(c, dtype, seed)),
                                   mask, who + (causal ? ", causal" : ", full"));
        ++seed;
      }
  const int64_t s = 150;
  for (const testing::PositionLayout& layout : testing::causal_position_layouts(s)) {
    const KernelCase c{1, 4, 2, s, s, 64};
    const OracleMask mask{true, layout.q_pos, layout.k_pos};
    expect_half_matches_oracle(half, backward_case(c, torch::kBFloat16, 190, mask, 0.125,
                                                   testing::random_kernel_inputs(c, torch::kBFloat16, 190)),
                               mask, who + ", " + layout.name);
  }
  for (const auto& [name, mask] : testing::window_and_document_masks(s)) {
    const KernelCase c{1, 4, 2, s, s, 64};
    expect_half_matches_oracle(half, backward_case(c, torch::kHalf, 191, mask, 0.125,
                                                   testing::random_kernel_inputs(c, torch::kHalf, 191)),
                               mask, who + ", " + name);
  }
  // Rows whose scores lie near −112 and +112, and whose maxima rise from tile to tile (lesson
  // 16's suite), scale 0.2: a P not taken from the row's lse overflows or underflows.
  const KernelCase c = testing::kFarFromZeroCase;
  const KernelInputs in = testing::inputs_far_from_zero(torch::kHalf, 192);
  for (bool causal : {false, true}) {
    const OracleMask mask{causal, {}, {}};
    expect_half_matches_oracle(half, backward_case(c, torch::kHalf, 192, mask, 0.2, in), mask,
                               who + (causal ? ", causal" : ", full") + ", scores far from 0, scale 0.2");
  }
}

CP_TEST(Lesson18Kernels, Task2_KeyKernelMatchesTheOracle) {
  CP_REQUIRE_CUDA_RUNTIME();
  expect_half_passes_the_suite(Half::kKeys);
}

CP_TEST(Lesson18Kernels, Task3_QueryKernelMatchesTheOracle) {
  CP_REQUIRE_CUDA_RUNTIME();
  expect_half_passes_the_suite(Half::kQueries);
}

CP_TEST(Lesson18Kernels, Task3_BadInputGivesClearErrors) {
  CP_REQUIRE_CUDA_RUNTIME();
  const KernelCase ok{1, 1, 1, 4, 4, 64};
  const OracleMask none{false, {}, {}};
  expect_half_matches_oracle(Half::kQueries, backward_case(ok, torch::kHalf, 1, none, 0.125,
                                                           testing::random_kernel_inputs(ok, torch::kHalf, 1)),
                             none, "counts once implemented");
  auto run = [&](const KernelCase& c, torch::ScalarType dtype) {
    expect_half_matches_oracle(Half::kKeys, backward_case(c, dtype, 2, none, 0.125,
                                                          testing::random_kernel_inputs(c, dtype, 2)),
                               none, "bad input");
  };
  testing::expect_errors({
      {"float32", [&] { run(ok, torch::kFloat); }, "the matrix units take float16 or bfloat16, got float32"},
      {"head dim 32", [&] { run({1, 1, 1, 4, 4, 32}, torch::kHalf); }, "unsupported head dim 32"},
  });
}
#else
CP_KERNEL_TESTS_NEED_CUDA(Lesson18Kernels)
#endif

// ── The torch side ───────────────────────────────────────────────────────────────────────────

CP_TEST(Lesson18, TorchSideRefusesWhatItCannotRun) {
  const torch::Tensor q = torch::zeros({1, 1, 4, 64}, torch::kHalf), lse = torch::zeros({1, 1, 4});
  testing::expect_errors({
      {"CPU tensors", [&] { attention_backward_fast(q, q, q, q, q, lse); }, "the matrix units are a GPU's"},
      {"float32", [&] { attention_backward_fast(q, q.to(torch::kFloat), q, q, q, lse); }, "float16 or bfloat16"},
  });
}

/// use_matrix_units(true) for the scope; lessons 03 and 05's kernels again after it, even on a
/// failure.
struct MatrixUnitsInScope {
  MatrixUnitsInScope() { use_matrix_units(true); }
  ~MatrixUnitsInScope() { use_matrix_units(false); }
  MatrixUnitsInScope(const MatrixUnitsInScope&) = delete;
  MatrixUnitsInScope& operator=(const MatrixUnitsInScope&) = delete;
};

CP_TEST(Lesson18Cuda, BackwardOnCudaTensorsAndUnderTheRing) {
  CP_REQUIRE_GPU();
  const KernelCase c{1, 4, 2, 192, 192, 64};
  const double scale = 1.0 / std::sqrt(64.0);
  const OracleMask causal{true, {}, {}};
  const BackwardCase b = backward_case(c, torch::kBFloat16, 185, causal, scale,
                                       testing::random_kernel_inputs(c, torch::kBFloat16, 185));
  const torch::Tensor q = b.in.q.cuda(), k = b.in.k.cuda(), v = b.in.v.cuda(), dout = b.dout.cuda();
  const torch::Tensor out = b.out.to(torch::kBFloat16).cuda(), lse = b.lse.to(torch::kFloat).cuda();
  auto expect_grads = [&](const AttnGrads& g, const std::string& what) {
    CP_EXPECT_CLOSE(g.dq.cpu(), b.dq, "dQ, " + what, kDims,
                    matrix_unit_gradient_tolerance(torch::kBFloat16, b.dq, b.ds_sum_per_row, scale * largest_abs(b.in.k)));
    CP_EXPECT_CLOSE(g.dk.cpu(), b.dk, "dK, " + what, kDims,
                    matrix_unit_gradient_tolerance(torch::kBFloat16, b.dk, b.ds_sum_per_key, scale * largest_abs(b.in.q)));
    CP_EXPECT_CLOSE(g.dv.cpu(), b.dv, "dV, " + what, kDims,
                    matrix_unit_gradient_tolerance(torch::kBFloat16, b.dv, b.p_sum_per_key, largest_abs(b.dout)));
  };
  const AttnGrads direct = attention_backward_fast(dout, q, k, v, out, lse, causal_mask(true));
  expect_grads(direct, "attention_backward_fast");
  const MatrixUnitsInScope on;
  // The kernels are deterministic: the same bits say which one ran.
  const AttnGrads selected = attention_block_backward(dout, q, k, v, out, lse, causal_mask(true));
  EXPECT_TRUE(torch::equal(selected.dq, direct.dq) && torch::equal(selected.dk, direct.dk) &&
              torch::equal(selected.dv, direct.dv))
      << "attention_block_backward after use_matrix_units(true) is not this lesson's kernels";

  // Lesson 05's ring backward on 3 ranks sharing the GPU, each block's backward on this lesson's
  // kernels (and the forward's lse and out given, not recomputed); the gradients come back in bfloat16 (the inputs' dtype): the base tolerance's
  // relative part covers that rounding.
  run_local_world(3, [&](Comm& comm) {
    auto mine = [&](const torch::Tensor& t) { return t.narrow(2, comm.rank() * 64, 64); };
    const RingGrads g =
        ring_attention_backward(comm, mine(dout), mine(q), mine(k), mine(v), mine(out), mine(lse), ring_options(true));
    const std::string what = "ring backward, rank " + std::to_string(comm.rank()) + " of 3";
    CP_EXPECT_CLOSE(g.dq.cpu(), mine(b.dq), "dQ, " + what, kDims,
                    matrix_unit_gradient_tolerance(torch::kBFloat16, b.dq, b.ds_sum_per_row, scale * largest_abs(b.in.k)));
    CP_EXPECT_CLOSE(g.dk.cpu(), mine(b.dk), "dK, " + what, kDims,
                    matrix_unit_gradient_tolerance(torch::kBFloat16, b.dk, b.ds_sum_per_key, scale * largest_abs(b.in.q)));
    CP_EXPECT_CLOSE(g.dv.cpu(), mine(b.dv), "dV, " + what, kDims,
                    matrix_unit_gradient_tolerance(torch::kBFloat16, b.dv, b.p_sum_per_key, largest_abs(b.dout)));
  });
}

}  // namespace
}  // namespace cp
