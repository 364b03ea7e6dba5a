// Lesson 01 benchmark: online softmax vs torch::softmax, per device, as effective bandwidth.
//
// Bytes moved are counted as the minimum an implementation must move (read x once, write y
// once), so GB/s compares implementations on the same footing.
#include <torch/cuda.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <chrono>
#include <cstdio>
#include <functional>

#include "common/device.h"
#include "online_softmax.h"

namespace {

double median_ms(const std::function<void()>& fn, bool cuda, int repeats) {
  std::vector<double> times;
  for (int i = 0; i < repeats + 1; ++i) {
    if (cuda) torch::cuda::synchronize();
    const auto start = std::chrono::steady_clock::now();
    fn();
    if (cuda) torch::cuda::synchronize();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (i > 0) times.push_back(ms);  // the first run warms up
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void bench_device(torch::Device device, torch::ScalarType dtype, const char* label) {
  const bool cuda = device.is_cuda();
  for (int64_t n : {128, 1024, 4097, 32768}) {
    const int64_t rows = (cuda ? (int64_t(1) << 27) : (int64_t(1) << 22)) / n / 4;  // ~512 MiB / 16 MiB of fp32
    const torch::Tensor x = torch::randn({rows, n}, torch::TensorOptions().device(device).dtype(dtype));
    const double gbytes = 2.0 * x.numel() * x.element_size() / 1e9;
    const double t_cp = median_ms([&] { cp::online_softmax(x); }, cuda, cuda ? 20 : 3);
    const double t_torch = median_ms([&] { torch::softmax(x, -1); }, cuda, cuda ? 20 : 3);
    std::printf("%-6s %-9s %8lld %7lld %12.3f %10.1f %12.3f %10.1f\n", label, c10::toString(dtype), (long long)rows,
                (long long)n, t_cp, gbytes / (t_cp / 1e3), t_torch, gbytes / (t_torch / 1e3));
  }
}

}  // namespace

int main() {
  torch::set_num_threads(1);
  std::printf("# softmax over the last dim: cp::online_softmax vs torch::softmax (median time; GB/s = 2·bytes(x)/time)\n");
  std::printf("# %-4s %-9s %8s %7s %12s %10s %12s %10s\n", "dev", "dtype", "rows", "n", "cp_ms", "cp_GB/s", "torch_ms",
              "torch_GB/s");
  bench_device(torch::kCPU, torch::kFloat, "cpu");
  const std::string no_gpu = cp::cuda_unavailable_reason();
  if (!no_gpu.empty()) {
    std::printf("# cuda: skipped (%s)\n", no_gpu.c_str());
    return 0;
  }
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) bench_device(torch::kCUDA, dtype, "cuda");
  return 0;
}
