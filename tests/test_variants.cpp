// Sliding window, softcap, ALiBi, dropout, block-sparse attention and attention sinks — alone and in the
// combinations users meet — forward and backward against the float64 reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <sstream>

#include "src/cpu/kernels/mask_blocks.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

struct Shape {
  std::int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v;
};

// Holds the side inputs (slopes, block mask) that options point to.
struct Variant {
  AttentionOptions options;
  Tensor alibi, block_mask, sinks, attn_mask;
  std::string name;
};

Variant make_variant(const Shape& s, const std::string& name, std::uint64_t seed) {
  Variant v;
  v.name = name;
  std::mt19937_64 rng(seed);
  auto has = [&](const char* key) { return name.find(key) != std::string::npos; };
  if (has("causal")) v.options.causal = true;
  if (has("topleft")) v.options.causal_alignment = CausalAlignment::top_left;
  if (has("window")) v.options.window_size = {37, v.options.causal ? 0 : 11};
  if (has("leftonly")) v.options.window_size = {20, -1};
  if (has("rightonly")) v.options.window_size = {-1, 5};
  if (has("softcap")) v.options.softcap = 1.5f;
  if (has("alibi")) {
    const bool per_batch = has("alibi2");
    v.alibi = per_batch ? Tensor(DType::f32, {s.batch, s.heads_q}) : Tensor(DType::f32, {s.heads_q});
    for (std::int64_t i = 0; i < v.alibi.numel(); ++i) v.alibi.set(i, std::exp2(-1.0f - 0.7f * static_cast<float>(i)));
    v.options.alibi_slopes = v.alibi.view();
  }
  if (has("sinks")) {  // logits around the scores' own range, some above every score
    v.sinks = Tensor(DType::f32, {s.heads_q});
    for (std::int64_t i = 0; i < v.sinks.numel(); ++i) v.sinks.set(i, static_cast<float>(rng() % 600) / 100.0f - 2.0f);
    v.options.sinks = v.sinks.view();
  }
  if (has("split3")) v.options.num_splits = 3;
  if (has("nodefer")) v.options.switches.deferred_normalization = false;
  if (has("dropout")) {
    v.options.dropout_p = 0.17f;
    v.options.seed = seed;
    v.options.offset = 5;
  }
  if (has("blocks")) {
    const std::int64_t bs = has("blocks16") ? 16 : 50;
    v.block_mask = Tensor(DType::u8, {(s.seqlen_q + bs - 1) / bs, (s.seqlen_k + bs - 1) / bs});
    for (std::int64_t i = 0; i < v.block_mask.numel(); ++i) v.block_mask.set(i, rng() % 3 != 0 ? 1.0f : 0.0f);
    v.options.block_mask = v.block_mask.view();
    v.options.block_mask_block_size = bs;
  }
  // attn_mask: "bmask" boolean (B, Hq, Sq, Sk) with whole rows and 16-key runs hidden, "bmask1"
  // boolean (1, 1, Sq, Sk), "bias" f32 (B, 1, Sq, Sk) with some −∞, "biasbf16" bf16 (1, Hq, 1, Sk),
  // "biasfull" f32 (B, Hq, Sq, Sk), "bias11" f32 (1, 1, Sq, Sk), "biash" f32 (1, Hq, 1, Sk),
  // "biasf16" f16 (B, 1, Sq, Sk), "biascol" f32 (B, Hq, Sq, 1).
  // "dbias" (a bias, (B, 1, Sq, Sk) unless another is named) also asks the backward for dbias.
  // Boolean masks with whole tiles kept, hidden and mixed (the kernels' summary, empty /
  // full / partial): keys in bands of 256 — band 0 kept, band 1 hidden, the rest random —
  // swapped for rows from 150 on and in odd (batch, head) planes. "bmasktiles" (B, Hq, Sq, Sk),
  // "bmasktiles11" (1, 1, Sq, Sk), "bmaskkeys" (1, Hq, 1, Sk), "bmaskrows" (B, 1, Sq, 1).
  // "biastiles" (B, Hq, Sq, Sk) float32, "biastilesbf16" (1, 1, Sq, Sk) bf16: the same bands as
  // a bias, hidden keys −∞ (the forward's summary: empty blocks), kept ones a value in [−2, 2).
  if (has("bmasktiles") || has("bmaskkeys") || has("bmaskrows") || has("biastiles")) {
    const bool bias = has("biastiles");
    const std::vector<std::int64_t> shape =
        has("bmasktiles11") || has("biastilesbf16") ? std::vector<std::int64_t>{1, 1, s.seqlen_q, s.seqlen_k}
        : has("bmasktiles") || bias ? std::vector<std::int64_t>{s.batch, s.heads_q, s.seqlen_q, s.seqlen_k}
        : has("bmaskkeys")  ? std::vector<std::int64_t>{1, s.heads_q, 1, s.seqlen_k}
                            : std::vector<std::int64_t>{s.batch, 1, s.seqlen_q, 1};
    v.attn_mask = Tensor(!bias ? DType::u8 : has("biastilesbf16") ? DType::bf16 : DType::f32, shape);
    const std::int64_t rows = shape[2], cols = shape[3];
    for (std::int64_t e = 0; e < v.attn_mask.numel(); ++e) {
      const std::int64_t plane = e / (rows * cols), i = e / cols % rows, j = e % cols;
      const bool swap = (i >= 150) != (plane % 2 == 1);
      const bool kept = has("bmaskrows") ? i % 5 != 2 : j / 256 == 0 ? !swap : j / 256 == 1 ? swap : rng() % 3 != 0;
      if (bias)
        v.attn_mask.set(e, kept ? static_cast<float>(rng() % 400) / 100.0f - 2.0f : -std::numeric_limits<float>::infinity());
      else
        v.attn_mask.set(e, kept ? 1.0f : 0.0f);
    }
    v.options.attn_mask = v.attn_mask.view();
  } else if (has("bmask") || has("bias")) {
    const bool boolean = has("bmask");
    const std::vector<std::int64_t> shape =
        has("bmask1") || has("bias11") ? std::vector<std::int64_t>{1, 1, s.seqlen_q, s.seqlen_k}
        : boolean || has("biasfull")   ? std::vector<std::int64_t>{s.batch, s.heads_q, s.seqlen_q, s.seqlen_k}
        : has("biasbf16") || has("biash") ? std::vector<std::int64_t>{1, s.heads_q, 1, s.seqlen_k}
        : has("biascol")                  ? std::vector<std::int64_t>{s.batch, s.heads_q, s.seqlen_q, 1}
                                          : std::vector<std::int64_t>{s.batch, 1, s.seqlen_q, s.seqlen_k};
    v.attn_mask = Tensor(boolean             ? DType::u8
                         : has("biasbf16") ? DType::bf16
                         : has("biasf16")  ? DType::f16
                                           : DType::f32,
                         shape);
    const std::int64_t sk = shape[3];
    for (std::int64_t e = 0; e < v.attn_mask.numel(); ++e) {
      const std::int64_t row = e / sk, col = e % sk;
      if (boolean)
        v.attn_mask.set(e, row % 7 == 3 || (col / 16) % 3 == 1 || rng() % 5 == 0 ? 0.0f : 1.0f);
      else
        v.attn_mask.set(e, rng() % 11 == 0 ? -std::numeric_limits<float>::infinity()
                                           : static_cast<float>(rng() % 400) / 100.0f - 2.0f);
    }
    v.options.attn_mask = v.attn_mask.view();
  }
  return v;
}

void check_variant(const Shape& s, const std::string& name, DType dtype, std::uint64_t seed,
                   bool deterministic = false, int threads = 2) {
  std::ostringstream trace;
  trace << name << " dtype=" << to_string(dtype) << " B=" << s.batch << " Sq=" << s.seqlen_q
        << " Sk=" << s.seqlen_k << " Hq=" << s.heads_q << " Hkv=" << s.heads_kv << " D=" << s.head_dim
        << " Dv=" << s.head_dim_v << " det=" << deterministic << " seed=" << seed;
  SCOPED_TRACE(trace.str());
  Variant var = make_variant(s, name, seed);
  AttentionOptions& o = var.options;
  o.deterministic = deterministic;
  o.num_threads = threads;
  const Tensor q = random_tensor(dtype, {s.batch, s.seqlen_q, s.heads_q, s.head_dim}, seed);
  const Tensor k = random_tensor(dtype, {s.batch, s.seqlen_k, s.heads_kv, s.head_dim}, seed + 1);
  const Tensor v = random_tensor(dtype, {s.batch, s.seqlen_k, s.heads_kv, s.head_dim_v}, seed + 2);
  const Tensor dout = random_tensor(dtype, {s.batch, s.seqlen_q, s.heads_q, s.head_dim_v}, seed + 3);

  const ForwardResult fwd = forward(q.view(), k.view(), v.view(), o);
  const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
  const AttentionProblem p = AttentionProblem::from_inputs(q.view(), k.view(), v.view(), o);
  double tol_out = 1e-5;
  if (dtype != DType::f32) tol_out += 2.0 * naive_output_error(naive_same_precision(p, o, q, k, v), want.out, p.dtype, o.exp2);
  EXPECT_LE(max_abs_error(fwd.out, want.out), tol_out) << "out";
  expect_lse_near(fwd.lse, want.lse);

  Tensor dsinks(DType::f32, {s.heads_q});
  if (o.sinks.data != nullptr) o.dsinks = dsinks.view();
  // A loss on lse too: its gradient, random and non-zero, shifts each row's D.
  const Tensor dlse = name.find("dlse") != std::string::npos
                          ? random_tensor(DType::f32, {s.batch, s.heads_q, s.seqlen_q}, seed + 4)
                          : Tensor(DType::f32, {0});
  if (dlse.numel() > 0) o.dlse = dlse.view();
  const bool with_dbias = name.find("dbias") != std::string::npos;
  Tensor dbias(DType::f32, with_dbias ? var.attn_mask.shape() : std::vector<std::int64_t>{0});
  if (with_dbias) o.dbias = dbias.view();
  const BackwardResult got = backward(dout.view(), q.view(), k.view(), v.view(), fwd.out.view(),
                                      fwd.lse.view(), o);
  const reference::Gradients g = reference::attention_backward(dout.view(), q.view(), k.view(), v.view(), o);
  double tq = 1e-4, tk = 1e-4, tv = 1e-4;
  // dbias sums dS over its broadcast dims: float32 rounding grows with the terms per element.
  const double summed = with_dbias ? static_cast<double>(s.batch * s.heads_q * s.seqlen_q * s.seqlen_k) /
                                         static_cast<double>(dbias.numel())
                                   : 1.0;
  double tb = 1e-4 + 1e-5 * summed;
  if (dtype != DType::f32) {
    const NaiveGradients n = naive_backward_same_precision(p, o, dout, q, k, v);
    tq += 3.0 * yardstick_error(n.dq, g.dq, "the naive dq", INFINITY);
    tk += 3.0 * yardstick_error(n.dk, g.dk, "the naive dk", INFINITY);
    tv += 3.0 * yardstick_error(n.dv, g.dv, "the naive dv", INFINITY);
    if (with_dbias) tb += 3.0 * yardstick_error(n.dbias, g.dbias, "the naive dbias", INFINITY);
  }
  EXPECT_LE(max_abs_error(got.dq, g.dq), tq) << "dq";
  EXPECT_LE(max_abs_error(got.dk, g.dk), tk) << "dk";
  EXPECT_LE(max_abs_error(got.dv, g.dv), tv) << "dv";
  if (o.sinks.data != nullptr) EXPECT_LE(max_abs_error(dsinks, g.dsinks), 1e-4 * static_cast<double>(s.batch * s.seqlen_q)) << "dsinks";
  if (with_dbias) EXPECT_LE(max_abs_error(dbias, g.dbias), tb) << "dbias";
}

