// Generation-4 numerics of the forward (docs/algorithm.md §5): the exp2 implementations and
// conditional rescaling, against the float64 reference, and the rescale statistics.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

struct Qkv {
  Tensor q, k, v;
};

// Random N(0, 1) inputs.
Qkv random_qkv(DType dtype, std::int64_t sq, std::int64_t sk, std::int64_t heads, std::int64_t d, std::uint64_t seed) {
  return {random_tensor(dtype, {1, sq, heads, d}, seed), random_tensor(dtype, {1, sk, heads, d}, seed + 1),
          random_tensor(dtype, {1, sk, heads, d}, seed + 2)};
}

// Adversarial rows: every query's scores grow steadily with the key index (key j scores
// j·step in log2 units, up to the rounding of k to dtype, which keeps them non-decreasing),
// so the running maximum moves in every tile. q rows are the first unit vector, so only
// k's first column scores; hq q heads share hkv kv heads.
Qkv rising_scores(DType dtype, std::int64_t sq, std::int64_t sk, std::int64_t hq, std::int64_t hkv, std::int64_t d,
                  float step) {
  Qkv in{random_tensor(dtype, {1, sq, hq, d}, 77), random_tensor(dtype, {1, sk, hkv, d}, 78),
         random_tensor(dtype, {1, sk, hkv, d}, 79)};
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (std::int64_t e = 0; e < in.q.numel(); ++e) in.q.set(e, e % d == 0 ? 1.0f : 0.0f);
  for (std::int64_t j = 0; j < sk; ++j)
    for (std::int64_t h = 0; h < hkv; ++h)
      in.k.set((j * hkv + h) * d, static_cast<float>(j) * step / (scale * OnlineSoftmaxState::kLog2e));
  return in;
}

Qkv increasing_scores(std::int64_t sq, std::int64_t sk, std::int64_t d, float step) {
  return rising_scores(DType::f32, sq, sk, 1, 1, d, step);
}

struct CountedRun {
  ForwardResult result;
  std::vector<std::int32_t> counts;
};

CountedRun run_counted(const Qkv& in, AttentionOptions options) {
  const std::int64_t sq = in.q.shape()[1], heads = in.q.shape()[2];
  CountedRun r{forward(in.q.view(), in.k.view(), in.v.view(), options), std::vector<std::int32_t>(static_cast<std::size_t>(heads * sq), -1)};
  options.rescale_counts = MutableTensorView(r.counts.data(), DType::i32, {1, heads, sq});
  forward(in.q.view(), in.k.view(), in.v.view(), r.result.out.view(), r.result.lse.view(), options);
  return r;
}

std::vector<double> values(const Tensor& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::int64_t e = 0; e < t.numel(); ++e) v[static_cast<std::size_t>(e)] = t.get(e);
  return v;
}

std::int64_t total(const std::vector<std::int32_t>& counts) { return std::accumulate(counts.begin(), counts.end(), std::int64_t{0}); }

std::int64_t key_tiles(const Qkv& in, const AttentionOptions& options) {
  const AttentionProblem p = AttentionProblem::from_inputs(in.q.view(), in.k.view(), in.v.view(), options);
  const std::int64_t bc = plan_forward(p, CpuHardware::detect(options.num_threads), options.num_splits).block_k;
  return (p.seqlen_k + bc - 1) / bc;
}

void expect_matches_reference(const Qkv& in, const AttentionOptions& options, const Tensor& out, double tolerance) {
  const reference::Result want = reference::attention(in.q.view(), in.k.view(), in.v.view(), options);
  EXPECT_LE(max_abs_error(out, want.out), tolerance);
}

TEST(ConditionalRescaling, EqualsTheClassicRuleOnRandomRows) {
  const Qkv in = random_qkv(DType::f32, 100, 1000, 2, 64, 1);
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    AttentionOptions classic;
    classic.causal = causal;
    classic.num_threads = 2;
    classic.rescale_threshold = 0.0f;
    AttentionOptions conditional = classic;
    conditional.rescale_threshold = 8.0f;
    const CountedRun a = run_counted(in, classic), b = run_counted(in, conditional);
    expect_matches_reference(in, classic, a.result.out, 1e-5);
    expect_matches_reference(in, conditional, b.result.out, 1e-5);
    EXPECT_LE(max_abs_error(a.result.out, values(b.result.out)), 2e-6);
    for (std::int64_t e = 0; e < a.result.lse.numel(); ++e)
      ASSERT_NEAR(a.result.lse.get(e), b.result.lse.get(e), 1e-5);
    // Random N(0, 1/√d·…) scores never grow by 8 (a factor 256) after the first tile.
    EXPECT_GT(total(a.counts), 0);
    EXPECT_EQ(total(b.counts), 0);
    for (std::int32_t c : a.counts) ASSERT_LT(c, key_tiles(in, classic));
  }
}

