// User-defined score and mask functions (flex.hpp, AttentionOptions::score_hook): relative
// position bias, prefix-LM, document masking over a packed batch, soft-capping and ALiBi
// written as score_mods, forward and backward against the float64 reference (which calls
// the same functors per score), with and without a block mask from create_block_mask, odd
// shapes, 1–3 threads, every SIMD target.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <sstream>
#include <vector>

#include "flashattn/flex.hpp"
#include "flashattn/fp8.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

struct Shape {
  std::int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
};

const Shape kShapes[] = {{1, 113, 203, 2, 1, 40}, {2, 97, 97, 4, 2, 32}, {1, 203, 113, 2, 2, 64},
                         {2, 3, 150, 4, 2, 40}};  // the last runs the decode kernel

struct Inputs {
  Tensor q, k, v, dout;
};

Inputs make_inputs(const Shape& s, std::uint64_t seed, DType dtype = DType::f32) {
  return {random_tensor(dtype, {s.batch, s.seqlen_q, s.heads_q, s.head_dim}, seed),
          random_tensor(dtype, {s.batch, s.seqlen_k, s.heads_kv, s.head_dim}, seed + 1),
          random_tensor(dtype, {s.batch, s.seqlen_k, s.heads_kv, s.head_dim}, seed + 2),
          random_tensor(dtype, {s.batch, s.seqlen_q, s.heads_q, s.head_dim}, seed + 3)};
}

// Forward (and backward unless with_backward is false) of `o` against the float64
// reference; bf16/f16 inputs within 2× (outputs) and 3× (gradients) the naive error.
ForwardResult check_against_reference(const Inputs& in, AttentionOptions o, int threads, bool with_backward = true) {
  o.num_threads = threads;
  const ForwardResult fwd = forward(in.q.view(), in.k.view(), in.v.view(), o);
  const reference::Result want = reference::attention(in.q.view(), in.k.view(), in.v.view(), o);
  const AttentionProblem p = AttentionProblem::from_inputs(in.q.view(), in.k.view(), in.v.view(), o);
  const bool low = in.q.dtype() != DType::f32;
  const double tol_out = 1e-5 + (low ? 2.0 * naive_output_error(naive_same_precision(p, o, in.q, in.k, in.v), want.out, p.dtype, o.exp2) : 0.0);
  EXPECT_LE(max_abs_error(fwd.out, want.out), tol_out) << "out";
  expect_lse_near(fwd.lse, want.lse);
  if (!with_backward) return fwd;
  const BackwardResult got =
      backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), fwd.out.view(), fwd.lse.view(), o);
  const reference::Gradients g =
      reference::attention_backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), o);
  double tq = 1e-4, tk = 1e-4, tv = 1e-4;
  if (low) {
    const NaiveGradients n = naive_backward_same_precision(p, o, in.dout, in.q, in.k, in.v);
    tq += 3.0 * yardstick_error(n.dq, g.dq, "the naive dq", INFINITY);
    tk += 3.0 * yardstick_error(n.dk, g.dk, "the naive dk", INFINITY);
    tv += 3.0 * yardstick_error(n.dv, g.dv, "the naive dv", INFINITY);
  }
  EXPECT_LE(max_abs_error(got.dq, g.dq), tq) << "dq";
  EXPECT_LE(max_abs_error(got.dk, g.dk), tk) << "dk";
  EXPECT_LE(max_abs_error(got.dv, g.dv), tv) << "dv";
  return fwd;
}

std::vector<double> values(const Tensor& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::int64_t e = 0; e < t.numel(); ++e) v[static_cast<std::size_t>(e)] = t.get(e);
  return v;
}

std::string trace(const Shape& s, const char* name, int threads, std::int64_t block) {
  std::ostringstream t;
  t << name << " B=" << s.batch << " Sq=" << s.seqlen_q << " Sk=" << s.seqlen_k << " Hq=" << s.heads_q
    << " Hkv=" << s.heads_kv << " D=" << s.head_dim << " threads=" << threads << " block=" << block;
  return t.str();
}

// A score_mod and mask_mod run with no block mask and with block masks of 16 and 32.
template <class ScoreMod, class MaskMod>
void check_mods(const Shape& s, const char* name, const ScoreMod& score_mod, const MaskMod& mask_mod,
                std::uint64_t seed, AttentionOptions base = {}, DType dtype = DType::f32) {
  const Inputs in = make_inputs(s, seed, dtype);
  const FlexMods mods(score_mod, mask_mod);
  constexpr bool has_mask = FlexMods<ScoreMod, MaskMod>::kHasMask;
  for (std::int64_t block : {0, 16, 32})
    for (int threads : {1, 2, 3}) {
      if (!has_mask && block > 0) continue;  // a block mask comes from a mask_mod
      SCOPED_TRACE(trace(s, name, threads, block));
      AttentionOptions o = base;
      BlockMask blocks;
      if constexpr (has_mask)
        if (block > 0) blocks = create_block_mask(mask_mod, s.batch, s.heads_q, s.seqlen_q, s.seqlen_k, block);
      o.score_hook = mods.hook(block > 0 ? &blocks : nullptr);
      o.deterministic = threads == 3;
      check_against_reference(in, o, threads);
    }
}

TEST(Flex, RelativePositionBias) {
  std::uint64_t seed = 700;
  for (const Shape& s : kShapes) {
    const std::int64_t span = s.seqlen_q + s.seqlen_k;
    std::vector<float> table(static_cast<std::size_t>(s.heads_q * span));
    for (std::size_t e = 0; e < table.size(); ++e) table[e] = static_cast<float>((e * 37) % 101) / 50.0f - 1.0f;
    const auto bias = [&](auto score, std::int64_t, std::int64_t h, std::int64_t q, std::int64_t kv) {
      return score + table[static_cast<std::size_t>(h * span + q - kv + s.seqlen_k)];
    };
    check_mods(s, "relbias", bias, flex::NoMaskMod{}, seed++);
    AttentionOptions causal;
    causal.causal = true;
    check_mods(s, "relbias+causal", bias, flex::NoMaskMod{}, seed++, causal);
  }
}

