// A rejected call changes nothing: every entry point checks every output view, option and
// table entry before its first write, so outputs, caches and descales are byte-identical
// after the Error (docs/reliability.md). Each case checksums them around the rejected call.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/error.hpp"
#include "flashattn/fp8.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

std::uint64_t checksum(const void* data, std::size_t bytes) {  // FNV-1a
  std::uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}
std::uint64_t checksum(const Tensor& t) { return checksum(t.data(), static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype())); }

// `call` throws a flashattn::Error naming every fragment, and every guarded tensor keeps its bytes.
void expect_rejected(const std::function<void()>& call, const std::vector<std::string>& fragments,
                     const std::vector<const Tensor*>& guarded) {
  std::vector<std::uint64_t> before;
  for (const Tensor* t : guarded) before.push_back(checksum(*t));
  expect_error(call, fragments);
  for (std::size_t i = 0; i < guarded.size(); ++i)
    EXPECT_EQ(checksum(*guarded[i]), before[i]) << "guarded tensor " << i << " changed by a rejected call";
}

Tensor ints(std::vector<std::int32_t> values) {
  Tensor t(DType::i32, {static_cast<std::int64_t>(values.size())});
  std::memcpy(t.data(), values.data(), values.size() * sizeof(std::int32_t));
  return t;
}

Tensor filled(DType dtype, std::vector<std::int64_t> shape, float value) {
  Tensor t(dtype, std::move(shape));
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set(i, value);
  return t;
}

// A batch of 4 sequences over a contiguous f32 cache of 16 slots, one new token each.
struct CacheCall {
  static constexpr std::int64_t kBatch = 4, kSlots = 16, kHeadsQ = 4, kHeadsKv = 2, kDim = 8;
  Tensor q = random_tensor(DType::f32, {kBatch, 1, kHeadsQ, kDim}, 1);
  Tensor k_cache = random_tensor(DType::f32, {kBatch, kSlots, kHeadsKv, kDim}, 2);
  Tensor v_cache = random_tensor(DType::f32, {kBatch, kSlots, kHeadsKv, kDim}, 3);
  Tensor k = random_tensor(DType::f32, {kBatch, 1, kHeadsKv, kDim}, 4);
  Tensor v = random_tensor(DType::f32, {kBatch, 1, kHeadsKv, kDim}, 5);
  Tensor seqlens = ints({3, 5, 7, 9});
  Tensor out = filled(DType::f32, {kBatch, 1, kHeadsQ, kDim}, 7.0f);
  Tensor lse = filled(DType::f32, {kBatch, kHeadsQ, 1}, 7.0f);
  KvCache cache() {
    KvCache c;
    c.k_cache = k_cache.view();
    c.v_cache = v_cache.view();
    c.k = k.view();
    c.v = v.view();
    c.cache_seqlens = seqlens.view();
    return c;
  }
  std::vector<const Tensor*> guarded() const { return {&out, &lse, &k_cache, &v_cache}; }
};

// The reproduction of issue 19: q of batch 4, out and lse views of batch 1. The kernels
// wrote sequences 1-3 past the end of out (AddressSanitizer: heap-buffer-overflow in
// StoreRow) after the append had changed the cache.
TEST(Rejected, KvCacheOutOfBatchOneForBatchFour) {
  CacheCall call;
  Tensor small_out = filled(DType::f32, {1, 1, CacheCall::kHeadsQ, CacheCall::kDim}, 7.0f);
  Tensor small_lse = filled(DType::f32, {1, CacheCall::kHeadsQ, 1}, 7.0f);
  const std::vector<const Tensor*> guarded = {&small_out, &small_lse, &call.k_cache, &call.v_cache};
  expect_rejected([&] { forward_with_kvcache(call.q.view(), call.cache(), small_out.view(), call.lse.view()); },
                  {"out: shape (1, 1, 4, 8)", "expected (4, 1, 4, 8)"}, guarded);
  expect_rejected([&] { forward_with_kvcache(call.q.view(), call.cache(), call.out.view(), small_lse.view()); },
                  {"lse: shape (1, 4, 1)", "expected (4, 4, 1)"}, guarded);
}

