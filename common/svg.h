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

/// One line of a line chart: a value per x of the chart.
struct LineSeries {
  std::string name;
  std::vector<double> values;
};

/// How an axis of a line chart maps values to pixels.
enum class AxisScale { Linear, Log };

/// Writes a line chart: one line with a dot per point for each series, over the x values `xs`
/// (shared by every series), axes with labelled ticks (a log axis: ticks at powers of ten on y, at
/// the x values themselves on x), and a legend. A NaN value has no point (a series that stops
/// early: its line joins the points it has). Values must be positive on a log axis. Throws
/// cp::Error if the file cannot be written or a series has the wrong number of values.
void write_line_chart(const std::string& path, const std::string& title, const std::vector<double>& xs,
                      const std::vector<LineSeries>& series, const std::string& x_label, const std::string& y_label,
                      AxisScale x_scale = AxisScale::Linear, AxisScale y_scale = AxisScale::Linear);

}  // namespace cp
