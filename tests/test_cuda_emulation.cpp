// The CUDA kernels' bodies (src/cuda/forward_body.hpp, backward_body.hpp) run on the CPU
// through the warp emulation (src/cuda/emulation.hpp): the same tile constants, the same
// iteration order, masks, fragment maps, swizzle and cp.async groups, checked against the
// float64 reference over hundreds of random shapes — index, mask and ragged-edge bugs show
// here without a GPU. Tolerances are upstream's rule: 2× (outputs) and 3× (gradients) the
// error of a naive implementation in the same precision.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <sstream>

#include "flashattn/cuda_plan.hpp"
#include "flashattn/flashattn.hpp"
#include "src/cuda/backward_body.hpp"
#include "src/cuda/emulation.hpp"
#include "src/cuda/forward_body.hpp"
#include "tests/support/support.hpp"

namespace flashattn::cuda {
namespace {

using emulation::HostBlock;
using test::max_abs_error;
using test::random_tensor;

struct Case {
  std::int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  bool causal;
  DType dtype;
};

std::string describe(const Case& c) {
  std::ostringstream s;
  s << "B=" << c.batch << " Sq=" << c.seqlen_q << " Sk=" << c.seqlen_k << " Hq=" << c.heads_q << " Hkv=" << c.heads_kv
    << " D=" << c.head_dim << " causal=" << c.causal << " " << to_string(c.dtype);
  return s.str();
}

Case random_case(std::mt19937& rng, int max_head_dim) {
  Case c;
  // Small enough for hundreds of shapes in seconds, large enough for several tiles of each
  // kind, ragged ends and causal diagonals off the tile grid.
  c.batch = 1 + rng() % 2;
  c.heads_kv = 1 + rng() % 2;
  c.heads_q = c.heads_kv * (1 + rng() % 2);
  c.seqlen_q = 1 + rng() % 90;
  c.seqlen_k = 1 + rng() % 140;
  // any multiple of 8 up to the largest bucket: 16-byte rows, zero-padded to the bucket
  c.head_dim = 8 * (1 + static_cast<std::int64_t>(rng() % (max_head_dim / 8)));
  c.causal = rng() % 2;
  c.dtype = rng() % 2 ? DType::bf16 : DType::f16;
  return c;
}

Operand operand(const Tensor& t) {
  const TensorView v = t.view();
  return {v.data, v.strides[0], v.strides[1], v.strides[2]};
}
MutableOperand mutable_operand(Tensor& t) {
  const MutableTensorView v = t.view();
  return {v.data, v.strides[0], v.strides[1], v.strides[2]};
}

template <ForwardTile kTile, class E>
void emulate_forward(const ForwardParams& p, std::int64_t batch) {
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < p.heads_q; ++h)
      for (int m = 0; m * kTile.block_m < p.seqlen_q; ++m) {
        HostBlock block(kTile.warps, kTile.smem_bytes());
        forward_block<kTile, E>(block, p, m, h, b);
        ASSERT_TRUE(block.idle()) << "cp.async groups left pending";
      }
}

// The plan's bucket → the instantiation, as the device dispatch table does.
template <class E>
void emulate_forward_bucket(int bucket, const ForwardParams& p, std::int64_t batch) {
  switch (bucket) {
    case 0: return emulate_forward<kForwardTiles[0], E>(p, batch);
    case 1: return emulate_forward<kForwardTiles[1], E>(p, batch);
    default: return emulate_forward<kForwardTiles[2], E>(p, batch);
  }
}

// Forward through the emulated kernel; out is poisoned (NaN) first, so every element it
// must write is checked.
ForwardResult emulated_forward(const Case& c, const Tensor& q, const Tensor& k, const Tensor& v) {
  AttentionOptions options;
  options.causal = c.causal;
  const AttentionProblem problem = AttentionProblem::from_inputs(q.view(), k.view(), v.view(), options);
  const CudaForwardPlan plan = plan_cuda_forward(problem);
  ForwardResult r{Tensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim}), Tensor(DType::f32, {c.batch, c.heads_q, c.seqlen_q})};
  for (std::int64_t i = 0; i < r.out.numel(); ++i) r.out.set(i, NAN);
  for (std::int64_t i = 0; i < r.lse.numel(); ++i) r.lse.set(i, NAN);
  const ForwardParams p{operand(q), operand(k), operand(v), mutable_operand(r.out), r.lse.data_as<float>(),
                        c.heads_q * c.seqlen_q, c.seqlen_q, static_cast<int>(c.seqlen_q), static_cast<int>(c.seqlen_k),
                        static_cast<int>(c.heads_q), static_cast<int>(c.heads_kv), static_cast<int>(c.head_dim),
                        problem.softmax_scale * kLog2e, c.causal};
  if (c.dtype == DType::bf16) emulate_forward_bucket<Bf16>(plan.bucket, p, c.batch);
  else emulate_forward_bucket<F16>(plan.bucket, p, c.batch);
  return r;
}

