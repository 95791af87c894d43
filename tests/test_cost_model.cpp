// The cost model against counts worked out by hand, its scaling laws, the CPU kernels'
// measured counters, and the hardware table's derived per-tile cycles.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "flashattn/cost_model.hpp"
#include "flashattn/plan.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

using cost::Tiling;

AttentionProblem square(std::int64_t n, std::int64_t d, bool causal = false, DType dtype = DType::bf16) {
  AttentionOptions o;
  o.causal = causal;
  return AttentionProblem::from_sizes(1, n, n, 1, 1, d, d, dtype, o);
}

// ---- visible pairs, brute force ------------------------------------------------------

// Every (query, key) pair tested against the masks' definitions (options.hpp): the window
// i + Sk − Sq − left <= j <= i + Sk − Sq + right, causal as right = 0, and the block mask.
TEST(CostModel, VisiblePairsMatchBruteForce) {
  struct Shape {
    std::int64_t sq, sk, left, right, block;
    bool causal;
  };
  const std::vector<Shape> shapes = {{7, 7, -1, -1, 0, false}, {7, 7, -1, -1, 0, true},  {5, 11, -1, -1, 0, true},
                                     {11, 5, -1, -1, 0, true}, {13, 9, 3, 2, 0, false},  {9, 13, 0, -1, 0, false},
                                     {13, 13, 4, -1, 3, true}, {10, 17, -1, -1, 4, false}, {17, 10, 2, 5, 5, false}};
  for (const Shape& sh : shapes) {
    AttentionOptions o;
    o.causal = sh.causal;
    o.window_size = {sh.left, sh.right};
    std::vector<std::uint8_t> mask;
    Tensor mask_tensor;
    if (sh.block > 0) {
      const std::int64_t qb = (sh.sq + sh.block - 1) / sh.block, kb = (sh.sk + sh.block - 1) / sh.block;
      mask_tensor = Tensor(DType::u8, {qb, kb});
      auto* m = mask_tensor.data_as<std::uint8_t>();
      for (std::int64_t i = 0; i < qb * kb; ++i) m[i] = static_cast<std::uint8_t>((i * 7 + 3) % 3 != 0);
      o.block_mask = mask_tensor.view();
      o.block_mask_block_size = sh.block;
    }
    const AttentionProblem p = AttentionProblem::from_sizes(2, sh.sq, sh.sk, 3, 3, 8, 5, DType::f32, o);
    std::int64_t expected = 0;
    for (std::int64_t i = 0; i < sh.sq; ++i)
      for (std::int64_t j = 0; j < sh.sk; ++j) {
        const std::int64_t diagonal = i + sh.sk - sh.sq;
        const std::int64_t right = sh.causal ? 0 : sh.right;
        if (sh.left >= 0 && j < diagonal - sh.left) continue;
        if (right >= 0 && j > diagonal + right) continue;
        if (sh.block > 0 && mask_tensor.data_as<std::uint8_t>()[(i / sh.block) * ((sh.sk + sh.block - 1) / sh.block) + j / sh.block] == 0)
          continue;
        ++expected;
      }
    EXPECT_EQ(p.visible_pairs(o.block_mask), expected) << p.describe();
    EXPECT_DOUBLE_EQ(p.visible_forward_flops(o.block_mask), 2.0 * (8 + 5) * 2 * 3 * static_cast<double>(expected));
  }
}

// ---- traffic, hand-computed ----------------------------------------------------------

TEST(CostModel, StandardForwardTrafficByHand) {
  // N = 4096, d = 64: 4·N² (S and P written and read) + N·(2d + 2d) (Q, K, V, O).
  const cost::TiledAccount a = cost::standard_forward(square(4096, 64));
  EXPECT_EQ(a.traffic.elements(), 4 * 4096LL * 4096 + 4096LL * 256);
  EXPECT_EQ(a.traffic.bytes(), 2 * a.traffic.elements());  // bf16
  EXPECT_EQ(a.traffic.elements_of("S", true), 4096LL * 4096);
  EXPECT_EQ(a.traffic.elements_of("P", false), 4096LL * 4096);
}

TEST(CostModel, StandardBackwardTrafficByHand) {
  // 7·N² (P twice, dP written and read, dS written and read twice) + N·d·8 with D = Dv.
  const cost::TiledAccount a = cost::standard_backward(square(1000, 32));
  EXPECT_EQ(a.traffic.elements(), 7 * 1000LL * 1000 + 8 * 1000LL * 32);
}

TEST(CostModel, EagerStandardPassesByHand) {
  // N = 1000, d = 32, bf16, dropout: per N×N element, forward Q·Kᵀ writes S (1), scale,
  // mask and softmax read and write (6), dropout reads P and writes P dropped (2) and its
  // one-byte mask, P·V reads P dropped (1): 10 bf16 elements + 1 byte; backward Pᵀ·dO and
  // dO·Vᵀ (2), dropout backward (2 + the mask byte), softmax backward (3), mask and scale
  // backward (4), dS·K and dSᵀ·Q (2): 13 + 1 byte. Q, K, V, O (4·N·d) and dO twice, Q, K,
  // V, dQ, dK, dV (8·N·d) in bf16.
  AttentionOptions o;
  o.dropout_p = 0.1f;
  const std::int64_t n = 1000, d = 32, nn = n * n;
  const AttentionProblem p = AttentionProblem::from_sizes(1, n, n, 1, 1, d, d, DType::bf16, o);
  const auto fwd = cost::standard_forward_passes(p, cost::StandardModel::eager);
  const auto bwd = cost::standard_backward_passes(p, cost::StandardModel::eager);
  EXPECT_EQ(fwd.size(), 6u);
  EXPECT_EQ(bwd.size(), 8u);
  const cost::TiledAccount f = cost::standard_forward(p, cost::StandardModel::eager);
  const cost::TiledAccount b = cost::standard_backward(p, cost::StandardModel::eager);
  EXPECT_EQ(f.traffic.bytes(), 2 * 10 * nn + nn + 2 * 4 * n * d);
  EXPECT_EQ(b.traffic.bytes(), 2 * 13 * nn + nn + 2 * 8 * n * d);
  EXPECT_EQ(f.traffic.elements_of("dropout mask", true), nn);
  EXPECT_EQ(b.traffic.elements_of("dropout mask", false), nn);
  // Matrix FLOPs only in the four products of the backward and two of the forward, as Work counts them.
  double flops = 0.0;
  for (const auto* passes : {&fwd, &bwd})
    for (const cost::Pass& k : *passes) flops += k.flops;
  EXPECT_DOUBLE_EQ(flops, cost::work(p).standard_forward + cost::work(p).standard_backward);
  // Without dropout the dropout kernels and the mask go; the minimal model ignores dropout
  // (regenerated from the seed) and equals the account above.
  const AttentionProblem plain = square(n, d);
  EXPECT_EQ(cost::standard_forward_passes(plain, cost::StandardModel::eager).size(), 5u);
  EXPECT_EQ(cost::standard_forward(plain, cost::StandardModel::eager).traffic.bytes(), 2 * 8 * nn + 2 * 4 * n * d);
  EXPECT_EQ(cost::standard_forward(p, cost::StandardModel::minimal).traffic.bytes(),
            cost::standard_forward(plain).traffic.bytes());
  EXPECT_EQ(cost::standard_backward(p, cost::StandardModel::minimal).traffic.bytes(),
            cost::standard_backward(plain).traffic.bytes());
  EXPECT_EQ(cost::parse_standard_model("eager"), cost::StandardModel::eager);
  EXPECT_THROW(cost::parse_standard_model("fused"), Error);
}

