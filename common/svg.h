// Plain SVG bar charts written by the demos themselves: no plotting dependency, and the file
// opens in any browser.
#pragma once

#include <string>
#include <vector>

namespace cp {

/// One series of a grouped bar chart: a value per group.
struct BarSeries {
  std::string name;
  std::vector<double> values;
};

/// Writes a grouped bar chart: one group of bars per entry of `groups` (e.g. "rank 0"), one bar
/// per series in each group, heights proportional to the values, each value printed above its
/// bar, a value axis with ticks labelled `value_label`, and a legend. Throws cp::Error if the
/// file cannot be written or a series has the wrong number of values.
void write_bar_chart(const std::string& path, const std::string& title, const std::vector<std::string>& groups,
                     const std::vector<BarSeries>& series, const std::string& value_label = "");

}  // namespace cp
