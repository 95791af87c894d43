// The CPU backward against float64 analytic gradients (themselves checked by finite
// differences), determinism, and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

// A case of these tests: sizes, causal, dtype, thread count, deterministic mode, and the
// forward's exponential and softcap where they matter.
Case backward_case(const Shape& shape, bool causal, DType dtype, int threads, bool deterministic,
                   std::uint64_t seed, Exp2Impl exp2 = Exp2Impl::automatic, float softcap = 0.0f) {
  AttentionOptions options;
  options.causal = causal;
  options.num_threads = threads;
  options.deterministic = deterministic;
  options.exp2 = exp2;
  options.softcap = softcap;
  return Case(shape, dtype, options, seed);
}

// A case's inputs and its forward's out and lse; `options` as the backward runs them.
struct Problem {
  Inputs in;
  ForwardResult fwd;
  AttentionOptions options;
};

Problem make_problem(const Case& c) {
  Inputs in = c.inputs();
  ForwardResult fwd = library_forward(c, in);
  return {std::move(in), std::move(fwd), c.options()};
}

BackwardResult run_backward(const Problem& p) {
  return backward(p.in.dout.view(), p.in.q.view(), p.in.k.view(), p.in.v.view(), p.fwd.out.view(),
                  p.fwd.lse.view(), p.options);
}

// Gradients by check_backward: within 1e-4 (float32 with exact exponentials) or 3× the
// naive same-precision backward's error plus 1e-4 (bf16/f16, or the poly3 exponential,
// which the naive backward then uses too) of the float64 reference: upstream's rule.
void check_case(const Shape& shape, bool causal, DType dtype, int threads, bool deterministic,
                std::uint64_t seed, Exp2Impl exp2 = Exp2Impl::automatic, float softcap = 0.0f) {
  check_backward(backward_case(shape, causal, dtype, threads, deterministic, seed, exp2, softcap));
}

constexpr std::pair<std::int64_t, std::int64_t> kSeqlenPairs[] = {
    {1, 239}, {3, 799}, {113, 203}, {127, 513}, {239, 1}, {1023, 1024}, {1024, 1023}};

TEST(Backward, SeqlenPairsFloat32) {
  std::uint64_t seed = 100;
  for (const auto& [sq, sk] : kSeqlenPairs)
    for (bool causal : {false, true})
      for (bool det : {false, true})
        // The two largest pairs one mode each (causal and deterministic for Sq < Sk, neither
        // for Sq > Sk): two modes of each took most of this test's 106 s under ASan.
        if (sq * sk < 500000 || (det == causal && causal == (sq < sk)))
          check_case({1, sq, sk, 2, 1, 32, 32}, causal, DType::f32, 2, det, seed++);
}

TEST(Backward, HeadDims) {
  std::uint64_t seed = 200;
  for (std::int64_t d : {1, 5, 40, 59, 64, 80, 111, 128, 160, 256, 300, 512})
    check_case({1, 45, 70, 2, 1, d, d}, d % 2 == 1, DType::f32, 2, d % 3 == 0, seed++);
}

TEST(Backward, ValueDimDiffersAndGroupedHeads) {
  check_case({2, 45, 77, 4, 2, 64, 32}, false, DType::f32, 2, false, 300);
  check_case({1, 80, 80, 2, 1, 40, 128}, true, DType::f32, 3, true, 301);
  check_case({2, 70, 90, 8, 8, 48, 48}, true, DType::f32, 2, false, 302);  // MHA
  check_case({2, 70, 90, 8, 2, 48, 48}, true, DType::f32, 2, true, 303);   // GQA
  check_case({1, 70, 90, 6, 1, 48, 48}, false, DType::f32, 2, false, 304); // MQA
}

TEST(Backward, LowPrecision) {
  std::uint64_t seed = 400;
  for (DType dtype : {DType::bf16, DType::f16}) {
    check_case({1, 113, 203, 4, 2, 64, 64}, false, dtype, 2, false, seed++);
    check_case({1, 67, 130, 2, 1, 128, 96}, true, dtype, 2, true, seed++);
  }
}

// The backward recomputes P with the forward's exponential: poly3's relative error of 7.5e-5
// (and mixed's share of it) reaches the gradients through P and through lse, amplified where
// dP − D is large next to the gradient; softcap adds its tanh' factor.
TEST(Backward, Poly3AndMixedExponentials) {
  std::uint64_t seed = 450;
  for (Exp2Impl exp2 : {Exp2Impl::poly3, Exp2Impl::mixed})
    for (DType dtype : {DType::f32, DType::bf16}) {
      check_case({2, 8, 12, 2, 1, 7, 40}, true, dtype, 2, true, seed++, exp2, 19.9f);
      check_case({1, 113, 203, 4, 2, 64, 64}, false, dtype, 2, false, seed++, exp2);
      check_case({1, 67, 130, 2, 1, 128, 96}, true, dtype, 3, true, seed++, exp2, 5.0f);
    }
}

