// pack_gqa (AttentionOptions::pack_gqa): the tiled kernels stacking the rows of every q
// head of a kv head into one Q tile. Every row is computed by the same arithmetic in the
// same order as in a tile of its own head, so a packed call is bit-identical to an unpacked
// one without key splits, or with the same splits of the same Q tiles (a split's keys
// follow its Q tile's rows) — on every SIMD target, both tiled kernels, any thread count —
// and within the tolerance rule of the float64 reference; the planner's choice, and the
// variants that differ per q head refused by name before anything is written.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "flashattn/flex.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

// Sizes with few rows per q head (where packing pays) and ragged tails: a head's rows not a
// whole number of micro-tile strips, head dims off the vector width, groups of 2 to 8.
const Shape kShapes[] = {{2, 1, 300, 4, 2, 64, 64},  {1, 5, 700, 8, 2, 40, 24},   {2, 13, 257, 6, 2, 59, 37},
                         {1, 33, 130, 3, 1, 128, 128}, {1, 64, 400, 16, 2, 32, 32}, {1, 9, 1000, 8, 1, 96, 96}};

// The options each shape runs under: plain, causal, a window, soft-capping with sinks, and
// a Q tile of 8 rows a head (several Q tiles per head).
std::vector<std::pair<std::string, AttentionOptions>> variants(const Shape& shape, Tensor& sinks) {
  AttentionOptions causal;
  causal.causal = true;
  AttentionOptions window;
  window.window_size = {90, 7};
  AttentionOptions capped = causal;
  capped.softcap = 4.0f;
  sinks = random_tensor(DType::f32, {shape.heads_q}, 77);
  capped.sinks = sinks.view();
  AttentionOptions small_tiles = causal;
  small_tiles.block_q = 8;
  return {{"plain", {}}, {"causal", causal}, {"window", window}, {"softcap+sinks", capped}, {"block_q 8", small_tiles}};
}

// The packed and the unpacked call of `c` with `kernel`: bitwise equal; with `reference`, the
// packed one within the reference's tolerance too.
void check_packed(const Case& c, ForwardKernel kernel, bool reference) {
  const Inputs in = c.inputs();
  AttentionOptions packed = c.options(), unpacked = c.options();
  packed.kernel = unpacked.kernel = kernel;
  packed.pack_gqa = true;
  unpacked.pack_gqa = false;
  PlansRun plans;
  packed.plans_run = &plans;
  const ForwardResult got = forward(in.q.view(), in.k.view(), in.v.view(), packed);
  const ForwardResult want = forward(in.q.view(), in.k.view(), in.v.view(), unpacked);
  ASSERT_EQ(plans.forward.size(), 1u);
  EXPECT_EQ(plans.forward.front().heads_per_item, c.problem().heads_q / c.problem().heads_kv)
      << plans.forward.front().describe();
  EXPECT_TRUE(bitwise_equal(got.out, want.out)) << "out differs from the unpacked call's";
  EXPECT_TRUE(bitwise_equal(got.lse, want.lse)) << "lse differs from the unpacked call's";
  if (reference) check_forward(c.with([&](AttentionOptions& o) { o = packed; o.plans_run = nullptr; }));
}

TEST(PackGqa, BitIdenticalToOneTilePerHeadOnEveryTarget) {
  for_each_simd_target([&](const std::string& target) {
    const bool bf16_kernel = CpuHardware::detect(1).bf16_dot;
    std::uint64_t seed = 4100;
    for (const Shape& shape : kShapes) {
      Tensor sinks;
      for (const auto& [name, options] : variants(shape, sinks))
        for (const int splits : {1, 3}) {
          const int threads = splits == 1 ? 1 : 3;
          AttentionOptions o = options;
          o.num_splits = splits;
          o.num_threads = threads;
          if (splits > 1 && o.block_q == 0) o.block_q = 16;  // the same Q tiles packed or not
          const DType dtype = seed % 2 == 0 ? DType::f32 : DType::bf16;
          const Case c(shape, dtype, o, seed++);
          SCOPED_TRACE(target + " " + name + " " + c.describe());
          // Against the reference once per case (the unpacked calls are, in their own tests).
          check_packed(c, ForwardKernel::tiled, splits == 1);
          if (dtype == DType::bf16 && bf16_kernel) check_packed(c, ForwardKernel::tiled_bf16, splits == 1);
        }
    }
  });
}

