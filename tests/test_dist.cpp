// Ring attention under mpirun (CTest starts this binary with P = 1, 2, 3, 4 ranks). Every rank
// builds the same global inputs, runs the ring on its shard, and checks its rows against
// single-process flashattn on the whole sequence and against the float64 reference.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "flashattn/dist.hpp"
#include "flashattn/flex.hpp"
#include "flashattn/online_softmax.hpp"
#include "src/dist/ring_comm.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

using dist::RingOptions;
using dist::ShardLayout;

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// Waits in the tests are short: a bug must fail the test, not stall CI (steps take
// milliseconds here).
constexpr double kTestTimeoutSeconds = 60.0;

// A case of the ring: one sequence length for queries and keys, split over the ranks; one
// thread each, as several ranks share this machine's cores.
Case ring_case(std::int64_t batch, std::int64_t seqlen, std::int64_t heads_q, std::int64_t heads_kv,
               std::int64_t head_dim, std::int64_t head_dim_v, bool causal, DType dtype, std::uint64_t seed,
               float softcap = 0.0f, bool float32_products = false) {
  AttentionOptions options;
  options.causal = causal;
  options.softcap = softcap;
  options.num_threads = 1;
  if (float32_products) {
    options.kernel = ForwardKernel::tiled;
    options.backward_kernel = BackwardKernel::tiled;
  }
  return Case({batch, seqlen, seqlen, heads_q, heads_kv, head_dim, head_dim_v}, dtype, options, seed);
}

std::string ring_trace(const Case& c, ShardLayout layout) {
  return c.describe() + " kernel=" + to_string(c.options().kernel) + " layout=" + (layout == ShardLayout::zigzag ? "zigzag" : "contiguous") +
         " ranks=" + std::to_string(world_size()) + " rank=" + std::to_string(world_rank());
}

// The local shard of a global (B, S, H, D) tensor (dim 1) or (B, H, S) lse (dim 2): the rows
// of this rank's token ranges, in storage order.
Tensor shard_of(const Tensor& global, const std::vector<dist::TokenRange>& ranges, int dim) {
  std::vector<std::int64_t> shape = global.shape();
  std::int64_t local = 0;
  for (const auto& r : ranges) local += r.size();
  shape[static_cast<std::size_t>(dim)] = local;
  Tensor shard(global.dtype(), shape);
  std::int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= shape[static_cast<std::size_t>(d)];
  for (std::size_t d = static_cast<std::size_t>(dim) + 1; d < shape.size(); ++d) inner *= shape[d];
  const std::int64_t seqlen = global.shape()[static_cast<std::size_t>(dim)];
  const std::size_t bytes = dtype_size(global.dtype());
  for (std::int64_t o = 0; o < outer; ++o) {
    std::int64_t at = 0;
    for (const auto& r : ranges)
      for (std::int64_t t = r.begin; t < r.end; ++t, ++at)
        std::memcpy(static_cast<unsigned char*>(shard.data()) + ((o * local + at) * inner) * bytes,
                    static_cast<const unsigned char*>(global.data()) + ((o * seqlen + t) * inner) * bytes,
                    static_cast<std::size_t>(inner) * bytes);
  }
  return shard;
}
std::vector<double> shard_of(const std::vector<double>& global, const std::vector<std::int64_t>& shape,
                             const std::vector<dist::TokenRange>& ranges, int dim) {
  std::vector<double> out;
  std::int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= shape[static_cast<std::size_t>(d)];
  for (std::size_t d = static_cast<std::size_t>(dim) + 1; d < shape.size(); ++d) inner *= shape[d];
  const std::int64_t seqlen = shape[static_cast<std::size_t>(dim)];
  for (std::int64_t o = 0; o < outer; ++o)
    for (const auto& r : ranges)
      for (std::int64_t t = r.begin; t < r.end; ++t)
        for (std::int64_t i = 0; i < inner; ++i) out.push_back(global[static_cast<std::size_t>((o * seqlen + t) * inner + i)]);
  return out;
}

double max_abs_difference(const Tensor& a, const Tensor& b) {
  double e = 0.0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.get(i), y = b.get(i);
    if (std::isinf(x) && x == y) continue;  // lse −∞ on both sides
    e = std::max(e, abs_difference(x, y));
  }
  return e;
}

// The most representable values of a and b's half dtype (bf16, f16) between two elements, at
// positions where they differ by more than `floor`: 0 where they are equal, 1 where adjacent.
std::int64_t max_steps_apart(const Tensor& a, const Tensor& b, double floor) {
  const auto ordered = [](std::uint16_t bits) {  // sign-magnitude bits as an ordered integer
    return (bits & 0x8000u) != 0 ? -static_cast<std::int64_t>(bits & 0x7FFFu) : static_cast<std::int64_t>(bits);
  };
  const auto* x = static_cast<const std::uint16_t*>(a.data());
  const auto* y = static_cast<const std::uint16_t*>(b.data());
  std::int64_t most = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i)
    if (std::fabs(a.get(i) - b.get(i)) > floor) most = std::max(most, std::abs(ordered(x[i]) - ordered(y[i])));
  return most;
}

double max_abs(const Tensor& t) {
  double m = 0.0;
  for (std::int64_t i = 0; i < t.numel(); ++i) m = std::fmax(m, std::fabs(t.get(i)));
  return m;
}

