// Minimal SVG charts for `flashattn tour --out` and `flashattn bench --plot`: line charts
// (optionally log-log) and grouped bar charts, written as plain text with no dependency.
#pragma once

#include <string>
#include <vector>

namespace flashattn::cli::svg {

struct Series {
  std::string name;
  std::vector<double> x;  // line charts only
  std::vector<double> y;  // one value per x (line) or per category (bars)
};

struct Axes {
  std::string title, x_label, y_label;
  bool log_x = false, log_y = false;
};

std::string line_chart(const Axes& axes, const std::vector<Series>& series);
std::string bar_chart(const Axes& axes, const std::vector<std::string>& categories, const std::vector<Series>& series);

// Writes `svg` to `path`; throws flashattn::Error naming the path when it cannot.
void write(const std::string& path, const std::string& svg);

}  // namespace flashattn::cli::svg