TEST(Flex, PrefixLm) {
  std::uint64_t seed = 720;
  for (const Shape& s : kShapes) {
    const std::int64_t prefix = s.seqlen_k / 3, diagonal = s.seqlen_k - s.seqlen_q;
    const auto prefix_lm = [=](std::int64_t, std::int64_t, std::int64_t q, std::int64_t kv) {
      return kv < prefix || kv <= q + diagonal;
    };
    check_mods(s, "prefix_lm", flex::NoScoreMod{}, prefix_lm, seed++);
  }
}

// Packed documents of different lengths per batch element, causal within each; a relative
// bias on top (score_mod and mask_mod together).
TEST(Flex, DocumentMaskOverPackedBatch) {
  std::uint64_t seed = 740;
  for (const Shape& s : kShapes) {
    if (s.seqlen_q != s.seqlen_k) continue;
    std::vector<int> doc(static_cast<std::size_t>(s.batch * s.seqlen_q));
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t i = 0; i < s.seqlen_q; ++i) doc[static_cast<std::size_t>(b * s.seqlen_q + i)] =
          static_cast<int>((i + 7 * b) / (19 + 6 * b));
    const std::int64_t n = s.seqlen_q;
    const auto doc_mask = [&](std::int64_t b, std::int64_t, std::int64_t q, std::int64_t kv) {
      return doc[static_cast<std::size_t>(b * n + q)] == doc[static_cast<std::size_t>(b * n + kv)] && kv <= q;
    };
    check_mods(s, "document", flex::NoScoreMod{}, doc_mask, seed++);
    const auto decay = [](auto score, std::int64_t, std::int64_t h, std::int64_t q, std::int64_t kv) {
      return score - 0.01f * static_cast<float>(h + 1) * static_cast<float>(q - kv);
    };
    check_mods(s, "document+decay", decay, doc_mask, seed++);
  }
}

// Soft-capping as a score_mod (differentiated by the library through flex::tanh, and with a
// derivative of the user's) matches the built-in softcap.
TEST(Flex, SoftcapAsScoreMod) {
  std::uint64_t seed = 760;
  constexpr float cap = 1.5f;
  const auto softcap = [](auto score, std::int64_t, std::int64_t, std::int64_t, std::int64_t) {
    return cap * flex::tanh(score / cap);
  };
  const auto value = [](float score, std::int64_t, std::int64_t, std::int64_t, std::int64_t) {
    return cap * std::tanh(score / cap);
  };
  const auto slope = [](double score, std::int64_t, std::int64_t, std::int64_t, std::int64_t) {
    const double t = std::tanh(score / cap);
    return 1.0 - t * t;
  };
  const flex::WithDerivative explicit_softcap{value, slope};
  for (const Shape& s : kShapes) {
    check_mods(s, "softcap_mod", softcap, flex::NoMaskMod{}, seed);
    check_mods(s, "softcap_with_derivative", explicit_softcap, flex::NoMaskMod{}, seed);
    const Inputs in = make_inputs(s, seed++);
    AttentionOptions builtin;
    builtin.softcap = cap;
    builtin.causal = true;
    const ForwardResult want = forward(in.q.view(), in.k.view(), in.v.view(), builtin);
    const FlexMods mods(softcap);
    AttentionOptions o;
    o.causal = true;
    o.score_hook = mods.hook();
    const ForwardResult got = check_against_reference(in, o, 2);
    EXPECT_LE(max_abs_error(got.out, values(want.out)), 1e-5) << "score_mod softcap vs options.softcap";
  }
}

TEST(Flex, AlibiAsScoreMod) {
  std::uint64_t seed = 780;
  for (const Shape& s : kShapes) {
    Tensor slopes(DType::f32, {s.heads_q});
    for (std::int64_t h = 0; h < s.heads_q; ++h) slopes.set(h, std::exp2(-1.0f - 0.7f * static_cast<float>(h)));
    const float* sl = slopes.data_as<float>();
    const std::int64_t diagonal = s.seqlen_k - s.seqlen_q;
    const auto alibi = [=](auto score, std::int64_t, std::int64_t h, std::int64_t q, std::int64_t kv) {
      return score - sl[h] * static_cast<float>(std::llabs(q + diagonal - kv));
    };
    check_mods(s, "alibi_mod", alibi, flex::NoMaskMod{}, seed);
    const Inputs in = make_inputs(s, seed++);
    AttentionOptions builtin;
    builtin.alibi_slopes = slopes.view();
    const ForwardResult want = forward(in.q.view(), in.k.view(), in.v.view(), builtin);
    const FlexMods mods(alibi);
    AttentionOptions o;
    o.score_hook = mods.hook();
    const ForwardResult got = check_against_reference(in, o, 3);
    EXPECT_LE(max_abs_error(got.out, values(want.out)), 1e-5) << "score_mod ALiBi vs options.alibi_slopes";
  }
}

// The hook composes with the built-in variants: it sees their score (softcap, ALiBi, bias)
// and its mask joins theirs.
TEST(Flex, WithBuiltinVariants) {
  const Shape s{2, 97, 97, 4, 2, 32};
  const auto bias = [](auto score, std::int64_t b, std::int64_t h, std::int64_t q, std::int64_t kv) {
    return score * 0.75f + 0.05f * static_cast<float>((q * 3 + kv + b + h) % 7);
  };
  const auto stripes = [](std::int64_t, std::int64_t h, std::int64_t q, std::int64_t kv) {
    return (q + kv + h) % 5 != 0;
  };
  Tensor slopes(DType::f32, {s.heads_q});
  for (std::int64_t h = 0; h < s.heads_q; ++h) slopes.set(h, 0.1f * static_cast<float>(h + 1));
  AttentionOptions o;
  o.window_size = {40, 3};
  o.softcap = 2.0f;
  o.alibi_slopes = slopes.view();
  o.dropout_p = 0.1f;
  o.seed = 5;
  check_mods(s, "window+softcap+alibi+dropout", bias, stripes, 800, o);
}