// The global inputs, the same on every rank.
struct Global {
  Tensor q, k, v, dout;
  AttentionOptions options;
};

Global make_global(const Case& c) {
  Inputs in = c.inputs();
  return {std::move(in.q), std::move(in.k), std::move(in.v), std::move(in.dout), c.options()};
}

// This rank's shards of the global inputs (dist::shard_ranges) and an out and lse to fill.
struct RankShards {
  std::vector<dist::TokenRange> ranges;
  Tensor q, k, v, dout, out, lse;
  RankShards(const Global& g, const AttentionProblem& p, ShardLayout layout)
      : ranges(dist::shard_ranges(p.seqlen_q, world_size(), world_rank(), layout)), q(shard_of(g.q, ranges, 1)),
        k(shard_of(g.k, ranges, 1)), v(shard_of(g.v, ranges, 1)), dout(shard_of(g.dout, ranges, 1)),
        out(p.dtype, dout.shape()), lse(DType::f32, {p.batch, p.heads_q, q.shape()[1]}) {}
};

RingOptions ring_options(const Case& c, ShardLayout layout) {
  RingOptions ring;
  ring.seqlen = c.problem().seqlen_q;
  ring.layout = layout;
  ring.timeout_seconds = kTestTimeoutSeconds;
  return ring;
}

// Whether the kernels keep P in float32 for a case's inputs: then the ring and one process
// differ only by the merge's rounding. tiled_bf16 (bf16 inputs on AVX512-BF16 CPUs without
// AMX, e.g. Zen 4) rounds P to bf16 relative to each tile's running maximum, which a shard
// starting afresh reaches differently: both stay within the reference's rule, not within a
// step of each other.
bool float32_products(const AttentionProblem& p, const AttentionOptions& options) {
  return p.dtype != DType::bf16 ||
         (options.kernel == ForwardKernel::tiled && options.backward_kernel == BackwardKernel::tiled);
}

// Forward: out and lse of the ring equal single-process flashattn's rows within the merge's
// rounding where float32_products, and the float64 reference's within the project's rule
// (f32 1e-5; otherwise expect_within_yardstick, on this rank's rows). The merge's rounding:
// the ring's partial outputs stay float32 and both final outputs are rounded to the dtype once
// (u·max|v| together), plus the float32 floor 1e-5 of reordered accumulation — so bf16/f16
// elements are equal or adjacent, where they differ by more than that floor.
void check_ring_forward(const Case& c, ShardLayout layout) {
  SCOPED_TRACE(ring_trace(c, layout));
  const Global g = make_global(c);
  const AttentionProblem& p = c.problem();
  const auto ranges = dist::shard_ranges(p.seqlen_q, world_size(), world_rank(), layout);
  const Tensor q = shard_of(g.q, ranges, 1), k = shard_of(g.k, ranges, 1), v = shard_of(g.v, ranges, 1);
  const std::int64_t sl = q.shape()[1];
  Tensor out(p.dtype, {p.batch, sl, p.heads_q, p.head_dim_v}), lse(DType::f32, {p.batch, p.heads_q, sl});
  const dist::RingStats stats = dist::ring_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), g.options,
                                                   ring_options(c, layout));
  EXPECT_EQ(stats.steps, world_size());

  const ForwardResult single = forward(g.q.view(), g.k.view(), g.v.view(), g.options);
  if (float32_products(p, g.options)) {
    const double merge_rounding = 2.0 * unit_roundoff(p.dtype) * max_abs(g.v) + 1e-5;
    EXPECT_LE(max_abs_difference(out, shard_of(single.out, ranges, 1)), merge_rounding);
    if (p.dtype != DType::f32) EXPECT_LE(max_steps_apart(out, shard_of(single.out, ranges, 1), 1e-5), 1);
    EXPECT_LE(max_abs_difference(lse, shard_of(single.lse, ranges, 2)), 1e-5);
  }

  const reference::Result want = reference::attention(g.q.view(), g.k.view(), g.v.view(), g.options);
  const std::vector<double> want_out = shard_of(want.out, single.out.shape(), ranges, 1);
  if (p.dtype == DType::f32) {
    EXPECT_LE(max_abs_error(out, want_out), kFloat32OutTolerance);
  } else {
    const std::vector<double> yardstick = rounded_where_the_kernel_rounds(p, g.options, g.q, g.k, g.v);
    expect_within_yardstick(out, want_out, shard_of(yardstick, single.out.shape(), ranges, 1), p.dtype);
  }
  expect_lse_near(lse, shard_of(want.lse, single.lse.shape(), ranges, 2));
}

