// Lesson 01 — online softmax. Shared by the learner and the solution builds; the test names
// carry the task numbers of the lesson README.
#include <torch/cuda.h>
#include <torch/types.h>

#include <algorithm>
#include <random>
#include <sstream>
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

/// Rows long enough that one running float32 sum misses the tolerance by a wide margin (2 to 5
/// times on N(0, 16) values), while a double sum (task 2) or kLanes partial states (task 3) stay
/// far inside it (README, "Rounding: why one running sum is not enough"). At 4097 the margin is thin.
constexpr int64_t kLongRow = 16384;

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

/// "n = 5: 1.2, -3.4, 60, ...; max 60 at 2": enough of a set of values to recognise it.
std::string describe_values(const std::vector<float>& xs) {
  std::ostringstream out;
  out << "n = " << xs.size() << ":";
  for (size_t i = 0; i < std::min<size_t>(xs.size(), 6); ++i) out << (i ? ", " : " ") << xs[i];
  if (xs.size() > 6) out << ", ...";
  if (!xs.empty()) {
    const size_t arg = std::max_element(xs.begin(), xs.end()) - xs.begin();
    out << "; max " << xs[arg] << " at " << arg;
  }
  return out.str();
}

/// `actual` must be the state `expected` of the values `xs`: m exactly (a maximum involves no
/// arithmetic), l within 1e-5 relative. On failure: one message with both states, the values
/// and, where the symptom has one likely cause, a hint.
::testing::AssertionResult same_state(SoftmaxState actual, SoftmaxState expected, const std::string& what,
                                      const std::vector<float>& xs) {
  const bool m_ok = actual.m == expected.m;
  const bool l_ok = expected.l == 0.0f ? actual.l == 0.0f : std::abs(actual.l - expected.l) <= 1e-5 * expected.l;
  if (m_ok && l_ok) return ::testing::AssertionSuccess();
  std::ostringstream out;
  auto num = [](float v) {  // NaN as NaN (an ostream writes -nan or nan)
    std::ostringstream text;
    if (std::isnan(v)) text << "NaN"; else text << v;
    return text.str();
  };
  out << what << ": got {m = " << num(actual.m) << ", l = " << num(actual.l) << "}, expected {m = " << num(expected.m)
      << ", l = " << num(expected.l) << "} (the definition, in double)\n  values " << describe_values(xs)
      << "\n  m must be the maximum exactly; l within 1e-05 relative";
  const bool all_finite = std::all_of(xs.begin(), xs.end(), [](float x) { return std::isfinite(x); });
  if (std::isnan(actual.l) && all_finite)
    out << "\n  hint: l is NaN though every value is finite: something computed 0·inf or exp(-inf - (-inf)). The "
           "empty state is {m = -inf, l = 0}: a correction factor exp(x - m_old) is exp(+inf) there; it must be "
           "exp(m_old - m_new) <= 1. In merge, an empty side (m = -inf) needs the same care.";
  else if (m_ok && actual.l > expected.l)
    out << "\n  hint: l is too large: when the maximum grows from m_old to m_new, the l so far must be multiplied "
           "by exp(m_old - m_new) < 1. Is l rescaled when the maximum changes?";
  else if (m_ok && actual.l < expected.l)
    out << "\n  hint: l is too small: does every value add its term, exp(x - m), or 1 for a new maximum after "
           "the rescale?";
  return ::testing::AssertionFailure() << out.str();
}

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<float> xs(n);
  for (float& x : xs) x = normal(gen);
  if (n > 3) xs[n / 3] = 60.0f;  // a late, large maximum forces rescaling
  return xs;
}

