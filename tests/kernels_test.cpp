// Tests of kernels/ itself:
// - the matrix-unit building blocks of kernels/mma.cuh (lesson 16), run by a probe kernel
//   (tests/kernels/mma_probe.cu) on a GPU or on CUDA on the CPU. Each fragment must hold the
//   elements the map names, and mma must equal a float64 matrix product of the same 16-bit inputs;
// - the vector exponential of kernels/cpu_simd.h, which lessons 01, 03, 05 and the decode kernel
//   share, at every SIMD level this CPU has;
// - the decode kernel of kernels/cpu_decode.h (lessons 15 and 19) where its block maximum decides
//   alone (a NaN score among hidden ones), and with rows of their own and unequal dims at every
//   SIMD level.
#include <torch/types.h>

#include <cmath>
#include <cstring>
#include <sstream>
#include <utility>
#include <vector>

#include "common/tensor_checks.h"
#include "kernels/cpu_decode.h"
#include "kernels/cpu_simd.h"
#include "kernels/mma_map.h"
#include "testing/device_buffer.h"
#include "testing/harness.h"
#include "testing/oracle.h"

#if CP_WITH_CUDA
#include "tests/kernels/async_copy_probe.cuh"
#include "tests/kernels/mma_probe.cuh"
#endif

namespace cp {
namespace {

#if CP_WITH_CUDA

struct ProbeResult {
  torch::Tensor a_frag, b_frag, bt_frag, a_as_b_frags, d_map, d_ld;
};

ProbeResult run_probe(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c, int misuse = 0) {
  CudaStream stream;
  DeviceBuffer a_dev(a), b_dev(b), c_dev(c);
  DeviceBuffer a_frag({32, 8}, torch::kFloat), b_frag({32, 4}, torch::kFloat), bt_frag({32, 4}, torch::kFloat);
  DeviceBuffer a_as_b_frags({32, 8}, torch::kFloat);
  DeviceBuffer d_map({16, 8}, torch::kFloat), d_ld({16, 8}, torch::kFloat);
  testing::launch_mma_probe({a_dev.get(), b_dev.get(), c_dev.as<float>(), a_frag.as<float>(), b_frag.as<float>(),
                             bt_frag.as<float>(), a_as_b_frags.as<float>(), d_map.as<float>(), d_ld.as<float>(),
                             misuse},
                            kernel_dtype(a, "a"), stream.get());
  return {a_frag.to_host(stream.get()),       b_frag.to_host(stream.get()), bt_frag.to_host(stream.get()),
          a_as_b_frags.to_host(stream.get()), d_map.to_host(stream.get()),  d_ld.to_host(stream.get())};
}

/// m[map_row(lane, e)][map_col(lane, e)] for every lane and element: what the map says a lane holds.
template <typename Row, typename Col>
torch::Tensor by_map(const torch::Tensor& m, int elements, Row row, Col col) {
  torch::Tensor expected = torch::empty({32, elements}, torch::kFloat);
  const torch::Tensor mf = m.to(torch::kFloat);
  for (int lane = 0; lane < 32; ++lane)
    for (int e = 0; e < elements; ++e) expected[lane][e] = mf[row(lane, e)][col(lane, e)];
  return expected;
}

CP_TEST(KernelsMmaKernels, FragmentsHoldWhatTheMapSays) {
  CP_REQUIRE_CUDA_RUNTIME();
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    // Every element a different small integer (exact in both formats): a misplaced one shows.
    const torch::Tensor a = torch::arange(256, torch::kFloat).view({16, 16}).to(dtype);
    const torch::Tensor b = (torch::arange(128, torch::kFloat).view({16, 8}) - 64).to(dtype);
    const ProbeResult r = run_probe(a, b, torch::zeros({16, 8}));
    const std::string what = std::string(" (") + torch::toString(torch::TensorOptions().dtype(dtype).dtype()) + ")";
    EXPECT_TRUE(torch::equal(r.a_frag, by_map(a, 8, kernels::frag_a_row, kernels::frag_a_col)))
        << "ldmatrix_x4 of A" << what << ": got\n" << r.a_frag;
    const torch::Tensor b_expected = by_map(b, 4, kernels::frag_b_row, kernels::frag_b_col);
    EXPECT_TRUE(torch::equal(r.b_frag, b_expected)) << "ldmatrix_x2 of Bᵀ" << what << ": got\n" << r.b_frag;
    EXPECT_TRUE(torch::equal(r.bt_frag, b_expected)) << "ldmatrix_x2_trans of B" << what << ": got\n" << r.bt_frag;
    // A as a [k][n] matrix read by .x4.trans: the B fragments of its columns 0–7, then 8–15.
    const torch::Tensor a_as_b = torch::cat({by_map(a.narrow(1, 0, 8), 4, kernels::frag_b_row, kernels::frag_b_col),
                                             by_map(a.narrow(1, 8, 8), 4, kernels::frag_b_row, kernels::frag_b_col)},
                                            1);
    EXPECT_TRUE(torch::equal(r.a_as_b_frags, a_as_b)) << "ldmatrix_x4_trans of A as B" << what << ": got\n"
                                                      << r.a_as_b_frags;
  }
}

CP_TEST(KernelsMmaKernels, MmaEqualsTheMatrixProduct) {
  CP_REQUIRE_CUDA_RUNTIME();
  uint64_t seed = 70;
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    for (int trial = 0; trial < 3; ++trial) {
      const torch::Tensor a = testing::random_with_outliers({16, 16}, seed++, 1.0, 0.0).to(dtype);
      const torch::Tensor b = testing::random_with_outliers({16, 8}, seed++, 1.0, 0.0).to(dtype);
      const torch::Tensor c = testing::random_with_outliers({16, 8}, seed++, 1.0, 0.0);
      const torch::Tensor expected = torch::matmul(a.to(torch::kDouble), b.to(torch::kDouble)) + c.to(torch::kDouble);
      const ProbeResult r = run_probe(a, b, c);
      const std::string what = std::string(dtype == torch::kHalf ? "float16" : "bfloat16") + ", trial " +
                               std::to_string(trial);
      CP_EXPECT_CLOSE(r.d_map, expected, "D = A·B + C, fragments by the map, " + what, {"row", "col"});
      CP_EXPECT_CLOSE(r.d_ld, expected, "D = A·B + C, fragments by ldmatrix, " + what, {"row", "col"});
    }
  }
}
CP_TEST(KernelsMmaKernels, TheEmulationRefusesWhatTheHardwareRefuses) {
  CP_REQUIRE_CUDA_RUNTIME();
#if defined(CP_CUDA_CPU_ROOT)
  // Under CUDA on the CPU every address is a plain pointer, so ldmatrix from global memory would
  // read the right numbers; the emulation refuses it, as a GPU would fault or read garbage. It
  // also refuses a phase whose rows share banks, which a GPU runs, slower.
  const torch::Tensor a = torch::ones({16, 16}, torch::kHalf), b = torch::ones({16, 8}, torch::kHalf);
  run_probe(a, b, torch::zeros({16, 8}));  // no mistake: no error
  testing::expect_errors({
      {"ldmatrix_x4 of A in global memory", [&] { run_probe(a, b, torch::zeros({16, 8}), 1); },
       "ldmatrix read an address outside the shared memory the kernel declared"},
      {"ldmatrix_x2 of a row 2 bytes past a 16-byte boundary", [&] { run_probe(a, b, torch::zeros({16, 8}), 2); },
       "an ldmatrix row address is not 16-byte aligned"},
      {"ldmatrix_x2_trans of B in global memory", [&] { run_probe(a, b, torch::zeros({16, 8}), 3); },
       "ldmatrix read an address outside the shared memory the kernel declared"},
      {"ldmatrix_x4_trans of A in global memory", [&] { run_probe(a, b, torch::zeros({16, 8}), 4); },
       "ldmatrix read an address outside the shared memory the kernel declared"},
      {"ldmatrix_x2 of 8 rows 96 bytes apart (two rows on each group of banks)",
       [&] { run_probe(a, b, torch::zeros({16, 8}), 5); }, "two of the 8 rows an ldmatrix reads at once share banks"},
  });
#else
  GTEST_SKIP() << "a GPU's own ldmatrix faults or reads garbage on these addresses: compute-sanitizer's memcheck "
                  "reports them on a GPU day; the emulation's refusals are tested under CUDA on the CPU";
#endif
}
#else
CP_KERNEL_TESTS_NEED_CUDA(KernelsMmaKernels)
#endif