// Backward with the ring's own out and lse: dq, dk, dv equal single-process flashattn's rows
// and the float64 reference's within the project's rule for gradients (gradient_rule: f32
// 1e-4; otherwise 3× the naive same-precision error plus 1e-4).
void check_ring_backward(const Case& c, ShardLayout layout) {
  SCOPED_TRACE(ring_trace(c, layout));
  const Global g = make_global(c);
  const AttentionProblem& p = c.problem();
  const auto ranges = dist::shard_ranges(p.seqlen_q, world_size(), world_rank(), layout);
  const Tensor q = shard_of(g.q, ranges, 1), k = shard_of(g.k, ranges, 1), v = shard_of(g.v, ranges, 1);
  const Tensor dout = shard_of(g.dout, ranges, 1);
  const std::int64_t sl = q.shape()[1];
  Tensor out(p.dtype, {p.batch, sl, p.heads_q, p.head_dim_v}), lse(DType::f32, {p.batch, p.heads_q, sl});
  const RingOptions ring = ring_options(c, layout);
  dist::ring_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), g.options, ring);
  Tensor dq(p.dtype, q.shape()), dk(p.dtype, k.shape()), dv(p.dtype, v.shape());
  dist::ring_backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(), dk.view(), dv.view(),
                      g.options, ring);

  const ForwardResult fwd = forward(g.q.view(), g.k.view(), g.v.view(), g.options);
  const BackwardResult single =
      backward(g.dout.view(), g.q.view(), g.k.view(), g.v.view(), fwd.out.view(), fwd.lse.view(), g.options);
  const reference::Gradients want =
      reference::attention_backward(g.dout.view(), g.q.view(), g.k.view(), g.v.view(), g.options);
  NaiveGradients naive;
  if (judged_by_yardstick(p.dtype, p.exp2)) naive = naive_backward_same_precision(p, g.options, g.dout, g.q, g.k, g.v);
  const GradientRule rule_q = gradient_rule(p.dtype, p.exp2, naive.dq, want.dq);
  const GradientRule rule_k = gradient_rule(p.dtype, p.exp2, naive.dk, want.dk);
  const GradientRule rule_v = gradient_rule(p.dtype, p.exp2, naive.dv, want.dv);
  for (const GradientRule* rule : {&rule_q, &rule_k, &rule_v}) EXPECT_EQ(rule->unsound, "");
  const double tol_q = rule_q.tolerance, tol_k = rule_k.tolerance, tol_v = rule_v.tolerance;
  EXPECT_LE(max_abs_error(dq, shard_of(want.dq, g.q.shape(), ranges, 1)), tol_q);
  EXPECT_LE(max_abs_error(dk, shard_of(want.dk, g.k.shape(), ranges, 1)), tol_k);
  EXPECT_LE(max_abs_error(dv, shard_of(want.dv, g.v.shape(), ranges, 1)), tol_v);
  // Against single-process flashattn: both within the rule of the reference, so within the
  // sum of the two tolerances of each other; f32 within the float32 floor.
  const double single_q = max_abs_error(single.dq, want.dq), single_k = max_abs_error(single.dk, want.dk);
  const double single_v = max_abs_error(single.dv, want.dv);
  EXPECT_LE(max_abs_difference(dq, shard_of(single.dq, ranges, 1)), tol_q + single_q);
  EXPECT_LE(max_abs_difference(dk, shard_of(single.dk, ranges, 1)), tol_k + single_k);
  EXPECT_LE(max_abs_difference(dv, shard_of(single.dv, ranges, 1)), tol_v + single_v);
  // Both sum float32 shares and round once: bf16/f16 elements equal or adjacent, where they
  // differ by more than the float32 floor 1e-4 of reordered accumulation (float32_products).
  if (p.dtype != DType::f32 && float32_products(p, g.options)) {
    EXPECT_LE(max_steps_apart(dq, shard_of(single.dq, ranges, 1), 1e-4), 1);
    EXPECT_LE(max_steps_apart(dk, shard_of(single.dk, ranges, 1), 1e-4), 1);
    EXPECT_LE(max_steps_apart(dv, shard_of(single.dv, ranges, 1), 1e-4), 1);
  }
}

// Sequence lengths: not divisible by 2P for P = 2, 3, 4 (uneven shards), and shorter than
// 2P = 8 (empty chunks on some ranks).
TEST(Ring, ForwardNonCausalContiguousGqa) {
  check_ring_forward(ring_case(2, 37, 4, 2, 16, 24, false, DType::f32, 10), ShardLayout::contiguous);
}
TEST(Ring, ForwardNonCausalZigzag) {
  check_ring_forward(ring_case(1, 41, 2, 2, 32, 32, false, DType::f32, 11), ShardLayout::zigzag);
}
TEST(Ring, ForwardCausalZigzagMqa) {
  check_ring_forward(ring_case(1, 53, 4, 1, 32, 32, true, DType::f32, 12), ShardLayout::zigzag);
}
TEST(Ring, ForwardCausalContiguous) {
  check_ring_forward(ring_case(2, 29, 2, 1, 8, 8, true, DType::f32, 13), ShardLayout::contiguous);
}
TEST(Ring, ForwardCausalSoftcap) {
  check_ring_forward(ring_case(1, 47, 2, 2, 16, 16, true, DType::f32, 14, 5.0f), ShardLayout::zigzag);
}
// bf16 with the kernels the planner takes (tiled_bf16 where VDPBF16PS is fast) and with the
// float32 products named, where the ring equals one process within a step.
TEST(Ring, ForwardBf16Causal) {
  check_ring_forward(ring_case(1, 66, 4, 2, 64, 64, true, DType::bf16, 15), ShardLayout::zigzag);
  check_ring_forward(ring_case(1, 66, 4, 2, 64, 64, true, DType::bf16, 15, 0.0f, true), ShardLayout::zigzag);
}
TEST(Ring, ForwardF16NonCausal) {
  check_ring_forward(ring_case(1, 35, 2, 1, 40, 24, false, DType::f16, 16), ShardLayout::contiguous);
}
TEST(Ring, ForwardShorterThanTheRing) {
  check_ring_forward(ring_case(1, 5, 2, 1, 8, 8, true, DType::f32, 17), ShardLayout::zigzag);
  check_ring_forward(ring_case(1, 3, 2, 1, 8, 8, false, DType::f32, 18), ShardLayout::contiguous);
  check_ring_forward(ring_case(1, 0, 2, 1, 8, 8, true, DType::f32, 19), ShardLayout::zigzag);
}