/// all_close of a row-wise result (softmax [..., n] or logsumexp [...]) of the input rows x
/// [..., n], showing the input row of the first wrong element. A long row that misses by a
/// little is what one running float32 sum gives (README, "Rounding"): the message says so.
::testing::AssertionResult rows_close(const torch::Tensor& actual, const torch::Tensor& expected,
                                      const torch::Tensor& x, const std::string& what,
                                      const std::vector<std::string>& dims = {}) {
  ::testing::AssertionResult result = all_close(actual, expected, what, dims, std::nullopt, x);
  const int64_t n = x.size(-1);
  if (result || n < 1000) return result;
  const testing::Tolerance tol = testing::tolerance_for(actual.scalar_type());
  const torch::Tensor a = actual.to(torch::kDouble), e = expected.to(torch::kDouble);
  const bool near = ((a - e).abs() <= 10 * (tol.abs + tol.rel * e.abs()) | (a == e)).all().item<bool>();
  if (near)
    result << "\n  note: every error is within 10× the tolerance, on rows of " << n << " values: this is "
           << "accumulation error in float32 over long rows, not a wrong formula. One running sum of " << n
           << " float32 terms drifts by ~1e-5 relative; kLanes partial states (task 3) or a double sum (task 2) "
           << "stay within the tolerance. See \"Rounding: why one running sum is not enough\" in the README.";
  return result;
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
    CP_ASSERT_RESULT(same_state(state_by_adding(xs, 0, n), direct_state(xs), "adding the values one by one", xs));
  }
}

CP_TEST(Lesson01, Task1_MergeOfTwoHalvesGivesTheWholeState) {
  const std::vector<float> xs = random_values(300, 5);
  for (size_t split : {0, 1, 100, 299, 300}) {
    const SoftmaxState merged = merge(state_by_adding(xs, 0, split), state_by_adding(xs, split, xs.size()));
    CP_ASSERT_RESULT(same_state(merged, direct_state(xs), "merge of the halves split at " + std::to_string(split), xs));
  }
}

CP_TEST(Lesson01, Task1_MergeIsAssociativeOverRandomSplits) {
  // Cut the values into random pieces and merge the pieces' states in a random tree: every
  // order must give the state of the whole (up to float rounding of l).
  const std::vector<float> xs = random_values(500, 7);
  std::mt19937 gen(1234);
  const int trials = 20;
  int failed = 0;
  ::testing::AssertionResult first_failure = ::testing::AssertionSuccess();
  for (int trial = 0; trial < trials; ++trial) {
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
    std::string what = "trial " + std::to_string(trial) + ": merging the pieces cut at";
    for (size_t cut : cuts) what += " " + std::to_string(cut);
    const ::testing::AssertionResult result = same_state(pieces[0], direct_state(xs), what, xs);
    if (!result && failed++ == 0) first_failure = result;
  }
  // One message for all the trials: the first failure says what is wrong.
  if (failed)
    ADD_FAILURE() << "failed in " << failed << " of " << trials << " trials; the first:\n" << first_failure.message();
}

CP_TEST(Lesson01, Task1_EmptyAndMinusInfinityStatesMergeWithoutNan) {
  const SoftmaxState empty = SoftmaxState::empty();
  SoftmaxState only_minus_inf = SoftmaxState::empty();
  only_minus_inf.add(-INFINITY);
  CP_EXPECT_RESULT(same_state(only_minus_inf, empty, "adding -inf to the empty state", {-INFINITY}));
  CP_EXPECT_RESULT(same_state(merge(empty, empty), empty, "empty + empty", {}));
  SoftmaxState three = SoftmaxState::empty();
  three.add(3.0f);
  CP_EXPECT_RESULT(same_state(three, direct_state({3.0f}), "adding 3 to the empty state", {3.0f}));
  CP_EXPECT_RESULT(same_state(merge(empty, three), direct_state({3.0f}), "empty + {3}", {3.0f}));
  CP_EXPECT_RESULT(same_state(merge(three, empty), direct_state({3.0f}), "{3} + empty", {3.0f}));
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
        CP_ASSERT_RESULT(rows_close(safe_softmax(x.to(dtype)), oracle_softmax(x), x,
                                    "safe_softmax n=" + std::to_string(n), {"row", "j"}));
    }
  }
}

CP_TEST(Lesson01, Task2_LongRowsNeedADoubleSum) {
  const torch::Tensor x = random_with_outliers({32, kLongRow}, 808, 4.0, 0.0);
  CP_EXPECT_RESULT(rows_close(safe_softmax(x), oracle_softmax(x), x,
                              "safe_softmax float32 n=" + std::to_string(kLongRow), {"row", "j"}));
}

CP_TEST(Lesson01, Task2_SafeSoftmaxOfAnAllMinusInfRowIsZero) {
  const torch::Tensor x = torch::tensor({{-INFINITY, -INFINITY, -INFINITY}, {0.0f, -INFINITY, 1.0f}});
  CP_EXPECT_RESULT(rows_close(safe_softmax(x), oracle_softmax(x), x, "safe_softmax with -inf rows", {"row", "j"}));
}