const Shape kShapes[] = {{1, 113, 203, 2, 1, 40, 40}, {2, 97, 97, 4, 2, 32, 24}, {1, 203, 113, 2, 2, 64, 64},
                         {2, 3, 150, 4, 2, 40, 40}};  // the last runs the decode kernel

// Each variant on every shape of kShapes, on one thread count per (shape, variant): 1, 2 and
// 3 threads take turns along both, so each variant meets every count over the four shapes and
// each shape every count (every count on every pair made these the ASan stage's slowest
// tests); the third count runs the deterministic mode.
void check_on_shapes(std::initializer_list<const char*> variants, std::uint64_t& seed) {
  for (std::size_t i = 0; i < std::size(kShapes); ++i) {
    std::size_t j = 0;
    for (const char* v : variants) {
      const int threads = static_cast<int>((i + j++) % 3) + 1;
      check_variant(kShapes[i], v, DType::f32, seed++, threads == 3, threads);
    }
  }
}

TEST(Variants, SlidingWindow) {
  std::uint64_t seed = 10;
  for (const Shape& s : kShapes)
    for (const char* v : {"window", "leftonly", "rightonly", "causal+window"}) check_variant(s, v, DType::f32, seed++);
}

// A window side that reaches past every key is the unbounded one, up to INT64_MAX (the key
// range's arithmetic overflowed there: rows saw no key): the same output and lse as no
// window, forward and backward, fewer queries than keys and more, both alignments.
TEST(Variants, HugeWindowSidesAreUnbounded) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  for (const auto& [sq, sk] : {std::pair<std::int64_t, std::int64_t>{37, 20}, {20, 37}})
    for (const bool causal : {false, true})
      for (const CausalAlignment alignment : {CausalAlignment::bottom_right, CausalAlignment::top_left}) {
        SCOPED_TRACE("Sq " + std::to_string(sq) + " Sk " + std::to_string(sk) + (causal ? " causal " : " ") +
                     to_string(alignment));
        const Tensor q = random_tensor(DType::f32, {2, sq, 2, 16}, 21), k = random_tensor(DType::f32, {2, sk, 2, 16}, 22);
        const Tensor v = random_tensor(DType::f32, {2, sk, 2, 16}, 23), dout = random_tensor(DType::f32, {2, sq, 2, 16}, 24);
        AttentionOptions o;
        o.causal = causal;
        o.causal_alignment = alignment;
        const ForwardResult want = forward(q.view(), k.view(), v.view(), o);
        const BackwardResult want_grads = backward(dout.view(), q.view(), k.view(), v.view(), want.out.view(),
                                                   want.lse.view(), o);
        using Window = AttentionOptions::WindowSize;
        for (const Window w : {Window{-1, kMax}, Window{kMax, -1}, Window{kMax, kMax}, Window{kMax - 3, kMax - 3},
                               Window{sq + sk, sq + sk}}) {
          if (causal && w.right > 0) continue;  // causal means right = 0
          SCOPED_TRACE("window (" + std::to_string(w.left) + ", " + std::to_string(w.right) + ")");
          o.window_size = w;
          const ForwardResult got = forward(q.view(), k.view(), v.view(), o);
          const auto differ = [](const Tensor& a, const Tensor& b) {
            double most = 0.0;
            for (std::int64_t i = 0; i < a.numel(); ++i) most = std::max<double>(most, std::fabs(a.get(i) - b.get(i)));
            return most;
          };
          EXPECT_LE(differ(got.out, want.out), 1e-6);
          EXPECT_LE(differ(got.lse, want.lse), 1e-5);
          const BackwardResult grads = backward(dout.view(), q.view(), k.view(), v.view(), got.out.view(),
                                                got.lse.view(), o);
          EXPECT_LE(differ(grads.dq, want_grads.dq), 1e-5);
          EXPECT_LE(differ(grads.dk, want_grads.dk), 1e-5);
          EXPECT_LE(differ(grads.dv, want_grads.dv), 1e-5);
        }
      }
}

TEST(Variants, Softcap) {
  std::uint64_t seed = 20;
  for (const Shape& s : kShapes)
    for (const char* v : {"softcap", "window+softcap", "causal+softcap"}) check_variant(s, v, DType::f32, seed++);
}

TEST(Variants, Alibi) {
  std::uint64_t seed = 30;
  for (const Shape& s : kShapes)
    for (const char* v : {"alibi", "alibi2", "causal+alibi", "window+alibi2"}) check_variant(s, v, DType::f32, seed++);
}

TEST(Variants, Dropout) {
  std::uint64_t seed = 40;
  for (const Shape& s : kShapes)
    for (const char* v : {"dropout", "causal+dropout", "window+softcap+dropout"}) {
      check_variant(s, v, DType::f32, seed, false);
      check_variant(s, v, DType::f32, seed++, true);
    }
}

TEST(Variants, BlockSparse) {
  std::uint64_t seed = 50;
  for (const Shape& s : kShapes)
    for (const char* v : {"blocks", "blocks16", "causal+blocks16", "blocks+alibi+softcap"})
      check_variant(s, v, DType::f32, seed, seed % 2 == 0), ++seed;
}

// Attention sinks (options.sinks): every forward kernel and the split-KV merge (the decode
// shape of kShapes, split3), alone and with softcap, ALiBi, windows, dropout, block masks;
// the backward's dq, dk, dv and dsinks.
TEST(Variants, Sinks) {
  std::uint64_t seed = 200;
  check_on_shapes({"sinks", "causal+sinks", "window+softcap+alibi+sinks", "sinks+split3", "sinks+nodefer",
                   "sinks+dropout+blocks16"},
                  seed);
  for_each_simd_target([&](const std::string&) {
    check_variant({1, 61, 77, 4, 2, 24, 24}, "window+softcap+alibi+sinks+split3", DType::f32, seed++, true, 3);
    check_variant({2, 2, 90, 4, 1, 40, 40}, "sinks+split3", DType::f32, seed++, false, 2);
  });
}

// The gradient of lse (options.dlse, a loss such as a z-loss on lse): dq, dk, dv, dsinks and
// dbias against the float64 reference's, with causal, windows, softcap, ALiBi, sinks, a
// bias, dropout and block masks, 1–3 threads (the deterministic mode on 3), every SIMD target.
TEST(Variants, LseGradient) {
  std::uint64_t seed = 250;
  check_on_shapes({"causal+dropout+dlse", "window+softcap+alibi+sinks+dlse", "bias+dbias+blocks16+dlse"}, seed);
  for_each_simd_target([&](const std::string&) {
    check_variant({1, 61, 77, 4, 2, 24, 24}, "causal+sinks+dlse", DType::f32, seed++, true, 3);
  });
}

// attn_mask (a dense boolean mask or additive bias, broadcast): every forward kernel (the
// decode shape of kShapes), alone and with causal, windows, softcap, ALiBi, dropout, block
// masks and sinks, 1–3 threads, every SIMD target; rows and tiles the mask hides entirely.
TEST(Variants, AttnMask) {
  std::uint64_t seed = 300;
  check_on_shapes({"bmask", "bmask1", "bias", "biasbf16", "biasf16", "biascol", "causal+bmask1",
                   "window+softcap+alibi+bias", "bmask+dropout+blocks16", "bias+sinks+split3"},
                  seed);
  for_each_simd_target([&](const std::string&) {
    check_variant({1, 61, 77, 4, 2, 24, 24}, "causal+bmask", DType::f32, seed++, true, 3);
    check_variant({2, 2, 90, 4, 1, 40, 40}, "bias+split3", DType::f32, seed++, false, 2);
  });
  check_variant({2, 97, 97, 4, 2, 32, 24}, "bmask", DType::bf16, seed++, false, 2);
  check_variant({2, 97, 97, 4, 2, 32, 24}, "bias", DType::bf16, seed++, false, 2);
}

// Biases of float32's largest magnitudes: a row whose every bias is finfo(float32).min (as
// transformers pads) weighs its keys alike — the mean of V, as the float64 definition and
// torch's SDPA — and one key biased +3e38 takes the row; bias·log2 e overflowed to ∓∞ (the
// first row was hidden whole: out 0, lse −∞; the second NaN). Rows of the tiled and decode
// kernels, f32 and bf16 biases (bf16's largest is 3.39e38), every SIMD target, the keys in one
// part and split (split-KV) in two and three parts of different sizes: the parts' partial
// results merged as one lse each weighed them alike (float32 rounds m + log ℓ to m there).
TEST(Variants, LargestFiniteBiasesAreBiasesNotHiddenKeys) {
  constexpr float kLowest = std::numeric_limits<float>::lowest();
  for_each_simd_target([&](const std::string&) {
    for (const std::int64_t sq : {1, 9})
      for (const DType bias_dtype : {DType::f32, DType::bf16})
        for (const int splits : {1, 2, 3}) {
        SCOPED_TRACE("Sq " + std::to_string(sq) + ", bias " + to_string(bias_dtype) + ", splits " +
                     std::to_string(splits));
        constexpr std::int64_t sk = 601;
        const Tensor q = random_tensor(DType::f32, {1, sq, 2, 16}, 61), k = random_tensor(DType::f32, {1, sk, 2, 16}, 62);
        const Tensor v = random_tensor(DType::f32, {1, sk, 2, 16}, 63);
        Tensor bias(bias_dtype, {1, 2, sq, sk});
        for (std::int64_t h = 0; h < 2; ++h)
          for (std::int64_t i = 0; i < sq; ++i)
            for (std::int64_t j = 0; j < sk; ++j) {
              const float lowest = bias_dtype == DType::f32 ? kLowest : -3.3e38f;
              // head 0: every bias the lowest; head 1: the lowest but for key 5 + i, +3e38
              bias.set((h * sq + i) * sk + j, h == 1 && j == 5 + i ? 3e38f : lowest);
            }
        AttentionOptions o;
        o.attn_mask = bias.view();
        o.num_splits = splits;
        PlansRun plans;
        o.plans_run = &plans;
        const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
        const ForwardResult got = forward(q.view(), k.view(), v.view(), o);
        ASSERT_EQ(plans.forward.size(), 1u);
        ASSERT_EQ(plans.forward[0].splits, splits);
        EXPECT_LE(max_abs_error(got.out, want.out), 1e-5);
        for (std::int64_t i = 0; i < got.lse.numel(); ++i) ASSERT_TRUE(std::isfinite(got.lse.get(i))) << "lse " << i;
        for (std::int64_t i = 0; i < sq; ++i)
          for (std::int64_t e = 0; e < 16; ++e) {  // head 1 of row i is V's row 5 + i
            ASSERT_FLOAT_EQ(got.out.get((i * 2 + 1) * 16 + e), v.get(((5 + i) * 2 + 1) * 16 + e));
          }
      }
  });
}