TEST(ConditionalRescaling, EqualsTheClassicRuleOnSteadilyIncreasingScores) {
  constexpr float kStep = 0.1f;  // log2 units per key: 100 over the row
  const Qkv in = increasing_scores(37, 1000, 32, kStep);
  AttentionOptions classic;
  classic.num_threads = 2;
  classic.num_splits = 1;
  classic.rescale_threshold = 0.0f;
  AttentionOptions conditional = classic;
  conditional.rescale_threshold = 8.0f;
  const CountedRun a = run_counted(in, classic), b = run_counted(in, conditional);
  expect_matches_reference(in, classic, a.result.out, 1e-5);
  expect_matches_reference(in, conditional, b.result.out, 1e-5);
  const std::int64_t tiles = key_tiles(in, classic);
  const AttentionProblem p = AttentionProblem::from_inputs(in.q.view(), in.k.view(), in.v.view(), classic);
  const float tile_growth = kStep * static_cast<float>((p.seqlen_k + tiles - 1) / tiles);
  for (std::size_t r = 0; r < a.counts.size(); ++r) {
    ASSERT_EQ(a.counts[r], tiles - 1) << "row " << r;  // every tile after the first
    // Each conditional rescale covers more than 8 of the 99.9 log2 units of growth, and at
    // most 8 plus one tile's growth.
    ASSERT_LE(b.counts[r], static_cast<std::int32_t>(99.9f / 8.0f)) << "row " << r;
    ASSERT_GE(b.counts[r], static_cast<std::int32_t>(99.9f / (8.0f + tile_growth)) - 1) << "row " << r;
  }
}

TEST(ConditionalRescaling, CountsAddUpOverSplitsAndInTheDecodeKernel) {
  const Qkv in = increasing_scores(1, 2000, 32, 0.05f);
  AttentionOptions options;
  options.rescale_threshold = 0.0f;
  options.num_threads = 2;
  const AttentionProblem p = AttentionProblem::from_inputs(in.q.view(), in.k.view(), in.v.view(), options);
  for (int splits : {1, 3}) {
    options.num_splits = splits;
    const CountedRun r = run_counted(in, options);
    // Each block of keys after a split's first rescales: the first sets the split's
    // reference from −∞. (The decode kernel's splits are equal shares of the keys, each in
    // blocks of block_k from its first key.)
    const CpuForwardPlan plan = plan_forward(p, CpuHardware::detect(options.num_threads), splits);
    ASSERT_TRUE(is_decode(plan.kernel));
    std::int64_t rescales = 0;
    for (std::int64_t item = 0; item < plan.work_items; ++item) {
      const ForwardWorkItem w = plan.work_item(p, item);
      rescales += std::max<std::int64_t>(0, (w.key_end - w.key_begin + plan.block_k - 1) / plan.block_k - 1);
    }
    EXPECT_EQ(r.counts[0], rescales) << splits << " splits";
    expect_matches_reference(in, options, r.result.out, 1e-5);
  }
}

