// The hardware table of the cost model: GPUs from their vendors' documents, and "this
// CPU" from what the front end measured. Rates are per SM (per core), per clock, dense
// (no 2:4 sparsity). Where a vendor states only a whole-chip rate, the per-SM rate is the
// one that, times the SM count and the boost clock, gives that rate; where the vendor
// states no boost clock (Blackwell), the clock is derived from the whole-chip rate and
// the per-SM rate instead. Each derivation is written out beside its number.
#include <algorithm>
#include <string>

#include "flashattn/cost_model.hpp"
#include "flashattn/error.hpp"

namespace flashattn::cost {
namespace {

// Shared by every GPU below (NVIDIA CUDA C++ Programming Guide, "Arithmetic
// Instructions" throughput table, compute capabilities 8.0 and 9.0; FlashAttention-4
// paper, Zadouri et al. 2026, §2, for Blackwell: "128 bytes/clock/SM", "16 ops/clock/SM"):
//   MUFU (ex2, rcp, lg2, sin, cos): 16 results per clock per SM
//   shared memory: 32 banks × 4 bytes = 128 bytes per clock per SM
// FlashAttention-3 (Shah et al. 2024, §3.1) states the H100's special-function rate as
// 3.9 TFLOPS: 132 SMs × 1.83 GHz × 16 = 3.87·10¹² — the same 16 per clock.
constexpr double kMufuPerClock = 16.0;
constexpr double kSmemBytesPerClock = 128.0;
constexpr double kKiB = 1024.0, kGB = 1e9;

// A software exp2 on the FP32 pipes (docs/algorithm.md §5, FlashAttention-4): round to get n, subtract
// for the fraction f, three FMAs of a cubic by Horner's rule, one integer add of n into
// the exponent bits.
constexpr double kGpuPolyExp2Ops = 6.0;

// The per-SM figures of one GPU design; a product adds its name, memory and bandwidth.
struct SmDesign {
  int sms;
  double clock_ghz;
  double mma_16bit, mma_tf32, mma_fp8;  // dense FLOP/clk/SM
  double fp32_lanes;
  double exp_per_clock;
  double smem_kib;
};

Architecture gpu(const char* name, const char* description, const SmDesign& sm, double l2_mib, double memory_gb,
                 double hbm_gbps, const char* source) {
  Architecture a;
  a.name = name;
  a.description = description;
  a.units = sm.sms;
  a.clock_ghz = sm.clock_ghz;
  a.mma_16bit = sm.mma_16bit;
  a.mma_tf32 = sm.mma_tf32;
  a.mma_fp8 = sm.mma_fp8;
  a.fp32_lanes = sm.fp32_lanes;
  a.exp_per_clock = sm.exp_per_clock;
  a.poly_exp_ops = kGpuPolyExp2Ops;
  a.smem_bytes_per_clock = kSmemBytesPerClock;
  a.smem_bytes = sm.smem_kib * kKiB;
  a.l2_bytes = l2_mib * kKiB * kKiB;
  a.hbm_bytes_per_second = hbm_gbps * kGB;
  a.memory_bytes = memory_gb * kGB;
  a.source = source;
  return a;
}

// A100 (NVIDIA A100 Tensor Core GPU Architecture whitepaper, 2020; A100 datasheet):
// 108 SMs, boost 1410 MHz; dense FP16/BF16 312 TFLOPS, TF32 156 TFLOPS, no FP8.
//   312e12 / (108 · 1.41e9) = 2049 → 2048 FLOP/clk/SM (1024 FMA); TF32: 1024.
// 64 FP32 cores per SM: 64 FP32 ops/clk; shared memory up to 164 KB per SM.
// HBM2: 40 GB at 1555 GB/s; HBM2e: 80 GB (SXM) at 2039 GB/s.
constexpr SmDesign kAmpere{108, 1.41, 2048, 1024, 0, 64, kMufuPerClock, 164};

// H100 SXM5 (NVIDIA H100 Tensor Core GPU Architecture whitepaper, 2022; H100 datasheet):
// 132 SMs, boost 1830 MHz; dense FP16/BF16 989.4 TFLOPS, TF32 494.7, FP8 1978.9.
//   989.4e12 / (132 · 1.83e9) = 4096 FLOP/clk/SM; TF32 2048; FP8 8192.
// 128 FP32 cores per SM; shared memory up to 228 KB per SM; HBM3 80 GB at 3.35 TB/s.
// H200 (H200 datasheet, 2024): the same GH100 SMs and clocks with HBM3e, 141 GB at 4.8 TB/s.
constexpr SmDesign kHopper{132, 1.83, 4096, 2048, 8192, 128, kMufuPerClock, 228};

// B200 (NVIDIA HGX B200 / DGX B200 datasheets; FlashAttention-4 paper §2): 148 SMs; dense
// FP16/BF16 2.25 PFLOPS, TF32 1.1 PFLOPS (2.2 with sparsity), FP8 4.5 PFLOPS; per SM
// 8192 FP16/BF16 FLOP/clk (FlashAttention-4: "8192 ops/clock/SM"), hence TF32 4096 and
// FP8 16384. Clock derived: 2.25e15 / (148 · 8192) = 1.856 GHz.
// 128 FP32 cores per SM; 228 KB shared memory per SM (plus 256 KB tensor memory);
// HBM3e 180 GB at 8 TB/s.
constexpr double kBlackwellClockGhz = 2.25e15 / (148.0 * 8192.0) / 1e9;
constexpr SmDesign kBlackwell{148, kBlackwellClockGhz, 8192, 4096, 16384, 128, kMufuPerClock, 228};
// B300 (NVIDIA technical blogs "Inside NVIDIA Blackwell Ultra" and "Making Softmax More
// Efficient with NVIDIA Blackwell Ultra", 2025): 160 SMs in the full chip (products may
// enable fewer), the same per-SM tensor-core rates for FP16/BF16/FP8 as B200 (its gains
// are NVFP4), and the SFU's MUFU.EX2 throughput doubled: 32 per clock per SM. HBM3e
// 288 GB at 8 TB/s. Its clock is not stated: B200's derived clock is assumed.
constexpr SmDesign kBlackwellUltra{160, kBlackwellClockGhz, 8192, 4096, 16384, 128, 2 * kMufuPerClock, 228};

// L2 caches, shared by all SMs: A100 40 MB (whitepaper), H100 and H200 50 MB (H100
// whitepaper), B200 126 MB (two dies' partitions together, as measured by Chips and Cheese,
// "Nvidia's B200: Keeping the CUDA Juggernaut Rolling", 2025); B300's is assumed equal.
constexpr double kAmpereL2Mib = 40, kHopperL2Mib = 50, kBlackwellL2Mib = 126;

std::vector<Architecture> make_table() {
  return {
      gpu("a100-40gb", "NVIDIA A100 SXM 40 GB (Ampere, FlashAttention-1/2)", kAmpere, kAmpereL2Mib, 40, 1555,
          "A100 whitepaper (2020) and datasheet; CUDA Programming Guide throughput table"),
      gpu("a100-80gb", "NVIDIA A100 SXM 80 GB (Ampere, FlashAttention-1/2)", kAmpere, kAmpereL2Mib, 80, 2039,
          "A100 whitepaper (2020) and datasheet; CUDA Programming Guide throughput table"),
      gpu("h100", "NVIDIA H100 SXM5 80 GB (Hopper, FlashAttention-3)", kHopper, kHopperL2Mib, 80, 3350,
          "H100 whitepaper (2022) and datasheet; FlashAttention-3 paper §3.1"),
      gpu("h200", "NVIDIA H200 SXM 141 GB (Hopper, HBM3e)", kHopper, kHopperL2Mib, 141, 4800, "H200 datasheet (2024); SMs as H100"),
      gpu("b200", "NVIDIA B200 180 GB (Blackwell, FlashAttention-4)", kBlackwell, kBlackwellL2Mib, 180, 8000,
          "HGX/DGX B200 datasheets; FlashAttention-4 paper §2"),
      gpu("b300", "NVIDIA B300 288 GB (Blackwell Ultra, doubled exp throughput)", kBlackwellUltra, kBlackwellL2Mib, 288, 8000,
          "NVIDIA Blackwell Ultra technical blogs (2025); clock assumed as B200"),
  };
}

// "This CPU" (docs/algorithm.md §1: DRAM is the slow memory, L1/L2 and registers the fast one).
// Vector FP32 pipes that can issue an FMA each clock: two on Zen 2-4 and on Intel cores
// since Haswell (AMD Software Optimization Guide for Zen 3; Intel Optimization Manual).
constexpr double kFmaPipes = 2.0;
// Vector loads per clock from L1: two on the same cores (same guides).
constexpr double kL1LoadsPerClock = 2.0;
// Vector instructions per vector of exponentials, read off the AVX2 code of
// src/cpu/kernels/simd_math-inl.h (objdump of Exp2Array in src/cpu/exp2.cpp, Highway 1.0.3).
// Both exp2s share 10: clamp (max, min), the reduction (Exp2: add and subtract 1.5·2^23,
// subtract; Exp2Poly3: floor, subtract, add 1.5·2^23), and 2^n from the rounded sum's bits
// — add the bias, shift into the exponent, multiply — and the NaN test and select. Exp2
// adds its 5 Horner FMAs, Exp2Poly3 its 3. Counted as issued on the FMA pipes: the integer
// and compare instructions could use other vector ports, so this is the upper end. (On
// AVX-512 Exp2 takes 11 in all: VSCALEFPS and a compare replace the bit arithmetic.)
constexpr double kExp2SharedOps = 10.0;
constexpr double kExp2VectorOps = kExp2SharedOps + 5.0;       // 15: the exact exp2
constexpr double kExp2Poly3VectorOps = kExp2SharedOps + 3.0;  // 13: poly3

}  // namespace

const std::vector<Architecture>& gpu_architectures() {
  static const std::vector<Architecture> table = make_table();
  return table;
}

const Architecture& gpu_architecture(std::string_view name) {
  const std::vector<Architecture>& table = gpu_architectures();
  const auto it = std::find_if(table.begin(), table.end(), [&](const Architecture& a) { return a.name == name; });
  if (it != table.end()) return *it;
  std::string known;
  for (const Architecture& a : table) known += (known.empty() ? "" : ", ") + a.name;
  throw Error("arch: unknown architecture '" + std::string(name) + "' (known: " + known + ", cpu)");
}

Architecture cpu_architecture(const CpuHardware& hw, const CpuMeasurements& m) {
  if (!(m.clock_ghz > 0.0) || !(m.sgemm_gflops > 0.0) || !(m.copy_gbps > 0.0))
    throw Error("cpu measurements: clock_ghz, sgemm_gflops and copy_gbps must be > 0, got " +
                std::to_string(m.clock_ghz) + ", " + std::to_string(m.sgemm_gflops) + ", " +
                std::to_string(m.copy_gbps));
  Architecture a;
  a.name = "cpu";
  a.description = "this CPU: " + std::to_string(hw.threads) + " cores, " + hw.simd_target + " (" +
                  std::to_string(hw.float_lanes) + " float lanes)";
  a.units = hw.threads;
  a.clock_ghz = m.clock_ghz;
  const double lanes = static_cast<double>(hw.float_lanes);
  // Matrix throughput: measured sgemm per core per clock. The kernels widen bf16/f16 to
  // float32 and multiply in float32, so every dtype gets the same rate.
  a.mma_tf32 = m.sgemm_gflops / (hw.threads * m.clock_ghz);
  a.mma_16bit = a.mma_tf32;
  a.mma_fp8 = 0;
  a.fp32_lanes = lanes * kFmaPipes;
  a.exp_per_clock = lanes * kFmaPipes / kExp2VectorOps;
  // A vector instruction is one lane operation per exponential of its vector.
  a.poly_exp_ops = kExp2Poly3VectorOps;
  a.smem_bytes_per_clock = kL1LoadsPerClock * lanes * 4.0;
  a.smem_bytes = static_cast<double>(hw.l2_bytes);
  // Each core's work item streams its head's packed K/V from its own L2: the cores' L2s
  // together are the cache of the rule in cached_traffic.
  a.l2_bytes = static_cast<double>(hw.l2_bytes) * hw.threads;
  a.hbm_bytes_per_second = m.copy_gbps * kGB;
  a.memory_bytes = 0;
  a.cpu = true;
  a.source = "measured here (sgemm, copy bandwidth, clock); exp and L1 rates derived from the SIMD width";
  return a;
}

}  // namespace flashattn::cost
