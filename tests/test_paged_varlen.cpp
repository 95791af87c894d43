// forward_varlen_paged: each sequence of a paged batch — decode rows, prefill chunks and
// empty sequences mixed, over pages shuffled in the pools — against the float64 reference
// (check_forward on its own Case); bit-identical alone, in any batch and on 1, 2 or 3
// threads; an FP8 pool equal to the KV cache's read of the same pages; bad calls rejected
// before anything is written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <random>

#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

struct Lengths {
  std::int64_t q, k;
};

constexpr std::int64_t kHq = 4, kHkv = 2, kDim = 32;

// A paged batch: sequence b's inputs are those of cases[b] (batch 1), its keys spread over
// shuffled pages of pools whose other slots hold NaN (read, they would poison the output);
// table entries past a sequence's pages are −1.
struct Batch {
  std::vector<Case> cases;
  std::vector<Inputs> inputs;
  Tensor q, k_pool, v_pool, table, seqused, cu_q, k_scale, v_scale;
  std::int64_t max_q = 0;

  PagedKvBatch kv() const {
    PagedKvBatch r{k_pool.view(), v_pool.view(), table.view(), seqused.view(), {}, {}};
    if (k_pool.dtype() == DType::u8) {
      r.k_scale = k_scale.view();
      r.v_scale = v_scale.view();
    }
    return r;
  }
  ForwardResult run(const AttentionOptions& o) const {
    return forward_varlen_paged(q.view(), cu_q.view(), max_q, kv(), o);
  }
  std::int64_t rows(std::size_t b) const { return cu_q.get(static_cast<std::int64_t>(b) + 1) - cu_q.get(static_cast<std::int64_t>(b)); }
};

Batch make_batch(const std::vector<Lengths>& lengths, DType dtype, std::int64_t page_size, const AttentionOptions& o,
                 std::uint64_t seed, bool alibi = false, bool fp8 = false) {
  Batch r;
  const auto batch = static_cast<std::int64_t>(lengths.size());
  std::int64_t total_q = 0, pages = 0, max_pages = 1;
  for (const Lengths& l : lengths) {
    Case c(Shape{1, l.q, l.k, kHq, kHkv, kDim, kDim}, dtype, o, seed + 10 * r.cases.size());
    r.cases.push_back(alibi ? c.with_alibi() : c);
    r.inputs.push_back(r.cases.back().inputs());
    total_q += l.q;
    r.max_q = std::max(r.max_q, l.q);
    const std::int64_t n = (l.k + page_size - 1) / page_size;
    pages += n;
    max_pages = std::max(max_pages, n + 1);
  }
  pages += 3;  // pages no sequence reads
  std::vector<std::int32_t> order(static_cast<std::size_t>(pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(seed)));
  const DType pool = fp8 ? DType::u8 : dtype;
  r.k_pool = Tensor(pool, {pages, page_size, kHkv, kDim});
  r.v_pool = Tensor(pool, {pages, page_size, kHkv, kDim});
  if (fp8) {
    Fp8CacheTensors f = fp8_cache({pages, page_size, kHkv, kDim});
    r.k_pool = f.k_codes, r.v_pool = f.v_codes, r.k_scale = f.k_scale, r.v_scale = f.v_scale;
    for (std::int64_t i = 0; i < r.k_scale.numel(); ++i) r.k_scale.set(i, 0.03125f * static_cast<float>(1 + i % 3));
  } else {
    for (std::int64_t i = 0; i < r.k_pool.numel(); ++i)
      r.k_pool.set(i, std::numeric_limits<float>::quiet_NaN()), r.v_pool.set(i, std::numeric_limits<float>::quiet_NaN());
  }
  r.table = Tensor(DType::i32, {batch, max_pages});
  r.seqused = Tensor(DType::i32, {batch});
  r.cu_q = Tensor(DType::i32, {batch + 1});
  r.q = Tensor(dtype, {total_q, kHq, kDim});
  std::int64_t next_page = 0, q0 = 0;
  r.cu_q.set(0, 0);
  for (std::int64_t b = 0; b < batch; ++b) {
    const Lengths l = lengths[static_cast<std::size_t>(b)];
    const Inputs& in = r.inputs[static_cast<std::size_t>(b)];
    for (std::int64_t i = 0; i < l.q * kHq * kDim; ++i) r.q.set(q0 * kHq * kDim + i, in.q.get(i));
    q0 += l.q;
    r.cu_q.set(b + 1, static_cast<float>(q0));
    r.seqused.set(b, static_cast<float>(l.k));
    for (std::int64_t pg = 0; pg < max_pages; ++pg)
      r.table.set(b * max_pages + pg, pg * page_size < l.k ? static_cast<float>(order[next_page++]) : -1.0f);
    if (fp8) continue;  // the FP8 pool keeps its codes
    for (std::int64_t j = 0; j < l.k; ++j) {
      const std::int64_t page = static_cast<std::int64_t>(r.table.get(b * max_pages + j / page_size));
      const std::int64_t slot = (page * page_size + j % page_size) * kHkv * kDim;
      for (std::int64_t e = 0; e < kHkv * kDim; ++e) {
        r.k_pool.set(slot + e, in.k.get(j * kHkv * kDim + e));
        r.v_pool.set(slot + e, in.v.get(j * kHkv * kDim + e));
      }
    }
  }
  return r;
}