TEST(PackGqa, VarlenSequencesAreBitIdentical) {
  // Packed sequences of several lengths: each is its own problem, packed or not alike.
  const std::vector<std::int32_t> lengths_q{7, 0, 30, 1, 12}, lengths_k{300, 40, 30, 900, 129};
  Tensor cu_q(DType::i32, {6}), cu_k(DType::i32, {6});
  std::int64_t total_q = 0, total_k = 0;
  cu_q.set(0, 0), cu_k.set(0, 0);
  for (std::size_t b = 0; b < lengths_q.size(); ++b) {
    total_q += lengths_q[b], total_k += lengths_k[b];
    cu_q.set(static_cast<std::int64_t>(b) + 1, static_cast<float>(total_q));
    cu_k.set(static_cast<std::int64_t>(b) + 1, static_cast<float>(total_k));
  }
  const Tensor q = random_tensor(DType::bf16, {total_q, 8, 64}, 1);
  const Tensor k = random_tensor(DType::bf16, {total_k, 2, 64}, 2);
  const Tensor v = random_tensor(DType::bf16, {total_k, 2, 64}, 3);
  for (const bool causal : {false, true}) {
    AttentionOptions packed, unpacked;
    packed.causal = unpacked.causal = causal;
    packed.num_threads = unpacked.num_threads = 2;
    packed.pack_gqa = true;
    unpacked.pack_gqa = false;
    const VarlenSeqlens seqlens{cu_q.view(), cu_k.view(), 30, 900};
    const ForwardResult got = forward_varlen(q.view(), k.view(), v.view(), seqlens, packed);
    const ForwardResult want = forward_varlen(q.view(), k.view(), v.view(), seqlens, unpacked);
    EXPECT_TRUE(bitwise_equal(got.out, want.out)) << "causal " << causal;
    EXPECT_TRUE(bitwise_equal(got.lse, want.lse)) << "causal " << causal;
  }
}

TEST(PackGqa, PlannerPacksFewRowsPerHeadOfAGroup) {
  const CpuHardware hw = CpuHardware::detect(2);
  const auto plan = [&](std::int64_t sq, std::int64_t hq, std::int64_t hkv, AttentionOptions o = {}) {
    const AttentionProblem p = AttentionProblem::from_sizes(1, sq, 4096, hq, hkv, 128, 128, DType::f32, o);
    return plan_forward(p, hw, o);
  };
  // A chunk of 8 new tokens of 32 q heads over 4 kv heads: one Q tile of the group's rows,
  // 8 a head back to back (not each padded to whole micro-tiles: 6 rows on AVX2, 8 on
  // AVX-512), causal or not.
  AttentionOptions causal;
  causal.causal = true;
  for (const AttentionOptions& o : {AttentionOptions{}, causal}) {
    const CpuForwardPlan chunk = plan(8, 32, 4, o);
    EXPECT_EQ(chunk.heads_per_item, 8);
    EXPECT_EQ(chunk.block_q, 8);
    EXPECT_EQ(chunk.q_blocks, 1);
  }
  // 32 rows a head of a group of 4 (a shared prefix's pass): each head takes a quarter of
  // the Q tile's rows unrounded — with this machine's L2 a tile of 126 rows or more (Zen 3 and
  // later, Sapphire Rapids), 32 rows a head in one tile (132 rows computed on AVX2), not 30 and
  // 2 rows a head (a head's 32 rows padded to 36).
  AttentionOptions unpacked;
  unpacked.pack_gqa = false;
  const std::int64_t tile_rows = plan(4096, 8, 8, unpacked).block_q;  // the planner's Q tile
  const CpuForwardPlan prefix = plan(32, 32, 8);
  if (prefix.heads_per_item > 1)  // packed where a head's rows fill at most half the tile
    EXPECT_EQ(prefix.block_q, std::min<std::int64_t>(32, (tile_rows + hw.micro_rows - 1) / 4))
        << "tile rows " << tile_rows << ", " << prefix.describe();
  if (tile_rows >= 126) {
    EXPECT_EQ(prefix.heads_per_item, 4) << prefix.describe();
    EXPECT_EQ(prefix.q_blocks, 1) << prefix.describe();
  }
  // A long prefill fills its tiles alone; MHA has nothing to pack; decode kernels hold every
  // head's rows already.
  EXPECT_EQ(plan(4096, 32, 4).heads_per_item, 1);
  EXPECT_EQ(plan(8, 32, 32).heads_per_item, 1);
  const CpuForwardPlan decode = plan(1, 32, 4);
  EXPECT_TRUE(is_decode(decode.kernel));
  EXPECT_EQ(decode.heads_per_item, 1);
  AttentionOptions never, always;
  never.pack_gqa = false;
  always.pack_gqa = true;
  EXPECT_EQ(plan(8, 32, 4, never).heads_per_item, 1);
  EXPECT_EQ(plan(2048, 32, 4, always).heads_per_item, 8);
  // Unset, a variant that differs per q head is not packed.
  AttentionOptions dropout;
  dropout.dropout_p = 0.1f;
  EXPECT_EQ(plan(8, 32, 4, dropout).heads_per_item, 1);
}

