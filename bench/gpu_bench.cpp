// What a GPU day measures (tools/gpu-check runs it on a lent GPU): two '#'-headed tables.
//
//   attention  the course's block attention (lesson 03 forward, lesson 05 backward, and for
//              16-bit inputs lesson 16's forward on the matrix units, row fwd-tc, and each later
//              version of lesson 17's ladder, rows fwd-v2, fwd-v3, …) in TFLOP/s
//              beside at::scaled_dot_product_attention, PyTorch's fused attention, on the same
//              inputs and the same GPU: float32 and bfloat16, D = 64 and 128, S = 4k to 16k,
//              causal and not; the relative error of each against the other.
//   ring       lesson 04's ring forward on 4 local ranks sharing the GPU (threads; each rank's
//              copies run on its own stream): the time with the exchange overlapped with the
//              compute, without overlap, and with the exchange left out (compute only), and the
//              share of the transfer time that overlap hides:
//                hidden = (serial - overlapped) / (serial - compute_only)
//
// FLOP convention (FlashAttention's papers): forward 4·B·H·Sq·Sk·D, halved when causal; backward
// 2.5× the forward. Both implementations are credited with the same count, so cp/sdpa is a ratio
// of times. Rows are skipped, and say so, once --seconds have passed: the GPU check runs inside a
// lease of minutes.
//
//   build/bin/gpu_bench                                    everything, on the GPU
//   build/bin/gpu_bench --part attention --dtypes bfloat16 --dims 128 --seq 8192
//   build/bin/gpu_bench --device cpu --seq 256 --dims 64 --dtypes float32   (the logic, on the CPU)
#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "block_attention.h"
#include "common/cli.h"
#include "common/error.h"
#include "common/world.h"
#include "fast_backward.h"
#include "fast_forward.h"
#include "ring_attention.h"
#include "ring_attention_backward.h"
#include "tensor_cores.h"
#include "timing.h"

#if TORCH_VERSION_MAJOR < 2
#error "gpu_bench compares with at::scaled_dot_product_attention, which needs LibTorch 2.0 or newer"
#endif
#if CP_TORCH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

/// The dtypes the kernels take (float64 is the CPU path's alone).
torch::ScalarType dtype_of(const std::string& name) {
  const torch::ScalarType dtype = cp::parse_dtype(name, "--dtypes");
  CP_CHECK(dtype != torch::kDouble, "--dtypes: the kernels take float32, float16 or bfloat16, got float64");
  return dtype;
}

/// Waits for the device's queued work (the GPU's, timed from the host), nothing on the CPU.
void sync(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize();
}

/// max |a - b| / max |b|, in float32: the two implementations' distance, relative to the output.
double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor bf = b.to(torch::kFloat);
  return ((a.to(torch::kFloat) - bf).abs().max() / bf.abs().max().clamp_min(1e-30)).item<double>();
}

/// The budget: rows start while it lasts, and the skipped ones are counted.
struct Budget {
  double seconds;
  Clock::time_point start = Clock::now();
  int skipped = 0;
  bool left() const { return std::chrono::duration<double>(Clock::now() - start).count() < seconds; }
};