TEST(Flex, EverySimdTarget) {
  std::uint64_t seed = 820;
  const auto bias = [](auto score, std::int64_t, std::int64_t h, std::int64_t q, std::int64_t kv) {
    return score + 0.03f * static_cast<float>((q - kv) % 11) - 0.2f * static_cast<float>(h);
  };
  const auto causal_docs = [](std::int64_t, std::int64_t, std::int64_t q, std::int64_t kv) {
    return q / 23 == kv / 23 && kv <= q;
  };
  for_each_simd_target([&](const std::string&) {
    check_mods({1, 61, 61, 4, 2, 24}, "docs+bias", bias, causal_docs, seed++);
    AttentionOptions split;
    split.num_splits = 3;
    check_mods({2, 2, 90, 4, 1, 40}, "bias decode split3", bias, flex::NoMaskMod{}, seed++, split);
  });
  for (DType dtype : {DType::bf16, DType::f16})
    check_mods({2, 97, 97, 4, 2, 32}, to_string(dtype).c_str(), bias, causal_docs, seed++, {}, dtype);
}

// A block mask from create_block_mask: its empty tiles are skipped (counted), and mask_mod is
// never asked about a key of a full block — an all-true mask_mod is not called at all. 512
// keys: K/V tiles of 256 (the float32 kernel's where L1 holds their panels) leave the last
// documents' Q tiles a whole empty tile.
TEST(Flex, BlockMaskSkipsEmptyTilesAndFullBlocks) {
  const Shape s{1, 512, 512, 2, 2, 32};
  const Inputs in = make_inputs(s, 900);
  std::atomic<std::int64_t> calls{0};
  const auto docs = [&](std::int64_t, std::int64_t, std::int64_t q, std::int64_t kv) {
    calls.fetch_add(1, std::memory_order_relaxed);
    return q / 64 == kv / 64 && kv <= q;
  };
  const FlexMods mods(flex::NoScoreMod{}, docs);
  const BlockMask blocks = create_block_mask(docs, 1, 1, s.seqlen_q, s.seqlen_k, 32);
  KernelCounters with_blocks, without_blocks;
  AttentionOptions o;
  o.block_q = 64;
  o.counters = &with_blocks;
  o.score_hook = mods.hook(&blocks);
  calls = 0;
  check_against_reference(in, o, 2, false);
  o.counters = &without_blocks;
  o.score_hook = mods.hook();
  check_against_reference(in, o, 2, false);
  EXPECT_GT(with_blocks.tiles_skipped, without_blocks.tiles_skipped);
  EXPECT_LT(with_blocks.tiles_computed, without_blocks.tiles_computed);

  const auto all = [&](std::int64_t, std::int64_t, std::int64_t, std::int64_t) {
    calls.fetch_add(1, std::memory_order_relaxed);
    return true;
  };
  const FlexMods all_mods(flex::NoScoreMod{}, all);
  const BlockMask full = create_block_mask(all, 1, 1, s.seqlen_q, s.seqlen_k, 32);
  for (std::int64_t e = 0; e < full.blocks.numel(); ++e) ASSERT_EQ(full.blocks.get(e), 2.0f);
  calls = 0;
  AttentionOptions f;
  f.score_hook = all_mods.hook(&full);
  forward(in.q.view(), in.k.view(), in.v.view(), f);
  EXPECT_EQ(calls.load(), 0) << "mask_mod called inside full blocks";
}

// A work item packs only the keys between its first and last tiles with work: keys that the
// block mask hides from every query are never converted (counted: kv_packed), whatever the
// planner's key tile.
TEST(Flex, KeysHiddenFromEveryQueryAreNotPacked) {
  const Shape s{1, 64, 700, 2, 2, 32};
  const Inputs in = make_inputs(s, 960);
  const auto first_keys = [](std::int64_t, std::int64_t, std::int64_t, std::int64_t kv) { return kv < 128; };
  const FlexMods mods(flex::NoScoreMod{}, first_keys);
  const BlockMask blocks = create_block_mask(first_keys, 1, 1, s.seqlen_q, s.seqlen_k, 128);
  KernelCounters counters;
  AttentionOptions o;
  o.score_hook = mods.hook(&blocks);
  o.counters = &counters;
  check_against_reference(in, o, 1, false);
  EXPECT_GT(counters.kv_packed, 0);
  EXPECT_LT(counters.kv_packed, s.heads_kv * s.seqlen_k * 2 * s.head_dim / 2)
      << "keys past 128 (and their tiles) hidden from every query were packed";
}

