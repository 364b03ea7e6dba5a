// Lessons 03 and 05 benchmark: the course's CPU block attention, forward and backward, against
// the attention a learner writes in three lines of LibTorch, softmax(scale · Q Kᵀ + mask) V, with
// LibTorch's autograd for the backward. Causal and not, S = 1k to 8k, D = 64, float32.
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
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "block_attention.h"
#include "common/cli.h"
#include "common/error.h"
#include "common/world.h"
#include "ring_attention_backward.h"

namespace {

using Clock = std::chrono::steady_clock;

/// Median times in ms of `a` and `b` over `repeats` runs each, after a warm-up run of each if
/// asked. The runs alternate (a, b, a, b, …) so that a change in the machine's load reaches both.
/// `prepare_b` runs untimed before each run of b (LibTorch's forward, before its backward).
std::pair<double, double> median_ms(int repeats, bool warm_up, const std::function<void()>& a,
                                    const std::function<void()>& b, const std::function<void()>& prepare_b = {}) {
  auto time = [](const std::function<void()>& fn) {
    const auto start = Clock::now();
    fn();
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  };
  std::vector<double> times_a, times_b;
  for (int i = warm_up ? -1 : 0; i < repeats; ++i) {
    const double ms_a = time(a);
    if (prepare_b) prepare_b();
    const double ms_b = time(b);
    if (i >= 0) times_a.push_back(ms_a), times_b.push_back(ms_b);
  }
  std::sort(times_a.begin(), times_a.end());
  std::sort(times_b.begin(), times_b.end());
  return {times_a[times_a.size() / 2], times_b[times_b.size() / 2]};
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

std::vector<int64_t> parse_list(const std::string& text) {
  std::vector<int64_t> values;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    CP_CHECK(!item.empty() && item.find_first_not_of("0123456789") == std::string::npos && std::stoll(item) > 0,
             "--seq: expected comma-separated positive integers, got '", text, "'");
    values.push_back(std::stoll(item));
  }
  CP_CHECK(!values.empty(), "--seq: no sequence length given");
  return values;
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
    const std::vector<int64_t> seqs = parse_list(cli.get("--seq"));

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
    std::printf("# median of %d alternating runs (after a warm-up run below S = 4096); ratio = torch_ms / cp_ms "
                "(> 1: the course is faster)\n# max_err: largest |cp - torch| of out (forward) or dq, dk, dv "
                "(backward)\n",
                repeats);
    std::printf("# %-8s %-6s %6s %3s %10s %10s %10s %10s %7s %9s\n", "pass", "mask", "S", "H", "cp_ms", "cp_GFLOP/s",
                "torch_ms", "torch_GF/s", "ratio", "max_err");
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
        auto row = [&](const char* pass, double flop, double cp_ms, double torch_ms, double err) {
          std::printf("  %-8s %-6s %6lld %3lld %10.1f %10.2f %10.1f %10.2f %7.2f %9.1e\n", pass,
                      causal ? "causal" : "full", (long long)s, (long long)h, cp_ms, flop / (cp_ms * 1e6), torch_ms,
                      flop / (torch_ms * 1e6), torch_ms / cp_ms, err);
          std::fflush(stdout);
        };
        auto max_err = [](const torch::Tensor& a, const torch::Tensor& b) {
          return (a - b).abs().max().item<double>();
        };

        cp::AttnResult fwd;
        torch::Tensor out;
        const auto [cp_fwd, torch_fwd] = median_ms(
            repeats, warm_up, [&] { fwd = cp::attention_block_forward(q, k, v, mask); },
            [&] {
              torch::NoGradGuard no_grad;
              out = torch_attention(q, k, v, hidden, scale);
            });
        row("forward", fwd_flop, cp_fwd, torch_fwd, max_err(fwd.out, out));

        cp::AttnGrads grads;
        torch::Tensor qg, kg, vg;
        const auto [cp_bwd, torch_bwd] = median_ms(
            repeats, warm_up, [&] { grads = cp::attention_block_backward(dout, q, k, v, fwd.out, fwd.lse, mask); },
            [&] { out.backward(dout); },
            [&] {
              qg = q.clone().requires_grad_(), kg = k.clone().requires_grad_(), vg = v.clone().requires_grad_();
              out = torch_attention(qg, kg, vg, hidden, scale);
            });
        row("backward", 2.5 * fwd_flop, cp_bwd, torch_bwd,
            std::max({max_err(grads.dq, qg.grad()), max_err(grads.dk, kg.grad()), max_err(grads.dv, vg.grad())}));
      }
    }
    return 0;
  });
}