TEST(PackGqa, PerHeadVariantsAreRefusedByNameBeforeAnyWrite) {
  const Tensor q = random_tensor(DType::f32, {1, 8, 4, 32}, 1);
  const Tensor k = random_tensor(DType::f32, {1, 300, 2, 32}, 2);
  const Tensor v = random_tensor(DType::f32, {1, 300, 2, 32}, 3);
  const Tensor slopes = random_tensor(DType::f32, {4}, 4);
  Tensor mask(DType::u8, {1, 1, 8, 300});
  for (std::int64_t i = 0; i < mask.numel(); ++i) mask.set(i, static_cast<float>(i % 3 != 0));
  const FlexMods relative([](auto score, std::int64_t, std::int64_t h, std::int64_t q_idx, std::int64_t kv_idx) {
    return score - 0.1f * static_cast<float>(h) * static_cast<float>(q_idx - kv_idx);
  });
  struct Variant {
    const char* name;
    std::function<void(AttentionOptions&)> set;
  };
  const Variant per_head[] = {{"alibi_slopes", [&](AttentionOptions& o) { o.alibi_slopes = slopes.view(); }},
                              {"dropout_p", [](AttentionOptions& o) { o.dropout_p = 0.2f; }},
                              {"attn_mask", [&](AttentionOptions& o) { o.attn_mask = mask.view(); }},
                              {"score_hook", [&](AttentionOptions& o) { o.score_hook = relative.hook(); }}};
  for (const Variant& variant : per_head) {
    SCOPED_TRACE(variant.name);
    Tensor out(DType::f32, {1, 8, 4, 32}), lse(DType::f32, {1, 4, 8});
    for (std::int64_t i = 0; i < out.numel(); ++i) out.set(i, 7.0f);
    for (std::int64_t i = 0; i < lse.numel(); ++i) lse.set(i, 7.0f);
    AttentionOptions o;
    variant.set(o);
    o.pack_gqa = true;
    expect_error([&] { forward(q.view(), k.view(), v.view(), out.view(), lse.view(), o); },
                 {"pack_gqa", variant.name, "differ per q head"});
    for (const Tensor* t : {&out, &lse})
      for (std::int64_t i = 0; i < t->numel(); ++i) ASSERT_EQ(t->get(i), 7.0f) << "an output written by a rejected call";
    // Unset, the same call runs unpacked.
    o.pack_gqa.reset();
    PlansRun plans;
    o.plans_run = &plans;
    forward(q.view(), k.view(), v.view(), out.view(), lse.view(), o);
    ASSERT_EQ(plans.forward.size(), 1u);
    EXPECT_EQ(plans.forward.front().heads_per_item, 1);
  }
}

}  // namespace
}  // namespace flashattn::test