// A work item whose keys start where the thread's packed ones end — the next document of a
// packed batch — packs over the places of the keys before it (src/cpu/kernels/packed_head.hpp):
// the same outputs bit for bit as packing every item's keys anew (switches.reuse_packed_kv
// off), near the reference: documents of 150, 200 and 94 tokens (tiles and documents out of
// step), GQA, the float32 kernel and tiled_bf16 where the CPU has AVX512-BF16, 1–3 threads,
// every SIMD target.
TEST(Flex, DocumentsPackedOverTheSamePlacesGiveTheSameOutputs) {
  const Shape s{1, 444, 444, 4, 2, 40};
  const auto docs = [](std::int64_t, std::int64_t, std::int64_t q, std::int64_t kv) {
    const auto doc = [](std::int64_t t) { return t < 150 ? 0 : t < 350 ? 1 : 2; };
    return doc(q) == doc(kv) && kv <= q;
  };
  const FlexMods mods(flex::NoScoreMod{}, docs);
  const BlockMask blocks = create_block_mask(docs, 1, 1, s.seqlen_q, s.seqlen_k, 32);
  int bf16_runs = 0;
  for_each_simd_target([&](const std::string& target) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      if (dtype == DType::bf16 && !CpuHardware::detect(1).bf16_dot) continue;  // counted below
      const Inputs in = make_inputs(s, 1300, dtype);
      for (int threads : {1, 2, 3}) {
        SCOPED_TRACE(target + ", " + to_string(dtype) + ", " + std::to_string(threads) + " threads");
        AttentionOptions o;
        o.block_q = 64;
        o.score_hook = mods.hook(&blocks);
        if (dtype == DType::bf16) {
          o.kernel = ForwardKernel::tiled_bf16;
          ++bf16_runs;
        }
        const ForwardResult reused = check_against_reference(in, o, threads, false);
        o.switches.reuse_packed_kv = false;
        o.num_threads = threads;
        const ForwardResult packed = forward(in.q.view(), in.k.view(), in.v.view(), o);
        EXPECT_TRUE(bitwise_equal(reused.out, packed.out));
        EXPECT_TRUE(bitwise_equal(reused.lse, packed.lse));
      }
    }
  });
  if (cpu_has_avx512bf16()) EXPECT_GT(bf16_runs, 0) << "this CPU has AVX512-BF16: tiled_bf16 must have run";
}

// The partial blocks handed to the kernels carry mask_mod's values (BlockMask::partial_keep):
// each byte is mask_mod's, each partial block has its slot; the kernels read the bytes and
// never call mask_mod (counted), forward and backward, and give bit for bit what calling it
// gives (the same BlockMask without its bytes), with and without a score_mod, per-(batch,
// head) planes, ragged blocks (20) and blocks of 128 (kernel blocks of 32). A mask whose
// partial blocks exceed the budget (a random one) keeps none.
TEST(Flex, PartialBlocksAreReadAsBytes) {
  const Shape s{2, 150, 203, 4, 2, 40};
  const Inputs in = make_inputs(s, 930);
  std::atomic<std::int64_t> calls{0};
  const auto docs = [&](std::int64_t b, std::int64_t h, std::int64_t q, std::int64_t kv) {
    calls.fetch_add(1, std::memory_order_relaxed);
    const std::int64_t len = 50 + 13 * b + 7 * h;
    return q / len == kv / len && kv <= q + h;
  };
  const auto bias = [](auto score, std::int64_t, std::int64_t h, std::int64_t q, std::int64_t kv) {
    return score + 0.01f * static_cast<float>((h + 1) * (kv - q));
  };
  const FlexMods mask_only(flex::NoScoreMod{}, docs);
  const FlexMods both(bias, docs);
  for (std::int64_t block : {20, 32, 128}) {
    SCOPED_TRACE("block " + std::to_string(block));
    const BlockMask m = create_block_mask(docs, s.batch, s.heads_q, s.seqlen_q, s.seqlen_k, block);
    ASSERT_FALSE(m.partial_slots.shape().empty()) << "a document mask's diagonal blocks fit the budget";
    const bool kernel = m.kernel_block_size > 0;
    const Tensor& grid = kernel ? m.kernel_blocks : m.blocks;
    const std::int64_t unit = kernel ? m.kernel_block_size : m.block_size;
    const std::int64_t uq = grid.shape()[2], uk = grid.shape()[3];
    for (std::int64_t e = 0; e < grid.numel(); ++e) {
      const std::int32_t slot = m.partial_slots.data_as<std::int32_t>()[e];
      ASSERT_EQ(slot >= 0, grid.get(e) == 1.0f) << "unit " << e << ": a slot for each partial block, none elsewhere";
      if (slot < 0) continue;
      const std::int64_t bj = e % uk, bi = e / uk % uq, plane = e / (uk * uq);
      for (std::int64_t r = 0; r < unit; ++r)
        for (std::int64_t c = 0; c < unit; ++c) {
          const std::int64_t i = bi * unit + r, j = bj * unit + c;
          const bool want = i < s.seqlen_q && j < s.seqlen_k && docs(plane / s.heads_q, plane % s.heads_q, i, j);
          ASSERT_EQ(m.partial_keep.data_as<std::uint8_t>()[(slot * unit + r) * unit + c] != 0, want)
              << "slot " << slot << " (" << r << ", " << c << ")";
        }
    }
    BlockMask bare = m;
    bare.partial_slots = Tensor();
    bare.partial_keep = Tensor();
    for (const auto* mods : {static_cast<const void*>(&mask_only), static_cast<const void*>(&both)}) {
      const bool with_score = mods == &both;
      SCOPED_TRACE(with_score ? "score_mod and mask_mod" : "mask_mod");
      AttentionOptions o, o_bare;
      o.num_threads = o_bare.num_threads = 2;
      o.deterministic = o_bare.deterministic = true;
      o.score_hook = with_score ? both.hook(&m) : mask_only.hook(&m);
      o_bare.score_hook = with_score ? both.hook(&bare) : mask_only.hook(&bare);
      EXPECT_NE(o.score_hook.partial_slots.data, nullptr);
      EXPECT_EQ(o_bare.score_hook.partial_slots.data, nullptr);
      calls = 0;
      const ForwardResult fwd = forward(in.q.view(), in.k.view(), in.v.view(), o);
      const BackwardResult grads =
          backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), fwd.out.view(), fwd.lse.view(), o);
      EXPECT_EQ(calls.load(), 0) << "mask_mod called where the block mask holds its bytes";
      const ForwardResult fwd_bare = forward(in.q.view(), in.k.view(), in.v.view(), o_bare);
      const BackwardResult grads_bare = backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(),
                                                 fwd_bare.out.view(), fwd_bare.lse.view(), o_bare);
      EXPECT_GT(calls.load(), 0) << "without the bytes the kernels call mask_mod";
      for (const auto& [name, got, want] : {std::tuple{"out", &fwd.out, &fwd_bare.out},
                                            std::tuple{"lse", &fwd.lse, &fwd_bare.lse},
                                            std::tuple{"dq", &grads.dq, &grads_bare.dq},
                                            std::tuple{"dk", &grads.dk, &grads_bare.dk},
                                            std::tuple{"dv", &grads.dv, &grads_bare.dv}})
        EXPECT_EQ(std::memcmp(got->data(), want->data(), static_cast<std::size_t>(got->numel()) * 4), 0)
            << name << " differs from mask_mod's";
      check_against_reference(in, o, 2);
    }
  }
  const auto noise = [](std::int64_t, std::int64_t, std::int64_t q, std::int64_t kv) {
    return ((q * 2654435761u) ^ (kv * 40503u)) % 3 != 0;
  };
  const BlockMask random = create_block_mask(noise, 1, 1, 512, 512, 32);
  EXPECT_TRUE(random.partial_slots.shape().empty()) << "256 partial blocks of 1 KiB exceed 128 B per query and key";
  EXPECT_TRUE(random.partial_keep.shape().empty());
}

