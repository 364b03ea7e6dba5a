// Lesson 17 — every version of the fast forward against float64 attention: lesson 16's whole
// kernel suite (float16 and bfloat16, D = 64 and 128, GQA, shapes that are not multiples of the
// tiles, the rings' causal layouts, windows and documents, scores far from 0), run for each
// version on device buffers (a GPU, or CUDA on the CPU, whose cp.async lands a group only at its
// wait and whose ldmatrix and cp.async refuse addresses outside shared memory); tasks 1 and 4's
// steps on their own through probe kernels, task 5's order on the CPU.
#include <torch/types.h>

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <cmath>

#include "attention_kernel_suite.h"
#include "block_order.h"
#include "common/error.h"
#include "common/tolerance.h"
#include "common/world.h"
#include "fast_forward.h"
#include "ring_attention.h"
#include "testing/device_buffer.h"
#include "testing/harness.h"
#include "testing/oracle.h"

#if CP_WITH_CUDA
#include "17_fast_forward_probes.cuh"
#include "fast_forward.cuh"
#endif

namespace cp {
namespace {

std::string name(int number) { return "version " + std::to_string(number); }

// ── Task 5: the order of the blocks (host code: no GPU needed) ─────────────────────────────────

CP_TEST(Lesson17, Task5_EveryBlockOnceTheLongestFirst) {
#ifdef CP_LESSON17_TASK5_NOT_STARTED
  throw NotImplemented("lesson 17, task 5: block_work (delete the #define of task 5 in block_order.h once written)");
#endif
  for (const auto& [heads, row_blocks] : std::vector<std::pair<int, int>>{{1, 1}, {1, 7}, {16, 1}, {3, 5}, {32, 64}}) {
    const std::string grid = std::to_string(heads) + " heads × " + std::to_string(row_blocks) + " row blocks";
    std::set<std::pair<int, int>> seen;
    int previous_work = INT32_MAX;
    for (int launched = 0; launched < heads * row_blocks; ++launched) {
      const BlockWork w = block_work(launched, heads, row_blocks);
      ASSERT_TRUE(w.bh >= 0 && w.bh < heads && w.row_block >= 0 && w.row_block < row_blocks)
          << grid << ": block " << launched << " got (bh " << w.bh << ", row block " << w.row_block
          << "), outside the grid";
      EXPECT_TRUE(seen.insert({w.bh, w.row_block}).second)
          << grid << ": (bh " << w.bh << ", row block " << w.row_block << ") is the work of two blocks";
      // Causal, with Sq = Sk: the rows of row block r see about r + 1 tiles of keys.
      const int work = w.row_block + 1;
      EXPECT_LE(work, previous_work) << grid << ": block " << launched << " (row block " << w.row_block
                                     << ") starts after a block with less work (a short block first leaves "
                                     << "a long one for the last wave)";
      previous_work = work;
    }
  }
}

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

// ── Task 4: two groups of rows, every ldmatrix an .x4 ───────────────────────────────────────

CP_TEST(Lesson17Kernels, Task4_WideStepsComputeBothGroupsProducts) {
  CP_REQUIRE_CUDA_RUNTIME();
  for (int64_t d : {64, 128}) {
    // Small integers: every product and sum exact in float32 and every score exact in float16,
    // so the steps must match float64 exactly; each row, key and dim different, so that a
    // fragment from the wrong place shows.
    auto small = [](int64_t rows, int64_t cols, int64_t seed) {
      return ((torch::arange(rows * cols, torch::kLong) * (2 * seed + 1) + seed) % 5 - 2).view({rows, cols});
    };
    const torch::Tensor q = small(128, d, 1), k = small(64, d, 2), v = small(64, d, 3);
    CudaStream stream;
    DeviceBuffer q_dev(q.to(torch::kHalf)), k_dev(k.to(torch::kHalf)), v_dev(v.to(torch::kHalf));
    DeviceBuffer scores({128, 64}, torch::kFloat), out({128, d}, torch::kFloat);
    testing::launch_lesson17_task4_probe({q_dev.get(), k_dev.get(), v_dev.get(), scores.as<float>(), out.as<float>(), d},
                                         stream.get());
    const torch::Tensor s_expected = torch::matmul(q.to(torch::kDouble), k.to(torch::kDouble).t());
    const torch::Tensor o_expected = torch::matmul(s_expected, v.to(torch::kDouble));
    const std::string at = "D = " + std::to_string(d);
    const torch::Tensor s_got = scores.to_host(stream.get()).to(torch::kDouble);
    const torch::Tensor o_got = out.to_host(stream.get()).to(torch::kDouble);
    const torch::Tensor s_wrong = s_got.ne(s_expected), o_wrong = o_got.ne(o_expected);
    EXPECT_EQ(s_wrong.sum().item<int64_t>(), 0)
        << at << ": compute_scores_wide: " << s_wrong.sum().item<int64_t>() << " of 128×64 scores differ from Q·Kᵀ; "
        << "rows with a wrong score: " << torch::nonzero(s_wrong.any(1)).flatten()
        << " (rows 32w … 32w+15 are warp w's group 0, 32w+16 … 32w+31 its group 1)";
    EXPECT_EQ(o_wrong.sum().item<int64_t>(), 0)
        << at << ": accumulate_pv_wide: " << o_wrong.sum().item<int64_t>() << " of 128×" << d
        << " outputs differ from P·V (P = the scores); dims with a wrong output: "
        << torch::nonzero(o_wrong.any(0)).flatten();
  }
}

CP_TEST(Lesson17Kernels, Task1_EachQuarterWarpsCopiesFallOnDifferentBanks) {
  CP_REQUIRE_CUDA_RUNTIME();
  for (int64_t d : {64, 128}) {
    // A whole tile, every copy issued; the log holds each copy's place in the tile (16-byte pieces).
    const int copies = static_cast<int>(64 * d / 8 / 128);
    const torch::Tensor src = torch::zeros({64, d}, torch::kShort);
    CudaStream stream;
    DeviceBuffer src_dev(src), tile({64, d + 8}, torch::kShort), places(torch::full({128, copies}, -1, torch::kInt));
    testing::Lesson17Task1Probe probe{static_cast<const uint16_t*>(src_dev.get()), 0, 64,
                                      static_cast<uint16_t*>(tile.get()), d};
    probe.places = places.as<int32_t>();
    testing::launch_lesson17_task1_probe(probe, stream.get());
    const torch::Tensor got = places.to_host(stream.get());
    ASSERT_EQ(got.eq(-1).sum().item<int64_t>(), 0)
        << "D = " << d << ": a thread issued fewer than " << copies << " copies for a whole tile:\n" << got;
    // A GPU stores a warp's 16-byte pieces a quarter-warp (8 lanes, 128 bytes) at a time; 8 pieces
    // on 8 different groups of 4 banks, (place mod 8), go at once, two on one group take turns.
    for (int warp = 0; warp < 4; ++warp)
      for (int i = 0; i < copies; ++i)
        for (int quarter = 0; quarter < 4; ++quarter) {
          const torch::Tensor lanes = got.narrow(0, 32 * warp + 8 * quarter, 8).select(1, i);
          const int64_t groups = std::get<0>(torch::_unique(lanes.remainder(8))).numel();
          EXPECT_EQ(groups, 8) << "D = " << d << ", copy " << i << " of warp " << warp << ", lanes "
                               << 8 * quarter << "–" << 8 * quarter + 7 << ": the pieces " << lanes
                               << " fall on " << groups << " groups of banks, not 8 (a bank conflict)";
        }
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

CP_TEST(Lesson17Kernels, Task4_Version4PassesLesson16sSuite) {
  CP_REQUIRE_CUDA_RUNTIME();
  expect_version_passes_lesson16s_suite(4);
}

CP_TEST(Lesson17Kernels, Task5_Version5PassesLesson16sSuite) {
  CP_REQUIRE_CUDA_RUNTIME();
  expect_version_passes_lesson16s_suite(5);
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
      {"version past the last", [&] { testing::run_attention_kernel(version(kFastForwardVersions + 1), half, none, 0.125); },
       "version: expected 1"},
      {"float32", [&] { testing::run_attention_kernel(version(2), f32, none, 0.125); },
       "the matrix units take float16 or bfloat16, got float32"},
      {"head dim 32", [&] { testing::run_attention_kernel(version(3), d32, none, 0.125); }, "unsupported head dim 32"},
  });
}
#else
CP_KERNEL_TESTS_NEED_CUDA(Lesson17Kernels)
#endif

// ── The torch side: a version by number, and every ring on it ────────────────────────────────

CP_TEST(Lesson17, TorchSideRefusesWhatItCannotRun) {
  const torch::Tensor q = torch::zeros({1, 1, 4, 64}, torch::kHalf);
  testing::expect_errors({
      {"version 0", [&] { attention_forward_fast(0, q, q, q); }, "version: expected 1"},
      {"use_fast_forward(6)", [&] { use_fast_forward(kFastForwardVersions + 1); }, "version: expected 1"},
      {"CPU tensors", [&] { attention_forward_fast(4, q, q, q); }, "the matrix units are a GPU's"},
      {"float32", [&] { attention_forward_fast(4, q.to(torch::kFloat), q, q); }, "float16 or bfloat16"},
  });
}

/// use_fast_forward(version) for the scope; lesson 03's kernel again after it, even on a failure.
struct FastForwardInScope {
  explicit FastForwardInScope(int version) { use_fast_forward(version); }
  ~FastForwardInScope() { use_fast_forward(0); }
  FastForwardInScope(const FastForwardInScope&) = delete;
  FastForwardInScope& operator=(const FastForwardInScope&) = delete;
};

CP_TEST(Lesson17Cuda, EveryVersionOnCudaTensorsAndTheRingOnTheChosenOne) {
  CP_REQUIRE_GPU();
  const std::vector<std::string> dims = {"b", "h", "s", "d"};
  const testing::KernelCase c{1, 4, 2, 192, 192, 64};
  const testing::KernelInputs in = testing::random_kernel_inputs(c, torch::kBFloat16, 171);
  const torch::Tensor q = in.q.cuda(), k = in.k.cuda(), v = in.v.cuda();
  const double scale = 1.0 / std::sqrt(64.0);
  const auto [out, lse] = testing::oracle_attention(in.q.to(torch::kDouble), in.k.to(torch::kDouble),
                                                    in.v.to(torch::kDouble), true, torch::arange(c.seq_q),
                                                    torch::arange(c.seq_k), scale);
  for (int version = 1; version <= kFastForwardVersions; ++version) {
    const AttnResult got = attention_forward_fast(version, q, k, v, causal_mask(true));
    CP_EXPECT_CLOSE(got.out.cpu(), out, "out, " + name(version), dims, matrix_unit_tolerance(in.v));
    CP_EXPECT_CLOSE(got.lse.cpu(), lse, "lse, " + name(version), {"b", "h", "s"});
  }
  const FastForwardInScope on(kFastForwardVersions);
  // The kernels are deterministic: the same bits say which one ran.
  const AttnResult selected = attention_block_forward(q, k, v, causal_mask(true));
  const AttnResult direct = attention_forward_fast(kFastForwardVersions, q, k, v, causal_mask(true));
  EXPECT_TRUE(torch::equal(selected.out, direct.out) && torch::equal(selected.lse, direct.lse))
      << "attention_block_forward after use_fast_forward(" << kFastForwardVersions << ") is not that version";
  // Lesson 04's ring on 3 ranks sharing the GPU, each block on the chosen version.
  run_local_world(3, [&](Comm& comm) {
    auto mine = [&](const torch::Tensor& t) { return t.narrow(2, comm.rank() * 64, 64); };
    const RingResult r = ring_attention_forward(comm, mine(q), mine(k), mine(v), ring_options(true));
    const std::string what = "ring on " + name(kFastForwardVersions) + ", rank " + std::to_string(comm.rank());
    CP_EXPECT_CLOSE(r.out.cpu(), mine(out), "out, " + what, dims, merged_tolerance(in.v, matrix_unit_tolerance(in.v)));
    CP_EXPECT_CLOSE(r.lse.cpu(), mine(lse), "lse, " + what, {"b", "h", "s"});
  });
}

}  // namespace
}  // namespace cp