TEST(Backward, EverySimdTargetAndThreadCount) {
  for_each_simd_target([](const std::string&) {
    std::uint64_t seed = 500;
    for (int threads : {1, 3})
      for (bool det : {false, true})
        check_case({1, 97, 131, 2, 1, 37, 45}, true, DType::f32, threads, det, seed++);
    check_case({1, 40, 50, 2, 2, 64, 64}, false, DType::bf16, 2, false, seed++);
  });
}

TEST(Backward, ReferenceGradientsMatchFiniteDifferences) {
  // L(q, k, v) = Σ dout ∘ attention(q, k, v), evaluated in float64 by the reference.
  Problem p = make_problem(backward_case({1, 6, 9, 2, 1, 5, 4}, true, DType::f32, 1, false, 900));
  auto loss = [&] {
    const reference::Result r = reference::attention(p.in.q.view(), p.in.k.view(), p.in.v.view(), p.options);
    double l = 0.0;
    for (std::int64_t i = 0; i < p.in.dout.numel(); ++i) l += p.in.dout.get(i) * r.out[static_cast<std::size_t>(i)];
    return l;
  };
  const reference::Gradients g =
      reference::attention_backward(p.in.dout.view(), p.in.q.view(), p.in.k.view(), p.in.v.view(), p.options);
  for (auto [tensor, grad] : {std::pair{&p.in.q, &g.dq}, {&p.in.k, &g.dk}, {&p.in.v, &g.dv}}) {
    for (std::int64_t i = 0; i < tensor->numel(); i += 3) {
      const float x = tensor->get(i);
      const float hi = x + 1e-2f, lo = x - 1e-2f;
      tensor->set(i, hi);
      const double l_hi = loss();
      tensor->set(i, lo);
      const double l_lo = loss();
      tensor->set(i, x);
      const double numeric = (l_hi - l_lo) / (static_cast<double>(hi) - lo);
      EXPECT_NEAR((*grad)[static_cast<std::size_t>(i)], numeric, 1e-4 * (1 + std::fabs(numeric))) << "element " << i;
    }
  }
}

TEST(Backward, DeterministicModeIsBitIdenticalAcrossRunsAndThreadCounts) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    Problem p = make_problem(backward_case({2, 300, 417, 4, 2, 64, 48}, true, dtype, 2, true, 1000));
    const BackwardResult first = run_backward(p);
    for (int run = 0; run < 20; ++run) {
      const BackwardResult again = run_backward(p);
      ASSERT_TRUE(bitwise_equal(first.dq, again.dq)) << "run " << run;
      ASSERT_TRUE(bitwise_equal(first.dk, again.dk)) << "run " << run;
      ASSERT_TRUE(bitwise_equal(first.dv, again.dv)) << "run " << run;
    }
    for (int threads : {1, 3, 8}) {
      p.options.num_threads = threads;
      const BackwardResult other = run_backward(p);
      EXPECT_TRUE(bitwise_equal(first.dq, other.dq)) << threads << " threads";
      EXPECT_TRUE(bitwise_equal(first.dk, other.dk)) << threads << " threads";
      EXPECT_TRUE(bitwise_equal(first.dv, other.dv)) << threads << " threads";
    }
  }
}

