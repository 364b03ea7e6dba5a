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
#include "attention_kernel_suite.h"

#if CP_WITH_CUDA
#include "16_tensor_cores_probes.cuh"
#include "kernels/mma_map.h"
#include "tensor_core_attention.cuh"
#endif

namespace cp {
namespace {

using testing::expect_error;
using testing::OracleMask;

const std::vector<std::string> kDims = {"b", "h", "s", "d"};

#if CP_WITH_CUDA
using testing::KernelCase;
using testing::KernelInputs;

const testing::AttentionLaunch kLesson16 = launch_tensor_core_attention_forward;

// ── Task 1 and task 2 alone: probe kernels run one step on known tiles ───────────────────────

/// A [rows, cols] matrix of 16-bit values, random with a few outliers, as float64 (exact).
torch::Tensor random_16bit(int64_t rows, int64_t cols, torch::ScalarType dtype, uint64_t seed) {
  return testing::random_with_outliers({rows, cols}, seed, 1.0, 8.0).to(dtype).to(torch::kDouble);
}

CP_TEST(Lesson16Kernels, Task1_QFragmentsAndScoresHoldWhatTheMapSays) {
  CP_REQUIRE_CUDA_RUNTIME();
  for (const auto& [dtype, d] : {std::pair{torch::kHalf, int64_t{64}}, std::pair{torch::kBFloat16, int64_t{128}}}) {
    const torch::Tensor q = random_16bit(64, d, dtype, 170 + d), k = random_16bit(64, d, dtype, 171 + d);
    CudaStream stream;
    DeviceBuffer q_dev(q.to(dtype)), k_dev(k.to(dtype));
    DeviceBuffer frag({4, 32, d / 16, 8}, torch::kFloat), scores({64, 64}, torch::kFloat);
    testing::launch_lesson16_task1_probe({q_dev.get(), k_dev.get(), frag.as<float>(), scores.as<float>(), d,
                                          kernel_dtype(q.to(dtype), "q")},
                                         stream.get());
    const torch::Tensor got_frag = frag.to_host(stream.get()), got_s = scores.to_host(stream.get());
    const std::string at = std::string(dtype == torch::kHalf ? "float16" : "bfloat16") + ", D = " + std::to_string(d);
    // Each element of each lane's A fragments, against the map (reported once per wrong register).
    int wrong = 0;
    for (int warp = 0; warp < 4; ++warp)
      for (int lane = 0; lane < 32; ++lane)
        for (int64_t kk = 0; kk < d / 16; ++kk)
          for (int e = 0; e < 8; ++e) {
            const int64_t row = 16 * warp + kernels::frag_a_row(lane, e), dim = 16 * kk + kernels::frag_a_col(lane, e);
            const double want = q[row][dim].item<double>(), have = got_frag[warp][lane][kk][e].item<double>();
            if (want != have && ++wrong <= 3)
              ADD_FAILURE() << at << ": warp " << warp << ", lane " << lane << ", q_frag[" << kk << "] element " << e
                            << " holds " << have << ", expected Q[" << row << "][" << dim << "] = " << want
                            << " (A's map: row frag_a_row(lane, e) of the warp's 16, dim 16·kk + frag_a_col)";
          }
    EXPECT_EQ(wrong, 0) << at << ": elements of Q's fragments that are not where A's map puts them";
    // S = Q·Kᵀ: products of 16-bit values are exact in float32; a sum of D of them in float32 is
    // within D·u·Σ|q·k| <= D²·u·max|q|·max|k| (u = 2⁻²⁴) of the exact one, in any order.
    const torch::Tensor s = q.matmul(k.t());
    const Tolerance tol{static_cast<double>(d * d) * std::ldexp(1.0, -24) * q.abs().max().item<double>() *
                            k.abs().max().item<double>(),
                        0};
    CP_EXPECT_CLOSE(got_s, s, "S = Q·Kᵀ from the fragments, " + at, {"row", "key"}, tol);
  }
}

/// The definition of one tile of the online softmax, in float64, row by row.
struct SoftmaxStep {
  torch::Tensor p, m, l, o;
};
SoftmaxStep reference_softmax_tile(const torch::Tensor& s, const torch::Tensor& kpos, int n, const torch::Tensor& first,
                                   const torch::Tensor& last, double scale, const torch::Tensor& m_in,
                                   const torch::Tensor& l_in, const torch::Tensor& o_in) {
  SoftmaxStep r{torch::zeros_like(s), m_in.clone(), l_in.clone(), o_in.clone()};
  for (int64_t row = 0; row < s.size(0); ++row) {
    double tile_max = -INFINITY;
    std::vector<bool> visible(s.size(1));
    for (int64_t j = 0; j < s.size(1); ++j) {
      const int64_t pos = kpos[j].item<int64_t>();
      visible[j] = j < n && first[row].item<int64_t>() <= pos && pos <= last[row].item<int64_t>();
      if (visible[j]) tile_max = std::max(tile_max, scale * s[row][j].item<double>());
    }
    const double m_old = m_in[row].item<double>(), m_new = std::max(m_old, tile_max);
    const double alpha = m_new == -INFINITY ? 1.0 : std::exp(m_old - m_new);
    double sum = l_in[row].item<double>() * alpha;
    for (int64_t j = 0; j < s.size(1); ++j) {
      const double p = visible[j] ? std::exp(scale * s[row][j].item<double>() - m_new) : 0.0;
      r.p[row][j] = p;
      sum += p;
    }
    r.m[row] = m_new;
    r.l[row] = sum;
    r.o[row] = o_in[row] * alpha;
  }
  return r;
}

CP_TEST(Lesson16Kernels, Task2_OnlineSoftmaxOnFragmentsFollowsTheDefinition) {
  CP_REQUIRE_CUDA_RUNTIME();
  // 64 rows of one tile of 64 keys (the last 4 missing: n = 60), a scale that is not 1/√D, and rows
  // chosen for what N(0, 1) scores never show:
  //   0–7    scores of −100 to −140 after scaling (a maximum started at 0 leaves every p at 0)
  //   8–15   scores of +100 to +140 (p = exp(s) without the maximum overflows)
  //   16–23  a maximum that rises: the state's m lies below this tile's scores (α < 1 on l and o)
  //   24–31  the state's m above this tile's scores (α = 1, p small)
  //   32–35  no key visible, nothing seen before (m = −inf: α must not be exp(−inf + inf) = NaN)
  //   36–39  no key visible, a state from earlier tiles (it must come out unchanged)
  //   40–63  a causal diagonal: row i sees the keys at positions up to 100 + i
  const double scale = 0.3;
  const int n = 60;
  torch::Tensor s = testing::random_with_outliers({64, 64}, 172, 2.0, 0.0).to(torch::kDouble);
  s.narrow(0, 0, 8).sub_(100 / scale + 40 / scale * torch::rand({8, 1}, torch::kDouble));
  s.narrow(0, 8, 8).add_(100 / scale + 40 / scale * torch::rand({8, 1}, torch::kDouble));
  s = s.to(torch::kFloat).to(torch::kDouble);
  const torch::Tensor kpos = torch::arange(100, 164, torch::kLong);
  torch::Tensor first = torch::full({64}, 0, torch::kLong), last = torch::full({64}, 1000, torch::kLong);
  last.narrow(0, 32, 8).fill_(50);  // before every key of the tile
  last.narrow(0, 40, 24).copy_(torch::arange(140, 164, torch::kLong));
  torch::Tensor m_in = torch::full({64}, 1.5, torch::kDouble), l_in = torch::full({64}, 3.0, torch::kDouble);
  m_in.narrow(0, 0, 16).fill_(-INFINITY), l_in.narrow(0, 0, 16).fill_(0);
  m_in.narrow(0, 16, 8).fill_(-3.0);
  m_in.narrow(0, 24, 8).fill_(12.0);
  m_in.narrow(0, 32, 4).fill_(-INFINITY), l_in.narrow(0, 32, 4).fill_(0);
  torch::Tensor o_in = testing::random_with_outliers({64, 64}, 173, 1.0, 0.0).to(torch::kDouble);
  o_in.narrow(0, 0, 16).zero_(), o_in.narrow(0, 32, 4).zero_();
  const SoftmaxStep want = reference_softmax_tile(s, kpos, n, first, last, scale, m_in, l_in, o_in);

  CudaStream stream;
  DeviceBuffer s_dev(s.to(torch::kFloat)), kpos_dev(kpos), first_dev(first), last_dev(last);
  DeviceBuffer m_dev(m_in.to(torch::kFloat)), l_dev(l_in.to(torch::kFloat)), o_dev(o_in.to(torch::kFloat));
  DeviceBuffer p_out({64, 64}, torch::kFloat), m_out({64}, torch::kFloat), l_out({64}, torch::kFloat),
      o_out({64, 64}, torch::kFloat);
  testing::launch_lesson16_task2_probe(
      {s_dev.as<float>(), kpos_dev.as<int64_t>(), n, first_dev.as<int64_t>(), last_dev.as<int64_t>(),
       static_cast<float>(scale), m_dev.as<float>(), l_dev.as<float>(), o_dev.as<float>(), p_out.as<float>(),
       m_out.as<float>(), l_out.as<float>(), o_out.as<float>()},
      stream.get());
  const torch::Tensor p = p_out.to_host(stream.get()), m = m_out.to_host(stream.get()),
                      l = l_out.to_host(stream.get()), o = o_out.to_host(stream.get());
  const std::string note = " (rows 0-7 far below 0, 8-15 far above, 16-23 a rising maximum, 24-31 a maximum "
                           "from before, 32-39 no key visible, 40-63 a causal diagonal; keys 60-63 missing)";
  // float32 computes the exponent scale·s − m with an error of up to u·(|scale·s| + |scale·s − m|)
  // <= 3u·max|scale·s| (u = 2⁻²⁴), which is p's relative error, plus a few ulps of expf; at scores
  // of 140 that is 2.5e-5, above the float32 default. l adds a sum of 64 terms (64u more), o one
  // product by α.
  const double u = std::ldexp(1.0, -24), level = (s * scale).abs().max().item<double>();
  const Tolerance exp_tol{1e-6, 3 * u * level + 8 * u};
  CP_EXPECT_CLOSE(p, want.p, "p = exp(scale·s − m_new) in s's fragments" + note, {"row", "key"}, exp_tol);
  CP_EXPECT_CLOSE(m, want.m, "m, each row's new maximum" + note, {"row"});
  CP_EXPECT_CLOSE(l, want.l, "l, each row's sum over its quad, rescaled" + note, {"row"},
                  Tolerance{1e-6, exp_tol.rel + 64 * u});
  CP_EXPECT_CLOSE(o, want.o, "o, rescaled by α" + note, {"row", "dim"}, exp_tol);
}

// ── The whole kernel ─────────────────────────────────────────────────────────────────────────

CP_TEST(Lesson16Kernels, Task3_KernelMatchesTheOracleForEveryDtypeHeadDimAndGroup) {
  CP_REQUIRE_CUDA_RUNTIME();
  testing::expect_kernel_for_every_dtype_head_dim_and_group(kLesson16, "lesson 16");
}

CP_TEST(Lesson16Kernels, Task3_KernelCausalMaskFromGlobalPositions) {
  CP_REQUIRE_CUDA_RUNTIME();
  testing::expect_kernel_causal_mask_from_global_positions(kLesson16, "lesson 16");
}

CP_TEST(Lesson16Kernels, Task3_KernelWindowsAndDocuments) {
  CP_REQUIRE_CUDA_RUNTIME();
  testing::expect_kernel_windows_and_documents(kLesson16, "lesson 16");
}

CP_TEST(Lesson16Kernels, Task3_KernelRowsFarFromZeroAndMaximaThatRise) {
  CP_REQUIRE_CUDA_RUNTIME();
  testing::expect_kernel_rows_far_from_zero(kLesson16, "lesson 16");
}

CP_TEST(Lesson16Kernels, Task3_KernelRejectsFloat32AndOtherHeadDims) {
  CP_REQUIRE_CUDA_RUNTIME();
  testing::expect_kernel_matches_oracle(kLesson16, {1, 1, 1, 4, 4, 64}, {false, {}, {}}, torch::kHalf, 163,
                                        "counts once implemented");
  const KernelInputs f32 = testing::random_kernel_inputs({1, 1, 1, 4, 4, 64}, torch::kFloat, 1);
  const OracleMask four{false, torch::arange(4), torch::arange(4)};
  expect_error([&] { testing::run_attention_kernel(kLesson16, f32, four, 0.125); },
               "the matrix units take float16 or bfloat16, got float32");
  const KernelInputs d32 = testing::random_kernel_inputs({1, 1, 1, 4, 4, 32}, torch::kHalf, 1);
  expect_error([&] { testing::run_attention_kernel(kLesson16, d32, four, 0.125); },
               "unsupported head dim 32");
  // q one element past a 16-byte boundary (a view into the middle of a row): the loads need 16.
  const KernelInputs in = testing::random_kernel_inputs({1, 1, 1, 4, 4, 64}, torch::kHalf, 1);
  CudaStream stream;
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
  const testing::KernelCase c{2, 8, 2, 300, 300, 128};
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    const testing::KernelInputs in = testing::random_kernel_inputs(c, dtype, 164);
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
  const testing::KernelCase c{1, 4, 2, 192, 192, 64};
  const testing::KernelInputs in = testing::random_kernel_inputs(c, torch::kBFloat16, 165);
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