// Blocks of 64 and 128 hand the kernels blocks of 32 (BlockMask::kernel_blocks): the states
// create_block_mask's states against every element of mask_mod, classified here one block at
// a time (batch and heads of their own, ragged lengths, blocks of 32 and of 20); and an
// exception mask_mod throws on one of the library's threads reaches the caller.
TEST(Flex, CreateBlockMaskClassifiesEveryBlockFromItsElements) {
  const auto mod = [](std::int64_t b, std::int64_t h, std::int64_t q, std::int64_t kv) {
    return (q + 3 * b) / (90 + 7 * h) == kv / (90 + 7 * h) && kv <= q + 5 * b + h;
  };
  constexpr std::int64_t batch = 2, heads = 3, sq = 157, sk = 211;
  for (std::int64_t block : {32, 20}) {
    SCOPED_TRACE("block " + std::to_string(block));
    const BlockMask m = create_block_mask(mod, batch, heads, sq, sk, block);
    const std::int64_t qb = (sq + block - 1) / block, kb = (sk + block - 1) / block;
    ASSERT_EQ(m.blocks.shape(), (std::vector<std::int64_t>{batch, heads, qb, kb}));
    std::int64_t seen[3] = {};
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t h = 0; h < heads; ++h)
        for (std::int64_t bi = 0; bi < qb; ++bi)
          for (std::int64_t bj = 0; bj < kb; ++bj) {
            std::int64_t kept = 0, all = 0;
            for (std::int64_t i = bi * block; i < std::min(sq, (bi + 1) * block); ++i)
              for (std::int64_t j = bj * block; j < std::min(sk, (bj + 1) * block); ++j, ++all) kept += mod(b, h, i, j);
            const float want = kept == 0 ? 0.0f : kept == all ? 2.0f : 1.0f;
            ++seen[static_cast<int>(want)];
            ASSERT_EQ(m.blocks.get(((b * heads + h) * qb + bi) * kb + bj), want) << b << " " << h << " " << bi << " " << bj;
          }
    EXPECT_GT(seen[0] * seen[1] * seen[2], 0) << "every state occurs";
  }
  const auto throws = [](std::int64_t, std::int64_t, std::int64_t q, std::int64_t) {
    if (q == 150) throw Error("mask_mod: row 150");
    return true;
  };
  expect_error([&] { create_block_mask(throws, 1, 2, sq, sk, 32); }, {"mask_mod: row 150"});
}

// create_block_mask gives at 32 (ragged lengths, per-head masks), each coarse block the
// combination of its sub-blocks, and the forward's and backward's bits those of block 32.
TEST(Flex, LargeBlocksHandTheKernelsBlocksOf32) {
  const Shape s{2, 203, 290, 4, 2, 24};
  const Inputs in = make_inputs(s, 960);
  const auto docs = [](std::int64_t, std::int64_t h, std::int64_t q, std::int64_t kv) {
    return q / (50 + 10 * h) == kv / (50 + 10 * h) && kv <= q + 87;
  };
  const FlexMods mods(flex::NoScoreMod{}, docs);
  const BlockMask at32 = create_block_mask(docs, 1, s.heads_q, s.seqlen_q, s.seqlen_k, 32);
  ASSERT_EQ(at32.kernel_block_size, 0);
  AttentionOptions o32;
  o32.score_hook = mods.hook(&at32);
  o32.num_threads = 2;
  o32.deterministic = true;  // dq's bits then do not depend on the threads' timing
  const ForwardResult f32 = forward(in.q.view(), in.k.view(), in.v.view(), o32);
  const BackwardResult g32 =
      backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), f32.out.view(), f32.lse.view(), o32);
  for (std::int64_t block : {64, 128}) {
    SCOPED_TRACE("block " + std::to_string(block));
    const BlockMask m = create_block_mask(docs, 1, s.heads_q, s.seqlen_q, s.seqlen_k, block);
    ASSERT_EQ(m.kernel_block_size, 32);
    ASSERT_EQ(m.kernel_blocks.shape(), at32.blocks.shape());
    for (std::int64_t e = 0; e < at32.blocks.numel(); ++e) ASSERT_EQ(m.kernel_blocks.get(e), at32.blocks.get(e)) << e;
    const std::int64_t r = block / 32, uq = at32.blocks.shape()[2], uk = at32.blocks.shape()[3];
    const std::int64_t qb = m.blocks.shape()[2], kb = m.blocks.shape()[3];
    for (std::int64_t h = 0; h < s.heads_q; ++h)
      for (std::int64_t bi = 0; bi < qb; ++bi)
        for (std::int64_t bj = 0; bj < kb; ++bj) {
          bool empty = true, full = true;
          for (std::int64_t fi = bi * r; fi < std::min(uq, (bi + 1) * r); ++fi)
            for (std::int64_t fj = bj * r; fj < std::min(uk, (bj + 1) * r); ++fj) {
              const float state = at32.blocks.get((h * uq + fi) * uk + fj);
              empty = empty && state == 0.0f;
              full = full && state == 2.0f;
            }
          ASSERT_EQ(m.blocks.get((h * qb + bi) * kb + bj), empty ? 0.0f : full ? 2.0f : 1.0f) << h << " " << bi << " " << bj;
        }
    AttentionOptions o = o32;
    o.score_hook = mods.hook(&m);
    const ForwardResult f = forward(in.q.view(), in.k.view(), in.v.view(), o);
    ASSERT_EQ(std::memcmp(f.out.data(), f32.out.data(), static_cast<std::size_t>(f.out.numel()) * 4), 0);
    ASSERT_EQ(std::memcmp(f.lse.data(), f32.lse.data(), static_cast<std::size_t>(f.lse.numel()) * 4), 0);
    const BackwardResult g =
        backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), f.out.view(), f.lse.view(), o);
    for (const auto& [got, want] : {std::pair{&g.dq, &g32.dq}, {&g.dk, &g32.dk}, {&g.dv, &g32.dv}})
      ASSERT_EQ(std::memcmp(got->data(), want->data(), static_cast<std::size_t>(got->numel()) * 4), 0);
  }
}

