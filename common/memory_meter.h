// Measured peak memory of a piece of code, per thread: how the demos compare the temporaries
// of the ring and all-gather strategies with numbers instead of formulas.
#pragma once

#include <cstdint>
#include <memory>

namespace cp {

/// While alive, counts the bytes that LibTorch's allocators (CPU, and the CUDA caching
/// allocator) hand to *this thread*, minus those freed again, and keeps the peak. It listens
/// through c10's memory-reporting hook (the one the profiler uses), so it measures real
/// allocations: every temporary, buffer and output made during the scope. Tensors that existed
/// before the meter started are not counted, whichever thread frees them. Meters nest: an inner
/// meter passes every report on to the outer one.
class MemoryMeter {
 public:
  MemoryMeter();
  ~MemoryMeter();
  MemoryMeter(const MemoryMeter&) = delete;
  MemoryMeter& operator=(const MemoryMeter&) = delete;

  /// The highest net allocation seen so far, in bytes.
  int64_t peak_bytes() const;
  /// The net allocation now (allocated − freed since the start), in bytes.
  int64_t current_bytes() const;

 private:
  struct Listener;
  std::shared_ptr<Listener> listener_;
  struct Guard;
  std::unique_ptr<Guard> guard_;
};

}  // namespace cp
