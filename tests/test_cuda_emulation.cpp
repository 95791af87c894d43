// The CUDA kernels' bodies (src/cuda/forward_body.hpp, backward_body.hpp) run on the CPU
// through the warp emulation (src/cuda/emulation.hpp): the same tile constants, the same
// iteration order, masks, fragment maps, swizzle and cp.async groups, checked against the
// float64 reference over hundreds of random shapes — index, mask and ragged-edge bugs show
// here without a GPU. Tolerances are upstream's rule: 2× (outputs) and 3× (gradients) the
// error of a naive implementation in the same precision.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "flashattn/cuda_plan.hpp"
#include "flashattn/flashattn.hpp"
#include "src/cuda/backward_body.hpp"
#include "src/cuda/emulation.hpp"
#include "src/cuda/forward_body.hpp"
#include "tests/support/support.hpp"

namespace flashattn::cuda {
namespace {

using emulation::HostBlock;
using test::Case;
using test::Inputs;

// A case of the CUDA kernels: one head dim for q, k and v (the kernels' only layout).
Case cuda_case(std::int64_t batch, std::int64_t seqlen_q, std::int64_t seqlen_k, std::int64_t heads_q,
               std::int64_t heads_kv, std::int64_t head_dim, bool causal, DType dtype, std::uint64_t seed,
               bool deterministic = false) {
  AttentionOptions options;
  options.causal = causal;
  options.deterministic = deterministic;
  return Case({batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim}, dtype, options, seed);
}

Case random_case(std::mt19937& rng, int max_head_dim, std::uint64_t seed, bool deterministic = false) {
  // Small enough for hundreds of shapes in seconds, large enough for several tiles of each
  // kind, ragged ends and causal diagonals off the tile grid.
  const std::int64_t batch = 1 + rng() % 2;
  const std::int64_t heads_kv = 1 + rng() % 2;
  const std::int64_t heads_q = heads_kv * (1 + rng() % 2);
  const std::int64_t seqlen_q = 1 + rng() % 90;
  const std::int64_t seqlen_k = 1 + rng() % 140;
  // any multiple of 8 up to the largest bucket: 16-byte rows, zero-padded to the bucket
  const std::int64_t head_dim = 8 * (1 + static_cast<std::int64_t>(rng() % (max_head_dim / 8)));
  const bool causal = rng() % 2;
  const DType dtype = rng() % 2 ? DType::bf16 : DType::f16;
  return cuda_case(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, dtype, seed, deterministic);
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
ForwardResult emulated_forward(const Case& c, const Inputs& in) {
  const AttentionProblem& problem = c.problem();
  const CudaForwardPlan plan = plan_cuda_forward(problem);
  ForwardResult r{Tensor(problem.dtype, {problem.batch, problem.seqlen_q, problem.heads_q, problem.head_dim}),
                  Tensor(DType::f32, {problem.batch, problem.heads_q, problem.seqlen_q})};
  for (std::int64_t i = 0; i < r.out.numel(); ++i) r.out.set(i, NAN);
  for (std::int64_t i = 0; i < r.lse.numel(); ++i) r.lse.set(i, NAN);
  const ForwardParams p{operand(in.q), operand(in.k), operand(in.v), mutable_operand(r.out), r.lse.data_as<float>(),
                        problem.heads_q * problem.seqlen_q, problem.seqlen_q, static_cast<int>(problem.seqlen_q),
                        static_cast<int>(problem.seqlen_k), static_cast<int>(problem.heads_q),
                        static_cast<int>(problem.heads_kv), static_cast<int>(problem.head_dim),
                        problem.softmax_scale * kLog2e, problem.causal};
  if (problem.dtype == DType::bf16) emulate_forward_bucket<Bf16>(plan.bucket, p, problem.batch);
  else emulate_forward_bucket<F16>(plan.bucket, p, problem.batch);
  return r;
}

// Against the float64 reference by upstream's rule (test::check_forward).
void check_emulated_forward(const Case& c) { test::check_forward(c, emulated_forward); }

TEST(CudaEmulation, ForwardRandomShapes) {
  std::mt19937 rng(2024);
  for (int trial = 0; trial < 150; ++trial) check_emulated_forward(random_case(rng, 256, 1000 + 3 * trial));
}

TEST(CudaEmulation, ForwardEdges) {
  std::uint64_t seed = 5000;
  for (const DType dtype : {DType::bf16, DType::f16}) {
    check_emulated_forward(cuda_case(1, 1, 1, 1, 1, 64, false, dtype, seed++));
    check_emulated_forward(cuda_case(1, 129, 257, 2, 1, 128, true, dtype, seed++));  // ragged past whole tiles
    check_emulated_forward(cuda_case(1, 200, 50, 2, 2, 64, true, dtype, seed++));    // Sq > Sk: leading rows see nothing
    check_emulated_forward(cuda_case(2, 64, 64, 4, 1, 256, true, dtype, seed++));    // MQA, whole tiles
    check_emulated_forward(cuda_case(1, 33, 500, 1, 1, 200, false, dtype, seed++));  // D padded to 256
    check_emulated_forward(cuda_case(2, 33, 0, 2, 1, 64, true, dtype, seed++));      // no keys: out 0, lse −∞
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

// Backward through the emulated kernels, with the emulated forward's out and lse; dq, dk, dv
// are poisoned (NaN) first.
BackwardResult emulated_backward(const Case& c, const Inputs& in) {
  const AttentionProblem& problem = c.problem();
  const std::int64_t batch = problem.batch, seqlen_q = problem.seqlen_q, seqlen_k = problem.seqlen_k;
  const std::int64_t heads_q = problem.heads_q, heads_kv = problem.heads_kv, head_dim = problem.head_dim;
  const bool deterministic = c.options().deterministic;
  const ForwardResult fwd = emulated_forward(c, in);
  const CudaBackwardPlan plan = plan_cuda_backward(problem, deterministic);
  BackwardResult r{Tensor(problem.dtype, {batch, seqlen_q, heads_q, head_dim}),
                   Tensor(problem.dtype, {batch, seqlen_k, heads_kv, head_dim}),
                   Tensor(problem.dtype, {batch, seqlen_k, heads_kv, head_dim})};
  for (Tensor* t : {&r.dq, &r.dk, &r.dv})
    for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, NAN);
  // The workspace as launch_backward lays it out.
  const std::int64_t rows = batch * heads_q * plan.m_blocks * plan.block_m;
  std::vector<float> stats(static_cast<std::size_t>(2 * rows), NAN);
  std::vector<float> accum(static_cast<std::size_t>(rows * plan.head_dim_padded), 0.0f);
  std::vector<int> turns(static_cast<std::size_t>(batch * heads_q * plan.m_blocks), 0);
  BackwardParams p{};
  p.q = operand(in.q);
  p.k = operand(in.k);
  p.v = operand(in.v);
  p.out = operand(fwd.out);
  p.dout = operand(in.dout);
  p.dq = mutable_operand(r.dq);
  p.dk = mutable_operand(r.dk);
  p.dv = mutable_operand(r.dv);
  p.lse = fwd.lse.data_as<float>();
  p.lse_batch_stride = heads_q * seqlen_q;
  p.lse_head_stride = seqlen_q;
  p.row_stats = stats.data();
  p.stats_rows = rows;
  p.dq_accum = accum.data();
  p.dq_turn = turns.data();
  p.head_dim_padded = plan.head_dim_padded;
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_k = static_cast<int>(seqlen_k);
  p.heads_q = static_cast<int>(heads_q);
  p.heads_kv = static_cast<int>(heads_kv);
  p.head_dim = static_cast<int>(head_dim);
  p.scale = problem.softmax_scale;
  p.scale_log2 = problem.softmax_scale * kLog2e;
  p.causal = problem.causal;
  p.deterministic = deterministic;
  if (problem.dtype == DType::bf16) emulate_backward_bucket<Bf16>(plan.bucket, p, batch);
  else emulate_backward_bucket<F16>(plan.bucket, p, batch);
  return r;
}

// Against the float64 reference by upstream's rule for gradients (test::check_backward).
void check_emulated_backward(const Case& c) { test::check_backward(c, emulated_backward); }

TEST(CudaEmulation, BackwardRandomShapes) {
  std::mt19937 rng(4048);
  for (int trial = 0; trial < 60; ++trial)
    check_emulated_backward(random_case(rng, 128, 9000 + 4 * trial, trial % 3 == 0));
}

TEST(CudaEmulation, BackwardEdges) {
  std::uint64_t seed = 12000;
  for (const DType dtype : {DType::bf16, DType::f16}) {
    // No keys: dq must be written, zero (the reference's gradient of a row without keys);
    // no queries: dq is empty and dk, dv zero — no zero-size grid is launched.
    check_emulated_backward(cuda_case(1, 37, 0, 2, 1, 64, false, dtype, seed += 4, false));
    check_emulated_backward(cuda_case(2, 37, 0, 2, 2, 128, true, dtype, seed += 4, true));
    check_emulated_backward(cuda_case(1, 0, 53, 2, 1, 64, false, dtype, seed += 4, false));
    check_emulated_backward(cuda_case(2, 0, 53, 4, 2, 128, true, dtype, seed += 4, true));
    check_emulated_backward(cuda_case(1, 0, 0, 1, 1, 64, false, dtype, seed += 4, false));
    check_emulated_backward(cuda_case(1, 1, 1, 1, 1, 64, false, dtype, seed += 4, false));
    check_emulated_backward(cuda_case(1, 200, 50, 2, 2, 64, true, dtype, seed += 4, true));   // rows without keys
    check_emulated_backward(cuda_case(1, 50, 200, 4, 1, 128, true, dtype, seed += 4, false)); // MQA, bottom-right causal
    check_emulated_backward(cuda_case(2, 65, 129, 2, 1, 72, false, dtype, seed += 4, true));  // D padded to 128
  }
}

}  // namespace
}  // namespace flashattn::cuda
