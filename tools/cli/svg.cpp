#include "tools/cli/svg.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "flashattn/error.hpp"

namespace flashattn::cli::svg {
namespace {

// Canvas and plot area, in pixels; the canvas grows taller when the legend needs it.
constexpr double kWidth = 720, kMinHeight = 440;
constexpr double kLeft = 80, kRight = 190, kTop = 40, kBottom = 60;  // right margin holds the legend
constexpr double kPlotW = kWidth - kLeft - kRight;
constexpr double kLegendTop = kTop + 10, kLegendRow = 20;  // first legend row, row pitch
constexpr int kTicks = 5;
constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf"};
constexpr int kColorCount = sizeof(kColors) / sizeof(kColors[0]);
// Once the colors repeat, lines differ by dash pattern (a sweep plots two dozen series).
constexpr const char* kDashes[] = {"", "7,4", "2,3", "10,3,2,3"};
constexpr int kDashCount = sizeof(kDashes) / sizeof(kDashes[0]);

const char* color(std::size_t k) { return kColors[k % kColorCount]; }
std::string dash(std::size_t k) {
  const char* d = kDashes[(k / kColorCount) % kDashCount];
  return *d ? std::string(" stroke-dasharray=\"") + d + "\"" : std::string();
}

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

std::string number(double v) {
  char buf[32];
  const double a = std::fabs(v);
  if (a != 0.0 && (a >= 1e5 || a < 1e-2)) std::snprintf(buf, sizeof buf, "%.1e", v);
  else std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

// A linear or logarithmic map from data to [0, 1].
struct Scale {
  double lo, hi;
  bool log;
  Scale(double lo_, double hi_, bool log_) : lo(lo_), hi(hi_), log(log_) {
    if (log) {
      lo = std::log10(std::max(lo, 1e-300));
      hi = std::log10(std::max(hi, 1e-300));
    }
    if (hi <= lo) hi = lo + 1.0;
  }
  double operator()(double v) const { return ((log ? std::log10(std::max(v, 1e-300)) : v) - lo) / (hi - lo); }
  double value(double t) const {  // inverse, for tick labels
    const double u = lo + t * (hi - lo);
    return log ? std::pow(10.0, u) : u;
  }
};

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

void y_ticks(std::ostringstream& s, const Scale& y, const Frame& f) {
  for (int i = 0; i <= kTicks; ++i) {
    const double t = static_cast<double>(i) / kTicks, py = kTop + f.plot_h * (1 - t);
    s << "<line x1=\"" << kLeft << "\" x2=\"" << kLeft + kPlotW << "\" y1=\"" << py << "\" y2=\"" << py
      << "\" stroke=\"#ddd\"/>\n<text x=\"" << kLeft - 6 << "\" y=\"" << py + 4 << "\" text-anchor=\"end\">"
      << number(y.value(t)) << "</text>\n";
  }
}

// Swatches: a line with the series' dash pattern for line charts, a square for bars.
void legend(std::ostringstream& s, const std::vector<Series>& series, bool lines) {
  for (std::size_t i = 0; i < series.size(); ++i) {
    const double y = kLegendTop + kLegendRow * static_cast<double>(i);
    if (lines)
      s << "<line x1=\"" << kWidth - kRight + 6 << "\" x2=\"" << kWidth - kRight + 26 << "\" y1=\"" << y - 3
        << "\" y2=\"" << y - 3 << "\" stroke-width=\"2\" stroke=\"" << color(i) << "\"" << dash(i) << "/>\n";
    else
      s << "<rect x=\"" << kWidth - kRight + 12 << "\" y=\"" << y - 9 << "\" width=\"12\" height=\"12\" fill=\""
        << color(i) << "\"/>\n";
    s << "<text x=\"" << kWidth - kRight + 30 << "\" y=\"" << y + 1 << "\">" << escape(series[i].name) << "</text>\n";
  }
}

}  // namespace

std::string line_chart(const Axes& a, const std::vector<Series>& series) {
  double x_lo = 1e300, x_hi = -1e300, y_lo = 1e300, y_hi = -1e300;
  for (const Series& sr : series)
    for (std::size_t i = 0; i < sr.x.size(); ++i) {
      x_lo = std::min(x_lo, sr.x[i]), x_hi = std::max(x_hi, sr.x[i]);
      y_lo = std::min(y_lo, sr.y[i]), y_hi = std::max(y_hi, sr.y[i]);
    }
  if (!a.log_y) y_lo = std::min(y_lo, 0.0);
  const Scale x(x_lo, x_hi, a.log_x), y(y_lo, a.log_y ? y_hi : y_hi * 1.05, a.log_y);
  const Frame f(series.size());
  std::ostringstream s;
  header(s, a, f);
  y_ticks(s, y, f);
  for (int i = 0; i <= kTicks; ++i) {
    const double t = static_cast<double>(i) / kTicks;
    s << "<text x=\"" << kLeft + kPlotW * t << "\" y=\"" << kTop + f.plot_h + 18 << "\" text-anchor=\"middle\">"
      << number(x.value(t)) << "</text>\n";
  }
  for (std::size_t k = 0; k < series.size(); ++k) {
    const Series& sr = series[k];
    s << "<polyline fill=\"none\" stroke-width=\"2\" stroke=\"" << color(k) << "\"" << dash(k) << " points=\"";
    for (std::size_t i = 0; i < sr.x.size(); ++i)
      s << kLeft + kPlotW * x(sr.x[i]) << "," << kTop + f.plot_h * (1 - y(sr.y[i])) << " ";
    s << "\"/>\n";
    for (std::size_t i = 0; i < sr.x.size(); ++i)
      s << "<circle r=\"3\" fill=\"" << color(k) << "\" cx=\"" << kLeft + kPlotW * x(sr.x[i])
        << "\" cy=\"" << kTop + f.plot_h * (1 - y(sr.y[i])) << "\"/>\n";
  }
  legend(s, series, true);
  s << "</svg>\n";
  return s.str();
}

std::string bar_chart(const Axes& a, const std::vector<std::string>& categories, const std::vector<Series>& series) {
  double y_hi = 0;
  for (const Series& sr : series)
    for (const double v : sr.y) y_hi = std::max(y_hi, v);
  const Scale y(0.0, y_hi * 1.05, false);
  const Frame f(series.size());
  std::ostringstream s;
  header(s, a, f);
  y_ticks(s, y, f);
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
  legend(s, series, false);
  s << "</svg>\n";
  return s.str();
}

void write(const std::string& path, const std::string& svg) {
  std::ofstream out(path);
  out << svg;
  if (!out) throw Error("svg: cannot write " + path);
}

}  // namespace flashattn::cli::svg