// Sequence b's rows of a batch result, as the (1, seqlen_q, heads, dim) result of a batch of one.
ForwardResult sequence_result(const ForwardResult& all, const Batch& batch, std::size_t b) {
  return packed_rows(all, batch.cu_q.get(static_cast<std::int64_t>(b)), batch.rows(b));
}

// Decode rows (some over more than kSplitKeys keys: split), prefill chunks over cached keys,
// empty sequences, a sequence without keys and causal rows that see none (q longer than k).
const std::vector<Lengths> kMix{{1, 2500}, {0, 20}, {40, 100}, {1, 0}, {3, 17}, {70, 50}, {1, 1}, {0, 0}, {16, 300}};

TEST(PagedVarlen, EachSequenceMatchesTheReference) {
  AttentionOptions causal;
  causal.causal = true;
  AttentionOptions window = causal;
  window.window_size = {20, 0};
  AttentionOptions softcap = causal;
  softcap.softcap = 5.0f;
  const std::vector<std::pair<const char*, AttentionOptions>> variants{
      {"plain", {}}, {"causal", causal}, {"window", window}, {"softcap", softcap}};
  for_each_simd_target([&](const std::string&) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f16})
      for (const auto& [name, options] : variants)
        for (bool alibi : {false, true}) {
          if (alibi && std::string(name) != "causal") continue;
          SCOPED_TRACE(std::string(name) + (alibi ? " alibi " : " ") + to_string(dtype));
          AttentionOptions o = options;
          o.num_threads = 3;
          for (std::int64_t page_size : {16, 5}) {
            const Batch batch = make_batch(kMix, dtype, page_size, o, 7, alibi);
            AttentionOptions call = o;
            if (alibi) call.alibi_slopes = batch.cases.front().options().alibi_slopes;
            const ForwardResult all = batch.run(call);
            for (std::size_t b = 0; b < kMix.size(); ++b) {
              if (batch.rows(b) == 0) continue;
              SCOPED_TRACE("sequence " + std::to_string(b) + " page size " + std::to_string(page_size));
              const ForwardResult mine = sequence_result(all, batch, b);
              check_forward(batch.cases[b], [&](const Case&, const Inputs&) {
                return ForwardResult{mine.out, mine.lse};
              });
            }
          }
        }
  });
}

