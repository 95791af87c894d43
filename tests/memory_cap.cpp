// Peak memory linear in sequence length: forward and backward at S = 65536, D = 64 under an
// address-space cap of 1 GiB, which one float32 S×S score matrix (16 GiB) would exceed
// sixteen times over. The cap is set before anything else runs, so every allocation —
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
#include "test_util.hpp"

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

  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const double peak_mib = static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB
  RecordProperty("peak_rss_mib", static_cast<int>(peak_mib));
  EXPECT_LT(peak_mib, static_cast<double>(kCapBytes) / (1 << 20));
}

}  // namespace
}  // namespace flashattn::test

int main(int argc, char** argv) {
  const rlimit cap{flashattn::test::kCapBytes, flashattn::test::kCapBytes};
  if (setrlimit(RLIMIT_AS, &cap) != 0) return 2;
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
