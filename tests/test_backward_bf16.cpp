// The tiled_bf16 backward kernel (all five products on VDPBF16PS, P and dS rounded to bf16)
// against the float64 reference with upstream's rule for gradients, on every SIMD target
// where it can run; that it runs where it can, that the float32 kernel stays reachable and
// correct on bf16 inputs, and that asking for it where it cannot run is a clear Error.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

struct Case {
  std::int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v;
  bool causal = false;
  int threads = 2;
  bool deterministic = false;
  float softcap = 0.0f;
  bool alibi = false;
  float dropout = 0.0f;
  int window_left = -1;
};

// Runs the backward with `kernel` on random bf16 inputs (the forward's out and lse from the
// automatic kernel) and checks dq, dk, dv within 3× the naive same-precision backward's
// error + 1e-4 of the float64 reference: upstream's rule for gradients.
void check(const Case& c, BackwardKernel kernel, std::uint64_t seed) {
  std::ostringstream trace;
  trace << "kernel=" << to_string(kernel) << " B=" << c.batch << " Sq=" << c.seqlen_q << " Sk=" << c.seqlen_k
        << " Hq=" << c.heads_q << " Hkv=" << c.heads_kv << " D=" << c.head_dim << " Dv=" << c.head_dim_v
        << " causal=" << c.causal << " threads=" << c.threads << " deterministic=" << c.deterministic
        << " softcap=" << c.softcap << " alibi=" << c.alibi << " dropout=" << c.dropout
        << " window_left=" << c.window_left << " seed=" << seed;
  SCOPED_TRACE(trace.str());
  AttentionOptions o;
  o.causal = c.causal;
  o.num_threads = c.threads;
  o.deterministic = c.deterministic;
  o.softcap = c.softcap;
  o.backward_kernel = kernel;
  if (c.window_left >= 0) o.window_size = {c.window_left, c.causal ? 0 : 17};
  Tensor slopes(DType::f32, {c.heads_q});
  if (c.alibi) {
    for (std::int64_t h = 0; h < c.heads_q; ++h) slopes.set(h, std::exp2(-1.0f - 0.5f * static_cast<float>(h)));
    o.alibi_slopes = slopes.view();
  }
  if (c.dropout > 0.0f) {
    o.dropout_p = c.dropout;
    o.seed = seed;
  }
  const Tensor q = random_tensor(DType::bf16, {c.batch, c.seqlen_q, c.heads_q, c.head_dim}, seed);
  const Tensor k = random_tensor(DType::bf16, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim}, seed + 1);
  const Tensor v = random_tensor(DType::bf16, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim_v}, seed + 2);
  const Tensor dout = random_tensor(DType::bf16, {c.batch, c.seqlen_q, c.heads_q, c.head_dim_v}, seed + 3);
  const ForwardResult fwd = forward(q.view(), k.view(), v.view(), o);
  const BackwardResult got = backward(dout.view(), q.view(), k.view(), v.view(), fwd.out.view(), fwd.lse.view(), o);
  const reference::Gradients want = reference::attention_backward(dout.view(), q.view(), k.view(), v.view(), o);
  const AttentionProblem p = AttentionProblem::from_inputs(q.view(), k.view(), v.view(), o);
  const NaiveGradients naive = naive_backward_same_precision(p, o, dout, q, k, v);
  EXPECT_LE(max_abs_error(got.dq, want.dq), 3.0 * max_abs_error(naive.dq, want.dq) + 1e-4) << "dq";
  EXPECT_LE(max_abs_error(got.dk, want.dk), 3.0 * max_abs_error(naive.dk, want.dk) + 1e-4) << "dk";
  EXPECT_LE(max_abs_error(got.dv, want.dv), 3.0 * max_abs_error(naive.dv, want.dv) + 1e-4) << "dv";
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
  for_each_simd_target([&](const std::string& target) {
    if (!CpuHardware::detect(2).bf16_dot) return;  // not this target (or not this CPU)
    ++ran;
    std::uint64_t seed = 700;
    // Odd and even head dims (pairs padded with a zero), Dv ≠ D, ragged tiles, GQA.
    for (const auto& [d, dv] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {7, 40}, {37, 37}, {64, 64},
                                {128, 96}, {256, 256}})
      check({1, 77, 131, 4, 2, d, dv, d % 2 == 1}, BackwardKernel::tiled_bf16, seed++);
    check({2, 150, 150, 2, 2, 64, 64, true, 1, true}, BackwardKernel::tiled_bf16, seed++);
    check({1, 200, 70, 3, 1, 48, 48, false, 3, false}, BackwardKernel::tiled_bf16, seed++);
    check({1, 9, 300, 2, 1, 32, 32, true, 2, true}, BackwardKernel::tiled_bf16, seed++);
    Case variants{1, 113, 203, 4, 2, 64, 64, true};
    variants.softcap = 3.0f;
    variants.alibi = true;
    check(variants, BackwardKernel::tiled_bf16, seed++);
    Case windowed{1, 130, 130, 2, 1, 64, 64};
    windowed.window_left = 33;
    windowed.dropout = 0.2f;
    check(windowed, BackwardKernel::tiled_bf16, seed++);
    (void)target;
  });
  if (cpu_has_avx512bf16())
    EXPECT_GT(ran, 0) << "this CPU has AVX512-BF16: the kernel must have run on its AVX-512 target";
  else if (ran == 0)
    GTEST_SKIP() << "no AVX512-BF16 on this CPU: tiled_bf16 cannot run here";
}

TEST(BackwardBf16, Float32KernelStaysReachableOnBf16Inputs) {
  check({1, 77, 131, 4, 2, 64, 48, true}, BackwardKernel::tiled, 800);
  check({1, 60, 90, 2, 1, 37, 37, false, 3, true}, BackwardKernel::tiled, 801);
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