void check_forward(const Case& c, std::uint64_t seed) {
  SCOPED_TRACE(describe(c) + " seed=" + std::to_string(seed));
  const Tensor q = random_tensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim}, seed);
  const Tensor k = random_tensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim}, seed + 1);
  const Tensor v = random_tensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim}, seed + 2);
  AttentionOptions options;
  options.causal = c.causal;
  const ForwardResult got = emulated_forward(c, q, k, v);
  const reference::Result want = reference::attention(q.view(), k.view(), v.view(), options);
  const AttentionProblem p = AttentionProblem::from_inputs(q.view(), k.view(), v.view(), options);
  const double tolerance = 2.0 * max_abs_error(test::naive_same_precision(p, options, q, k, v), want.out) + 1e-5;
  ASSERT_LE(max_abs_error(got.out, want.out), tolerance);
  for (std::int64_t i = 0; i < got.lse.numel(); ++i) {
    const double expected = want.lse[static_cast<std::size_t>(i)];
    if (std::isinf(expected)) ASSERT_EQ(got.lse.get(i), expected) << "lse " << i;
    else ASSERT_NEAR(got.lse.get(i), expected, 1e-4 * (1 + std::abs(expected))) << "lse " << i;
  }
}

TEST(CudaEmulation, ForwardRandomShapes) {
  std::mt19937 rng(2024);
  for (int trial = 0; trial < 150; ++trial) check_forward(random_case(rng, 256), 1000 + 3 * trial);
}

TEST(CudaEmulation, ForwardEdges) {
  std::uint64_t seed = 5000;
  for (const DType dtype : {DType::bf16, DType::f16}) {
    check_forward({1, 1, 1, 1, 1, 64, false, dtype}, seed++);
    check_forward({1, 129, 257, 2, 1, 128, true, dtype}, seed++);    // ragged past whole tiles
    check_forward({1, 200, 50, 2, 2, 64, true, dtype}, seed++);      // Sq > Sk: leading rows see nothing
    check_forward({2, 64, 64, 4, 1, 256, true, dtype}, seed++);      // MQA, whole tiles
    check_forward({1, 33, 500, 1, 1, 200, false, dtype}, seed++);    // D padded to 256
    check_forward({2, 33, 0, 2, 1, 64, true, dtype}, seed++);        // no keys: out 0, lse −∞
  }
}

// The passes of a backward call as backward.cu launches them (run_backward_passes): each
// grid's blocks one after the other, the per-row passes one row per (block, thread) as the
// device's threads take them. A launch with an empty grid is an error, as CUDA's
// cudaErrorInvalidConfiguration.
template <BackwardTile kTile, class E>
void emulate_backward(const BackwardParams& p, std::int64_t batch) {
  const auto to_float = [](std::uint16_t x) { return E::kIsBf16 ? bf16_to_float(x) : f16_to_float(x); };
  const auto from_float = [](float x) { return E::kIsBf16 ? float_to_bf16(x) : float_to_f16(x); };
  const std::int64_t n_blocks = (p.seqlen_k + kTile.block_n - 1) / kTile.block_n;
  run_backward_passes(backward_grids(p, batch, kTile.block_m, n_blocks), [&](BackwardPass pass, const Grid& grid) {
    if (grid.empty()) throw Error("emulated launch: a zero-size grid (cudaErrorInvalidConfiguration)");
    for (std::int64_t z = 0; z < grid.z; ++z)
      for (std::int64_t y = 0; y < grid.y; ++y)
        for (std::int64_t x = 0; x < grid.x; ++x) {
          const int b = static_cast<int>(z), h = static_cast<int>(y);
          if (pass == BackwardPass::blocks) {  // in K/V-tile order, as blocks start
            HostBlock block(kTile.warps, kTile.smem_bytes());
            backward_block<kTile, E>(block, p, static_cast<int>(x), h, b);
            ASSERT_TRUE(block.idle()) << "cp.async groups left pending";
            continue;
          }
          for (std::int64_t row = x * kRowThreads; row < (x + 1) * kRowThreads; ++row)
            if (pass == BackwardPass::prepare && row < padded_rows(p.seqlen_q, kTile.block_m))
              prepare_row(p, kTile.block_m, b, h, row, to_float);
            else if (pass == BackwardPass::convert && row < p.seqlen_q)
              convert_dq_row(p, kTile.block_m, b, h, row, from_float);
        }
  });
}

template <class E>
void emulate_backward_bucket(int bucket, const BackwardParams& p, std::int64_t batch) {
  if (bucket == 0) emulate_backward<kBackwardTiles[0], E>(p, batch);
  else emulate_backward<kBackwardTiles[1], E>(p, batch);
}

