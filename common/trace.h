// Chrome-trace recording of per-rank compute and communication spans (open the JSON in
// chrome://tracing or https://ui.perfetto.dev) — how a learner *sees* overlap.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace cp {

/// Spans of all ranks of a run; thread-safe, so the ranks of a local world share one.
class Trace {
 public:
  using Clock = std::chrono::steady_clock;

  /// Records [start, end) of `name` on `lane` (e.g. "compute", "comm") of `rank`.
  void add(int rank, const std::string& lane, const std::string& name, Clock::time_point start,
           Clock::time_point end);
  /// Spans of `rank` recorded from now on carry {"phase": phase} in their args (e.g. the strategy
  /// being run), so that the trace of several runs shows which span is whose; "" for none.
  void set_phase(int rank, const std::string& phase);
  /// Writes the Chrome trace JSON ("X" events in order of start, times in µs to the ns; one
  /// process per rank, one thread per lane).
  void write(const std::string& path) const;

  /// One recorded span; start from the trace's origin.
  struct Span {
    int rank;
    std::string lane, name, phase;
    int64_t start_ns, duration_ns;
  };
  /// The spans recorded so far, in the order they ended (for tests that compare their times).
  std::vector<Span> spans() const;

 private:
  mutable std::mutex mutex_;
  std::vector<Span> spans_;
  std::map<int, std::string> phases_;  // rank -> phase of its next spans
  const Clock::time_point origin_ = Clock::now();
};

/// Records a span from construction to destruction; does nothing when trace is null.
class TraceSpan {
 public:
  TraceSpan(Trace* trace, int rank, std::string lane, std::string name)
      : trace_(trace), rank_(rank), lane_(std::move(lane)), name_(std::move(name)), start_(Trace::Clock::now()) {}
  ~TraceSpan() {
    if (trace_) trace_->add(rank_, lane_, name_, start_, Trace::Clock::now());
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  Trace* trace_;
  int rank_;
  std::string lane_, name_;
  Trace::Clock::time_point start_;
};

}  // namespace cp
