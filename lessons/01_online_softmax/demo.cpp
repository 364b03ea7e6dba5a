// Lesson 01 demo: the online state at work, step by step, then the three softmaxes side by side.
//
//   build/bin/lesson01_demo_learner    runs your code
//   build/bin/lesson01_demo_solution   runs the solution
#include <torch/cuda.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <chrono>
#include <cstdio>
#include <vector>

#include "common/device.h"
#include "common/world.h"
#include "online_softmax.h"

namespace {

double milliseconds_of(const std::function<void()>& fn, int repeats) {
  fn();  // warm-up
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < repeats; ++i) fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / repeats;
}

void walk_through_a_row() {
  const std::vector<float> row = {1.0f, 3.0f, 2.0f, 5.0f, -INFINITY, 4.0f};
  std::printf("1) One pass over x = [1, 3, 2, 5, -inf, 4], state (m, l):\n");
  cp::SoftmaxState state = cp::SoftmaxState::empty();
  for (float x : row) {
    const float old_m = state.m;
    state.add(x);
    std::printf("   add %5.1f -> m = %4.1f  l = %.6f%s\n", x, state.m, state.l,
                state.m != old_m && old_m != -INFINITY ? "   (new maximum: l rescaled by exp(m_old - m_new))" : "");
  }
  std::printf("   logsumexp = m + log(l) = %.6f   (torch: %.6f)\n\n", state.logsumexp(),
              torch::logsumexp(torch::tensor(row), 0).item<float>());

  std::printf("2) The same row cut into three pieces, as if on three ranks, merged in any order:\n");
  cp::SoftmaxState pieces[3] = {cp::SoftmaxState::empty(), cp::SoftmaxState::empty(), cp::SoftmaxState::empty()};
  for (size_t i = 0; i < row.size(); ++i) pieces[i / 2].add(row[i]);
  for (int p = 0; p < 3; ++p) std::printf("   piece %d: m = %4.1f  l = %.6f\n", p, pieces[p].m, pieces[p].l);
  const cp::SoftmaxState left = cp::merge(cp::merge(pieces[0], pieces[1]), pieces[2]);
  const cp::SoftmaxState right = cp::merge(pieces[2], cp::merge(pieces[1], pieces[0]));
  std::printf("   ((0+1)+2): m = %.1f l = %.6f    (2+(1+0)): m = %.1f l = %.6f\n\n", left.m, left.l, right.m, right.l);
}

void compare_implementations() {
  const torch::Tensor x = torch::randn({512, 4097}) * 4;
  const torch::Tensor reference = torch::softmax(x.to(torch::kDouble), -1);
  std::printf("3) softmax of a [512, 4097] float32 matrix, one CPU thread:\n");
  std::printf("# %-26s %12s %16s\n", "implementation", "time_ms", "max_abs_error");
  auto row = [&](const char* name, const std::function<torch::Tensor()>& fn) {
    torch::Tensor y;
    const double ms = milliseconds_of([&] { y = fn(); }, 5);
    const double err = (y.to(torch::kCPU, torch::kDouble) - reference).abs().max().item<double>();
    std::printf("  %-26s %12.3f %16.3e\n", name, ms, err);
  };
  row("torch::softmax", [&] { return torch::softmax(x, -1); });
  row("cp::safe_softmax (3 pass)", [&] { return cp::safe_softmax(x); });
  const torch::Tensor x64 = x.to(torch::kDouble);
  row("cp::online_softmax float64", [&] { return cp::online_softmax(x64); });  // your loops, a value at a time
  row("cp::online_softmax", [&] { return cp::online_softmax(x); });  // float32: the given vectorised copy
  const std::string no_gpu = cp::cuda_unavailable_reason();
  if (no_gpu.empty()) {
    const torch::Tensor xg = x.cuda();
    row("cp::online_softmax (CUDA)", [&] {
      torch::Tensor y = cp::online_softmax(xg);
      torch::cuda::synchronize();
      return y;
    });
  } else {
    std::printf("  (CUDA row skipped: %s)\n", no_gpu.c_str());
  }
}

}  // namespace

int main() {
  return cp::run_main(
      [] {
        torch::set_num_threads(1);
        torch::manual_seed(0);
        walk_through_a_row();
        compare_implementations();
        return 0;
      },
      [](const cp::NotImplemented& e) {
        std::printf("\nThis demo runs your lesson 01 code, which is not written yet:\n  %s\n"
                    "Open lessons/01_online_softmax/README.md and start with task 1.\n", e.what());
      });
}