void attention_table(const torch::Device& device, const std::vector<std::string>& dtypes,
                     const std::vector<int64_t>& dims, const std::vector<int64_t>& seqs, int64_t work, int repeats,
                     Budget& budget) {
  std::printf("# attention: the course's kernels (lesson 03 forward, lesson 05 backward) vs "
              "at::scaled_dot_product_attention (sdpa), same inputs, %s\n",
              device.str().c_str());
  std::printf("# B = 1, Hq = Hkv = H = max(1, %lld / S^2); FLOP: forward 4*H*S*S*D, halved when causal, backward "
              "2.5x forward; TF/s = 1e12 FLOP/s; median of %d runs after a warm-up; cp/sdpa = sdpa_ms / cp_ms "
              "(> 1: the course is faster); rel_err = max|cp - sdpa| / max|sdpa| (out, or the worst of dq, dk, dv)\n",
              (long long)work, repeats);
  std::printf("# %-8s %-6s %-8s %4s %6s %3s %9s %8s %9s %8s %8s %9s\n", "pass", "mask", "dtype", "D", "S", "H",
              "cp_ms", "cp_TF/s", "sdpa_ms", "sdpa_TF/s", "cp/sdpa", "rel_err");
  for (const std::string& dtype_name : dtypes)
    for (const int64_t d : dims)
      for (const int64_t s : seqs)
        for (const bool causal : {false, true}) {
          const int64_t h = std::max<int64_t>(1, work / (s * s));
          if (!budget.left()) {
            std::printf("  %-8s %-6s %-8s %4lld %6lld %3lld  not run: out of time (--seconds %.0f)\n", "both",
                        causal ? "causal" : "full", dtype_name.c_str(), (long long)d, (long long)s, (long long)h,
                        budget.seconds);
            ++budget.skipped;
            continue;
          }
          const torch::ScalarType dtype = dtype_of(dtype_name);
          torch::manual_seed(1);
          const auto options = torch::TensorOptions().device(device).dtype(dtype);
          const torch::Tensor q = torch::randn({1, h, s, d}, options), k = torch::randn({1, h, s, d}, options),
                              v = torch::randn({1, h, s, d}, options), dout = torch::randn({1, h, s, d}, options);
          const cp::AttentionMask mask = cp::causal_mask(causal);
          const double fwd_flop = 4.0 * h * s * s * d * (causal ? 0.5 : 1.0);
          auto row = [&](const char* pass, double flop, const std::vector<double>& ms, double err) {
            std::printf("  %-8s %-6s %-8s %4lld %6lld %3lld %9.2f %8.1f %9.2f %8.1f %8.3f %9.1e\n", pass,
                        causal ? "causal" : "full", dtype_name.c_str(), (long long)d, (long long)s, (long long)h,
                        ms[0], flop / (ms[0] * 1e9), ms[1], flop / (ms[1] * 1e9), ms[1] / ms[0], err);
            std::fflush(stdout);
          };

          cp::AttnResult fwd;
          torch::Tensor sdpa_out;
          const std::function<void()> sdpa_forward = [&] {
            torch::NoGradGuard no_grad;
            sdpa_out = at::scaled_dot_product_attention(q, k, v, {}, 0.0, causal);
            sync(device);
          };
          const std::vector<double> fwd_ms = cp::bench::median_ms(repeats, true,
                                                                  {[&] {
                                                                     fwd = cp::attention_block_forward(q, k, v, mask);
                                                                     sync(device);
                                                                   },
                                                                   sdpa_forward});
          row("forward", fwd_flop, fwd_ms, relative_error(fwd.out, sdpa_out));
          if (device.is_cuda() && dtype != torch::kFloat && (d == 64 || d == 128)) {  // lesson 16's matrix units
            cp::AttnResult tc;
            const std::vector<double> tc_ms = cp::bench::median_ms(
                repeats, true,
                {[&] {
                   tc = cp::attention_forward_tensor_cores(q, k, v, mask);
                   sync(device);
                 },
                 sdpa_forward});
            row("fwd-tc", fwd_flop, tc_ms, relative_error(tc.out, sdpa_out));
            for (int version = 2; version <= cp::kFastForwardVersions; ++version) {  // lesson 17's ladder
              cp::AttnResult ff;
              const std::vector<double> ff_ms = cp::bench::median_ms(
                  repeats, true,
                  {[&] {
                     ff = cp::attention_forward_fast(version, q, k, v, mask);
                     sync(device);
                   },
                   sdpa_forward});
              row(("fwd-v" + std::to_string(version)).c_str(), fwd_flop, ff_ms, relative_error(ff.out, sdpa_out));
            }
          }

          // A backward beside sdpa's (whose untimed forward precedes each of its runs): one row.
          torch::Tensor qg, kg, vg;
          const auto backward_row = [&](const char* name, const std::function<cp::AttnGrads()>& backward) {
            cp::AttnGrads grads;
            const std::vector<double> ms = cp::bench::median_ms(
                repeats, true,
                {[&] {
                   grads = backward();
                   sync(device);
                 },
                 [&] {
                   sdpa_out.backward(dout);
                   sync(device);
                 }},
                {{},
                 [&] {
                   qg = q.detach().requires_grad_(), kg = k.detach().requires_grad_(), vg = v.detach().requires_grad_();
                   sdpa_out = at::scaled_dot_product_attention(qg, kg, vg, {}, 0.0, causal);
                   sync(device);
                 }});
            row(name, 2.5 * fwd_flop, ms,
                std::max({relative_error(grads.dq, qg.grad()), relative_error(grads.dk, kg.grad()),
                          relative_error(grads.dv, vg.grad())}));
          };
          backward_row("backward", [&] { return cp::attention_block_backward(dout, q, k, v, fwd.out, fwd.lse, mask); });
          if (device.is_cuda() && dtype != torch::kFloat && (d == 64 || d == 128))  // lesson 18's matrix units
            backward_row("bwd-mma", [&] { return cp::attention_backward_fast(dout, q, k, v, fwd.out, fwd.lse, mask); });
        }
}