// Bad input names the argument; paths without the hook reject it by name.
// A score_mod functor with overloads for one precision only (its values and Dual<double>, or
// its values and Dual<float>) is differentiated by the Dual it has: its gradients equal the
// reference's. The double-only one was let through backward() and then taken as having
// derivative 1 in the kernels (dq, dk a third of 3·s's).
struct TripleInDouble {
  double operator()(double s, std::int64_t, std::int64_t, std::int64_t, std::int64_t) const { return 3.0 * s; }
  flex::Dual<double> operator()(flex::Dual<double> s, std::int64_t, std::int64_t, std::int64_t, std::int64_t) const {
    return 3.0 * s;
  }
};
struct TripleInFloat {
  float operator()(float s, std::int64_t, std::int64_t, std::int64_t, std::int64_t) const { return 3.0f * s; }
  flex::Dual<float> operator()(flex::Dual<float> s, std::int64_t, std::int64_t, std::int64_t, std::int64_t) const {
    return 3.0f * s;
  }
};

TEST(Flex, ScoreModOfOnePrecisionIsDifferentiatedInIt) {
  const Shape s{2, 37, 45, 4, 2, 24};
  const Inputs in = make_inputs(s, 940);
  const FlexMods in_double{TripleInDouble{}};
  const FlexMods in_float{TripleInFloat{}};
  for (int threads : {1, 2}) {
    AttentionOptions o;
    o.score_hook = in_double.hook();
    check_against_reference(in, o, threads);
    o.score_hook = in_float.hook();
    check_against_reference(in, o, threads);
  }
}

// score_mod and mask_mod may throw: forward() and backward() rethrow the first exception
// (they ran on the library's threads, where it ended the process), on every thread count,
// and the same mods then serve a call that does not throw.
// One FlexMods serves one call at a time: its exception slot is the object's, so concurrent
// calls would take each other's exception (one failing for the other's mod, the other
// returning unspecified outputs without a word). A call given mods that a running call holds
// — here a call made from inside the first call's score_mod — is an Error naming score_hook
// (rethrown by the first call as its mod's exception); a copy serves a second call, and once
// a call returns, its mods serve the next.
TEST(Flex, ModsServeOneCallAtATime) {
  const Shape s{1, 8, 8, 1, 1, 8};
  const Inputs in = make_inputs(s, 947);
  const FlexMods<std::function<float(float, std::int64_t, std::int64_t, std::int64_t, std::int64_t)>>* shared = nullptr;
  bool inside = false;  // the nested call's own mod calls no further
  const std::function<float(float, std::int64_t, std::int64_t, std::int64_t, std::int64_t)> nested =
      [&](float x, std::int64_t, std::int64_t, std::int64_t q, std::int64_t kv) {
        if (q == 0 && kv == 0 && !inside) {
          AttentionOptions inner;
          inner.num_threads = 1;
          inner.score_hook = shared->hook();
          inside = true;
          try {
            forward(in.q.view(), in.k.view(), in.v.view(), inner);
          } catch (...) {
            inside = false;
            throw;
          }
          inside = false;
        }
        return x;
      };
  const FlexMods mods(nested);
  shared = &mods;
  AttentionOptions o;
  o.num_threads = 1;
  o.score_hook = mods.hook();
  expect_error([&] { forward(in.q.view(), in.k.view(), in.v.view(), o); },
               {"score_hook: its mods serve another call now", "its own copy"});
  const FlexMods copy = mods;  // the nested call through a copy: both run
  shared = &copy;
  check_against_reference(in, o, 1, false);
  check_against_reference(in, o, 1, false);  // mods the call before held serve the next
}