// q's head_dim against the cache's: forward_with_kvcache took q of head_dim 8 over a cache of
// 16 (and appended new keys of 16) and read each key's first 8 values — a silently wrong
// result, found in the twenty-first session; forward_varlen_paged refused it already.
TEST(Rejected, KvCacheHeadDimOtherThanQs) {
  CacheCall call;
  Tensor narrow_q = filled(DType::f32, {CacheCall::kBatch, 1, CacheCall::kHeadsQ, CacheCall::kDim / 2}, 0.5f);
  expect_rejected([&] { forward_with_kvcache(narrow_q.view(), call.cache(), call.out.view(), call.lse.view()); },
                  {"k_cache: head_dim 8", "does not match q's 4"}, call.guarded());
}

TEST(Rejected, KvCacheBadOutputsAndOptionsLeaveTheCacheAsItWas) {
  CacheCall call;
  Tensor wrong_dtype = filled(DType::bf16, {CacheCall::kBatch, 1, CacheCall::kHeadsQ, CacheCall::kDim}, 7.0f);
  expect_rejected([&] { forward_with_kvcache(call.q.view(), call.cache(), wrong_dtype.view(), call.lse.view()); },
                  {"out: dtype bf16", "expected f32"}, call.guarded());
  for (float p : {1.5f, -0.25f}) {
    AttentionOptions o;
    o.dropout_p = p;
    expect_rejected([&] { forward_with_kvcache(call.q.view(), call.cache(), call.out.view(), call.lse.view(), o); },
                    {"dropout_p: must be in [0, 1)"}, call.guarded());
  }
  AttentionOptions window;
  window.causal = true;
  window.window_size = {2, 3};
  expect_rejected([&] { forward_with_kvcache(call.q.view(), call.cache(), call.out.view(), call.lse.view(), window); },
                  {"window_size: right = 3", "causal"}, call.guarded());
  AttentionOptions kernel;  // a kernel these inputs rule out
  kernel.kernel = ForwardKernel::tiled_bf16;
  expect_rejected([&] { forward_with_kvcache(call.q.view(), call.cache(), call.out.view(), call.lse.view(), kernel); },
                  {"kernel tiled_bf16", "needs bf16"}, call.guarded());
  // The planner's refusal (pack_gqa with ALiBi's per-head slopes) comes before the append too:
  // it came from planning, after the new keys were written.
  const Tensor slopes = filled(DType::f32, {CacheCall::kHeadsQ}, 0.5f);
  AttentionOptions packed;
  packed.pack_gqa = true;
  packed.alibi_slopes = slopes.view();
  expect_rejected([&] { forward_with_kvcache(call.q.view(), call.cache(), call.out.view(), call.lse.view(), packed); },
                  {"pack_gqa: true is not supported with"}, call.guarded());
}

// Block sizes up to INT64_MAX count one block for the whole sequence: ceil(S / block) wrapped
// to 0 there, so an empty table passed the shape check and the kernels read (quantize_fp8
// wrote) its element 0 — a crash on null data.
TEST(Rejected, BlockSizesUpToInt64MaxCountOneBlock) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const Tensor q = random_tensor(DType::f32, {1, 4, 1, 16}, 11);
  AttentionOptions o;
  o.block_mask = TensorView(nullptr, DType::u8, {0, 0});
  o.block_mask_block_size = kMax;
  expect_error([&] { forward(q.view(), q.view(), q.view(), o); }, {"block_mask: shape (0, 0) but expected (1, 1)"});
  const Tensor one_block = filled(DType::u8, {1, 1}, 1.0f);
  o.block_mask = one_block.view();
  const ForwardResult masked = forward(q.view(), q.view(), q.view(), o);
  const ForwardResult plain = forward(q.view(), q.view(), q.view());
  EXPECT_EQ(checksum(masked.out), checksum(plain.out));
  AttentionOptions hooked;
  hooked.score_hook.apply = [](const void*, const ScoreSpan&) {};
  hooked.score_hook.mask = [](const void*, std::int64_t, std::int64_t, std::int64_t, std::int64_t) { return true; };
  hooked.score_hook.block_mask = TensorView(nullptr, DType::u8, {1, 1, 0, 0});
  hooked.score_hook.block_size = kMax;
  expect_error([&] { forward(q.view(), q.view(), q.view(), hooked); }, {"score_hook.block_mask: shape (1, 1, 0, 0)"});
  const Fp8Tensor codes = quantize_fp8(q.view(), Fp8Format::e4m3, kMax);
  EXPECT_EQ(codes.descale.shape(), (std::vector<std::int64_t>{1, 1, 1}));
  Fp8View k = codes.view();
  k.descale = TensorView(nullptr, DType::f32, {1, 1, 0});
  expect_error([&] { forward_fp8(codes.view(), k, codes.view(), DType::f32); }, {"k.descale: shape (1, 1, 0)"});
}

