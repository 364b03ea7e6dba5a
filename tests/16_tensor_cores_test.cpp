// Lesson 16 — the block attention forward on the matrix units, against float64 attention: float16
// and bfloat16, D = 64 and 128, shapes that are not multiples of the tiles, GQA, causal masks from
// global positions (rows that see no key included), sliding windows and packed documents. The
// kernel runs on device buffers (a GPU, or CUDA on the CPU, whose mma is the emulation of
// kernels/mma.cuh); the torch function on CUDA tensors where a GPU is present.
#include <torch/types.h>

#include <cmath>

#include "common/error.h"
#include "common/tensor_checks.h"
#include "common/tolerance.h"
#include "common/world.h"
#include "ring_attention.h"
#include "tensor_cores.h"
#include "testing/device_buffer.h"
#include "testing/harness.h"
#include "testing/oracle.h"

#if CP_WITH_CUDA
#include "tensor_core_attention.cuh"
#endif

namespace cp {
namespace {

using testing::expect_error;
using testing::OracleMask;

const std::vector<std::string> kDims = {"b", "h", "s", "d"};

struct Case {
  int64_t batch, heads_q, heads_kv, seq_q, seq_k, head_dim;
};

struct Inputs {
  torch::Tensor q, k, v;  // in the dtype under test, on the CPU
};

Inputs random_inputs(const Case& c, torch::ScalarType dtype, uint64_t seed) {
  auto make = [&](int64_t heads, int64_t seq, uint64_t salt) {
    return testing::random_with_outliers({c.batch, heads, seq, c.head_dim}, seed * 3 + salt, 1.0, 0.0).to(dtype);
  };
  return {make(c.heads_q, c.seq_q, 0), make(c.heads_kv, c.seq_k, 1), make(c.heads_kv, c.seq_k, 2)};
}

#if CP_WITH_CUDA
using testing::DeviceBuffer;
using testing::TestStream;

AttnResult run_kernel(const Inputs& in, const OracleMask& mask, double scale) {
  AttentionMask am;
  am.causal = mask.causal;
  am.q_positions = mask.q_pos;
  am.k_positions = mask.k_pos;
  am.window = mask.window;
  am.documents = mask.documents;
  const VisibleKeys keys = visible_keys(am, mask.q_pos);
  const BlockAttentionParams p{in.q.size(0), in.q.size(1), in.k.size(1), in.q.size(2), in.k.size(2), in.q.size(3),
                               static_cast<float>(scale), keys.masked};
  TestStream stream;
  DeviceBuffer q(in.q), k(in.k), v(in.v), k_pos(mask.k_pos);
  DeviceBuffer first(keys.masked ? keys.first : mask.q_pos), last(keys.masked ? keys.last : mask.q_pos);
  DeviceBuffer out(in.q.sizes().vec(), in.q.scalar_type()), lse({p.batch, p.heads_q, p.seq_q}, torch::kFloat);
  launch_tensor_core_attention_forward(q.get(), k.get(), v.get(), out.get(), lse.as<float>(), first.as<int64_t>(),
                                       last.as<int64_t>(), k_pos.as<int64_t>(), p, kernel_dtype(in.q, "q"),
                                       stream.get());
  return {out.to_host(stream.get()), lse.to_host(stream.get())};
}

void check_kernel(const Case& c, OracleMask mask, torch::ScalarType dtype, uint64_t seed, const std::string& what) {
  if (!mask.q_pos.defined()) mask.q_pos = torch::arange(c.seq_q);
  if (!mask.k_pos.defined()) mask.k_pos = torch::arange(c.seq_k);
  const Inputs in = random_inputs(c, dtype, seed);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const auto [out, lse] = testing::oracle_attention(in.q.to(torch::kDouble), in.k.to(torch::kDouble),
                                                    in.v.to(torch::kDouble), mask, scale);
  const AttnResult got = run_kernel(in, mask, scale);
  const std::string name = what + ", " + std::string(dtype == torch::kHalf ? "float16" : "bfloat16") + ", B" +
                           std::to_string(c.batch) + " Hq" + std::to_string(c.heads_q) + " Hkv" +
                           std::to_string(c.heads_kv) + " Sq" + std::to_string(c.seq_q) + " Sk" +
                           std::to_string(c.seq_k) + " D" + std::to_string(c.head_dim);
  CP_EXPECT_CLOSE(got.out, out, "out, " + name, kDims, matrix_unit_tolerance(in.v));
  CP_EXPECT_CLOSE(got.lse, lse, "lse, " + name, {"b", "h", "s"});
}

CP_TEST(Lesson16Kernels, Task3_KernelMatchesTheOracleForEveryDtypeHeadDimAndGroup) {
  CP_REQUIRE_CUDA_RUNTIME();
  const std::vector<Case> cases = {
      {1, 1, 1, 1, 1, 64},     // one query, one key
      {2, 4, 2, 70, 130, 64},  // GQA 2, neither length a multiple of a tile
      {1, 8, 1, 64, 64, 128},  // MQA, exactly one tile
      {1, 4, 4, 17, 200, 128}, // fewer queries than a warp's 16 rows in the last block, four key tiles
  };
  uint64_t seed = 160;
  for (auto dtype : {torch::kHalf, torch::kBFloat16})
    for (const Case& c : cases)
      for (bool causal : {false, true}) check_kernel(c, {causal, {}, {}}, dtype, seed++, causal ? "causal" : "full");
}

CP_TEST(Lesson16Kernels, Task3_KernelCausalMaskFromGlobalPositions) {
  CP_REQUIRE_CUDA_RUNTIME();
  const int64_t s = 150;  // three 64-row blocks and three 64-key tiles, a multiple of neither
  for (const testing::PositionLayout& layout : testing::causal_position_layouts(s))
    for (int64_t d : {64, 128})
      check_kernel({1, 4, 2, s, s, d}, {true, layout.q_pos, layout.k_pos}, d == 64 ? torch::kBFloat16 : torch::kHalf,
                   161, layout.name);
}

CP_TEST(Lesson16Kernels, Task3_KernelWindowsAndDocuments) {
  CP_REQUIRE_CUDA_RUNTIME();
  const int64_t s = 150;
  for (const auto& [name, mask] : testing::window_and_document_masks(s))
    for (auto dtype : {torch::kHalf, torch::kBFloat16}) check_kernel({1, 4, 2, s, s, 64}, mask, dtype, 162, name);
}

CP_TEST(Lesson16Kernels, Task3_KernelRejectsFloat32AndOtherHeadDims) {
  CP_REQUIRE_CUDA_RUNTIME();
  check_kernel({1, 1, 1, 4, 4, 64}, {false, {}, {}}, torch::kHalf, 163, "counts once implemented");
  const Inputs f32 = random_inputs({1, 1, 1, 4, 4, 64}, torch::kFloat, 1);
  expect_error([&] { run_kernel(f32, {false, torch::arange(4), torch::arange(4)}, 0.125); },
               "the matrix units take float16 or bfloat16, got float32");
  const Inputs d32 = random_inputs({1, 1, 1, 4, 4, 32}, torch::kHalf, 1);
  expect_error([&] { run_kernel(d32, {false, torch::arange(4), torch::arange(4)}, 0.125); }, "unsupported head dim 32");
  // q one element past a 16-byte boundary (a view into the middle of a row): the loads need 16.
  const Inputs in = random_inputs({1, 1, 1, 4, 4, 64}, torch::kHalf, 1);
  TestStream stream;
  DeviceBuffer q(in.q), k(in.k), v(in.v), pos(torch::arange(4));
  DeviceBuffer out(in.q.sizes().vec(), in.q.scalar_type()), lse({1, 1, 4}, torch::kFloat);
  const BlockAttentionParams p{1, 1, 1, 3, 4, 64, 0.125f, false};
  expect_error([&] { launch_tensor_core_attention_forward(static_cast<const char*>(q.get()) + 2, k.get(), v.get(),
                                                          out.get(), lse.as<float>(), pos.as<int64_t>(), pos.as<int64_t>(),
                                                          pos.as<int64_t>(), p, DType::Float16, stream.get()); },
               "must start on a 16-byte boundary");
  // The torch function refuses before any GPU is touched, so these run without one too.
  expect_error([&] { attention_forward_tensor_cores(torch::zeros({1, 1, 4, 64}), torch::zeros({1, 1, 4, 64}),
                                                    torch::zeros({1, 1, 4, 64})); },
               "q: the matrix units take float16 or bfloat16");
  const auto half_cpu = torch::TensorOptions().dtype(torch::kHalf);
  expect_error([&] { attention_forward_tensor_cores(torch::zeros({1, 1, 4, 64}, half_cpu), torch::zeros({1, 1, 4, 64}, half_cpu),
                                                    torch::zeros({1, 1, 4, 64}, half_cpu)); },
               "q: the matrix units are a GPU's");
}
#else
CP_KERNEL_TESTS_NEED_CUDA(Lesson16Kernels)
#endif

// ── CUDA tensors (a GPU and a CUDA LibTorch) ───────────────────────────────────────────────

CP_TEST(Lesson16Cuda, Task3_ForwardOnCudaTensorsMatchesTheOracle) {
  CP_REQUIRE_GPU();
  const Case c{2, 8, 2, 300, 300, 128};
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    const Inputs in = random_inputs(c, dtype, 164);
    const double scale = 1.0 / std::sqrt(128.0);
    const auto [out, lse] = testing::oracle_attention(in.q.to(torch::kDouble), in.k.to(torch::kDouble),
                                                      in.v.to(torch::kDouble), true, torch::arange(c.seq_q),
                                                      torch::arange(c.seq_k), scale);
    const AttnResult got = attention_forward_tensor_cores(in.q.cuda(), in.k.cuda(), in.v.cuda(), causal_mask(true));
    CP_EXPECT_CLOSE(got.out.cpu(), out, "out on cuda", kDims, matrix_unit_tolerance(in.v));
    CP_EXPECT_CLOSE(got.lse.cpu(), lse, "lse on cuda", {"b", "h", "s"});
  }
}

/// use_tensor_cores(true) for the scope; lesson 03's kernel again after it, even on a failure.
struct TensorCoresInScope {
  TensorCoresInScope() { use_tensor_cores(true); }
  ~TensorCoresInScope() { use_tensor_cores(false); }
  TensorCoresInScope(const TensorCoresInScope&) = delete;
  TensorCoresInScope& operator=(const TensorCoresInScope&) = delete;
};

CP_TEST(Lesson16Cuda, Task3_UseTensorCoresRunsLesson03sForwardAndTheRingsOnTheMatrixUnits) {
  CP_REQUIRE_GPU();
  const Case c{1, 4, 2, 192, 192, 64};
  const Inputs in = random_inputs(c, torch::kBFloat16, 165);
  const torch::Tensor q = in.q.cuda(), k = in.k.cuda(), v = in.v.cuda();
  const AttnResult lesson03 = attention_block_forward(q, k, v, causal_mask(true));
  const AttnResult float32_before = attention_block_forward(q.to(torch::kFloat), k.to(torch::kFloat),
                                                            v.to(torch::kFloat), causal_mask(true));
  const TensorCoresInScope on;
  // The kernels are deterministic: the same bits say which one ran.
  const AttnResult selected = attention_block_forward(q, k, v, causal_mask(true));
  const AttnResult tensor_cores = attention_forward_tensor_cores(q, k, v, causal_mask(true));
  EXPECT_TRUE(torch::equal(selected.out, tensor_cores.out) && torch::equal(selected.lse, tensor_cores.lse))
      << "attention_block_forward on bfloat16 CUDA tensors after use_tensor_cores(true) is not the matrix-unit kernel";
  EXPECT_FALSE(torch::equal(selected.out, lesson03.out))
      << "out on the matrix units equals lesson 03's kernel bit for bit: P's rounding to bfloat16 should show";
  const AttnResult float32_after = attention_block_forward(q.to(torch::kFloat), k.to(torch::kFloat),
                                                           v.to(torch::kFloat), causal_mask(true));
  EXPECT_TRUE(torch::equal(float32_after.out, float32_before.out))
      << "float32 must stay on lesson 03's kernel (the matrix units take 16-bit inputs)";
  EXPECT_TRUE(takes_tensor_cores(torch::kHalf, 128, 9) && takes_tensor_cores(torch::kBFloat16, 64, 8));
  EXPECT_FALSE(takes_tensor_cores(torch::kFloat, 64, 9) || takes_tensor_cores(torch::kHalf, 32, 9) ||
               takes_tensor_cores(torch::kHalf, 64, 7));

  // Lesson 04's ring on 3 ranks sharing the GPU, each block on the matrix units.
  const double scale = 1.0 / std::sqrt(64.0);
  const auto [out, lse] = testing::oracle_attention(in.q.to(torch::kDouble), in.k.to(torch::kDouble),
                                                    in.v.to(torch::kDouble), true, torch::arange(c.seq_q),
                                                    torch::arange(c.seq_k), scale);
  run_local_world(3, [&](Comm& comm) {
    auto mine = [&](const torch::Tensor& t) { return t.narrow(2, comm.rank() * 64, 64); };
    const RingResult r = ring_attention_forward(comm, mine(q), mine(k), mine(v), ring_options(true));
    const std::string what = "ring on the matrix units, rank " + std::to_string(comm.rank()) + " of 3";
    CP_EXPECT_CLOSE(r.out.cpu(), mine(out), "out, " + what, kDims, merged_tolerance(in.v, matrix_unit_tolerance(in.v)));
    CP_EXPECT_CLOSE(r.lse.cpu(), mine(lse), "lse, " + what, {"b", "h", "s"});
  });
}

}  // namespace
}  // namespace cp