TEST(CostModel, StandardPredictionAddsPasses) {
  // Every pass of bf16 d = 64 attention on an A100 is memory-bound (2 bytes per score
  // against 2·64 FLOPs: 64 FLOP/B < 312e12 / 2.039e12 = 153): time = bytes / bandwidth.
  const AttentionProblem p = square(2048, 64);
  const cost::Architecture& a100 = cost::gpu_architecture("a100-80gb");
  const auto passes = cost::standard_forward_passes(p, cost::StandardModel::eager);
  const cost::Prediction r = cost::predict_standard(p, a100, passes);
  const double bytes = static_cast<double>(cost::standard_forward(p, cost::StandardModel::eager).traffic.bytes());
  EXPECT_DOUBLE_EQ(r.memory_bytes, bytes);
  EXPECT_NEAR(r.seconds, bytes / 2039e9, 1e-12 * r.seconds);
  EXPECT_EQ(r.bound, "memory");
  EXPECT_DOUBLE_EQ(r.compute_seconds, cost::work(p).standard_forward / a100.peak_flops(DType::bf16));
}

TEST(CostModel, L2ServesRestreamedTilesWhenTheyFit) {
  // A100, 16 heads of N = 1024, d = 64, bf16, 128×128 tiles: 8 Q tiles per head stream its
  // K and V (256 KiB); 108 SMs hold ceil(108 / 8) = 14 heads, 3.5 MiB: they fit in 40 MiB,
  // so K and V come from slow memory once per head.
  const cost::Architecture& a100 = cost::gpu_architecture("a100-40gb");
  EXPECT_DOUBLE_EQ(a100.l2_bytes, 40.0 * 1024 * 1024);
  const AttentionProblem p = AttentionProblem::from_sizes(1, 1024, 1024, 16, 16, 64, 64, DType::bf16, {});
  const cost::TiledAccount f = cost::flash_forward(p, Tiling{128, 128});
  const cost::CachedTraffic c = cost::cached_traffic(f, a100, "forward");
  const double head_kv = 1024.0 * 128 * 2;
  EXPECT_EQ(c.heads_in_flight, 14);
  EXPECT_DOUBLE_EQ(c.head_bytes, head_kv);
  EXPECT_TRUE(c.fits);
  EXPECT_DOUBLE_EQ(c.raw_bytes, static_cast<double>(f.traffic.bytes()));
  EXPECT_DOUBLE_EQ(c.bytes, c.raw_bytes - 7 * 16 * head_kv);
  EXPECT_DOUBLE_EQ(cost::predict_forward(p, a100, Tiling{128, 128}, {}).memory_bytes, c.bytes);
  // Backward: the Q side of a head once (Q, dO in bf16; lse, D, the dQ accumulator read and
  // written in float32) instead of once per K/V tile.
  const cost::TiledAccount b = cost::flash_backward(p, Tiling{128, 128});
  const cost::CachedTraffic cb = cost::cached_traffic(b, a100, "backward");
  const double head_q = 1024.0 * (128 * 2 + (2 + 2 * 64) * 4);
  EXPECT_TRUE(cb.fits);
  EXPECT_DOUBLE_EQ(cb.bytes, cb.raw_bytes - 7 * 16 * head_q);
  // N = 131072, d = 128: a head's K/V is 64 MiB, more than the L2 even for one head in
  // flight: every restream from slow memory.
  const AttentionProblem big = AttentionProblem::from_sizes(1, 131072, 131072, 1, 1, 128, 128, DType::bf16, {});
  const cost::CachedTraffic r = cost::cached_traffic(cost::flash_forward(big, Tiling{128, 128}), a100, "forward");
  EXPECT_EQ(r.heads_in_flight, 1);
  EXPECT_FALSE(r.fits);
  EXPECT_DOUBLE_EQ(r.bytes, r.raw_bytes);
  EXPECT_NE(r.assumption.find("exceed"), std::string::npos);
}

TEST(CostModel, Gpt2MediumReproducesThePaper) {
  // Dao et al. 2022, Figure 2 left: GPT-2 medium attention (batch 64, N = 1024, 16 heads,
  // d = 64, fp16, dropout, not causal) forward + backward on an A100 40 GB. The paper
  // measured standard / FlashAttention: 66.6 / 75.2 GFLOPs, 40.3 / 4.4 GB of HBM traffic,
  // 41.7 / 7.3 ms. The model (minimal standard, 128×128 tiles, the L2 rule) must give each
  // ratio within ±25% of the paper's.
  AttentionOptions o;
  o.dropout_p = 0.1f;
  const AttentionProblem p = AttentionProblem::from_sizes(64, 1024, 1024, 16, 16, 64, 64, DType::f16, o);
  const cost::Architecture& a100 = cost::gpu_architecture("a100-40gb");
  const Tiling t{128, 128};
  const cost::Work w = cost::work(p);
  const double flops_ratio = (w.forward + w.backward) / (w.standard_forward + w.standard_backward);
  const double standard_bytes = static_cast<double>(cost::standard_forward(p, cost::StandardModel::minimal).traffic.bytes() +
                                                    cost::standard_backward(p, cost::StandardModel::minimal).traffic.bytes());
  const double flash_bytes = cost::cached_traffic(cost::flash_forward(p, t), a100, "forward").bytes +
                             cost::cached_traffic(cost::flash_backward(p, t), a100, "backward").bytes;
  const double standard_s =
      cost::predict_standard(p, a100, cost::standard_forward_passes(p, cost::StandardModel::minimal)).seconds +
      cost::predict_standard(p, a100, cost::standard_backward_passes(p, cost::StandardModel::minimal)).seconds;
  const double flash_s = cost::predict_forward(p, a100, t, {DType::f16}).seconds +
                         cost::predict_backward(p, a100, t, {DType::f16}).seconds;
  const auto within = [](double model, double paper) { return std::fabs(model / paper - 1.0) <= 0.25; };
  EXPECT_TRUE(within(flops_ratio, 75.2 / 66.6)) << flops_ratio;
  EXPECT_TRUE(within(standard_bytes / flash_bytes, 40.3 / 4.4)) << standard_bytes / flash_bytes;
  EXPECT_TRUE(within(standard_s / flash_s, 41.7 / 7.3)) << standard_s / flash_s;
}

