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

// How an axis labels its ticks: plain numbers, bytes (KiB, MiB, GiB) or counts with binary
// prefixes (Ki, Mi, Gi — element counts that are powers of two).
enum class Unit { number, bytes, binary };

// Log axes put their ticks at the data's own values (x) or at powers of two (y); linear
// axes at the data's values when they are a few integers, else at 1-2-5 steps.
struct Axes {
  std::string title, x_label, y_label;
  bool log_x = false, log_y = false;
  Unit x_unit = Unit::number, y_unit = Unit::number;
};

// Series whose points all coincide with an earlier series' are drawn dashed over it and
// say so in the legend ("= tiled (model)").
std::string line_chart(const Axes& axes, const std::vector<Series>& series);
std::string bar_chart(const Axes& axes, const std::vector<std::string>& categories, const std::vector<Series>& series);

// Writes `svg` to `path`; throws flashattn::Error naming the path when it cannot.
void write(const std::string& path, const std::string& svg);

}  // namespace flashattn::cli::svg