// The kept Q/dO tiles (CpuBackwardPlan::keep_q_rows): each thread converts a Q tile once per
// kv head and reads it there for every K/V tile after — the same values as building it anew
// per K/V tile (switches.reuse_packed_kv off), so the same gradients bit for bit (dQ where its
// shares are added in a fixed order): GQA groups
// (the copy holds every q head of the kv head), ragged last Q tiles, causal and windowed
// skips, f32 and f16 inputs on the float32 kernel and bf16 on tiled_bf16 where it runs,
// deterministic mode, 1–3 threads, every SIMD target. The plan keeps them within its budgets
// and not past them.
TEST(Backward, KeptQRowsAreTheGatheredOnes) {
  const CpuHardware hw = CpuHardware::detect(2);
  std::uint64_t seed = 1100;
  int bf16_runs = 0;
  for_each_simd_target([&](const std::string& target) {
    for (int threads : {1, 2, 3}) {
      for (const Shape& shape : {Shape{2, 201, 333, 6, 2, 40, 24}, Shape{1, 77, 130, 8, 1, 64, 64}}) {
        for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
          const BackwardKernel kernel = dtype == DType::bf16 ? BackwardKernel::tiled_bf16 : BackwardKernel::tiled;
          if (kernel == BackwardKernel::tiled_bf16) {
            if (!CpuHardware::detect(threads).bf16_dot) continue;  // not on this target: see the count below
            ++bf16_runs;
          }
          Case c = backward_case(shape, threads != 2, dtype, threads, threads == 3, seed++);
          if (threads == 2) c = c.with([](AttentionOptions& o) { o.window_size = {40, 7}; });
          SCOPED_TRACE(target + ", " + c.describe());
          Problem p = make_problem(c);
          ASSERT_TRUE(plan_backward(c.problem(), hw, false, kernel).keep_q_rows);
          p.options.backward_kernel = kernel;
          const BackwardResult kept = run_backward(p);
          p.options.switches.reuse_packed_kv = false;
          const BackwardResult gathered = run_backward(p);
          // dK and dV: each K/V tile's own, summed in one order. dQ: its K/V tiles' shares are
          // added in the order threads finish them unless deterministic (or one thread).
          EXPECT_TRUE(bitwise_equal(kept.dk, gathered.dk));
          EXPECT_TRUE(bitwise_equal(kept.dv, gathered.dv));
          if (threads == 1 || c.options().deterministic)
            EXPECT_TRUE(bitwise_equal(kept.dq, gathered.dq));
          else {
            double largest = 0.0;
            for (std::int64_t e = 0; e < gathered.dq.numel(); ++e) largest = std::max(largest, std::fabs(double{gathered.dq.get(e)}));
            const double tolerance = 1e-4 * largest + 2.0 * ulp(dtype, largest);
            for (std::int64_t e = 0; e < kept.dq.numel(); ++e)
              ASSERT_NEAR(kept.dq.get(e), gathered.dq.get(e), tolerance) << "dq element " << e;
          }
        }
      }
    }
  });
  // Without AVX512-BF16 the bf16 cases are left out here, and BackwardBf16's tests report the
  // skip; with it they must have run.
  if (cpu_has_avx512bf16()) EXPECT_GT(bf16_runs, 0) << "this CPU has AVX512-BF16: tiled_bf16's kept tiles must have run";
  // 8 q heads of one kv head at 16384 queries, D = 256: 8 · 16384 · 2 · (256 + 16) floats
  // = 272 MiB per thread, past the per-thread budget: gathered per tile.
  const AttentionProblem big = AttentionProblem::from_sizes(1, 16384, 16384, 8, 1, 256, 256, DType::f32, {});
  EXPECT_FALSE(plan_backward(big, hw, false, BackwardKernel::tiled).keep_q_rows);
  // One head of 65536 queries, D = 64: 40 MiB a thread, more than q and dout (32 MiB) — the
  // copies would add more than they copy (tests/memory_cap.cpp's problem). 32 heads: kept.
  const AttentionProblem one_head = AttentionProblem::from_sizes(1, 65536, 65536, 1, 1, 64, 64, DType::f32, {});
  EXPECT_FALSE(plan_backward(one_head, hw, false, BackwardKernel::tiled).keep_q_rows);
  const AttentionProblem heads = AttentionProblem::from_sizes(1, 65536, 65536, 32, 32, 64, 64, DType::f32, {});
  EXPECT_TRUE(plan_backward(heads, hw, false, BackwardKernel::tiled).keep_q_rows);
  const AttentionProblem small = AttentionProblem::from_sizes(1, 512, 512, 8, 1, 64, 64, DType::bf16, {});
  if (hw.bf16_dot) EXPECT_TRUE(plan_backward(small, hw, false, BackwardKernel::tiled_bf16).keep_q_rows);
  EXPECT_TRUE(plan_backward(small, hw, false, BackwardKernel::tiled).keep_q_rows);
}

TEST(Backward, RowsWithoutVisibleKeysContributeNothing) {
  Problem p = make_problem(backward_case({1, 40, 25, 2, 1, 16, 16}, true, DType::f32, 2, false, 1100));
  for (bool det : {false, true}) {
    p.options.deterministic = det;
    const BackwardResult g = run_backward(p);
    for (const Tensor* grad : {&g.dq, &g.dk, &g.dv})
      for (std::int64_t i = 0; i < grad->numel(); ++i) ASSERT_TRUE(std::isfinite(grad->get(i))) << "element " << i;
    for (std::int64_t row = 0; row < 40 - 25; ++row)  // the first Sq − Sk rows see no key
      for (std::int64_t c = 0; c < 2 * 16; ++c) EXPECT_EQ(g.dq.get(row * 32 + c), 0.0f);
  }
  check_case({1, 40, 25, 2, 1, 16, 16}, true, DType::f32, 2, true, 1101);
}