TEST(CostModel, FlashForwardTrafficByHand) {
  // N = 4096, d = 64, Br = M/d = 512 for M = 32768, Bc = 128: 8 Q tiles each stream all
  // of K and V: 8·4096·(64 + 64) elements; Q and O once (4096·64 each), lse once.
  const AttentionProblem p = square(4096, 64);
  const cost::TiledAccount a = cost::flash_forward(p, Tiling{512, 128});
  EXPECT_EQ(a.traffic.elements_of("K", false) + a.traffic.elements_of("V", false), 8LL * 4096 * 128);
  EXPECT_EQ(a.traffic.elements(), 8LL * 4096 * 128 + 2 * 4096LL * 64 + 4096);
  EXPECT_EQ(a.traffic.bytes(), 2 * (8LL * 4096 * 128 + 2 * 4096LL * 64) + 4 * 4096);
  EXPECT_EQ(a.tiles_computed, 8 * 32);
  EXPECT_EQ(a.tiles_skipped, 0);
  // The streamed K/V is exactly 2·N²·d²/M, twice the Θ-form (once for K, once for V).
  EXPECT_DOUBLE_EQ(static_cast<double>(a.traffic.elements_of("K", false)),
                   cost::theta_forms(p, 32768).flash);
}

TEST(CostModel, RaggedCausalTilesByHand) {
  // Sq = Sk = 5, Br = Bc = 2, causal: row i sees keys [0, i]. Q tile 0 (rows 0-1) reads
  // keys 0-1; tile 1 (rows 2-3) keys 0-3; tile 2 (row 4) keys 0-4: 2 + 4 + 5 = 11 keys in
  // 1 + 2 + 3 = 6 tiles of a 3×3 grid; scores 2·2 + 2·4 + 1·5 = 17; visible pairs 15.
  const AttentionProblem p = square(5, 1, true, DType::f32);
  const cost::TiledAccount a = cost::flash_forward(p, Tiling{2, 2});
  EXPECT_EQ(a.traffic.elements_of("K", false), 11);
  EXPECT_EQ(a.tiles_computed, 6);
  EXPECT_EQ(a.tiles_skipped, 3);
  EXPECT_EQ(a.scores, 17);
  EXPECT_EQ(cost::work(p).visible_pairs, 15);
  // Backward, K/V tiles outer: tile 0 (keys 0-1) meets Q tiles 0, 1, 2; tile 1 (keys 2-3)
  // Q tiles 1, 2; tile 2 (key 4) Q tile 2: Q rows streamed 2+2+1 + 2+1 + 1 = 9.
  const cost::TiledAccount b = cost::flash_backward(p, Tiling{2, 2});
  EXPECT_EQ(b.tiles_computed, 6);
  EXPECT_EQ(b.traffic.elements_of("Q", false), 9);
  EXPECT_EQ(b.traffic.elements_of("K", false), 5);
}

TEST(CostModel, ThetaFormsByHand) {
  // N = 4096, d = 64, M = 32768: standard N·d + N², tiled N²·d²/M; their ratio
  // N·d²/(M·(N + d)) tends to d²/M = 1/8, within a factor 1 + d/N of it.
  const cost::ThetaForms f = cost::theta_forms(square(4096, 64), 32768);
  EXPECT_DOUBLE_EQ(f.standard, 4096.0 * 64 + 4096.0 * 4096);
  EXPECT_DOUBLE_EQ(f.flash, 4096.0 * 4096 * 64 * 64 / 32768);
  EXPECT_DOUBLE_EQ(f.ratio, 4096.0 * 64 * 64 / (32768.0 * (4096 + 64)));
  EXPECT_NEAR(f.ratio, 64.0 * 64 / 32768, 64.0 * 64 / 32768 * 64 / 4096);
  EXPECT_THROW(cost::theta_forms(square(8, 8), 0.0), Error);
}

TEST(CostModel, WorkByHand) {
  // Non-causal N = 4096, d = 64: forward 4·N²·d = 2³², backward 10·N²·d (2.5× forward) of
  // which 2·N²·d recompute S; standard backward from the stored P: 8·N²·d.
  const cost::Work w = cost::work(square(4096, 64));
  const double n2d = 4096.0 * 4096 * 64;
  EXPECT_DOUBLE_EQ(w.forward, 4294967296.0);
  EXPECT_DOUBLE_EQ(w.backward, 10 * n2d);
  EXPECT_DOUBLE_EQ(w.backward_recompute, 2 * n2d);
  EXPECT_DOUBLE_EQ(w.standard_forward, w.forward);
  EXPECT_DOUBLE_EQ(w.standard_backward, 8 * n2d);
  EXPECT_DOUBLE_EQ(w.exp_forward, 4096.0 * 4096);
  // Causal: N(N+1)/2 visible pairs; standard attention still computes all N².
  const cost::Work c = cost::work(square(100, 8, true));
  EXPECT_EQ(c.visible_pairs, 5050);
  EXPECT_DOUBLE_EQ(c.forward, 2.0 * 5050 * 16);
  EXPECT_DOUBLE_EQ(c.standard_forward, 2.0 * 10000 * 16);
}

// ---- scaling laws --------------------------------------------------------------------

TEST(CostModel, TiledTrafficFallsAsOneOverM) {
  const AttentionProblem p = square(2048, 64);
  std::int64_t previous = 0;
  for (const std::int64_t br : {16, 32, 64, 128, 256}) {
    const std::int64_t kv = cost::flash_forward(p, Tiling{br, 64}).traffic.elements_of("K", false);
    if (previous != 0) EXPECT_EQ(2 * kv, previous) << "Br = " << br;  // M = Br·d doubled: half the K reads
    previous = kv;
  }
  // The backward streams the Q side once per K/V tile: ∝ 1/Bc.
  const std::int64_t q64 = cost::flash_backward(p, Tiling{64, 64}).traffic.elements_of("Q", false);
  const std::int64_t q128 = cost::flash_backward(p, Tiling{64, 128}).traffic.elements_of("Q", false);
  EXPECT_EQ(q64, 2 * q128);
}