#if CP_WITH_CUDA
/// Runs the async-copy probe on src [2, 256]; returns shared memory after wait_all_but_newest and
/// after wait_all.
std::pair<torch::Tensor, torch::Tensor> run_async_copy_probe(const torch::Tensor& src, int misuse = 0) {
  CudaStream stream;
  DeviceBuffer src_dev(src), after1({2, 256}, torch::kFloat), after0({2, 256}, torch::kFloat);
  testing::launch_async_copy_probe({src_dev.as<float>(), after1.as<float>(), after0.as<float>(), misuse},
                                   stream.get());
  return {after1.to_host(stream.get()), after0.to_host(stream.get())};
}

CP_TEST(KernelsAsyncCopyKernels, AGroupHasLandedOnceItsWaitReturns) {
  CP_REQUIRE_CUDA_RUNTIME();
  const torch::Tensor src = torch::arange(512, torch::kFloat).view({2, 256});
  const auto [after1, after0] = run_async_copy_probe(src);
  EXPECT_TRUE(torch::equal(after1[0], src[0]))
      << "after wait_all_but_newest, group 0 (tile 0) must have landed: got\n" << after1[0];
  EXPECT_TRUE(torch::equal(after0, src)) << "after wait_all, both groups must have landed: got\n" << after0;
#if defined(CP_CUDA_CPU_ROOT)
  // The emulation lands a group only when a wait retires it: a kernel that reads tile 1 after
  // wait_all_but_newest reads the old bytes here (on a GPU it may read them, or the new ones, or a mix).
  EXPECT_TRUE(torch::equal(after1[1], torch::full({256}, -1.0f)))
      << "after wait_all_but_newest, the emulation must not have landed group 1 yet: got\n" << after1[1];
  testing::expect_errors({
      {"cp.async into global memory", [&] { run_async_copy_probe(src, 1); },
       "cp.async wrote outside the shared memory the kernel declared"},
      {"cp.async to a shared address 4 bytes past a 16-byte boundary", [&] { run_async_copy_probe(src, 2); },
       "a cp.async address is not 16-byte aligned"},
  });
#endif
}
#else
CP_KERNEL_TESTS_NEED_CUDA(KernelsAsyncCopyKernels)
#endif