// The rescale branch of the online softmax on every SIMD target and every forward kernel
// (random rows at the default threshold rescale on few targets, so they do not reach it):
// rows whose scores rise along the keys (0.1 log2 units a key, 100 over the row), at
// thresholds 0 (the classic rule) and 8, must rescale — as counted per row in
// rescale_counts and in KernelCounters::rescales, which must agree — and match the float64
// reference (float32: 1e-5 relative to the largest |v|; bf16: within the yardstick that
// rounds where the kernel rounds, tiled_bf16 upstream's twice the naive same-precision error). The backward has no such branch: it recomputes P from the
// forward's lse (RescaleBranch.BackwardOnRisingScores checks it on the same rows).
// Returns how many SIMD targets ran the kernel.
int expect_rescales_on_every_target(ForwardKernel kernel, DType dtype, std::int64_t sq, std::int64_t hq,
                                    std::int64_t hkv) {
  const Qkv in = rising_scores(dtype, sq, 1000, hq, hkv, 32, 0.1f);
  int ran = 0;
  for_each_simd_target([&](const std::string&) {
    if (kernel == ForwardKernel::tiled_bf16 && !CpuHardware::detect(0).bf16_dot) return;  // this target has none
    ++ran;
    for (float threshold : {0.0f, 8.0f}) {
      SCOPED_TRACE(std::string(to_string(kernel)) + " " + to_string(dtype) + " threshold " + std::to_string(threshold));
      AttentionOptions o;
      o.kernel = kernel;
      o.num_threads = 2;
      o.num_splits = 1;
      o.rescale_threshold = threshold;
      const AttentionProblem p = AttentionProblem::from_inputs(in.q.view(), in.k.view(), in.v.view(), o);
      ASSERT_EQ(plan_forward(p, CpuHardware::detect(2), 1, 0, kernel).kernel, kernel);
      Tensor out(dtype, {1, sq, hq, 32}), lse(DType::f32, {1, hq, sq});
      std::vector<std::int32_t> counts(static_cast<std::size_t>(hq * sq), -1);
      o.rescale_counts = MutableTensorView(counts.data(), DType::i32, {1, hq, sq});
      KernelCounters counters;
      o.counters = &counters;
      forward(in.q.view(), in.k.view(), in.v.view(), out.view(), lse.view(), o);
      for (std::size_t r = 0; r < counts.size(); ++r) ASSERT_GT(counts[r], 0) << "row " << r << " never rescaled";
      EXPECT_EQ(counters.rescales, total(counts));
      o.rescale_counts = {};
      o.counters = nullptr;
      const reference::Result want = reference::attention(in.q.view(), in.k.view(), in.v.view(), o);
      double v_max = 0.0;
      for (std::int64_t e = 0; e < in.v.numel(); ++e) v_max = std::fmax(v_max, std::fabs(in.v.get(e)));
      if (dtype == DType::f32) {
        EXPECT_LE(max_abs_error(out, want.out), 1e-5 * v_max);
      } else if (kernel == ForwardKernel::tiled_bf16) {
        // P rounded to bf16 against each tile's running maximum, not the row's: upstream's rule.
        EXPECT_LE(max_abs_error(out, want.out),
                  2.0 * naive_output_error(naive_same_precision(p, o, in.q, in.k, in.v), want.out, p.dtype, o.exp2) + 1e-5);
      } else {
        // P in float32: the yardstick that rounds where these kernels round. The naive one
        // rounds S to bf16, off by an eighth of the largest output on these rising scores.
        expect_within_yardstick(out, want.out, rounded_where_the_kernel_rounds(p, o, in.q, in.k, in.v), dtype);
      }
      expect_lse_near(lse, want.lse);
    }
  });
  return ran;
}

TEST(RescaleBranch, TiledKernelOnEveryTarget) {
  EXPECT_GT(expect_rescales_on_every_target(ForwardKernel::tiled, DType::f32, 37, 2, 1), 0);
  EXPECT_GT(expect_rescales_on_every_target(ForwardKernel::tiled, DType::bf16, 37, 2, 1), 0);
}

TEST(RescaleBranch, DecodeKernelOnEveryTarget) {
  // 4 q heads over 2 kv heads, one query: two rows per kv head.
  EXPECT_GT(expect_rescales_on_every_target(ForwardKernel::decode, DType::f32, 1, 4, 2), 0);
  EXPECT_GT(expect_rescales_on_every_target(ForwardKernel::decode, DType::bf16, 1, 4, 2), 0);
}

TEST(RescaleBranch, TiledBf16KernelOnEveryTargetThatHasIt) {
  const int ran = expect_rescales_on_every_target(ForwardKernel::tiled_bf16, DType::bf16, 37, 2, 1);
  EXPECT_EQ(ran > 0, cpu_has_avx512bf16()) << "AVX512-BF16 on this CPU: " << cpu_has_avx512bf16();
  if (ran == 0) GTEST_SKIP() << "no AVX512-BF16 on this CPU: tiled_bf16 cannot run here";
}