// ALiBi slopes per sequence, (batch, heads_q): sequence b reads row b. Rows that repeat the
// (heads_q) slopes give their result bit for bit; a row scaled differently changes its
// sequence alone.
TEST(PagedVarlen, AlibiSlopesPerSequence) {
  AttentionOptions o;
  o.causal = true;
  const Batch batch = make_batch(kMix, DType::f32, 16, o, 9, true);
  const TensorView shared = batch.cases.front().options().alibi_slopes;
  const auto n = static_cast<std::int64_t>(kMix.size());
  Tensor rows(DType::f32, {n, kHq});
  for (std::int64_t b = 0; b < n; ++b)
    for (std::int64_t h = 0; h < kHq; ++h)
      rows.set(b * kHq + h, static_cast<const float*>(shared.data)[h * shared.strides[0]] * (b == 2 ? 2.0f : 1.0f));
  AttentionOptions one = o, each = o;
  one.alibi_slopes = shared;
  each.alibi_slopes = rows.view();
  const ForwardResult a = batch.run(one), b = batch.run(each);
  for (std::size_t s = 0; s < kMix.size(); ++s) {
    const ForwardResult x = sequence_result(a, batch, s), y = sequence_result(b, batch, s);
    EXPECT_EQ(bitwise_equal(x.out, y.out), s != 2) << "sequence " << s;
  }
  // A bad slope is named by its sequence and head, as forward()'s are by batch and head.
  rows.set(1 * kHq + 1, NAN);
  expect_error([&] { batch.run(each); }, {"alibi_slopes: slope of batch 1, head 1 is nan"});
}

// The sequences `pick` of a batch, in that order, over the same pools.
Batch subset(const Batch& all, const std::vector<std::size_t>& pick) {
  Batch r = all;
  const auto batch = static_cast<std::int64_t>(pick.size());
  const std::int64_t width = all.table.shape()[1], row = kHq * kDim;
  std::int64_t total = 0;
  for (std::size_t b : pick) total += all.rows(b);
  r.cases.clear();
  r.inputs.clear();
  r.q = Tensor(all.q.dtype(), {total, kHq, kDim});
  r.table = Tensor(DType::i32, {batch, width});
  r.seqused = Tensor(DType::i32, {batch});
  r.cu_q = Tensor(DType::i32, {batch + 1});
  r.cu_q.set(0, 0);
  std::int64_t q0 = 0;
  for (std::int64_t i = 0; i < batch; ++i) {
    const std::size_t b = pick[static_cast<std::size_t>(i)];
    const std::int64_t from = all.cu_q.get(static_cast<std::int64_t>(b));
    for (std::int64_t e = 0; e < all.rows(b) * row; ++e) r.q.set(q0 * row + e, all.q.get(from * row + e));
    q0 += all.rows(b);
    r.cu_q.set(i + 1, static_cast<float>(q0));
    r.seqused.set(i, all.seqused.get(static_cast<std::int64_t>(b)));
    for (std::int64_t pg = 0; pg < width; ++pg) r.table.set(i * width + pg, all.table.get(static_cast<std::int64_t>(b) * width + pg));
  }
  return r;
}

// A sequence's out and lse alone, in the batch, in the batch reversed, on 1, 2 and 3 threads.
void expect_batch_invariant(bool fp8) {
  AttentionOptions o;
  o.causal = true;
  const Batch batch = make_batch(kMix, DType::bf16, 16, o, 3, false, fp8);
  std::vector<std::size_t> reversed(kMix.size());
  std::iota(reversed.rbegin(), reversed.rend(), std::size_t{0});
  const Batch backwards = subset(batch, reversed);
  std::vector<ForwardResult> first;
  for (int threads : {1, 2, 3}) {
    SCOPED_TRACE(std::to_string(threads) + " threads");
    o.num_threads = threads;
    const ForwardResult all = batch.run(o), all_backwards = backwards.run(o);
    for (std::size_t b = 0; b < kMix.size(); ++b) {
      SCOPED_TRACE("sequence " + std::to_string(b));
      const ForwardResult mine = sequence_result(all, batch, b);
      const Batch single = subset(batch, {b});
      const ForwardResult alone = sequence_result(single.run(o), single, 0);
      const ForwardResult moved = sequence_result(all_backwards, backwards, kMix.size() - 1 - b);
      for (const ForwardResult* other : {&alone, &moved, threads == 1 ? &mine : &first[b]}) {
        EXPECT_TRUE(bitwise_equal(mine.out, other->out));
        EXPECT_TRUE(bitwise_equal(mine.lse, other->lse));
      }
      if (threads == 1) first.push_back(mine);
    }
  }
}