/// y = exp_nonpos(x), or exp2_nonpos(x) if Base2, n a multiple of 16, at the widest SIMD level
/// allowed (simd_call).
template <bool Base2>
struct ExpOfArray {
  template <int W>
  CP_SIMD_INLINE static void run(const float* x, float* y, size_t n) {
    for (size_t i = 0; i < n; i += W) {
      const auto v = kernels::load<kernels::fvec<W>>(x + i);
      kernels::store(y + i, Base2 ? kernels::exp2_nonpos(v) : kernels::exp_nonpos(v));
    }
  }
};

template <bool Base2 = false>
std::vector<float> exp_nonpos_of(std::vector<float> x) {
  x.resize((x.size() + 15) / 16 * 16, 0.0f);
  std::vector<float> y(x.size());
  kernels::simd_call<ExpOfArray<Base2>>(x.data(), y.data(), x.size());
  return y;
}

/// Every 1009th float from 0 down to `lowest` (about a million in either test's range).
std::vector<float> every_1009th_float_down_to(float lowest) {
  std::vector<float> x;
  for (float f = -0.0f; f >= lowest;) {
    x.push_back(f);
    uint32_t b;
    std::memcpy(&b, &f, sizeof b);
    b += 1009;
    std::memcpy(&f, &b, sizeof f);
  }
  return x;
}

/// The largest error of y against exact(x) in units of the last place of the float result, and
/// where.
template <typename Exact>
std::pair<double, float> worst_ulp(const std::vector<float>& x, const std::vector<float>& y, Exact exact_of) {
  std::pair<double, float> worst{0.0, 0.0f};
  for (size_t i = 0; i < x.size(); ++i) {
    const double exact = exact_of(static_cast<double>(x[i]));
    const double ulp = std::ldexp(1.0, std::ilogb(static_cast<float>(exact)) - 23);
    const double err = std::fabs(y[i] - exact) / ulp;
    if (err > worst.first) worst = {err, x[i]};
  }
  return worst;
}

