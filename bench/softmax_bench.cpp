// Lesson 01 benchmark: online softmax vs torch::softmax, per device, as effective bandwidth, with a
// plain copy of the same bytes as the ceiling.
//
// Bytes moved are counted as the minimum an implementation must move (read x once, write y
// once), so GB/s compares implementations on the same footing, and x.clone() (the same bytes
// into a new tensor, as softmax returns one, and no arithmetic) is what memory allows.
#include <torch/cuda.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include "common/cpu_features.h"
#include "common/device.h"
#include "online_softmax.h"
#include "timing.h"

namespace {

void bench_device(torch::Device device, torch::ScalarType dtype, const char* label, const std::string& level) {
  const bool cuda = device.is_cuda();
  for (int64_t n : {128, 1024, 4097, 32768}) {
    const int64_t rows = (cuda ? (int64_t(1) << 27) : (int64_t(1) << 22)) / n / 4;  // ~512 MiB / 16 MiB of fp32
    const torch::Tensor x = torch::randn({rows, n}, torch::TensorOptions().device(device).dtype(dtype));
    const double gbytes = 2.0 * x.numel() * x.element_size() / 1e9;
    auto timed = [cuda](std::function<void()> fn) -> std::function<void()> {
      return [cuda, fn] {
        fn();
        if (cuda) torch::cuda::synchronize();  // the kernel's time, not its launch's
      };
    };
    const std::vector<double> ms =
        cp::bench::median_ms(cuda ? 20 : 5, /*warm_up=*/true,
                             {timed([&] { cp::online_softmax(x); }), timed([&] { torch::softmax(x, -1); }),
                              timed([&] { x.clone(); })});
    const double t_cp = ms[0], t_torch = ms[1], t_copy = ms[2];
    std::printf("  %-4s %-9s %-8s %7lld %6lld %9.3f %8.1f %9.3f %8.1f %8.1f %7.2f %7.2f\n", label,
                c10::toString(dtype), level.c_str(), (long long)rows, (long long)n, t_cp, gbytes / (t_cp / 1e3),
                t_torch, gbytes / (t_torch / 1e3), gbytes / (t_copy / 1e3), t_torch / t_cp, t_copy / t_cp);
  }
}

}  // namespace

int main() {
  torch::set_num_threads(1);
  const cp::SimdLevel best = cp::simd_level();
  std::printf("# softmax over the last dim: cp::online_softmax vs torch::softmax, one thread\n");
  std::printf("# CPU SIMD: %s; the CPU rows run cp at every level up to it (CP_CPU_SIMD caps it)\n",
              cp::describe(best).c_str());
  std::printf("# median of 5 alternating runs; GB/s = 2·bytes(x)/time; copy: x.clone(), the same bytes read and written into a new tensor\n");
  std::printf("# speedup = torch_ms / cp_ms (> 1: the course is faster); of_copy = copy_ms / cp_ms (1: memory speed)\n");
  std::printf("# %-4s %-9s %-8s %7s %6s %9s %8s %9s %8s %8s %7s %7s\n", "dev", "dtype", "simd", "rows", "n", "cp_ms",
              "cp_GB/s", "torch_ms", "torch_GB/s", "copy_GB/s", "speedup", "of_copy");
  for (int level = 0; level <= static_cast<int>(best); ++level) {
    cp::set_simd_level(static_cast<cp::SimdLevel>(level));
    bench_device(torch::kCPU, torch::kFloat, "cpu", cp::name(static_cast<cp::SimdLevel>(level)));
  }
  cp::set_simd_level(best);
  const std::string no_gpu = cp::cuda_unavailable_reason();
  if (!no_gpu.empty()) {
    std::printf("# cuda: skipped (%s)\n", no_gpu.c_str());
    return 0;
  }
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) bench_device(torch::kCUDA, dtype, "cuda", "-");
  return 0;
}
