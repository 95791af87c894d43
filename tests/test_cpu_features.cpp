// No silent skip: the planner's view of this CPU (CpuHardware::detect, and the checks of the
// bf16 and half-precision kernels it rests on) against what the Linux kernel says of the CPU
// in /proc/cpuinfo, read independently. A kernel path the CPU can run must be the one the
// planner offers — a detection that misses a feature would leave its kernel untested while
// every test passes — and one it cannot run must never be offered (an illegal instruction).
// The tests that need a feature skip with GTEST_SKIP() << reason where it is absent, so the
// run's list of skipped tests is the list of kernel paths this machine did not reach.
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "src/cpu/kernels/bf16_dot.hpp"
#include "src/cpu/kernels/bf16_decode.hpp"
#include "src/cpu/kernels/fp16_decode.hpp"
#include "src/cpu/kernels/int8_dot.hpp"
#include "src/cpu/kernels/forward_kernel.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

struct CpuInfo {
  std::set<std::string> flags;
  std::string vendor;
  bool has(const std::string& flag) const { return flags.count(flag) != 0; }
};

// The first processor's "flags" and "vendor_id" lines; empty where there is no /proc/cpuinfo.
CpuInfo read_cpuinfo() {
  CpuInfo info;
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    const std::size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = line.substr(0, line.find_first_of(" \t"));
    std::istringstream value(line.substr(colon + 1));
    if (key == "vendor_id" && info.vendor.empty()) value >> info.vendor;
    if (key == "flags" && info.flags.empty())
      for (std::string flag; value >> flag;) info.flags.insert(flag);
    if (!info.flags.empty() && !info.vendor.empty()) break;
  }
  return info;
}

// /proc/cpuinfo of an x86-64 Linux machine, or a skip saying why there is none.
#define FLASHATTN_REQUIRE_CPUINFO(info)                                                  \
  const CpuInfo info = read_cpuinfo();                                                    \
  if (info.flags.empty()) GTEST_SKIP() << "no x86 flags in /proc/cpuinfo: not x86-64 Linux"

bool cpu_avx512(const CpuInfo& info) {
  // Highway's AVX3 target, which the AVX-512 kernels need: F, VL, DQ and BW. The Linux kernel
  // lists them only where it also saves the 512-bit register state (XCR0).
  return info.has("avx512f") && info.has("avx512vl") && info.has("avx512dq") && info.has("avx512bw");
}

bool avx512_target(const std::string& target) { return target.rfind("AVX3", 0) == 0; }

// The OS's side of AVX-512, read from the CPU itself: XSAVE enabled by the OS (CPUID.1:ECX
// OSXSAVE) and XCR0 saving the SSE, AVX, opmask and both halves of the ZMM state (bits 1, 2,
// 5, 6, 7) — the register state a context switch must keep.
bool os_saves_avx512_state() {
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0 || (ecx & (1u << 27)) == 0) return false;
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 0xE6u) == 0xE6u;
#else
  return false;
#endif
}

TEST(CpuFeatures, Avx512TargetExactlyWhereTheCpuHasAvx512) {
  FLASHATTN_REQUIRE_CPUINFO(info);
  const CpuHardware hw = CpuHardware::detect(0);
  EXPECT_EQ(avx512_target(hw.simd_target), cpu_avx512(info))
      << "dispatched SIMD target " << hw.simd_target << "; /proc/cpuinfo AVX-512 F/VL/DQ/BW: " << cpu_avx512(info);
  EXPECT_EQ(hw.simd_target, cpu_simd_target());
  if (cpu_avx512(info)) EXPECT_TRUE(os_saves_avx512_state()) << "the kernel lists AVX-512 but XCR0 lacks its state";
  if (avx512_target(hw.simd_target)) EXPECT_TRUE(os_saves_avx512_state()) << "an AVX-512 target without the OS's ZMM state";
}

// The tests over every compiled SIMD target (for_each_simd_target) visit the one the
// kernels dispatch to. A build with FLASHATTN_SIMD_TARGETS=native (cmake/simd_targets.cmake)
// compiles few targets: this test then skips, naming the ones those tests cannot visit.
TEST(CpuFeatures, ForEachSimdTargetVisitsTheDispatchedOne) {
  std::string visited;
  bool dispatched = false;
  const std::string target = CpuHardware::detect(0).simd_target;
  for_each_simd_target([&](const std::string& name) {
    visited += (visited.empty() ? "" : " ") + name;
    dispatched = dispatched || name == target;
  });
  EXPECT_TRUE(dispatched) << "dispatched target " << target << "; visited: " << visited;
#ifdef FLASHATTN_SIMD_TARGETS_LEFT_OUT
  GTEST_SKIP() << "built with FLASHATTN_SIMD_TARGETS=native: SIMD targets " << FLASHATTN_SIMD_TARGETS_LEFT_OUT
               << " are not compiled; the tests over every compiled target ran " << visited << " only";
#endif
}