TEST(Rejected, KvCacheOutputAliasingTheCache) {
  CacheCall call;
  // out over the first elements of k_cache (same shape, so only the aliasing is wrong).
  MutableTensorView aliased(call.k_cache.data(), DType::f32, {CacheCall::kBatch, 1, CacheCall::kHeadsQ, CacheCall::kDim});
  expect_rejected([&] { forward_with_kvcache(call.q.view(), call.cache(), aliased, call.lse.view()); },
                  {"out", "overlaps input k_cache"}, call.guarded());
  MutableTensorView lse_in_v(call.v_cache.data(), DType::f32, {CacheCall::kBatch, CacheCall::kHeadsQ, 1});
  expect_rejected([&] { forward_with_kvcache(call.q.view(), call.cache(), call.out.view(), lse_in_v); },
                  {"lse", "overlaps input v_cache"}, call.guarded());
  // lse over cache_seqlens (one q head, so lse's 4 floats cover the 4 lengths): the call
  // would overwrite the lengths it reads.
  MutableTensorView lse_over_seqlens(call.seqlens.data(), DType::f32, {CacheCall::kBatch, 1, 1});
  Tensor q_one_head = random_tensor(DType::f32, {CacheCall::kBatch, 1, 1, CacheCall::kDim}, 10);
  Tensor out_one_head = filled(DType::f32, {CacheCall::kBatch, 1, 1, CacheCall::kDim}, 7.0f);
  KvCache mqa = call.cache();
  Tensor k1 = random_tensor(DType::f32, {CacheCall::kBatch, CacheCall::kSlots, 1, CacheCall::kDim}, 11);
  Tensor v1 = random_tensor(DType::f32, {CacheCall::kBatch, CacheCall::kSlots, 1, CacheCall::kDim}, 12);
  Tensor kn = random_tensor(DType::f32, {CacheCall::kBatch, 1, 1, CacheCall::kDim}, 13);
  Tensor vn = random_tensor(DType::f32, {CacheCall::kBatch, 1, 1, CacheCall::kDim}, 14);
  mqa.k_cache = k1.view();
  mqa.v_cache = v1.view();
  mqa.k = kn.view();
  mqa.v = vn.view();
  expect_rejected([&] { forward_with_kvcache(q_one_head.view(), mqa, out_one_head.view(), lse_over_seqlens); },
                  {"lse", "overlaps input cache_seqlens"}, {&out_one_head, &call.seqlens, &k1, &v1});
}

TEST(Rejected, KvCacheAppendIntoSharedMemory) {
  CacheCall call;
  KvCache same = call.cache();
  same.v_cache = call.k_cache.view();  // k_cache == v_cache while the append writes both
  expect_rejected([&] { forward_with_kvcache(call.q.view(), same, call.out.view(), call.lse.view()); },
                  {"v_cache", "overlaps", "k_cache"}, call.guarded());
  Tensor rows = ints({0, 1, 1, 3});  // two sequences append to cache row 1
  KvCache dup = call.cache();
  dup.cache_batch_idx = rows.view();
  expect_rejected([&] { forward_with_kvcache(call.q.view(), dup, call.out.view(), call.lse.view()); },
                  {"cache_batch_idx: sequences 1 and 2 both append to cache row 1"}, call.guarded());
  // Without new tokens, sequences may share a row (nothing is written there).
  KvCache read_only = dup;
  read_only.k = {};
  read_only.v = {};
  EXPECT_NO_THROW(forward_with_kvcache(call.q.view(), read_only, call.out.view(), call.lse.view()));
}

