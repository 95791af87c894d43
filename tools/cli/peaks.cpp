// The peak loops (peaks.hpp). The FMA loop is compiled once per Highway SIMD target
// (foreach_target) and dispatched like the kernels, so it runs the widest vectors of every
// CPU the library runs on. The bf16 loops use instructions Highway 1.0.3 does not emit (its
// bf16 ReorderWidenMulAccumulate widens to float32 and multiplies there), so they are
// intrinsics in functions that carry their instruction sets in target attributes, like
// src/cpu/kernels/bf16_dot.cpp, and run only where the CPU has them.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "tools/cli/peaks.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace flashattn::cli::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Zen 3/4 and Intel cores retire two FMAs a cycle at a 4-cycle latency: 8 independent
// chains fill them, 12 leave slack. Each step is c·a + b, which keeps the values bounded.
// The chains are named one by one (arrays of vectors are not allowed on SVE and RVV) and
// start apart, so that no compiler merges two.
double FmaLoop(std::int64_t steps, float* sink) {
  const hn::ScalableTag<float> d;
  const auto a = hn::Set(d, 0.999f), b = hn::Set(d, 0.001f);
  auto c0 = hn::Set(d, 0.000f), c1 = hn::Set(d, 0.001f), c2 = hn::Set(d, 0.002f), c3 = hn::Set(d, 0.003f);
  auto c4 = hn::Set(d, 0.004f), c5 = hn::Set(d, 0.005f), c6 = hn::Set(d, 0.006f), c7 = hn::Set(d, 0.007f);
  auto c8 = hn::Set(d, 0.008f), c9 = hn::Set(d, 0.009f), c10 = hn::Set(d, 0.010f), c11 = hn::Set(d, 0.011f);
  for (std::int64_t i = 0; i < steps; ++i) {
    c0 = hn::MulAdd(c0, a, b), c1 = hn::MulAdd(c1, a, b), c2 = hn::MulAdd(c2, a, b);
    c3 = hn::MulAdd(c3, a, b), c4 = hn::MulAdd(c4, a, b), c5 = hn::MulAdd(c5, a, b);
    c6 = hn::MulAdd(c6, a, b), c7 = hn::MulAdd(c7, a, b), c8 = hn::MulAdd(c8, a, b);
    c9 = hn::MulAdd(c9, a, b), c10 = hn::MulAdd(c10, a, b), c11 = hn::MulAdd(c11, a, b);
  }
  const auto sum = ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)) + ((c8 + c9) + (c10 + c11));
  *sink = hn::GetLane(sum);
  return 2.0 * 12 * static_cast<double>(hn::Lanes(d)) * static_cast<double>(steps);
}

// The target the loop above was compiled for, and its lanes of float32.
std::int64_t FmaTarget() { return HWY_TARGET; }
std::int64_t FmaLanes() { return static_cast<std::int64_t>(hn::Lanes(hn::ScalableTag<float>())); }

}  // namespace flashattn::cli::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "flashattn/flashattn.hpp"
#include "tools/cli/peaks.hpp"

namespace flashattn::cli {
HWY_EXPORT(FmaLoop);
HWY_EXPORT(FmaTarget);
HWY_EXPORT(FmaLanes);

namespace {

// Each loop does about 6.4 GFLOP a thread a run (FMA: 384 a step, VDPBF16PS: 768): tens of
// milliseconds at the peak. A bench --sweep measures both peaks before every case, and on an
// Intel CPU, where VDPBF16PS runs at half FMA's rate, twice FMA's work took 0.1 s a run.
constexpr std::int64_t kFmaSteps = std::int64_t{1} << 24;
constexpr std::int64_t kDotSteps = std::int64_t{1} << 23;
constexpr std::int64_t kAmxSteps = std::int64_t{1} << 20;

// GFLOP/s of `loop` (FLOPs done, a value to keep live) run by `threads` threads at once, best
// of `repeats` after one warm-up. Fresh threads, not the OpenMP team: the AMX loop loads its
// own tile configuration, which must not be left on a thread the library's kernels reuse.
double best_gflops(int threads, int repeats, const std::function<double(float*)>& loop) {
  double best = 0.0;
  for (int r = 0; r < repeats + 1; ++r) {
    std::vector<double> flops(static_cast<std::size_t>(threads));
    std::vector<float> sinks(static_cast<std::size_t>(threads));
    std::vector<std::thread> team;
    const auto t0 = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t)
      team.emplace_back([&, t] { flops[static_cast<std::size_t>(t)] = loop(&sinks[static_cast<std::size_t>(t)]); });
    for (std::thread& t : team) t.join();
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double total = 0.0;
    for (int t = 0; t < threads; ++t) {
      total += flops[static_cast<std::size_t>(t)];
      if (sinks[static_cast<std::size_t>(t)] == 12345.0f) std::fputc(' ', stderr);  // keeps the results live
    }
    if (r > 0) best = std::max(best, total / sec * 1e-9);
  }
  return best;
}

#if defined(__x86_64__)
// bf16 (2^-10, 2^-10) in each 32-bit word: the products (2^-20 each) add up to 2^4 over
// kDotSteps pair steps, far from overflow and from denormals (which both loops flush).
constexpr int kSmallPair = 0x3A803A80;

// CPUID.(7, 0):EDX[22], AMX-BF16 (asked of CPUID: Clang 14's __builtin_cpu_supports does not
// know "amx-bf16").
bool HasAmxBf16() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) != 0 && (edx & (1u << 22)) != 0;
}