// The case's inputs with every query and key element 1: every score head_dim·scale.
Global equal_scores(const Case& c, float scale) {
  Global g = make_global(c);
  for (Tensor* t : {&g.q, &g.k})
    for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, 1.0f);
  g.options.softmax_scale = scale;
  return g;
}

// Every query and key the same and scores near 1e29: each row's softmax is uniform over the
// global keys, so out is the mean of every value. A float32 lse rounds m + log ℓ to m there
// and a merge through lses weighed the ranks' shards (of different lengths) alike; the steps
// hand the merge their states (max and ℓ) apart.
TEST(Ring, HugeScoresWeighTheShardsByTheirKeys) {
  const Case c = ring_case(1, 37, 2, 1, 8, 8, false, DType::f32, 27);
  const AttentionProblem& p = c.problem();
  for (const ShardLayout layout : {ShardLayout::contiguous, ShardLayout::zigzag}) {
    SCOPED_TRACE(ring_trace(c, layout));
    const Global g = equal_scores(c, 1e28f);  // q·k = 8: every score 8e28
    RankShards shards(g, p, layout);
    dist::ring_forward(shards.q.view(), shards.k.view(), shards.v.view(), shards.out.view(), shards.lse.view(),
                       g.options, ring_options(c, layout));
    for (std::int64_t col = 0; col < p.head_dim_v; ++col) {
      double mean = 0.0;
      for (std::int64_t j = 0; j < p.seqlen_k; ++j) mean += g.v.get(j * p.head_dim_v + col);
      mean /= static_cast<double>(p.seqlen_k);
      for (std::int64_t i = 0; i < shards.q.shape()[1]; ++i)
        for (std::int64_t h = 0; h < p.heads_q; ++h)
          ASSERT_NEAR(shards.out.get((i * p.heads_q + h) * p.head_dim_v + col), mean, kFloat32OutTolerance)
              << "row " << i << " head " << h << " column " << col;
    }
  }
}

// Rows whose |lse| ≥ 710 (every score 1024 here: q = k = ones, head_dim 16, scale 64): the
// backward recomputes such a row's normaliser from the keys it is given only where that agrees
// with the given lse, and each shard holds a part of the keys — so the ring's shares take
// the global lse as given (they were normalised per shard, dv P times too large). Exact to
// that lse's float32 rounding: P within η = ln 2 · 2^-21 · |lse·log2e| relative (four ulps
// of lse·log2e), the gradients within η of their largest magnitude beyond the float32 floor.
TEST(Ring, BackwardHugeScoresTakeTheGlobalLse) {
  for (const bool causal : {false, true}) {
    const Case c = ring_case(1, 37, 2, 1, 16, 16, causal, DType::f32, 28);
    const AttentionProblem& p = c.problem();
    for (const ShardLayout layout : {ShardLayout::contiguous, ShardLayout::zigzag}) {
      SCOPED_TRACE(ring_trace(c, layout));
      const Global g = equal_scores(c, 64.0f);
      RankShards shards(g, p, layout);
      const RingOptions ring = ring_options(c, layout);
      dist::ring_forward(shards.q.view(), shards.k.view(), shards.v.view(), shards.out.view(), shards.lse.view(),
                         g.options, ring);
      Tensor dq(p.dtype, shards.q.shape()), dk(p.dtype, shards.k.shape()), dv(p.dtype, shards.v.shape());
      dist::ring_backward(shards.dout.view(), shards.q.view(), shards.k.view(), shards.v.view(), shards.out.view(),
                          shards.lse.view(), dq.view(), dk.view(), dv.view(), g.options, ring);
      const reference::Gradients want =
          reference::attention_backward(g.dout.view(), g.q.view(), g.k.view(), g.v.view(), g.options);
      const double eta = std::log(2.0) * 0x1p-21 * max_abs(shards.lse) * OnlineSoftmaxState::kLog2e;
      ASSERT_GT(max_abs(shards.lse) * OnlineSoftmaxState::kLog2e, 1024.0) << "the rows are large";
      const auto bound = [&](const std::vector<double>& grad) {
        double most = 0.0;
        for (const double x : grad) most = std::max(most, std::fabs(x));
        return kGradientFloor + eta * most;
      };
      EXPECT_LE(max_abs_error(dq, shard_of(want.dq, g.q.shape(), shards.ranges, 1)), bound(want.dq)) << "dq";
      EXPECT_LE(max_abs_error(dk, shard_of(want.dk, g.k.shape(), shards.ranges, 1)), bound(want.dk)) << "dk";
      EXPECT_LE(max_abs_error(dv, shard_of(want.dv, g.v.shape(), shards.ranges, 1)), bound(want.dv)) << "dv";
    }
  }
}