TEST(PagedVarlen, BitIdenticalAloneInAnyBatchOnAnyThreads) { expect_batch_invariant(false); }
TEST(PagedVarlen, Fp8PoolBitIdenticalAloneInAnyBatchOnAnyThreads) { expect_batch_invariant(true); }

// Each sequence's plan (AttentionOptions::plans_run, batch order, sequences with rows) is the
// same on every thread count: decode rows split their keys in shares of about kSplitKeys =
// 2048, prefill chunks take the tiled kernel unsplit.
TEST(PagedVarlen, PlansDependOnTheSequenceAlone) {
  AttentionOptions o;
  o.causal = true;
  const Batch batch = make_batch(kMix, DType::bf16, 16, o, 3);
  std::vector<std::string> first;
  for (int threads : {1, 2, 3}) {
    PlansRun plans;
    o.num_threads = threads;
    o.plans_run = &plans;
    batch.run(o);
    ASSERT_EQ(plans.forward.size(), 7u);  // kMix has two sequences without rows
    const CpuForwardPlan& long_decode = plans.forward[0];  // (1, 2500)
    EXPECT_TRUE(is_decode(long_decode.kernel));
    EXPECT_EQ(long_decode.splits, 2);
    // (40, 100): bf16 runs the tiled_bf16 kernel where the CPU's bf16 products outpace FMA
    const CpuHardware hw = CpuHardware::detect(threads);
    EXPECT_EQ(plans.forward[1].kernel, hw.bf16_dot_fast ? ForwardKernel::tiled_bf16 : ForwardKernel::tiled)
        << "bf16_dot_fast " << hw.bf16_dot_fast;
    EXPECT_EQ(plans.forward[1].splits, 1);
    for (std::size_t i = 0; i < plans.forward.size(); ++i) {
      CpuForwardPlan p = plans.forward[i];
      p.threads = 0;  // the threads a plan may use are the call's
      p.hardware.threads = 0;
      if (threads == 1) {
        first.push_back(p.describe());
      } else {
        EXPECT_EQ(p.describe(), first[i]) << "sequence with rows " << i;
      }
    }
  }
}

// pack_gqa changes no bit of a paged batch: its prefill chunks (2 q heads a kv head) stack
// their heads' rows in one Q tile or not, its decode rows take the decode kernel either way.
TEST(PagedVarlen, PackGqaChangesNoBit) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    AttentionOptions o;
    o.causal = true;
    o.num_threads = 2;
    const Batch batch = make_batch(kMix, dtype, 16, o, 5);
    AttentionOptions packed = o, unpacked = o;
    packed.pack_gqa = true;
    unpacked.pack_gqa = false;
    PlansRun plans;
    packed.plans_run = &plans;
    const ForwardResult got = batch.run(packed), want = batch.run(unpacked);
    EXPECT_EQ(plans.forward[1].heads_per_item, kHq / kHkv) << plans.forward[1].describe();  // (40, 100)
    EXPECT_TRUE(bitwise_equal(got.out, want.out)) << to_string(dtype);
    EXPECT_TRUE(bitwise_equal(got.lse, want.lse)) << to_string(dtype);
  }
}

// An FP8 pool read by forward_varlen_paged equals forward_with_kvcache's read of the same
// pages (tested against the reference in test_kvcache.cpp) bit for bit: one thread and one
// key share plan both calls alike.
TEST(PagedVarlen, Fp8PoolEqualsTheKvCacheRead) {
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    AttentionOptions o;
    o.causal = causal;
    o.num_threads = 1;
    o.num_splits = 1;
    Batch batch = make_batch(kMix, DType::f32, 16, o, 11, false, true);
    const ForwardResult all = batch.run(o);
    for (std::size_t b = 0; b < kMix.size(); ++b) {
      if (batch.rows(b) == 0) continue;
      SCOPED_TRACE("sequence " + std::to_string(b));
      const Batch single = subset(batch, {b});
      Tensor q(DType::f32, {1, single.rows(0), kHq, kDim});
      for (std::int64_t i = 0; i < q.numel(); ++i) q.set(i, single.q.get(i));
      KvCache c{batch.k_pool.view(), batch.v_pool.view(), single.table.view(), single.seqused.view()};
      c.k_scale = batch.k_scale.view();
      c.v_scale = batch.v_scale.view();
      const ForwardResult want = forward_with_kvcache(q.view(), c, o);
      const ForwardResult got = sequence_result(all, batch, b);
      EXPECT_TRUE(bitwise_equal(got.out, want.out));
      EXPECT_TRUE(bitwise_equal(got.lse, want.lse));
    }
  }
}