// 12 chains of VDPBF16PS: each step, 16 lanes × 2 products, multiplied and added.
__attribute__((target("avx512bf16,avx512f"))) double DotLoop(float* sink) {
  constexpr int kChains = 12;
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(0.001f * static_cast<float>(c));
  const __m512bh a = (__m512bh)_mm512_set1_epi32(kSmallPair);
  for (std::int64_t i = 0; i < kDotSteps; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, a);
  __m512 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  *sink = _mm512_reduce_add_ps(sum);
  return 2.0 * 16 * 2 * kChains * static_cast<double>(kDotSteps);
}

// AMX: four TDPBF16PS a step into C tiles 0–3 (16 × 16 float32 each) from A tiles 4, 5 and
// B tiles 6, 7 (16 rows × 16 pairs), each TDPBF16PS 16·16·32 products, multiplied and added.
struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t bytes_per_row[16] = {};
  std::uint8_t rows[16] = {};
};

__attribute__((target("amx-tile,amx-bf16"))) double AmxLoop(float* sink) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  int operand[16 * 16];  // one A or B tile: 16 rows of 16 pairs
  std::fill(operand, operand + 16 * 16, kSmallPair);
  float c[16 * 16];
  _tile_loadconfig(&config);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  for (std::int64_t i = 0; i < kAmxSteps; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  *sink = c[0];
  _tile_stored(3, c, 64);
  *sink += c[16 * 16 - 1];
  _tile_release();
  return 4.0 * 16 * 16 * 32 * 2 * static_cast<double>(kAmxSteps);
}
#endif

}  // namespace

Peaks measure_peaks(int threads, int repeats) {
  Peaks p;
  const std::int64_t target = HWY_DYNAMIC_DISPATCH(FmaTarget)();
  if (target == HWY_SCALAR || target == HWY_EMU128) {
    p.fma.reason = std::string("the dispatched Highway target ") + hwy::TargetName(target) +
                   " has no SIMD multiply-add";
  } else {
    p.fma.isa = std::string(hwy::TargetName(target)) + " (Highway), " +
                std::to_string(HWY_DYNAMIC_DISPATCH(FmaLanes)()) + " float32 lanes, 12 chains a thread";
    p.fma.gflops =
        best_gflops(threads, repeats, [](float* sink) { return HWY_DYNAMIC_DISPATCH(FmaLoop)(kFmaSteps, sink); });
  }
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512bf16")) {
    p.bf16_dot.isa = "AVX512-BF16 VDPBF16PS zmm, 12 chains a thread";
    p.bf16_dot.gflops = best_gflops(threads, repeats, DotLoop);
  } else {
    p.bf16_dot.reason = "no AVX512-BF16 on this CPU (VDPBF16PS)";
  }
  // CpuHardware::detect asks Linux for this process's tile state (a per-process grant) when
  // the CPU has AMX-BF16; the kernels run on tiles exactly where it says so.
  if (CpuHardware::detect(threads).amx_bf16) {
    p.amx_bf16.isa = "AMX-BF16 TDPBF16PS, 4 accumulator tiles a thread";
    p.amx_bf16.gflops = best_gflops(threads, repeats, AmxLoop);
  } else if (!HasAmxBf16()) {
    p.amx_bf16.reason = "no AMX-BF16 on this CPU (TDPBF16PS)";
  } else {
    p.amx_bf16.reason = "AMX-BF16 present but unusable here (Linux did not grant the tile state, or no AVX512-BF16)";
  }
#else
  p.bf16_dot.reason = "not an x86-64 CPU (VDPBF16PS)";
  p.amx_bf16.reason = "not an x86-64 CPU (TDPBF16PS)";
#endif
  return p;
}

void confirm_peaks(Peaks& peaks, const std::vector<std::pair<std::string, double>>& cases, int threads, int repeats) {
  const auto exceeded = [&] {
    for (const auto& [kernel, gflops] : cases)
      if (const Peak& peak = *peaks.bound_of(kernel).peak; peak.gflops && gflops > *peak.gflops) return true;
    return false;
  };
  for (int run = 0; run < 4 && (run == 0 || exceeded()); ++run) {
    const Peaks again = measure_peaks(threads, repeats);
    for (const auto& [best, now] : {std::pair{&peaks.fma, &again.fma}, std::pair{&peaks.bf16_dot, &again.bf16_dot},
                                    std::pair{&peaks.amx_bf16, &again.amx_bf16}})
      if (best->gflops && now->gflops) best->gflops = std::max(*best->gflops, *now->gflops);
  }
}

std::string percent_of_peak(double gflops, const Peak& peak) {
  if (!peak.gflops) return "-";
  char buf[16];
  std::snprintf(buf, sizeof buf, "%.0f%%", 100.0 * gflops / *peak.gflops);
  return buf;
}

void print_peaks(const Peaks& peaks) {
  for (const auto& [name, peak] : {std::pair{"FMA peak", &peaks.fma}, std::pair{"bf16 dot-product peak", &peaks.bf16_dot},
                                   std::pair{"AMX bf16 peak", &peaks.amx_bf16}}) {
    if (peak->gflops) std::printf("%s: %.1f GFLOP/s (%s)\n", name, *peak->gflops, peak->isa.c_str());
    else std::printf("%s: not measured (%s)\n", name, peak->reason.c_str());
  }
}

Peaks::Bound Peaks::bound_of(const std::string& kernel) const {
  if (kernel != "tiled_bf16") return {"fma", &fma};
  return amx_bf16.gflops ? Bound{"amx_bf16", &amx_bf16} : Bound{"bf16_dot", &bf16_dot};
}

}  // namespace flashattn::cli
#endif  // HWY_ONCE
