// Lesson 17 — every version of the fast forward against float64 attention: lesson 16's whole
// kernel suite (float16 and bfloat16, D = 64 and 128, GQA, shapes that are not multiples of the
// tiles, the rings' causal layouts, windows and documents, scores far from 0), run for each
// version on device buffers (a GPU, or CUDA on the CPU, whose cp.async lands a group only at its
// wait and whose ldmatrix and cp.async refuse addresses outside shared memory); task 1's tile
// copies on their own through a probe kernel.
#include <torch/types.h>

#include <string>

#include "attention_kernel_suite.h"
#include "common/error.h"
#include "fast_forward.h"
#include "testing/device_buffer.h"
#include "testing/harness.h"
#include "testing/oracle.h"

#if CP_WITH_CUDA
#include "17_fast_forward_probes.cuh"
#include "fast_forward.cuh"
#endif

namespace cp {
namespace {

#if CP_WITH_CUDA
using testing::expect_error;
using testing::OracleMask;

/// Version `version` of the ladder as a launch of lesson 03's signature.
testing::AttentionLaunch version(int number) {
  return [number](const void* q, const void* k, const void* v, void* out, float* lse, const int64_t* q_first,
                  const int64_t* q_last, const int64_t* k_pos, const BlockAttentionParams& p, DType dtype,
                  cudaStream_t stream) {
    launch_fast_forward(number, q, k, v, out, lse, q_first, q_last, k_pos, p, dtype, stream);
  };
}

std::string name(int number) { return "version " + std::to_string(number); }

// ── Task 1: the tile's copies ────────────────────────────────────────────────────────────────

CP_TEST(Lesson17Kernels, Task1_TileCopiesLandWhereTheTileSays) {
  CP_REQUIRE_CUDA_RUNTIME();
  for (int64_t d : {64, 128})
    for (int n : {64, 37, 1, 0}) {  // a whole tile, a last tile of 37 rows, of 1, none
      const int64_t rows = 110, row0 = 40;
      // Every element of the source distinct: a piece copied to the wrong place shows.
      const torch::Tensor src = (torch::arange(rows * d, torch::kInt) % 30000 + 1).to(torch::kShort).view({rows, d});
      CudaStream stream;
      DeviceBuffer src_dev(src), tile({64, d + 8}, torch::kShort);
      testing::launch_lesson17_task1_probe({static_cast<const uint16_t*>(src_dev.get()), row0, n,
                                            static_cast<uint16_t*>(tile.get()), d},
                                           stream.get());
      const torch::Tensor got = tile.to_host(stream.get());
      torch::Tensor expected = torch::full({64, d + 8}, static_cast<int16_t>(0x7777), torch::kShort);
      expected.narrow(1, 0, d).zero_();
      expected.narrow(0, 0, n).narrow(1, 0, d).copy_(src.narrow(0, row0, n));
      const torch::Tensor wrong = got.ne(expected);
      const std::string at = "D = " + std::to_string(d) + ", " + std::to_string(n) + " rows from row " +
                             std::to_string(row0);
      EXPECT_EQ(wrong.sum().item<int64_t>(), 0)
          << at << ": " << wrong.sum().item<int64_t>() << " elements of the tile differ; first at (row, col) "
          << (wrong.any().item<bool>() ? torch::nonzero(wrong)[0] : torch::zeros({2}, torch::kLong))
          << " (rows < n: the source's rows from row0; rows >= n: zeros; the 8 padding elements of every row "
          << "untouched)";
    }
}

// ── Every version: lesson 16's suite ─────────────────────────────────────────────────────────

/// The four parts of lesson 16's suite for version `number`.
void expect_version_passes_lesson16s_suite(int number) {
  testing::expect_kernel_for_every_dtype_head_dim_and_group(version(number), name(number));
  testing::expect_kernel_causal_mask_from_global_positions(version(number), name(number));
  testing::expect_kernel_windows_and_documents(version(number), name(number));
  testing::expect_kernel_rows_far_from_zero(version(number), name(number));
}

CP_TEST(Lesson17Kernels, Task2_Version2PassesLesson16sSuite) {
  CP_REQUIRE_CUDA_RUNTIME();
  expect_version_passes_lesson16s_suite(2);
}

CP_TEST(Lesson17Kernels, Task3_Version3PassesLesson16sSuite) {
  CP_REQUIRE_CUDA_RUNTIME();
  expect_version_passes_lesson16s_suite(3);
}

CP_TEST(Lesson17Kernels, Task2_BadInputGivesClearErrors) {
  CP_REQUIRE_CUDA_RUNTIME();
  testing::expect_kernel_matches_oracle(version(2), {1, 1, 1, 4, 4, 64}, {false, {}, {}}, torch::kHalf, 171,
                                        "counts once implemented");
  const testing::KernelInputs half = testing::random_kernel_inputs({1, 1, 1, 4, 4, 64}, torch::kHalf, 1);
  const testing::KernelInputs f32 = testing::random_kernel_inputs({1, 1, 1, 4, 4, 64}, torch::kFloat, 1);
  const testing::KernelInputs d32 = testing::random_kernel_inputs({1, 1, 1, 4, 4, 32}, torch::kHalf, 1);
  const OracleMask none{false, torch::arange(4), torch::arange(4)};
  testing::expect_errors({
      {"version 0", [&] { testing::run_attention_kernel(version(0), half, none, 0.125); }, "version: expected 1"},
      {"version 4", [&] { testing::run_attention_kernel(version(kFastForwardVersions + 1), half, none, 0.125); },
       "version: expected 1"},
      {"float32", [&] { testing::run_attention_kernel(version(2), f32, none, 0.125); },
       "the matrix units take float16 or bfloat16, got float32"},
      {"head dim 32", [&] { testing::run_attention_kernel(version(3), d32, none, 0.125); }, "unsupported head dim 32"},
  });
}
#else
CP_KERNEL_TESTS_NEED_CUDA(Lesson17Kernels)
#endif

}  // namespace
}  // namespace cp