TEST(CostModel, TrafficGrowsAsNSquared) {
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    const auto kv = [&](std::int64_t n) {
      return cost::flash_forward(square(n, 64, causal), Tiling{64, 64}).traffic.elements_of("V", false);
    };
    const auto s = [&](std::int64_t n) { return cost::standard_forward(square(n, 64, causal)).traffic.elements_of("S", true); };
    EXPECT_EQ(s(2048), 4 * s(1024));
    if (causal) {  // Q tile t of q = N/64 reads t + 1 tiles: 64·64·q(q + 1)/2, → 4× per doubling
      EXPECT_EQ(kv(1024), 64 * 64 * 16 * 17 / 2);
      EXPECT_EQ(kv(2048), 64 * 64 * 32 * 33 / 2);
    } else {
      EXPECT_EQ(kv(2048), 4 * kv(1024));
    }
  }
  // Causal tiles read about half of what full attention reads.
  const double ratio = static_cast<double>(cost::flash_forward(square(4096, 64, true), Tiling{64, 64}).traffic.elements()) /
                       static_cast<double>(cost::flash_forward(square(4096, 64), Tiling{64, 64}).traffic.elements());
  EXPECT_GT(ratio, 0.5);
  EXPECT_LT(ratio, 0.52);
}

TEST(CostModel, TiledMovesLessThanStandard) {
  const AttentionProblem p = square(4096, 128);
  EXPECT_LT(cost::flash_forward(p, Tiling{128, 128}).traffic.bytes(), cost::standard_forward(p).traffic.bytes());
  EXPECT_LT(cost::flash_backward(p, Tiling{64, 128}).traffic.bytes(), cost::standard_backward(p).traffic.bytes());
  EXPECT_THROW(cost::flash_forward(p, Tiling{0, 128}), Error);
  // pack_gqa's heads per item must divide the q heads of a kv head.
  const AttentionProblem gqa = AttentionProblem::from_sizes(1, 64, 512, 6, 2, 64, 64, DType::f32, {});
  EXPECT_EQ(cost::flash_forward(gqa, Tiling{16, 128, 1, false, 3}).tiles_computed, 2 * 4 * 4);
  expect_error([&] { cost::flash_forward(gqa, Tiling{16, 128, 1, false, 2}); },
               {"heads_per_item 2", "does not divide the 3 q heads of a kv head"});
}

// ---- measured counters equal the model -----------------------------------------------

struct CounterCase {
  const char* name;
  std::int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v;
  DType dtype;
  bool causal;
  std::int64_t window_left, window_right;
  int num_splits;
  std::int64_t block_q;
};

constexpr CounterCase kCounterCases[] = {
    {"ragged gqa", 2, 301, 203, 4, 2, 40, 24, DType::f32, false, -1, -1, 0, 0},
    {"causal bf16", 1, 517, 517, 2, 1, 64, 64, DType::bf16, true, -1, -1, 0, 0},
    {"window", 1, 260, 390, 2, 2, 32, 32, DType::f16, false, 50, 20, 0, 0},
    {"block_q 8", 1, 200, 300, 1, 1, 16, 16, DType::f32, true, -1, -1, 0, 8},
    {"split-kv", 1, 20, 700, 2, 1, 32, 32, DType::f32, false, -1, -1, 3, 0},
    {"decode", 2, 1, 450, 8, 2, 64, 64, DType::bf16, false, -1, -1, 0, 0},
    // Few rows per q head of a GQA group: the planner packs them (pack_gqa), each K/V tile
    // counted once for the group's stacked rows.
    {"pack_gqa", 2, 13, 700, 8, 2, 32, 32, DType::f32, false, -1, -1, 0, 0},
    {"pack_gqa causal split", 1, 21, 450, 6, 2, 64, 40, DType::bf16, true, -1, -1, 2, 0},
};

AttentionOptions counter_options(const CounterCase& c, int threads) {
  AttentionOptions o;
  o.causal = c.causal;
  o.window_size = {c.window_left, c.window_right};
  o.num_splits = c.num_splits;
  o.block_q = c.block_q;
  o.num_threads = threads;
  return o;
}

TEST(CostModel, ForwardCountersEqualModel) {
  for (const CounterCase& c : kCounterCases)
    for (const int threads : {1, 3}) {
      SCOPED_TRACE(std::string(c.name) + " threads=" + std::to_string(threads));
      const Tensor q = random_tensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim}, 1);
      const Tensor k = random_tensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim}, 2);
      const Tensor v = random_tensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim_v}, 3);
      KernelCounters counters;
      AttentionOptions o = counter_options(c, threads);
      o.counters = &counters;
      forward(q.view(), k.view(), v.view(), o);
      const AttentionProblem p = AttentionProblem::from_inputs(q.view(), k.view(), v.view(), o);
      const CpuForwardPlan plan = plan_forward(p, CpuHardware::detect(threads), c.num_splits, c.block_q);
      const cost::TiledAccount a = cost::flash_forward(p, cost::tiling_of(plan));
      const bool split = plan.splits > 1;
      if (std::string(c.name).starts_with("pack_gqa")) EXPECT_GT(plan.heads_per_item, 1) << plan.describe();
      EXPECT_EQ(counters.q_read, a.traffic.elements_of("Q", false));
      EXPECT_EQ(counters.k_read, a.traffic.elements_of("K", false));
      EXPECT_EQ(counters.v_read, a.traffic.elements_of("V", false));
      EXPECT_EQ(counters.o_written, a.traffic.elements_of(split ? "O partial" : "O", true));
      EXPECT_EQ(counters.lse_written, a.traffic.elements_of(split ? "lse partial" : "lse", true));
      EXPECT_EQ(counters.tiles_computed, a.tiles_computed);
      EXPECT_EQ(counters.tiles_skipped, a.tiles_skipped);
      EXPECT_EQ(counters.scores, a.scores);
      EXPECT_GT(counters.tiles_computed, 0);
      // Packing (measured only: it depends on which thread ran which item): without masks
      // every kv head is packed whole at least once, and at most once per work item.
      const std::int64_t head_kv = c.seqlen_k * (c.head_dim + c.head_dim_v);
      if (plan.kernel == ForwardKernel::tiled && !c.causal && c.window_left < 0) {
        EXPECT_GE(counters.kv_packed, c.batch * c.heads_kv * head_kv);
        EXPECT_LE(counters.kv_packed, plan.work_items * head_kv);
      }
    }
}

