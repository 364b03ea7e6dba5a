// Timing shared by the benchmarks: medians of alternating runs.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace cp::bench {

/// The median time in ms of each function over `repeats` runs, after one warm-up run of each if
/// asked. The runs alternate (f0, f1, f2, f0, …) so that a change in the machine's load reaches
/// every function alike. prepare[i], when set, runs untimed before each run of fns[i] (LibTorch's
/// forward, before its backward).
inline std::vector<double> median_ms(int repeats, bool warm_up, const std::vector<std::function<void()>>& fns,
                                     const std::vector<std::function<void()>>& prepare = {}) {
  std::vector<std::vector<double>> times(fns.size());
  for (int i = warm_up ? -1 : 0; i < repeats; ++i) {
    for (size_t f = 0; f < fns.size(); ++f) {
      if (f < prepare.size() && prepare[f]) prepare[f]();
      const auto start = std::chrono::steady_clock::now();
      fns[f]();
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      if (i >= 0) times[f].push_back(ms);
    }
  }
  std::vector<double> medians;
  for (std::vector<double>& t : times) {
    std::sort(t.begin(), t.end());
    medians.push_back(t[t.size() / 2]);
  }
  return medians;
}

}  // namespace cp::bench
