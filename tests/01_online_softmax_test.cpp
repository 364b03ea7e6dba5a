// Lesson 01 — online softmax. Shared by the learner and the solution builds; the test names
// carry the task numbers of the lesson README.
#include <torch/cuda.h>
#include <torch/types.h>

#include <random>
#include <thread>

#include "common/error.h"
#include "common/tensor_checks.h"
#include "online_softmax.h"
#include "testing/device_buffer.h"
#include "testing/harness.h"
#include "testing/oracle.h"

#if CP_WITH_CUDA
#include "online_softmax.cuh"
#endif

namespace cp {
namespace {

using testing::all_close;
using testing::all_close_or_nan;
using testing::expect_error;
using testing::oracle_logsumexp;
using testing::oracle_softmax;
using testing::random_with_outliers;

/// Row lengths around the warp size and its multiples, never only multiples of 32.
const std::vector<int64_t> kLengths = {1, 2, 31, 33, 100, 257, 1000, 4097};

/// The state of a set computed directly from its definition, in double.
SoftmaxState direct_state(const std::vector<float>& xs) {
  double m = -INFINITY;
  for (float x : xs) m = std::max(m, static_cast<double>(x));
  if (m == -INFINITY) return SoftmaxState::empty();
  double l = 0;
  for (float x : xs) l += std::exp(x - m);
  return {static_cast<float>(m), static_cast<float>(l)};
}

SoftmaxState state_by_adding(const std::vector<float>& xs, size_t begin, size_t end) {
  SoftmaxState s = SoftmaxState::empty();
  for (size_t i = begin; i < end; ++i) s.add(xs[i]);
  return s;
}

void expect_same_state(SoftmaxState actual, SoftmaxState expected, const std::string& what) {
  EXPECT_EQ(actual.m, expected.m) << what;  // the max is exact: no arithmetic involved
  if (expected.l == 0.0f) {
    EXPECT_EQ(actual.l, 0.0f) << what;
  } else {
    EXPECT_NEAR(actual.l, expected.l, 1e-5 * expected.l) << what << " (m = " << expected.m << ")";
  }
}

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<float> xs(n);
  for (float& x : xs) x = normal(gen);
  if (n > 3) xs[n / 3] = 60.0f;  // a late, large maximum forces rescaling
  return xs;
}

/// Rows with NaN, +inf and -inf among finite values, n >= 40 columns: what each must give is
/// the float64 reference's answer (torch): NaN anywhere -> softmax and lse NaN; +inf (no NaN) ->
/// lse +inf and softmax NaN (inf/inf); -inf entries are masked; an all -inf row -> zeros, -inf.
torch::Tensor non_finite_rows(int64_t n, uint64_t seed) {
  torch::Tensor x = random_with_outliers({12, n}, seed, 3.0, 0.0);
  x[0][5] = NAN;                                          // one NaN
  x[1][n - 1] = NAN;                                      // NaN in the last lane's last value
  x[2][7] = INFINITY;                                     // one +inf
  x[3][1] = INFINITY, x[3][n - 2] = INFINITY;             // two +inf: inf - inf inside the sum
  x[4][3] = -INFINITY;                                    // a masked entry: the row stays finite
  x[5].fill_(-INFINITY), x[5][9] = NAN;                   // NaN among -inf only
  x[6].fill_(-INFINITY);                                  // nothing visible: zeros and -inf
  x[7][2] = -INFINITY, x[7][33 % n] = INFINITY;           // -inf and +inf
  x[8][4] = INFINITY, x[8][36] = NAN;                     // +inf and NaN: NaN wins
  x[9][0] = NAN, x[9][1] = INFINITY;                      // NaN before +inf
  x[10].fill_(NAN);                                       // NaN only
  // row 11: finite, the control
  return x;
}

// ── Task 1: the state ────────────────────────────────────────────────────────────────────────

CP_TEST(Lesson01, Task1_AddingValuesGivesTheDirectState) {
  for (size_t n : {1, 2, 5, 64, 1000}) {
    const std::vector<float> xs = random_values(n, 11 + n);
    expect_same_state(state_by_adding(xs, 0, n), direct_state(xs), "n = " + std::to_string(n));
  }
}

CP_TEST(Lesson01, Task1_MergeOfTwoHalvesGivesTheWholeState) {
  const std::vector<float> xs = random_values(300, 5);
  for (size_t split : {0, 1, 100, 299, 300}) {
    const SoftmaxState merged = merge(state_by_adding(xs, 0, split), state_by_adding(xs, split, xs.size()));
    expect_same_state(merged, direct_state(xs), "split at " + std::to_string(split));
  }
}

CP_TEST(Lesson01, Task1_MergeIsAssociativeOverRandomSplits) {
  // Cut the values into random pieces and merge the pieces' states in a random tree: every
  // order must give the state of the whole (up to float rounding of l).
  const std::vector<float> xs = random_values(500, 7);
  std::mt19937 gen(1234);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<size_t> cuts = {0, xs.size()};
    for (int c = 0; c < 6; ++c) cuts.push_back(std::uniform_int_distribution<size_t>(0, xs.size())(gen));
    std::sort(cuts.begin(), cuts.end());
    std::vector<SoftmaxState> pieces;
    for (size_t i = 0; i + 1 < cuts.size(); ++i) pieces.push_back(state_by_adding(xs, cuts[i], cuts[i + 1]));
    while (pieces.size() > 1) {  // merge two random neighbours until one state is left
      const size_t i = std::uniform_int_distribution<size_t>(0, pieces.size() - 2)(gen);
      pieces[i] = merge(pieces[i], pieces[i + 1]);
      pieces.erase(pieces.begin() + i + 1);
    }
    expect_same_state(pieces[0], direct_state(xs), "trial " + std::to_string(trial));
  }
}