CP_TEST(KernelsCpuSimd, ExpNonposWithinOneUlpAndItsRulesAtEverySimdLevel) {
  const std::vector<float> x = every_1009th_float_down_to(-87.3f);  // the results are normal floats
  testing::for_each_simd_level([&](const std::string& at) {
    const auto [worst, worst_x] = worst_ulp(x, exp_nonpos_of(x), [](double v) { return std::exp(v); });
    // Measured on every float of the range: 1.02 ulp with FMA, 0.99 without (SSE2).
    EXPECT_LE(worst, 1.1) << "exp_nonpos" << at << ": " << worst << " ulp at x = " << worst_x;

    // The rules the online softmax relies on.
    const std::vector<float> special = {-INFINITY, -1e30f, -88.0f, 0.0f, -0.0f, NAN, 1e-7f, 50.0f, INFINITY};
    const std::vector<float> e = exp_nonpos_of(special);
    const auto show = [&](size_t i) {
      std::ostringstream os;
      os << "exp_nonpos(" << special[i] << ") = " << e[i] << at;
      return os.str();
    };
    for (size_t i : {0, 1, 2}) EXPECT_EQ(e[i], 0.0f) << show(i) << ", expected exactly 0";
    for (size_t i : {3, 4}) EXPECT_EQ(e[i], 1.0f) << show(i) << ", expected exactly 1";
    EXPECT_TRUE(std::isnan(e[5])) << show(5) << ", expected NaN";
    for (size_t i : {6, 7, 8}) EXPECT_EQ(e[i], 1.0f) << show(i) << ": x > 0 is read as 0";
    // Below -87.33 down to -88: a float under 1.2e-38 (or 0), never garbage.
    std::vector<float> low;
    for (float f = -87.33f; f > -88.0f; f -= 0.001f) low.push_back(f);
    const std::vector<float> e_low = exp_nonpos_of(low);
    for (size_t i = 0; i < low.size(); ++i)
      ASSERT_TRUE(e_low[i] >= 0.0f && e_low[i] < 1.2e-38f) << "exp_nonpos(" << low[i] << ") = " << e_low[i] << at;
  });
}

CP_TEST(KernelsCpuSimd, Exp2NonposWithinOneUlpAndItsRulesAtEverySimdLevel) {
  const std::vector<float> x = every_1009th_float_down_to(-126.0f);  // the results are normal floats
  testing::for_each_simd_level([&](const std::string& at) {
    const auto exact_exp2 = [](double v) { return std::exp2(v); };
    const auto [worst, worst_x] = worst_ulp(x, exp_nonpos_of<true>(x), exact_exp2);
    // Measured on every float of the range: 0.95 ulp with FMA, 1.23 without (SSE2).
    EXPECT_LE(worst, 1.25) << "exp2_nonpos" << at << ": " << worst << " ulp at x = " << worst_x;

    // The rules lesson 03's forward relies on; a hair above 0 is computed, not read as 0.
    const std::vector<float> special = {-INFINITY, -1e30f, -127.0f, 0.0f, -0.0f, NAN, 1e-7f, 0.25f};
    const std::vector<float> e = exp_nonpos_of<true>(special);
    const auto show = [&](size_t i) {
      std::ostringstream os;
      os << "exp2_nonpos(" << special[i] << ") = " << e[i] << at;
      return os.str();
    };
    for (size_t i : {0, 1, 2}) EXPECT_EQ(e[i], 0.0f) << show(i) << ", expected exactly 0";
    for (size_t i : {3, 4}) EXPECT_EQ(e[i], 1.0f) << show(i) << ", expected exactly 1";
    EXPECT_TRUE(std::isnan(e[5])) << show(5) << ", expected NaN";
    for (size_t i : {6, 7}) EXPECT_LE(worst_ulp({special[i]}, {e[i]}, exact_exp2).first, 1.25) << show(i);
    // Below -126 down to -127: a float under 1.2e-38 (or 0), never garbage.
    std::vector<float> low;
    for (float f = -126.0f; f > -127.0f; f -= 0.001f) low.push_back(f);
    const std::vector<float> e_low = exp_nonpos_of<true>(low);
    for (size_t i = 0; i < low.size(); ++i)
      ASSERT_TRUE(e_low[i] >= 0.0f && e_low[i] < 1.2e-38f) << "exp2_nonpos(" << low[i] << ") = " << e_low[i] << at;
  });
}