TEST(PagedVarlen, RejectsBadCallsBeforeWriting) {
  const Batch good = make_batch({{1, 40}, {5, 17}, {0, 3}}, DType::bf16, 16, {}, 5);
  const Batch fp8 = make_batch({{1, 40}, {5, 17}}, DType::bf16, 16, {}, 5, false, true);
  Tensor out(DType::bf16, {good.q.shape()[0], kHq, kDim}), lse(DType::f32, {kHq, good.q.shape()[0]});
  for (std::int64_t i = 0; i < out.numel(); ++i) out.set(i, 7.0f);
  for (std::int64_t i = 0; i < lse.numel(); ++i) lse.set(i, 7.0f);
  auto expect_rejected = [&](const Batch& bad, const AttentionOptions& o, const std::vector<std::string>& fragments) {
    SCOPED_TRACE(fragments.front());
    if (bad.q.shape()[0] == out.shape()[0]) {
      expect_error([&] { forward_varlen_paged(bad.q.view(), bad.cu_q.view(), bad.max_q, bad.kv(), out.view(), lse.view(), o); },
                   fragments);
      for (std::int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.get(i), 7.0f);
      for (std::int64_t i = 0; i < lse.numel(); ++i) ASSERT_EQ(lse.get(i), 7.0f);
    }
    expect_error([&] { bad.run(o); }, fragments);
  };
  const std::int64_t pages = good.k_pool.shape()[0], width = good.table.shape()[1];
  Batch b = good;
  b.table.set(width, static_cast<float>(pages));  // sequence 1's first page
  expect_rejected(b, {}, {"block_table: [1, 0] = " + std::to_string(pages), "outside the cache's"});
  b = good;
  b.table.set(0, -2.0f);
  expect_rejected(b, {}, {"block_table: [0, 0] = -2"});
  b = good;
  b.seqused.set(2, static_cast<float>(width * 16 + 1));
  expect_rejected(b, {}, {"seqused_k: [2] = " + std::to_string(width * 16 + 1), "max_pages · page_size"});
  b = good;
  b.seqused.set(0, -1.0f);
  expect_rejected(b, {}, {"seqused_k: [0] = -1"});
  b = good;
  b.cu_q.set(1, 4.0f);  // 0, 4, 6, 6: sequence 1 would end before it starts
  b.cu_q.set(2, 3.0f);
  expect_rejected(b, {}, {"cu_seqlens_q", "non-decreasing"});
  b = good;
  b.cu_q.set(3, 7.0f);
  expect_rejected(b, {}, {"cu_seqlens_q", "does not match"});
  b = good;
  b.max_q = 4;
  expect_rejected(b, {}, {"max_seqlen_q = 4"});
  b = good;
  b.k_pool = Tensor(DType::f16, good.k_pool.shape());
  expect_rejected(b, {}, {"k_cache", "f16"});
  b = good;
  b.seqused = Tensor(DType::i32, {2});
  expect_rejected(b, {}, {"seqused_k"});
  AttentionOptions masked;
  const Tensor mask(DType::u8, {1, 1, 1});
  masked.block_mask = mask.view();
  expect_rejected(good, masked, {"block_mask"});
  AttentionOptions dropout;  // keyed by the batch index, it would break batch invariance
  dropout.dropout_p = 0.1f;
  expect_rejected(good, dropout, {"dropout_p: 0.1", "inference only"});
  Batch f = fp8;
  f.k_scale.set(static_cast<std::int64_t>(f.table.get(0)) * kHkv + 1, 0.0f);
  expect_rejected(f, {}, {"k_scale", "finite positive descale"});
  f = fp8;
  f.v_scale = Tensor(DType::f32, {1, kHkv});
  expect_rejected(f, {}, {"v_scale"});
}