CP_TEST(Lesson01, Task1_EmptyAndMinusInfinityStatesMergeWithoutNan) {
  const SoftmaxState empty = SoftmaxState::empty();
  SoftmaxState only_minus_inf = SoftmaxState::empty();
  only_minus_inf.add(-INFINITY);
  expect_same_state(only_minus_inf, empty, "adding -inf");
  expect_same_state(merge(empty, empty), empty, "empty + empty");
  SoftmaxState three = SoftmaxState::empty();
  three.add(3.0f);
  expect_same_state(merge(empty, three), three, "empty + {3}");
  expect_same_state(merge(three, empty), three, "{3} + empty");
  EXPECT_EQ(merge(empty, empty).logsumexp(), -INFINITY);
  EXPECT_FALSE(std::isnan(merge(empty, empty).l));
}

CP_TEST(Lesson01, Task1_NanAndPlusInfAreNeverDropped) {
  // Never a "masked" NaN: a NaN value makes the whole set NaN, in add() and in merge(), whatever
  // the order; +inf gives logsumexp +inf (torch.logsumexp's answer), NaN beats +inf.
  auto of = [](std::initializer_list<float> xs) {
    SoftmaxState s = SoftmaxState::empty();
    for (float x : xs) s.add(x);
    return s;
  };
  const SoftmaxState empty = SoftmaxState::empty(), nan = of({NAN}), three = of({3.0f}), inf = of({INFINITY});
  for (const auto& [state, name] : {std::pair{of({NAN}), "{NaN}"}, {of({1.0f, NAN, 2.0f}), "{1, NaN, 2}"},
                                    {of({5.0f, NAN}), "{5, NaN}"}, {of({NAN, 5.0f}), "{NaN, 5}"},
                                    {of({-INFINITY, NAN}), "{-inf, NaN}"}, {of({INFINITY, NAN}), "{+inf, NaN}"},
                                    {of({NAN, INFINITY}), "{NaN, +inf}"}, {merge(empty, nan), "empty + {NaN}"},
                                    {merge(nan, empty), "{NaN} + empty"}, {merge(three, nan), "{3} + {NaN}"},
                                    {merge(nan, three), "{NaN} + {3}"}, {merge(inf, nan), "{+inf} + {NaN}"},
                                    {merge(nan, inf), "{NaN} + {+inf}"}}) {
    EXPECT_TRUE(std::isnan(state.logsumexp())) << name << ": got " << state.logsumexp();
    EXPECT_TRUE(std::isnan(state.m)) << name << ": the maximum of a set with NaN is NaN, got " << state.m;
  }
  for (const auto& [state, name] : {std::pair{of({INFINITY}), "{+inf}"}, {of({1.0f, INFINITY}), "{1, +inf}"},
                                    {of({INFINITY, 1.0f}), "{+inf, 1}"}, {of({INFINITY, INFINITY}), "{+inf, +inf}"},
                                    {of({-INFINITY, INFINITY}), "{-inf, +inf}"}, {merge(inf, three), "{+inf} + {3}"},
                                    {merge(three, inf), "{3} + {+inf}"}, {merge(inf, inf), "{+inf} + {+inf}"},
                                    {merge(empty, inf), "empty + {+inf}"}}) {
    EXPECT_EQ(state.logsumexp(), INFINITY) << name;
    EXPECT_EQ(state.m, INFINITY) << name;
    // exp(x - m) / l for any x of the set is inf/inf or 0/inf...: the softmax is NaN, as torch's.
    EXPECT_TRUE(std::isnan(std::exp(3.0f - state.m) / state.l)) << name << ": l = " << state.l;
  }
}

