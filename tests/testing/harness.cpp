#include "testing/harness.h"

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "common/cpu_features.h"
#include "common/world.h"
#include "testing/failure_digest.h"
#include "testing/session.h"

namespace cp::testing {

void run_guarded(const std::function<void()>& body) {
  try {
    body();
  } catch (const NotImplemented& e) {
    GTEST_SKIP() << "NOT STARTED — " << e.what();
  }
}

void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
  } catch (const NotImplemented&) {
    throw;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "the error should mention '" << needle
                                                                      << "', got: " << e.what();
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a cp::Error mentioning '" << needle << "', got another exception: " << e.what();
    return;
  }
  ADD_FAILURE() << "expected a cp::Error mentioning '" << needle << "', got no error";
}

void expect_errors(const std::vector<BadInput>& table) {
  for (const BadInput& row : table) {
    SCOPED_TRACE("bad input: " + row.input);
    expect_error(row.call, row.message);
  }
}

const std::vector<int>& local_world_sizes() {
  static const std::vector<int> sizes = {1, 2, 3, 4, 8};
  return sizes;
}

bool under_mpirun() { return detail::launched_world() != nullptr; }

int process_rank() { return under_mpirun() ? detail::launched_world()->rank() : 0; }

bool gpu_expected() {
  const char* value = std::getenv("CP_EXPECT_GPU");
  return value != nullptr && std::string(value) == "1";
}

namespace {

void run_local_worlds(const std::function<void(Comm&)>& body) {
  // Tests deadlock only by mistake; a short watchdog makes such a mistake fail fast.
  const LocalWorldOptions options{std::chrono::milliseconds(1000)};
  for (int n : local_world_sizes()) {
    try {
      run_local_world(
          n,
          [&](Comm& comm) {
            SCOPED_TRACE(::testing::Message() << "world size " << n << ", rank " << comm.rank());
            body(comm);
          },
          options);
    } catch (const NotImplemented&) {
      throw;
    } catch (const std::exception& e) {
      FAIL() << "world size " << n << ": " << e.what();
    }
  }
}

enum RankOutcome : int32_t { kPassed = 0, kFailed = 1, kNotStarted = 2 };

void run_launched_world(Comm& comm, const std::function<void(Comm&)>& body) {
  RankOutcome outcome = kPassed;
  std::string not_started;
  try {
    SCOPED_TRACE(::testing::Message() << "mpi world of " << comm.size() << ", rank " << comm.rank());
    body(comm);
  } catch (const NotImplemented& e) {
    outcome = kNotStarted;
    not_started = e.what();
  } catch (const std::exception& e) {
    // The other ranks may wait for this one forever: end the whole world, loudly.
    std::cerr << "[rank " << comm.rank() << "] exception in " << ::testing::UnitTest::GetInstance()->current_test_info()->name()
              << ": " << e.what() << "\n  aborting the MPI world" << std::endl;
    detail::abort_launched_world(e.what());
  }
  if (::testing::Test::HasFatalFailure()) {
    std::cerr << "[rank " << comm.rank() << "] fatal assertion failed; aborting the MPI world" << std::endl;
    detail::abort_launched_world("a fatal assertion failed");
  }
  if (outcome == kPassed && ::testing::Test::HasFailure()) outcome = kFailed;

  // Every rank learns every rank's outcome, so a failure anywhere fails the test everywhere. (On
  // the GPU under nccl, which moves nothing else.)
  const torch::Device device = comm.backend() == Backend::Nccl ? current_cuda_device() : torch::Device(torch::kCPU);
  const torch::Tensor outcomes =
      comm.all_gather(torch::tensor({static_cast<int32_t>(outcome)}, torch::kInt32).to(device)).cpu();
  std::vector<int> others_failed;
  for (int r = 0; r < comm.size(); ++r) {
    const int32_t o = outcomes[r].item<int32_t>();
    if (o == kFailed) detail::note_failing_rank(r);
    if (o == kFailed && r != comm.rank()) others_failed.push_back(r);
    if (o == kNotStarted && not_started.empty()) not_started = "rank " + std::to_string(r) + " is not started";
  }
  // Rank 0 names the other failing ranks. Unless CP_VERBOSE=1, only the lowest failing rank
  // prints its messages (failure_digest.h): rank 0 itself, or the rank named first here.
  if (comm.rank() == 0 && !others_failed.empty()) {
    ::testing::Message ranks;
    for (size_t i = 0; i < others_failed.size(); ++i) ranks << (i ? ", " : "") << others_failed[i];
    const std::string lowest = std::to_string(others_failed.front());
    ADD_FAILURE() << (others_failed.size() == 1 ? "rank " : "ranks ") << ranks << " failed"
                  << (outcome == kFailed ? " too" : "")
                  << (detail::verbose()     ? " (their messages carry [rank r])"
                      : outcome == kFailed ? " (CP_VERBOSE=1 prints their messages)"
                                           : " (rank " + lowest + "'s messages carry [rank " + lowest +
                                                 "]; CP_VERBOSE=1 prints every rank's)");
  }
  if (!not_started.empty()) throw NotImplemented(not_started);
}

}  // namespace

void for_each_simd_level(const std::function<void(const std::string& at)>& body) {
  struct Restore {
    SimdLevel level = simd_level();
    ~Restore() { set_simd_level(level); }
  } restore;
  for (int level = 0; level <= static_cast<int>(best_simd_level()); ++level) {
    set_simd_level(static_cast<SimdLevel>(level));
    body(" at SIMD " + describe(static_cast<SimdLevel>(level)));
  }
}

void for_each_world(const std::function<void(Comm&)>& body) {
  if (Comm* world = detail::launched_world())
    run_launched_world(*world, body);
  else
    run_local_worlds(body);
}

}  // namespace cp::testing