// A packed KV-cache call (forward_with_kvcache with cu_seqlens_q, cu_seqlens_k_new) over the
// pools of `batch`: sequence b's last added[b] keys are taken out of its pages (their slots
// set to NaN) and given as new k, v, packed; cache_seqlens the keys before them.
struct PackedAppend {
  Tensor k_pool, v_pool, k, v, cu_new, seqlens;
  KvCache cache(const Batch& batch) {
    KvCache c;
    c.k_cache = k_pool.view(), c.v_cache = v_pool.view();
    c.block_table = batch.table.view(), c.cache_seqlens = seqlens.view();
    c.k = k.view(), c.v = v.view(), c.cu_seqlens_k_new = cu_new.view();
    c.cu_seqlens_q = batch.cu_q.view(), c.max_seqlen_q = batch.max_q;
    return c;
  }
};

PackedAppend packed_append(const Batch& batch, const std::vector<std::int64_t>& added) {
  const auto n = static_cast<std::int64_t>(added.size());
  const std::int64_t total = std::accumulate(added.begin(), added.end(), std::int64_t{0});
  const std::int64_t page_size = batch.k_pool.shape()[1], width = batch.table.shape()[1], row = kHkv * kDim;
  PackedAppend r{batch.k_pool, batch.v_pool, Tensor(batch.q.dtype(), {total, kHkv, kDim}),
                 Tensor(batch.q.dtype(), {total, kHkv, kDim}), Tensor(DType::i32, {n + 1}), Tensor(DType::i32, {n})};
  std::int64_t t0 = 0;
  r.cu_new.set(0, 0.0f);
  for (std::int64_t b = 0; b < n; ++b) {
    const std::int64_t keys = batch.seqused.get(b), first = keys - added[static_cast<std::size_t>(b)];
    r.seqlens.set(b, static_cast<float>(first));
    for (std::int64_t j = first; j < keys; ++j, ++t0) {
      const std::int64_t page = batch.table.get(b * width + j / page_size);
      const std::int64_t slot = (page * page_size + j % page_size) * row;
      for (std::int64_t e = 0; e < row; ++e) {
        r.k.set(t0 * row + e, batch.k_pool.get(slot + e));
        r.v.set(t0 * row + e, batch.v_pool.get(slot + e));
        r.k_pool.set(slot + e, std::numeric_limits<float>::quiet_NaN());
        r.v_pool.set(slot + e, std::numeric_limits<float>::quiet_NaN());
      }
    }
    r.cu_new.set(b + 1, static_cast<float>(t0));
  }
  return r;
}

// Appended then attended: without rotary the pools after the call are the batch's, bit for
// bit (every appended slot written, no other); out and lse are forward_varlen_paged's over
// them, bit for bit, and each sequence's match the float64 reference of its case; 1, 2 and
// 3 threads, every SIMD target.
TEST(PagedVarlen, PackedKvCacheAppendsThenAttends) {
  const std::vector<std::int64_t> added{1, 0, 40, 0, 3, 50, 1, 0, 7};  // of kMix's keys
  AttentionOptions causal;
  causal.causal = true;
  for_each_simd_target([&](const std::string&) {
    for (DType dtype : {DType::f32, DType::bf16})
      for (int threads : {1, 2, 3}) {
        SCOPED_TRACE(to_string(dtype) + " threads " + std::to_string(threads));
        AttentionOptions o = causal;
        o.num_threads = threads;
        const Batch batch = make_batch(kMix, dtype, 16, o, 11);
        PackedAppend a = packed_append(batch, added);
        const ForwardResult all = forward_with_kvcache(batch.q.view(), a.cache(batch), o);
        EXPECT_TRUE(bitwise_equal(a.k_pool, batch.k_pool) && bitwise_equal(a.v_pool, batch.v_pool));
        const ForwardResult paged = batch.run(o);  // the same pools read by forward_varlen_paged
        EXPECT_TRUE(bitwise_equal(all.out, paged.out) && bitwise_equal(all.lse, paged.lse));
        for (std::size_t b = 0; b < kMix.size(); ++b) {
          if (batch.rows(b) == 0) continue;
          SCOPED_TRACE("sequence " + std::to_string(b));
          const ForwardResult mine = sequence_result(all, batch, b);
          check_forward(batch.cases[b], [&](const Case&, const Inputs&) { return ForwardResult{mine.out, mine.lse}; });
        }
      }
  });
}

