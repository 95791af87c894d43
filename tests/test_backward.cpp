// The CPU backward against float64 analytic gradients (themselves checked by finite
// differences), determinism, and bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

struct Case {
  std::int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v;
  bool causal;
  DType dtype;
  int threads;
  bool deterministic;
  Exp2Impl exp2 = Exp2Impl::automatic;
  float softcap = 0.0f;
};

std::string describe(const Case& c) {
  std::ostringstream s;
  s << "B=" << c.batch << " Sq=" << c.seqlen_q << " Sk=" << c.seqlen_k << " Hq=" << c.heads_q
    << " Hkv=" << c.heads_kv << " D=" << c.head_dim << " Dv=" << c.head_dim_v << " causal=" << c.causal
    << " dtype=" << to_string(c.dtype) << " threads=" << c.threads << " deterministic=" << c.deterministic
    << " exp2=" << to_string(c.exp2) << " softcap=" << c.softcap;
  return s.str();
}

struct Problem {
  Tensor q, k, v, dout;
  ForwardResult fwd;
  AttentionOptions options;
};

Problem make_problem(const Case& c, std::uint64_t seed) {
  Problem p{random_tensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim}, seed),
            random_tensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim}, seed + 1),
            random_tensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim_v}, seed + 2),
            random_tensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim_v}, seed + 3),
            {},
            {}};
  p.options.causal = c.causal;
  p.options.num_threads = c.threads;
  p.options.deterministic = c.deterministic;
  p.options.exp2 = c.exp2;
  p.options.softcap = c.softcap;
  p.fwd = forward(p.q.view(), p.k.view(), p.v.view(), p.options);
  return p;
}

BackwardResult run_backward(const Problem& p) {
  return backward(p.dout.view(), p.q.view(), p.k.view(), p.v.view(), p.fwd.out.view(),
                  p.fwd.lse.view(), p.options);
}

// Gradients within 1e-4 (float32 with exact exponentials) or 3× the naive same-precision
// backward's error plus 1e-4 (bf16/f16, or the poly3 exponential, which the naive backward
// then uses too) of the float64 reference: upstream's rule for gradients.
void check_case(const Case& c, std::uint64_t seed) {
  SCOPED_TRACE(describe(c) + " seed=" + std::to_string(seed));
  const Problem p = make_problem(c, seed);
  const BackwardResult got = run_backward(p);
  const reference::Gradients want =
      reference::attention_backward(p.dout.view(), p.q.view(), p.k.view(), p.v.view(), p.options);
  double tol_q = 1e-4, tol_k = 1e-4, tol_v = 1e-4;
  if (c.dtype != DType::f32 || c.exp2 == Exp2Impl::poly3 || c.exp2 == Exp2Impl::mixed) {
    const AttentionProblem ap = AttentionProblem::from_inputs(p.q.view(), p.k.view(), p.v.view(), p.options);
    const NaiveGradients naive = naive_backward_same_precision(ap, p.options, p.dout, p.q, p.k, p.v);
    tol_q = 3.0 * max_abs_error(naive.dq, want.dq) + 1e-4;
    tol_k = 3.0 * max_abs_error(naive.dk, want.dk) + 1e-4;
    tol_v = 3.0 * max_abs_error(naive.dv, want.dv) + 1e-4;
  }
  EXPECT_LE(max_abs_error(got.dq, want.dq), tol_q) << "dq";
  EXPECT_LE(max_abs_error(got.dk, want.dk), tol_k) << "dk";
  EXPECT_LE(max_abs_error(got.dv, want.dv), tol_v) << "dv";
}

constexpr std::pair<std::int64_t, std::int64_t> kSeqlenPairs[] = {
    {1, 239}, {3, 799}, {113, 203}, {127, 513}, {239, 1}, {1023, 1024}, {1024, 1023}};

