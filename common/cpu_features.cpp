#include "common/cpu_features.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "common/error.h"

namespace cp {

SimdLevel best_simd_level() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // __builtin_cpu_supports also checks that the operating system saves the wide registers.
  if (__builtin_cpu_supports("avx512f")) return SimdLevel::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return SimdLevel::kAvx2;
#endif
  return SimdLevel::kBaseline;
}

namespace {

/// -1 until the first simd_level() reads CP_CPU_SIMD; then the level, as an int.
std::atomic<int> chosen_level{-1};

SimdLevel level_from_environment() {
  const SimdLevel best = best_simd_level();
  const char* asked = std::getenv("CP_CPU_SIMD");
  if (asked == nullptr || *asked == '\0') return best;
  for (SimdLevel want : {SimdLevel::kBaseline, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (std::strcmp(asked, name(want)) != 0) continue;
    CP_CHECK(want <= best, "CP_CPU_SIMD=", asked, ": this CPU supports at most ", describe(best));
    return want;
  }
  CP_FAIL("CP_CPU_SIMD=", asked, ": expected baseline, avx2 or avx512");
}

}  // namespace

SimdLevel simd_level() {
  int level = chosen_level.load(std::memory_order_relaxed);
  if (level < 0) {
    level = static_cast<int>(level_from_environment());
    chosen_level.store(level, std::memory_order_relaxed);
  }
  return static_cast<SimdLevel>(level);
}

void set_simd_level(SimdLevel level) {
  CP_CHECK(level <= best_simd_level(), "set_simd_level: ", describe(level), " asked, but this CPU supports at most ",
           describe(best_simd_level()));
  chosen_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

int simd_floats(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512: return 16;
    case SimdLevel::kAvx2: return 8;
    case SimdLevel::kBaseline: break;
  }
  return 4;
}

const char* name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512: return "avx512";
    case SimdLevel::kAvx2: return "avx2";
    case SimdLevel::kBaseline: break;
  }
  return "baseline";
}

std::string describe(SimdLevel level) {
  if (level != SimdLevel::kBaseline) return std::string(name(level)) + " (" + std::to_string(simd_floats(level)) + " floats, FMA)";
#if defined(__x86_64__)
  return "baseline (SSE2, 4 floats)";
#else
  return "baseline (4 floats)";
#endif
}

}  // namespace cp
