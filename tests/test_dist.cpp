// Ring attention under mpirun (CTest starts this binary with P = 1, 2, 3, 4 ranks). Every rank
// builds the same global inputs, runs the ring on its shard, and checks its rows against
// single-process flashattn on the whole sequence and against the float64 reference.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "flashattn/dist.hpp"
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

struct Case {
  std::int64_t batch, seqlen, heads_q, heads_kv, head_dim, head_dim_v;
  bool causal;
  DType dtype;
  ShardLayout layout;
  float softcap = 0.0f;
};

std::string describe(const Case& c) {
  std::ostringstream s;
  s << "B=" << c.batch << " S=" << c.seqlen << " Hq=" << c.heads_q << " Hkv=" << c.heads_kv << " D=" << c.head_dim
    << " Dv=" << c.head_dim_v << " causal=" << c.causal << " dtype=" << to_string(c.dtype)
    << " layout=" << (c.layout == ShardLayout::zigzag ? "zigzag" : "contiguous") << " softcap=" << c.softcap
    << " ranks=" << world_size() << " rank=" << world_rank();
  return s.str();
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

double max_abs(const Tensor& t) {
  double m = 0.0;
  for (std::int64_t i = 0; i < t.numel(); ++i) m = std::fmax(m, std::fabs(t.get(i)));
  return m;
}

struct Global {
  Tensor q, k, v, dout;
  AttentionOptions options;
};

Global make_global(const Case& c, std::uint64_t seed) {
  Global g{random_tensor(c.dtype, {c.batch, c.seqlen, c.heads_q, c.head_dim}, seed),
           random_tensor(c.dtype, {c.batch, c.seqlen, c.heads_kv, c.head_dim}, seed + 1),
           random_tensor(c.dtype, {c.batch, c.seqlen, c.heads_kv, c.head_dim_v}, seed + 2),
           random_tensor(c.dtype, {c.batch, c.seqlen, c.heads_q, c.head_dim_v}, seed + 3), {}};
  g.options.causal = c.causal;
  g.options.softcap = c.softcap;
  g.options.num_threads = 1;  // several ranks share this machine's cores
  return g;
}

RingOptions ring_options(const Case& c) {
  RingOptions ring;
  ring.seqlen = c.seqlen;
  ring.layout = c.layout;
  ring.timeout_seconds = kTestTimeoutSeconds;
  return ring;
}

// Forward: out and lse of the ring equal single-process flashattn's rows within the merge's
// rounding, and the float64 reference's within the project's rule (f32 1e-5; otherwise 2×
// the naive same-precision error plus 1e-5). The merge's rounding: each of the ring's
// partial outputs is rounded to the dtype once (at most u·max|v|, a partial being a convex
// combination of rows of v) and both final outputs once (u·max|v| together), plus the
// float32 floor 1e-5 of reordered accumulation.
void check_forward(const Case& c, std::uint64_t seed) {
  SCOPED_TRACE(describe(c));
  const Global g = make_global(c, seed);
  const auto ranges = dist::shard_ranges(c.seqlen, world_size(), world_rank(), c.layout);
  const Tensor q = shard_of(g.q, ranges, 1), k = shard_of(g.k, ranges, 1), v = shard_of(g.v, ranges, 1);
  const std::int64_t sl = q.shape()[1];
  Tensor out(c.dtype, {c.batch, sl, c.heads_q, c.head_dim_v}), lse(DType::f32, {c.batch, c.heads_q, sl});
  const dist::RingStats stats = dist::ring_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), g.options,
                                                   ring_options(c));
  EXPECT_EQ(stats.steps, world_size());

  const ForwardResult single = forward(g.q.view(), g.k.view(), g.v.view(), g.options);
  const double merge_rounding = 2.0 * unit_roundoff(c.dtype) * max_abs(g.v) + 1e-5;
  EXPECT_LE(max_abs_difference(out, shard_of(single.out, ranges, 1)), merge_rounding);
  EXPECT_LE(max_abs_difference(lse, shard_of(single.lse, ranges, 2)), 1e-5);

  const reference::Result want = reference::attention(g.q.view(), g.k.view(), g.v.view(), g.options);
  double tolerance = 1e-5;
  if (c.dtype != DType::f32) {
    const AttentionProblem p = AttentionProblem::from_inputs(g.q.view(), g.k.view(), g.v.view(), g.options);
    tolerance = 2.0 * max_abs_error(naive_same_precision(p, g.options, g.q, g.k, g.v), want.out) + 1e-5;
  }
  EXPECT_LE(max_abs_error(out, shard_of(want.out, single.out.shape(), ranges, 1)), tolerance);
  const std::vector<double> want_lse = shard_of(want.lse, single.lse.shape(), ranges, 2);
  for (std::int64_t i = 0; i < lse.numel(); ++i)
    ASSERT_NEAR(lse.get(i), want_lse[static_cast<std::size_t>(i)], 1e-5 + 1e-6 * std::fabs(want_lse[static_cast<std::size_t>(i)]))
        << "lse index " << i;
}

