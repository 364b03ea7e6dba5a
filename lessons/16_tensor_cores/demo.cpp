// Lesson 16 — the matrix-unit forward on a small case, with or without a GPU (CUDA on the CPU runs
// the same kernel through the emulation of kernels/mma.cuh): which elements one lane holds, then
// the kernel's error against float64 beside lesson 03's kernel on the same 16-bit inputs, which
// shows what rounding P to 16 bits before P·V costs.
//   build/bin/lesson16_demo_solution [--lane 5] [--seq 200] [--dim 64]   (_learner: your kernel)
#include <torch/types.h>
#include <torch/utils.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>

#include "common/cli.h"
#include "common/device.h"
#include "common/error.h"
#include "common/world.h"
#include "kernels/mma_map.h"
#include "tensor_cores.h"

#if CP_WITH_CUDA
#include "block_attention.cuh"
#include "common/device_buffer.h"
#include "tensor_core_attention.cuh"
#endif

namespace {

void print_lane(int lane) {
  using namespace cp::kernels;
  std::printf("Lane %d (g = %d, t = %d) holds, as (row, col) of each operand of mma.m16n8k16:\n", lane, lane / 4,
              lane % 4);
  std::printf("  A 16x16, x[0..7]:");
  for (int e = 0; e < 8; ++e) std::printf(" (%d,%d)", frag_a_row(lane, e), frag_a_col(lane, e));
  std::printf("\n  B 16x8,  x[0..3]:");
  for (int e = 0; e < 4; ++e) std::printf(" (%d,%d)", frag_b_row(lane, e), frag_b_col(lane, e));
  std::printf("\n  C 16x8,  x[0..3]:");
  for (int e = 0; e < 4; ++e) std::printf(" (%d,%d)", frag_c_row(lane, e), frag_c_col(lane, e));
  std::printf("\n  (its row of C lies in lanes %d-%d: a row's maximum is two xor shuffles away)\n\n", 4 * (lane / 4),
              4 * (lane / 4) + 3);
}

#if CP_WITH_CUDA
/// Causal attention in float64 on the CPU: out [B, H, S, D] and lse [B, H, S].
std::pair<torch::Tensor, torch::Tensor> float64_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                          const torch::Tensor& v, double scale) {
  const int64_t s = q.size(2);
  const torch::Tensor hidden = torch::ones({s, s}, torch::kBool).triu(1);
  const torch::Tensor scores = (q.matmul(k.transpose(-2, -1)) * scale).masked_fill(hidden, -INFINITY);
  return {torch::softmax(scores, -1).matmul(v), torch::logsumexp(scores, -1)};
}

using Launch = void (*)(const void*, const void*, const void*, void*, float*, const int64_t*, const int64_t*,
                        const int64_t*, const cp::BlockAttentionParams&, cp::DType, cudaStream_t);

void compare_kernels(int64_t seq, int64_t dim) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  std::printf("Causal attention, B 1, H 2, S %lld, D %lld, inputs N(0, 1) rounded to 16 bits; errors against "
              "float64:\n", (long long)seq, (long long)dim);
  std::printf("# %-9s %-16s %10s %10s %12s %9s\n", "dtype", "kernel", "out_err", "lse_err", "u*max|v|", "ms/call");
  for (torch::ScalarType dtype : {torch::kHalf, torch::kBFloat16}) {
    torch::manual_seed(16);
    const auto shape = std::vector<int64_t>{1, 2, seq, dim};
    const torch::Tensor q = torch::randn(shape).to(dtype), k = torch::randn(shape).to(dtype),
                        v = torch::randn(shape).to(dtype);
    const auto [out64, lse64] =
        float64_attention(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble), scale);
    const torch::Tensor positions = torch::arange(seq, torch::kLong);
    const cp::BlockAttentionParams p{1, 2, 2, seq, seq, dim, static_cast<float>(scale), true};
    const cp::DType kernel_type = dtype == torch::kHalf ? cp::DType::Float16 : cp::DType::BFloat16;
    const double u = std::ldexp(1.0, dtype == torch::kHalf ? -11 : -8);
    const std::string name = dtype == torch::kHalf ? "float16" : "bfloat16";
    const std::pair<const char*, Launch> kernels[] = {{"lesson 03", cp::launch_block_attention_forward},
                                                      {"matrix units", cp::launch_tensor_core_attention_forward}};
    for (const auto& [label, launch] : kernels) {
      cp::CudaStream stream;
      cp::DeviceBuffer dq(q), dk(k), dv(v), first(torch::zeros({seq}, torch::kLong)), last(positions), kpos(positions);
      cp::DeviceBuffer out(shape, dtype), lse({1, 2, seq}, torch::kFloat);
      auto call = [&] {
        launch(dq.get(), dk.get(), dv.get(), out.get(), lse.as<float>(), first.as<int64_t>(), last.as<int64_t>(),
               kpos.as<int64_t>(), p, kernel_type, stream.get());
        return out.to_host(stream.get());
      };
      call();  // the first call compiles the kernel on CUDA on the CPU: not timed
      const auto start = std::chrono::steady_clock::now();
      const torch::Tensor got = call();
      const double ms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const double out_err = (got.to(torch::kDouble) - out64).abs().max().item<double>();
      const double lse_err = (lse.to_host(stream.get()).to(torch::kDouble) - lse64).abs().max().item<double>();
      std::printf("  %-9s %-16s %10.2e %10.2e %12.2e %9.2f\n", name.c_str(), label, out_err, lse_err,
                  u * v.to(torch::kDouble).abs().max().item<double>(), ms);
    }
  }
  std::printf("out_err, lse_err: largest |kernel - float64|. u: the dtype's unit roundoff. ms/call: %s.\n",
              cp::cuda_unavailable_reason().empty() ? "this GPU"
                                                    : "CUDA on the CPU, a check of the numbers and not of a GPU's speed");
}
#endif

}  // namespace

int main(int argc, char** argv) {
  return cp::run_main(
      [&] {
        const cp::CommandLine cli(argc, argv, "Lesson 16: one lane's fragments, and the matrix-unit kernel's error.",
                                  {{"--lane", "5", "the lane whose fragments are shown (0-31)"},
                                   {"--seq", "200", "queries and keys of the comparison"},
                                   {"--dim", "64", "head dim: 64 or 128"}});
        if (cli.help_requested()) return 0;
        const int lane = cli.get_int("--lane");
        const int64_t seq = cli.get_int("--seq"), dim = cli.get_int("--dim");
        CP_CHECK(lane >= 0 && lane < 32, "--lane ", lane, " must be 0 … 31");
        CP_CHECK(seq >= 1 && seq <= 4096, "--seq ", seq, " must be 1 … 4096");
        CP_CHECK(dim == 64 || dim == 128, "--dim ", dim, " must be 64 or 128");
        torch::set_num_threads(1);
        print_lane(lane);
#if CP_WITH_CUDA
        if (const std::string why = cp::cuda_runtime_unavailable_reason(); !why.empty()) {
          std::printf("The kernels do not run here: %s\n", why.c_str());
          return 0;
        }
        compare_kernels(seq, dim);
#else
        std::printf("The kernels do not run here: this build has no CUDA "
                    "(make setup-cuda-cpu runs them on the CPU).\n");
#endif
        return 0;
      },
      [](const cp::NotImplemented& e) {
        std::printf("\nThis demo runs your lesson 16 kernel, which is not written yet:\n  %s\n", e.what());
      });
}