// ── Task 2: safe softmax on the CPU ───────────────────────────────────────────────────────────

CP_TEST(Lesson01, Task2_SafeSoftmaxMatchesTorch) {
  for (double outlier : {0.0, 1e4}) {
    for (int64_t n : kLengths) {
      const torch::Tensor x = random_with_outliers({64, n}, 100 + n, 4.0, outlier);
      for (auto dtype : {torch::kFloat, torch::kDouble})
        EXPECT_TRUE(all_close(safe_softmax(x.to(dtype)), oracle_softmax(x), "safe_softmax n=" + std::to_string(n)));
    }
  }
}

CP_TEST(Lesson01, Task2_SafeSoftmaxOfAnAllMinusInfRowIsZero) {
  const torch::Tensor x = torch::tensor({{-INFINITY, -INFINITY, -INFINITY}, {0.0f, -INFINITY, 1.0f}});
  EXPECT_TRUE(all_close(safe_softmax(x), oracle_softmax(x), "safe_softmax with -inf rows"));
}

CP_TEST(Lesson01, Task2_NanAndInfFollowTheReference) {
  for (int64_t n : {40, 100}) {
    const torch::Tensor x = non_finite_rows(n, 50 + n);
    const torch::Tensor expected = oracle_softmax(x);
    ASSERT_TRUE(expected[0].isnan().all().item<bool>() && expected[2].isnan().all().item<bool>());
    ASSERT_FALSE(expected[4].isnan().any().item<bool>());
    for (auto dtype : {torch::kFloat, torch::kDouble})
      EXPECT_TRUE(all_close_or_nan(safe_softmax(x.to(dtype)), expected, "safe_softmax n=" + std::to_string(n),
                                   {"row", "j"}));
  }
}

// ── Task 3: online softmax and logsumexp on the CPU ───────────────────────────────────────────

CP_TEST(Lesson01, Task3_OnlineSoftmaxMatchesTorch) {
  for (double outlier : {0.0, 1e4}) {
    for (int64_t n : kLengths) {
      const torch::Tensor x = random_with_outliers({8, 16, n}, 200 + n, 4.0, outlier);
      for (auto dtype : {torch::kFloat, torch::kDouble})
        EXPECT_TRUE(all_close(online_softmax(x.to(dtype)), oracle_softmax(x), "online_softmax n=" + std::to_string(n),
                              {"i", "j", "col"}));
    }
  }
}

CP_TEST(Lesson01, Task3_RowLogsumexpMatchesTorch) {
  for (int64_t n : kLengths) {
    const torch::Tensor x = random_with_outliers({64, n}, 300 + n, 4.0, n % 2 ? 1e4 : 0.0);
    const torch::Tensor lse = row_logsumexp(x);
    EXPECT_EQ(lse.scalar_type(), torch::kFloat);
    EXPECT_TRUE(all_close(lse, oracle_logsumexp(x), "row_logsumexp n=" + std::to_string(n)));
  }
}

