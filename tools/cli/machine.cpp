#include "tools/cli/machine.hpp"

#include <omp.h>

#include <fstream>

#include "flashattn/error.hpp"

namespace flashattn::cli {

std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

int resolved_threads(int requested) { return requested > 0 ? requested : omp_get_max_threads(); }

double cpu_clock_ghz() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("cpu MHz", 0) == 0) return std::stod(line.substr(line.find(':') + 1)) * 1e-3;
  std::ifstream max_freq("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq");  // kHz
  double khz = 0.0;
  if (max_freq >> khz && khz > 0.0) return khz * 1e-6;
  throw Error("cpu clock: neither /proc/cpuinfo nor cpufreq states it");
}

}  // namespace flashattn::cli
