// What a cp::Trace writes, read back for the tests of lessons that record one (04, 10, 11).
#pragma once

#include <map>
#include <string>

#include "common/trace.h"

namespace cp::testing {

/// The spans of a written Chrome trace, counted by lane ("cat": "comm", "compute", ...) and by
/// rank ("pid"), and whether the file had the Chrome trace's top-level "traceEvents".
struct TraceContents {
  bool has_trace_events = false;
  std::map<std::string, int> spans_per_lane;
  std::map<int, int> spans_per_rank;
  /// "lanes seen: comm (4 spans), compute (3 spans); ranks seen: 0 (3 spans), 1 (4 spans)", for
  /// a failure message that names what is there instead of dumping the file.
  std::string describe() const;
};

/// Writes `trace` to a temporary file of this process and thread, reads it back and removes it.
TraceContents read_trace(const Trace& trace);

}  // namespace cp::testing