// A paged pool of 8 pages of 4 slots; 2 sequences of 2 table entries, one new token each.
struct PagedCall {
  Tensor q = random_tensor(DType::f32, {2, 1, 2, 8}, 21);
  Tensor k_pool = random_tensor(DType::f32, {8, 4, 1, 8}, 22);
  Tensor v_pool = random_tensor(DType::f32, {8, 4, 1, 8}, 23);
  Tensor k = random_tensor(DType::f32, {2, 1, 1, 8}, 24);
  Tensor v = random_tensor(DType::f32, {2, 1, 1, 8}, 25);
  Tensor seqlens = ints({5, 2});
  Tensor table{DType::i32, {2, 2}};
  Tensor out = filled(DType::f32, {2, 1, 2, 8}, 7.0f);
  Tensor lse = filled(DType::f32, {2, 2, 1}, 7.0f);
  PagedCall(std::vector<std::int32_t> entries) { std::memcpy(table.data(), entries.data(), 4 * sizeof(std::int32_t)); }
  KvCache cache() {
    KvCache c;
    c.k_cache = k_pool.view();
    c.v_cache = v_pool.view();
    c.k = k.view();
    c.v = v.view();
    c.cache_seqlens = seqlens.view();
    c.block_table = table.view();
    return c;
  }
  void run() { forward_with_kvcache(q.view(), cache(), out.view(), lse.view()); }
  std::vector<const Tensor*> guarded() const { return {&out, &lse, &k_pool, &v_pool, &table}; }
};

TEST(Rejected, PagedTableEntries) {
  {
    PagedCall ok({0, 1, 2, 3});
    EXPECT_NO_THROW(ok.run());
  }
  {
    PagedCall call({0, -1, 2, 3});  // sequence 0's token 4 (its new one) lies in the page of entry [0, 1]
    expect_rejected([&] { call.run(); }, {"block_table: [0, 1] = -1 outside"}, call.guarded());
  }
  {
    PagedCall call({0, 8, 2, 3});
    expect_rejected([&] { call.run(); }, {"block_table: [0, 1] = 8 outside the cache's 8 pages"}, call.guarded());
  }
  {
    PagedCall call({0, 1, 1, 3});  // both sequences append into page 1
    expect_rejected([&] { call.run(); }, {"block_table: page 1 receives new tokens through both [0, 1] and [1, 0]"},
                    call.guarded());
  }
  {
    PagedCall call({0, 2, 0, 3});  // sequence 1 appends into page 0, which sequence 0 reads
    expect_rejected([&] { call.run(); }, {"block_table: page 0 receives new tokens through [1, 0]", "read through [0, 0]"},
                    call.guarded());
  }
  {
    PagedCall call({0, 0, 2, 3});  // one sequence lists its appended page twice
    expect_rejected([&] { call.run(); }, {"block_table: page 0"}, call.guarded());
  }
}

TEST(Rejected, Fp8CacheKeepsItsCodesAndDescales) {
  Tensor q = random_tensor(DType::bf16, {2, 1, 2, 8}, 31);
  Tensor k_codes = filled(DType::u8, {2, 8, 1, 8}, 0.0f), v_codes = filled(DType::u8, {2, 8, 1, 8}, 0.0f);
  // k_scale's (2, 1) descales begin a larger allocation, so that an output view laid over them
  // (below) stays inside memory the test owns.
  Tensor k_scale_storage = filled(DType::f32, {16}, 0.5f), v_scale = filled(DType::f32, {2, 1}, 0.5f);
  const MutableTensorView k_scale(k_scale_storage.data(), DType::f32, {2, 1});
  for (std::int64_t i = 0; i < k_codes.numel(); ++i) {
    k_codes.data_as<std::uint8_t>()[i] = static_cast<std::uint8_t>(0x30 + i % 7);
    v_codes.data_as<std::uint8_t>()[i] = static_cast<std::uint8_t>(0x31 + i % 5);
  }
  Tensor k = random_tensor(DType::bf16, {2, 1, 1, 8}, 32), v = random_tensor(DType::bf16, {2, 1, 1, 8}, 33);
  Tensor seqlens = ints({3, 6});
  Tensor out = filled(DType::bf16, {2, 1, 2, 8}, 7.0f), lse = filled(DType::f32, {2, 2, 1}, 7.0f);
  KvCache c;
  c.k_cache = k_codes.view();
  c.v_cache = v_codes.view();
  c.k_scale = k_scale;
  c.v_scale = v_scale.view();
  c.k = k.view();
  c.v = v.view();
  c.cache_seqlens = seqlens.view();
  const std::vector<const Tensor*> guarded = {&out, &lse, &k_codes, &v_codes, &k_scale_storage, &v_scale};
  Tensor wrong = filled(DType::bf16, {2, 1, 2, 4}, 7.0f);
  expect_rejected([&] { forward_with_kvcache(q.view(), c, wrong.view(), lse.view()); }, {"out: shape (2, 1, 2, 4)"},
                  guarded);
  AttentionOptions o;
  o.softcap = -1.0f;
  expect_rejected([&] { forward_with_kvcache(q.view(), c, out.view(), lse.view(), o); }, {"softcap"}, guarded);
  MutableTensorView out_over_scale(k_scale_storage.data(), DType::bf16, {2, 1, 2, 8});  // exactly its 64 bytes
  expect_rejected([&] { forward_with_kvcache(q.view(), c, out_over_scale, lse.view()); },
                  {"out", "overlaps input k_scale"}, guarded);
  EXPECT_NO_THROW(forward_with_kvcache(q.view(), c, out.view(), lse.view()));
}