TEST(Ring, BackwardNonCausalGqa) {
  check_ring_backward(ring_case(2, 37, 4, 2, 16, 24, false, DType::f32, 20), ShardLayout::contiguous);
}
TEST(Ring, BackwardCausalZigzag) {
  check_ring_backward(ring_case(1, 53, 4, 1, 32, 32, true, DType::f32, 21), ShardLayout::zigzag);
}
TEST(Ring, BackwardCausalContiguous) {
  check_ring_backward(ring_case(2, 29, 2, 1, 8, 8, true, DType::f32, 22), ShardLayout::contiguous);
}
TEST(Ring, BackwardCausalSoftcap) {
  check_ring_backward(ring_case(1, 31, 2, 2, 16, 16, true, DType::f32, 23, 5.0f), ShardLayout::zigzag);
}
TEST(Ring, BackwardBf16Causal) {
  check_ring_backward(ring_case(1, 45, 4, 2, 32, 32, true, DType::bf16, 24), ShardLayout::zigzag);
  check_ring_backward(ring_case(1, 45, 4, 2, 32, 32, true, DType::bf16, 24, 0.0f, true), ShardLayout::zigzag);
}
TEST(Ring, BackwardShorterThanTheRing) {
  check_ring_backward(ring_case(1, 5, 2, 1, 8, 8, true, DType::f32, 25), ShardLayout::zigzag);
  check_ring_backward(ring_case(1, 0, 2, 1, 8, 8, false, DType::f32, 26), ShardLayout::contiguous);
}

// options.deterministic: two runs give the same bits (the ring's summation order is fixed).
TEST(Ring, DeterministicBackwardIsBitIdentical) {
  const Case c = ring_case(1, 61, 2, 1, 16, 16, true, DType::f32, 30);
  const ShardLayout layout = ShardLayout::zigzag;
  const AttentionProblem& p = c.problem();
  Global g = make_global(c);
  g.options.deterministic = true;
  g.options.num_threads = 2;
  const auto ranges = dist::shard_ranges(p.seqlen_q, world_size(), world_rank(), layout);
  const Tensor q = shard_of(g.q, ranges, 1), k = shard_of(g.k, ranges, 1), v = shard_of(g.v, ranges, 1);
  const Tensor dout = shard_of(g.dout, ranges, 1);
  Tensor out(p.dtype, dout.shape()), lse(DType::f32, {p.batch, p.heads_q, q.shape()[1]});
  dist::ring_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), g.options, ring_options(c, layout));
  Tensor first[3] = {Tensor(p.dtype, q.shape()), Tensor(p.dtype, k.shape()), Tensor(p.dtype, v.shape())};
  Tensor second[3] = {Tensor(p.dtype, q.shape()), Tensor(p.dtype, k.shape()), Tensor(p.dtype, v.shape())};
  for (Tensor* grads : {first, second})
    dist::ring_backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), grads[0].view(),
                        grads[1].view(), grads[2].view(), g.options, ring_options(c, layout));
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(std::memcmp(first[i].data(), second[i].data(), static_cast<std::size_t>(first[i].numel()) * sizeof(float)), 0)
        << "gradient " << i;
}

// Bytes on the wire: P − 1 K/V shards forward; backward also P dK/dV accumulators (float32).
TEST(Ring, BytesSentAreTheShardsThatTravel) {
  const Case c = ring_case(1, 50, 2, 1, 8, 12, true, DType::bf16, 40);
  const ShardLayout layout = ShardLayout::zigzag;
  const AttentionProblem& p = c.problem();
  const Global g = make_global(c);
  const int ranks = world_size(), me = world_rank();
  const auto ranges = dist::shard_ranges(p.seqlen_q, ranks, me, layout);
  const Tensor q = shard_of(g.q, ranges, 1), k = shard_of(g.k, ranges, 1), v = shard_of(g.v, ranges, 1);
  const Tensor dout = shard_of(g.dout, ranges, 1);
  Tensor out(p.dtype, dout.shape()), lse(DType::f32, {p.batch, p.heads_q, q.shape()[1]});
  const dist::RingStats fwd =
      dist::ring_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), g.options, ring_options(c, layout));
  Tensor dq(p.dtype, q.shape()), dk(p.dtype, k.shape()), dv(p.dtype, v.shape());
  const dist::RingStats bwd = dist::ring_backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(),
                                                  dq.view(), dk.view(), dv.view(), g.options, ring_options(c, layout));
  std::int64_t kv_bytes = 0, grad_bytes = 0;
  for (int step = 0; step < ranks; ++step) {
    const std::int64_t tokens = dist::shard_length(p.seqlen_q, ranks, (me - step + ranks) % ranks, layout);
    if (step + 1 < ranks) kv_bytes += tokens * p.heads_kv * (p.head_dim + p.head_dim_v) * 2;  // bf16
    if (ranks > 1) grad_bytes += tokens * p.heads_kv * (p.head_dim + p.head_dim_v) * 4;      // float32
  }
  EXPECT_EQ(fwd.bytes_sent, kv_bytes);
  EXPECT_EQ(bwd.bytes_sent, kv_bytes + grad_bytes);
  EXPECT_GE(fwd.seconds, fwd.compute_seconds);
}

