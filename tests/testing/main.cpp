// The gtest main of every test program, in-process or under mpirun.
//
// Run on its own, a program tests local worlds (threads). Under mpirun it tests the launched
// world, over the backend that --backend names (after the gtest flags, in any order):
//   mpirun -np 4 build/bin/runtime_test                                         (mpi, the default)
//   mpirun -np 2 build/bin/runtime_test --backend nccl --gtest_filter='*Cuda.*'  (one GPU per rank)
// The nccl backend moves CUDA tensors only: give it the CUDA suites (names ending in "Cuda").
//
// Under mpirun only rank 0 prints the usual gtest output; the other ranks print only their
// failures, prefixed with their rank. A failing test prints its first failure in full and the
// rest one line each (failure_digest.h; CP_VERBOSE=1 prints every one in full). Rank 0 also
// writes one JSON line per test to the file named by CP_RESULTS_JSON (read by tools/status and
// tools/compare) and prints a summary.
#include <gtest/gtest.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>

#include "common/cli.h"
#include "common/world.h"
#include "testing/failure_digest.h"
#include "testing/harness.h"
#include "testing/oracle.h"
#include "testing/session.h"

#if CP_WITH_MPI
#include <mpi.h>
#endif

namespace cp::testing::detail {
namespace {
std::shared_ptr<Comm> launched;  // the mpi or nccl world, alive for the whole program
std::function<void(const std::string&)> record_abort;  // rank 0's reporter, once it exists
}

Comm* launched_world() { return launched.get(); }

void abort_launched_world(const std::string& why) {
  if (record_abort) record_abort(why);
#if CP_WITH_MPI
  MPI_Abort(MPI_COMM_WORLD, 1);
#endif
  std::abort();
}

namespace {

enum class Outcome { Passed, Failed, NotStarted, Skipped };

Outcome outcome_of(const ::testing::TestInfo& test, std::string* message) {
  const ::testing::TestResult& result = *test.result();
  for (int i = 0; i < result.total_part_count(); ++i) {
    const ::testing::TestPartResult& part = result.GetTestPartResult(i);
    if (message->empty() || part.failed()) *message = part.summary();
  }
  if (result.Failed()) return Outcome::Failed;
  if (result.Skipped()) return message->rfind("NOT STARTED", 0) == 0 ? Outcome::NotStarted : Outcome::Skipped;
  return Outcome::Passed;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return v > 0 ? "1e308" : "-1e308";  // JSON has no infinity
  std::ostringstream out;
  out.precision(3);
  out << std::scientific << v;
  return out.str();
}

/// Rank 0: NOT STARTED lines, the results file and the closing summary.
class CourseReporter : public ::testing::EmptyTestEventListener {
 public:
  explicit CourseReporter(const char* results_path) {
    if (results_path) results_.open(results_path);
  }

  void OnTestStart(const ::testing::TestInfo&) override { take_checks(); }

  void OnTestEnd(const ::testing::TestInfo& test) override {
    std::string message;
    const Outcome outcome = outcome_of(test, &message);
    ++counts_[static_cast<int>(outcome)];
    write(test, outcome, message, test.result()->elapsed_time());
  }

  /// The running test, failed with `why`: the world is about to be aborted (gtest never ends it).
  void record_abort(const std::string& why) {
    const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
    if (test) write(*test, Outcome::Failed, "aborted the MPI world: " + why, 0);
  }

  void OnTestProgramEnd(const ::testing::UnitTest&) override {
    std::cout << "Summary: " << counts_[0] << " passed, " << counts_[1] << " failed, " << counts_[2]
              << " not started, " << counts_[3] << " skipped\n";
  }

 private:
  void write(const ::testing::TestInfo& test, Outcome outcome, const std::string& message, int64_t time_ms) {
    const std::string name = std::string(test.test_suite_name()) + "." + test.name();
    static const char* kNames[] = {"passed", "failed", "not_started", "skipped"};
    if (outcome == Outcome::NotStarted) std::cout << "[ NOT STARTED ] " << name << "\n" << std::flush;
    if (!results_.is_open()) return;
    results_ << "{\"test\": " << json_string(name) << ", \"status\": \"" << kNames[static_cast<int>(outcome)]
             << "\", \"time_ms\": " << time_ms << ", \"message\": " << json_string(message)
             << ", \"checks\": [";
    const std::vector<CheckRecord> records = take_checks();
    for (size_t i = 0; i < records.size(); ++i) {
      const CheckRecord& c = records[i];
      results_ << (i ? ", " : "") << "{\"what\": " << json_string(c.what) << ", \"max_abs\": " << json_number(c.max_abs)
               << ", \"max_rel\": " << json_number(c.max_rel) << ", \"wrong\": " << c.wrong
               << ", \"tol_abs\": " << c.tolerance.abs << ", \"tol_rel\": " << c.tolerance.rel << "}";
    }
    results_ << "]}\n" << std::flush;
  }

  std::ofstream results_;
  int counts_[4] = {0, 0, 0, 0};
};

}  // namespace
}  // namespace cp::testing::detail

int main(int argc, char** argv) {
  using namespace cp::testing::detail;
  ::testing::InitGoogleTest(&argc, argv);  // takes the gtest flags out of argv
  return cp::run_main([&] {
    const bool under_mpirun = cp::launched_by_mpirun();
    const cp::CommandLine cli(argc, argv, "The course's options, besides GoogleTest's (above).",
                              {{"--backend", under_mpirun ? "mpi" : "local",
                                "local without mpirun (threads); under mpirun mpi, or nccl for the *Cuda.* suites"}});
    if (cli.help_requested()) return 0;
    const cp::Backend backend = cp::parse_backend(cli.get("--backend"));
    CP_CHECK((backend == cp::Backend::Local) != under_mpirun, "--backend ", cli.get("--backend"),
             under_mpirun ? ": under mpirun the tests use the launched world: mpi or nccl"
                          : ": without mpirun the tests run local worlds; launch with mpirun for mpi or nccl");
    // Many ranks share few cores: one LibTorch intra-op thread per rank.
    torch::set_num_threads(1);
    if (backend == cp::Backend::Mpi) launched = cp::mpi_world();
    if (backend == cp::Backend::Nccl) launched = cp::nccl_world();

    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    const int rank = launched ? launched->rank() : 0;
    // gtest's printer behind the digest (a failing test in one screen); ranks > 0 print failures only.
    ::testing::TestEventListener* printer = listeners.Release(listeners.default_result_printer());
    if (rank != 0) {
      delete printer;
      printer = nullptr;
    }
    listeners.Append(failure_digest(printer, rank).release());
    if (rank == 0) {
      auto* reporter = new CourseReporter(std::getenv("CP_RESULTS_JSON"));  // the listeners own it
      listeners.Append(reporter);
      record_abort = [reporter](const std::string& why) { reporter->record_abort(why); };
    }
    const int status = RUN_ALL_TESTS();
    launched.reset();  // the last Comm: MPI is finalised when run_main returns
    return status;
  });
}
