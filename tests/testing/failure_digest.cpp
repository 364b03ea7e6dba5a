#include "testing/failure_digest.h"

#include <atomic>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace cp::testing::detail {

bool verbose() {
  static const bool on = [] {
    const char* value = std::getenv("CP_VERBOSE");
    return value != nullptr && std::string(value) == "1";
  }();
  return on;
}

namespace {

std::atomic<int> failing_rank{-1};

// The failures after the first that a digest lists, one line each, before it only counts them.
constexpr size_t kListedFailures = 8;
constexpr size_t kLineWidth = 160;

std::string location(const ::testing::TestPartResult& part) {
  return std::string(part.file_name() ? part.file_name() : "?") + ":" + std::to_string(part.line_number());
}

/// gtest's own block for a failure: "file:line: Failure", the message and its traces (without
/// a "Google Test trace:" heading that has no trace under it).
std::string full_report(const ::testing::TestPartResult& part) {
  std::string message = part.message();
  const size_t trace_at = message.find("Google Test trace:");
  if (trace_at != std::string::npos &&
      message.find_first_not_of(" \n", trace_at + std::string("Google Test trace:").size()) == std::string::npos) {
    const std::string before = message.substr(0, trace_at);
    message = before.substr(0, before.find_last_not_of(" \n") + 1);  // npos + 1 = 0: nothing before
  }
  return location(part) + ": Failure\n" + message + "\n";
}

/// One line: where (file name and line), the message with its lines joined, and the
/// SCOPED_TRACE context (world size, rank, configuration) that gtest appends after "Google Test
/// trace:"; cut to kLineWidth.
std::string one_line(const ::testing::TestPartResult& part) {
  const std::string message = part.message();
  const size_t trace_at = message.find("Google Test trace:\n");
  std::string text;
  std::istringstream lines(message.substr(0, trace_at));
  for (std::string line; std::getline(lines, line);) {
    const size_t begin = line.find_first_not_of(' ');
    if (begin == std::string::npos || (text.empty() && line == "Failed")) continue;  // ADD_FAILURE's first line
    text += (text.empty() ? "" : " ") + line.substr(begin);
  }
  std::string context;
  if (trace_at != std::string::npos) {
    std::istringstream traces(message.substr(trace_at + 19));
    for (std::string line; std::getline(traces, line);) {
      const size_t colon = line.find(": ");  // each trace line is "file:line: message"
      if (line.empty()) continue;
      context += (context.empty() ? "" : "; ") + (colon == std::string::npos ? line : line.substr(colon + 2));
    }
  }
  const std::string file = part.file_name() ? part.file_name() : "?";
  std::string line = file.substr(file.find_last_of('/') + 1) + ":" + std::to_string(part.line_number()) + ": " +
                     (context.empty() ? "" : "[" + context + "] ") + text;
  if (line.size() > kLineWidth) line = line.substr(0, kLineWidth - 3) + "...";
  return line;
}

class FailureDigest : public ::testing::TestEventListener {
 public:
  FailureDigest(::testing::TestEventListener* printer, int rank) : printer_(printer), rank_(rank) {}

