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

}  // namespace

void write_bar_chart(const std::string& path, const std::string& title, const std::vector<std::string>& groups,
                     const std::vector<BarSeries>& series, const std::string& value_label) {
  static const char* colours[] = {"#d95f02", "#1b9e77", "#7570b3", "#e7298a", "#66a61e", "#e6ab02"};
  constexpr int kColours = sizeof(colours) / sizeof(colours[0]);
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

  std::ofstream out(path);
  CP_CHECK(out.good(), "cannot write the chart ", path);
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"10\" y=\"22\" font-size=\"14\">" << title << "</text>\n";
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
          << "\" fill=\"" << colours[s % kColours] << "\"><title>" << series[s].name << ": " << v << "</title></rect>\n"
          << "<text transform=\"translate(" << x + bar / 2 + 2 << " " << base - h - 4
          << ") rotate(-90)\" font-size=\"11\">" << short_number(v) << "</text>\n";
    }
    out << "<text x=\"" << x0 + (group_width - gap) / 2 << "\" y=\"" << base + 18 << "\" text-anchor=\"middle\">"
        << groups[g] << "</text>\n";
  }
  for (size_t s = 0; s < series.size(); ++s) {
    const int x = left + static_cast<int>(s % legend_columns) * legend_item;
    const int y = base + 32 + static_cast<int>(s / legend_columns) * 20;
    out << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"12\" height=\"12\" fill=\"" << colours[s % kColours]
        << "\"/><text x=\"" << x + 16 << "\" y=\"" << y + 11 << "\">" << series[s].name << "</text>\n";
  }
  out << "</svg>\n";
  CP_CHECK(out.good(), "cannot write the chart ", path);
}

}  // namespace cp
