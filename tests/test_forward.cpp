// The CPU forward kernel against the float64 reference.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>

#include "src/cpu/kernels/forward_kernel.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

// A case of these tests: sizes, causal, dtype and thread count; checked by check_forward
// (float32 within 1e-5, bf16/f16 by the yardstick that rounds where the kernels round).
void check_case(const Shape& shape, bool causal, DType dtype, int threads, std::uint64_t seed) {
  AttentionOptions options;
  options.causal = causal;
  options.num_threads = threads;
  check_forward(Case(shape, dtype, options, seed));
}

// The (Sq, Sk) pairs upstream tests, with ragged tails against every tile size.
constexpr std::pair<std::int64_t, std::int64_t> kSeqlenPairs[] = {
    {1, 239}, {3, 799}, {113, 203}, {127, 513}, {239, 1}, {1023, 1024}, {1024, 1023}};

TEST(Forward, SeqlenPairsFloat32) {
  std::uint64_t seed = 100;
  for (const auto& [sq, sk] : kSeqlenPairs)
    for (bool causal : {false, true})
      check_case({1, sq, sk, 2, 1, 64, 64}, causal, DType::f32, 2, seed++);
}

TEST(Forward, HeadDims) {
  std::uint64_t seed = 200;
  for (std::int64_t d : {1, 5, 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256, 300, 384, 512})
    check_case({1, 67, 131, 2, 2, d, d}, d % 2 == 0, DType::f32, 2, seed++);
}

TEST(Forward, ValueDimDiffersFromKeyDim) {
  check_case({2, 45, 77, 4, 2, 64, 32}, false, DType::f32, 2, 300);
  check_case({1, 80, 80, 2, 1, 40, 128}, true, DType::f32, 2, 301);
  check_case({1, 33, 65, 1, 1, 3, 257}, false, DType::f32, 1, 302);
}

TEST(Forward, GroupedAndMultiQuery) {
  check_case({2, 70, 90, 8, 8, 64, 64}, true, DType::f32, 2, 400);  // MHA
  check_case({2, 70, 90, 8, 2, 64, 64}, true, DType::f32, 2, 401);  // GQA
  check_case({2, 70, 90, 6, 1, 64, 64}, false, DType::f32, 2, 402);  // MQA
}

// The float32 products compute a Q tile's last strip at half height where it holds no more
// than half a strip's real rows (tile_ops-inl.h: kTailRows): its rows come out bit-identical
// to the same rows computed within a whole strip (the same queries in a tile of two whole
// strips), on every SIMD target, over several K/V tiles (P·V accumulating, rescales), with
// deferred normalization and without; KernelCounters::rows_computed shows which ran.
TEST(Forward, HalfHeightLastStripIsBitIdenticalToAWholeOne) {
  for_each_simd_target([&](const std::string& target) {
    const std::int64_t strip = CpuHardware::detect(1).micro_rows, keys = 700;
    const Tensor q = random_tensor(DType::f32, {1, 2 * strip, 3, 40}, 900);
    const Tensor k = random_tensor(DType::f32, {1, keys, 3, 40}, 901);
    const Tensor v = random_tensor(DType::f32, {1, keys, 3, 24}, 902);
    for (const bool deferred : {true, false}) {
      AttentionOptions o;
      o.num_threads = 1;
      o.kernel = ForwardKernel::tiled;
      o.switches.deferred_normalization = deferred;
      KernelCounters whole_counts;
      o.counters = &whole_counts;
      const ForwardResult whole = forward(q.view(), k.view(), v.view(), o);
      ASSERT_GT(whole_counts.tiles_computed, 3) << "several K/V tiles a head";
      const std::int64_t tiles_per_head = whole_counts.tiles_computed / 3;
      EXPECT_EQ(whole_counts.rows_computed, whole_counts.tiles_computed * 2 * strip);
      for (std::int64_t tail = 1; tail <= strip / 2; ++tail) {
        const std::int64_t sq = strip + tail;  // a whole strip, then `tail` rows: half height
        SCOPED_TRACE(target + ": " + std::to_string(strip) + "-row strips, last holds " + std::to_string(tail) +
                     (deferred ? "" : ", normalized every tile"));
        KernelCounters counts;
        o.counters = &counts;
        const ForwardResult half = forward(TensorView(q.data(), DType::f32, {1, sq, 3, 40}), k.view(), v.view(), o);
        EXPECT_EQ(counts.tiles_computed, 3 * tiles_per_head);
        EXPECT_EQ(counts.rows_computed, counts.tiles_computed * (strip + strip / 2)) << "the last strip at half height";
        for (std::int64_t e = 0; e < half.out.numel(); ++e)
          ASSERT_EQ(half.out.get(e), whole.out.get(e)) << "out element " << e;
        for (std::int64_t h = 0; h < 3; ++h)
          for (std::int64_t i = 0; i < sq; ++i)
            ASSERT_EQ(half.lse.get(h * sq + i), whole.lse.get(h * 2 * strip + i)) << "lse of head " << h << " row " << i;
      }
    }
  });
}