CP_TEST(Lesson01, Task2_NanAndInfFollowTheReference) {
  for (int64_t n : {40, 100}) {
    const torch::Tensor x = non_finite_rows(n, 50 + n);
    const torch::Tensor expected = oracle_softmax(x);
    ASSERT_TRUE(expected[0].isnan().all().item<bool>() && expected[2].isnan().all().item<bool>());
    ASSERT_FALSE(expected[4].isnan().any().item<bool>());
    for (auto dtype : {torch::kFloat, torch::kDouble})
      CP_ASSERT_RESULT(all_close_or_nan(safe_softmax(x.to(dtype)), expected, "safe_softmax n=" + std::to_string(n),
                                        {"row", "j"}, std::nullopt, x));
  }
}

// ── Task 3: online softmax and logsumexp on the CPU ───────────────────────────────────────────

CP_TEST(Lesson01, Task3_OnlineSoftmaxMatchesTorch) {
  for (double outlier : {0.0, 1e4}) {
    for (int64_t n : kLengths) {
      const torch::Tensor x = random_with_outliers({8, 16, n}, 200 + n, 4.0, outlier);
      for (auto dtype : {torch::kFloat, torch::kDouble})
        CP_ASSERT_RESULT(rows_close(online_softmax(x.to(dtype)), oracle_softmax(x), x,
                                    "online_softmax n=" + std::to_string(n) + (outlier ? " with outliers of ±1e4" : ""),
                                    {"i", "j", "col"}));
    }
  }
}

// float64 input runs your row_state (float32 states, so one running sum loses accuracy there too);
// float32 input runs the given vectorised copy (online_softmax_simd.h).
CP_TEST(Lesson01, Task3_LongRowsNeedPartialStates) {
  const torch::Tensor x = random_with_outliers({32, kLongRow}, 809, 4.0, 0.0);
  for (auto dtype : {torch::kDouble, torch::kFloat})
    CP_EXPECT_RESULT(rows_close(online_softmax(x.to(dtype)), oracle_softmax(x), x,
                                std::string("online_softmax ") + c10::toString(dtype) + " n=" + std::to_string(kLongRow),
                                {"row", "j"}));
}

CP_TEST(Lesson01, Task3_RowLogsumexpMatchesTorch) {
  for (int64_t n : kLengths) {
    const torch::Tensor x = random_with_outliers({64, n}, 300 + n, 4.0, n % 2 ? 1e4 : 0.0);
    for (auto dtype : {torch::kDouble, torch::kFloat}) {
      const torch::Tensor lse = row_logsumexp(x.to(dtype));
      EXPECT_EQ(lse.scalar_type(), torch::kFloat);
      CP_ASSERT_RESULT(rows_close(lse, oracle_logsumexp(x), x, "row_logsumexp n=" + std::to_string(n), {"row"}));
    }
  }
}

CP_TEST(Lesson01, Task3_HugeValuesAndMinusInfEntries) {
  // ±1e4 overflow a naive exp; -inf entries are masked-out columns.
  torch::Tensor x = random_with_outliers({5, 97}, 9, 3.0, 1e4);
  x.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, 97, 3)}, -INFINITY);
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    CP_EXPECT_RESULT(rows_close(online_softmax(x.to(dtype)), oracle_softmax(x), x, "online_softmax", {"row", "j"}));
    CP_EXPECT_RESULT(rows_close(row_logsumexp(x.to(dtype)), oracle_logsumexp(x), x, "row_logsumexp", {"row"}));
  }
}

CP_TEST(Lesson01, Task3_AllMinusInfRowGivesZerosAndMinusInfNeverNan) {
  torch::Tensor x = random_with_outliers({3, 40}, 4);
  x[1].fill_(-INFINITY);
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    const torch::Tensor y = online_softmax(x.to(dtype));
    if (y.isnan().any().item<bool>())
      ADD_FAILURE() << "online_softmax gave NaN (" << dtype << "); a row of -inf only must give zeros";
    CP_EXPECT_RESULT(rows_close(y, oracle_softmax(x), x, "online_softmax", {"row", "j"}));
    EXPECT_EQ(row_logsumexp(x.to(dtype))[1].item<float>(), -INFINITY) << dtype;
  }
}

