// A ring schedule that stops early, for the tests of lessons 04 and 05 (lesson 12 derives such
// schedules from any mask): the contiguous layout under a sliding window of at most one chunk,
// so that rank r needs only its own chunk and the one before it, the chunks of steps 0 and 1.
#pragma once

#include <algorithm>

#include "ring_attention.h"

namespace cp::testing {

/// The contiguous layout, causal with a window of `window` <= chunk keys: two ring steps.
inline RingSchedule two_step_window_schedule(int64_t window) {
  RingSchedule schedule = contiguous_schedule();
  schedule.plan = [window](int rank, int source, int, int64_t chunk, bool causal) {
    CP_CHECK(causal && window <= chunk, "two_step_window_schedule: causal, with a window of at most one chunk");
    if (source != rank && source != rank - 1) return BlockPlan{};  // beyond the window (or after the queries)
    BlockPlan plan{true, 0, chunk, 0, chunk, true};
    plan.window = window;
    return plan;
  };
  schedule.steps = [](int world, int64_t, bool) { return std::min(world, 2); };
  return schedule;
}

}  // namespace cp::testing