// The AVX2 decode kernel (short bf16 decode calls on Intel's AVX-512 CPUs) is offered exactly
// where Highway's AVX2 target is compiled and runs — its own CPUID check (AVX2, FMA, BMI2, F16C
// read from leaf 1) agreeing with Highway's and with /proc/cpuinfo.
TEST(CpuFeatures, Avx2DecodeGeometryExactlyWhereTheAvx2TargetRuns) {
  FLASHATTN_REQUIRE_CPUINFO(info);
  bool avx2_runs = false;
  for_each_simd_target([&](const std::string& name) { avx2_runs = avx2_runs || name == "AVX2"; });
  EXPECT_EQ(cpu::avx2_kernel_geometry().has_value(), avx2_runs);
  if (avx2_runs) EXPECT_TRUE(info.has("avx2") && info.has("fma") && info.has("bmi2") && info.has("f16c"));
}

TEST(CpuFeatures, Bf16DotExactlyWhereTheCpuHasAvx512Bf16) {
  FLASHATTN_REQUIRE_CPUINFO(info);
  const bool cpu = info.has("avx512_bf16") && info.has("avx512f") && info.has("avx512bw") && info.has("avx512vl");
  EXPECT_EQ(cpu::bf16dot::available(), cpu) << "/proc/cpuinfo avx512_bf16 (with F/BW/VL): " << cpu;
  const CpuHardware hw = CpuHardware::detect(0);
  // tiled_bf16 is built for the AVX-512 targets, which such a CPU dispatches to.
  EXPECT_EQ(hw.bf16_dot, cpu && avx512_target(hw.simd_target)) << "SIMD target " << hw.simd_target;
  EXPECT_EQ(hw.bf16_dot, cpu) << "a CPU with AVX512-BF16 must run tiled_bf16 (SIMD target " << hw.simd_target << ")";
}

// AMX needs the CPU's AMX-TILE and AMX-BF16 and the OS's permission for this process to use
// the tile data (Linux 5.16+: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), per process;
// asking again once granted succeeds again).
TEST(CpuFeatures, AmxExactlyWhereTheCpuHasItAndTheOsGrantsIt) {
  FLASHATTN_REQUIRE_CPUINFO(info);
  const bool cpu = info.has("amx_tile") && info.has("amx_bf16") && info.has("avx512_bf16");
  bool granted = false;
#if defined(__x86_64__) && defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  granted = cpu && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#endif
  EXPECT_EQ(cpu::bf16dot::uses_amx(), cpu && granted)
      << "/proc/cpuinfo amx_tile, amx_bf16, avx512_bf16: " << cpu << "; tile data granted: " << granted;
  // The planner's rule for the bf16 kernels' speed (bf16_dot.hpp): AMD's VDPBF16PS, or AMX.
  EXPECT_EQ(CpuHardware::detect(0).bf16_dot_fast,
            CpuHardware::detect(0).bf16_dot && (info.vendor == "AuthenticAMD" || (cpu && granted)))
      << "vendor " << info.vendor;
  // What bench's AMX peak loop runs on (tools/cli/peaks.cpp).
  EXPECT_EQ(CpuHardware::detect(0).amx_bf16, CpuHardware::detect(0).bf16_dot && cpu && granted);
}

TEST(CpuFeatures, DecodeFp16ExactlyWhereTheCpuHasAvx512Fp16) {
  FLASHATTN_REQUIRE_CPUINFO(info);
  const bool cpu = info.has("avx512_fp16") && info.has("avx512bw");
  // A CPU with AVX512-FP16 whose build lacks the kernel (a compiler without -mavx512fp16)
  // fails here rather than skipping decode_fp16's tests.
  EXPECT_EQ(cpu::fp16dot::available(), cpu) << "/proc/cpuinfo avx512_fp16: " << cpu;
  EXPECT_EQ(CpuHardware::detect(0).decode_fp16, cpu);
}

TEST(CpuFeatures, Int8DotExactlyWhereTheCpuHasAvx512Vnni) {
  FLASHATTN_REQUIRE_CPUINFO(info);
  const bool cpu = info.has("avx512_vnni") && info.has("avx512bw") && info.has("avx512vl");
  EXPECT_EQ(cpu::int8dot::available(), cpu) << "/proc/cpuinfo avx512_vnni: " << info.has("avx512_vnni");
  EXPECT_EQ(CpuHardware::detect(0).int8_dot, cpu);
  // decode_bf16 scores int8 K codes on it: every CPU with AVX512-BF16 has it.
  if (cpu::bf16decode::available()) EXPECT_TRUE(cpu::int8dot::available());
}

TEST(CpuFeatures, DecodeBf16ExactlyWhereTheCpuHasAvx512Bf16) {
  FLASHATTN_REQUIRE_CPUINFO(info);
  const bool cpu = info.has("avx512_bf16");
  EXPECT_EQ(cpu::bf16decode::available(), cpu) << "/proc/cpuinfo avx512_bf16: " << cpu;
  EXPECT_EQ(CpuHardware::detect(0).decode_bf16, cpu);
}

}  // namespace
}  // namespace flashattn::test