CP_TEST(Lesson01, Task3_NanAndInfFollowTheReference) {
  for (int64_t n : {40, 100, 1000}) {  // the NaN and inf land in different lanes of the 32 states
    const torch::Tensor x = non_finite_rows(n, 60 + n);
    const std::string what = " n=" + std::to_string(n);
    const torch::Tensor lse = oracle_logsumexp(x);
    ASSERT_TRUE(std::isnan(lse[0].item<double>()) && lse[2].item<double>() == INFINITY);
    for (auto dtype : {torch::kFloat, torch::kDouble}) {
      CP_ASSERT_RESULT(all_close_or_nan(online_softmax(x.to(dtype)), oracle_softmax(x), "online_softmax" + what,
                                        {"row", "j"}, std::nullopt, x));
      CP_ASSERT_RESULT(all_close_or_nan(row_logsumexp(x.to(dtype)), lse, "row_logsumexp" + what, {"row"},
                                        std::nullopt, x));
    }
  }
}

CP_TEST(Lesson01, Task3_LeadingDimsAndNonContiguousInput) {
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    const torch::Tensor base = random_with_outliers({6, 5, 33}, 77).to(dtype);
    const torch::Tensor x = base.transpose(0, 1);  // [5, 6, 33], not contiguous
    CP_EXPECT_RESULT(rows_close(online_softmax(x), oracle_softmax(x), x, "online_softmax of a transposed tensor"));
    CP_EXPECT_RESULT(rows_close(row_logsumexp(x), oracle_logsumexp(x), x, "row_logsumexp of a transposed tensor"));
  }
}

/// The given vectorised path (float32 rows, online_softmax_simd.h) at every SIMD level this CPU
/// has: lengths around its steps of 4·W values, -inf, NaN and +inf in every lane position.
CP_TEST(Lesson01, Task3_VectorisedPathAtEverySimdLevel) {
  online_softmax(torch::zeros({1, 2}, torch::kDouble));  // counts once task 3 is written (float64 runs it)
  testing::for_each_simd_level([&](const std::string& at) {
    for (int64_t n : std::initializer_list<int64_t>{1, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, kLongRow}) {
      torch::Tensor x = random_with_outliers({6, n}, 500 + n, 4.0, 1e4);
      x[1].fill_(-INFINITY);
      x.index_put_({2, torch::indexing::Slice(0, n, 2)}, -INFINITY);
      const std::string what = " n=" + std::to_string(n) + at;
      CP_ASSERT_RESULT(rows_close(online_softmax(x), oracle_softmax(x), x, "online_softmax" + what, {"row", "j"}));
      CP_ASSERT_RESULT(rows_close(row_logsumexp(x), oracle_logsumexp(x), x, "row_logsumexp" + what, {"row"}));
    }
    for (int64_t n : {40, 100, 1000}) {
      const torch::Tensor x = non_finite_rows(n, 60 + n);
      const std::string what = " n=" + std::to_string(n) + at;
      CP_ASSERT_RESULT(all_close_or_nan(online_softmax(x.to(torch::kFloat)), oracle_softmax(x), "online_softmax" + what,
                                        {"row", "j"}, std::nullopt, x));
      CP_ASSERT_RESULT(all_close_or_nan(row_logsumexp(x.to(torch::kFloat)), oracle_logsumexp(x),
                                        "row_logsumexp" + what, {"row"}, std::nullopt, x));
    }
  });
}

CP_TEST(Lesson01, Task3_BadInputGivesClearErrors) {
  // The checks are given code; the test counts once the learner's online_softmax runs.
  online_softmax(torch::zeros({1, 2}, torch::kDouble));  // counts once task 3 is written (float64 runs it)
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
      CP_EXPECT_CLOSE(y, oracle_softmax(x), "online_softmax cuda n=" + std::to_string(n));
    }
  }
}

CP_TEST(Lesson01Cuda, Task4_RowLogsumexpMatchesTorchForEveryDtype) {
  CP_REQUIRE_GPU();
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    const torch::Tensor x = random_with_outliers({7, 1000}, 500, 3.0, 1e3).to(dtype);
    // The result is float32 computed from the dtype's values: compare at float32 tolerance.
    CP_EXPECT_CLOSE(row_logsumexp(x.cuda()), oracle_logsumexp(x), "row_logsumexp cuda");
  }
}