// The row strips' spans (docs/algorithm.md §3): on a causal diagonal or a window's edges the
// forward and the backward compute each strip over the keys some row of it sees, not whole
// tiles. A strip's span overshoots a row's visible keys by under a panel and a strip's height
// at each end it cuts (KernelCounters::scores_computed), where whole tiles would overshoot by
// about half a tile a row; the gradients stay within the rule (check_case). Every SIMD target.
TEST(Backward, StripsComputeTheirSpansOnly) {
  for_each_simd_target([](const std::string& target) {
    const CpuHardware hw = CpuHardware::detect(1);
    const std::int64_t heads = 2, slack_per_row = hw.micro_cols + hw.micro_rows;
    struct Shape2 {
      std::int64_t s, window, visible, ends;  // sequence, left window (-1: none), visible pairs a head, ends cut
    };
    for (const Shape2& c : {Shape2{1024, -1, 1024 * 1025 / 2, 1}, Shape2{256, 16, 17 * 256 - 16 * 17 / 2, 2}}) {
      const Case k = backward_case({1, c.s, c.s, heads, heads, 64, 64}, true, DType::f32, 2, false, 1150);
      AttentionOptions o = k.options();
      o.window_size = {c.window, 0};
      KernelCounters fwd, bwd;
      o.counters = &fwd;
      const Inputs in = k.inputs();
      const ForwardResult f = forward(in.q.view(), in.k.view(), in.v.view(), o);
      o.counters = &bwd;
      backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), f.out.view(), f.lse.view(), o);
      const std::int64_t visible = heads * c.visible;
      const std::int64_t bound = visible + heads * (c.s + hw.micro_rows) * c.ends * slack_per_row;
      for (const auto& [name, counts] : {std::pair<const char*, const KernelCounters*>{"forward", &fwd}, {"backward", &bwd}}) {
        SCOPED_TRACE(target + ", window " + std::to_string(c.window) + ", " + name);
        EXPECT_GE(counts->scores_computed, visible);
        EXPECT_LE(counts->scores_computed, bound);
        EXPECT_GT(counts->scores, bound) << "whole tiles would compute more: the case tells spans from tiles";
      }
    }
  });
  check_case({1, 200, 200, 2, 1, 64, 64}, true, DType::f32, 3, true, 1151);
}

// The strips' narrowing drops only exact zeros: the causal (and windowed) backward gives the
// bits of the same mask as an additive bias of 0 and −∞, which the backward computes over whole
// tiles (it summarises no bias) — bottom-right alignment with seqlen_q above and below
// seqlen_k (rows that see no key), grouped heads, every SIMD target, deterministic dQ.
TEST(Backward, NarrowedStripsGiveTheWholeTilesBits) {
  for_each_simd_target([](const std::string& target) {
    std::uint64_t seed = 1160;
    for (const auto& [sq, sk, left] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{200, 200, -1},
                                       {150, 230, -1}, {230, 150, 40}, {177, 177, 20}}) {
      SCOPED_TRACE(target + ": " + std::to_string(sq) + " x " + std::to_string(sk) + ", left window " +
                   std::to_string(left));
      Case c = backward_case({1, sq, sk, 4, 2, 40, 24}, true, DType::f32, 2, true, seed++);
      AttentionOptions causal = c.options();
      causal.window_size = {left, 0};
      const Inputs in = c.inputs();
      const ForwardResult f = forward(in.q.view(), in.k.view(), in.v.view(), causal);
      Tensor bias(DType::f32, {1, 1, sq, sk});
      for (std::int64_t i = 0; i < sq; ++i)
        for (std::int64_t j = 0; j < sk; ++j) {
          const std::int64_t diagonal = i + sk - sq;  // bottom-right: query i sees keys up to it
          const bool seen = j <= diagonal && (left < 0 || j >= diagonal - left);
          bias.set(i * sk + j, seen ? 0.0f : -std::numeric_limits<float>::infinity());
        }
      AttentionOptions masked = c.options();
      masked.causal = false;
      masked.attn_mask = bias.view();
      const auto grads = [&](const AttentionOptions& o) {
        return backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), f.out.view(), f.lse.view(), o);
      };
      const BackwardResult narrowed = grads(causal), whole = grads(masked);
      for (const auto& [name, a, b] : {std::tuple{"dq", &narrowed.dq, &whole.dq}, {"dk", &narrowed.dk, &whole.dk},
                                       {"dv", &narrowed.dv, &whole.dv}})
        for (std::int64_t e = 0; e < a->numel(); ++e) ASSERT_EQ(a->get(e), b->get(e)) << name << " element " << e;
    }
  });
}

