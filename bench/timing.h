// What the benchmarks share: medians of alternating runs, and the lists their options take.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"

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

/// "a,b" -> {"a", "b"}: a comma-separated list, or a cp::Error naming `option` when it is empty.
inline std::vector<std::string> split_list(const std::string& text, const char* option) {
  std::vector<std::string> items;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) items.push_back(item);
  CP_CHECK(!items.empty(), option, ": no value given");
  return items;
}

/// "1024,2048" -> {1024, 2048}: comma-separated positive integers, or a cp::Error naming `option`.
inline std::vector<int64_t> positive_list(const std::string& text, const char* option) {
  std::vector<int64_t> values;
  for (const std::string& item : split_list(text, option)) {
    CP_CHECK(!item.empty() && item.find_first_not_of("0123456789") == std::string::npos && std::stoll(item) > 0,
             option, ": expected comma-separated positive integers, got '", text, "'");
    values.push_back(std::stoll(item));
  }
  return values;
}

}  // namespace cp::bench