TEST(Backward, SeqlenPairsFloat32) {
  std::uint64_t seed = 100;
  for (const auto& [sq, sk] : kSeqlenPairs)
    for (bool causal : {false, true})
      for (bool det : {false, true})
        if (sq * sk < 500000 || det == causal)  // the two largest pairs: half the modes
          check_case({1, sq, sk, 2, 1, 32, 32, causal, DType::f32, 2, det}, seed++);
}

TEST(Backward, HeadDims) {
  std::uint64_t seed = 200;
  for (std::int64_t d : {1, 5, 40, 59, 64, 80, 111, 128, 160, 256, 300, 512})
    check_case({1, 45, 70, 2, 1, d, d, d % 2 == 1, DType::f32, 2, d % 3 == 0}, seed++);
}

TEST(Backward, ValueDimDiffersAndGroupedHeads) {
  check_case({2, 45, 77, 4, 2, 64, 32, false, DType::f32, 2, false}, 300);
  check_case({1, 80, 80, 2, 1, 40, 128, true, DType::f32, 3, true}, 301);
  check_case({2, 70, 90, 8, 8, 48, 48, true, DType::f32, 2, false}, 302);  // MHA
  check_case({2, 70, 90, 8, 2, 48, 48, true, DType::f32, 2, true}, 303);   // GQA
  check_case({1, 70, 90, 6, 1, 48, 48, false, DType::f32, 2, false}, 304); // MQA
}

TEST(Backward, LowPrecision) {
  std::uint64_t seed = 400;
  for (DType dtype : {DType::bf16, DType::f16}) {
    check_case({1, 113, 203, 4, 2, 64, 64, false, dtype, 2, false}, seed++);
    check_case({1, 67, 130, 2, 1, 128, 96, true, dtype, 2, true}, seed++);
  }
}

// The backward recomputes P with the forward's exponential: poly3's relative error of 7.5e-5
// (and mixed's share of it) reaches the gradients through P and through lse, amplified where
// dP − D is large next to the gradient; softcap adds its tanh' factor.
TEST(Backward, Poly3AndMixedExponentials) {
  std::uint64_t seed = 450;
  for (Exp2Impl exp2 : {Exp2Impl::poly3, Exp2Impl::mixed})
    for (DType dtype : {DType::f32, DType::bf16}) {
      check_case({2, 8, 12, 2, 1, 7, 40, true, dtype, 2, true, exp2, 19.9f}, seed++);
      check_case({1, 113, 203, 4, 2, 64, 64, false, dtype, 2, false, exp2}, seed++);
      check_case({1, 67, 130, 2, 1, 128, 96, true, dtype, 3, true, exp2, 5.0f}, seed++);
    }
}

TEST(Backward, EverySimdTargetAndThreadCount) {
  for_each_simd_target([](const std::string&) {
    std::uint64_t seed = 500;
    for (int threads : {1, 3})
      for (bool det : {false, true})
        check_case({1, 97, 131, 2, 1, 37, 45, true, DType::f32, threads, det}, seed++);
    check_case({1, 40, 50, 2, 2, 64, 64, false, DType::bf16, 2, false}, seed++);
  });
}

TEST(Backward, ReferenceGradientsMatchFiniteDifferences) {
  // L(q, k, v) = Σ dout ∘ attention(q, k, v), evaluated in float64 by the reference.
  Case c{1, 6, 9, 2, 1, 5, 4, true, DType::f32, 1, false};
  Problem p = make_problem(c, 900);
  auto loss = [&] {
    const reference::Result r = reference::attention(p.q.view(), p.k.view(), p.v.view(), p.options);
    double l = 0.0;
    for (std::int64_t i = 0; i < p.dout.numel(); ++i) l += p.dout.get(i) * r.out[static_cast<std::size_t>(i)];
    return l;
  };
  const reference::Gradients g =
      reference::attention_backward(p.dout.view(), p.q.view(), p.k.view(), p.v.view(), p.options);
  for (auto [tensor, grad] : {std::pair{&p.q, &g.dq}, {&p.k, &g.dk}, {&p.v, &g.dv}}) {
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

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * dtype_size(a.dtype())) == 0;
}

