#include "common/svg.h"

#include <algorithm>
#include <fstream>

#include "common/error.h"

namespace cp {

void write_bar_chart(const std::string& path, const std::string& title, const std::vector<std::string>& groups,
                     const std::vector<BarSeries>& series) {
  static const char* colours[] = {"#d95f02", "#1b9e77", "#7570b3", "#e7298a", "#66a61e", "#e6ab02"};
  constexpr int kColours = sizeof(colours) / sizeof(colours[0]);
  double top = 0;
  for (const BarSeries& s : series) {
    CP_CHECK(s.values.size() == groups.size(), "write_bar_chart: series '", s.name, "' has ", s.values.size(),
             " values for ", groups.size(), " groups");
    for (double v : s.values) top = std::max(top, v);
  }
  if (top <= 0) top = 1;
  const int bar = 18, group_width = static_cast<int>(series.size()) * bar + 16, legend_width = 150;
  const int width = std::max<int>(80 + static_cast<int>(groups.size()) * group_width,
                                  60 + static_cast<int>(series.size()) * legend_width);
  const int base = 260, height = 320;
  std::ofstream out(path);
  CP_CHECK(out.good(), "cannot write the chart ", path);
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"10\" y=\"20\" font-size=\"14\">" << title << "</text>\n"
      << "<line x1=\"50\" y1=\"" << base << "\" x2=\"" << width - 10 << "\" y2=\"" << base << "\" stroke=\"black\"/>\n";
  for (size_t g = 0; g < groups.size(); ++g) {
    const int x0 = 60 + static_cast<int>(g) * group_width;
    for (size_t s = 0; s < series.size(); ++s) {
      const double h = 200.0 * series[s].values[g] / top;
      out << "<rect x=\"" << x0 + static_cast<int>(s) * bar << "\" y=\"" << base - h << "\" width=\"" << bar - 2
          << "\" height=\"" << h << "\" fill=\"" << colours[s % kColours] << "\"><title>" << series[s].name << ": "
          << series[s].values[g] << "</title></rect>\n";
    }
    out << "<text x=\"" << x0 << "\" y=\"" << base + 16 << "\">" << groups[g] << "</text>\n";
  }
  for (size_t s = 0; s < series.size(); ++s)
    out << "<rect x=\"" << 60 + s * legend_width << "\" y=\"" << base + 30 << "\" width=\"12\" height=\"12\" fill=\""
        << colours[s % kColours] << "\"/><text x=\"" << 76 + s * legend_width << "\" y=\"" << base + 41 << "\">"
        << series[s].name << "</text>\n";
  out << "</svg>\n";
  CP_CHECK(out.good(), "cannot write the chart ", path);
}

}  // namespace cp