CP_TEST(Lesson01, Task3_HugeValuesAndMinusInfEntries) {
  // ±1e4 overflow a naive exp; -inf entries are masked-out columns.
  torch::Tensor x = random_with_outliers({5, 97}, 9, 3.0, 1e4);
  x.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, 97, 3)}, -INFINITY);
  EXPECT_TRUE(all_close(online_softmax(x), oracle_softmax(x), "online_softmax"));
  EXPECT_TRUE(all_close(row_logsumexp(x), oracle_logsumexp(x), "row_logsumexp"));
}

CP_TEST(Lesson01, Task3_AllMinusInfRowGivesZerosAndMinusInfNeverNan) {
  torch::Tensor x = random_with_outliers({3, 40}, 4);
  x[1].fill_(-INFINITY);
  const torch::Tensor y = online_softmax(x);
  EXPECT_FALSE(y.isnan().any().item<bool>());
  EXPECT_TRUE(all_close(y, oracle_softmax(x), "online_softmax"));
  EXPECT_EQ(row_logsumexp(x)[1].item<float>(), -INFINITY);
}

CP_TEST(Lesson01, Task3_NanAndInfFollowTheReference) {
  for (int64_t n : {40, 100, 1000}) {  // the NaN and inf land in different lanes of the 32 states
    const torch::Tensor x = non_finite_rows(n, 60 + n);
    const std::string what = " n=" + std::to_string(n);
    const torch::Tensor lse = oracle_logsumexp(x);
    ASSERT_TRUE(std::isnan(lse[0].item<double>()) && lse[2].item<double>() == INFINITY);
    for (auto dtype : {torch::kFloat, torch::kDouble}) {
      EXPECT_TRUE(all_close_or_nan(online_softmax(x.to(dtype)), oracle_softmax(x), "online_softmax" + what,
                                   {"row", "j"}));
      EXPECT_TRUE(all_close_or_nan(row_logsumexp(x.to(dtype)), lse, "row_logsumexp" + what, {"row"}));
    }
  }
}

CP_TEST(Lesson01, Task3_LeadingDimsAndNonContiguousInput) {
  const torch::Tensor base = random_with_outliers({6, 5, 33}, 77);
  const torch::Tensor x = base.transpose(0, 1);  // [5, 6, 33], not contiguous
  EXPECT_TRUE(all_close(online_softmax(x), oracle_softmax(x), "online_softmax of a transposed tensor"));
  EXPECT_TRUE(all_close(row_logsumexp(x), oracle_logsumexp(x), "row_logsumexp of a transposed tensor"));
}

CP_TEST(Lesson01, Task3_BadInputGivesClearErrors) {
  // The checks are given code; the test counts once the learner's online_softmax runs.
  online_softmax(torch::zeros({1, 2}));
  expect_error([] { online_softmax(torch::tensor(1.0f)); }, "x: expected at least 1 dimension");
  expect_error([] { online_softmax(torch::zeros({2, 3}, torch::kHalf)); }, "x: the CPU path takes float32 or float64");
  expect_error([] { row_logsumexp(torch::zeros({2, 3}, torch::kInt)); }, "x: the CPU path takes float32 or float64");
  expect_error([] { online_softmax(torch::Tensor()); }, "x: tensor is undefined");
}

// ── Task 4: the CUDA kernel through online_softmax() on CUDA tensors (a GPU and a CUDA LibTorch) ──

CP_TEST(Lesson01Cuda, Task4_OnlineSoftmaxMatchesTorchForEveryDtype) {
  CP_REQUIRE_GPU();
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    for (int64_t n : kLengths) {
      // fp16 cannot hold 1e4 outliers' exponent range safely: keep values within its range.
      const torch::Tensor x = random_with_outliers({3, n}, 400 + n, 3.0, 1e3).to(dtype);
      const torch::Tensor y = online_softmax(x.cuda());
      EXPECT_EQ(y.scalar_type(), dtype);
      EXPECT_TRUE(all_close(y, oracle_softmax(x), "online_softmax cuda n=" + std::to_string(n)));
    }
  }
}

