#include "common/svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "common/error.h"

namespace cp {

namespace {

/// A value in at most 4 significant digits, with k/M/G for thousands, millions, billions.
std::string short_number(double v) {
  const char* suffix = "";
  for (const char* s : {"k", "M", "G"}) {
    if (std::abs(v) < 1000) break;
    v /= 1000;
    suffix = s;
  }
  char text[32];
  std::snprintf(text, sizeof(text), "%.4g%s", v, suffix);
  return text;
}

/// The distance between axis ticks: 1, 2 or 5 times a power of ten, giving at most 6 ticks up to `top`.
double tick_step(double top) {
  const double magnitude = std::pow(10.0, std::floor(std::log10(top / 6)));
  for (double m : {1.0, 2.0, 5.0})
    if (top / (m * magnitude) <= 6) return m * magnitude;
  return 10 * magnitude;
}

/// A chart's file: the svg element of width × height pixels on white, and its title.
std::ofstream open_chart(const std::string& path, int width, int height, const std::string& title) {
  std::ofstream out(path);
  CP_CHECK(out.good(), "cannot write the chart ", path);
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"10\" y=\"22\" font-size=\"14\">" << title << "</text>\n";
  return out;
}

void close_chart(std::ofstream& out, const std::string& path) {
  out << "</svg>\n";
  CP_CHECK(out.good(), "cannot write the chart ", path);
}

const char* const kColours[] = {"#d95f02", "#1b9e77", "#7570b3", "#e7298a", "#66a61e", "#e6ab02"};
constexpr int kColourCount = sizeof(kColours) / sizeof(kColours[0]);

}  // namespace

void write_bar_chart(const std::string& path, const std::string& title, const std::vector<std::string>& groups,
                     const std::vector<BarSeries>& series, const std::string& value_label) {
  double largest = 0;
  for (const BarSeries& s : series) {
    CP_CHECK(s.values.size() == groups.size(), "write_bar_chart: series '", s.name, "' has ", s.values.size(),
             " values for ", groups.size(), " groups");
    for (double v : s.values) largest = std::max(largest, v);
  }
  const double step = tick_step(largest > 0 ? largest : 1);
  const double top = step * std::ceil((largest > 0 ? largest : 1) / step);  // the axis ends on a tick

  // Layout in pixels: the value axis on the left, the groups side by side, the legend below.
  const int bar = 24, gap = 24, group_width = static_cast<int>(series.size()) * bar + gap;
  const int left = 80, plot_top = 80, plot_height = 240, base = plot_top + plot_height;
  const int plot_width = static_cast<int>(groups.size()) * group_width;
  const int legend_item = 170, legend_columns = std::max(1, (plot_width + 40) / legend_item);
  const int legend_rows = (static_cast<int>(series.size()) + legend_columns - 1) / legend_columns;
  const int width = std::max(left + plot_width + 20, 20 + 8 * static_cast<int>(title.size()));
  const int height = base + 40 + 20 * legend_rows;

  std::ofstream out = open_chart(path, width, height, title);
  // The value axis: a line, a labelled tick with a faint grid line every `step`, and its label.
  out << "<line x1=\"" << left << "\" y1=\"" << plot_top << "\" x2=\"" << left << "\" y2=\"" << base
      << "\" stroke=\"black\"/>\n";
  for (int i = 0; i * step <= top * (1 + 1e-9); ++i) {
    const double y = base - plot_height * (i * step) / top;
    out << "<line x1=\"" << left - 4 << "\" y1=\"" << y << "\" x2=\"" << left + plot_width << "\" y2=\"" << y
        << "\" stroke=\"" << (i == 0 ? "black" : "#dddddd") << "\"/>\n"
        << "<text x=\"" << left - 7 << "\" y=\"" << y + 4 << "\" text-anchor=\"end\">" << short_number(i * step)
        << "</text>\n";
  }
  out << "<text transform=\"translate(16 " << plot_top + plot_height / 2 << ") rotate(-90)\" text-anchor=\"middle\">"
      << value_label << "</text>\n";
  // The bars, each with its value above it (written upwards: the bars are narrow).
  for (size_t g = 0; g < groups.size(); ++g) {
    const int x0 = left + gap / 2 + static_cast<int>(g) * group_width;
    for (size_t s = 0; s < series.size(); ++s) {
      const double v = series[s].values[g], h = plot_height * std::max(v, 0.0) / top;
      const int x = x0 + static_cast<int>(s) * bar;
      out << "<rect x=\"" << x << "\" y=\"" << base - h << "\" width=\"" << bar - 3 << "\" height=\"" << h
          << "\" fill=\"" << kColours[s % kColourCount] << "\"><title>" << series[s].name << ": " << v << "</title></rect>\n"
          << "<text transform=\"translate(" << x + bar / 2 + 2 << " " << base - h - 4
          << ") rotate(-90)\" font-size=\"11\">" << short_number(v) << "</text>\n";
    }
    out << "<text x=\"" << x0 + (group_width - gap) / 2 << "\" y=\"" << base + 18 << "\" text-anchor=\"middle\">"
        << groups[g] << "</text>\n";
  }
  for (size_t s = 0; s < series.size(); ++s) {
    const int x = left + static_cast<int>(s % legend_columns) * legend_item;
    const int y = base + 32 + static_cast<int>(s / legend_columns) * 20;
    out << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"12\" height=\"12\" fill=\"" << kColours[s % kColourCount]
        << "\"/><text x=\"" << x + 16 << "\" y=\"" << y + 11 << "\">" << series[s].name << "</text>\n";
  }
  close_chart(out, path);
}

namespace {

/// Value → pixel along one axis of `length` pixels, for values in [lo, hi] (linear or log10).
struct Axis {
  AxisScale scale;
  double lo, hi;
  double length;
  double map(double v) const {
    if (scale == AxisScale::Log) return length * (std::log10(v) - std::log10(lo)) / (std::log10(hi) - std::log10(lo));
    return length * (v - lo) / (hi - lo);
  }
};

}  // namespace

void write_line_chart(const std::string& path, const std::string& title, const std::vector<double>& xs,
                      const std::vector<LineSeries>& series, const std::string& x_label, const std::string& y_label,
                      AxisScale x_scale, AxisScale y_scale) {
  CP_CHECK(!xs.empty(), "write_line_chart: no x values");
  double y_lo = INFINITY, y_hi = -INFINITY;
  for (const LineSeries& s : series) {
    CP_CHECK(s.values.size() == xs.size(), "write_line_chart: series '", s.name, "' has ", s.values.size(),
             " values for ", xs.size(), " x values");
    for (double v : s.values) {
      if (std::isnan(v)) continue;  // no point there
      CP_CHECK(y_scale == AxisScale::Linear || v > 0, "write_line_chart: series '", s.name, "' has the value ", v,
               " on a log axis");
      y_lo = std::min(y_lo, v);
      y_hi = std::max(y_hi, v);
    }
  }
  const auto [x_min, x_max] = std::minmax_element(xs.begin(), xs.end());
  double x_lo = *x_min, x_hi = *x_max > *x_min ? *x_max : *x_min + 1;
  // The y axis ends on ticks: multiples of the tick step (linear) or powers of ten (log).
  std::vector<double> y_ticks;
  if (y_scale == AxisScale::Log) {
    y_lo = std::pow(10.0, std::floor(std::log10(y_lo)));
    y_hi = std::pow(10.0, std::ceil(std::log10(y_hi * (1 + 1e-12))));
    for (double t = y_lo; t <= y_hi * (1 + 1e-9); t *= 10) y_ticks.push_back(t);
  } else {
    if (!(y_hi > y_lo)) y_hi = y_lo + 1;
    const double step = tick_step(y_hi - y_lo);
    y_lo = step * std::floor(y_lo / step);
    y_hi = step * std::ceil(y_hi / step);
    for (double t = y_lo; t <= y_hi + step * 1e-9; t += step) y_ticks.push_back(t);
  }
  std::vector<double> x_ticks;
  if (x_scale == AxisScale::Log || xs.size() <= 10) {
    x_ticks = xs;
  } else {
    const double step = tick_step(x_hi - x_lo);
    for (double t = step * std::ceil(x_lo / step); t <= x_hi + step * 1e-9; t += step) x_ticks.push_back(t);
  }

  const int left = 80, plot_top = 50, plot_width = 560, plot_height = 300, base = plot_top + plot_height;
  const int legend_rows = static_cast<int>(series.size() + 1) / 2;
  const int width = left + plot_width + 30, height = base + 60 + 20 * legend_rows;
  const Axis ax{x_scale, x_lo, x_hi, static_cast<double>(plot_width)};
  const Axis ay{y_scale, y_lo, y_hi, static_cast<double>(plot_height)};
  auto px = [&](double x) { return left + ax.map(x); };
  auto py = [&](double y) { return base - ay.map(y); };

  std::ofstream out = open_chart(path, width, height, title);
  for (double t : y_ticks) {
    const double y = py(t);
    out << "<line x1=\"" << left - 4 << "\" y1=\"" << y << "\" x2=\"" << left + plot_width << "\" y2=\"" << y
        << "\" stroke=\"#dddddd\"/>\n<text x=\"" << left - 7 << "\" y=\"" << y + 4 << "\" text-anchor=\"end\">"
        << short_number(t) << "</text>\n";
  }
  for (double t : x_ticks) {
    const double x = px(t);
    out << "<line x1=\"" << x << "\" y1=\"" << base << "\" x2=\"" << x << "\" y2=\"" << base + 4
        << "\" stroke=\"black\"/>\n<text x=\"" << x << "\" y=\"" << base + 18 << "\" text-anchor=\"middle\">"
        << short_number(t) << "</text>\n";
  }
  out << "<polyline points=\"" << left << "," << plot_top << " " << left << "," << base << " " << left + plot_width
      << "," << base << "\" fill=\"none\" stroke=\"black\"/>\n"
      << "<text x=\"" << left + plot_width / 2 << "\" y=\"" << base + 38 << "\" text-anchor=\"middle\">" << x_label
      << "</text>\n<text transform=\"translate(16 " << plot_top + plot_height / 2
      << ") rotate(-90)\" text-anchor=\"middle\">" << y_label << "</text>\n";
  for (size_t s = 0; s < series.size(); ++s) {
    const char* colour = kColours[s % kColourCount];
    // Every other line dashed: lines that coincide (the point of some charts) stay visible.
    out << "<polyline fill=\"none\" stroke=\"" << colour << "\" stroke-width=\"2\""
        << (s % 2 ? " stroke-dasharray=\"7 4\"" : "") << " points=\"";
    for (size_t i = 0; i < xs.size(); ++i)
      if (!std::isnan(series[s].values[i])) out << px(xs[i]) << "," << py(series[s].values[i]) << " ";
    out << "\"/>\n";
    if (xs.size() <= 40)
      for (size_t i = 0; i < xs.size(); ++i)
        if (!std::isnan(series[s].values[i]))
          out << "<circle cx=\"" << px(xs[i]) << "\" cy=\"" << py(series[s].values[i]) << "\" r=\"3\" fill=\"" << colour
            << "\"><title>" << series[s].name << ": " << series[s].values[i] << "</title></circle>\n";
    const int lx = left + static_cast<int>(s % 2) * (plot_width / 2), ly = base + 52 + static_cast<int>(s / 2) * 20;
    out << "<rect x=\"" << lx << "\" y=\"" << ly << "\" width=\"12\" height=\"12\" fill=\"" << colour
        << "\"/><text x=\"" << lx + 16 << "\" y=\"" << ly + 11 << "\">" << series[s].name << "</text>\n";
  }
  close_chart(out, path);
}

}  // namespace cp
