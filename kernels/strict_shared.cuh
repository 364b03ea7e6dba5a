// What the emulation of the matrix-unit instructions refuses, as the hardware does: ldmatrix and
// cp.async read or write shared memory, 16 bytes aligned. And one thing the hardware allows at a
// price: an ldmatrix whose rows share banks (the course's kernels have none, and keep none). On a GPU, ldmatrix on a global address
// faults or reads garbage; under CUDA on the CPU (chipStar + PoCL) every address is an ordinary
// pointer and the same mistake would read the right numbers and pass. So there the emulation
// checks each address against the shared-memory regions the kernel declared (declare_shared) and
// records a fault, and the launcher turns it into a cp::Error (throw_on_emulation_fault).
//
// Under nvcc all of this is empty: the real instructions need no declaration, and
// compute-sanitizer's memcheck reports what they do wrong on a GPU day.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

// The real sm_80 instructions (ldmatrix, mma.sync, cp.async: kernels/mma.cuh, async_copy.cuh), or
// their emulation (CUDA on the CPU, GPUs before sm_80, the host passes of nvcc).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(__HIP_PLATFORM_SPIRV__)
#define CP_SM80_PTX 1
#else
#define CP_SM80_PTX 0
#endif

#if defined(__HIP_PLATFORM_SPIRV__)
#define CP_STRICT_EMULATION 1  // CUDA on the CPU: the emulated instructions check their addresses
#else
#define CP_STRICT_EMULATION 0
#endif

#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#include "common/error.h"

namespace cp::kernels {

/// The kinds of fault, one bit each.
enum EmulationFault : unsigned {
  kLdmatrixNotShared = 1u,     ///< ldmatrix given an address outside the declared shared memory
  kLdmatrixMisaligned = 2u,    ///< an ldmatrix row address not 16-byte aligned
  kAsyncCopyNotShared = 4u,    ///< cp.async's destination outside the declared shared memory
  kAsyncCopyMisaligned = 8u,   ///< a cp.async source or destination not 16-byte aligned
  kAsyncCopyOverflow = 16u,    ///< more copies in flight than the emulation keeps (AsyncCopies)
  kLdmatrixBankConflict = 32u, ///< the 8 rows of an ldmatrix phase on fewer than 8 groups of banks
};

// Everything below has internal linkage: each .cu file is a module of its own under CUDA on the
// CPU, with its own record of faults, and its launchers must read that one.
namespace {

#if CP_STRICT_EMULATION
namespace strict {
// Per block (file-scope __shared__): the regions the kernel declared. Per module: the faults seen
// since the last check.
constexpr int kRegions = 4;
__shared__ uintptr_t region_lo[kRegions], region_hi[kRegions];
__device__ unsigned int faults;
}  // namespace strict
#endif

/// Declares the block's shared-memory regions that ldmatrix may read and cp.async may write
/// (up to 4; later arguments may be null). Every thread calls it; a __syncthreads() must follow
/// before the first ldmatrix or cp.async. Nothing under nvcc.
__device__ __forceinline__ void declare_shared(const void* p0, size_t bytes0, const void* p1 = nullptr,
                                               size_t bytes1 = 0, const void* p2 = nullptr, size_t bytes2 = 0,
                                               const void* p3 = nullptr, size_t bytes3 = 0) {
#if CP_STRICT_EMULATION
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
    const void* p[strict::kRegions] = {p0, p1, p2, p3};
    const size_t bytes[strict::kRegions] = {bytes0, bytes1, bytes2, bytes3};
    for (int i = 0; i < strict::kRegions; ++i) {
      strict::region_lo[i] = reinterpret_cast<uintptr_t>(p[i]);
      strict::region_hi[i] = p[i] ? reinterpret_cast<uintptr_t>(p[i]) + bytes[i] : 0;
    }
  }
#else
  (void)p0, (void)bytes0, (void)p1, (void)bytes1, (void)p2, (void)bytes2, (void)p3, (void)bytes3;
#endif
}

/// Records `not_shared` unless [p, p + 16) lies in a declared region, and `misaligned` unless p
/// is 16-byte aligned (the emulated instructions call it; nothing under nvcc).
__device__ __forceinline__ void expect_shared_16(const void* p, unsigned not_shared, unsigned misaligned) {
#if CP_STRICT_EMULATION
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  bool inside = false;
  for (int i = 0; i < strict::kRegions; ++i) inside |= a >= strict::region_lo[i] && a + 16 <= strict::region_hi[i];
  if (!inside) atomicOr(&strict::faults, not_shared);
  if (a % 16 != 0) atomicOr(&strict::faults, misaligned);
#else
  (void)p, (void)not_shared, (void)misaligned;
#endif
}

/// Records `fault` (an EmulationFault) unless `ok` (nothing under nvcc).
__device__ __forceinline__ void expect(bool ok, unsigned fault) {
#if CP_STRICT_EMULATION
  if (!ok) atomicOr(&strict::faults, fault);
#else
  (void)ok, (void)fault;
#endif
}

/// Host: after a launch of a kernel of this .cu file, waits for `stream` and throws a cp::Error
/// naming `kernel` and what its emulated instructions refused since the last check, then clears
/// the record. Nothing under nvcc.
inline void throw_on_emulation_fault(cudaStream_t stream, const char* kernel) {
#if CP_STRICT_EMULATION
  CUDA_CHECK(cudaStreamSynchronize(stream));
  unsigned int seen = 0;
  CUDA_CHECK(cudaMemcpyFromSymbol(&seen, strict::faults, sizeof seen));
  if (seen == 0) return;
  const unsigned int none = 0;
  CUDA_CHECK(cudaMemcpyToSymbol(strict::faults, &none, sizeof none));
  std::string what;
  auto add = [&](unsigned bit, const char* text) {
    if (seen & bit) what += std::string(what.empty() ? "" : "; ") + text;
  };
  add(kLdmatrixNotShared, "ldmatrix read an address outside the shared memory the kernel declared (on a GPU: a "
                          "fault or garbage; is a fragment loaded straight from global memory?)");
  add(kLdmatrixMisaligned, "an ldmatrix row address is not 16-byte aligned");
  add(kAsyncCopyNotShared, "cp.async wrote outside the shared memory the kernel declared");
  add(kAsyncCopyMisaligned, "a cp.async address is not 16-byte aligned");
  add(kAsyncCopyOverflow, "more cp.async copies in flight than the emulation keeps (wait for a group first)");
  add(kLdmatrixBankConflict, "two of the 8 rows an ldmatrix reads at once share banks (a bank conflict: a GPU reads "
                             "them one after the other; is the tile's row stride padded?)");
  throw Error(std::string(kernel) + ", under CUDA on the CPU: " + what, __FILE__, __LINE__);
#else
  (void)stream, (void)kernel;
#endif
}

/// Host: lets `kernel` take `bytes` of dynamic shared memory. Above 48 KiB a GPU needs the
/// kernel's opt-in (cudaFuncSetAttribute). CUDA on the CPU has no such call (chipStar's CUDA
/// headers lack it) and gives a block 1 MiB: nothing to do there.
template <typename Kernel>
inline void allow_dynamic_shared(Kernel* kernel, int bytes) {
#if CP_STRICT_EMULATION
  (void)kernel, (void)bytes;
#else
  CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  bytes));
#endif
}

}  // namespace
}  // namespace cp::kernels