TEST(CostModel, BackwardCountersEqualModel) {
  for (const CounterCase& c : kCounterCases)
    for (const int threads : {1, 3}) {
      SCOPED_TRACE(std::string(c.name) + " threads=" + std::to_string(threads));
      const Tensor q = random_tensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim}, 4);
      const Tensor k = random_tensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim}, 5);
      const Tensor v = random_tensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim_v}, 6);
      const Tensor dout = random_tensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim_v}, 7);
      AttentionOptions o = counter_options(c, threads);
      const ForwardResult f = forward(q.view(), k.view(), v.view(), o);
      KernelCounters counters;
      o.counters = &counters;
      backward(dout.view(), q.view(), k.view(), v.view(), f.out.view(), f.lse.view(), o);
      const AttentionProblem p = AttentionProblem::from_inputs(q.view(), k.view(), v.view(), o);
      const CpuBackwardPlan plan = plan_backward(p, CpuHardware::detect(threads), false);
      const cost::Traffic& t = cost::flash_backward(p, cost::tiling_of(plan)).traffic;
      const cost::TiledAccount a = cost::flash_backward(p, cost::tiling_of(plan));
      EXPECT_EQ(counters.q_read, t.elements_of("Q", false));
      EXPECT_EQ(counters.k_read, t.elements_of("K", false));
      EXPECT_EQ(counters.v_read, t.elements_of("V", false));
      EXPECT_EQ(counters.o_read, t.elements_of("O", false));
      EXPECT_EQ(counters.dout_read, t.elements_of("dO", false));
      EXPECT_EQ(counters.stats_read, t.elements_of("lse", false) + t.elements_of("D", false));
      EXPECT_EQ(counters.dq_accum_read, t.elements_of("dQ accum", false));
      EXPECT_EQ(counters.dq_accum_written, t.elements_of("dQ accum", true));
      EXPECT_EQ(counters.dq_written, t.elements_of("dQ", true));
      EXPECT_EQ(counters.dk_written, t.elements_of("dK", true));
      EXPECT_EQ(counters.dv_written, t.elements_of("dV", true));
      EXPECT_EQ(counters.tiles_computed, a.tiles_computed);
      EXPECT_EQ(counters.tiles_skipped, a.tiles_skipped);
      EXPECT_EQ(counters.scores, a.scores);
    }
}

TEST(CostModel, CountersAddUpAndAreOffByDefault) {
  const Tensor q = random_tensor(DType::f32, {1, 70, 2, 16}, 8);
  const Tensor k = random_tensor(DType::f32, {1, 90, 2, 16}, 9);
  KernelCounters once, twice;
  AttentionOptions o;
  o.counters = &once;
  forward(q.view(), k.view(), k.view(), o);
  o.counters = &twice;
  forward(q.view(), k.view(), k.view(), o);
  forward(q.view(), k.view(), k.view(), o);
  EXPECT_EQ(twice.k_read, 2 * once.k_read);
  EXPECT_EQ(twice.tiles_computed, 2 * once.tiles_computed);
  EXPECT_EQ(AttentionOptions{}.counters, nullptr);
}

TEST(CostModel, BlockQOverrideKeepsTheResult) {
  // The tile sweep's knob changes the schedule, not the mathematics: every row is still
  // computed over the same K/V tiles in the same order, so the output is bit-identical.
  // One split: with fewer Q tiles (Br 500: one per head) the planner would split the keys,
  // and split-KV merges partial results — other roundings, which the bf16 kernel's P
  // (rounded against each split's own maximum) shows in the bf16 output.
  const Tensor q = random_tensor(DType::bf16, {1, 203, 3, 40}, 10);
  const Tensor k = random_tensor(DType::bf16, {1, 157, 3, 40}, 11);
  const Tensor v = random_tensor(DType::bf16, {1, 157, 3, 24}, 12);
  AttentionOptions o;
  o.causal = true;
  o.num_splits = 1;
  const ForwardResult planned = forward(q.view(), k.view(), v.view(), o);
  for (const std::int64_t bq : {1, 8, 36, 500}) {
    o.block_q = bq;
    const ForwardResult swept = forward(q.view(), k.view(), v.view(), o);
    for (std::int64_t i = 0; i < planned.out.numel(); ++i) ASSERT_EQ(swept.out.get(i), planned.out.get(i)) << "Br " << bq;
  }
  o.block_q = -1;
  EXPECT_THROW(forward(q.view(), k.view(), v.view(), o), Error);
}

TEST(CostModel, KernelSwitchesKeepTheResultAndChangeTheCounters) {
  // The measurement switches change what the kernel re-does, not its arithmetic: the output
  // is bit-identical. With K/V packing reuse off every Q tile packs the K/V it streams, so
  // kv_packed equals the model's raw K + V count (the cache rule's "every restream");
  // with it on, each head is packed at least once, the model's once-per-head count. Prefetch
  // changes no counter.
  const std::int64_t n = 300, heads = 2, d = 40, dv = 24;
  const Tensor q = random_tensor(DType::f32, {1, n, heads, d}, 20);
  const Tensor k = random_tensor(DType::f32, {1, n, heads, d}, 21);
  const Tensor v = random_tensor(DType::f32, {1, n, heads, dv}, 22);
  AttentionOptions o;
  o.num_splits = 1;
  o.block_q = 32;
  o.num_threads = 2;
  KernelCounters on;
  o.counters = &on;
  const ForwardResult reference = forward(q.view(), k.view(), v.view(), o);
  const AttentionProblem p = AttentionProblem::from_inputs(q.view(), k.view(), v.view(), o);
  const CpuForwardPlan plan = plan_forward(p, CpuHardware::detect(2), 1, 32);
  ASSERT_EQ(plan.kernel, ForwardKernel::tiled);
  const cost::TiledAccount model = cost::flash_forward(p, cost::tiling_of(plan));
  const std::int64_t streamed = model.traffic.elements_of("K", false) + model.traffic.elements_of("V", false);
  EXPECT_GE(on.kv_packed, heads * n * (d + dv));
  EXPECT_LT(on.kv_packed, streamed);
  for (const bool reuse : {true, false})
    for (const bool prefetch : {true, false}) {
      SCOPED_TRACE(std::string("reuse ") + (reuse ? "on" : "off") + ", prefetch " + (prefetch ? "on" : "off"));
      KernelCounters c;
      o.counters = &c;
      o.switches.reuse_packed_kv = reuse;
      o.switches.software_prefetch = prefetch;
      const ForwardResult r = forward(q.view(), k.view(), v.view(), o);
      for (std::int64_t i = 0; i < r.out.numel(); ++i) ASSERT_EQ(r.out.get(i), reference.out.get(i));
      EXPECT_EQ(c.k_read + c.v_read, streamed);
      EXPECT_EQ(c.tiles_computed, on.tiles_computed);
      if (!reuse) EXPECT_EQ(c.kv_packed, streamed);
      if (reuse) EXPECT_LT(c.kv_packed, streamed);
    }
  // Normalizing at every tile (FlashAttention-1) instead of once: the same tiles and traffic,
  // the output equal to float32 rounding; the model adds Br·Bc + (1 − rescale share)·Br·Dv
  // FP32 operations per tile (B200, 128×128×128: 16384 / 128 = 128 cycles with every tile rescaling).
  o.switches = {};
  o.switches.deferred_normalization = false;
  KernelCounters c;
  o.counters = &c;
  const ForwardResult r = forward(q.view(), k.view(), v.view(), o);
  bool tiled_apart = false;
  for (std::int64_t i = 0; i < r.out.numel(); ++i) {
    ASSERT_NEAR(r.out.get(i), reference.out.get(i), 2e-6 + 2e-6 * std::fabs(reference.out.get(i))) << i;
    tiled_apart |= r.out.get(i) != reference.out.get(i);
  }
  EXPECT_TRUE(tiled_apart);
  for (std::int64_t i = 0; i < r.lse.numel(); ++i) ASSERT_EQ(r.lse.get(i), reference.lse.get(i)) << i;
  EXPECT_EQ(c.k_read + c.v_read, streamed);
  EXPECT_EQ(c.scores, on.scores);
  // The decode kernel's softmax rows take the same switch.
  const Tensor dq = random_tensor(DType::f32, {2, 1, 4, d}, 23);
  const Tensor dk = random_tensor(DType::f32, {2, 700, 2, d}, 24);
  const Tensor dvv = random_tensor(DType::f32, {2, 700, 2, d}, 25);
  AttentionOptions od;
  od.kernel = ForwardKernel::decode;
  const ForwardResult decode_on = forward(dq.view(), dk.view(), dvv.view(), od);
  od.switches.deferred_normalization = false;
  const ForwardResult decode_off = forward(dq.view(), dk.view(), dvv.view(), od);
  const AttentionProblem pd = AttentionProblem::from_inputs(dq.view(), dk.view(), dvv.view(), od);
  ASSERT_EQ(plan_forward(pd, CpuHardware::detect(0), 0, 0, ForwardKernel::decode).kernel, ForwardKernel::decode);
  bool rounded_apart = false;  // the switch acted: other roundings somewhere
  for (std::int64_t i = 0; i < decode_on.out.numel(); ++i) {
    ASSERT_NEAR(decode_off.out.get(i), decode_on.out.get(i), 2e-6 + 2e-6 * std::fabs(decode_on.out.get(i))) << i;
    rounded_apart |= decode_off.out.get(i) != decode_on.out.get(i);
  }
  EXPECT_TRUE(rounded_apart);
  const cost::Architecture& b200 = cost::gpu_architecture("b200");
  cost::TileOptions every_tile{DType::bf16};
  every_tile.deferred_normalization = false;
  EXPECT_DOUBLE_EQ(cost::forward_tile_cycles(b200, 128, 128, 128, 128, every_tile).fma -
                       cost::forward_tile_cycles(b200, 128, 128, 128, 128, {DType::bf16}).fma,
                   128.0);
}