TEST(Backward, DeterministicModeIsBitIdenticalAcrossRunsAndThreadCounts) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    Problem p = make_problem({2, 300, 417, 4, 2, 64, 48, true, dtype, 2, true}, 1000);
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

TEST(Backward, RowsWithoutVisibleKeysContributeNothing) {
  Problem p = make_problem({1, 40, 25, 2, 1, 16, 16, true, DType::f32, 2, false}, 1100);
  for (bool det : {false, true}) {
    p.options.deterministic = det;
    const BackwardResult g = run_backward(p);
    for (std::int64_t i = 0; i < g.dq.numel(); ++i) ASSERT_FALSE(std::isnan(g.dq.get(i)));
    for (std::int64_t i = 0; i < g.dk.numel(); ++i) ASSERT_FALSE(std::isnan(g.dk.get(i)));
    for (std::int64_t row = 0; row < 40 - 25; ++row)  // the first Sq − Sk rows see no key
      for (std::int64_t c = 0; c < 2 * 16; ++c) EXPECT_EQ(g.dq.get(row * 32 + c), 0.0f);
  }
  check_case({1, 40, 25, 2, 1, 16, 16, true, DType::f32, 2, true}, 1101);
}

TEST(Backward, EmptySizes) {
  for (const auto& [b, sq, sk] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{0, 5, 5}, {2, 0, 5}, {2, 5, 0}})
    for (bool det : {false, true}) {
      const Problem p = make_problem({b, sq, sk, 2, 1, 8, 8, false, DType::f32, 2, det}, 1200);
      const BackwardResult g = run_backward(p);
      for (const Tensor* t : {&g.dq, &g.dk, &g.dv})
        for (std::int64_t i = 0; i < t->numel(); ++i) ASSERT_EQ(t->get(i), 0.0f);
    }
}

TEST(Backward, BadInputNamesTheArgument) {
  const Problem p = make_problem({1, 5, 6, 2, 1, 8, 8, false, DType::f32, 1, false}, 1300);
  auto expect = [](const std::function<void()>& call, const std::string& fragment) {
    try {
      call();
      ADD_FAILURE() << "expected flashattn::Error containing " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  const Tensor wrong_dout = random_tensor(DType::f32, {1, 5, 2, 7}, 1);
  expect([&] { backward(wrong_dout.view(), p.q.view(), p.k.view(), p.v.view(), p.fwd.out.view(), p.fwd.lse.view()); },
         "dout: shape (1, 5, 2, 7) but expected (1, 5, 2, 8)");
  const Tensor wrong_lse(DType::f32, {1, 5, 2});
  expect([&] { backward(p.dout.view(), p.q.view(), p.k.view(), p.v.view(), p.fwd.out.view(), wrong_lse.view()); },
         "lse: shape (1, 5, 2) but expected (1, 2, 5)");
  const Tensor bf16_dout = random_tensor(DType::bf16, {1, 5, 2, 8}, 1);
  expect([&] { backward(bf16_dout.view(), p.q.view(), p.k.view(), p.v.view(), p.fwd.out.view(), p.fwd.lse.view()); },
         "dout: dtype bf16");
  Tensor dq(DType::f32, {1, 5, 2, 8}), dk(DType::f32, {1, 6, 1, 8}), dv(DType::f16, {1, 6, 1, 8});
  expect([&] { backward(p.dout.view(), p.q.view(), p.k.view(), p.v.view(), p.fwd.out.view(), p.fwd.lse.view(), dq.view(), dk.view(), dv.view()); },
         "dv: dtype f16");
  Tensor dq_alias = p.q;
  expect([&] { backward(p.dout.view(), dq_alias.view(), p.k.view(), p.v.view(), p.fwd.out.view(), p.fwd.lse.view(), dq_alias.view(), dk.view(), dk.view()); },
         "overlaps input q");
}

}  // namespace
}  // namespace flashattn::test