// Rows whose every visible score carries the same huge bias (a padding row of −1e4, −1e9 or
// float32's lowest on every key; its query zero, so the float64 scores are exactly the bias and
// P uniform over the keys it sees): their lse, m + log2 ℓ, rounds to m in float32 (exactly
// past 2^30), and a P recomputed from it summed to ℓ — gradients n times too large. The
// backward recomputes such rows' offsets from their own scores (counters.large_lse_rows);
// their gradients, dbias and dsinks (sinks at the rows' bias: the sink a (n + 1)th equal
// logit) match the reference as any row's do. Causal or not, 1 and 3 threads (the third
// deterministic), every SIMD target.
TEST(Variants, RowsWhoseEveryScoreIsHugeKeepNormalizedGradients) {
  // 69 large rows of 170: more than one group of LargeRowOffsets (8 micro-tiles of rows) on every target.
  const std::int64_t b = 2, sq = 170, sk = 150, hq = 4, hkv = 2, d = 24;
  const auto huge = [](std::int64_t i) {
    return i == 7 ? std::numeric_limits<float>::lowest() : i % 5 == 1 ? -1e4f : i % 5 == 3 ? -1e9f : 0.0f;
  };
  Tensor q = random_tensor(DType::f32, {b, sq, hq, d}, 71);
  const Tensor k = random_tensor(DType::f32, {b, sk, hkv, d}, 72), v = random_tensor(DType::f32, {b, sk, hkv, d}, 73);
  const Tensor dout = random_tensor(DType::f32, {b, sq, hq, d}, 74);
  Tensor bias = random_tensor(DType::f32, {b, 1, sq, sk}, 75);
  for (std::int64_t bi = 0; bi < b; ++bi)
    for (std::int64_t i = 0; i < sq; ++i) {
      if (huge(i) == 0.0f) continue;
      for (std::int64_t e = 0; e < hq * d; ++e) q.set((bi * sq + i) * hq * d + e, 0.0f);
      for (std::int64_t j = 0; j < sk; ++j) bias.set((bi * sq + i) * sk + j, huge(i));
    }
  Tensor sinks(DType::f32, {hq});
  for (std::int64_t h = 0; h < hq; ++h) sinks.set(h, -1e9f);
  for_each_simd_target([&](const std::string&) {
    for (const bool causal : {false, true})
      for (const bool with_sinks : {false, true})
        for (const int threads : {1, 3}) {
          SCOPED_TRACE(std::string(causal ? "causal" : "full") + (with_sinks ? ", sinks" : "") + ", threads " +
                       std::to_string(threads));
          // With sinks, the rows of −1e9 alone: the sink drowns the others' keys.
          Tensor mask = bias;
          if (with_sinks)
            for (std::int64_t e = 0; e < mask.numel(); ++e)
              if (mask.get(e) < -1e3f && mask.get(e) != -1e9f) mask.set(e, -1e9f);
          AttentionOptions o;
          o.causal = causal;
          o.attn_mask = mask.view();
          o.num_threads = threads;
          o.deterministic = threads == 3;
          if (with_sinks) o.sinks = sinks.view();
          const ForwardResult fwd = forward(q.view(), k.view(), v.view(), o);
          Tensor dbias(DType::f32, mask.shape()), dsinks(DType::f32, {hq});
          o.dbias = dbias.view();
          if (with_sinks) o.dsinks = dsinks.view();
          KernelCounters counters;
          o.counters = &counters;
          const BackwardResult got =
              backward(dout.view(), q.view(), k.view(), v.view(), fwd.out.view(), fwd.lse.view(), o);
          o.counters = nullptr;
          const reference::Gradients want =
              reference::attention_backward(dout.view(), q.view(), k.view(), v.view(), o);
          // Large: the huge rows that see a key, and with the sinks (−1e9) the rows that see none
          // (the first Sq − Sk rows under bottom-right causal), whose lse is the sink's.
          std::int64_t large_rows = 0;
          for (std::int64_t i = 0; i < sq; ++i) {
            const bool sees_keys = !causal || i >= sq - sk;
            large_rows += sees_keys ? huge(i) != 0.0f : with_sinks;
          }
          EXPECT_EQ(counters.large_lse_rows, b * hq * large_rows);
          EXPECT_LE(max_abs_error(got.dq, want.dq), 1e-4) << "dq";
          EXPECT_LE(max_abs_error(got.dk, want.dk), 1e-4) << "dk";
          EXPECT_LE(max_abs_error(got.dv, want.dv), 1e-4) << "dv";
          EXPECT_LE(max_abs_error(dbias, want.dbias), 1e-4 * static_cast<double>(hq)) << "dbias";
          if (with_sinks) EXPECT_LE(max_abs_error(dsinks, want.dsinks), 1e-4 * static_cast<double>(b * sq)) << "dsinks";
        }
  });
}

// A single head whose every row is large: its rows are recomputed as work items of their own
// (up to 8 micro-tiles of rows each), spread over the threads however few heads there are.
// The deterministic mode's gradients are the same bits on 1, 2 and 3 threads, and match the
// reference; every SIMD target. (Run under ThreadSanitizer by scripts/test.)
TEST(Variants, LargeRowsOfOneHeadSpreadOverTheThreads) {
  // Queries zero and one bias per row (−1e4, −1e9, float32's lowest), as in the test above: the
  // float64 scores are exactly the bias and P uniform over the keys.
  const std::int64_t sq = 130, sk = 40, d = 16;
  const Tensor q(DType::f32, {1, sq, 1, d}), k = random_tensor(DType::f32, {1, sk, 1, d}, 82);
  const Tensor v = random_tensor(DType::f32, {1, sk, 1, d}, 83), dout = random_tensor(DType::f32, {1, sq, 1, d}, 84);
  Tensor bias(DType::f32, {1, 1, sq, sk});
  for (std::int64_t i = 0; i < sq; ++i)
    for (std::int64_t j = 0; j < sk; ++j)
      bias.set(i * sk + j, i % 3 == 0 ? -1e4f : i % 3 == 1 ? -1e9f : std::numeric_limits<float>::lowest());
  for_each_simd_target([&](const std::string&) {
    AttentionOptions o;
    o.attn_mask = bias.view();
    o.deterministic = true;
    const ForwardResult fwd = forward(q.view(), k.view(), v.view(), o);
    const reference::Gradients want = reference::attention_backward(dout.view(), q.view(), k.view(), v.view(), o);
    std::vector<BackwardResult> runs;
    for (const int threads : {1, 2, 3}) {
      SCOPED_TRACE("threads " + std::to_string(threads));
      o.num_threads = threads;
      KernelCounters counters;
      o.counters = &counters;
      runs.push_back(backward(dout.view(), q.view(), k.view(), v.view(), fwd.out.view(), fwd.lse.view(), o));
      EXPECT_EQ(counters.large_lse_rows, sq);
      EXPECT_LE(max_abs_error(runs.back().dq, want.dq), 1e-4) << "dq";
      EXPECT_LE(max_abs_error(runs.back().dk, want.dk), 1e-4) << "dk";
      EXPECT_LE(max_abs_error(runs.back().dv, want.dv), 1e-4) << "dv";
    }
    for (std::size_t r = 1; r < runs.size(); ++r)
      for (const auto& [got, first] : {std::pair{&runs[r].dq, &runs[0].dq}, {&runs[r].dk, &runs[0].dk},
                                       {&runs[r].dv, &runs[0].dv}})
        EXPECT_EQ(std::memcmp(got->data(), first->data(), static_cast<std::size_t>(got->numel()) * 4), 0)
            << (r + 1) << " threads against 1";
  });
}

// A backward over a part of the keys, given the lse of all of them (ring_backward's shares,
// or a caller splitting K/V), adds up to the whole backward. Where |lse| ≥ 710 the backward
// recomputes a row's normaliser from the keys it is given — but keeps the given lse where the
// two disagree: each half of these keys holds about half a row's mass, and the large rows
// were normalised per half (dv twice too large). Exact to the lse's float32 rounding: P
// within η = ln 2 · 2^-21 · |lse·log2e| relative, the gradients within η of their largest
// magnitude beyond the float32 floor. Every score 1024 (q = k = ones, head_dim 16, scale 64),
// and random scores at scale 80 (|lse| 600–1100, some rows below the threshold); every SIMD
// target, 1 and 3 threads.
TEST(Variants, BackwardOverAPartOfTheKeysKeepsTheGivenLse) {
  const std::int64_t sq = 40, sk = 64, half = 32, hq = 2, d = 16;
  for (const bool equal_scores : {true, false}) {
    Tensor q = random_tensor(DType::f32, {1, sq, hq, d}, 91), k = random_tensor(DType::f32, {1, sk, 1, d}, 92);
    const Tensor v = random_tensor(DType::f32, {1, sk, 1, d}, 93), dout = random_tensor(DType::f32, {1, sq, hq, d}, 94);
    if (equal_scores)
      for (Tensor* t : {&q, &k})
        for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, 1.0f);
    AttentionOptions o;
    o.softmax_scale = equal_scores ? 64.0f : 80.0f;
    const reference::Gradients want = reference::attention_backward(dout.view(), q.view(), k.view(), v.view(), o);
    const auto bound = [](const std::vector<double>& grad, double eta) {
      double most = 0.0;
      for (const double x : grad) most = std::max(most, std::fabs(x));
      return kGradientFloor + eta * most;
    };
    for_each_simd_target([&](const std::string&) {
      for (const int threads : {1, 3}) {
        SCOPED_TRACE(std::string(equal_scores ? "equal scores" : "random scores") + ", threads " +
                     std::to_string(threads));
        o.num_threads = threads;
        const ForwardResult fwd = forward(q.view(), k.view(), v.view(), o);
        double lse2 = 0.0;
        for (std::int64_t i = 0; i < fwd.lse.numel(); ++i)
          lse2 = std::max(lse2, std::fabs(fwd.lse.get(i)) * static_cast<double>(OnlineSoftmaxState::kLog2e));
        ASSERT_GT(lse2, 1024.0) << "large rows";
        const double eta = std::log(2.0) * 0x1p-21 * lse2;
        std::vector<double> dq(static_cast<std::size_t>(q.numel()), 0.0), dk, dv;
        for (std::int64_t part = 0; part < 2; ++part) {
          const TensorView kp(static_cast<const float*>(k.data()) + part * half * d, DType::f32, {1, half, 1, d});
          const TensorView vp(static_cast<const float*>(v.data()) + part * half * d, DType::f32, {1, half, 1, d});
          const BackwardResult got = backward(dout.view(), q.view(), kp, vp, fwd.out.view(), fwd.lse.view(), o);
          for (std::int64_t i = 0; i < got.dq.numel(); ++i) dq[static_cast<std::size_t>(i)] += got.dq.get(i);
          for (std::int64_t i = 0; i < got.dk.numel(); ++i) dk.push_back(got.dk.get(i)), dv.push_back(got.dv.get(i));
        }
        const auto error = [](const std::vector<double>& a, const std::vector<double>& b) {
          double e = 0.0;
          for (std::size_t i = 0; i < a.size(); ++i) e = std::max(e, std::fabs(a[i] - b[i]));
          return e;
        };
        EXPECT_LE(error(dq, want.dq), bound(want.dq, eta)) << "dq";
        EXPECT_LE(error(dk, want.dk), bound(want.dk, eta)) << "dk";
        EXPECT_LE(error(dv, want.dv), bound(want.dv, eta)) << "dv";
      }
    });
  }
}