/// online_softmax and row_logsumexp of empty shapes: no rows, and rows of no element (lse -inf).
void check_empty_rows(torch::Device device) {
  // Counts once implemented (on the CPU, float64 runs task 3's code): empty rows never reach the row code.
  online_softmax(torch::zeros({1, 2}, device.is_cuda() ? torch::kFloat : torch::kDouble).to(device));
  for (const auto& shape : {std::vector<int64_t>{0, 7}, std::vector<int64_t>{5, 0}}) {
    const torch::Tensor x = torch::zeros(shape);
    CP_EXPECT_CLOSE(online_softmax(x.to(device)), oracle_softmax(x), "online_softmax of an empty shape");
    CP_EXPECT_CLOSE(row_logsumexp(x.to(device)), oracle_logsumexp(x), "row_logsumexp of an empty shape");
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
  CP_EXPECT_CLOSE(y, oracle_softmax(x), "online_softmax of a tensor on GPU 1");
}

CP_TEST(Lesson01Cuda, Task4_MinusInfRowsAndManyRows) {
  CP_REQUIRE_GPU();
  torch::Tensor x = random_with_outliers({1000, 65}, 600);
  x[17].fill_(-INFINITY);
  x.index_put_({torch::indexing::Slice(), 3}, -INFINITY);
  const torch::Tensor y = online_softmax(x.cuda());
  EXPECT_FALSE(y.isnan().any().item<bool>());
  CP_EXPECT_CLOSE(y, oracle_softmax(x), "online_softmax cuda");
  CP_EXPECT_CLOSE(row_logsumexp(x.cuda()), oracle_logsumexp(x), "row_logsumexp cuda");
}

// ── Task 4: the CUDA kernel on device buffers (a GPU, or CUDA on the CPU) ─────────────────────
//
// launch_online_softmax is called directly on cudaMalloc'd copies of the input: these tests need
// no LibTorch CUDA, so they run on a GPU and, without one, on the CPU through chipStar + PoCL.

#if CP_WITH_CUDA

/// What to ask the kernel for: both outputs, or one of them (the other pointer is null).
enum class Outputs { Both, YOnly, LseOnly };

/// Runs the kernel on x [rows, n] (any float dtype) and compares y and lse with the oracle.
void check_kernel(const torch::Tensor& x, const std::string& what, Outputs outputs = Outputs::Both) {
  const int64_t rows = x.size(0), n = x.size(1);
  CudaStream stream;
  DeviceBuffer x_dev(x), y_dev({rows, n}, x.scalar_type()), lse_dev({rows}, torch::kFloat);
  const bool want_y = outputs != Outputs::LseOnly, want_lse = outputs != Outputs::YOnly;
  launch_online_softmax(x_dev.get(), want_y ? y_dev.get() : nullptr, want_lse ? lse_dev.as<float>() : nullptr, rows,
                        n, kernel_dtype(x, "x"), stream.get());
  const std::string where = what + " (x " + std::string(c10::toString(x.scalar_type())) + " rows=" +
                            std::to_string(rows) + " n=" + std::to_string(n) + ")";
  // lse is float32 computed from the dtype's values: the oracle takes the same rounded values.
  if (want_y) CP_EXPECT_CLOSE(y_dev.to_host(stream.get()), oracle_softmax(x), "y " + where, {"row", "j"});
  if (want_lse) CP_EXPECT_CLOSE(lse_dev.to_host(stream.get()), oracle_logsumexp(x), "lse " + where, {"row"});
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
      CudaStream stream;
      DeviceBuffer x_dev(xd), y_dev({x.size(0), n}, dtype), lse_dev({x.size(0)}, torch::kFloat);
      launch_online_softmax(x_dev.get(), y_dev.get(), lse_dev.as<float>(), x.size(0), n, kernel_dtype(xd, "x"),
                            stream.get());
      const std::string what = " (x " + std::string(c10::toString(dtype)) + " n=" + std::to_string(n) + ")";
      CP_EXPECT_RESULT(all_close_or_nan(y_dev.to_host(stream.get()), oracle_softmax(xd), "y" + what, {"row", "j"}));
      CP_EXPECT_RESULT(all_close_or_nan(lse_dev.to_host(stream.get()), oracle_logsumexp(xd), "lse" + what, {"row"}));
    }
  }
}
#else
CP_KERNEL_TESTS_NEED_CUDA(Lesson01Kernels)
#endif

}  // namespace
}  // namespace cp
