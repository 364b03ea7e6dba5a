#include "common/trace.h"

#include <algorithm>
#include <fstream>
#include <iomanip>

#include "common/error.h"

namespace cp {

void Trace::add(int rank, const std::string& lane, const std::string& name, Clock::time_point start,
                Clock::time_point end) {
  const auto ns = [&](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t - origin_).count();
  };
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.push_back({rank, lane, name, phases_[rank], ns(start), ns(end) - ns(start)});
}

void Trace::set_phase(int rank, const std::string& phase) {
  std::lock_guard<std::mutex> lock(mutex_);
  phases_[rank] = phase;
}

std::vector<Trace::Span> Trace::spans() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return spans_;
}

void Trace::write(const std::string& path) const {
  std::lock_guard<std::mutex> lock(mutex_);
  // In order of start, the longer first at equal starts: an enclosing span before what it holds.
  std::vector<Span> spans = spans_;
  std::stable_sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.start_ns != b.start_ns ? a.start_ns < b.start_ns : a.duration_ns > b.duration_ns;
  });
  std::ofstream out(path);
  CP_CHECK(out.good(), "trace: cannot write ", path);
  // Chrome trace times are in µs: fixed notation with 3 decimals keeps every nanosecond (the
  // default notation, 7.41555e+07, would round to 100 µs and make neighbouring spans overlap).
  out << std::fixed << std::setprecision(3);
  std::map<std::string, int> lanes;  // lane name -> thread id, in order of first span
  std::map<int, bool> ranks;
  out << "{\"traceEvents\": [\n";
  bool first = true;
  for (const Span& s : spans) {
    const int tid = lanes.emplace(s.lane, static_cast<int>(lanes.size())).first->second;
    ranks[s.rank] = true;
    out << (first ? "" : ",\n") << "{\"name\": \"" << s.name << "\", \"cat\": \"" << s.lane
        << "\", \"ph\": \"X\", \"pid\": " << s.rank << ", \"tid\": " << tid << ", \"ts\": " << s.start_ns / 1e3
        << ", \"dur\": " << s.duration_ns / 1e3;
    if (!s.phase.empty()) out << ", \"args\": {\"phase\": \"" << s.phase << "\"}";
    out << "}";
    first = false;
  }
  for (const auto& [rank, unused] : ranks) {
    out << (first ? "" : ",\n") << "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " << rank
        << ", \"args\": {\"name\": \"rank " << rank << "\"}}";
    first = false;
    for (const auto& [lane, tid] : lanes)
      out << ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " << rank << ", \"tid\": " << tid
          << ", \"args\": {\"name\": \"" << lane << "\"}}"
          << ",\n{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": " << rank << ", \"tid\": " << tid
          << ", \"args\": {\"sort_index\": " << tid << "}}";
  }
  out << "\n]}\n";
  CP_CHECK(out.good(), "trace: cannot write ", path);
}

}  // namespace cp
