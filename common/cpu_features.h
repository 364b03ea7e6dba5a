// Which SIMD instructions the CPU loops of the course may use: detected once at run time, so that
// one binary uses AVX2 or AVX-512 where the CPU has them and runs on any x86-64 (or arm64) where it
// has not. No -march flag: a build with -march=native crashes on a CPU older than the one that
// built it, and its speed says nothing about a learner's machine.
#pragma once

#include <string>

namespace cp {

/// The SIMD level of the CPU loops (lesson 01's softmax, lessons 03 and 05's attention tiles).
enum class SimdLevel {
  kBaseline,  ///< what every CPU of the architecture has: SSE2 on x86-64 (4 floats), NEON on arm64
  kAvx2,      ///< x86-64 with AVX2 and FMA: 8 floats, one fused multiply-add
  kAvx512,    ///< x86-64 with AVX-512F: 16 floats
};

/// The level the loops use: the best the CPU supports, or CP_CPU_SIMD (baseline, avx2, avx512)
/// to ask for a lower one (tests and benchmarks compare the levels on one machine). Asking for a
/// level the CPU lacks is a cp::Error naming CP_CPU_SIMD: it would crash on an illegal instruction.
SimdLevel simd_level();

/// Makes the loops use `level` from now on: tests and benchmarks run every level the CPU has. A
/// level the CPU lacks is a cp::Error.
void set_simd_level(SimdLevel level);

/// The best level this CPU supports, whatever CP_CPU_SIMD says.
SimdLevel best_simd_level();

/// "baseline", "avx2" or "avx512": the names CP_CPU_SIMD takes.
const char* name(SimdLevel level);

/// "baseline (SSE2, 4 floats)", "avx2 (8 floats, FMA)", "avx512 (16 floats, FMA)".
std::string describe(SimdLevel level);

/// Floats per register at this level.
int simd_floats(SimdLevel level);

}  // namespace cp