CP_TEST(Lesson01Cuda, Task4_RowLogsumexpMatchesTorchForEveryDtype) {
  CP_REQUIRE_GPU();
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    const torch::Tensor x = random_with_outliers({7, 1000}, 500, 3.0, 1e3).to(dtype);
    // The result is float32 computed from the dtype's values: compare at float32 tolerance.
    EXPECT_TRUE(all_close(row_logsumexp(x.cuda()), oracle_logsumexp(x), "row_logsumexp cuda"));
  }
}

/// online_softmax and row_logsumexp of empty shapes: no rows, and rows of no element (lse -inf).
void check_empty_rows(torch::Device device) {
  online_softmax(torch::zeros({1, 2}).to(device));  // counts once implemented: empty rows never reach the row code
  for (const auto& shape : {std::vector<int64_t>{0, 7}, std::vector<int64_t>{5, 0}}) {
    const torch::Tensor x = torch::zeros(shape);
    EXPECT_TRUE(all_close(online_softmax(x.to(device)), oracle_softmax(x), "online_softmax of an empty shape"));
    EXPECT_TRUE(all_close(row_logsumexp(x.to(device)), oracle_logsumexp(x), "row_logsumexp of an empty shape"));
  }
}

CP_TEST(Lesson01, Task3_EmptyShapes) { check_empty_rows(torch::kCPU); }

CP_TEST(Lesson01Cuda, Task4_EmptyShapesOnCuda) {
  CP_REQUIRE_GPU();
  check_empty_rows(torch::kCUDA);
}

CP_TEST(Lesson01Cuda, Task4_KernelRunsOnTheTensorsGpu) {
  // A thread starts on GPU 0; a tensor on GPU 1 must still be processed on GPU 1, on that GPU's
  // stream (the launch happens inside a CudaDeviceScope of the tensor's device).
  CP_REQUIRE_GPU();
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs (one is visible)";
  const torch::Tensor x = random_with_outliers({37, 300}, 650);
  torch::Tensor y;
  std::thread([&] { y = online_softmax(x.to(torch::Device(torch::kCUDA, 1))); }).join();
  EXPECT_EQ(y.device(), torch::Device(torch::kCUDA, 1));
  EXPECT_TRUE(all_close(y, oracle_softmax(x), "online_softmax of a tensor on GPU 1"));
}

CP_TEST(Lesson01Cuda, Task4_MinusInfRowsAndManyRows) {
  CP_REQUIRE_GPU();
  torch::Tensor x = random_with_outliers({1000, 65}, 600);
  x[17].fill_(-INFINITY);
  x.index_put_({torch::indexing::Slice(), 3}, -INFINITY);
  const torch::Tensor y = online_softmax(x.cuda());
  EXPECT_FALSE(y.isnan().any().item<bool>());
  EXPECT_TRUE(all_close(y, oracle_softmax(x), "online_softmax cuda"));
  EXPECT_TRUE(all_close(row_logsumexp(x.cuda()), oracle_logsumexp(x), "row_logsumexp cuda"));
}

// ── Task 4: the CUDA kernel on device buffers (a GPU, or CUDA on the CPU) ─────────────────────
//
// launch_online_softmax is called directly on cudaMalloc'd copies of the input: these tests need
// no LibTorch CUDA, so they run on a GPU and, without one, on the CPU through chipStar + PoCL.

#if CP_WITH_CUDA
using testing::DeviceBuffer;
using testing::TestStream;

/// What to ask the kernel for: both outputs, or one of them (the other pointer is null).
enum class Outputs { Both, YOnly, LseOnly };

/// Runs the kernel on x [rows, n] (any float dtype) and compares y and lse with the oracle.
void check_kernel(const torch::Tensor& x, const std::string& what, Outputs outputs = Outputs::Both) {
  const int64_t rows = x.size(0), n = x.size(1);
  TestStream stream;
  DeviceBuffer x_dev(x), y_dev({rows, n}, x.scalar_type()), lse_dev({rows}, torch::kFloat);
  const bool want_y = outputs != Outputs::LseOnly, want_lse = outputs != Outputs::YOnly;
  launch_online_softmax(x_dev.get(), want_y ? y_dev.get() : nullptr, want_lse ? lse_dev.as<float>() : nullptr, rows,
                        n, kernel_dtype(x, "x"), stream.get());
  const std::string where = what + " (x " + std::string(c10::toString(x.scalar_type())) + " rows=" +
                            std::to_string(rows) + " n=" + std::to_string(n) + ")";
  // lse is float32 computed from the dtype's values: the oracle takes the same rounded values.
  if (want_y) EXPECT_TRUE(all_close(y_dev.to_host(stream.get()), oracle_softmax(x), "y " + where, {"row", "j"}));
  if (want_lse) EXPECT_TRUE(all_close(lse_dev.to_host(stream.get()), oracle_logsumexp(x), "lse " + where, {"row"}));
}

