// Lessons 03 and 05 benchmark: the course's CPU block attention, forward and backward, against
// the attention a learner writes in three lines of LibTorch, softmax(scale · Q Kᵀ + mask) V, with
// LibTorch's autograd for the backward, and (LibTorch >= 2.0) PyTorch's fused
// at::scaled_dot_product_attention. Causal and not, S = 1k to 8k, D = 64, float32, one core at the
// SIMD level the CPU has (CP_CPU_SIMD=baseline or avx2 caps it), with the core's FMA peak.
//
// FLOP convention (as FlashAttention's papers): forward 4·B·H·Sq·Sk·D (two matrix products),
// halved when causal; backward 2.5× the forward. Both implementations are credited with the same
// FLOP count, so the ratio is a ratio of times; LibTorch computes the whole masked matrix anyway.
//
//   build/bin/attention_bench                       1 thread, S = 1024, 2048, 4096, 8192
//   build/bin/attention_bench --seq 1024,2048 --repeats 5 --threads 2
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "block_attention.h"
#include "common/cli.h"
#include "common/error.h"
#include "common/world.h"
#include "common/cpu_features.h"
#include "ring_attention_backward.h"
#include "timing.h"

// at::scaled_dot_product_attention, PyTorch's own fused attention and the peer a user would pick,
// exists from LibTorch 2.0 on (Debian 13: 2.6); Debian 12's 1.13 has none, and its columns print "-".
#if TORCH_VERSION_MAJOR >= 2
#define CP_BENCH_SDPA 1
#else
#define CP_BENCH_SDPA 0
#endif

namespace {

using Clock = std::chrono::steady_clock;

/// The core's clock in GHz, measured: a chain of dependent 64-bit multiplies takes 3 cycles per
/// multiply on every x86-64 core of the last decade (AMD Zen 1-5, Intel since Nehalem), whatever
/// /proc/cpuinfo says of turbo and virtual machines. Not adds: Intel's Golden Cove cores (Sapphire
/// Rapids Xeons) run a chain of `add $1` several per cycle, which read 6-12 GHz on an H200's host
/// (2026-11-27). 0 elsewhere.
double measured_ghz() {
#if defined(__x86_64__)
  constexpr int64_t kIterations = 10'000'000;  // 4 multiplies each: 0.12 G cycles, about 0.04 s
  constexpr double kCyclesPerMultiply = 3.0;
  int64_t x = 1;
  const int64_t one = 1;
  const auto start = Clock::now();
  for (int64_t i = 0; i < kIterations; ++i)
    asm volatile("imul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0" : "+r"(x) : "r"(one));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return 4.0 * kCyclesPerMultiply * kIterations / seconds / 1e9;
#else
  return 0.0;
#endif
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "unknown CPU";
}

/// softmax(scale · Q Kᵀ + mask) V, the S × S matrices materialised.
torch::Tensor torch_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& hidden, double scale) {
  torch::Tensor s = torch::matmul(q, k.transpose(-2, -1)) * scale;
  if (hidden.defined()) s = s.masked_fill(hidden, -INFINITY);
  return torch::matmul(torch::softmax(s, -1), v);
}

}  // namespace

