// The test harness: CP_TEST, world helpers and GPU gating shared by every lesson's tests.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "common/comm.h"
#include "common/device.h"
#include "common/error.h"

namespace cp::testing {

/// Runs a test body; a cp::NotImplemented from learner code becomes a skip marked NOT STARTED.
void run_guarded(const std::function<void()>& body);

/// The world sizes every distributed test runs on the local backend: odd sizes catch
/// direction bugs, 8 catches indexing that only works for small rings.
const std::vector<int>& local_world_sizes();

/// Runs body(comm) on every world: local worlds of each size in local_world_sizes() when the
/// program runs on its own, or the launched world when it runs under mpirun. Under mpirun a
/// failure on any rank fails the test on every rank, and an exception aborts the world.
void for_each_world(const std::function<void(Comm&)>& body);

/// Runs body(" at SIMD <level>") once at every SIMD level this CPU has, from the SSE2 baseline up
/// (common/cpu_features.h: the CPU loops are compiled for each), then restores the level it found
/// (CP_CPU_SIMD's), also when body throws: a CPU loop must hold its rules at every width.
void for_each_simd_level(const std::function<void(const std::string& at)>& body);

/// Runs fn and expects a cp::Error whose message contains `needle` (a cp::NotImplemented passes
/// through, so that a test of learner code still shows NOT STARTED). Any other exception, or
/// none, fails the test.
void expect_error(const std::function<void()>& fn, const std::string& needle);

/// One row of a bad-input table: what is wrong, the call that must reject it, and a fragment
/// of the cp::Error message it must give.
struct BadInput {
  std::string input;
  std::function<void()> call;
  std::string message;
};

/// Runs every row of `table` with expect_error; a failure names the row's input.
void expect_errors(const std::vector<BadInput>& table);

/// True when this test program was started by mpirun (one process per rank).
bool under_mpirun();

/// Rank of this process in the launched world (0 when not under mpirun).
int process_rank();

/// True when the environment says a GPU must be usable (CP_EXPECT_GPU=1, set by make
/// gpu-check): then a test that would skip for want of CUDA fails instead, so that a GPU run in
/// which nothing could execute cannot pass.
bool gpu_expected();

}  // namespace cp::testing

/// A test whose body may call learner code: NotImplemented is reported as NOT STARTED.
#define CP_TEST(suite, name)                                                   \
  static void suite##_##name##_body();                                         \
  TEST(suite, name) { ::cp::testing::run_guarded(&suite##_##name##_body); }    \
  static void suite##_##name##_body()

/// Skips the current test, with the reason, when CUDA tensors cannot be used here (fails
/// instead when a GPU is expected: gpu_expected()).
#define CP_REQUIRE_GPU() CP_SKIP_UNLESS_EMPTY(::cp::cuda_unavailable_reason(), "needs a CUDA GPU: ")

/// Skips (or, when a GPU is expected, fails) the current test when `reason` is not empty.
#define CP_SKIP_UNLESS_EMPTY(reason_expr, prefix)                                                  \
  do {                                                                                             \
    const std::string cp_reason = (reason_expr);                                                   \
    if (!cp_reason.empty()) {                                                                      \
      if (::cp::testing::gpu_expected()) FAIL() << "CP_EXPECT_GPU is set, but " << prefix << cp_reason; \
      GTEST_SKIP() << prefix << cp_reason;                                                         \
    }                                                                                              \
  } while (0)