void check_backward(const Case& c, bool deterministic, std::uint64_t seed) {
  SCOPED_TRACE(describe(c) + " deterministic=" + std::to_string(deterministic) + " seed=" + std::to_string(seed));
  const Tensor q = random_tensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim}, seed);
  const Tensor k = random_tensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim}, seed + 1);
  const Tensor v = random_tensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim}, seed + 2);
  const Tensor dout = random_tensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim}, seed + 3);
  AttentionOptions options;
  options.causal = c.causal;
  const ForwardResult fwd = emulated_forward(c, q, k, v);
  const AttentionProblem problem = AttentionProblem::from_inputs(q.view(), k.view(), v.view(), options);
  const CudaBackwardPlan plan = plan_cuda_backward(problem, deterministic);
  Tensor dq(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim}), dk(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim}),
      dv(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim});
  for (Tensor* t : {&dq, &dk, &dv})
    for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, NAN);
  // The workspace as launch_backward lays it out.
  const std::int64_t rows = c.batch * c.heads_q * plan.m_blocks * plan.block_m;
  std::vector<float> stats(static_cast<std::size_t>(2 * rows), NAN);
  std::vector<float> accum(static_cast<std::size_t>(rows * plan.head_dim_padded), 0.0f);
  std::vector<int> turns(static_cast<std::size_t>(c.batch * c.heads_q * plan.m_blocks), 0);
  BackwardParams p{};
  p.q = operand(q);
  p.k = operand(k);
  p.v = operand(v);
  p.out = operand(fwd.out);
  p.dout = operand(dout);
  p.dq = mutable_operand(dq);
  p.dk = mutable_operand(dk);
  p.dv = mutable_operand(dv);
  p.lse = fwd.lse.data_as<float>();
  p.lse_batch_stride = c.heads_q * c.seqlen_q;
  p.lse_head_stride = c.seqlen_q;
  p.row_stats = stats.data();
  p.stats_rows = rows;
  p.dq_accum = accum.data();
  p.dq_turn = turns.data();
  p.head_dim_padded = plan.head_dim_padded;
  p.seqlen_q = static_cast<int>(c.seqlen_q);
  p.seqlen_k = static_cast<int>(c.seqlen_k);
  p.heads_q = static_cast<int>(c.heads_q);
  p.heads_kv = static_cast<int>(c.heads_kv);
  p.head_dim = static_cast<int>(c.head_dim);
  p.scale = problem.softmax_scale;
  p.scale_log2 = problem.softmax_scale * kLog2e;
  p.causal = c.causal;
  p.deterministic = deterministic;
  if (c.dtype == DType::bf16) emulate_backward_bucket<Bf16>(plan.bucket, p, c.batch);
  else emulate_backward_bucket<F16>(plan.bucket, p, c.batch);

  const reference::Gradients want = reference::attention_backward(dout.view(), q.view(), k.view(), v.view(), options);
  const test::NaiveGradients naive = test::naive_backward_same_precision(problem, options, dout, q, k, v);
  ASSERT_LE(max_abs_error(dq, want.dq), 3.0 * max_abs_error(naive.dq, want.dq) + 1e-4) << "dq";
  ASSERT_LE(max_abs_error(dk, want.dk), 3.0 * max_abs_error(naive.dk, want.dk) + 1e-4) << "dk";
  ASSERT_LE(max_abs_error(dv, want.dv), 3.0 * max_abs_error(naive.dv, want.dv) + 1e-4) << "dv";
}

TEST(CudaEmulation, BackwardRandomShapes) {
  std::mt19937 rng(4048);
  for (int trial = 0; trial < 60; ++trial) check_backward(random_case(rng, 128), trial % 3 == 0, 9000 + 4 * trial);
}

TEST(CudaEmulation, BackwardEdges) {
  std::uint64_t seed = 12000;
  for (const DType dtype : {DType::bf16, DType::f16}) {
    // No keys: dq must be written, zero (the reference's gradient of a row without keys);
    // no queries: dq is empty and dk, dv zero — no zero-size grid is launched.
    check_backward({1, 37, 0, 2, 1, 64, false, dtype}, false, seed += 4);
    check_backward({2, 37, 0, 2, 2, 128, true, dtype}, true, seed += 4);
    check_backward({1, 0, 53, 2, 1, 64, false, dtype}, false, seed += 4);
    check_backward({2, 0, 53, 4, 2, 128, true, dtype}, true, seed += 4);
    check_backward({1, 0, 0, 1, 1, 64, false, dtype}, false, seed += 4);
    check_backward({1, 1, 1, 1, 1, 64, false, dtype}, false, seed += 4);
    check_backward({1, 200, 50, 2, 2, 64, true, dtype}, true, seed += 4);   // rows without keys
    check_backward({1, 50, 200, 4, 1, 128, true, dtype}, false, seed += 4); // MQA, bottom-right causal
    check_backward({2, 65, 129, 2, 1, 72, false, dtype}, true, seed += 4);  // D padded to 128
  }
}

}  // namespace
}  // namespace flashattn::cuda