TEST(Ring, ShardsCoverTheSequenceOnce) {
  for (const ShardLayout layout : {ShardLayout::contiguous, ShardLayout::zigzag})
    for (const std::int64_t seqlen : {0, 1, 7, 8, 9, 100, 101})
      for (int ranks = 1; ranks <= 5; ++ranks) {
        std::vector<int> owner(static_cast<std::size_t>(seqlen), -1);
        std::int64_t smallest = seqlen, largest = 0;
        for (int r = 0; r < ranks; ++r) {
          const auto ranges = dist::shard_ranges(seqlen, ranks, r, layout);
          ASSERT_EQ(ranges.size(), layout == ShardLayout::zigzag ? 2u : 1u);
          for (const auto& range : ranges)
            for (std::int64_t t = range.begin; t < range.end; ++t) {
              ASSERT_EQ(owner[static_cast<std::size_t>(t)], -1) << "token " << t << " held twice";
              owner[static_cast<std::size_t>(t)] = r;
            }
          if (layout == ShardLayout::zigzag) {  // chunks r and 2P − 1 − r, ascending
            EXPECT_LE(ranges[0].end, ranges[1].begin);
          }
          const std::int64_t n = dist::shard_length(seqlen, ranks, r, layout);
          smallest = std::min(smallest, n);
          largest = std::max(largest, n);
        }
        for (std::int64_t t = 0; t < seqlen; ++t) EXPECT_NE(owner[static_cast<std::size_t>(t)], -1) << "token " << t;
        EXPECT_LE(largest - smallest, layout == ShardLayout::zigzag ? 2 : 1);
      }
  EXPECT_THROW(dist::shard_ranges(10, 0, 0, ShardLayout::zigzag), Error);
  EXPECT_THROW(dist::shard_ranges(10, 2, 2, ShardLayout::zigzag), Error);
  EXPECT_THROW(dist::shard_ranges(-1, 2, 0, ShardLayout::zigzag), Error);
}

// The zig-zag layout balances causal work: every rank's visible (query, key) pairs differ by
// at most the rounding of the chunk sizes, while contiguous shards give the last rank about
// 2P − 1 times the first's.
TEST(Ring, ZigzagBalancesCausalWork) {
  const std::int64_t seqlen = 1024;
  for (int ranks = 2; ranks <= 8; ++ranks) {
    std::vector<std::int64_t> zigzag, contiguous;
    for (const ShardLayout layout : {ShardLayout::zigzag, ShardLayout::contiguous})
      for (int r = 0; r < ranks; ++r) {
        std::int64_t pairs = 0;  // visible pairs: query t sees t + 1 keys
        for (const auto& range : dist::shard_ranges(seqlen, ranks, r, layout))
          for (std::int64_t t = range.begin; t < range.end; ++t) pairs += t + 1;
        (layout == ShardLayout::zigzag ? zigzag : contiguous).push_back(pairs);
      }
    const auto [zmin, zmax] = std::minmax_element(zigzag.begin(), zigzag.end());
    EXPECT_LE(static_cast<double>(*zmax - *zmin), 0.01 * static_cast<double>(*zmax)) << ranks << " ranks";
    EXPECT_GT(static_cast<double>(contiguous.back()), (2.0 * ranks - 2.0) * static_cast<double>(contiguous.front()))
        << ranks << " ranks";
  }
}

// Options the ring cannot express, and a rank whose arguments differ: every rank throws.
// Options that only the steps' kernels check — a kernel the dtype rules out (tiled_bf16 on
// float32, on every CPU), dsinks and dbias (the ring takes no sinks or masks) — are Errors on
// every rank before the ring turns, also on a rank whose causal shard is empty (S < P): it
// never calls a kernel, and a step that threw with the next transfers posted left them
// writing into freed buffers. A valid call afterwards runs as usual.
TEST(Ring, KernelOptionsAreErrorsOnEveryRankBeforeTheRingTurns) {
  const Case c = ring_case(1, 1, 2, 1, 8, 8, true, DType::f32, 52);
  const ShardLayout layout = ShardLayout::contiguous;
  const AttentionProblem& p = c.problem();
  const Global g = make_global(c);
  RankShards shards(g, p, layout);
  const Tensor &q = shards.q, &k = shards.k, &v = shards.v, &dout = shards.dout;
  Tensor &out = shards.out, &lse = shards.lse;
  Tensor dq(p.dtype, q.shape()), dk(p.dtype, k.shape()), dv(p.dtype, v.shape());
  Tensor dsinks(DType::f32, {p.heads_q}), dbias(DType::f32, {1, 1, p.seqlen_q, p.seqlen_k});
  AttentionOptions bf16_kernel = g.options, bf16_backward = g.options, with_dsinks = g.options, with_dbias = g.options;
  bf16_kernel.kernel = ForwardKernel::tiled_bf16;
  bf16_backward.backward_kernel = BackwardKernel::tiled_bf16;
  with_dsinks.dsinks = dsinks.view();
  with_dbias.dbias = dbias.view();
  const Tensor dlse(DType::f32, {p.batch, p.heads_q, p.seqlen_q});
  AttentionOptions with_dlse = g.options;
  with_dlse.dlse = dlse.view();
  const auto expect_error = [&](bool backward, const AttentionOptions& options, const std::string& needle) {
    SCOPED_TRACE((backward ? "ring_backward, " : "ring_forward, ") + needle);
    try {
      if (backward)
        dist::ring_backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(), dk.view(),
                            dv.view(), options, ring_options(c, layout));
      else
        dist::ring_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), options, ring_options(c, layout));
      ADD_FAILURE() << "no error, expected one naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(false, bf16_kernel, "tiled_bf16");
  expect_error(true, bf16_kernel, "tiled_bf16");
  expect_error(true, bf16_backward, "tiled_bf16");
  expect_error(true, with_dsinks, "dsinks");
  expect_error(true, with_dbias, "dbias");
  expect_error(true, with_dlse, "dlse");
  dist::ring_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), g.options, ring_options(c, layout));
  dist::ring_backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(), dk.view(), dv.view(),
                      g.options, ring_options(c, layout));
  const ForwardResult want = forward(g.q.view(), g.k.view(), g.v.view(), g.options);
  if (q.shape()[1] == 1)
    for (std::int64_t e = 0; e < out.numel(); ++e) EXPECT_NEAR(out.get(e), want.out.get(e), 1e-6) << e;
}

