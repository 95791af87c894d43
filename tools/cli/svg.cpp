#include "tools/cli/svg.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

#include "flashattn/error.hpp"

namespace flashattn::cli::svg {
namespace {

// Canvas and plot area, in pixels; the canvas grows taller when the legend needs it.
constexpr double kWidth = 720, kMinHeight = 440;
constexpr double kLeft = 80, kRight = 190, kTop = 40, kBottom = 60;  // right margin holds the legend
constexpr double kPlotW = kWidth - kLeft - kRight;
constexpr double kLegendTop = kTop + 10, kLegendRow = 20;  // first legend row, row pitch
constexpr std::size_t kMaxTicks = 8;                       // per axis, at most
constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf"};
constexpr int kColorCount = sizeof(kColors) / sizeof(kColors[0]);
// Once the colors repeat, lines differ by dash pattern (a sweep plots two dozen series).
constexpr const char* kDashes[] = {"", "7,4", "2,3", "10,3,2,3"};
constexpr int kDashCount = sizeof(kDashes) / sizeof(kDashes[0]);
constexpr const char* kCoincidentDash = "5,5";  // a line drawn over an identical one

const char* color(std::size_t k) { return kColors[k % kColorCount]; }
std::string dash_attribute(const char* d) {
  return *d ? std::string(" stroke-dasharray=\"") + d + "\"" : std::string();
}
const char* dash(std::size_t k) { return kDashes[(k / kColorCount) % kDashCount]; }

struct Frame {
  double height, plot_h;
  explicit Frame(std::size_t legend_rows)
      : height(std::max(kMinHeight, kLegendTop + kLegendRow * static_cast<double>(legend_rows) + kBottom)),
        plot_h(height - kTop - kBottom) {}
};

std::string escape(const std::string& s) {
  std::string out;
  for (const char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else out += c;
  }
  return out;
}

// "1.5 MiB", "64 Ki", "2048", "0.25": three significant digits at most, no trailing zeros.
std::string label(double v, Unit unit) {
  char buf[32];
  if (unit != Unit::number) {
    const char* bytes[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    const char* counts[] = {"", "Ki", "Mi", "Gi", "Ti"};
    int u = 0;
    while (std::fabs(v) >= 1024.0 && u < 4) v /= 1024.0, ++u;
    const char* suffix = unit == Unit::bytes ? bytes[u] : counts[u];
    std::snprintf(buf, sizeof buf, "%.3g%s%s", v, *suffix ? " " : "", suffix);
    return buf;
  }
  const double a = std::fabs(v);
  if (a >= 1e6 || (a != 0.0 && a < 1e-3)) std::snprintf(buf, sizeof buf, "%.3g", v);
  else if (a >= 100.0 || v == std::round(v)) std::snprintf(buf, sizeof buf, "%.0f", v);
  else std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

// A linear or logarithmic map from data to [0, 1].
struct Scale {
  double lo, hi;
  bool log;
  Scale(double lo_, double hi_, bool log_) : lo(lo_), hi(hi_), log(log_) {
    if (log) {
      lo = std::log2(std::max(lo, 1e-300));
      hi = std::log2(std::max(hi, 1e-300));
    }
    if (hi <= lo) hi = lo + 1.0;
  }
  double operator()(double v) const { return ((log ? std::log2(std::max(v, 1e-300)) : v) - lo) / (hi - lo); }
};

// Every k-th of `v` so that at most kMaxTicks remain, the first kept.
std::vector<double> thinned(const std::vector<double>& v) {
  const std::size_t k = (v.size() + kMaxTicks - 1) / kMaxTicks;
  std::vector<double> out;
  for (std::size_t i = 0; i < v.size(); i += std::max<std::size_t>(k, 1)) out.push_back(v[i]);
  return out;
}

// An axis: its range and its ticks, from the data shown on it.
struct Axis {
  double lo = 0.0, hi = 1.0;
  std::vector<double> ticks;
};

// Log axis: the range widened to the enclosing powers of two; ticks at the data's own values
// when they are few (`data_ticks`: the x axis), else at powers of two, every k-th.
Axis log_axis(const std::vector<double>& values, bool data_ticks) {
  std::set<double> distinct;
  for (const double v : values)
    if (v > 0.0) distinct.insert(v);
  Axis a;
  if (distinct.empty()) return a;
  const double lo = *distinct.begin(), hi = *distinct.rbegin();
  if (data_ticks && distinct.size() <= kMaxTicks) {
    a.lo = lo, a.hi = hi;
    a.ticks.assign(distinct.begin(), distinct.end());
    return a;
  }
  const int e0 = static_cast<int>(std::floor(std::log2(lo) + 1e-9)), e1 = static_cast<int>(std::ceil(std::log2(hi) - 1e-9));
  a.lo = std::ldexp(1.0, e0), a.hi = std::ldexp(1.0, std::max(e1, e0 + 1));
  std::vector<double> powers;
  for (int e = e0; e <= std::max(e1, e0 + 1); ++e) powers.push_back(std::ldexp(1.0, e));
  a.ticks = thinned(powers);
  return a;
}

// Linear axis from min(0, data) to the data's maximum: ticks at the data's values when they
// are a few integers (thread counts), else at a 1-2-5 step, the top raised to a tick.
Axis linear_axis(const std::vector<double>& values, bool data_ticks) {
  std::set<double> distinct(values.begin(), values.end());
  Axis a;
  if (distinct.empty()) return a;
  const bool integers = std::all_of(distinct.begin(), distinct.end(), [](double v) { return v == std::round(v); });
  if (data_ticks && integers && distinct.size() <= kMaxTicks) {
    a.lo = *distinct.begin(), a.hi = *distinct.rbegin();
    if (a.hi <= a.lo) a.lo -= 1.0, a.hi += 1.0;
    a.ticks.assign(distinct.begin(), distinct.end());
    return a;
  }
  const double lo = std::min(0.0, *distinct.begin()), hi = std::max(*distinct.rbegin(), lo + 1e-300);
  const double raw = (hi - lo) / 5.0, mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double step = raw / mag <= 1.0 ? mag : raw / mag <= 2.0 ? 2 * mag : raw / mag <= 5.0 ? 5 * mag : 10 * mag;
  a.lo = std::floor(lo / step) * step;
  a.hi = std::ceil(hi / step) * step;
  for (double t = a.lo; t <= a.hi + step * 1e-6; t += step) a.ticks.push_back(std::fabs(t) < step * 1e-9 ? 0.0 : t);
  return a;
}

void header(std::ostringstream& s, const Axes& a, const Frame& f) {
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\"" << f.height
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << kWidth / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">" << escape(a.title) << "</text>\n"
    << "<text x=\"" << kLeft + kPlotW / 2 << "\" y=\"" << f.height - 15 << "\" text-anchor=\"middle\">" << escape(a.x_label)
    << "</text>\n"
    << "<text transform=\"translate(18," << kTop + f.plot_h / 2 << ") rotate(-90)\" text-anchor=\"middle\">"
    << escape(a.y_label) << "</text>\n"
    << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << kPlotW << "\" height=\"" << f.plot_h
    << "\" fill=\"none\" stroke=\"#444\"/>\n";
}

void y_ticks(std::ostringstream& s, const Axis& axis, const Scale& y, Unit unit, const Frame& f) {
  for (const double v : axis.ticks) {
    const double py = kTop + f.plot_h * (1 - y(v));
    s << "<line x1=\"" << kLeft << "\" x2=\"" << kLeft + kPlotW << "\" y1=\"" << py << "\" y2=\"" << py
      << "\" stroke=\"#ddd\"/>\n<text x=\"" << kLeft - 6 << "\" y=\"" << py + 4 << "\" text-anchor=\"end\">"
      << escape(label(v, unit)) << "</text>\n";
  }
}

// One legend entry: a swatch (a line with the series' dash pattern for line charts, a
// square for bars), the name, and an optional note on the row below.
struct LegendEntry {
  std::string name, note;
  const char* color;
  const char* dash;
};

std::size_t legend_rows(const std::vector<LegendEntry>& entries) {
  std::size_t rows = 0;
  for (const LegendEntry& e : entries) rows += e.note.empty() ? 1 : 2;
  return rows;
}

void legend(std::ostringstream& s, const std::vector<LegendEntry>& entries, bool lines) {
  double y = kLegendTop;
  for (const LegendEntry& e : entries) {
    if (lines)
      s << "<line x1=\"" << kWidth - kRight + 6 << "\" x2=\"" << kWidth - kRight + 26 << "\" y1=\"" << y - 3
        << "\" y2=\"" << y - 3 << "\" stroke-width=\"2\" stroke=\"" << e.color << "\"" << dash_attribute(e.dash) << "/>\n";
    else
      s << "<rect x=\"" << kWidth - kRight + 12 << "\" y=\"" << y - 9 << "\" width=\"12\" height=\"12\" fill=\""
        << e.color << "\"/>\n";
    s << "<text x=\"" << kWidth - kRight + 30 << "\" y=\"" << y + 1 << "\">" << escape(e.name) << "</text>\n";
    y += kLegendRow;
    if (e.note.empty()) continue;
    s << "<text x=\"" << kWidth - kRight + 30 << "\" y=\"" << y - 3 << "\" font-size=\"11\" fill=\"#555\">"
      << escape(e.note) << "</text>\n";
    y += kLegendRow;
  }
}

bool coincide(const Series& a, const Series& b) {
  if (a.x.empty() || a.x != b.x || a.y.size() != b.y.size()) return false;
  for (std::size_t i = 0; i < a.y.size(); ++i)
    if (std::fabs(a.y[i] - b.y[i]) > 1e-9 * std::max(std::fabs(a.y[i]), std::fabs(b.y[i]))) return false;
  return true;
}

}  // namespace

std::string line_chart(const Axes& a, const std::vector<Series>& series) {
  std::vector<double> xs, ys;
  for (const Series& sr : series) {
    xs.insert(xs.end(), sr.x.begin(), sr.x.end());
    ys.insert(ys.end(), sr.y.begin(), sr.y.begin() + static_cast<std::ptrdiff_t>(std::min(sr.x.size(), sr.y.size())));
  }
  const Axis xa = a.log_x ? log_axis(xs, true) : linear_axis(xs, true);
  const Axis ya = a.log_y ? log_axis(ys, false) : linear_axis(ys, false);
  const Scale x(xa.lo, xa.hi, a.log_x), y(ya.lo, ya.hi, a.log_y);
  std::vector<LegendEntry> entries;
  for (std::size_t k = 0; k < series.size(); ++k) {
    LegendEntry e{series[k].name, "", color(k), dash(k)};
    for (std::size_t i = 0; i < k; ++i)
      if (coincide(series[i], series[k])) {
        e.note = "= " + series[i].name + " (same line)";
        e.dash = kCoincidentDash;
        break;
      }
    entries.push_back(e);
  }
  const Frame f(legend_rows(entries));
  std::ostringstream s;
  header(s, a, f);
  y_ticks(s, ya, y, a.y_unit, f);
  for (const double v : xa.ticks)
    s << "<text x=\"" << kLeft + kPlotW * x(v) << "\" y=\"" << kTop + f.plot_h + 18 << "\" text-anchor=\"middle\">"
      << escape(label(v, a.x_unit)) << "</text>\n";
  for (std::size_t k = 0; k < series.size(); ++k) {
    const Series& sr = series[k];
    const std::size_t n = std::min(sr.x.size(), sr.y.size());
    s << "<polyline fill=\"none\" stroke-width=\"2\" stroke=\"" << entries[k].color << "\""
      << dash_attribute(entries[k].dash) << " points=\"";
    for (std::size_t i = 0; i < n; ++i) s << kLeft + kPlotW * x(sr.x[i]) << "," << kTop + f.plot_h * (1 - y(sr.y[i])) << " ";
    s << "\"/>\n";
    for (std::size_t i = 0; i < n; ++i)
      s << "<circle r=\"3\" fill=\"" << entries[k].color << "\" cx=\"" << kLeft + kPlotW * x(sr.x[i]) << "\" cy=\""
        << kTop + f.plot_h * (1 - y(sr.y[i])) << "\"/>\n";
  }
  legend(s, entries, true);
  s << "</svg>\n";
  return s.str();
}

std::string bar_chart(const Axes& a, const std::vector<std::string>& categories, const std::vector<Series>& series) {
  std::vector<double> ys{0.0};
  for (const Series& sr : series) ys.insert(ys.end(), sr.y.begin(), sr.y.end());
  const Axis ya = linear_axis(ys, false);
  const Scale y(ya.lo, ya.hi, false);
  std::vector<LegendEntry> entries;
  for (std::size_t k = 0; k < series.size(); ++k) entries.push_back({series[k].name, "", color(k), ""});
  const Frame f(legend_rows(entries));
  std::ostringstream s;
  header(s, a, f);
  y_ticks(s, ya, y, a.y_unit, f);
  const double group = kPlotW / static_cast<double>(std::max<std::size_t>(categories.size(), 1));
  const double bar = group * 0.8 / static_cast<double>(std::max<std::size_t>(series.size(), 1));
  for (std::size_t c = 0; c < categories.size(); ++c) {
    const double gx = kLeft + group * static_cast<double>(c);
    s << "<text x=\"" << gx + group / 2 << "\" y=\"" << kTop + f.plot_h + 18 << "\" text-anchor=\"middle\">"
      << escape(categories[c]) << "</text>\n";
    for (std::size_t k = 0; k < series.size(); ++k) {
      const double v = c < series[k].y.size() ? series[k].y[c] : 0.0, h = f.plot_h * y(v);
      s << "<rect x=\"" << gx + group * 0.1 + bar * static_cast<double>(k) << "\" y=\"" << kTop + f.plot_h - h
        << "\" width=\"" << bar << "\" height=\"" << h << "\" fill=\"" << color(k) << "\"/>\n";
    }
  }
  legend(s, entries, false);
  s << "</svg>\n";
  return s.str();
}

void write(const std::string& path, const std::string& svg) {
  std::ofstream out(path);
  out << svg;
  if (!out) throw Error("svg: cannot write " + path);
}

}  // namespace flashattn::cli::svg
