// Copies from global to shared memory that run while the warps compute (cp.async, sm_80 and
// newer): a thread issues 16-byte copies, closes them into a group with commit(), and waits for
// all its groups (wait_all) or all but the newest (wait_all_but_newest). A __syncthreads() after
// the wait makes every thread's finished copies visible to the whole block. FlashAttention-2's
// kernels load the next tiles of K and V this way while the matrix units work on the current ones.
//
// Under CUDA on the CPU there is no cp.async. AsyncCopies keeps each thread's copies and performs
// a group's only when a wait retires it, in the order they were committed: a kernel that reads a
// tile before waiting for its group reads the bytes that were there before, and fails its tests,
// as it may on a GPU. It also refuses what the hardware refuses (kernels/strict_shared.cuh): a
// destination outside the shared memory the kernel declared, an address not 16-byte aligned.
#pragma once

#include <cstdint>

#include "kernels/strict_shared.cuh"

namespace cp::kernels {

/// One thread's asynchronous copies. kMaxInFlight: the most copies the thread issues between two
/// waits that retire them, and the most groups in flight (the emulation's storage; the hardware
/// needs none of it).
template <int kMaxInFlight>
class AsyncCopies {
 public:
  /// Starts copying the 16 bytes at global `src` to shared `dst` (both 16-byte aligned).
  __device__ __forceinline__ void copy16(void* dst, const void* src) {
#if CP_SM80_PTX
    const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(src));
#else
    expect_shared_16(dst, kAsyncCopyNotShared, kAsyncCopyMisaligned);
    expect(reinterpret_cast<uintptr_t>(src) % 16 == 0, kAsyncCopyMisaligned);
    if (count_ == kMaxInFlight) {
      expect(false, kAsyncCopyOverflow);
      return;
    }
    dst_[count_] = dst;
    src_[count_] = src;
    ++count_;
#endif
  }

  /// Closes the group of the copies issued since the last commit (it may be empty).
  __device__ __forceinline__ void commit() {
#if CP_SM80_PTX
    asm volatile("cp.async.commit_group;\n" ::);
#else
    if (groups_ == kMaxInFlight) {
      expect(false, kAsyncCopyOverflow);
      return;
    }
    group_end_[groups_++] = count_;
#endif
  }

  /// Returns once every committed group of this thread has landed in shared memory (visible to
  /// the other threads after a __syncthreads()).
  __device__ __forceinline__ void wait_all() { wait<0>(); }
  /// Returns once every committed group but the newest has landed: the newest may still fly.
  __device__ __forceinline__ void wait_all_but_newest() { wait<1>(); }

 private:
  /// cp.async.wait_group kPending: at most kPending groups still in flight.
  template <int kPending>
  __device__ __forceinline__ void wait() {
#if CP_SM80_PTX
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#else
    const int retire = groups_ - kPending;  // the oldest groups land now
    if (retire <= 0) return;
    const int landed = group_end_[retire - 1];
    for (int i = 0; i < landed; ++i) *static_cast<uint4*>(dst_[i]) = *static_cast<const uint4*>(src_[i]);
    for (int i = landed; i < count_; ++i) dst_[i - landed] = dst_[i], src_[i - landed] = src_[i];
    count_ -= landed;
    for (int g = retire; g < groups_; ++g) group_end_[g - retire] = group_end_[g] - landed;
    groups_ -= retire;
#endif
  }

#if !CP_SM80_PTX
  void* dst_[kMaxInFlight];
  const void* src_[kMaxInFlight];
  int group_end_[kMaxInFlight];  // copies issued before each group's commit
  int count_ = 0, groups_ = 0;
#endif
};

}  // namespace cp::kernels