TEST(Forward, ThreadCounts) {
  for (int threads : {1, 2, 3, 8})
    check_case({2, 150, 260, 3, 1, 48, 48}, true, DType::f32, threads, 500 + threads);
}

TEST(Forward, LowPrecision) {
  std::uint64_t seed = 600;
  for (DType dtype : {DType::bf16, DType::f16}) {
    check_case({1, 113, 203, 4, 2, 64, 64}, false, dtype, 2, seed++);
    check_case({1, 127, 513, 2, 1, 128, 128}, true, dtype, 2, seed++);
    check_case({2, 31, 45, 2, 2, 59, 80}, true, dtype, 2, seed++);
  }
}

TEST(Forward, EverySimdTarget) {
  for_each_simd_target([](const std::string& target) {
    EXPECT_EQ(cpu_simd_target(), target);
    std::uint64_t seed = 700;
    for (const auto& [sq, sk] : {std::pair<std::int64_t, std::int64_t>{113, 203}, {239, 1}, {3, 799}})
      check_case({1, sq, sk, 2, 1, 59, 37}, true, DType::f32, 2, seed++);
    check_case({2, 65, 129, 4, 2, 128, 128}, false, DType::f32, 3, seed++);
    check_case({1, 50, 70, 2, 1, 96, 96}, true, DType::bf16, 2, seed++);
    check_case({1, 50, 70, 2, 1, 40, 40}, false, DType::f16, 1, seed++);
  });
}

TEST(Forward, RowsWithoutVisibleKeysGiveZeroAndMinusInfinity) {
  // Causal with Sq > Sk: bottom-right alignment leaves the first Sq − Sk rows empty.
  const std::int64_t sq = 40, sk = 25, d = 16;
  const Tensor q = random_tensor(DType::f32, {1, sq, 1, d}, 1);
  const Tensor k = random_tensor(DType::f32, {1, sk, 1, d}, 2);
  const Tensor v = random_tensor(DType::f32, {1, sk, 1, d}, 3);
  AttentionOptions options;
  options.causal = true;
  const ForwardResult r = forward(q.view(), k.view(), v.view(), options);
  for (std::int64_t i = 0; i < sq; ++i) {
    const float lse = r.lse.get(i);
    if (i < sq - sk) {
      EXPECT_EQ(lse, -std::numeric_limits<float>::infinity()) << "row " << i;
      for (std::int64_t c = 0; c < d; ++c) EXPECT_EQ(r.out.get(i * d + c), 0.0f) << "row " << i;
    } else {
      EXPECT_TRUE(std::isfinite(lse)) << "row " << i;
    }
  }
  check_case({2, 40, 25, 2, 1, 16, 16}, true, DType::f32, 2, 800);
}

TEST(Forward, EmptySizesGiveEmptyOutputs) {
  for (const auto& [b, sq, sk] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{0, 5, 5}, {2, 0, 5}, {2, 5, 0}}) {
    const Tensor q = random_tensor(DType::f32, {b, sq, 2, 8}, 1);
    const Tensor k = random_tensor(DType::f32, {b, sk, 2, 8}, 2);
    const ForwardResult r = forward(q.view(), k.view(), k.view());
    EXPECT_EQ(r.out.numel(), b * sq * 2 * 8);
    for (std::int64_t i = 0; i < r.lse.numel(); ++i)  // Sk = 0: no key is visible
      EXPECT_EQ(r.lse.get(i), -std::numeric_limits<float>::infinity());
    for (std::int64_t i = 0; i < r.out.numel(); ++i) EXPECT_EQ(r.out.get(i), 0.0f);
  }
}