int main(int argc, char** argv) {
  return cp::run_main([&] {
    const cp::CommandLine cli(argc, argv,
                              "The course's CPU block attention (lessons 03, 05) against LibTorch's materialised "
                              "attention and its autograd backward.",
                              {{"--seq", "1024,2048,4096,8192", "sequence lengths S (Sq = Sk), comma-separated"},
                               {"--head-dim", "64", "head dim D"},
                               {"--repeats", "3", "timed runs of each implementation per row (the median is printed)"},
                               {"--threads", "1", "torch::set_num_threads; the course's CPU path is single-threaded"}});
    if (cli.help_requested()) return 0;
    const int threads = cli.get_int("--threads"), repeats = cli.get_int("--repeats");
    const int64_t d = cli.get_int("--head-dim");
    CP_CHECK(threads >= 1 && repeats >= 1 && d >= 1, "--threads, --repeats, --head-dim: must be at least 1");
    torch::set_num_threads(threads);
    const std::vector<int64_t> seqs = cp::bench::positive_list(cli.get("--seq"), "--seq");

    const std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof date, "%Y-%m-%d", std::localtime(&now));
    std::printf("# attention on the CPU: the course's block attention (lesson 03 forward, lesson 05 backward) vs "
                "LibTorch softmax(scale*QK^T + mask)V and its autograd backward\n");
    std::printf("# machine: %s, %u hardware threads; torch threads %d; LibTorch %d.%d.%d; %s\n", cpu_model().c_str(),
                std::thread::hardware_concurrency(), torch::get_num_threads(), TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR,
                TORCH_VERSION_PATCH, date);
    std::printf("# float32, B = 1, D = %lld, H = 8·(2048/S)^2 clamped to 1..8; FLOP: forward 4·B·H·S·S·D, halved when "
                "causal, backward 2.5x forward\n",
                (long long)d);
    const double ghz = measured_ghz();
    const int floats = cp::simd_floats(cp::simd_level());
    const double peak = ghz * floats * 4.0;  // two FMA pipes, 2 FLOP each
    std::printf("# CPU SIMD: %s (CP_CPU_SIMD caps it); core clock %.2f GHz (measured); peak of one core %.1f "
                "GFLOP/s = GHz x %d floats x 2 FLOP x 2 FMA pipes (assumed: some CPUs have one)\n",
                cp::describe(cp::simd_level()).c_str(), ghz, peak, floats);
    std::printf("# median of %d alternating runs (after a warm-up run below S = 4096); cp_peak = cp_GFLOP/s / peak; "
                "vs_torch = torch_ms / cp_ms, vs_sdpa = sdpa_ms / cp_ms (> 1: the course is faster)\n"
                "# sdpa: at::scaled_dot_product_attention, PyTorch's fused attention (LibTorch >= 2.0)%s\n"
                "# max_err: largest |cp - torch| of out (forward) or dq, dk, dv (backward)\n",
                repeats, CP_BENCH_SDPA ? "" : "; not in this LibTorch: '-'");
    std::printf("# %-8s %-6s %6s %3s %9s %10s %7s %9s %10s %8s %9s %8s %9s\n", "pass", "mask", "S", "H", "cp_ms",
                "cp_GFLOP/s", "cp_peak", "torch_ms", "torch_GF/s", "vs_torch", "sdpa_ms", "vs_sdpa", "max_err");
    for (const int64_t s : seqs) {
      // H keeps the work H·S² constant from S = 2048 on (8k: twice that, H cannot go below 1).
      const int64_t h = std::clamp<int64_t>(8 * (2048 * 2048) / (s * s), 1, 8);
      const bool warm_up = s < 4096;  // beyond, one run takes seconds and warms up nothing
      torch::manual_seed(1);
      const torch::Tensor q = torch::randn({1, h, s, d}), k = torch::randn({1, h, s, d});
      const torch::Tensor v = torch::randn({1, h, s, d}), dout = torch::randn({1, h, s, d});
      const double scale = 1.0 / std::sqrt(static_cast<double>(d));
      for (const bool causal : {false, true}) {
        const double fwd_flop = 4.0 * h * s * s * d * (causal ? 0.5 : 1.0);
        const torch::Tensor hidden =
            causal ? torch::ones({s, s}, torch::kBool).triu(1) : torch::Tensor();  // key after query: hidden
        const cp::AttentionMask mask = cp::causal_mask(causal);
        auto row = [&](const char* pass, double flop, const std::vector<double>& ms, double err) {
          const double gflops = flop / (ms[0] * 1e6);
          std::printf("  %-8s %-6s %6lld %3lld %9.1f %10.2f %6.0f%% %9.1f %10.2f %8.2f", pass, causal ? "causal" : "full",
                      (long long)s, (long long)h, ms[0], gflops, 100.0 * gflops / peak, ms[1], flop / (ms[1] * 1e6),
                      ms[1] / ms[0]);
          if (ms.size() > 2)
            std::printf(" %9.1f %8.2f", ms[2], ms[2] / ms[0]);
          else
            std::printf(" %9s %8s", "-", "-");
          std::printf(" %9.1e\n", err);
          std::fflush(stdout);
        };
        auto max_err = [](const torch::Tensor& a, const torch::Tensor& b) {
          return (a - b).abs().max().item<double>();
        };

        cp::AttnResult fwd;
        torch::Tensor out;
        std::vector<std::function<void()>> forwards = {
            [&] { fwd = cp::attention_block_forward(q, k, v, mask); },
            [&] {
              torch::NoGradGuard no_grad;
              out = torch_attention(q, k, v, hidden, scale);
            }};
#if CP_BENCH_SDPA
        forwards.push_back([&] {
          torch::NoGradGuard no_grad;
          at::scaled_dot_product_attention(q, k, v, {}, 0.0, causal);
        });
#endif
        const std::vector<double> fwd_ms = cp::bench::median_ms(repeats, warm_up, forwards);  // before max_err reads out
        row("forward", fwd_flop, fwd_ms, max_err(fwd.out, out));

        cp::AttnGrads grads;
        torch::Tensor qg, kg, vg, out_sdpa;
        auto leaves = [&] {
          qg = q.clone().requires_grad_(), kg = k.clone().requires_grad_(), vg = v.clone().requires_grad_();
        };
        std::vector<std::function<void()>> backwards = {
            [&] { grads = cp::attention_block_backward(dout, q, k, v, fwd.out, fwd.lse, mask); },
            [&] { out.backward(dout); }};
        std::vector<std::function<void()>> prepare = {{}, [&] {
                                                        leaves();
                                                        out = torch_attention(qg, kg, vg, hidden, scale);
                                                      }};
#if CP_BENCH_SDPA
        backwards.push_back([&] { out_sdpa.backward(dout); });
        prepare.push_back([&] {
          leaves();
          out_sdpa = at::scaled_dot_product_attention(qg, kg, vg, {}, 0.0, causal);
        });
#endif
        const std::vector<double> ms = cp::bench::median_ms(repeats, warm_up, backwards, prepare);
        // The gradients of the last backward run: LibTorch's, or sdpa's where it ran last.
        row("backward", 2.5 * fwd_flop, ms,
            std::max({max_err(grads.dq, qg.grad()), max_err(grads.dk, kg.grad()), max_err(grads.dv, vg.grad())}));
      }
    }
    return 0;
  });
}
