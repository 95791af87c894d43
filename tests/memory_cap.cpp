// Peak memory linear in sequence length: forward and backward at S = 65536, D = 64 under an
// address-space cap of 1 GiB, which one float32 S×S score matrix (16 GiB) would exceed
// sixteen times over; out, lse and dQ are checked on a few rows against float64, dK and dV
// by identities, and the peak resident memory is asserted. The cap is set before anything
// else runs, so every allocation —
// the library's workspaces, OpenMP's thread stacks, the test's own tensors — counts.
// Its own executable (not part of flashattn_tests) because the cap is process-wide and
// sanitizers reserve terabytes of address space.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cmath>
#include <cstdint>
#include <new>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

constexpr std::int64_t kSeqlen = 65536, kDim = 64;
constexpr rlim_t kCapBytes = rlim_t{1} << 30;

TEST(MemoryCap, SixtyFourThousandTokensForwardAndBackwardUnderOneGibibyte) {
  static_assert(kSeqlen * kSeqlen * 4 >= 16 * static_cast<std::int64_t>(kCapBytes),
                "the cap must be far below one materialized score matrix");
  // The cap bites: the score matrix of standard attention cannot even be allocated.
  EXPECT_THROW(Tensor(DType::f32, {kSeqlen, kSeqlen}), std::bad_alloc);
  const Tensor q = random_tensor(DType::f32, {1, kSeqlen, 1, kDim}, 1);
  const Tensor k = random_tensor(DType::f32, {1, kSeqlen, 1, kDim}, 2);
  const Tensor v = random_tensor(DType::f32, {1, kSeqlen, 1, kDim}, 3);
  const Tensor dout = random_tensor(DType::f32, {1, kSeqlen, 1, kDim}, 4);
  AttentionOptions options;
  options.causal = true;  // halves the time; the memory argument is the same
  options.num_threads = 2;  // the per-thread workspaces below, on any machine

  const ForwardResult fwd = forward(q.view(), k.view(), v.view(), options);
  // A few rows, first, middle and last, against the float64 reference.
  const AttentionProblem problem = AttentionProblem::from_inputs(q.view(), k.view(), v.view(), options);
  for (const std::int64_t row : {std::int64_t{0}, kSeqlen / 2 + 17, kSeqlen - 1}) {
    std::vector<double> expected(kDim);
    double lse = 0.0;
    reference::attention_row(problem, options, q.view(), k.view(), v.view(), 0, 0, row, expected.data(), &lse);
    for (std::int64_t c = 0; c < kDim; ++c)
      ASSERT_NEAR(fwd.out.get(row * kDim + c), expected[c], 1e-5) << "row " << row << " column " << c;
    ASSERT_NEAR(fwd.lse.get(row), lse, 1e-4) << "row " << row;
  }

  const BackwardResult grads =
      backward(dout.view(), q.view(), k.view(), v.view(), fwd.out.view(), fwd.lse.view(), options);
  // Two identities of softmax attention that need no S×S reference: every row of P sums
  // to one, so Σ_j dV_j = Σ_i dO_i; every row of dS sums to zero, so Σ_j dK_j = 0.
  for (std::int64_t c = 0; c < kDim; ++c) {
    double sum_dv = 0.0, sum_dout = 0.0, sum_dk = 0.0, sum_abs_dk = 0.0;
    for (std::int64_t j = 0; j < kSeqlen; ++j) {
      sum_dv += grads.dv.get(j * kDim + c);
      sum_dout += dout.get(j * kDim + c);
      sum_dk += grads.dk.get(j * kDim + c);
      sum_abs_dk += std::fabs(grads.dk.get(j * kDim + c));
    }
    ASSERT_NEAR(sum_dv, sum_dout, 1e-6 * kSeqlen) << "column " << c;
    ASSERT_LT(std::fabs(sum_dk), 1e-4 * sum_abs_dk) << "column " << c;
  }

  // dQ of a few rows against float64, from the row's reference output and lse: with
  // P_ij = e^(s_ij − lse_i) and D_i = dO_i·O_i, dq_i = scale·Σ_j P_ij·(dO_i·v_j − D_i)·k_j —
  // one pass over the row's keys, no S×S matrix.
  for (const std::int64_t row : {std::int64_t{0}, std::int64_t{1000}, kSeqlen / 2 + 17, kSeqlen - 1}) {
    std::vector<double> o(kDim), dq(kDim, 0.0);
    double lse = 0.0, delta = 0.0;
    reference::attention_row(problem, options, q.view(), k.view(), v.view(), 0, 0, row, o.data(), &lse);
    for (std::int64_t c = 0; c < kDim; ++c) delta += dout.get(row * kDim + c) * o[c];
    for (std::int64_t j = 0; j <= row; ++j) {  // causal, Sq = Sk: keys up to the row's own
      double s = 0.0, dp = 0.0;
      for (std::int64_t c = 0; c < kDim; ++c) {
        s += static_cast<double>(q.get(row * kDim + c)) * k.get(j * kDim + c);
        dp += static_cast<double>(dout.get(row * kDim + c)) * v.get(j * kDim + c);
      }
      const double ds = std::exp(s * problem.softmax_scale - lse) * (dp - delta);
      for (std::int64_t c = 0; c < kDim; ++c) dq[c] += ds * k.get(j * kDim + c);
    }
    for (std::int64_t c = 0; c < kDim; ++c)
      ASSERT_NEAR(grads.dq.get(row * kDim + c), problem.softmax_scale * dq[c], 1e-4) << "dq row " << row << " column " << c;
  }

  // Peak resident memory, linear in S: the test's 4 inputs, out, and the 3 gradients (16 MiB
  // each in float32: 128 MiB), the backward's float32 dQ accumulator and per-row statistics
  // (S·(1 + D) floats: 16 MiB), the packed K/V the threads keep of the head (S·(2D + D)
  // floats, 48 MiB, touched tile by tile as the threads take K/V tiles; tile buffers well
  // under 1 MiB), and the process itself (libraries, two threads' stacks) — 203 MiB measured
  // (2026-12); one S×S score matrix would be 16 GiB.
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const double peak_mib = static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB
  RecordProperty("peak_rss_mib", static_cast<int>(peak_mib));
  EXPECT_LT(peak_mib, 256.0);
}

}  // namespace
}  // namespace flashattn::test

int main(int argc, char** argv) {
  const rlimit cap{flashattn::test::kCapBytes, flashattn::test::kCapBytes};
  if (setrlimit(RLIMIT_AS, &cap) != 0) return 2;
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