// With rotary tables (interleaved and half-split): each sequence's pools equal, bit for bit,
// those of the same sequence appended alone through the (batch, seqlen) KV-cache call, whose
// rotary is tested against the reference in test_kvcache.cpp, and its out and lse equal that
// call's within its rounding (it may split the keys differently).
TEST(PagedVarlen, PackedKvCacheRotatesAsTheBatchedCall) {
  const std::vector<Lengths> mix{{1, 300}, {4, 20}, {0, 9}, {6, 6}, {1, 33}};
  const std::vector<std::int64_t> added{1, 4, 2, 6, 0};
  Tensor cos(DType::f32, {512, 8}), sin(DType::f32, {512, 8});  // rotary_dim 16 of 32
  for (std::int64_t i = 0; i < cos.numel(); ++i) {
    const double angle = 0.37 * static_cast<double>(i / 8) / std::pow(10.0, static_cast<double>(i % 8) / 4.0);
    cos.set(i, static_cast<float>(std::cos(angle)));
    sin.set(i, static_cast<float>(std::sin(angle)));
  }
  AttentionOptions o;
  o.causal = true;
  o.num_threads = 2;
  for (bool interleaved : {true, false}) {
    SCOPED_TRACE(interleaved ? "interleaved" : "half-split");
    const Batch batch = make_batch(mix, DType::bf16, 16, o, 13);
    PackedAppend a = packed_append(batch, added);
    KvCache c = a.cache(batch);
    c.rotary_cos = cos.view(), c.rotary_sin = sin.view(), c.rotary_interleaved = interleaved;
    Tensor k_before = a.k_pool, v_before = a.v_pool;
    const ForwardResult all = forward_with_kvcache(batch.q.view(), c, o);
    for (std::size_t b = 0; b < mix.size(); ++b) {
      SCOPED_TRACE("sequence " + std::to_string(b));
      const auto bi = static_cast<std::int64_t>(b);
      const std::int64_t rows = batch.rows(b), q0 = batch.cu_q.get(bi), width = batch.table.shape()[1];
      const std::int64_t t0 = a.cu_new.get(bi), n = added[b], row = kHkv * kDim;
      Tensor q(DType::bf16, {1, rows, kHq, kDim}), k(DType::bf16, {1, n, kHkv, kDim}), v = k;
      for (std::int64_t i = 0; i < q.numel(); ++i) q.set(i, batch.q.get(q0 * kHq * kDim + i));
      for (std::int64_t i = 0; i < n * row; ++i) k.set(i, a.k.get(t0 * row + i)), v.set(i, a.v.get(t0 * row + i));
      Tensor k_pool = k_before, v_pool = v_before, table(DType::i32, {1, width}), seqlen(DType::i32, {1});
      for (std::int64_t pg = 0; pg < width; ++pg) table.set(pg, batch.table.get(bi * width + pg));
      seqlen.set(0, a.seqlens.get(bi));
      KvCache alone;
      alone.k_cache = k_pool.view(), alone.v_cache = v_pool.view(), alone.block_table = table.view();
      alone.cache_seqlens = seqlen.view();
      if (n > 0) alone.k = k.view(), alone.v = v.view();
      alone.rotary_cos = cos.view(), alone.rotary_sin = sin.view(), alone.rotary_interleaved = interleaved;
      const ForwardResult want = forward_with_kvcache(q.view(), alone, o);
      const std::int64_t page_size = 16;
      for (std::int64_t j = 0; j < batch.seqused.get(bi); ++j) {  // this sequence's slots
        const std::int64_t page = batch.table.get(bi * width + j / page_size);
        const std::int64_t slot = (page * page_size + j % page_size) * row;
        for (std::int64_t e = 0; e < row; ++e) {
          ASSERT_EQ(a.k_pool.get(slot + e), k_pool.get(slot + e)) << "key " << j << " element " << e;
          ASSERT_EQ(a.v_pool.get(slot + e), v_pool.get(slot + e)) << "value " << j << " element " << e;
        }
      }
      const ForwardResult mine = sequence_result(all, batch, b);
      for (std::int64_t i = 0; i < want.out.numel(); ++i)  // split-KV may differ: the batched call is not batch-invariant
        ASSERT_NEAR(mine.out.get(i), want.out.get(i), 1e-2) << "out element " << i;
      for (std::int64_t i = 0; i < want.lse.numel(); ++i) ASSERT_NEAR(mine.lse.get(i), want.lse.get(i), 1e-5);
    }
  }
}