// causal_alignment top_left (SDPA's is_causal): causal, windows and ALiBi measured from key i,
// on Sq < Sk, Sq == Sk, Sq > Sk and the decode shape, with windows, ALiBi, dense masks,
// dropout, block masks and sinks, 1–3 threads, every SIMD target.
TEST(Variants, TopLeftCausal) {
  std::uint64_t seed = 400;
  check_on_shapes({"topleft+causal", "topleft+causal+window", "topleft+window+alibi", "topleft+rightonly",
                   "topleft+causal+bmask1", "topleft+causal+bias+dropout", "topleft+causal+blocks16+sinks"},
                  seed);
  for_each_simd_target([&](const std::string&) {
    check_variant({1, 61, 77, 4, 2, 24, 24}, "topleft+causal+alibi", DType::f32, seed++, true, 3);
    check_variant({2, 2, 90, 4, 1, 40, 40}, "topleft+causal+split3", DType::f32, seed++, false, 2);
  });
  check_variant({2, 97, 130, 4, 2, 32, 24}, "topleft+causal", DType::bf16, seed++, false, 2);
}

// Top-left causal is the lower triangle j <= i written as a boolean attn_mask — checked without
// key_range, which the reference shares with the kernels — and the cost model counts its pairs.
TEST(Variants, TopLeftCausalIsTheLowerTriangle) {
  for (const auto& [sq, sk] : {std::pair<std::int64_t, std::int64_t>{37, 90}, {90, 37}, {5, 8}, {8, 5}}) {
    SCOPED_TRACE("Sq=" + std::to_string(sq) + " Sk=" + std::to_string(sk));
    const Tensor q = random_tensor(DType::f32, {2, sq, 2, 16}, 1);
    const Tensor k = random_tensor(DType::f32, {2, sk, 2, 16}, 2);
    const Tensor v = random_tensor(DType::f32, {2, sk, 2, 16}, 3);
    Tensor tril(DType::u8, {1, 1, sq, sk});
    for (std::int64_t i = 0; i < sq; ++i)
      for (std::int64_t j = 0; j < sk; ++j) tril.set(i * sk + j, j <= i ? 1.0f : 0.0f);
    AttentionOptions top_left;
    top_left.causal = true;
    top_left.causal_alignment = CausalAlignment::top_left;
    AttentionOptions masked;
    masked.attn_mask = tril.view();
    const ForwardResult got = forward(q.view(), k.view(), v.view(), top_left);
    const reference::Result want = reference::attention(q.view(), k.view(), v.view(), masked);
    EXPECT_LE(max_abs_error(got.out, want.out), 1e-5);
    expect_lse_near(got.lse, want.lse);
    std::int64_t pairs = 0;
    for (std::int64_t i = 0; i < sq; ++i) pairs += std::min(i + 1, sk);
    const AttentionProblem p = AttentionProblem::from_inputs(q.view(), k.view(), v.view(), top_left);
    EXPECT_EQ(p.visible_pairs(), pairs);
    EXPECT_NE(p.describe().find("causal_alignment=top_left"), std::string::npos);
  }
}

// Top-left windows on Sq far above Sk: the later Q tiles' windows begin past the last key
// (their first tile lies beyond their key range's end), beside a mask that keeps only the
// first keys and a score hook's block mask that does the same — the masks' kept keys end
// before the rows' windows begin, and those rows see no key (out 0, lse −∞), 1–3 threads.
TEST(Variants, TopLeftWindowsPastTheKeysWithMasks) {
  constexpr std::int64_t sq = 700, sk = 40;
  const Tensor q = random_tensor(DType::f32, {1, sq, 1, 16}, 11);
  const Tensor k = random_tensor(DType::f32, {1, sk, 1, 16}, 12);
  const Tensor v = random_tensor(DType::f32, {1, sk, 1, 16}, 13);
  Tensor first_keys(DType::u8, {1, 1, sq, sk});
  for (std::int64_t e = 0; e < first_keys.numel(); ++e) first_keys.set(e, e % sk < 4 ? 1.0f : 0.0f);
  const auto first_four = [](std::int64_t, std::int64_t, std::int64_t, std::int64_t kv) { return kv < 4; };
  const FlexMods mods(flex::NoScoreMod{}, first_four);
  const BlockMask blocks = create_block_mask(first_four, 1, 1, sq, sk, 8);
  for (const bool hook : {false, true})
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE(std::string(hook ? "score hook" : "attn_mask") + ", " + std::to_string(threads) + " threads");
      AttentionOptions o;
      o.causal_alignment = CausalAlignment::top_left;
      o.window_size = {0, -1};
      o.num_threads = threads;
      if (hook) o.score_hook = mods.hook(&blocks);
      else o.attn_mask = first_keys.view();
      const ForwardResult got = forward(q.view(), k.view(), v.view(), o);
      const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
      EXPECT_LE(max_abs_error(got.out, want.out), 1e-5);
      expect_lse_near(got.lse, want.lse);
    }
}

// The entry points whose positions are not one (Sq, Sk) matrix's reject top_left by name.
TEST(Variants, TopLeftRejectedByName) {
  AttentionOptions o;
  o.causal = true;
  o.causal_alignment = CausalAlignment::top_left;
  auto expect = [](const std::function<void()>& call, const std::string& fragment) { expect_error(call, {fragment}); };
  const Tensor q3 = random_tensor(DType::f32, {10, 2, 8}, 1), k3 = random_tensor(DType::f32, {12, 2, 8}, 2);
  Tensor cu(DType::i32, {2});
  expect([&] { forward_varlen(q3.view(), k3.view(), k3.view(), {cu.view(), cu.view(), 10, 12}, o); },
         "causal_alignment: top_left is not supported by the variable-length entry points");
  Tensor out3(DType::f32, {10, 2, 8}), lse3(DType::f32, {2, 10});
  const Tensor pool = random_tensor(DType::f32, {2, 4, 2, 8}, 3);
  PagedKvBatch paged;
  paged.k_cache = paged.v_cache = pool.view();
  expect([&] { forward_varlen_paged(q3.view(), cu.view(), 10, paged, out3.view(), lse3.view(), o); },
         "causal_alignment: top_left is not supported by forward_varlen_paged");
  const Tensor q = random_tensor(DType::f32, {1, 3, 2, 8}, 1);
  Tensor cache = random_tensor(DType::f32, {1, 12, 2, 8}, 4);
  KvCache kv;
  kv.k_cache = kv.v_cache = cache.view();
  expect([&] { forward_with_kvcache(q.view(), kv, o); },
         "causal_alignment: top_left is not supported by forward_with_kvcache");
  Tensor out(DType::f32, {1, 3, 2, 8}), lse(DType::f32, {1, 2, 3});
  expect([&] { forward_fp8({}, {}, {}, out.view(), lse.view(), o); },
         "causal_alignment: top_left is not supported by forward_fp8");
}

// A boolean attn_mask's summary classifies every block as its bytes say — empty (all 0),
// full (none 0, whatever non-zero value), partial — on every SIMD target: mask planes per
// batch element and head, rows a stride apart that exceeds their length, lengths off the
// vector (the row and column tails), documents with runs of full rows and single rows that
// differ, and a random mask whose row blocks settle after their first row; each row block's
// span runs from its first block that keeps a key to past its last.
TEST(Variants, BooleanMaskSummaryMatchesItsBytes) {
  constexpr std::int64_t batch = 2, heads = 3, sq = 77, sk = 150, row_stride = 171;
  std::vector<std::uint8_t> storage(static_cast<std::size_t>(batch * heads * sq * row_stride), 7);
  std::mt19937_64 rng(990);
  for (std::int64_t plane = 0; plane < batch * heads; ++plane)
    for (std::int64_t i = 0; i < sq; ++i)
      for (std::int64_t j = 0; j < sk; ++j) {
        const std::int64_t len = 19 + 7 * plane;
        bool keep = i / len == j / len && j <= i;
        if (plane == 1) keep = keep || (i % 13 == 5 && j % 29 == 3);  // lone rows differ
        if (plane == 4) keep = rng() % 3 != 0;                         // random
        if (plane == 5) keep = true;                                   // full everywhere
        storage[static_cast<std::size_t>((plane * sq + i) * row_stride + j)] =
            keep ? static_cast<std::uint8_t>(1 + rng() % 255) : 0;
      }
  const TensorView mask(storage.data(), DType::u8, {batch, heads, sq, sk},
                        {heads * sq * row_stride, sq * row_stride, row_stride, 1});
  for_each_simd_target([&](const std::string&) {
    for (const auto& [br, bc] : {std::pair<std::int64_t, std::int64_t>{8, 32}, {6, 16}, {64, 128}, {1, 8}, {7, 24}}) {
      SCOPED_TRACE("blocks " + std::to_string(br) + " x " + std::to_string(bc));
      for (int threads : {1, 3}) {
        const cpu::DenseMaskSummary summary(mask, sq, sk, br, bc, threads);
        const cpu::DenseMaskBlocks& m = summary.blocks();
        ASSERT_EQ(m.row_blocks, (sq + br - 1) / br);
        ASSERT_EQ(m.col_blocks, (sk + bc - 1) / bc);
        for (std::int64_t plane = 0; plane < batch * heads; ++plane)
          for (std::int64_t rb = 0; rb < m.row_blocks; ++rb) {
            // The row block's span: from its first block that keeps a key to past its last.
            std::int64_t first = m.col_blocks, end = 0;
            for (std::int64_t i = rb * br; i < std::min(sq, (rb + 1) * br); ++i)
              for (std::int64_t j = 0; j < sk; ++j)
                if (storage[static_cast<std::size_t>((plane * sq + i) * row_stride + j)] != 0)
                  first = std::min(first, j / bc), end = std::max(end, j / bc + 1);
            const std::int32_t* span = m.spans + 2 * (m.plane_index(plane / heads, plane % heads) * m.row_blocks + rb);
            if (first < end) {
              ASSERT_EQ(span[0], first) << "plane " << plane << " row block " << rb;
              ASSERT_EQ(span[1], end) << "plane " << plane << " row block " << rb;
            } else {
              ASSERT_GE(span[0], span[1]) << "plane " << plane << " row block " << rb << ": keeps no key";
            }
            for (std::int64_t cb = 0; cb < m.col_blocks; ++cb) {
              bool kept = false, hidden = false;
              for (std::int64_t i = rb * br; i < std::min(sq, (rb + 1) * br); ++i)
                for (std::int64_t j = cb * bc; j < std::min(sk, (cb + 1) * bc); ++j)
                  (storage[static_cast<std::size_t>((plane * sq + i) * row_stride + j)] != 0 ? kept : hidden) = true;
              ASSERT_EQ(m.states[m.plane(plane / heads, plane % heads) + rb * m.col_blocks + cb],
                        static_cast<std::uint8_t>(classify_block(kept, hidden)))
                  << "plane " << plane << " block (" << rb << ", " << cb << "), " << threads << " threads";
            }
          }
      }
    }
  });
}