TEST(Ring, UnsupportedOptionsAreErrorsOnEveryRank) {
  const Case c = ring_case(1, 20, 2, 1, 8, 8, true, DType::f32, 50);
  const ShardLayout layout = ShardLayout::zigzag;
  const AttentionProblem& p = c.problem();
  const Global g = make_global(c);
  RankShards shards(g, p, layout);
  const Tensor &q = shards.q, &k = shards.k, &v = shards.v, &dout = shards.dout;
  Tensor &out = shards.out, &lse = shards.lse;
  // Sentinels that every rejected call must leave as they are.
  constexpr float kUnwritten = 7.0f;
  for (Tensor* t : {&out, &lse})
    for (std::int64_t e = 0; e < t->numel(); ++e) t->set(e, kUnwritten);
  const auto unwritten = [&](const Tensor& t) {
    for (std::int64_t e = 0; e < t.numel(); ++e)
      if (t.get(e) != kUnwritten) return false;
    return true;
  };
  const auto expect_error = [&](const AttentionOptions& options, const RingOptions& ring, const std::string& needle) {
    try {
      dist::ring_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), options, ring);
      ADD_FAILURE() << "no error, expected one naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(unwritten(out) && unwritten(lse)) << "a call rejected for " << needle << " wrote out or lse";
  };
  AttentionOptions dropout = g.options;
  dropout.dropout_p = 0.1f;
  expect_error(dropout, ring_options(c, layout), "dropout_p");
  AttentionOptions window = g.options;
  window.window_size = {4, 0};
  expect_error(window, ring_options(c, layout), "window_size");
  const float slopes[2] = {0.5f, 0.25f};
  AttentionOptions alibi = g.options;
  alibi.alibi_slopes = TensorView(slopes, DType::f32, {2});
  expect_error(alibi, ring_options(c, layout), "alibi_slopes");
  AttentionOptions sinks = g.options;
  sinks.sinks = TensorView(slopes, DType::f32, {2});
  expect_error(sinks, ring_options(c, layout), "sinks are not supported by the ring");
  Tensor counts(DType::i32, {p.batch, p.heads_q, q.shape()[1]});
  AttentionOptions counted = g.options;
  counted.rescale_counts = counts.view();
  expect_error(counted, ring_options(c, layout), "rescale_counts");
  AttentionOptions top_left = g.options;
  top_left.causal_alignment = CausalAlignment::top_left;
  expect_error(top_left, ring_options(c, layout), "causal_alignment top_left is not supported by the ring");
  const FlexMods mods([](auto s, std::int64_t, std::int64_t, std::int64_t q_idx, std::int64_t kv_idx) {
    return s + 0.01f * static_cast<float>(q_idx - kv_idx);
  });
  AttentionOptions hooked = g.options;
  hooked.score_hook = mods.hook();
  expect_error(hooked, ring_options(c, layout), "score_hook is not supported by the ring");
  RingOptions bad_timeout = ring_options(c, layout);
  bad_timeout.timeout_seconds = 0.0;
  expect_error(g.options, bad_timeout, "timeout_seconds");
  if (world_size() > 1) {
    // Rank 1 alone claims another global length: its shard check fails, the others learn it.
    RingOptions mismatched = ring_options(c, layout);
    if (world_rank() == 1) mismatched.seqlen = p.seqlen_q + 2 * world_size();
    expect_error(g.options, mismatched, world_rank() == 1 ? "global seqlen" : "rank(s) 1 rejected");
    // Rank 1 alone passes a timeout that is not > 0: it names the field, the others name it
    // at once (they do not wait in the communicator's duplication for their whole timeout).
    RingOptions one_bad_timeout = ring_options(c, layout);
    if (world_rank() == 1) one_bad_timeout.timeout_seconds = -1.0;
    const auto before = std::chrono::steady_clock::now();
    expect_error(g.options, one_bad_timeout, world_rank() == 1 ? "timeout_seconds must be > 0" : "rank(s) 1 rejected");
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - before).count(),
              kTestTimeoutSeconds / 2);
    // Rank 0 alone asks for a different softmax scale: every rank names the field.
    AttentionOptions scaled = g.options;
    if (world_rank() == 0) scaled.softmax_scale = 0.5f;
    expect_error(scaled, ring_options(c, layout), "softmax_scale");
    // ... and the options that choose the arithmetic (each rank's numerics would differ).
    AttentionOptions exp2 = g.options, rescale = g.options, splits = g.options;
    if (world_rank() == 1) exp2.exp2 = Exp2Impl::poly3, rescale.rescale_threshold = 4.0f, splits.num_splits = 2;
    expect_error(exp2, ring_options(c, layout), "different exp2");
    expect_error(rescale, ring_options(c, layout), "different rescale_threshold");
    expect_error(splits, ring_options(c, layout), "different num_splits");
  }
  // Backward: the same options rejected by name, the gradients left unwritten ...
  Tensor dq(p.dtype, q.shape()), dk(p.dtype, k.shape()), dv(p.dtype, v.shape());
  for (Tensor* t : {&dq, &dk, &dv})
    for (std::int64_t e = 0; e < t->numel(); ++e) t->set(e, kUnwritten);
  for (const auto& [options, needle] : {std::pair{top_left, "causal_alignment top_left"}, std::pair{hooked, "score_hook"}}) {
    try {
      dist::ring_backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(), dk.view(),
                          dv.view(), options, ring_options(c, layout));
      ADD_FAILURE() << "no error, expected one naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("ring_backward: ") + needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(unwritten(dq) && unwritten(dk) && unwritten(dv)) << "a call rejected for " << needle << " wrote a gradient";
  }
  // Rank 1 alone calls ring_backward where the others call ring_forward: every rank names the
  // operation at once (their first exchanges look alike; they would wait out the timeout).
  if (world_size() > 1) {
    try {
      if (world_rank() == 1)
        dist::ring_backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(), dk.view(),
                            dv.view(), g.options, ring_options(c, layout));
      else
        dist::ring_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), g.options, ring_options(c, layout));
      ADD_FAILURE() << "no error for ring_forward and ring_backward mixed";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("the ranks pass different operation (ring_forward or ring_backward)"),
                std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(unwritten(out) && unwritten(lse) && unwritten(dq) && unwritten(dk) && unwritten(dv));
  }
  // ... and a gradient that aliases an input, on every rank.
  try {
    dist::ring_backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(),
                        MutableTensorView(const_cast<void*>(q.data()), p.dtype, {p.batch, q.shape()[1], p.heads_q, p.head_dim}),
                        dk.view(), dv.view(), g.options, ring_options(c, layout));
    ADD_FAILURE() << "no error for dq aliasing q";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dq: output memory overlaps input q"), std::string::npos) << e.what();
  }
  // Wrong output shape on one rank.
  Tensor short_out(p.dtype, {p.batch, q.shape()[1] + (world_rank() == 0 ? 1 : 0), p.heads_q, p.head_dim_v});
  try {
    dist::ring_forward(q.view(), k.view(), v.view(), short_out.view(), lse.view(), g.options, ring_options(c, layout));
    ADD_FAILURE() << "no error for a wrong out shape on rank 0";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(world_rank() == 0 ? "out" : "rank(s) 0 rejected"), std::string::npos)
        << e.what();
  }
}