// The backward recomputes P = 2^(S·log2e − lse·log2e) from the forward's lse: on rows whose
// scores rise by 100 log2 units, every probability but the last few keys' underflows, and
// the gradients must still match the float64 reference (float32: 1e-4 relative to the
// largest gradient; bf16: upstream's three times the naive same-precision error), on every
// SIMD target that runs `kernel`. Returns how many did.
int expect_backward_on_rising_scores(BackwardKernel kernel, DType dtype) {
  const Qkv in = rising_scores(dtype, 37, 1000, 2, 1, 32, 0.1f);
  const Tensor dout = random_tensor(dtype, {1, 37, 2, 32}, 80);
  AttentionOptions o;
  o.num_threads = 2;
  o.backward_kernel = kernel;
  const reference::Gradients want = reference::attention_backward(dout.view(), in.q.view(), in.k.view(), in.v.view(), o);
  const AttentionProblem p = AttentionProblem::from_inputs(in.q.view(), in.k.view(), in.v.view(), o);
  const NaiveGradients naive = naive_backward_same_precision(p, o, dout, in.q, in.k, in.v);
  int ran = 0;
  for_each_simd_target([&](const std::string&) {
    if (kernel == BackwardKernel::tiled_bf16 && !CpuHardware::detect(2).bf16_dot) return;  // this target has none
    ++ran;
    SCOPED_TRACE(std::string(to_string(kernel)) + " " + to_string(dtype));
    const ForwardResult fwd = forward(in.q.view(), in.k.view(), in.v.view(), o);
    const BackwardResult got =
        backward(dout.view(), in.q.view(), in.k.view(), in.v.view(), fwd.out.view(), fwd.lse.view(), o);
    const std::pair<const Tensor*, const std::vector<double>*> grads[] = {
        {&got.dq, &want.dq}, {&got.dk, &want.dk}, {&got.dv, &want.dv}};
    const std::vector<double>* naive_grads[] = {&naive.dq, &naive.dk, &naive.dv};
    for (int g = 0; g < 3; ++g) {
      double largest = 0.0;
      for (double x : *grads[g].second) largest = std::fmax(largest, std::fabs(x));
      const double tolerance = dtype == DType::f32 ? 1e-4 * std::fmax(1.0, largest)
                                                   : 3.0 * yardstick_error(*naive_grads[g], *grads[g].second, "the naive gradient", INFINITY) + 1e-4;
      EXPECT_LE(max_abs_error(*grads[g].first, *grads[g].second), tolerance) << "gradient d" << "qkv"[g];
    }
  });
  return ran;
}

TEST(RescaleBranch, BackwardOnRisingScores) {
  EXPECT_GT(expect_backward_on_rising_scores(BackwardKernel::tiled, DType::f32), 0);
  EXPECT_GT(expect_backward_on_rising_scores(BackwardKernel::tiled, DType::bf16), 0);
}

TEST(RescaleBranch, Bf16BackwardOnRisingScores) {
  const int ran = expect_backward_on_rising_scores(BackwardKernel::tiled_bf16, DType::bf16);
  EXPECT_EQ(ran > 0, cpu_has_avx512bf16()) << "AVX512-BF16 on this CPU: " << cpu_has_avx512bf16();
  if (ran == 0) GTEST_SKIP() << "no AVX512-BF16 on this CPU: tiled_bf16 cannot run here";
}

TEST(Exp2Impl, Poly3AndMixedStayWithinTheirBoundsForEveryDtype) {
  std::uint64_t seed = 40;
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    const Qkv in = random_qkv(dtype, 67, 301, 2, 64, seed += 3);
    const reference::Result want = reference::attention(in.q.view(), in.k.view(), in.v.view());
    double v_max = 0.0;
    for (std::int64_t e = 0; e < in.v.numel(); ++e) v_max = std::fmax(v_max, std::fabs(in.v.get(e)));
    AttentionOptions exact;
    exact.exp2 = Exp2Impl::exact;
    const ForwardResult reference_kernel = forward(in.q.view(), in.k.view(), in.v.view(), exact);
    for (Exp2Impl impl : {Exp2Impl::poly3, Exp2Impl::mixed}) {
      SCOPED_TRACE(to_string(dtype) + std::string(" ") + to_string(impl));
      AttentionOptions options;
      options.exp2 = impl;
      options.exp2_poly3_fraction = 0.5f;
      const ForwardResult got = forward(in.q.view(), in.k.view(), in.v.view(), options);
      if (dtype == DType::f32) {
        // Weights off by a relative 7.5e-5 move a convex combination by at most twice that
        // times max|v|.
        EXPECT_LE(max_abs_error(got.out, want.out), 2.0 * 7.5e-5 * v_max + 1e-5);
        // and it is not the exact exp2: the outputs differ.
        EXPECT_GT(max_abs_error(got.out, values(reference_kernel.out)), 0.0);
      } else {
        const AttentionProblem p = AttentionProblem::from_inputs(in.q.view(), in.k.view(), in.v.view(), options);
        EXPECT_LE(max_abs_error(got.out, want.out),
                  2.0 * naive_output_error(naive_same_precision(p, options, in.q, in.k, in.v), want.out, p.dtype, options.exp2) + 1e-5);
      }
      for (std::int64_t e = 0; e < got.lse.numel(); ++e)
        // ℓ off by a relative 7.5e-5 moves lse = m + log ℓ by as much.
        ASSERT_NEAR(got.lse.get(e), want.lse[static_cast<std::size_t>(e)], 7.5e-5 + 1e-5);
    }
  }
}