TEST(Forward, StridedViewsAndUntouchedMemory) {
  // q, k, v as slices of one packed (B, S, 3, H, D) buffer, out written into a wider
  // buffer whose gaps must stay untouched, lse with a padded row stride.
  const std::int64_t b = 2, s = 57, h = 3, d = 40;
  const Tensor qkv = random_tensor(DType::f32, {b, s, 3 * h, d}, 11);
  const float* base = qkv.data_as<float>();
  const std::int64_t row = 3 * h * d;
  TensorView q(base, DType::f32, {b, s, h, d}, {s * row, row, d, 1});
  TensorView k(base + h * d, DType::f32, {b, s, h, d}, {s * row, row, d, 1});
  TensorView v(base + 2 * h * d, DType::f32, {b, s, h, d}, {s * row, row, d, 1});

  const float sentinel = 12345.0f;
  std::vector<float> out_buf(static_cast<std::size_t>(b * s * h * (d + 7)), sentinel);
  std::vector<float> lse_buf(static_cast<std::size_t>(b * h * (s + 3)), sentinel);
  MutableTensorView out(out_buf.data(), DType::f32, {b, s, h, d}, {s * h * (d + 7), h * (d + 7), d + 7, 1});
  MutableTensorView lse(lse_buf.data(), DType::f32, {b, h, s}, {h * (s + 3), s + 3, 1});
  const std::vector<float> qkv_before(base, base + qkv.numel());
  AttentionOptions options;
  options.causal = true;
  forward(q, k, v, out, lse, options);

  const reference::Result want = reference::attention(q, k, v, options);
  double err = 0.0;
  for (std::int64_t bi = 0; bi < b; ++bi)
    for (std::int64_t i = 0; i < s; ++i)
      for (std::int64_t hi = 0; hi < h; ++hi)
        for (std::int64_t c = 0; c < d + 7; ++c) {
          const float got = out_buf[static_cast<std::size_t>(((bi * s + i) * h + hi) * (d + 7) + c)];
          if (c >= d) {
            ASSERT_EQ(got, sentinel);
          } else {
            err = std::max(err, abs_difference(got, want.out[static_cast<std::size_t>(((bi * s + i) * h + hi) * d + c)]));
          }
        }
  EXPECT_LE(err, 1e-5);
  for (std::int64_t r = 0; r < b * h; ++r)
    for (std::int64_t c = s; c < s + 3; ++c) ASSERT_EQ(lse_buf[static_cast<std::size_t>(r * (s + 3) + c)], sentinel);
  EXPECT_EQ(std::vector<float>(base, base + qkv.numel()), qkv_before) << "inputs were modified";
}

TEST(Forward, LargeScoresDoNotOverflow) {
  // Scores near ±1e4 overflow a naive exp; the running maximum keeps the kernel exact.
  Tensor q = random_tensor(DType::f32, {1, 64, 1, 32}, 21);
  const Tensor k = random_tensor(DType::f32, {1, 300, 1, 32}, 22);
  const Tensor v = random_tensor(DType::f32, {1, 300, 1, 32}, 23);
  for (std::int64_t i = 0; i < q.numel(); ++i) q.set(i, q.get(i) * 300.0f);
  const ForwardResult got = forward(q.view(), k.view(), v.view());
  const reference::Result want = reference::attention(q.view(), k.view(), v.view());
  EXPECT_LE(max_abs_error(got.out, want.out), 1e-4);
  for (std::int64_t i = 0; i < got.lse.numel(); ++i)
    EXPECT_NEAR(got.lse.get(i), want.lse[static_cast<std::size_t>(i)], 1e-6 * std::fabs(want.lse[static_cast<std::size_t>(i)]) + 1e-4);
}

TEST(Forward, ExplicitSoftmaxScale) {
  const Tensor q = random_tensor(DType::f32, {1, 90, 2, 64}, 31);
  const Tensor k = random_tensor(DType::f32, {1, 150, 2, 64}, 32);
  const Tensor v = random_tensor(DType::f32, {1, 150, 2, 64}, 33);
  for (float scale : {0.0f, 0.3f, -0.2f}) {
    AttentionOptions options;
    options.softmax_scale = scale;
    const ForwardResult got = forward(q.view(), k.view(), v.view(), options);
    EXPECT_LE(max_abs_error(got.out, reference::attention(q.view(), k.view(), v.view(), options).out), 1e-5)
        << "scale " << scale;
  }
}