// A boolean attn_mask of a structured pattern (packed documents, causal within each, per
// batch element) has its summary's partial blocks copied out (DenseMaskBlocks::keep), each
// byte the mask's, no slot elsewhere, and the kernels read those: forward and backward
// against the float64 reference on every SIMD target, 1–3 threads, odd sizes, bf16 too; a
// random mask, partial everywhere, exceeds the budget and keeps none.
TEST(Variants, BooleanMaskPartialBlocksCopiedOut) {
  constexpr std::int64_t batch = 2, sq = 150, sk = 203;
  Tensor docs(DType::u8, {batch, 1, sq, sk}), noise(DType::u8, {1, 1, 512, 512});
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t i = 0; i < sq; ++i)
      for (std::int64_t j = 0; j < sk; ++j) {
        const std::int64_t len = 37 + 11 * b, qi = i + sk - sq;  // bottom-right: the last query sees the last key
        docs.set((b * sq + i) * sk + j, qi / len == j / len && j <= qi ? 1.0f : 0.0f);
      }
  for (std::int64_t e = 0; e < noise.numel(); ++e) noise.set(e, (e * 2654435761u) % 7 < 3 ? 1.0f : 0.0f);
  for (const auto& [br, bc] : {std::pair<std::int64_t, std::int64_t>{8, 32}, {64, 128}}) {
    SCOPED_TRACE("blocks " + std::to_string(br) + " x " + std::to_string(bc));
    const cpu::DenseMaskSummary summary(docs.view(), sq, sk, br, bc, 2);
    const cpu::DenseMaskBlocks& m = summary.blocks();
    ASSERT_NE(m.slots, nullptr);
    const auto* bytes = docs.data_as<std::uint8_t>();
    for (std::int64_t e = 0; e < batch * m.row_blocks * m.col_blocks; ++e) {
      const std::int64_t cb = e % m.col_blocks, rb = e / m.col_blocks % m.row_blocks;
      const std::int64_t b = e / (m.col_blocks * m.row_blocks);
      ASSERT_EQ(m.slots[e] >= 0, static_cast<ScoreBlock>(m.states[e]) == ScoreBlock::partial) << "block " << e;
      if (m.slots[e] < 0) continue;
      for (std::int64_t r = 0; r < br && rb * br + r < sq; ++r)
        for (std::int64_t c = 0; c < bc && cb * bc + c < sk; ++c)
          ASSERT_EQ(m.keep[(m.slots[e] * br + r) * bc + c], bytes[(b * sq + rb * br + r) * sk + cb * bc + c])
              << "block " << e << " (" << r << ", " << c << ")";
    }
    EXPECT_EQ(cpu::DenseMaskSummary(noise.view(), 512, 512, br, bc, 2).blocks().slots, nullptr);
  }
  std::uint64_t seed = 980;
  for_each_simd_target([&](const std::string& target) {
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE(target + ", " + std::to_string(threads) + " threads");
      const Tensor q = random_tensor(DType::f32, {batch, sq, 4, 24}, seed);
      const Tensor k = random_tensor(DType::f32, {batch, sk, 2, 24}, seed + 1);
      const Tensor v = random_tensor(DType::f32, {batch, sk, 2, 24}, seed + 2);
      const Tensor dout = random_tensor(DType::f32, {batch, sq, 4, 24}, seed + 3);
      ++seed;
      AttentionOptions o;
      o.attn_mask = docs.view();
      o.num_threads = threads;
      const ForwardResult fwd = forward(q.view(), k.view(), v.view(), o);
      const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
      EXPECT_LE(max_abs_error(fwd.out, want.out), 1e-5);
      expect_lse_near(fwd.lse, want.lse);
      const BackwardResult got = backward(dout.view(), q.view(), k.view(), v.view(), fwd.out.view(), fwd.lse.view(), o);
      const reference::Gradients g = reference::attention_backward(dout.view(), q.view(), k.view(), v.view(), o);
      EXPECT_LE(max_abs_error(got.dq, g.dq), 1e-4);
      EXPECT_LE(max_abs_error(got.dk, g.dk), 1e-4);
      EXPECT_LE(max_abs_error(got.dv, g.dv), 1e-4);
    }
  });
  // bf16 (tiled_bf16 where it runs): within 2x the naive same-precision error, forward.
  const Tensor q = random_tensor(DType::bf16, {batch, sq, 4, 32}, seed);
  const Tensor k = random_tensor(DType::bf16, {batch, sk, 2, 32}, seed + 1);
  const Tensor v = random_tensor(DType::bf16, {batch, sk, 2, 32}, seed + 2);
  AttentionOptions o;
  o.attn_mask = docs.view();
  const ForwardResult fwd = forward(q.view(), k.view(), v.view(), o);
  const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
  const AttentionProblem p = AttentionProblem::from_inputs(q.view(), k.view(), v.view(), o);
  const double naive_error = naive_output_error(naive_same_precision(p, o, q, k, v), want.out, p.dtype, o.exp2);
  EXPECT_LE(max_abs_error(fwd.out, want.out), 1e-5 + 2.0 * naive_error);
  expect_lse_near(fwd.lse, want.lse);
}

// options.dbias: the bias gradient of every broadcast shape — full, (1, 1, Sq, Sk), (B, 1, Sq, Sk),
// (1, Hq, 1, Sk), (B, Hq, Sq, 1) — against the float64 reference, with causal, softcap, ALiBi, dropout, every
// forward shape of kShapes, 1–3 threads, every SIMD target; from one forward's out and lse, the
// same dbias bits for 1, 2 and 3 threads.
// A boolean attn_mask whose tiles are kept whole, hidden whole or mixed (the kernels read
// only the mixed ones, skip the hidden ones), and a bias whose tiles are −∞ whole or not:
// odd sizes, every forward kernel, broadcast planes, 1–3 threads; hidden tiles are skipped.
TEST(Variants, AttnMaskTiles) {
  std::uint64_t seed = 900;
  const Shape shapes[] = {{1, 203, 700, 2, 1, 40, 40}, {1, 301, 555, 2, 1, 24, 24}, {2, 3, 700, 4, 2, 40, 40}};
  // Each variant on 1, 2 and 3 threads, one count per shape (every count on every shape took
  // 268 s of the ASan stage).
  int count = 0;
  for (const Shape& s : shapes)
    for (const char* v : {"bmasktiles", "bmasktiles11", "bmaskkeys", "bmaskrows", "causal+bmasktiles", "biastiles",
                          "causal+biastilesbf16"}) {
      count = count % 3 + 1;
      check_variant(s, v, DType::f32, seed++, count == 3, count);
    }
  const Shape s = shapes[0];
  for (const char* v : {"bmasktiles", "biastiles"})
    for (int threads : {1, 2, 3}) {
      Variant var = make_variant(s, v, seed);
      KernelCounters counters;
      var.options.counters = &counters;
      var.options.num_threads = threads;
      const Tensor q = random_tensor(DType::f32, {s.batch, s.seqlen_q, s.heads_q, s.head_dim}, seed);
      const Tensor k = random_tensor(DType::f32, {s.batch, s.seqlen_k, s.heads_kv, s.head_dim}, seed + 1);
      forward(q.view(), k.view(), k.view(), var.options);
      EXPECT_GT(counters.tiles_skipped, 0) << v << ", " << threads << " threads: no tile of band 1 (hidden) skipped";
    }
}

TEST(Variants, AttnMaskBiasGradient) {
  std::uint64_t seed = 400;
  const std::initializer_list<const char*> variants = {
      "dbias+biasfull",      "dbias+bias11",         "dbias", "dbias+biash", "causal+dbias+bias11", "softcap+alibi+dbias+biasfull",
      "dropout+dbias+biash", "window+softcap+dropout+dbias", "causal+dbias+biascol"};
  check_on_shapes(variants, seed);
  for_each_simd_target([&](const std::string&) {
    check_variant({1, 61, 77, 4, 2, 24, 24}, "causal+softcap+dbias+bias11", DType::f32, seed++, true, 3);
    check_variant({2, 2, 90, 4, 1, 40, 40}, "dbias+biash", DType::f32, seed++, false, 2);
  });
  // Per-head dbias broadcast over the batch without grouped heads: each kv head adds into its own head.
  for (int threads : {1, 3}) check_variant({3, 41, 57, 3, 3, 24, 24}, "dbias+biash", DType::f32, seed++, false, threads);
  check_variant({2, 97, 97, 4, 2, 32, 24}, "dbias+biasfull", DType::bf16, seed++, false, 2);
  check_variant({2, 97, 97, 4, 2, 32, 24}, "causal+dbias+biasbf16", DType::bf16, seed++, false, 3);

  const Shape s{2, 150, 300, 4, 2, 32, 32};  // several Q and K/V tiles
  for (const char* v : variants) {
    SCOPED_TRACE(v);
    Variant var = make_variant(s, v, seed);
    const Tensor q = random_tensor(DType::f32, {s.batch, s.seqlen_q, s.heads_q, s.head_dim}, seed);
    const Tensor k = random_tensor(DType::f32, {s.batch, s.seqlen_k, s.heads_kv, s.head_dim}, seed + 1);
    const Tensor val = random_tensor(DType::f32, {s.batch, s.seqlen_k, s.heads_kv, s.head_dim_v}, seed + 2);
    const Tensor dout = random_tensor(DType::f32, {s.batch, s.seqlen_q, s.heads_q, s.head_dim_v}, seed + 3);
    ++seed;
    const ForwardResult fwd = forward(q.view(), k.view(), val.view(), var.options);
    std::vector<Tensor> dbias;
    for (int threads : {1, 2, 3}) {
      dbias.emplace_back(DType::f32, var.attn_mask.shape());
      var.options.dbias = dbias.back().view();
      var.options.num_threads = threads;
      backward(dout.view(), q.view(), k.view(), val.view(), fwd.out.view(), fwd.lse.view(), var.options);
    }
    for (int t : {1, 2})
      EXPECT_EQ(std::memcmp(dbias[0].data(), dbias[static_cast<std::size_t>(t)].data(),
                            static_cast<std::size_t>(dbias[0].numel()) * 4), 0)
          << "dbias differs between 1 and " << t + 1 << " threads";
  }
}

