// The tiled_bf16 backward kernel (all five products on VDPBF16PS, P and dS rounded to bf16)
// against the float64 reference with upstream's rule for gradients, on every SIMD target
// where it can run; that it runs where it can, that the float32 kernel stays reachable and
// correct on bf16 inputs, and that asking for it where it cannot run is a clear Error.
#include <gtest/gtest.h>

#include <cmath>

#include "src/cpu/kernels/mask_blocks.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

// A bf16 case of these tests: sizes, causal, thread count and deterministic mode.
Case bf16_case(const Shape& shape, bool causal, std::uint64_t seed, int threads = 2, bool deterministic = false) {
  AttentionOptions o;
  o.causal = causal;
  o.num_threads = threads;
  o.deterministic = deterministic;
  return Case(shape, DType::bf16, o, seed);
}

// Runs the backward with `kernel` on the case's inputs (the forward's out and lse from the
// automatic kernel) and checks dq, dk, dv by check_backward: within 3× the naive
// same-precision backward's error + 1e-4 of the float64 reference, upstream's rule.
void check(const Case& c, BackwardKernel kernel) {
  check_backward(c.with([&](AttentionOptions& o) { o.backward_kernel = kernel; }));
}

TEST(BackwardBf16, PlannedWhereItRunsAndIsTheFasterKernel) {
  const AttentionProblem bf16 = AttentionProblem::from_sizes(1, 100, 100, 2, 1, 64, 64, DType::bf16, {});
  const AttentionProblem f32 = AttentionProblem::from_sizes(1, 100, 100, 2, 1, 64, 64, DType::f32, {});
  const CpuHardware hw = CpuHardware::detect(2);
  EXPECT_EQ(plan_backward(f32, hw, false).kernel, BackwardKernel::tiled);
  const bool chosen = hw.bf16_dot && hw.bf16_dot_fast;  // planned by default only where it is the faster one
  EXPECT_EQ(plan_backward(bf16, hw, false).kernel, chosen ? BackwardKernel::tiled_bf16 : BackwardKernel::tiled);
  EXPECT_NE(plan_backward(bf16, hw, false).describe().find(std::string("kernel=") + (chosen ? "tiled_bf16" : "tiled")),
            std::string::npos);
  CpuHardware fast = hw;  // simulated: a CPU whose bf16 products outpace FMA
  fast.bf16_dot = fast.bf16_dot_fast = true;
  EXPECT_EQ(plan_backward(bf16, fast, false).kernel, BackwardKernel::tiled_bf16);
  EXPECT_EQ(plan_backward(f32, fast, false).kernel, BackwardKernel::tiled);
  if (cpu_has_avx512bf16())  // the dispatched target here is AVX-512 on such a CPU
    EXPECT_TRUE(hw.bf16_dot) << "this CPU has AVX512-BF16 but the kernel is not available on " << hw.simd_target;
}

TEST(BackwardBf16, MatchesTheReferenceOnEveryTargetThatRunsIt) {
  int ran = 0;
  for_each_simd_target([&](const std::string&) {
    if (!CpuHardware::detect(2).bf16_dot) return;  // not this target (or not this CPU)
    ++ran;
    std::uint64_t seed = 700;
    // Odd and even head dims (pairs padded with a zero), Dv ≠ D, ragged tiles, GQA.
    for (const auto& [d, dv] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {7, 40}, {37, 37}, {64, 64},
                                {128, 96}, {256, 256}})
      check(bf16_case({1, 77, 131, 4, 2, d, dv}, d % 2 == 1, seed++), BackwardKernel::tiled_bf16);
    check(bf16_case({2, 150, 150, 2, 2, 64, 64}, true, seed++, 1, true), BackwardKernel::tiled_bf16);
    check(bf16_case({1, 200, 70, 3, 1, 48, 48}, false, seed++, 3, false), BackwardKernel::tiled_bf16);
    check(bf16_case({1, 9, 300, 2, 1, 32, 32}, true, seed++, 2, true), BackwardKernel::tiled_bf16);
    const Case variants =
        bf16_case({1, 113, 203, 4, 2, 64, 64}, true, seed++).with([](AttentionOptions& o) { o.softcap = 3.0f; });
    check(variants.with_alibi(), BackwardKernel::tiled_bf16);
    const Case windowed = bf16_case({1, 130, 130, 2, 1, 64, 64}, false, seed).with([&](AttentionOptions& o) {
      o.window_size = {33, 17};
      o.dropout_p = 0.2f;
      o.seed = seed;
    });
    check(windowed, BackwardKernel::tiled_bf16);
    // A boolean attn_mask of documents (causal within each, bottom-right): its partial blocks
    // are copied out by the mask summary at the backward's tile sizes, and the kernel reads
    // them there (RowMods::apply_mask_blocks), not the caller's rows.
    constexpr std::int64_t sq = 140, sk = 190, len = 45;
    Tensor docs(DType::u8, {1, 1, sq, sk});
    for (std::int64_t i = 0; i < sq; ++i)
      for (std::int64_t j = 0; j < sk; ++j) {
        const std::int64_t qi = i + sk - sq;
        docs.set(i * sk + j, qi / len == j / len && j <= qi ? 1.0f : 0.0f);
      }
    const Case masked = bf16_case({1, sq, sk, 4, 2, 64, 64}, false, seed + 1).with([&](AttentionOptions& o) {
      o.attn_mask = docs.view();
    });
    const CpuBackwardPlan plan = plan_backward(masked.problem(), CpuHardware::detect(2), false);
    EXPECT_NE(cpu::DenseMaskSummary(docs.view(), sq, sk, plan.block_q, plan.block_k, 2).blocks().slots, nullptr);
    check(masked, BackwardKernel::tiled_bf16);
  });
  if (cpu_has_avx512bf16())
    EXPECT_GT(ran, 0) << "this CPU has AVX512-BF16: the kernel must have run on its AVX-512 target";
  else if (ran == 0)
    GTEST_SKIP() << "no AVX512-BF16 on this CPU: tiled_bf16 cannot run here";
}

TEST(BackwardBf16, Float32KernelStaysReachableOnBf16Inputs) {
  check(bf16_case({1, 77, 131, 4, 2, 64, 48}, true, 800), BackwardKernel::tiled);
  check(bf16_case({1, 60, 90, 2, 1, 37, 37}, false, 801, 3, true), BackwardKernel::tiled);
}

TEST(BackwardBf16, UnavailableRequestIsAnError) {
  const AttentionProblem f32 = AttentionProblem::from_sizes(1, 100, 100, 2, 1, 64, 64, DType::f32, {});
  const AttentionProblem bf16 = AttentionProblem::from_sizes(1, 100, 100, 2, 1, 64, 64, DType::bf16, {});
  CpuHardware hw = CpuHardware::detect(2);
  expect_error([&] { plan_backward(f32, hw, false, BackwardKernel::tiled_bf16); }, {"tiled_bf16", "bf16", "f32"});
  hw.bf16_dot = false;  // a CPU or target without it
  expect_error([&] { plan_backward(bf16, hw, false, BackwardKernel::tiled_bf16); },
               {"tiled_bf16", "AVX512-BF16", "not available"});
  EXPECT_EQ(plan_backward(bf16, hw, false).kernel, BackwardKernel::tiled);
  EXPECT_EQ(parse_backward_kernel("tiled_bf16"), BackwardKernel::tiled_bf16);
  expect_error([] { parse_backward_kernel("fast"); }, {"fast", "auto, tiled or tiled_bf16"});
}

}  // namespace
}  // namespace flashattn::test