TEST(Rejected, ForwardKeepsRescaleCountsWhenItsKernelIsRuledOut) {
  Tensor q = random_tensor(DType::f32, {1, 9, 2, 8}, 41), k = random_tensor(DType::f32, {1, 11, 2, 8}, 42),
         v = random_tensor(DType::f32, {1, 11, 2, 8}, 43);
  Tensor out = filled(DType::f32, {1, 9, 2, 8}, 7.0f), lse = filled(DType::f32, {1, 2, 9}, 7.0f);
  Tensor counts = filled(DType::i32, {1, 2, 9}, 5.0f);
  AttentionOptions o;
  o.rescale_counts = counts.view();
  o.kernel = ForwardKernel::tiled_bf16;  // needs bf16 inputs
  expect_rejected([&] { forward(q.view(), k.view(), v.view(), out.view(), lse.view(), o); }, {"kernel tiled_bf16"},
                  {&out, &lse, &counts});
}

TEST(Rejected, VarlenChecksEverySequenceBeforeTheFirstWrites) {
  // Two sequences of 3 and 4 tokens. out lies in q's buffer past sequence 0's rows: sequence
  // 0's output rows overlap only sequence 1's queries, so a per-sequence check passed and
  // the write changed an input.
  constexpr std::int64_t kHeads = 2, kDim = 8, kTotal = 7;
  Tensor buffer = random_tensor(DType::f32, {2 * kTotal, kHeads, kDim}, 51);
  Tensor k = random_tensor(DType::f32, {kTotal, kHeads, kDim}, 52), v = random_tensor(DType::f32, {kTotal, kHeads, kDim}, 53);
  Tensor cu = ints({0, 3, 7});
  Tensor lse = filled(DType::f32, {kHeads, kTotal}, 7.0f);
  const TensorView q(buffer.data(), DType::f32, {kTotal, kHeads, kDim});
  const MutableTensorView out(static_cast<float*>(buffer.data()) + 3 * kHeads * kDim, DType::f32, {kTotal, kHeads, kDim});
  const VarlenSeqlens seqlens{cu.view(), cu.view(), 4, 4};
  expect_rejected([&] { forward_varlen(q, k.view(), v.view(), seqlens, out, lse.view()); }, {"out", "overlaps input q"},
                  {&buffer, &lse});
  Tensor out_bf16 = filled(DType::bf16, {kTotal, kHeads, kDim}, 7.0f);
  Tensor q_own = random_tensor(DType::f32, {kTotal, kHeads, kDim}, 54);
  expect_rejected([&] { forward_varlen(q_own.view(), k.view(), v.view(), seqlens, out_bf16.view(), lse.view()); },
                  {"out: dtype bf16", "expected f32"}, {&out_bf16, &lse});
}