/// A RingExchange that moves nothing: the ring's compute alone (its results are wrong, and unused).
cp::Request no_exchange(cp::Comm&, const std::vector<torch::Tensor>&, const std::vector<torch::Tensor>&) {
  return cp::Request();
}

void ring_table(const torch::Device& device, const std::vector<std::string>& dtypes, int world, int64_t seq,
                int64_t heads, int64_t d, int repeats, Budget& budget) {
  std::printf("# ring: lesson 04's ring_attention_forward on %d local ranks (threads) sharing %s, S = %lld in all "
              "(%lld per rank), H = %lld, D = %lld\n",
              world, device.str().c_str(), (long long)seq, (long long)(seq / world), (long long)heads, (long long)d);
  std::printf("# overlapped: the next chunk's exchange started before the step's compute (RingOptions::overlap); "
              "serial: exchange, then compute; compute_only: no exchange at all; median of %d runs after a warm-up, "
              "timed on rank 0 between two barriers; hidden = (serial - overlapped) / (serial - compute_only)\n",
              repeats);
  std::printf("# %-8s %-6s %13s %10s %15s %7s\n", "dtype", "mask", "overlapped_ms", "serial_ms", "compute_only_ms",
              "hidden");
  for (const std::string& dtype_name : dtypes)
    for (const bool causal : {false, true}) {
      if (!budget.left()) {
        std::printf("  %-8s %-6s  not run: out of time (--seconds %.0f)\n", dtype_name.c_str(),
                    causal ? "causal" : "full", budget.seconds);
        ++budget.skipped;
        continue;
      }
      const torch::ScalarType dtype = dtype_of(dtype_name);
      std::vector<double> ms;  // rank 0's medians: overlapped, serial, compute only
      cp::run_local_world(world, [&](cp::Comm& comm) {
        torch::Generator gen = at::detail::createCPUGenerator(100 + comm.rank());
        const int64_t chunk = seq / comm.size();
        auto input = [&] { return torch::randn({1, heads, chunk, d}, gen).to(device, dtype); };
        const torch::Tensor q = input(), k = input(), v = input();
        cp::RingOptions overlapped = cp::ring_options(causal), serial = cp::ring_options(causal);
        serial.overlap = false;
        cp::RingOptions compute_only = serial;
        compute_only.exchange = no_exchange;
        auto timed = [&](const cp::RingOptions& options) {
          return [&comm, &q, &k, &v, &device, options] {
            comm.barrier();
            cp::ring_attention_forward(comm, q, k, v, options);
            sync(device);
            comm.barrier();
          };
        };
        const std::vector<double> medians =
            cp::bench::median_ms(repeats, true, {timed(overlapped), timed(serial), timed(compute_only)});
        if (comm.rank() == 0) ms = medians;
      });
      std::printf("  %-8s %-6s %13.2f %10.2f %15.2f", dtype_name.c_str(), causal ? "causal" : "full", ms[0], ms[1],
                  ms[2]);
      // The transfer time is a difference of two medians: below 5% of the serial time it is noise.
      const double transfer = ms[1] - ms[2];
      if (transfer > 0.05 * ms[1])
        std::printf(" %6.0f%%\n", 100.0 * (ms[1] - ms[0]) / transfer);
      else
        std::printf(" %7s  (transfer within the timing noise)\n", "-");
      std::fflush(stdout);
    }
}

}  // namespace