// Backward with the ring's own out and lse: dq, dk, dv equal single-process flashattn's rows
// and the float64 reference's within the project's rule for gradients (f32 1e-4; otherwise
// 3× the naive same-precision error plus 1e-4).
void check_backward(const Case& c, std::uint64_t seed, bool deterministic = false) {
  SCOPED_TRACE(describe(c));
  Global g = make_global(c, seed);
  g.options.deterministic = deterministic;
  const auto ranges = dist::shard_ranges(c.seqlen, world_size(), world_rank(), c.layout);
  const Tensor q = shard_of(g.q, ranges, 1), k = shard_of(g.k, ranges, 1), v = shard_of(g.v, ranges, 1);
  const Tensor dout = shard_of(g.dout, ranges, 1);
  const std::int64_t sl = q.shape()[1];
  Tensor out(c.dtype, {c.batch, sl, c.heads_q, c.head_dim_v}), lse(DType::f32, {c.batch, c.heads_q, sl});
  const RingOptions ring = ring_options(c);
  dist::ring_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), g.options, ring);
  Tensor dq(c.dtype, q.shape()), dk(c.dtype, k.shape()), dv(c.dtype, v.shape());
  dist::ring_backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(), dk.view(), dv.view(),
                      g.options, ring);

  const ForwardResult fwd = forward(g.q.view(), g.k.view(), g.v.view(), g.options);
  const BackwardResult single =
      backward(g.dout.view(), g.q.view(), g.k.view(), g.v.view(), fwd.out.view(), fwd.lse.view(), g.options);
  const reference::Gradients want =
      reference::attention_backward(g.dout.view(), g.q.view(), g.k.view(), g.v.view(), g.options);
  double tol_q = 1e-4, tol_k = 1e-4, tol_v = 1e-4;
  if (c.dtype != DType::f32) {
    const AttentionProblem p = AttentionProblem::from_inputs(g.q.view(), g.k.view(), g.v.view(), g.options);
    const NaiveGradients naive = naive_backward_same_precision(p, g.options, g.dout, g.q, g.k, g.v);
    tol_q = 3.0 * max_abs_error(naive.dq, want.dq) + 1e-4;
    tol_k = 3.0 * max_abs_error(naive.dk, want.dk) + 1e-4;
    tol_v = 3.0 * max_abs_error(naive.dv, want.dv) + 1e-4;
  }
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
}

// Sequence lengths: not divisible by 2P for P = 2, 3, 4 (uneven shards), and shorter than
// 2P = 8 (empty chunks on some ranks).
TEST(Ring, ForwardNonCausalContiguousGqa) {
  check_forward({2, 37, 4, 2, 16, 24, false, DType::f32, ShardLayout::contiguous}, 10);
}
TEST(Ring, ForwardNonCausalZigzag) { check_forward({1, 41, 2, 2, 32, 32, false, DType::f32, ShardLayout::zigzag}, 11); }
TEST(Ring, ForwardCausalZigzagMqa) { check_forward({1, 53, 4, 1, 32, 32, true, DType::f32, ShardLayout::zigzag}, 12); }
TEST(Ring, ForwardCausalContiguous) {
  check_forward({2, 29, 2, 1, 8, 8, true, DType::f32, ShardLayout::contiguous}, 13);
}
TEST(Ring, ForwardCausalSoftcap) {
  check_forward({1, 47, 2, 2, 16, 16, true, DType::f32, ShardLayout::zigzag, 5.0f}, 14);
}
TEST(Ring, ForwardBf16Causal) { check_forward({1, 66, 4, 2, 64, 64, true, DType::bf16, ShardLayout::zigzag}, 15); }
TEST(Ring, ForwardF16NonCausal) {
  check_forward({1, 35, 2, 1, 40, 24, false, DType::f16, ShardLayout::contiguous}, 16);
}
TEST(Ring, ForwardShorterThanTheRing) {
  check_forward({1, 5, 2, 1, 8, 8, true, DType::f32, ShardLayout::zigzag}, 17);
  check_forward({1, 3, 2, 1, 8, 8, false, DType::f32, ShardLayout::contiguous}, 18);
  check_forward({1, 0, 2, 1, 8, 8, true, DType::f32, ShardLayout::zigzag}, 19);
}