TEST(CostModel, QTileParallelismSwitchIsFlashAttention1Partitioning) {
  // Off: one work item per (batch, head) with all its rows in one Q tile, whatever block_q and
  // num_splits ask — the plan the model is given says so, and the counters agree with the
  // model's account of that tiling: one Q tile per head, each key tile streamed once per head.
  const std::int64_t n = 300, heads = 3, d = 40, dv = 24;
  const Tensor q = random_tensor(DType::f32, {2, n, heads, d}, 30);
  const Tensor k = random_tensor(DType::f32, {2, n, heads, d}, 31);
  const Tensor v = random_tensor(DType::f32, {2, n, heads, dv}, 32);
  AttentionOptions o;
  o.block_q = 32;
  o.num_splits = 3;
  o.num_threads = 2;
  const ForwardResult reference = forward(q.view(), k.view(), v.view(), o);
  o.switches.q_tile_parallelism = false;
  KernelCounters c;
  o.counters = &c;
  const ForwardResult r = forward(q.view(), k.view(), v.view(), o);
  for (std::int64_t i = 0; i < r.out.numel(); ++i)
    ASSERT_NEAR(r.out.get(i), reference.out.get(i), 2e-6 + 2e-6 * std::fabs(reference.out.get(i))) << i;
  for (std::int64_t i = 0; i < r.lse.numel(); ++i)
    ASSERT_NEAR(r.lse.get(i), reference.lse.get(i), 2e-6 + 2e-6 * std::fabs(reference.lse.get(i))) << i;
  const AttentionProblem p = AttentionProblem::from_inputs(q.view(), k.view(), v.view(), o);
  const CpuForwardPlan plan = plan_forward(p, CpuHardware::detect(2), o);
  EXPECT_EQ(plan.q_blocks, 1);
  EXPECT_EQ(plan.splits, 1);
  EXPECT_EQ(plan.work_items, 2 * heads);
  const cost::TiledAccount model = cost::flash_forward(p, cost::tiling_of(plan));
  EXPECT_EQ(c.tiles_computed, model.tiles_computed);
  EXPECT_EQ(c.tiles_computed, 2 * heads * ((n + plan.block_k - 1) / plan.block_k));
  EXPECT_EQ(c.k_read + c.v_read, model.traffic.elements_of("K", false) + model.traffic.elements_of("V", false));
  EXPECT_EQ(c.k_read + c.v_read, 2 * heads * n * (d + dv));
  // On (FlashAttention-2): block_q = 32, rounded up to the micro-kernel's rows on this SIMD
  // target, gives several Q tiles per head, each streaming the keys.
  o.switches.q_tile_parallelism = true;
  const CpuForwardPlan fa2 = plan_forward(p, CpuHardware::detect(2), o);
  EXPECT_GE(fa2.block_q, 32);
  EXPECT_LT(fa2.block_q, 64);
  EXPECT_EQ(fa2.q_blocks, (n + fa2.block_q - 1) / fa2.block_q);
}

// ---- hardware table: per-tile cycles by hand -----------------------------------------