TEST(Rejected, VarlenBackwardChecksDoutWhole) {
  constexpr std::int64_t kHeads = 2, kDim = 8, kTotal = 7;
  Tensor q = random_tensor(DType::f32, {kTotal, kHeads, kDim}, 61), k = random_tensor(DType::f32, {kTotal, kHeads, kDim}, 62),
         v = random_tensor(DType::f32, {kTotal, kHeads, kDim}, 63);
  Tensor cu = ints({0, 3, 7});
  const VarlenSeqlens seqlens{cu.view(), cu.view(), 4, 4};
  const ForwardResult f = forward_varlen(q.view(), k.view(), v.view(), seqlens);
  Tensor short_dout = random_tensor(DType::f32, {3, kHeads, kDim}, 64);  // read past its end before the check
  Tensor dq = filled(DType::f32, {kTotal, kHeads, kDim}, 7.0f), dk = filled(DType::f32, {kTotal, kHeads, kDim}, 7.0f),
         dv = filled(DType::f32, {kTotal, kHeads, kDim}, 7.0f);
  expect_rejected([&] {
    backward_varlen(short_dout.view(), q.view(), k.view(), v.view(), f.out.view(), f.lse.view(), seqlens, dq.view(),
                    dk.view(), dv.view());
  }, {"dout: shape (3, 2, 8)", "expected (7, 2, 8)"}, {&dq, &dk, &dv});
  Tensor dv_bf16 = filled(DType::bf16, {kTotal, kHeads, kDim}, 7.0f);
  Tensor dout = random_tensor(DType::f32, {kTotal, kHeads, kDim}, 65);
  expect_rejected([&] {
    backward_varlen(dout.view(), q.view(), k.view(), v.view(), f.out.view(), f.lse.view(), seqlens, dq.view(), dk.view(),
                    dv_bf16.view());
  }, {"dv: dtype bf16"}, {&dq, &dk, &dv_bf16});
  const MutableTensorView dk_over_dq = dq.view();
  expect_rejected([&] {
    backward_varlen(dout.view(), q.view(), k.view(), v.view(), f.out.view(), f.lse.view(), seqlens, dq.view(), dk_over_dq,
                    dv.view());
  }, {"dk", "overlaps", "dq"}, {&dq, &dv});
}

TEST(Rejected, BackwardAndMergeAndFp8Forward) {
  Tensor q = random_tensor(DType::f32, {1, 5, 2, 8}, 71), k = random_tensor(DType::f32, {1, 6, 2, 8}, 72),
         v = random_tensor(DType::f32, {1, 6, 2, 8}, 73);
  const ForwardResult f = forward(q.view(), k.view(), v.view());
  Tensor dout = random_tensor(DType::f32, {1, 5, 2, 8}, 74);
  Tensor dq = filled(DType::f32, {1, 5, 2, 8}, 7.0f), dk = filled(DType::f32, {1, 6, 2, 8}, 7.0f),
         dv = filled(DType::f32, {1, 6, 2, 7}, 7.0f);
  expect_rejected([&] {
    backward(dout.view(), q.view(), k.view(), v.view(), f.out.view(), f.lse.view(), dq.view(), dk.view(), dv.view());
  }, {"dv: shape (1, 6, 2, 7)"}, {&dq, &dk, &dv});
  Tensor dv_ok = filled(DType::f32, {1, 6, 2, 8}, 7.0f);
  Tensor counts = filled(DType::i32, {1, 2, 5}, 5.0f);
  AttentionOptions o;
  o.rescale_counts = counts.view();
  expect_rejected([&] {
    backward(dout.view(), q.view(), k.view(), v.view(), f.out.view(), f.lse.view(), dq.view(), dk.view(), dv_ok.view(), o);
  }, {"rescale_counts", "not by backward"}, {&dq, &dk, &dv_ok, &counts});

  Tensor outs = random_tensor(DType::f32, {2, 1, 5, 2, 8}, 75), lses = random_tensor(DType::f32, {2, 1, 2, 5}, 76);
  Tensor merged = filled(DType::f32, {1, 5, 2, 8}, 7.0f), merged_lse = filled(DType::f32, {1, 5, 2}, 7.0f);
  expect_rejected([&] { merge_attention_states(outs.view(), lses.view(), merged.view(), merged_lse.view()); },
                  {"lse: shape (1, 5, 2)"}, {&merged, &merged_lse});

  const Fp8Tensor q8 = quantize_fp8(q.view(), Fp8Format::e4m3), k8 = quantize_fp8(k.view(), Fp8Format::e4m3),
                  v8 = quantize_fp8(v.view(), Fp8Format::e4m3);
  Tensor out8 = filled(DType::f32, {1, 5, 2, 8}, 7.0f), lse8 = filled(DType::f32, {1, 2, 6}, 7.0f);
  expect_rejected([&] { forward_fp8(q8.view(), k8.view(), v8.view(), out8.view(), lse8.view()); },
                  {"lse: shape (1, 2, 6)"}, {&out8, &lse8});
  Tensor lse8_ok = filled(DType::f32, {1, 2, 5}, 7.0f);
  AttentionOptions hot;
  hot.rescale_threshold = 9.0f;  // unrescaled FP8 probabilities must fit e4m3
  expect_rejected([&] { forward_fp8(q8.view(), k8.view(), v8.view(), out8.view(), lse8_ok.view(), hot); },
                  {"rescale_threshold"}, {&out8, &lse8_ok});
}

}  // namespace
}  // namespace flashattn::test