TEST(Ring, BackwardNonCausalGqa) {
  check_backward({2, 37, 4, 2, 16, 24, false, DType::f32, ShardLayout::contiguous}, 20);
}
TEST(Ring, BackwardCausalZigzag) { check_backward({1, 53, 4, 1, 32, 32, true, DType::f32, ShardLayout::zigzag}, 21); }
TEST(Ring, BackwardCausalContiguous) {
  check_backward({2, 29, 2, 1, 8, 8, true, DType::f32, ShardLayout::contiguous}, 22);
}
TEST(Ring, BackwardCausalSoftcap) {
  check_backward({1, 31, 2, 2, 16, 16, true, DType::f32, ShardLayout::zigzag, 5.0f}, 23);
}
TEST(Ring, BackwardBf16Causal) { check_backward({1, 45, 4, 2, 32, 32, true, DType::bf16, ShardLayout::zigzag}, 24); }
TEST(Ring, BackwardShorterThanTheRing) {
  check_backward({1, 5, 2, 1, 8, 8, true, DType::f32, ShardLayout::zigzag}, 25);
  check_backward({1, 0, 2, 1, 8, 8, false, DType::f32, ShardLayout::contiguous}, 26);
}

// options.deterministic: two runs give the same bits (the ring's summation order is fixed).
TEST(Ring, DeterministicBackwardIsBitIdentical) {
  const Case c{1, 61, 2, 1, 16, 16, true, DType::f32, ShardLayout::zigzag};
  Global g = make_global(c, 30);
  g.options.deterministic = true;
  g.options.num_threads = 2;
  const auto ranges = dist::shard_ranges(c.seqlen, world_size(), world_rank(), c.layout);
  const Tensor q = shard_of(g.q, ranges, 1), k = shard_of(g.k, ranges, 1), v = shard_of(g.v, ranges, 1);
  const Tensor dout = shard_of(g.dout, ranges, 1);
  Tensor out(c.dtype, dout.shape()), lse(DType::f32, {c.batch, c.heads_q, q.shape()[1]});
  dist::ring_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), g.options, ring_options(c));
  Tensor first[3] = {Tensor(c.dtype, q.shape()), Tensor(c.dtype, k.shape()), Tensor(c.dtype, v.shape())};
  Tensor second[3] = {Tensor(c.dtype, q.shape()), Tensor(c.dtype, k.shape()), Tensor(c.dtype, v.shape())};
  for (Tensor* grads : {first, second})
    dist::ring_backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), grads[0].view(),
                        grads[1].view(), grads[2].view(), g.options, ring_options(c));
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(std::memcmp(first[i].data(), second[i].data(), static_cast<std::size_t>(first[i].numel()) * sizeof(float)), 0)
        << "gradient " << i;
}

