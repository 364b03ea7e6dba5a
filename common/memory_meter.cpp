#include "common/memory_meter.h"

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <unordered_map>

namespace cp {

namespace {
// The type of the two running totals c10 passes to reportMemoryUsage: int64_t in LibTorch 1.x,
// size_t in 2.x. An override must repeat the base's signature exactly, so the type is read from
// the base class itself rather than from a version number.
template <class> struct ReportTotals;
template <class Base, class Total>
struct ReportTotals<void (Base::*)(void*, int64_t, Total, Total, c10::Device)> {
  using type = Total;
};
using ReportTotal = ReportTotals<decltype(&c10::MemoryReportingInfoBase::reportMemoryUsage)>::type;
}  // namespace

struct MemoryMeter::Listener : c10::MemoryReportingInfoBase {
  // The outer listener (an enclosing meter or the profiler) outlives this one: scopes nest.
  explicit Listener(c10::DebugInfoBase* outer) : outer(dynamic_cast<c10::MemoryReportingInfoBase*>(outer)) {}

  void reportMemoryUsage(void* ptr, int64_t bytes, ReportTotal total_allocated, ReportTotal total_reserved,
                         c10::Device device) override {
    if (bytes > 0) {
      live[ptr] = bytes;
      current += bytes;
      peak = std::max(peak, current);
    } else if (auto it = live.find(ptr); it != live.end()) {  // a free; one from before the meter is not ours
      current -= it->second;
      live.erase(it);
    }
    if (outer && outer->memoryProfilingEnabled())
      outer->reportMemoryUsage(ptr, bytes, total_allocated, total_reserved, device);
  }
  bool memoryProfilingEnabled() const override { return true; }

  c10::MemoryReportingInfoBase* outer;
  std::unordered_map<void*, int64_t> live;  // allocations made while the meter runs, not yet freed
  int64_t current = 0, peak = 0;
};

// The hook is the thread-local PROFILER_STATE debug info; the guard installs ours for the
// meter's lifetime and puts back whatever was there.
struct MemoryMeter::Guard {
  explicit Guard(std::shared_ptr<Listener> listener)
      : guard(c10::DebugInfoKind::PROFILER_STATE, std::move(listener)) {}
  c10::DebugInfoGuard guard;
};

MemoryMeter::MemoryMeter()
    : listener_(std::make_shared<Listener>(c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE))),
      guard_(std::make_unique<Guard>(listener_)) {}

MemoryMeter::~MemoryMeter() = default;

int64_t MemoryMeter::peak_bytes() const { return listener_->peak; }
int64_t MemoryMeter::current_bytes() const { return listener_->current; }

}  // namespace cp