int main(int argc, char** argv) {
  return cp::run_main([&] {
    const cp::CommandLine cli(
        argc, argv, "The course's attention kernels against scaled_dot_product_attention, and the ring's overlap, on one GPU.",
        {{"--part", "attention,ring", "which tables: attention, ring or both (comma-separated)"},
         {"--device", "cuda", "cuda, or cpu (the same code on CPU tensors, to check the program without a GPU)"},
         {"--dtypes", "float32,bfloat16", "float32, float16, bfloat16 (comma-separated)"},
         {"--dims", "64,128", "head dims D of the attention table (the kernels take 32, 64, 128)"},
         {"--seq", "4096,8192,16384", "sequence lengths S of the attention table (comma-separated)"},
         {"--work", "1073741824", "H * S^2 of each attention row (H = work / S^2, at least 1): equal work per row"},
         {"--ring-seq", "16384", "the ring's whole sequence (divisible by --world)"},
         {"--world", "4", "the ring's local ranks"},
         {"--repeats", "3", "timed runs per measurement (the median is printed)"},
         {"--seconds", "240", "no row starts after this many seconds (the rest say 'not run: out of time')"}});
    if (cli.help_requested()) return 0;
    const std::string device_name = cli.get("--device");
    CP_CHECK(device_name == "cuda" || device_name == "cpu", "--device: expected cuda or cpu, got '", device_name, "'");
    const torch::Device device(device_name == "cuda" ? torch::kCUDA : torch::kCPU);
    CP_CHECK(!device.is_cuda() || torch::cuda::is_available(),
             "--device cuda: no usable CUDA GPU (LibTorch without CUDA, or no GPU); --device cpu runs the same code "
             "on the CPU");
    const int repeats = cli.get_int("--repeats"), world = cli.get_int("--world");
    const int64_t ring_seq = cli.get_int("--ring-seq"), work = std::stoll(cli.get("--work"));
    CP_CHECK(repeats >= 1, "--repeats: expected at least 1, got ", repeats);
    CP_CHECK(world >= 1 && ring_seq > 0 && ring_seq % world == 0, "--ring-seq ", ring_seq,
             ": expected a positive multiple of --world ", world);
    CP_CHECK(work > 0, "--work: expected a positive number, got ", work);
    const std::vector<std::string> parts = cp::bench::split_list(cli.get("--part"), "--part"), dtypes = cp::bench::split_list(cli.get("--dtypes"), "--dtypes");
    for (const std::string& part : parts)
      CP_CHECK(part == "attention" || part == "ring", "--part: expected attention or ring, got '", part, "'");
    for (const std::string& name : dtypes) dtype_of(name);  // every name checked before the first row
    const std::vector<int64_t> dims = cp::bench::positive_list(cli.get("--dims"), "--dims");
    const std::vector<int64_t> seqs = cp::bench::positive_list(cli.get("--seq"), "--seq");
    Budget budget{std::stod(cli.get("--seconds"))};
    torch::set_num_threads(1);

#if CP_TORCH_CUDA
    if (device.is_cuda()) {
      cudaDeviceProp prop{};
      CP_CHECK(cudaGetDeviceProperties(&prop, 0) == cudaSuccess, "cudaGetDeviceProperties failed");
      std::printf("# GPU: %s, compute capability %d.%d, %d SMs; LibTorch %d.%d.%d\n", prop.name, prop.major, prop.minor,
                  prop.multiProcessorCount, TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
    }
#endif
    const auto wants = [&](const char* part) { return std::find(parts.begin(), parts.end(), part) != parts.end(); };
    if (wants("attention")) attention_table(device, dtypes, dims, seqs, work, repeats, budget);
    if (wants("ring")) ring_table(device, dtypes, world, ring_seq, /*heads=*/8, /*d=*/64, repeats, budget);
    if (budget.skipped > 0) std::printf("# %d rows not run: out of time (--seconds %.0f)\n", budget.skipped, budget.seconds);
    return 0;
  });
}