TEST(Backward, EmptySizes) {
  for (const auto& [b, sq, sk] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{0, 5, 5}, {2, 0, 5}, {2, 5, 0}})
    for (bool det : {false, true}) {
      const Problem p = make_problem(backward_case({b, sq, sk, 2, 1, 8, 8}, false, DType::f32, 2, det, 1200));
      const BackwardResult g = run_backward(p);
      for (const Tensor* t : {&g.dq, &g.dk, &g.dv})
        for (std::int64_t i = 0; i < t->numel(); ++i) ASSERT_EQ(t->get(i), 0.0f);
    }
  // No query rows: dk and dv written with zeros (they held 7), and in work bounded by them —
  // a batch of 2^40 empty sequences (a header-only .npy) took hours over batch·heads.
  const Tensor q(DType::f32, {2, 0, 2, 8}), k = random_tensor(DType::f32, {2, 5, 1, 8}, 3), lse(DType::f32, {2, 2, 0});
  Tensor dq(DType::f32, {2, 0, 2, 8}), dk(DType::f32, {2, 5, 1, 8}), dv(DType::f32, {2, 5, 1, 8});
  for (Tensor* t : {&dk, &dv})
    for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, 7.0f);
  backward(q.view(), q.view(), k.view(), k.view(), q.view(), lse.view(), dq.view(), dk.view(), dv.view());
  for (const Tensor* t : {&dk, &dv})
    for (std::int64_t i = 0; i < t->numel(); ++i) ASSERT_EQ(t->get(i), 0.0f);
  float storage = 0.0f;
  const std::int64_t huge = std::int64_t{1} << 40;
  const TensorView none(&storage, DType::f32, {huge, 0, 2, 8}), no_lse(&storage, DType::f32, {huge, 2, 0});
  const MutableTensorView no_grad(&storage, DType::f32, {huge, 0, 2, 8});
  backward(none, none, none, none, none, no_lse, no_grad, no_grad, no_grad);
  EXPECT_EQ(storage, 0.0f);
}

TEST(Backward, BadInputNamesTheArgument) {
  const Problem p = make_problem(backward_case({1, 5, 6, 2, 1, 8, 8}, false, DType::f32, 1, false, 1300));
  const Inputs& in = p.in;
  auto expect = [](const std::function<void()>& call, const std::string& fragment) {
    try {
      call();
      ADD_FAILURE() << "expected flashattn::Error containing " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  const Tensor wrong_dout = random_tensor(DType::f32, {1, 5, 2, 7}, 1);
  expect([&] { backward(wrong_dout.view(), in.q.view(), in.k.view(), in.v.view(), p.fwd.out.view(), p.fwd.lse.view()); },
         "dout: shape (1, 5, 2, 7) but expected (1, 5, 2, 8)");
  const Tensor wrong_lse(DType::f32, {1, 5, 2});
  expect([&] { backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), p.fwd.out.view(), wrong_lse.view()); },
         "lse: shape (1, 5, 2) but expected (1, 2, 5)");
  const Tensor bf16_dout = random_tensor(DType::bf16, {1, 5, 2, 8}, 1);
  expect([&] { backward(bf16_dout.view(), in.q.view(), in.k.view(), in.v.view(), p.fwd.out.view(), p.fwd.lse.view()); },
         "dout: dtype bf16");
  Tensor dq(DType::f32, {1, 5, 2, 8}), dk(DType::f32, {1, 6, 1, 8}), dv(DType::f16, {1, 6, 1, 8});
  expect([&] { backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), p.fwd.out.view(), p.fwd.lse.view(), dq.view(), dk.view(), dv.view()); },
         "dv: dtype f16");
  Tensor dq_alias = in.q;
  expect([&] { backward(in.dout.view(), dq_alias.view(), in.k.view(), in.v.view(), p.fwd.out.view(), p.fwd.lse.view(), dq_alias.view(), dk.view(), dk.view()); },
         "overlaps input q");
}

}  // namespace
}  // namespace flashattn::test
