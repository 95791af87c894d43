// Facts of the machine the CLI runs on, for its reports.
#pragma once

#include <string>

namespace flashattn::cli {

std::string cpu_model();
int resolved_threads(int requested);
// Nominal clock of this CPU in GHz (/proc/cpuinfo, else cpufreq); throws Error when unknown.
double cpu_clock_ghz();

}  // namespace flashattn::cli