TEST(Exp2Impl, DefaultsAreExactAndThresholdEight) {
  const AttentionOptions none;
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    const AttentionProblem p = AttentionProblem::from_sizes(1, 4, 4, 1, 1, 8, 8, dtype, none);
    EXPECT_EQ(p.exp2, Exp2Impl::exact) << to_string(dtype);
    EXPECT_EQ(p.rescale_threshold, AttentionProblem::kDefaultRescaleThreshold);
  }
  AttentionOptions o;
  o.exp2 = Exp2Impl::mixed;
  o.exp2_poly3_fraction = 0.25f;
  o.rescale_threshold = 0.0f;
  const AttentionProblem p = AttentionProblem::from_sizes(1, 4, 4, 1, 1, 8, 8, DType::f32, o);
  EXPECT_EQ(p.exp2, Exp2Impl::mixed);
  EXPECT_EQ(p.exp2_poly3_fraction, 0.25f);
  EXPECT_EQ(p.rescale_threshold, 0.0f);
  EXPECT_EQ(parse_exp2_impl("poly3"), Exp2Impl::poly3);
  expect_error([] { parse_exp2_impl("poly5"); }, {"poly5", "exact, poly3 or mixed"});
}

TEST(Exp2Impl, ExportedArrayMatchesTheKernelBounds) {
  std::vector<float> x;
  for (float v = -30.0f; v <= 0.0f; v += 0.01f) x.push_back(v);
  x.push_back(-0.5f);  // an odd length: the padded tail
  std::vector<float> exact(x.size()), poly3(x.size());
  exp2_array(Exp2Impl::exact, x.data(), exact.data(), x.size());
  exp2_array(Exp2Impl::poly3, x.data(), poly3.data(), x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp2(static_cast<double>(x[i]));
    ASSERT_LE(std::fabs(exact[i] - want), 2.5e-7 * want) << x[i];
    ASSERT_LE(std::fabs(poly3[i] - want), 7.6e-5 * want) << x[i];
  }
  expect_error([&] { exp2_array(Exp2Impl::mixed, x.data(), poly3.data(), x.size()); }, {"exact or poly3", "mixed"});
}

TEST(NumericsOptions, BadValuesAreRejectedWithTheirValues) {
  const Qkv in = random_qkv(DType::f32, 5, 6, 2, 8, 3);
  AttentionOptions o;
  o.exp2_poly3_fraction = 1.5f;
  expect_error([&] { forward(in.q.view(), in.k.view(), in.v.view(), o); }, {"exp2_poly3_fraction", "1.5"});
  for (float bad : {-1.0f, 65.0f, std::nanf("")}) {
    AttentionOptions t;
    t.rescale_threshold = bad;
    expect_error([&] { forward(in.q.view(), in.k.view(), in.v.view(), t); }, {"rescale_threshold", "[0, 64"});
  }
  std::vector<float> wrong_dtype(10);
  AttentionOptions c;
  c.rescale_counts = MutableTensorView(wrong_dtype.data(), DType::f32, {1, 2, 5});
  expect_error([&] { forward(in.q.view(), in.k.view(), in.v.view(), c); }, {"rescale_counts", "i32"});
  std::vector<std::int32_t> wrong_shape(10);
  c.rescale_counts = MutableTensorView(wrong_shape.data(), DType::i32, {1, 5, 2});
  expect_error([&] { forward(in.q.view(), in.k.view(), in.v.view(), c); }, {"rescale_counts", "(1, 2, 5)"});
  std::vector<std::int32_t> cu{0, 5};
  const VarlenSeqlens seqlens{TensorView(cu.data(), DType::i32, {2}), TensorView(cu.data(), DType::i32, {2}), 5, 5};
  const Tensor q3 = random_tensor(DType::f32, {5, 2, 8}, 1);
  c.rescale_counts = MutableTensorView(wrong_shape.data(), DType::i32, {1, 2, 5});
  expect_error([&] { forward_varlen(q3.view(), q3.view(), q3.view(), seqlens, c); },
               {"rescale_counts", "forward_varlen"});
}

}  // namespace
}  // namespace flashattn::test
