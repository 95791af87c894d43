// AttentionOptions::plans_run: every entry point reports the plans it ran, which is what the
// CLI prints — including where the library plans differently from one plan_forward call
// (the sequences of a KV cache that share one parallel region).
#include <gtest/gtest.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

// A report that a call must replace (or, rejected, leave as it is).
PlansRun stale_report() {
  PlansRun plans;
  plans.forward.resize(3);
  plans.backward.resize(2);
  return plans;
}

TEST(PlansRun, ForwardAndBackwardReportThePlanTheyRan) {
  const Case c({1, 300, 300, 4, 2, 64, 64}, DType::f32, [] {
    AttentionOptions o;
    o.causal = true;
    o.num_threads = 2;
    return o;
  }());
  const Inputs in = c.inputs();
  PlansRun plans = stale_report();
  AttentionOptions options = c.options();
  options.plans_run = &plans;
  const ForwardResult f = forward(in.q.view(), in.k.view(), in.v.view(), options);
  ASSERT_EQ(plans.forward.size(), 1u);
  EXPECT_TRUE(plans.backward.empty());
  const CpuForwardPlan want = plan_forward(c.problem(), CpuHardware::detect(2), c.options());
  EXPECT_EQ(plans.forward[0].describe(), want.describe());
  EXPECT_EQ(plans.forward[0].work_items, want.work_items);

  backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), f.out.view(), f.lse.view(), options);
  EXPECT_TRUE(plans.forward.empty());
  ASSERT_EQ(plans.backward.size(), 1u);
  EXPECT_EQ(plans.backward[0].describe(), plan_backward(c.problem(), CpuHardware::detect(2), false).describe());
}

TEST(PlansRun, ARejectedCallLeavesTheReportAsItWas) {
  const Case c({1, 8, 8, 2, 2, 32, 32}, DType::f32);
  const Inputs in = c.inputs();
  Tensor out(DType::f32, {1, 8, 2, 31}), lse(DType::f32, {1, 2, 8});  // out's head_dim is wrong
  PlansRun plans = stale_report();
  AttentionOptions options;
  options.plans_run = &plans;
  EXPECT_THROW(forward(in.q.view(), in.k.view(), in.v.view(), out.view(), lse.view(), options), Error);
  EXPECT_EQ(plans.forward.size(), 3u);
  EXPECT_EQ(plans.backward.size(), 2u);
}

TEST(PlansRun, VarlenReportsOnePlanPerSequenceWithRows) {
  // Three sequences, the middle one without queries: two plans, in batch order, each the plan
  // the sequence runs alone (a batch's sequences are planned alone, one parallel region).
  const std::vector<std::int64_t> q_lens = {40, 0, 200}, k_lens = {60, 10, 200};
  auto offsets = [](const std::vector<std::int64_t>& lens) {
    Tensor cu(DType::i32, {static_cast<std::int64_t>(lens.size()) + 1});
    std::int64_t total = 0;
    for (std::size_t b = 0; b <= lens.size(); ++b) {
      cu.set(static_cast<std::int64_t>(b), static_cast<double>(total));
      if (b < lens.size()) total += lens[b];
    }
    return cu;
  };
  const Tensor cu_q = offsets(q_lens), cu_k = offsets(k_lens);
  const std::int64_t tq = 240, tk = 270;
  const Tensor q = support::random_tensor(DType::f32, {tq, 4, 32}, 1);
  const Tensor k = support::random_tensor(DType::f32, {tk, 2, 32}, 2);
  const Tensor v = support::random_tensor(DType::f32, {tk, 2, 32}, 3);
  PlansRun plans = stale_report();
  AttentionOptions options;
  options.num_threads = 2;
  options.plans_run = &plans;
  forward_varlen(q.view(), k.view(), v.view(), {cu_q.view(), cu_k.view(), 200, 200}, options);
  ASSERT_EQ(plans.forward.size(), 2u);
  const std::vector<CpuForwardPlan> batched = plans.forward;
  for (const auto& [index, q0, k0] : {std::tuple<std::size_t, std::int64_t, std::int64_t>{0, 0, 0}, {1, 40, 70}}) {
    const std::int64_t sq = q_lens[index * 2], sk = k_lens[index * 2];
    const Tensor one_q = offsets({sq}), one_k = offsets({sk});
    forward_varlen(TensorView(static_cast<const float*>(q.data()) + q0 * 4 * 32, DType::f32, {sq, 4, 32}),
                   TensorView(static_cast<const float*>(k.data()) + k0 * 2 * 32, DType::f32, {sk, 2, 32}),
                   TensorView(static_cast<const float*>(v.data()) + k0 * 2 * 32, DType::f32, {sk, 2, 32}),
                   {one_q.view(), one_k.view(), sq, sk}, options);
    ASSERT_EQ(plans.forward.size(), 1u);
    EXPECT_EQ(batched[index].describe(), plans.forward[0].describe()) << "sequence " << index * 2;
    EXPECT_EQ(batched[index].threads, std::min(2, static_cast<int>(batched[index].work_items)));
  }
}

// Decode rows of several sequences share one parallel region, so each splits its keys less
// than it would alone: the plans that ran are not plan_forward's of one sequence — what the
// CLI printed before it read the report.
TEST(PlansRun, KvCacheSequencesReportTheSharedRegionsSplits) {
  constexpr std::int64_t kBatch = 3, kCap = 2048, kHeads = 4, kHeadsKv = 2, kDim = 64;
  Tensor k_cache = support::random_tensor(DType::f32, {kBatch, kCap, kHeadsKv, kDim}, 4);
  Tensor v_cache = support::random_tensor(DType::f32, {kBatch, kCap, kHeadsKv, kDim}, 5);
  const Tensor q = support::random_tensor(DType::f32, {kBatch, 1, kHeads, kDim}, 6);
  KvCache cache;
  cache.k_cache = k_cache.view();
  cache.v_cache = v_cache.view();
  PlansRun plans = stale_report();
  AttentionOptions options;
  options.num_threads = 2;
  options.plans_run = &plans;
  forward_with_kvcache(q.view(), cache, options);
  ASSERT_EQ(plans.forward.size(), static_cast<std::size_t>(kBatch));
  const CpuHardware hw = CpuHardware::detect(2);
  const AttentionProblem one = AttentionProblem::from_sizes(1, 1, kCap, kHeads, kHeadsKv, kDim, kDim, DType::f32, options);
  const CpuForwardPlan alone = plan_forward(one, hw, options);
  ASSERT_TRUE(is_decode(alone.kernel));
  const std::int64_t tiles = (kCap + alone.block_k - 1) / alone.block_k;
  const std::int64_t shared_splits = std::min<std::int64_t>((2 * hw.threads + kBatch - 1) / kBatch, tiles);
  for (const CpuForwardPlan& plan : plans.forward) {
    EXPECT_TRUE(is_decode(plan.kernel)) << plan.describe();
    EXPECT_EQ(plan.splits, shared_splits) << plan.describe();
  }
  if (hw.threads > 1) EXPECT_NE(plans.forward[0].splits, alone.splits) << "alone: " << alone.describe();
}

}  // namespace
}  // namespace flashattn::test