CP_TEST(Lesson01Kernels, Task4_KernelMatchesTorchForEveryDtypeAndLength) {
  CP_REQUIRE_CUDA_RUNTIME();
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16})
    for (int64_t n : kLengths)  // fp16 holds exp() of differences up to ~11: outliers of 1e3 still test the shift
      check_kernel(random_with_outliers({3, n}, 400 + n, 3.0, 1e3).to(dtype), "online softmax kernel");
}

CP_TEST(Lesson01Kernels, Task4_RowCountsThatLeaveWarpsOfTheLastBlockIdle) {
  // One warp per row, four warps per block: 1, 2, 3, 5, 6, 7, 9 and 1001 rows leave warps of the
  // last block without a row. Those warps must still reach every shuffle (see the README).
  CP_REQUIRE_CUDA_RUNTIME();
  for (int64_t rows : {1, 2, 3, 4, 5, 6, 7, 9, 1001})
    check_kernel(random_with_outliers({rows, 65}, 700 + rows), "online softmax kernel");
}

CP_TEST(Lesson01Kernels, Task4_EmptyShapesAndSingleElementRows) {
  CP_REQUIRE_CUDA_RUNTIME();
  check_kernel(torch::zeros({0, 7}), "no rows");
  check_kernel(torch::zeros({5, 0}), "empty rows (lse = -inf)");
  check_kernel(random_with_outliers({6, 1}, 3), "one element per row (y = 1)");
}

CP_TEST(Lesson01Kernels, Task4_MinusInfRowsGiveZerosAndMinusInfNeverNan) {
  CP_REQUIRE_CUDA_RUNTIME();
  torch::Tensor x = random_with_outliers({9, 130}, 600);
  x[2].fill_(-INFINITY);
  x[7].fill_(-INFINITY);
  x.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, 130, 3)}, -INFINITY);
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) check_kernel(x.to(dtype), "-inf rows and columns");
}

CP_TEST(Lesson01Kernels, Task4_EachOutputCanBeLeftOut) {
  // online_softmax() asks for y only, row_logsumexp() for lse only: the other pointer is null.
  CP_REQUIRE_CUDA_RUNTIME();
  const torch::Tensor x = random_with_outliers({6, 100}, 31);
  check_kernel(x, "y only", Outputs::YOnly);
  check_kernel(x, "lse only", Outputs::LseOnly);
}
CP_TEST(Lesson01Kernels, Task4_NanAndInfFollowTheReference) {
  CP_REQUIRE_CUDA_RUNTIME();
  for (int64_t n : {40, 100}) {
    const torch::Tensor x = non_finite_rows(n, 70 + n);
    for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
      const torch::Tensor xd = x.to(dtype);
      TestStream stream;
      DeviceBuffer x_dev(xd), y_dev({x.size(0), n}, dtype), lse_dev({x.size(0)}, torch::kFloat);
      launch_online_softmax(x_dev.get(), y_dev.get(), lse_dev.as<float>(), x.size(0), n, kernel_dtype(xd, "x"),
                            stream.get());
      const std::string what = " (x " + std::string(c10::toString(dtype)) + " n=" + std::to_string(n) + ")";
      EXPECT_TRUE(all_close_or_nan(y_dev.to_host(stream.get()), oracle_softmax(xd), "y" + what, {"row", "j"}));
      EXPECT_TRUE(all_close_or_nan(lse_dev.to_host(stream.get()), oracle_logsumexp(xd), "lse" + what, {"row"}));
    }
  }
}
#else
CP_KERNEL_TESTS_NEED_CUDA(Lesson01Kernels)
#endif

}  // namespace
}  // namespace cp