// A call's workspaces may be the ones an earlier call gave back (ForwardWorkspaces), with
// that call's packed K/V, counters and larger or smaller buffers: calls of other layouts in
// between — the tiled kernel's packing, decode's, more threads, longer keys — leave a
// repeated call's output, lse and counters exactly as the first time (not kv_packed: which
// thread packs a kv head whose items go out one by one depends on timing).
TEST(Forward, KeptWorkspacesChangeNothing) {
  struct Call {
    Tensor q, k, v;
    AttentionOptions options;
  };
  auto make = [](std::int64_t sq, std::int64_t sk, std::int64_t d, DType dtype, bool causal, int threads,
                 std::uint64_t seed) {
    Call c{random_tensor(dtype, {2, sq, 4, d}, seed), random_tensor(dtype, {2, sk, 2, d}, seed + 1),
           random_tensor(dtype, {2, sk, 2, d}, seed + 2), {}};
    c.options.causal = causal;
    c.options.num_threads = threads;
    return c;
  };
  const Call calls[] = {make(37, 501, 72, DType::f32, true, 3, 1), make(1, 2000, 64, DType::bf16, false, 2, 4),
                        make(130, 1500, 40, DType::f32, false, 2, 7), make(5, 301, 72, DType::f32, false, 1, 10)};
  auto run = [](const Call& c, KernelCounters& counters) {
    AttentionOptions o = c.options;
    o.counters = &counters;
    return forward(c.q.view(), c.k.view(), c.v.view(), o);
  };
  std::vector<ForwardResult> first;
  std::vector<KernelCounters> first_counts(std::size(calls));
  for (std::size_t i = 0; i < std::size(calls); ++i) first.push_back(run(calls[i], first_counts[i]));
  for (std::size_t i : {2u, 0u, 3u, 1u, 0u}) {
    KernelCounters counts;
    const ForwardResult again = run(calls[i], counts);
    EXPECT_TRUE(bitwise_equal(again.out, first[i].out)) << "call " << i;
    EXPECT_TRUE(bitwise_equal(again.lse, first[i].lse)) << "call " << i;
    EXPECT_EQ(counts.tiles_computed, first_counts[i].tiles_computed) << "call " << i;
    EXPECT_EQ(counts.scores, first_counts[i].scores) << "call " << i;
    EXPECT_EQ(counts.rescales, first_counts[i].rescales) << "call " << i;
  }
}

}  // namespace
}  // namespace flashattn::test