// A row that sees no key: out 0 and lse = its sink; its gradient is zero.
TEST(Variants, SinksRowWithoutKeys) {
  const Tensor q = random_tensor(DType::f32, {1, 9, 2, 16}, 1);
  const Tensor k = random_tensor(DType::f32, {1, 4, 2, 16}, 2);
  const Tensor v = random_tensor(DType::f32, {1, 4, 2, 16}, 3);
  Tensor sinks(DType::f32, {2});
  sinks.set(0, 0.5f);
  sinks.set(1, -1.25f);
  AttentionOptions o;
  o.sinks = sinks.view();
  o.window_size = {0, 0};  // rows 0..4 see no key (Sk − Sq = −5)
  const ForwardResult fwd = forward(q.view(), k.view(), v.view(), o);
  const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
  EXPECT_LE(max_abs_error(fwd.out, want.out), 1e-5);
  expect_lse_near(fwd.lse, want.lse);
  EXPECT_EQ(fwd.lse.get(0), 0.5f);  // (b 0, h 0, row 0)
  EXPECT_EQ(fwd.lse.get(9 + 2), -1.25f);  // (b 0, h 1, row 2)
}

// Sinks with bf16 and f16 inputs (the tiled kernel here; the yardstick's softmax counts the sink).
TEST(Variants, SinksLowPrecision) {
  std::uint64_t seed = 400;
  for (DType dtype : {DType::bf16, DType::f16}) {
    check_variant({2, 97, 97, 4, 2, 32, 24}, "causal+sinks", dtype, seed++, false, 2);
    check_variant({1, 70, 90, 4, 2, 48, 48}, "window+softcap+alibi+sinks", dtype, seed++, true, 3);
  }
}

// The decode kernel on split-KV (num_splits 2 to 5, one query per sequence, GQA): the sink
// enters each row once through split 0, and the merge carries it — against the reference.
TEST(Variants, SinksDecodeKernelSplitKv) {
  std::uint64_t seed = 420;
  for_each_simd_target([&](const std::string&) {
    for (DType dtype : {DType::f32, DType::bf16})
      for (int splits : {2, 3, 5})
        for (int threads : {1, 2, 3}) {
          SCOPED_TRACE(std::string(to_string(dtype)) + " splits " + std::to_string(splits) + " threads " +
                       std::to_string(threads));
          Variant var = make_variant({2, 1, 333, 8, 2, 64, 64}, splits == 3 ? "sinks+window" : "sinks", seed);
          AttentionOptions& o = var.options;
          o.kernel = ForwardKernel::decode;
          o.num_splits = splits;
          o.num_threads = threads;
          const Tensor q = random_tensor(dtype, {2, 1, 8, 64}, seed);
          const Tensor k = random_tensor(dtype, {2, 333, 2, 64}, seed + 1);
          const Tensor v = random_tensor(dtype, {2, 333, 2, 64}, seed + 2);
          ++seed;
          const AttentionProblem p = AttentionProblem::from_inputs(q.view(), k.view(), v.view(), o);
          ASSERT_EQ(plan_forward(p, CpuHardware::detect(threads), splits, 0, ForwardKernel::decode).kernel,
                    ForwardKernel::decode);
          const ForwardResult got = forward(q.view(), k.view(), v.view(), o);
          const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
          double tol = 1e-5;
          if (dtype != DType::f32) tol += 2.0 * naive_output_error(naive_same_precision(p, o, q, k, v), want.out, p.dtype, o.exp2);
          EXPECT_LE(max_abs_error(got.out, want.out), tol);
          expect_lse_near(got.lse, want.lse);
        }
  });
}

// What a sink does to a row's (out, lse) follows from the row's (out, lse) without it
// (docs/algorithm.md §6.1): lse' = log(e^lse + e^σ), out' = out · e^(lse − lse'). Checked on
// the kernels whose rounding the float64 reference does not model — tiled_bf16 (AVX512-BF16)
// and decode_fp16 (AVX512-FP16) and decode_bf16 (AVX512-BF16), over an FP8 cache, split and
// not — where the CPU has them.
void expect_sink_applied(const ForwardResult& plain, const ForwardResult& sunk, const Tensor& sinks,
                         std::int64_t heads_q, std::int64_t seqlen_q) {
  for (std::int64_t i = 0; i < plain.lse.numel(); ++i) {
    const double sink = sinks.get((i / seqlen_q) % heads_q), lse = plain.lse.get(i);
    const double want = std::max(lse, sink) + std::log1p(std::exp(-std::fabs(lse - sink)));
    ASSERT_NEAR(sunk.lse.get(i), want, 1e-5 * std::max(1.0, std::fabs(want))) << "lse " << i;
  }
  const std::int64_t dv = plain.out.shape()[3];
  for (std::int64_t e = 0; e < plain.out.numel(); ++e) {
    const std::int64_t row = e / dv, b = row / (seqlen_q * heads_q), i = row / heads_q % seqlen_q, h = row % heads_q;
    const std::int64_t l = (b * heads_q + h) * seqlen_q + i;
    const double want = plain.out.get(e) * std::exp(static_cast<double>(plain.lse.get(l)) - sunk.lse.get(l));
    ASSERT_NEAR(sunk.out.get(e), want, 2e-2 * std::fabs(want) + 1e-5) << "out " << e;  // one bf16/f16 rounding
  }
}

TEST(Variants, SinksTiledBf16Kernel) {
  if (!CpuHardware::detect(0).bf16_dot) GTEST_SKIP() << "no AVX512-BF16 on this CPU: tiled_bf16 cannot run here";
  const Tensor q = random_tensor(DType::bf16, {2, 77, 4, 64}, 440);
  const Tensor k = random_tensor(DType::bf16, {2, 131, 2, 64}, 441);
  const Tensor v = random_tensor(DType::bf16, {2, 131, 2, 64}, 442);
  Tensor sinks(DType::f32, {4});
  for (std::int64_t h = 0; h < 4; ++h) sinks.set(h, 1.5f * static_cast<float>(h) - 1.0f);
  for (int splits : {1, 3}) {
    SCOPED_TRACE("splits " + std::to_string(splits));
    AttentionOptions o;
    o.kernel = ForwardKernel::tiled_bf16;
    o.causal = true;
    o.num_splits = splits;
    o.num_threads = 3;
    const ForwardResult plain = forward(q.view(), k.view(), v.view(), o);
    o.sinks = sinks.view();
    expect_sink_applied(plain, forward(q.view(), k.view(), v.view(), o), sinks, 4, 77);
  }
}

void expect_sinks_on_fp8_decode(ForwardKernel kernel) {
  Fp8CacheTensors fp8 = fp8_cache({2, 300, 2, 64});
  Tensor q = random_tensor(DType::f32, {2, 1, 8, 64}, 450);
  for (std::int64_t i = 0; i < q.numel(); ++i) q.set(i, q.get(i) * 0x1p-6f);  // scores near the sinks' range
  Tensor seqlens(DType::i32, {2}), sinks(DType::f32, {8});
  seqlens.set(0, 300.0f);
  seqlens.set(1, 171.0f);
  for (std::int64_t h = 0; h < 8; ++h) sinks.set(h, 0.75f * static_cast<float>(h) - 2.0f);
  for (int splits : {1, 4}) {
    SCOPED_TRACE("splits " + std::to_string(splits));
    KvCache c = fp8.cache();
    c.cache_seqlens = seqlens.view();
    AttentionOptions o;
    o.kernel = kernel;
    o.num_splits = splits;
    o.num_threads = 2;
    const ForwardResult plain = forward_with_kvcache(q.view(), c, o);
    o.sinks = sinks.view();
    expect_sink_applied(plain, forward_with_kvcache(q.view(), c, o), sinks, 8, 1);
  }
}

TEST(Variants, SinksDecodeFp16Kernel) {
  if (!CpuHardware::detect(0).decode_fp16) GTEST_SKIP() << "no AVX512-FP16 on this CPU: decode_fp16 cannot run here";
  expect_sinks_on_fp8_decode(ForwardKernel::decode_fp16);
}

TEST(Variants, SinksDecodeBf16Kernel) {
  if (!CpuHardware::detect(0).decode_bf16) GTEST_SKIP() << "no AVX512-BF16 on this CPU: decode_bf16 cannot run here";
  expect_sinks_on_fp8_decode(ForwardKernel::decode_bf16);
}

TEST(Variants, LowPrecisionAndEveryTarget) {
  std::uint64_t seed = 60;
  for (DType dtype : {DType::bf16, DType::f16})
    check_variant({1, 70, 90, 4, 2, 48, 48}, "causal+window+softcap+alibi+dropout", dtype, seed++);
  for_each_simd_target([&](const std::string&) {
    check_variant({1, 61, 77, 2, 1, 24, 24}, "window+softcap+alibi+dropout+blocks16", DType::f32, seed++, true, 3);
  });
}

TEST(Variants, DropoutFractionAndMaskIndependentOfThreads) {
  const float p = 0.3f;
  std::int64_t dropped = 0, total = 0;
  for (std::int64_t i = 0; i < 512; ++i)
    for (std::int64_t j = 0; j < 512; ++j, ++total) dropped += !dropout_keep(1234, 0, 0, 3, i, j, p);
  EXPECT_NEAR(static_cast<double>(dropped) / static_cast<double>(total), p, 0.01);
  // Different seeds, offsets, heads give different masks.
  int differ = 0;
  for (std::int64_t j = 0; j < 256; ++j)
    differ += dropout_keep(1, 0, 0, 0, 0, j, p) != dropout_keep(2, 0, 0, 0, 0, j, p);
  EXPECT_GT(differ, 40);

  const Tensor q = random_tensor(DType::f32, {1, 150, 2, 32}, 1);
  const Tensor k = random_tensor(DType::f32, {1, 170, 2, 32}, 2);
  AttentionOptions o;
  o.dropout_p = 0.5f;
  o.seed = 99;
  o.num_threads = 1;
  const ForwardResult one = forward(q.view(), k.view(), k.view(), o);
  o.num_threads = 3;
  const ForwardResult three = forward(q.view(), k.view(), k.view(), o);
  EXPECT_EQ(std::memcmp(one.out.data(), three.out.data(), static_cast<std::size_t>(one.out.numel()) * 4), 0);
  o.seed = 100;
  const ForwardResult other_seed = forward(q.view(), k.view(), k.view(), o);
  EXPECT_GT(max_abs_error(other_seed.out, std::vector<double>(one.out.data_as<float>(),
                                                              one.out.data_as<float>() + one.out.numel())),
            1e-3);
}