TEST(Flex, ExceptionFromAModReachesTheCaller) {
  const Shape s{1, 40, 64, 2, 1, 16};
  const Inputs in = make_inputs(s, 945);
  const std::vector<float> table(80, 0.25f);  // too short for kv − q past 40
  const auto bias = [&table](auto x, std::int64_t, std::int64_t, std::int64_t q, std::int64_t kv) {
    return x + table.at(static_cast<std::size_t>(kv - q + 39));
  };
  const auto causal_checked = [](std::int64_t, std::int64_t, std::int64_t q, std::int64_t kv) {
    if (kv > 60) throw std::out_of_range("mask_mod: kv past 60");
    return kv <= q + 24;
  };
  const FlexMods scores(bias);
  const FlexMods masks(flex::NoScoreMod{}, causal_checked);
  for (int threads : {1, 2, 3}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    AttentionOptions o;
    o.num_threads = threads;
    o.score_hook = scores.hook();
    EXPECT_THROW(forward(in.q.view(), in.k.view(), in.v.view(), o), std::out_of_range);
    const ForwardResult f = forward(in.q.view(), in.k.view(), in.v.view(), AttentionOptions{});
    EXPECT_THROW(backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), f.out.view(), f.lse.view(), o),
                 std::out_of_range);
    o.score_hook = masks.hook();
    EXPECT_THROW(forward(in.q.view(), in.k.view(), in.v.view(), o), std::out_of_range);
  }
  // The float64 reference calls the mods on its own threads too.
  {
    AttentionOptions o;
    o.score_hook = scores.hook();
    EXPECT_THROW(reference::attention(in.q.view(), in.k.view(), in.v.view(), o), std::out_of_range);
    EXPECT_THROW(reference::attention_probs(in.q.view(), in.k.view(), in.v.view(), o), std::out_of_range);
    EXPECT_THROW(reference::attention_backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), o),
                 std::out_of_range);
    o.score_hook = masks.hook();
    EXPECT_THROW(reference::attention(in.q.view(), in.k.view(), in.v.view(), o), std::out_of_range);
  }
  // The same mods over keys they can read: no stale exception, the reference's result.
  const Shape ok{1, 40, 40, 2, 1, 16};
  AttentionOptions o;
  o.score_hook = scores.hook();
  check_against_reference(make_inputs(ok, 946), o, 2);
  o.score_hook = masks.hook();
  check_against_reference(make_inputs(ok, 947), o, 2);
}

// A block_size past every sequence length, up to INT64_MAX: one block per plane, its bytes
// kept or not by a budget that no longer overflows (unit² wrapped, passed the budget, and the
// bytes' tensor was allocated from a wrapped size: a heap overflow); the reference's result.
TEST(Flex, HugeBlockSizesMakeOneBlock) {
  const Shape s{1, 10, 10, 2, 1, 16};
  const Inputs in = make_inputs(s, 948);
  const auto causal = [](std::int64_t, std::int64_t, std::int64_t q, std::int64_t kv) { return kv <= q; };
  const FlexMods mods(flex::NoScoreMod{}, causal);
  for (std::int64_t block : {std::int64_t{3037000501}, std::int64_t{4611686018427387905},
                             std::numeric_limits<std::int64_t>::max()}) {
    SCOPED_TRACE("block_size " + std::to_string(block));
    const BlockMask m = create_block_mask(causal, 1, 1, s.seqlen_q, s.seqlen_k, block);
    ASSERT_EQ(m.blocks.numel(), 1);
    EXPECT_EQ(m.blocks.get(0), static_cast<float>(static_cast<std::uint8_t>(ScoreBlock::partial)));
    EXPECT_TRUE(m.partial_keep.shape().empty());  // a block of block_size² bytes is over the budget
    AttentionOptions o;
    o.score_hook = mods.hook(&m);
    check_against_reference(in, o, 2);
  }
}