// A packed KV-cache call rejected leaves the pools, out and lse as they were.
TEST(PagedVarlen, PackedKvCacheRejectsBadCallsBeforeWriting) {
  const Batch batch = make_batch({{1, 40}, {5, 17}, {2, 3}}, DType::bf16, 16, {}, 5);
  const PackedAppend good = packed_append(batch, {1, 5, 2});
  Tensor out(DType::bf16, {batch.q.shape()[0], kHq, kDim}), lse(DType::f32, {kHq, batch.q.shape()[0]});
  for (std::int64_t i = 0; i < out.numel(); ++i) out.set(i, 7.0f);
  for (std::int64_t i = 0; i < lse.numel(); ++i) lse.set(i, 7.0f);
  auto expect_rejected = [&](PackedAppend a, const Batch& bt, const std::function<void(KvCache&)>& edit,
                             const std::vector<std::string>& fragments, const AttentionOptions& options = {}) {
    SCOPED_TRACE(fragments.front());
    KvCache c = a.cache(bt);
    edit(c);
    expect_error([&] { forward_with_kvcache(bt.q.view(), c, out.view(), lse.view(), options); }, fragments);
    EXPECT_TRUE(bitwise_equal(a.k_pool, good.k_pool) && bitwise_equal(a.v_pool, good.v_pool));
    for (std::int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.get(i), 7.0f);
    for (std::int64_t i = 0; i < lse.numel(); ++i) ASSERT_EQ(lse.get(i), 7.0f);
  };
  const std::int64_t width = batch.table.shape()[1];
  PackedAppend a = good;
  a.cu_new.set(3, 7.0f);
  expect_rejected(a, batch, [](KvCache&) {}, {"cu_seqlens_k_new", "does not match"});
  a = good;
  a.seqlens.set(0, static_cast<float>(width * 16));
  expect_rejected(a, batch, [](KvCache&) {}, {"cache_seqlens: [0]", "does not fit"});
  Batch shared = batch;  // sequence 2 appends into sequence 1's second page
  shared.table.set(2 * width, batch.table.get(width + 1));
  expect_rejected(good, shared, [](KvCache&) {}, {"block_table: page", "receives new tokens"});
  expect_rejected(good, batch, [](KvCache& c) { c.block_table = {}; }, {"cu_seqlens_q", "block_table"});
  expect_rejected(good, batch, [](KvCache& c) { c.cu_seqlens_k_new = {}; }, {"cu_seqlens_k_new"});
  const Tensor cos(DType::f32, {20, 8});
  expect_rejected(good, batch, [&](KvCache& c) { c.rotary_cos = c.rotary_sin = cos.view(); },
                  {"rotary_cos: 20 positions"});
  const Tensor wide(DType::bf16, {8, kHkv, kDim + 1});
  expect_rejected(good, batch, [&](KvCache& c) { c.v = wide.view(); }, {"v:"});
  AttentionOptions dropout;  // the packed batch runs as forward_varlen_paged: inference only
  dropout.dropout_p = 0.1f;
  expect_rejected(good, batch, [](KvCache&) {}, {"dropout_p: 0.1", "packed", "inference only"}, dropout);
}

}  // namespace
}  // namespace flashattn::test