TEST(CostModel, B200TileCyclesByHand) {
  // FlashAttention-4's feeds and speeds: 8192 FLOP/clk/SM, 16 exp/clk/SM, 128 B/clk/SM.
  const cost::Architecture& b200 = cost::gpu_architecture("b200");
  const cost::TileOptions bf16{DType::bf16};
  // Forward 128×128×128: MMA 2·128·128·256 / 8192 = 1024; exp 128·128 / 16 = 1024;
  // smem 2 bytes·(3·128·128) / 128 = 768; FP32 pipes (4·128·128 + 128·128) / 128 = 640.
  const cost::UnitCycles f = cost::forward_tile_cycles(b200, 128, 128, 128, 128, bf16);
  EXPECT_DOUBLE_EQ(f.mma, 1024);
  EXPECT_DOUBLE_EQ(f.exp, 1024);
  EXPECT_DOUBLE_EQ(f.smem, 768);
  EXPECT_DOUBLE_EQ(f.fma, 640);
  EXPECT_EQ(f.bottleneck(), "mma=exp");
  // A quarter of the exponentials as cubic polynomials: exp 768, FP32 pipes
  // 640 + 0.25·16384·6 / 128 = 832; conditional rescaling at 10%: 512 + 12.8 + 192.
  cost::TileOptions poly = bf16;
  poly.poly_exp_fraction = 0.25;
  EXPECT_DOUBLE_EQ(cost::forward_tile_cycles(b200, 128, 128, 128, 128, poly).exp, 768);
  EXPECT_DOUBLE_EQ(cost::forward_tile_cycles(b200, 128, 128, 128, 128, poly).fma, 832);
  EXPECT_EQ(cost::forward_tile_cycles(b200, 128, 128, 128, 128, poly).bottleneck(), "mma");
  poly.rescale_fraction = 0.1;
  EXPECT_DOUBLE_EQ(cost::forward_tile_cycles(b200, 128, 128, 128, 128, poly).fma, 512 + 12.8 + 192);
  // Backward: MMA 2·128·128·640 / 8192 = 2560; smem (2 bytes·10·128·128 + 2·4·128·128) / 128
  // = 3584; with 2-CTA (2 bytes·7.5·128·128 + 4·128·128) / 128 = 2432, below the MMA.
  const cost::UnitCycles b = cost::backward_tile_cycles(b200, 128, 128, 128, 128, bf16);
  EXPECT_DOUBLE_EQ(b.mma, 2560);
  EXPECT_DOUBLE_EQ(b.smem, 3584);
  EXPECT_EQ(b.bottleneck(), "smem");
  cost::TileOptions two_cta = bf16;
  two_cta.two_cta = true;
  const cost::UnitCycles b2 = cost::backward_tile_cycles(b200, 128, 128, 128, 128, two_cta);
  EXPECT_DOUBLE_EQ(b2.smem, 2432);
  EXPECT_EQ(b2.bottleneck(), "mma");
}

TEST(CostModel, OtherArchitecturesByHand) {
  // H100: 4096 FLOP/clk/SM: forward MMA 2048 cycles, exp 1024 — exp needs half the MMA's
  // time, FlashAttention-3's "50% of the cycles" at d = 128.
  const cost::UnitCycles h = cost::forward_tile_cycles(cost::gpu_architecture("h100"), 128, 128, 128, 128, {});
  EXPECT_DOUBLE_EQ(h.mma, 2048);
  EXPECT_DOUBLE_EQ(h.exp, 1024);
  EXPECT_EQ(h.bottleneck(), "mma");
  // B300 doubles the exp unit: 512 cycles, the MMA alone bounds the forward.
  const cost::UnitCycles u = cost::forward_tile_cycles(cost::gpu_architecture("b300"), 128, 128, 128, 128, {});
  EXPECT_DOUBLE_EQ(u.exp, 512);
  EXPECT_EQ(u.bottleneck(), "mma");
  // A100, d = 64: MMA 2·128·128·128 / 2048 = 2048; FP32 pipes (4·128·128 + 128·64) / 64 = 1152.
  const cost::UnitCycles a = cost::forward_tile_cycles(cost::gpu_architecture("a100-80gb"), 128, 128, 64, 64, {});
  EXPECT_DOUBLE_EQ(a.mma, 2048);
  EXPECT_DOUBLE_EQ(a.fma, 1152);
  // Whole-chip rates derived back: H100 989.4 TFLOPS, A100 312 TFLOPS, B200 2.25 PFLOPS dense.
  EXPECT_NEAR(cost::gpu_architecture("h100").peak_flops(DType::bf16), 989.4e12, 0.1e12);
  EXPECT_NEAR(cost::gpu_architecture("a100-40gb").peak_flops(DType::f16), 311.9e12, 0.1e12);
  EXPECT_NEAR(cost::gpu_architecture("b200").peak_flops(DType::bf16), 2.25e15, 1e9);
  EXPECT_EQ(cost::gpu_architecture("a100-40gb").mma_fp8, 0.0);  // Ampere has no FP8
  EXPECT_THROW(cost::gpu_architecture("v100"), Error);
}

TEST(CostModel, CpuArchitectureDerivedByHand) {
  CpuHardware hw;
  hw.threads = 2;
  hw.float_lanes = 8;  // AVX2
  hw.l2_bytes = 512 * 1024;
  hw.simd_target = "AVX2";
  const cost::Architecture cpu = cost::cpu_architecture(hw, {3.0, 96.0, 20.0});
  EXPECT_DOUBLE_EQ(cpu.mma_tf32, 16.0);  // 96 GFLOP/s / (2 cores · 3 GHz)
  EXPECT_DOUBLE_EQ(cpu.fp32_lanes, 16.0);  // 8 lanes · 2 FMA pipes
  // Exp2 and Exp2Poly3 on AVX2: 10 shared vector instructions plus 5 and 3 FMAs.
  EXPECT_DOUBLE_EQ(cpu.exp_per_clock, 16.0 / 15.0);
  EXPECT_DOUBLE_EQ(cpu.poly_exp_ops, 13.0);
  EXPECT_DOUBLE_EQ(cpu.smem_bytes_per_clock, 64.0);  // 2 loads of 32 bytes
  EXPECT_DOUBLE_EQ(cpu.hbm_bytes_per_second, 20e9);
  // Forward tile 64×128×64 on the shared FMA pipes: MMA 2·64·128·128 / 16 = 131072,
  // exp 8192 / (16/15) = 7680, softmax (4·8192 + 64·64) / 16 = 2304; L1 4 bytes·(64·64 +
  // 2·128·64) / 64 = 1280. The pipes' sum bounds the tile.
  const cost::UnitCycles c = cost::forward_tile_cycles(cpu, 64, 128, 64, 64, {DType::f32});
  EXPECT_DOUBLE_EQ(c.mma, 131072);
  EXPECT_DOUBLE_EQ(c.exp, 7680);
  EXPECT_DOUBLE_EQ(c.fma, 2304);
  EXPECT_DOUBLE_EQ(c.smem, 1280);
  EXPECT_DOUBLE_EQ(c.time(), 131072 + 7680 + 2304);
  EXPECT_EQ(c.bottleneck(), "fma pipes");
  // Every exponential by Exp2Poly3: 8192 · 13 / 16 = 6656 cycles on the pipes instead of
  // 7680; a quarter of them: exp 7680 · 3/4 = 5760, fma 2304 + 1664.
  const cost::UnitCycles poly = cost::forward_tile_cycles(cpu, 64, 128, 64, 64, {DType::f32, 1.0});
  EXPECT_DOUBLE_EQ(poly.exp, 0);
  EXPECT_DOUBLE_EQ(poly.fma, 2304 + 6656);
  const cost::UnitCycles quarter = cost::forward_tile_cycles(cpu, 64, 128, 64, 64, {DType::f32, 0.25});
  EXPECT_DOUBLE_EQ(quarter.exp, 5760);
  EXPECT_DOUBLE_EQ(quarter.fma, 2304 + 1664);
  EXPECT_THROW(cost::cpu_architecture(hw, {0.0, 96.0, 20.0}), Error);
}

