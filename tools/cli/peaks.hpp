// The machine's arithmetic peaks, measured by `flashattn bench` with its own loops in the
// process that times the cases, so that every case is a fraction of a limit measured beside
// it (issue 25):
//   fma       float32 multiply-adds: 12 independent MulAdd chains a thread in the widest
//             vectors of the Highway target the CPU dispatches to (foreach_target), the
//             bound of every float32 kernel and of bf16 ones that compute in float32;
//   bf16_dot  VDPBF16PS (AVX512-BF16): 12 independent chains of zmm dot products of bf16
//             pairs, the bound of the tiled_bf16 kernels where they run without AMX;
//   amx_bf16  TDPBF16PS (AMX-BF16) on four 16 × 16 float32 accumulator tiles, the bound of
//             the tiled_bf16 kernels where they run on AMX.
// A peak the CPU cannot run is not measured: its `reason` names the missing feature.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace flashattn::cli {

struct Peak {
  std::optional<double> gflops;  // at the run's threads, best of the repeats; empty: `reason`
  std::string isa;               // what the loop ran, e.g. "AVX2 (Highway), 8 float32 lanes, 12 chains a thread"
  std::string reason;            // why it was not measured (empty when it was)
};

struct Peaks {
  Peak fma, bf16_dot, amx_bf16;
  // The peak that bounds a case run by the kernel named `kernel`, and its name ("fma",
  // "bf16_dot" or "amx_bf16"): tiled_bf16 computes on bf16 dot products (on AMX tiles where
  // the library runs them there), every other kernel and standard attention in float32 FMA.
  struct Bound {
    const char* name;
    const Peak* peak;
  };
  Bound bound_of(const std::string& kernel) const;
};

// Each loop `threads` threads at once, best of `repeats` after one warm-up run.
Peaks measure_peaks(int threads, int repeats);
// Measures the peaks once more after the cases they bound, and again (at most three more
// times) while one of `cases` — (kernel, GFLOP/s) — ran faster than the peak that bounds it,
// keeping each peak's best: a peak measured while the host held one of the bench's cores
// back (a virtual machine's steal time) came out at half the machine's, and every fraction
// of it doubled (a masks run reported 157%). A case still above its peak then shows it.
void confirm_peaks(Peaks& peaks, const std::vector<std::pair<std::string, double>>& cases, int threads, int repeats);
// `gflops` as a percentage of `peak` for a table ("37%"), "-" where the peak was not measured.
std::string percent_of_peak(double gflops, const Peak& peak);
// One line a peak on stdout: its GFLOP/s and loop, or why it was not measured.
void print_peaks(const Peaks& peaks);

}  // namespace flashattn::cli