TEST(Flex, BadInputNamesTheArgument) {
  const Shape s{1, 20, 24, 2, 1, 16};
  const Inputs in = make_inputs(s, 950);
  const auto causal = [](std::int64_t, std::int64_t, std::int64_t q, std::int64_t kv) { return kv <= q; };
  const auto float_only = [](float x, std::int64_t, std::int64_t, std::int64_t, std::int64_t) { return 2.0f * x; };
  const FlexMods masks(flex::NoScoreMod{}, causal);
  const FlexMods no_derivative(float_only);
  AttentionOptions o;
  o.score_hook = no_derivative.hook();
  const ForwardResult fwd = forward(in.q.view(), in.k.view(), in.v.view(), o);  // forward needs no derivative
  expect_error([&] { backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), fwd.out.view(), fwd.lse.view(), o); },
               {"score_hook", "no derivative"});
  const BlockMask wrong = create_block_mask(causal, 1, 1, s.seqlen_q, s.seqlen_k + 40, 8);
  o.score_hook = masks.hook(&wrong);
  expect_error([&] { forward(in.q.view(), in.k.view(), in.v.view(), o); }, {"score_hook.block_mask: shape (1, 1, 3, 8)"});
  o.score_hook = masks.hook();
  o.score_hook.block_size = 4;
  expect_error([&] { forward(in.q.view(), in.k.view(), in.v.view(), o); }, {"score_hook.block_mask"});
  const BlockMask with_bytes = create_block_mask(causal, 1, 1, s.seqlen_q, s.seqlen_k, 8);
  ASSERT_FALSE(with_bytes.partial_slots.shape().empty());
  Tensor slots = with_bytes.partial_slots;
  o.score_hook = masks.hook(&with_bytes);
  o.score_hook.partial_slots = with_bytes.partial_keep.view();
  expect_error([&] { forward(in.q.view(), in.k.view(), in.v.view(), o); }, {"score_hook.partial_slots"});
  slots.data_as<std::int32_t>()[5] = static_cast<std::int32_t>(with_bytes.partial_keep.shape()[0]);
  o.score_hook.partial_slots = slots.view();
  expect_error([&] { forward(in.q.view(), in.k.view(), in.v.view(), o); },
               {"score_hook.partial_slots: slot " + std::to_string(with_bytes.partial_keep.shape()[0]),
                "(0, 0, 1, 2)"});
  // A block state that is no ScoreBlock, at its place in the hook's block mask.
  BlockMask bad_state = create_block_mask(causal, 1, 1, s.seqlen_q, s.seqlen_k, 8);
  o.score_hook = masks.hook(&bad_state);
  const TensorView& states = o.score_hook.block_mask;
  ASSERT_EQ(states.data, bad_state.blocks.data());
  bad_state.blocks.data_as<std::uint8_t>()[states.strides[2] + 2 * states.strides[3]] = 7;
  expect_error([&] { forward(in.q.view(), in.k.view(), in.v.view(), o); },
               {"score_hook.block_mask: value 7 at (0, 0, 1, 2)", "ScoreBlock"});
  o.score_hook = masks.hook(&with_bytes);
  o.score_hook.partial_keep = with_bytes.partial_slots.view();
  expect_error([&] { forward(in.q.view(), in.k.view(), in.v.view(), o); }, {"score_hook.partial_keep"});
  o.score_hook = masks.hook();
  o.score_hook.partial_slots = with_bytes.partial_slots.view();
  expect_error([&] { forward(in.q.view(), in.k.view(), in.v.view(), o); },
               {"score_hook.partial_slots", "without a block_mask"});
  o.score_hook = masks.hook();
  o.score_hook.mask = nullptr;
  expect_error([&] { forward(in.q.view(), in.k.view(), in.v.view(), o); }, {"score_hook", "neither"});
  expect_error([] { create_block_mask([](auto...) { return true; }, 1, 1, 8, 8, 0); },
               {"create_block_mask", "block_size"});
  o.score_hook = masks.hook();
  Tensor cu(DType::i32, {2});
  cu.set(0, 0.0f);
  cu.set(1, 20.0f);
  const Tensor q3 = random_tensor(DType::f32, {20, 2, 16}, 1), k3 = random_tensor(DType::f32, {20, 1, 16}, 2);
  expect_error([&] { forward_varlen(q3.view(), k3.view(), k3.view(), {cu.view(), cu.view(), 20, 20}, o); },
               {"score_hook: not supported by the variable-length entry points"});
  Tensor k_cache = random_tensor(DType::f32, {1, 24, 1, 16}, 3), v_cache = random_tensor(DType::f32, {1, 24, 1, 16}, 4);
  KvCache cache;
  cache.k_cache = k_cache.view();
  cache.v_cache = v_cache.view();
  expect_error([&] { forward_with_kvcache(in.q.view(), cache, o); }, {"score_hook: not supported by forward_with_kvcache"});
  PagedKvBatch paged;
  paged.k_cache = k_cache.view();
  paged.v_cache = v_cache.view();
  Tensor out3(DType::f32, {20, 2, 16}), lse3(DType::f32, {2, 20});
  expect_error([&] { forward_varlen_paged(q3.view(), cu.view(), 20, paged, out3.view(), lse3.view(), o); },
               {"score_hook: not supported by forward_varlen_paged"});
  const Fp8Tensor q8 = quantize_fp8(in.q.view(), Fp8Format::e4m3), k8 = quantize_fp8(in.k.view(), Fp8Format::e4m3);
  expect_error([&] { forward_fp8(q8.view(), k8.view(), k8.view(), DType::f32, o); },
               {"score_hook: not supported by forward_fp8"});
  const Tensor bias = random_tensor(DType::f32, {1, 1, s.seqlen_q, s.seqlen_k}, 5);
  Tensor dbias(DType::f32, {1, 1, s.seqlen_q, s.seqlen_k});
  o.score_hook = masks.hook();
  o.attn_mask = bias.view();
  o.dbias = dbias.view();
  expect_error([&] { backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), fwd.out.view(), fwd.lse.view(), o); },
               {"dbias: not supported with a score_hook"});
}

// flex::detail::affine_span, the Python FlexAttention hook's step, on every SIMD target against
// its formula: operands contiguous, broadcast (step 0) and strided (a step of 2, one score at
// a time), with keep bytes, −∞ scores and spans of every length up to three vectors.
TEST(Flex, AffineSpanAppliesItsFormulaOnEveryTarget) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const float c_scale = 1.4426950408889634f;
  std::vector<float> a(96), c(96);
  std::vector<std::uint8_t> keep(96);
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i] = 0.5f + 0.01f * static_cast<float>(i);
    c[i] = -1.0f + 0.03f * static_cast<float>(i);
    keep[i] = static_cast<std::uint8_t>(i % 3 != 1);
  }
  test::for_each_simd_target([&](const std::string&) {
    for (std::int64_t n : {1, 7, 16, 17, 33, 48}) {
      for (std::int64_t step : {0, 1, 2}) {
        for (bool with_keep : {false, true}) {
          std::vector<float> s(static_cast<std::size_t>(n)), grad(s.size());
          for (std::int64_t k = 0; k < n; ++k) {
            s[k] = k % 5 == 2 ? kNegInf : 0.25f * static_cast<float>(k) - 3.0f;
            grad[k] = 1.0f + 0.125f * static_cast<float>(k);
          }
          const std::vector<float> s0 = s, grad0 = grad;
          flex::detail::affine_span(s.data(), grad.data(), n, a.data(), step, c.data(), step, c_scale,
                                    with_keep ? keep.data() : nullptr, with_keep ? step : 0);
          for (std::int64_t k = 0; k < n; ++k) {
            SCOPED_TRACE("n " + std::to_string(n) + " step " + std::to_string(step) + " keep " +
                         std::to_string(with_keep) + " k " + std::to_string(k));
            const bool kept = s0[k] != kNegInf && (!with_keep || keep[k * step] != 0);
            if (!kept) {
              EXPECT_EQ(s[k], kNegInf);
              EXPECT_EQ(grad[k], 0.0f);
              continue;
            }
            const double want = static_cast<double>(a[k * step]) * s0[k] + static_cast<double>(c[k * step]) * c_scale;
            EXPECT_NEAR(s[k], want, 4e-7 * (1.0 + std::fabs(want)));
            EXPECT_EQ(grad[k], grad0[k] * a[k * step]);
          }
        }
      }
    }
    std::vector<float> s{1.0f, kNegInf, 2.0f};  // no coefficients, no bytes: unchanged
    flex::detail::affine_span(s.data(), nullptr, 3, nullptr, 0, nullptr, 0, c_scale, nullptr, 0);
    EXPECT_EQ(s, (std::vector<float>{1.0f, kNegInf, 2.0f}));
  });
}

}  // namespace
}  // namespace flashattn::test