TEST(CostModel, PredictionIsConsistent) {
  // H100, non-causal N = 8192, d = 128, 16 heads: compute-bound; time = tiles · 2048 cycles
  // / (132 SMs · 1.83 GHz); utilisation = the MMA's share of the bottleneck = 1.
  AttentionOptions o;
  const AttentionProblem p = AttentionProblem::from_sizes(1, 8192, 8192, 16, 16, 128, 128, DType::bf16, o);
  const cost::Architecture& h100 = cost::gpu_architecture("h100");
  const cost::Prediction r = cost::predict_forward(p, h100, Tiling{128, 128}, {});
  const double tiles = 16.0 * 64 * 64;
  EXPECT_DOUBLE_EQ(r.compute_seconds, tiles * 2048 / (132 * 1.83e9));
  EXPECT_GT(r.compute_seconds, r.memory_seconds);
  EXPECT_EQ(r.bound, "mma");
  EXPECT_NEAR(r.utilisation, 1.0, 1e-12);
  EXPECT_FALSE(r.assumptions.empty());
  // The backward is 2.5× the work and bound by shared memory on B200.
  EXPECT_EQ(cost::predict_backward(p, cost::gpu_architecture("b200"), Tiling{128, 128}, {}).bound, "smem");
}

// The forward's schedule, which the kernels walk and the cost model counts: its items cover
// every query row of every (batch, head) once — one head's rows an item, every head's of a
// kv head (pack_gqa), or every head's (decode) — and the splits of a Q tile cut the keys its
// rows see into consecutive shares of whole tiles, in order, without overlap or gap.
TEST(CostModel, ForwardScheduleCoversEveryRowAndKeyOnce) {
  struct Shape {
    std::int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv;
    bool causal;
    std::int64_t left, right;
  };
  const Shape shapes[] = {{2, 77, 301, 4, 2, false, -1, -1}, {1, 130, 130, 3, 1, true, -1, -1},
                          {1, 5, 1000, 2, 2, false, 100, 0}, {3, 1, 257, 8, 2, false, -1, -1},
                          {1, 64, 700, 1, 1, true, 37, -1}};
  for (const Shape& sh : shapes)
    for (const int mode : {0, 1, 2})  // tiled, tiled under pack_gqa, decode
      for (const std::int64_t splits : {1, 2, 3, 7}) {
        const bool decode = mode == 2;
        const std::int64_t heads_per_item = mode == 1 ? sh.heads_q / sh.heads_kv : 1;
        AttentionOptions o;
        o.causal = sh.causal;
        o.window_size = {sh.left, sh.right};
        const AttentionProblem p = AttentionProblem::from_sizes(sh.batch, sh.seqlen_q, sh.seqlen_k, sh.heads_q,
                                                                sh.heads_kv, 16, 16, DType::f32, o);
        const std::int64_t bq = 32, bc = 64;
        const ForwardSchedule s{bq, bc, decode ? 1 : (p.seqlen_q + bq - 1) / bq, splits, decode, heads_per_item};
        SCOPED_TRACE(p.describe() + (decode ? " decode" : " tiled") + " heads_per_item " +
                     std::to_string(heads_per_item) + " splits " + std::to_string(splits));
        const std::int64_t items = forward_work_items(p, s);
        ASSERT_EQ(items, decode ? p.batch * splits : p.batch * p.heads_q / heads_per_item * s.q_blocks * splits);
        // The items of one (batch, kv head) group are consecutive (the driver hands them out whole).
        const std::int64_t per_group = forward_items_per_kv_head(p, s);
        ASSERT_EQ(items % per_group, 0);
        for (std::int64_t item = 0; item < items; ++item) {
          const ForwardWorkItem w = forward_work_item(p, s, item);
          const std::int64_t group = item / per_group;
          if (decode) {
            EXPECT_EQ(w.batch, group);
          } else {
            EXPECT_EQ(w.batch * p.heads_kv + w.head / (p.heads_q / p.heads_kv), group) << "item " << item;
            EXPECT_EQ(w.heads, heads_per_item);
            EXPECT_EQ((w.head + w.heads - 1) / (p.heads_q / p.heads_kv), w.head / (p.heads_q / p.heads_kv))
                << "item " << item << ": its heads share one kv head";
          }
        }
        // (batch, head, row) → how often an item computes it; (batch, head, q block) → next key
        std::vector<int> rows_seen(static_cast<std::size_t>(p.batch * p.heads_q * p.seqlen_q), 0);
        for (std::int64_t item = 0; item < items; item += splits) {
          const ForwardWorkItem first = forward_work_item(p, s, item);
          const AttentionProblem::KeyRange lo = p.key_range(first.row_begin);
          const AttentionProblem::KeyRange hi = p.key_range(first.row_begin + first.rows - 1);
          std::int64_t next = lo.begin;  // where the next split's share must begin
          for (std::int64_t split = 0; split < splits; ++split) {
            const ForwardWorkItem w = forward_work_item(p, s, item + split);
            EXPECT_EQ(w.split, split);
            EXPECT_EQ(w.batch, first.batch);
            EXPECT_EQ(w.head, first.head);
            EXPECT_EQ(w.row_begin, first.row_begin);
            if (w.key_begin >= w.key_end) continue;  // an empty share
            EXPECT_EQ(w.key_begin, next);
            if (decode)  // equal shares, to a key
              EXPECT_LE(std::abs((w.key_end - w.key_begin) * splits - (std::max(lo.begin, hi.end) - lo.begin)), splits)
                  << "decode shares are equal";
            else
              EXPECT_TRUE(w.key_begin == lo.begin || w.key_begin % bc == 0) << "shares start on a tile";
            EXPECT_EQ(w.first_block, decode ? w.key_begin : w.key_begin / bc * bc);
            next = w.key_end;
          }
          EXPECT_EQ(next, std::max(lo.begin, hi.end)) << "the shares end where the rows' keys end";
          const std::int64_t heads = decode ? p.heads_q : first.heads;
          for (std::int64_t h = 0; h < heads; ++h)
            for (std::int64_t i = first.row_begin; i < first.row_begin + first.rows; ++i)
              ++rows_seen[static_cast<std::size_t>((first.batch * p.heads_q + first.head + h) * p.seqlen_q + i)];
        }
        for (const int seen : rows_seen) ASSERT_EQ(seen, 1);
      }
}

}  // namespace
}  // namespace flashattn::test