TEST(Variants, ReturnedProbabilitiesExplainTheOutput) {
  // out = (dropped-and-scaled P)·V with P from attention_probs, and the zeros of P are the
  // dropped fraction.
  const std::int64_t sq = 64, sk = 300, d = 16;
  const Tensor q = random_tensor(DType::f32, {1, sq, 1, d}, 1);
  const Tensor k = random_tensor(DType::f32, {1, sk, 1, d}, 2);
  const Tensor v = random_tensor(DType::f32, {1, sk, 1, d}, 3);
  AttentionOptions o;
  o.dropout_p = 0.4f;
  o.seed = 11;
  const Tensor probs = reference::attention_probs(q.view(), k.view(), v.view(), o);
  const ForwardResult r = forward(q.view(), k.view(), v.view(), o);
  std::int64_t zeros = 0;
  double err = 0.0;
  for (std::int64_t i = 0; i < sq; ++i)
    for (std::int64_t c = 0; c < d; ++c) {
      double acc = 0.0;
      for (std::int64_t j = 0; j < sk; ++j) acc += probs.get(i * sk + j) * v.get(j * d + c);
      err = std::max(err, abs_difference(acc, r.out.get(i * d + c)));
    }
  for (std::int64_t e = 0; e < probs.numel(); ++e) zeros += probs.get(e) == 0.0f;
  EXPECT_LE(err, 1e-5);
  EXPECT_NEAR(static_cast<double>(zeros) / static_cast<double>(probs.numel()), 0.4, 0.01);
}

TEST(Variants, FullyMaskedRowsGiveZeroAndMinusInfinity) {
  // A block mask whose first q block sees nothing.
  const Tensor q = random_tensor(DType::f32, {1, 40, 1, 16}, 1);
  const Tensor k = random_tensor(DType::f32, {1, 40, 1, 16}, 2);
  Tensor mask(DType::u8, {2, 2});
  mask.set(3, 1.0f);
  AttentionOptions o;
  o.block_mask = mask.view();
  o.block_mask_block_size = 20;
  const ForwardResult r = forward(q.view(), k.view(), k.view(), o);
  for (std::int64_t i = 0; i < 20; ++i) {
    EXPECT_EQ(r.lse.get(i), -std::numeric_limits<float>::infinity());
    for (std::int64_t c = 0; c < 16; ++c) EXPECT_EQ(r.out.get(i * 16 + c), 0.0f);
  }
  const Tensor dout = random_tensor(DType::f32, {1, 40, 1, 16}, 3);
  const BackwardResult g = backward(dout.view(), q.view(), k.view(), k.view(), r.out.view(), r.lse.view(), o);
  for (const Tensor* grad : {&g.dq, &g.dk, &g.dv})
    for (std::int64_t i = 0; i < grad->numel(); ++i) ASSERT_TRUE(std::isfinite(grad->get(i))) << "element " << i;
  for (std::int64_t i = 0; i < 20 * 16; ++i) EXPECT_EQ(g.dq.get(i), 0.0f);
}

