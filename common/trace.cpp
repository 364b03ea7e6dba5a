#include "common/trace.h"

#include <fstream>
#include <map>

#include "common/error.h"

namespace cp {

void Trace::add(int rank, const std::string& lane, const std::string& name, Clock::time_point start,
                Clock::time_point end) {
  const auto us = [&](Clock::time_point t) { return std::chrono::duration<double, std::micro>(t - origin_).count(); };
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.push_back({rank, lane, name, us(start), us(end) - us(start)});
}

void Trace::write(const std::string& path) const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::ofstream out(path);
  CP_CHECK(out.good(), "trace: cannot write ", path);
  std::map<std::string, int> lanes;  // lane name -> thread id, in order of appearance
  std::map<int, bool> ranks;
  out << "{\"traceEvents\": [\n";
  bool first = true;
  for (const Span& s : spans_) {
    const int tid = lanes.emplace(s.lane, static_cast<int>(lanes.size())).first->second;
    ranks[s.rank] = true;
    out << (first ? "" : ",\n") << "{\"name\": \"" << s.name << "\", \"cat\": \"" << s.lane
        << "\", \"ph\": \"X\", \"pid\": " << s.rank << ", \"tid\": " << tid << ", \"ts\": " << s.start_us
        << ", \"dur\": " << s.duration_us << "}";
    first = false;
  }
  for (const auto& [rank, unused] : ranks) {
    out << (first ? "" : ",\n") << "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " << rank
        << ", \"args\": {\"name\": \"rank " << rank << "\"}}";
    first = false;
    for (const auto& [lane, tid] : lanes)
      out << ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " << rank << ", \"tid\": " << tid
          << ", \"args\": {\"name\": \"" << lane << "\"}}";
  }
  out << "\n]}\n";
}

}  // namespace cp