  void OnTestProgramStart(const ::testing::UnitTest& u) override { forward(&Listener::OnTestProgramStart, u); }
  void OnTestIterationStart(const ::testing::UnitTest& u, int i) override {
    if (printer_) printer_->OnTestIterationStart(u, i);
  }
  void OnEnvironmentsSetUpStart(const ::testing::UnitTest& u) override { forward(&Listener::OnEnvironmentsSetUpStart, u); }
  void OnEnvironmentsSetUpEnd(const ::testing::UnitTest& u) override { forward(&Listener::OnEnvironmentsSetUpEnd, u); }
  void OnTestSuiteStart(const ::testing::TestSuite& s) override { forward(&Listener::OnTestSuiteStart, s); }
#ifndef GTEST_REMOVE_LEGACY_TEST_CASEAPI_
  // gtest calls both; its printer implements one or the other depending on its version.
  void OnTestCaseStart(const ::testing::TestCase& s) override { forward(&Listener::OnTestCaseStart, s); }
  void OnTestCaseEnd(const ::testing::TestCase& s) override { forward(&Listener::OnTestCaseEnd, s); }
#endif
  void OnTestStart(const ::testing::TestInfo& t) override {
    failing_rank = -1;
    failures_.clear();
    forward(&Listener::OnTestStart, t);
  }
  void OnTestDisabled(const ::testing::TestInfo& t) override { forward(&Listener::OnTestDisabled, t); }
  void OnTestPartResult(const ::testing::TestPartResult& part) override {
    if (!part.failed() || verbose()) {
      if (printer_) {
        printer_->OnTestPartResult(part);
      } else if (part.failed()) {
        print_on_rank(full_report(part));
      }
      return;
    }
    const std::lock_guard<std::mutex> lock(mutex_);  // local worlds fail from several threads
    failures_.push_back(part);
  }
  void OnTestEnd(const ::testing::TestInfo& t) override {
    if (!failures_.empty()) print_digest();
    failures_.clear();
    forward(&Listener::OnTestEnd, t);
  }
  void OnTestSuiteEnd(const ::testing::TestSuite& s) override { forward(&Listener::OnTestSuiteEnd, s); }
  void OnEnvironmentsTearDownStart(const ::testing::UnitTest& u) override {
    forward(&Listener::OnEnvironmentsTearDownStart, u);
  }
  void OnEnvironmentsTearDownEnd(const ::testing::UnitTest& u) override { forward(&Listener::OnEnvironmentsTearDownEnd, u); }
  void OnTestIterationEnd(const ::testing::UnitTest& u, int i) override {
    if (printer_) printer_->OnTestIterationEnd(u, i);
  }
  void OnTestProgramEnd(const ::testing::UnitTest& u) override { forward(&Listener::OnTestProgramEnd, u); }

 private:
  using Listener = ::testing::TestEventListener;
  template <typename Event, typename Arg>
  void forward(Event event, const Arg& arg) {
    if (printer_) (printer_.get()->*event)(arg);
  }

  void print_digest() {
    // Ranks > 0: the lowest failing rank prints; the others are named by rank 0. A test that
    // never exchanged outcomes (no for_each_world) gets one line from each failing rank.
    std::ostringstream out;
    if (printer_ == nullptr && rank_ != first_failing_rank()) {
      if (first_failing_rank() >= 0) return;
      print_on_rank(one_line(failures_.front()) + "\n");
      return;
    }
    out << full_report(failures_.front());
    if (failures_.size() > 1) {
      out << "  and " << failures_.size() - 1 << " more failure" << (failures_.size() > 2 ? "s" : "")
          << " of this test (CP_VERBOSE=1 prints each in full):\n";
      for (size_t i = 1; i < failures_.size() && i <= kListedFailures; ++i) out << "  " << one_line(failures_[i]) << "\n";
      if (failures_.size() - 1 > kListedFailures) out << "  ... and " << failures_.size() - 1 - kListedFailures << " more\n";
    }
    if (printer_) {
      std::cout << out.str() << std::flush;
    } else {
      print_on_rank(out.str());
    }
  }

  /// Ranks > 0: every line prefixed with the rank, on stderr, in one write.
  void print_on_rank(const std::string& text) const {
    std::string prefixed;
    for (size_t at = 0, next; at < text.size(); at = next + 1) {
      next = text.find('\n', at);
      prefixed += "[rank " + std::to_string(rank_) + "] " + text.substr(at, next == std::string::npos ? next : next - at + 1);
      if (next == std::string::npos) break;
    }
    std::cerr << prefixed << std::flush;
  }

  std::unique_ptr<::testing::TestEventListener> printer_;
  int rank_;
  std::mutex mutex_;
  std::vector<::testing::TestPartResult> failures_;
};

}  // namespace

std::unique_ptr<::testing::TestEventListener> failure_digest(::testing::TestEventListener* printer, int rank) {
  return std::make_unique<FailureDigest>(printer, rank);
}

void note_failing_rank(int rank) {
  int seen = failing_rank.load();
  while ((seen < 0 || rank < seen) && !failing_rank.compare_exchange_weak(seen, rank)) {
  }
}

int first_failing_rank() { return failing_rank.load(); }

}  // namespace cp::testing::detail