TEST(Variants, BadInputNamesTheArgument) {
  const Tensor q = random_tensor(DType::f32, {2, 10, 4, 8}, 1);
  const Tensor k = random_tensor(DType::f32, {2, 12, 2, 8}, 2);
  auto expect = [&](const AttentionOptions& o, const std::string& fragment) {
    try {
      forward(q.view(), k.view(), k.view(), o);
      ADD_FAILURE() << "expected flashattn::Error containing " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  AttentionOptions o;
  o.window_size = {-2, 3};
  expect(o, "window_size: (-2, 3)");
  o = {};
  o.causal = true;
  o.window_size = {4, 2};
  expect(o, "contradicts causal");
  o = {};
  o.softcap = -1.0f;
  expect(o, "softcap: must be >= 0");
  o = {};
  o.dropout_p = 1.0f;
  expect(o, "dropout_p: must be in [0, 1)");
  const Tensor slopes(DType::f32, {3});
  o = {};
  o.alibi_slopes = slopes.view();
  expect(o, "alibi_slopes: shape (3) but expected (4)");
  const Tensor slopes2(DType::f32, {3, 4});
  o.alibi_slopes = slopes2.view();
  expect(o, "alibi_slopes: shape (3, 4) but expected (2, 4)");
  const Tensor mask_bad_shape(DType::u8, {2, 3, 10, 12});
  o = {};
  o.attn_mask = mask_bad_shape.view();
  expect(o, "attn_mask: shape (2, 3, 10, 12) does not broadcast");
  const Tensor mask_int(DType::i32, {1, 1, 10, 12});
  o.attn_mask = mask_int.view();
  expect(o, "attn_mask: dtype i32");
  const Tensor mask_wide(DType::f32, {1, 1, 10, 24});
  TensorView strided = mask_wide.view();
  strided.shape[3] = 12;
  strided.strides[3] = 2;
  o.attn_mask = strided;
  expect(o, "attn_mask: last dimension must be contiguous");
  const Tensor bf_slopes(DType::bf16, {4});
  o.alibi_slopes = bf_slopes.view();
  expect(o, "alibi_slopes: dtype bf16");
  const Tensor mask(DType::u8, {2, 2});
  o = {};
  o.block_mask = mask.view();
  o.block_mask_block_size = 4;
  expect(o, "block_mask: shape (2, 2) but expected (3, 3)");
  o.block_mask_block_size = 0;
  expect(o, "block_mask_block_size: must be >= 1");
  const Tensor fmask(DType::f32, {3, 3});
  o.block_mask = fmask.view();
  o.block_mask_block_size = 4;
  expect(o, "block_mask: dtype f32");
}

// Bad sinks (shape, dtype, a non-finite logit) and a bad dsinks: an Error naming them,
// raised before out, lse, dq or dsinks is written.
TEST(Variants, BadSinksNameTheArgumentBeforeAnythingIsWritten) {
  const Tensor q = random_tensor(DType::f32, {2, 10, 4, 8}, 1);
  const Tensor k = random_tensor(DType::f32, {2, 12, 2, 8}, 2);
  Tensor out(DType::f32, {2, 10, 4, 8}), lse(DType::f32, {2, 4, 10});
  for (std::int64_t i = 0; i < out.numel(); ++i) out.set(i, 7.0f);
  auto expect = [&](const AttentionOptions& o, const std::string& fragment) {
    try {
      forward(q.view(), k.view(), k.view(), out.view(), lse.view(), o);
      ADD_FAILURE() << "expected flashattn::Error containing " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
    for (std::int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.get(i), 7.0f) << fragment;
  };
  const Tensor three(DType::f32, {3}), bf(DType::bf16, {4}), two_d(DType::f32, {2, 4});
  AttentionOptions o;
  o.sinks = three.view();
  expect(o, "sinks: shape (3) but expected (4)");
  o.sinks = bf.view();
  expect(o, "sinks: dtype bf16");
  o.sinks = two_d.view();
  expect(o, "sinks");
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    Tensor sinks(DType::f32, {4});
    sinks.set(2, bad);
    o.sinks = sinks.view();
    expect(o, "sinks: sink logit of head 2 is");
  }

  Tensor sinks(DType::f32, {4});
  o.sinks = sinks.view();
  const ForwardResult f = forward(q.view(), k.view(), k.view(), o);
  Tensor dq(DType::f32, {2, 10, 4, 8}), dk(DType::f32, {2, 12, 2, 8}), dv(DType::f32, {2, 12, 2, 8});
  Tensor dsinks3(DType::f32, {3}), dsinks(DType::f32, {4});
  dsinks3.set(0, 7.0f), dsinks.set(0, 7.0f), dq.set(0, 7.0f);
  auto expect_backward = [&](const AttentionOptions& ob, const std::string& fragment) {
    try {
      backward(f.out.view(), q.view(), k.view(), k.view(), f.out.view(), f.lse.view(), dq.view(), dk.view(),
               dv.view(), ob);
      ADD_FAILURE() << "expected flashattn::Error containing " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
    EXPECT_EQ(dq.get(0), 7.0f);
    EXPECT_EQ(dsinks3.get(0), 7.0f);
    EXPECT_EQ(dsinks.get(0), 7.0f);
  };
  o.dsinks = dsinks3.view();
  expect_backward(o, "dsinks: shape (3) but expected (4)");
  AttentionOptions no_sinks;
  no_sinks.dsinks = dsinks.view();
  expect_backward(no_sinks, "dsinks: set without sinks");
  // lse's gradient: lse's shape (2, 4, 10) and dtype, and apart from the outputs.
  const Tensor dlse_shape(DType::f32, {2, 4, 9}), dlse_dtype(DType::bf16, {2, 4, 10});
  AttentionOptions bad_dlse;
  bad_dlse.dlse = dlse_shape.view();
  expect_backward(bad_dlse, "dlse: shape (2, 4, 9) but expected (2, 4, 10)");
  bad_dlse.dlse = dlse_dtype.view();
  expect_backward(bad_dlse, "dlse: dtype bf16");
  bad_dlse.dlse = TensorView(dq.data(), DType::f32, {2, 4, 10});
  expect_backward(bad_dlse, "dlse");
  // dsinks over an input: q, k or v — read after dsinks is zeroed — are named, none written.
  for (const char* input : {"q", "k", "v"}) {
    Tensor qi = q, ki = k, vi = k;
    Tensor& target = input[0] == 'q' ? qi : input[0] == 'k' ? ki : vi;
    const Tensor before = target;
    AttentionOptions over = o;
    over.dsinks = MutableTensorView(target.data(), DType::f32, {4});
    try {
      backward(f.out.view(), qi.view(), ki.view(), vi.view(), f.out.view(), f.lse.view(), dq.view(), dk.view(),
               dv.view(), over);
      ADD_FAILURE() << "expected flashattn::Error naming dsinks and " << input;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("dsinks"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::string("overlaps input ") + input), std::string::npos) << e.what();
    }
    EXPECT_EQ(std::memcmp(target.data(), before.data(), static_cast<std::size_t>(before.numel()) * 4), 0) << input;
    EXPECT_EQ(dq.get(0), 7.0f);
  }
  // A row given lse −∞ sees nothing, as the kernels take it (a forward with sinks never returns
  // it): no gradient, and no share of dsinks — it was exp(sink + ∞) = +∞.
  Tensor lse_inf = f.lse;
  lse_inf.set(3, -std::numeric_limits<float>::infinity());
  AttentionOptions with_dsinks = o;
  with_dsinks.dsinks = dsinks.view();
  backward(f.out.view(), q.view(), k.view(), k.view(), f.out.view(), lse_inf.view(), dq.view(), dk.view(), dv.view(),
           with_dsinks);
  for (std::int64_t h = 0; h < 4; ++h) EXPECT_TRUE(std::isfinite(dsinks.get(h))) << "dsinks of head " << h;
  for (std::int64_t e = 0; e < 8; ++e) EXPECT_EQ(dq.get(3 * 4 * 8 + e), 0.0f) << "dq of the row given lse -inf";
}

// A bad dbias (no float attn_mask, a boolean one, another shape or dtype, overlapping an input or
// another output) and an attn_mask overlapping an output: an Error naming them, raised before
// out, dq or dbias is written.
TEST(Variants, BadDbiasAndOverlappingMaskNameTheArgumentBeforeAnythingIsWritten) {
  const Tensor q = random_tensor(DType::f32, {2, 10, 4, 8}, 1);
  const Tensor k = random_tensor(DType::f32, {2, 12, 2, 8}, 2);
  Tensor bias = random_tensor(DType::f32, {2, 1, 10, 12}, 3);
  const Tensor boolean(DType::u8, {2, 1, 10, 12});
  AttentionOptions o;
  o.attn_mask = bias.view();
  const ForwardResult f = forward(q.view(), k.view(), k.view(), o);
  Tensor dq(DType::f32, {2, 10, 4, 8}), dk(DType::f32, {2, 12, 2, 8}), dv(DType::f32, {2, 12, 2, 8});
  Tensor dbias(DType::f32, {2, 1, 10, 12}), wrong_shape(DType::f32, {1, 1, 10, 12}), wrong_dtype(DType::bf16, {2, 1, 10, 12});
  Tensor big(DType::f32, {2 * 10 * 4 * 8 + 2 * 10 * 12});  // dq and dbias in one buffer
  dq.set(0, 7.0f), dbias.set(0, 7.0f), wrong_shape.set(0, 7.0f), big.set(0, 7.0f);
  // lse inside a buffer of dbias's size: a dbias over that buffer overlaps lse and nothing else
  // (over f.lse's own memory it would run into whatever the heap put after it).
  Tensor lse_buffer(DType::f32, {2 * 1 * 10 * 12});
  for (std::int64_t e = 0; e < f.lse.numel(); ++e) lse_buffer.set(e, f.lse.get(e));
  const TensorView lse_in_buffer(lse_buffer.data(), DType::f32, {2, 4, 10});
  auto expect_backward = [&](const AttentionOptions& ob, const MutableTensorView& dq_view, const std::string& fragment) {
    try {
      backward(f.out.view(), q.view(), k.view(), k.view(), f.out.view(), lse_in_buffer, dq_view, dk.view(), dv.view(),
               ob);
      ADD_FAILURE() << "expected flashattn::Error containing " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
    EXPECT_EQ(dq.get(0), 7.0f) << fragment;
    EXPECT_EQ(dbias.get(0), 7.0f) << fragment;
    EXPECT_EQ(wrong_shape.get(0), 7.0f) << fragment;
    EXPECT_EQ(big.get(0), 7.0f) << fragment;
  };
  AttentionOptions ob;
  ob.dbias = dbias.view();
  expect_backward(ob, dq.view(), "dbias: set without a float attn_mask (none is set)");
  ob.attn_mask = boolean.view();
  expect_backward(ob, dq.view(), "dbias: set without a float attn_mask (a boolean mask has no gradient)");
  ob.attn_mask = bias.view();
  ob.dbias = wrong_shape.view();
  expect_backward(ob, dq.view(), "dbias: shape (1, 1, 10, 12) but expected (2, 1, 10, 12)");
  ob.dbias = wrong_dtype.view();
  expect_backward(ob, dq.view(), "dbias: dtype bf16");
  ob.dbias = MutableTensorView(big.data_as<float>() + 2 * 10 * 4 * 8 - 1, DType::f32, {2, 1, 10, 12});
  const MutableTensorView dq_in_big(big.data_as<float>(), DType::f32, {2, 10, 4, 8});
  expect_backward(ob, dq_in_big, "dbias: output memory overlaps input dq");
  ob.dbias = MutableTensorView(lse_buffer.data_as<float>(), DType::f32, {2, 1, 10, 12});
  expect_backward(ob, dq.view(), "dbias: output memory overlaps input lse");
  // attn_mask inside an output's memory.
  ob.dbias = dbias.view();
  ob.attn_mask = TensorView(dq.data_as<float>(), DType::f32, {2, 1, 10, 12});
  expect_backward(ob, dq.view(), "dq: output memory overlaps input attn_mask");
  ob.attn_mask = TensorView(dbias.data_as<float>(), DType::f32, {2, 1, 10, 12});
  expect_backward(ob, dq.view(), "dbias: output memory overlaps input attn_mask");
  Tensor out(DType::f32, {2, 10, 4, 8}), lse(DType::f32, {2, 4, 10});
  out.set(0, 7.0f);
  for (const auto& [target, name] : {std::pair{&out, "out"}, {&lse, "lse"}}) {
    AttentionOptions of;
    of.attn_mask = TensorView(target->data_as<float>(), DType::f32, {1, 1, 10, 1});
    try {
      forward(q.view(), k.view(), k.view(), out.view(), lse.view(), of);
      ADD_FAILURE() << "expected an Error for attn_mask inside " << name;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string(name) + ": output memory overlaps input attn_mask"),
                std::string::npos) << e.what();
    }
    EXPECT_EQ(out.get(0), 7.0f);
  }
}

// A side input — alibi_slopes, sinks, the block-sparse block_mask, the score hook's block mask
// — inside an output's memory (out, lse, dq; forward_varlen's out, forward_with_kvcache's
// out and the cache its append writes, forward_varlen_paged's out): an Error naming both, raised
// before anything is written.
TEST(Variants, SideInputsInsideAnOutputAreRefusedBeforeAnythingIsWritten) {
  const Tensor q = random_tensor(DType::f32, {1, 8, 4, 16}, 1);
  const Tensor k = random_tensor(DType::f32, {1, 8, 2, 16}, 2);
  Tensor out(DType::f32, {1, 8, 4, 16}), lse(DType::f32, {1, 4, 8});
  Tensor dq(DType::f32, {1, 8, 4, 16}), dk(DType::f32, {1, 8, 2, 16}), dv(DType::f32, {1, 8, 2, 16});
  const auto sentinels = [&] {
    for (Tensor* t : {&out, &lse, &dq}) t->set(0, 7.0f);
  };
  const auto untouched = [&](const std::string& what) {
    for (Tensor* t : {&out, &lse, &dq}) EXPECT_EQ(t->get(0), 7.0f) << what;
  };
  const auto expect = [&](const std::string& what, const std::function<void()>& call, const std::string& fragment) {
    sentinels();
    try {
      call();
      ADD_FAILURE() << what << ": expected flashattn::Error containing " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << what << ": " << e.what();
    }
    untouched(what);
  };
  // Each side input as a view of the first bytes of an output.
  const auto place = [](AttentionOptions& o, const std::string& input, void* at) {
    if (input == "alibi_slopes") o.alibi_slopes = TensorView(at, DType::f32, {4});
    if (input == "sinks") o.sinks = TensorView(at, DType::f32, {4});
    if (input == "block_mask") {
      o.block_mask = TensorView(at, DType::u8, {1, 1});
      o.block_mask_block_size = 8;
    }
  };
  const FlexMods keep_all(flex::NoScoreMod{}, [](std::int64_t, std::int64_t, std::int64_t, std::int64_t) { return true; });
  const BlockMask blocks = create_block_mask([](std::int64_t, std::int64_t, std::int64_t, std::int64_t) { return true; },
                                             1, 1, 8, 8, 8);
  const ForwardResult f = forward(q.view(), k.view(), k.view());
  for (const std::string input : {"alibi_slopes", "sinks", "block_mask", "score_hook.block_mask"}) {
    const auto with = [&](void* at) {
      AttentionOptions o;
      if (input == "score_hook.block_mask") {
        o.score_hook = keep_all.hook(&blocks);
        o.score_hook.block_mask = TensorView(at, DType::u8, {1, 1, 1, 1});
      } else {
        place(o, input, at);
      }
      return o;
    };
    const std::string overlaps = ": output memory overlaps input " + input;
    expect(input + " in out", [&] { forward(q.view(), k.view(), k.view(), out.view(), lse.view(), with(out.data())); },
           "out" + overlaps);
    expect(input + " in lse", [&] { forward(q.view(), k.view(), k.view(), out.view(), lse.view(), with(lse.data())); },
           "lse" + overlaps);
    expect(input + " in dq", [&] {
      backward(f.out.view(), q.view(), k.view(), k.view(), f.out.view(), f.lse.view(), dq.view(), dk.view(),
               dv.view(), with(dq.data()));
    }, "dq" + overlaps);
    if (input == "score_hook.block_mask" || input == "block_mask") continue;
    Tensor cu(DType::i32, {2});
    cu.data_as<std::int32_t>()[0] = 0, cu.data_as<std::int32_t>()[1] = 8;
    const TensorView q3(q.data(), DType::f32, {8, 4, 16}), k3(k.data(), DType::f32, {8, 2, 16});
    const MutableTensorView out3(out.data(), DType::f32, {8, 4, 16}), lse2(lse.data(), DType::f32, {4, 8});
    expect(input + " in forward_varlen's out",
           [&] { forward_varlen(q3, k3, k3, {cu.view(), cu.view(), 8, 8}, out3, lse2, with(out.data())); },
           "out" + overlaps);
    Tensor cache = random_tensor(DType::f32, {1, 12, 2, 16}, 4), new_k = random_tensor(DType::f32, {1, 8, 2, 16}, 5);
    Tensor seqlens(DType::i32, {1});
    seqlens.data_as<std::int32_t>()[0] = 2;
    KvCache kv;
    kv.k_cache = kv.v_cache = cache.view();
    kv.cache_seqlens = seqlens.view();
    expect(input + " in forward_with_kvcache's out",
           [&] { forward_with_kvcache(q.view(), kv, out.view(), lse.view(), with(out.data())); }, "out" + overlaps);
    Tensor k_cache = random_tensor(DType::f32, {1, 12, 2, 16}, 6), v_cache = random_tensor(DType::f32, {1, 12, 2, 16}, 7);
    const float first = k_cache.get(0);
    kv.k_cache = k_cache.view();
    kv.v_cache = v_cache.view();
    kv.k = kv.v = new_k.view();
    expect(input + " in the appended k_cache",
           [&] { forward_with_kvcache(q.view(), kv, out.view(), lse.view(), with(k_cache.data())); },
           "k_cache" + overlaps);
    EXPECT_EQ(k_cache.get(0), first);
    Tensor table(DType::i32, {1, 1});
    table.data_as<std::int32_t>()[0] = 0;
    Tensor used(DType::i32, {1});
    used.data_as<std::int32_t>()[0] = 8;
    PagedKvBatch paged;
    paged.k_cache = paged.v_cache = TensorView(k.data(), DType::f32, {1, 8, 2, 16});
    paged.block_table = table.view();
    paged.seqused_k = used.view();
    expect(input + " in forward_varlen_paged's out",
           [&] { forward_varlen_paged(q3, cu.view(), 8, paged, out3, lse2, with(out.data())); }, "out" + overlaps);
  }
}

}  // namespace
}  // namespace flashattn::test