// Bytes on the wire: P − 1 K/V shards forward; backward also P dK/dV accumulators (float32).
TEST(Ring, BytesSentAreTheShardsThatTravel) {
  const Case c{1, 50, 2, 1, 8, 12, true, DType::bf16, ShardLayout::zigzag};
  const Global g = make_global(c, 40);
  const int ranks = world_size(), me = world_rank();
  const auto ranges = dist::shard_ranges(c.seqlen, ranks, me, c.layout);
  const Tensor q = shard_of(g.q, ranges, 1), k = shard_of(g.k, ranges, 1), v = shard_of(g.v, ranges, 1);
  const Tensor dout = shard_of(g.dout, ranges, 1);
  Tensor out(c.dtype, dout.shape()), lse(DType::f32, {c.batch, c.heads_q, q.shape()[1]});
  const dist::RingStats fwd =
      dist::ring_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), g.options, ring_options(c));
  Tensor dq(c.dtype, q.shape()), dk(c.dtype, k.shape()), dv(c.dtype, v.shape());
  const dist::RingStats bwd = dist::ring_backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(),
                                                  dq.view(), dk.view(), dv.view(), g.options, ring_options(c));
  std::int64_t kv_bytes = 0, grad_bytes = 0;
  for (int step = 0; step < ranks; ++step) {
    const std::int64_t tokens = dist::shard_length(c.seqlen, ranks, (me - step + ranks) % ranks, c.layout);
    if (step + 1 < ranks) kv_bytes += tokens * c.heads_kv * (c.head_dim + c.head_dim_v) * 2;  // bf16
    if (ranks > 1) grad_bytes += tokens * c.heads_kv * (c.head_dim + c.head_dim_v) * 4;      // float32
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
TEST(Ring, UnsupportedOptionsAreErrorsOnEveryRank) {
  const Case c{1, 20, 2, 1, 8, 8, true, DType::f32, ShardLayout::zigzag};
  const Global g = make_global(c, 50);
  const auto ranges = dist::shard_ranges(c.seqlen, world_size(), world_rank(), c.layout);
  const Tensor q = shard_of(g.q, ranges, 1), k = shard_of(g.k, ranges, 1), v = shard_of(g.v, ranges, 1);
  Tensor out(c.dtype, q.shape()), lse(DType::f32, {c.batch, c.heads_q, q.shape()[1]});
  const auto expect_error = [&](const AttentionOptions& options, const RingOptions& ring, const std::string& needle) {
    try {
      dist::ring_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), options, ring);
      ADD_FAILURE() << "no error, expected one naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  AttentionOptions dropout = g.options;
  dropout.dropout_p = 0.1f;
  expect_error(dropout, ring_options(c), "dropout_p");
  AttentionOptions window = g.options;
  window.window_size = {4, 0};
  expect_error(window, ring_options(c), "window_size");
  const float slopes[2] = {0.5f, 0.25f};
  AttentionOptions alibi = g.options;
  alibi.alibi_slopes = TensorView(slopes, DType::f32, {2});
  expect_error(alibi, ring_options(c), "alibi_slopes");
  Tensor counts(DType::i32, {c.batch, c.heads_q, q.shape()[1]});
  AttentionOptions counted = g.options;
  counted.rescale_counts = counts.view();
  expect_error(counted, ring_options(c), "rescale_counts");
  RingOptions bad_timeout = ring_options(c);
  bad_timeout.timeout_seconds = 0.0;
  expect_error(g.options, bad_timeout, "timeout_seconds");
  if (world_size() > 1) {
    // Rank 1 alone claims another global length: its shard check fails, the others learn it.
    RingOptions mismatched = ring_options(c);
    if (world_rank() == 1) mismatched.seqlen = c.seqlen + 2 * world_size();
    expect_error(g.options, mismatched, world_rank() == 1 ? "global seqlen" : "rank(s) 1 rejected");
    // Rank 0 alone asks for a different softmax scale: every rank names the field.
    AttentionOptions scaled = g.options;
    if (world_rank() == 0) scaled.softmax_scale = 0.5f;
    expect_error(scaled, ring_options(c), "softmax_scale");
  }
  // Backward: a gradient that aliases an input, on every rank.
  Tensor dq(c.dtype, q.shape()), dk(c.dtype, k.shape()), dv(c.dtype, v.shape());
  const Tensor dout = shard_of(g.dout, ranges, 1);
  try {
    dist::ring_backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(),
                        MutableTensorView(const_cast<void*>(q.data()), c.dtype, {c.batch, q.shape()[1], c.heads_q, c.head_dim}),
                        dk.view(), dv.view(), g.options, ring_options(c));
    ADD_FAILURE() << "no error for dq aliasing q";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dq: output memory overlaps input q"), std::string::npos) << e.what();
  }
  // Wrong output shape on one rank.
  Tensor short_out(c.dtype, {c.batch, q.shape()[1] + (world_rank() == 0 ? 1 : 0), c.heads_q, c.head_dim_v});
  try {
    dist::ring_forward(q.view(), k.view(), v.view(), short_out.view(), lse.view(), g.options, ring_options(c));
    ADD_FAILURE() << "no error for a wrong out shape on rank 0";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(world_rank() == 0 ? "out" : "rank(s) 0 rejected"), std::string::npos)
        << e.what();
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