namespace flashattn::test {
namespace {

TEST(Forward, SplitKvMatchesTheReferenceForEverySplitCount) {
  // Decoding shapes: few query rows, many keys; every split count merges exactly.
  const std::pair<std::int64_t, std::int64_t> pairs[] = {{1, 128}, {1, 339}, {3, 1024}, {64, 800}, {1, 20000}, {16, 20000}};
  std::uint64_t seed = 900;
  for (const auto& [sq, sk] : pairs) {
    const Tensor q = random_tensor(DType::f32, {1, sq, 4, 64}, seed);
    const Tensor k = random_tensor(DType::f32, {1, sk, 1, 64}, seed + 1);
    const Tensor v = random_tensor(DType::f32, {1, sk, 1, 64}, seed + 2);
    seed += 3;
    for (bool causal : {false, true}) {
      AttentionOptions o;
      o.causal = causal;
      if (sk == 339) o.window_size = {100, causal ? 0 : 50};
      const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
      for (int splits : {1, 2, 3, 7, 16}) {
        o.num_splits = splits;
        SCOPED_TRACE("Sq=" + std::to_string(sq) + " Sk=" + std::to_string(sk) + " causal=" +
                     std::to_string(causal) + " splits=" + std::to_string(splits));
        const ForwardResult got = forward(q.view(), k.view(), v.view(), o);
        EXPECT_LE(max_abs_error(got.out, want.out), 1e-5);
        for (std::int64_t i = 0; i < got.lse.numel(); ++i)
          ASSERT_NEAR(got.lse.get(i), want.lse[static_cast<std::size_t>(i)], 1e-5 + 1e-6 * std::fabs(want.lse[static_cast<std::size_t>(i)]));
      }
    }
  }
  AttentionOptions bad;
  bad.num_splits = -1;
  const Tensor q = random_tensor(DType::f32, {1, 2, 1, 8}, 1);
  EXPECT_THROW(forward(q.view(), q.view(), q.view(), bad), Error);
}

TEST(Forward, MaskedStripsAgreeWithTheReferenceForEveryTileShape) {
  // A diagonal tile computes only the micro-tiles of each row strip's span of visible keys
  // (FindStripKeys in src/cpu/kernels/tiled_forward.cpp), so the spans must hold every visible key for any
  // Q tile against any K/V tile: Q tiles smaller than, unaligned with (126 against 128) and
  // as large as the K/V tiles, the plan's own choice (block_q 0), causal with Sq = Sk,
  // Sq < Sk and Sq > Sk (rows without keys), and windows whose left edge enters a tile
  // mid-strip — on every SIMD target, whose micro-tiles differ.
  struct Mask {
    bool causal;
    std::int64_t left, right;
  };
  const Mask masks[] = {{true, -1, -1}, {true, 37, 0}, {false, 20, 5}, {false, -1, 3}};
  const std::pair<std::int64_t, std::int64_t> lengths[] = {{300, 300}, {257, 300}, {300, 257}};
  for_each_simd_target([&](const std::string&) {
    std::uint64_t seed = 950;
    for (const auto& [sq, sk] : lengths) {
      const Tensor q = random_tensor(DType::f32, {1, sq, 2, 40}, seed);
      const Tensor k = random_tensor(DType::f32, {1, sk, 1, 40}, seed + 1);
      const Tensor v = random_tensor(DType::f32, {1, sk, 1, 24}, seed + 2);
      seed += 3;
      for (const Mask& m : masks) {
        AttentionOptions o;
        o.causal = m.causal;
        o.window_size = {m.left, m.right};
        const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
        for (std::int64_t block_q : {0, 6, 16, 48, 126, 128}) {
          o.block_q = block_q;
          SCOPED_TRACE("Sq=" + std::to_string(sq) + " Sk=" + std::to_string(sk) + " causal=" +
                       std::to_string(m.causal) + " window=" + std::to_string(m.left) + "," +
                       std::to_string(m.right) + " block_q=" + std::to_string(block_q));
          const ForwardResult got = forward(q.view(), k.view(), v.view(), o);
          EXPECT_LE(max_abs_error(got.out, want.out), 1e-5);
          expect_lse_near(got.lse, want.lse);
        }
      }
    }
  });
}

TEST(Forward, PlanSplitsKeysOnlyWhenThreadsWouldIdle) {
  const CpuHardware hw = CpuHardware::detect(4);
  const AttentionProblem decode = AttentionProblem::from_sizes(1, 1, 32768, 8, 2, 128, 128, DType::bf16, {});
  EXPECT_GE(plan_forward(decode, hw).splits, 1);
  EXPECT_EQ(plan_forward(decode, hw).work_items % 8, 0);
  EXPECT_GT(plan_forward(decode, hw).work_items, 4);  // every thread has work
  const AttentionProblem prefill = AttentionProblem::from_sizes(1, 4096, 4096, 16, 16, 128, 128, DType::bf16, {});
  EXPECT_EQ(plan_forward(prefill, hw).splits, 1);
  EXPECT_EQ(plan_forward(decode, hw, 1).splits, 1);
  EXPECT_EQ(plan_forward(decode, hw, 5).splits, 5);
}

// Short decode calls over bf16 and f16 caches run the AVX2 target's decode kernel where
// CpuHardware::short_decode_bytes says so (Intel's AVX-512 CPUs), the plan's geometry that
// target's; float32, longer calls, prefill and hardware without the rule keep the
// dispatched target.
TEST(Forward, ShortBf16DecodeRunsTheAvx2KernelWhereTheHardwareSaysSo) {
  const std::optional<cpu::KernelGeometry> avx2 = cpu::avx2_kernel_geometry();
  if (!avx2)
    GTEST_SKIP() << "the AVX2 target is not compiled here (FLASHATTN_SIMD_TARGETS=native on an AVX-512 CPU) or "
                    "this CPU cannot run it";
  CpuHardware hw = CpuHardware::detect(2);
  hw.short_decode_bytes = std::size_t{1} << 20;
  auto plan = [&](std::int64_t sk, std::int64_t sq, DType dtype) {
    return plan_forward(AttentionProblem::from_sizes(1, sq, sk, 8, 2, 64, 64, dtype, {}), hw);
  };
  // K and V of 2048 keys: 2048 · 2 kv heads · (64 + 64) · 2 bytes = 1 MiB.
  for (DType dtype : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(to_string(dtype));
    const CpuForwardPlan short_call = plan(2048, 1, dtype);
    EXPECT_EQ(short_call.kernel, ForwardKernel::decode);
    EXPECT_TRUE(short_call.avx2_decode);
    EXPECT_EQ(short_call.hardware.simd_target, avx2->target);
    EXPECT_EQ(short_call.hardware.micro_cols, avx2->micro_cols);
    EXPECT_EQ(short_call.head_dim_v_padded % avx2->micro_cols, 0);
    EXPECT_NE(short_call.describe().find(std::string("simd=") + avx2->target), std::string::npos);
    EXPECT_FALSE(plan(2049, 1, dtype).avx2_decode);
  }
  EXPECT_FALSE(plan(1024, 1, DType::f32).avx2_decode);
  EXPECT_FALSE(plan(1024, 64, DType::bf16).avx2_decode);  // 32 rows per kv head: tiled
  hw.short_decode_bytes = 0;
  EXPECT_FALSE(plan(16, 1, DType::bf16).avx2_decode);
}

// The same through forward() on the dispatched target (no loop over the targets, which
// turns the AVX2 decode kernel off): bf16 and f16 decode below and above this CPU's
// short_decode_bytes against the float64 reference, the kernel that ran read from the
// call's report.
TEST(Forward, ShortBf16AndF16DecodeMatchTheReferenceOnTheKernelThePlannerPicks) {
  const CpuHardware hw = CpuHardware::detect(2);
  ::testing::Test::RecordProperty("short_decode_bytes", std::to_string(hw.short_decode_bytes));
  std::uint64_t seed = 3300;
  for (DType dtype : {DType::bf16, DType::f16})
    for (const Shape& shape : {Shape{2, 1, 1025, 8, 2, 64, 64}, Shape{1, 3, 300, 6, 3, 37, 45},
                               Shape{1, 2, 777, 4, 4, 128, 96}, Shape{1, 1, 40000, 2, 1, 8, 8}})
      for (int threads : {1, 3}) {
        PlansRun ran;
        AttentionOptions o;
        o.causal = true;
        o.num_threads = threads;
        o.plans_run = &ran;
        const Case c(shape, dtype, o, seed++);
        check_forward(c);
        ASSERT_EQ(ran.forward.size(), 1u);
        const std::int64_t bytes = shape.batch * shape.seqlen_k * shape.heads_kv * (shape.head_dim + shape.head_dim_v) * 2;
        EXPECT_EQ(ran.forward[0].avx2_decode,
                  hw.short_decode_bytes > 0 && bytes <= static_cast<std::int64_t>(hw.short_decode_bytes))
            << c.describe() << ": " << ran.forward[0].describe();
      }
}

// The tiled kernels' K/V tile: 256 keys whatever L1d holds (measured on a 48 KiB and on a
// 32 KiB L1d, plan.cpp), never more keys than the problem has (rounded up to a panel); the
// decode kernels start from 128 and fit their blocks to the caches.
TEST(Forward, PlanTakesKeyTilesOf256ForTheTiledKernels) {
  const AttentionProblem p = AttentionProblem::from_sizes(1, 1024, 1024, 4, 4, 64, 64, DType::f32, {});
  CpuHardware hw = CpuHardware::detect(2);
  for (const std::int64_t l1d : {32 * 1024, 48 * 1024})
    for (const int cols : {16, 32}) {
      SCOPED_TRACE("L1d " + std::to_string(l1d) + " micro_cols " + std::to_string(cols));
      hw.l1d_bytes = static_cast<std::size_t>(l1d);
      hw.micro_cols = cols;
      EXPECT_EQ(plan_forward(p, hw).block_k, 256);
    }
  const AttentionProblem short_keys = AttentionProblem::from_sizes(1, 1024, 100, 4, 4, 64, 64, DType::f32, {});
  EXPECT_EQ(plan_forward(short_keys, hw).block_k, 128);  // 100 keys, panels of 32 columns
  const AttentionProblem decode = AttentionProblem::from_sizes(1, 1, 4096, 8, 2, 32, 32, DType::f32, {});
  EXPECT_EQ(plan_forward(decode, hw).kernel, ForwardKernel::decode);
  EXPECT_LE(plan_forward(decode, hw).block_k, 128);
}

}  // namespace
}  // namespace flashattn::test