CP_TEST(KernelsCpuDecode, NanScoreAmongMinusInfScoresWinsTheBlockAtEverySimdLevel) {
  // One block of 32 keys, every score -inf but key 5's, which is NaN. A NaN score wins the
  // maximum (lesson 03's rule): out and lse are NaN. A maximum that drops the NaN is -inf, and
  // the block is taken for one with no visible key (out 0, lse -inf). Lesson 15's tests cannot
  // tell the two apart: there a NaN score always meets finite ones, and its p = NaN reaches the
  // result either way.
  constexpr int64_t d = 16, n = kernels::kDecodeBlock;
  std::vector<float> q(d, 0.0f), k(n * d, 0.0f), v(n * d, 1.0f), work(d + kernels::kDecodeBlock + 2);
  std::vector<int64_t> k_pos(n);
  q[0] = 1.0f;
  for (int64_t j = 0; j < n; ++j) {
    k_pos[j] = j;
    k[j * d] = j == 5 ? NAN : -INFINITY;  // score q · k_j: NaN for key 5, -inf for the others
  }
  testing::for_each_simd_level([&](const std::string& at) {
    std::vector<float> out(d, 0.0f), lse(1, 0.0f);
    const kernels::ContiguousKeys keys{k.data(), v.data(), k_pos.data(), int64_t{n}, d};
    kernels::simd_call<kernels::DecodeAttend>(q.data(), int64_t{1}, keys, n, d, d, 1.0f, out.data(), lse.data(),
                                              work.data());
    EXPECT_TRUE(std::isnan(lse[0])) << "lse = " << lse[0] << at << ", expected NaN";
    for (int64_t i = 0; i < d; ++i) ASSERT_TRUE(std::isnan(out[i])) << "out[" << i << "] = " << out[i] << at;
  });
}

/// Keys with a visibility of their own per row (lesson 19's chunks and draft tokens), rows j of
/// d_qk and d_v floats one after another, key j visible to row r if j < seen[r].
struct RowLimitedKeys {
  const float* k;
  const float* v;
  const int64_t* seen;
  int64_t d_qk, d_v;
  const float* key(int64_t j) const { return k + j * d_qk; }
  const float* value(int64_t j) const { return v + j * d_v; }
  bool visible(int64_t j, int64_t row) const { return j < seen[row]; }
};

CP_TEST(KernelsCpuDecode, RowsOfTheirOwnAndUnequalDimsAtEverySimdLevel) {
  // Five rows seeing 0, 1, 31, 33 and 69 of 70 keys (a block boundary on each side of 32), scores
  // of 19 floats and values of 11 (neither a multiple of any SIMD width). The last key and value
  // are NaN, hidden from every row; value 32 is NaN, seen by the last two rows only: each row must
  // equal float64 softmax over its own keys, NaN where it sees the NaN value and nowhere else.
  constexpr int64_t n = 70, d_qk = 19, d_v = 11, rows = 5;
  const std::vector<int64_t> seen = {0, 1, 31, 33, 69};
  const torch::Tensor q = testing::random_with_outliers({rows, d_qk}, 191, 1.0, 0.0);
  torch::Tensor k = testing::random_with_outliers({n, d_qk}, 192, 1.0, 0.0);
  torch::Tensor v = testing::random_with_outliers({n, d_v}, 193, 1.0, 0.0);
  k[n - 1].fill_(NAN);
  v[n - 1].fill_(NAN);
  v[32].fill_(NAN);
  const double scale = 0.7;
  const torch::Tensor scores = torch::matmul(q.to(torch::kDouble), k.to(torch::kDouble).t()) * scale;
  const torch::Tensor hidden = torch::arange(n).unsqueeze(0) >= torch::tensor(seen).unsqueeze(1);
  const torch::Tensor masked = scores.masked_fill(hidden, -INFINITY);
  const torch::Tensor expected_lse = testing::oracle_logsumexp(masked);
  const torch::Tensor p = testing::oracle_softmax(masked);
  torch::Tensor expected_out = torch::zeros({rows, d_v}, torch::kDouble);
  for (int64_t r = 0; r < rows; ++r)  // over the row's own keys only: 0 · NaN must not reach it
    expected_out[r] = torch::matmul(p[r].narrow(0, 0, seen[r]), v.narrow(0, 0, seen[r]).to(torch::kDouble));
  std::vector<float> work(rows * (d_v + kernels::kDecodeBlock + 2));
  testing::for_each_simd_level([&](const std::string& at) {
    torch::Tensor out = torch::zeros({rows, d_v}), lse = torch::zeros({rows});
    const RowLimitedKeys keys{k.data_ptr<float>(), v.data_ptr<float>(), seen.data(), d_qk, d_v};
    kernels::simd_call<kernels::DecodeAttend>(q.data_ptr<float>(), rows, keys, n, d_qk, d_v, static_cast<float>(scale),
                                              out.data_ptr<float>(), lse.data_ptr<float>(), work.data());
    CP_EXPECT_RESULT(testing::all_close_or_nan(out, expected_out, "out" + at, {"row", "d"}));
    CP_EXPECT_CLOSE(lse, expected_lse, "lse" + at, {"row"});
  });
}

}  // namespace
}  // namespace cp