// The ring's transfers cancel what is still posted when a step throws before they are waited
// for: a message that arrives afterwards is not taken by the abandoned receive (whose buffer
// the unwinding would free), and the next receive of the same kind gets it.
TEST(Ring, TransfersAbandonedByAnExceptionAreCancelled) {
  RingOptions ring;
  ring.comm = MPI_COMM_WORLD;
  ring.timeout_seconds = 10.0;
  dist::detail::RingComm comm(ring, "transfers test");
  constexpr std::size_t kBytes = 64;
  constexpr unsigned char kUnwritten = 0xA5;
  std::vector<unsigned char> abandoned(kBytes, kUnwritten), later(kBytes, kUnwritten), sent(kBytes);
  for (std::size_t i = 0; i < kBytes; ++i) sent[i] = static_cast<unsigned char>(comm.rank() * 7 + i);
  try {
    dist::detail::Transfers receive("a receive abandoned by a step that throws");
    comm.receive(receive, abandoned.data(), kBytes, dist::detail::Payload::k);
    throw Error("a step failed");
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "a step failed");
  }
  MPI_Barrier(MPI_COMM_WORLD);  // every receive cancelled before any rank sends
  dist::detail::Transfers send("the send"), receive("the receive after the cancelled one");
  comm.send(send, sent.data(), kBytes, dist::detail::Payload::k);
  comm.receive(receive, later.data(), kBytes, dist::detail::Payload::k);
  comm.wait(send);
  comm.wait(receive);
  const int prev = (comm.rank() + comm.size() - 1) % comm.size();
  for (std::size_t i = 0; i < kBytes; ++i) {
    EXPECT_EQ(abandoned[i], kUnwritten) << "the abandoned receive's buffer was written, byte " << i;
    EXPECT_EQ(later[i], static_cast<unsigned char>(prev * 7 + i)) << "byte " << i;
  }
}

}  // namespace
}  // namespace flashattn::test

namespace {

// The report of ranks other than 0: their failed assertions only, each naming the rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed())
      std::printf("rank %d: %s:%d: Failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                  result.line_number(), result.message());
  }

 private:
  int rank_;
};

}  // namespace

// MPI around GoogleTest: every rank runs every test in the same order (the ring calls are
// collective); rank 0 prints the full report, the others only their failures.
int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  int failed = RUN_ALL_TESTS();
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return failed;
}
