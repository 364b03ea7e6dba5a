// Lesson 17 — the ladder's names and its torch side (host code; the kernels are in fast_forward.cu).
#include "fast_forward.h"

#include <atomic>

#include "common/error.h"
#include "tensor_cores.h"

#if CP_WITH_CUDA
#include "common/device.h"
#include "fast_forward.cuh"
#endif

namespace cp {

const char* fast_forward_version_name(int version) {
  CP_CHECK(version >= 1 && version <= kFastForwardVersions, "version: expected 1 … ", kFastForwardVersions, ", got ",
           version);
  static const char* const names[] = {"lesson 16's kernel", "cp.async in FlashAttention-2's order",
                                      "masks only on cut tiles, exp2", "128 rows a block, ldmatrix.x4",
                                      "the longest blocks first"};
  return names[version - 1];
}

AttnResult attention_forward_fast(int version, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const AttentionMask& mask, std::optional<double> scale) {
  fast_forward_version_name(version);  // checks the number
#if CP_WITH_CUDA
  return attention_forward_matrix_units(&launch_fast_forward, version, q, k, v, mask, scale);
#else
  return attention_forward_tensor_cores(q, k, v, mask, scale);  // its checks, and the error without CUDA
#endif
}

namespace {

std::atomic<int> selected_version{0};

/// Lesson 03's override: the selected version for the inputs the matrix units take.
std::optional<AttnResult> forward_on_selected_version(const torch::Tensor& q, const torch::Tensor& k,
                                                      const torch::Tensor& v, const AttentionMask& mask,
                                                      std::optional<double> scale) {
#if CP_WITH_CUDA
  if (!takes_tensor_cores(q.scalar_type(), q.size(3), compute_capability_major(q.device()))) return std::nullopt;
  return attention_forward_fast(selected_version.load(), q, k, v, mask, scale);
#else
  (void)q, (void)k, (void)v, (void)mask, (void)scale;
  return std::nullopt;  // no CUDA tensor reaches here without CUDA
#endif
}

}  // namespace

void use_fast_forward(int version) {
  if (version != 0) fast_forward_version_name(version);  // checks the number
  selected_version.store(version);
  set_cuda_forward_override(version != 0 ? &forward_on_selected_version : nullptr);
}

}  // namespace cp
