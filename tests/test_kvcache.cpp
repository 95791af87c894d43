// forward_with_kvcache against the float64 reference built from the logical (unpaged)
// cache: contiguous and paged caches, page sizes 1..256, appended tokens with rotary
// embeddings, GQA, causal; appends touch only the slots they name.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "src/cpu/kernels/bf16_decode.hpp"
#include "src/cpu/planner.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

constexpr std::int64_t kBatch = 3, kHq = 4, kHkv = 2, kDim = 32, kNew = 3, kSq = 3, kCapacity = 64;
constexpr std::int64_t kSeqlens[kBatch] = {5, 0, 40};
constexpr float kSentinel = 777.0f;

// Independent rotary: pairs (2i, 2i+1) or (i, i + half) at angle index `pos`.
void rotate(std::vector<float>& x, std::int64_t pos, const Tensor& cos, const Tensor& sin, bool interleaved) {
  const std::int64_t half = cos.shape()[1];
  for (std::int64_t i = 0; i < half; ++i) {
    const std::int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    const float c = cos.get(pos * half + i), s = sin.get(pos * half + i);
    const float xa = x[a], xb = x[b];
    x[a] = xa * c - xb * s;
    x[b] = xa * s + xb * c;
  }
}

struct Inputs {
  Tensor q = random_tensor(DType::f32, {kBatch, kSq, kHq, kDim}, 1);
  Tensor old_k = random_tensor(DType::f32, {kBatch, kCapacity, kHkv, kDim}, 2);  // logical cache contents
  Tensor old_v = random_tensor(DType::f32, {kBatch, kCapacity, kHkv, kDim}, 3);
  Tensor new_k = random_tensor(DType::f32, {kBatch, kNew, kHkv, kDim}, 4);
  Tensor new_v = random_tensor(DType::f32, {kBatch, kNew, kHkv, kDim}, 5);
  Tensor cos{DType::f32, {128, 8}}, sin{DType::f32, {128, 8}};  // rotary_dim 16 of 32
  Tensor seqlens{DType::i32, {kBatch}};
  Inputs() {
    for (std::int64_t p = 0; p < 128; ++p)
      for (std::int64_t i = 0; i < 8; ++i) {
        const double angle = static_cast<double>(p) * std::pow(10000.0, -static_cast<double>(i) / 8.0);
        cos.set(p * 8 + i, static_cast<float>(std::cos(angle)));
        sin.set(p * 8 + i, static_cast<float>(std::sin(angle)));
      }
    for (std::int64_t b = 0; b < kBatch; ++b) seqlens.set(b, static_cast<float>(kSeqlens[b]));
  }
};

// Page p of the paged cache holds logical (b, positions [slot·ps, ...)) under a shuffled
// page order; returns the block table.
Tensor make_paged(const Inputs& s, std::int64_t ps, Tensor& k_pages, Tensor& v_pages) {
  const std::int64_t per_seq = (kCapacity + ps - 1) / ps, pages = kBatch * per_seq;
  Tensor table(DType::i32, {kBatch, per_seq});
  k_pages = Tensor(DType::f32, {pages, ps, kHkv, kDim});
  v_pages = Tensor(DType::f32, {pages, ps, kHkv, kDim});
  for (std::int64_t i = 0; i < k_pages.numel(); ++i) k_pages.set(i, kSentinel), v_pages.set(i, kSentinel);
  for (std::int64_t b = 0; b < kBatch; ++b)
    for (std::int64_t pg = 0; pg < per_seq; ++pg) {
      const std::int64_t page = (pages - 1 - (pg * kBatch + b) + pages / 2) % pages;  // a shuffled permutation
      table.set(b * per_seq + pg, static_cast<float>(page));
    }
  std::vector<int> used(static_cast<std::size_t>(pages), 0);
  for (std::int64_t e = 0; e < table.numel(); ++e) EXPECT_EQ(used[static_cast<std::size_t>(table.get(e))]++, 0);
  for (std::int64_t b = 0; b < kBatch; ++b)
    for (std::int64_t pos = 0; pos < kSeqlens[b]; ++pos) {
      const auto page = static_cast<std::int64_t>(table.get(b * per_seq + pos / ps));
      for (std::int64_t e = 0; e < kHkv * kDim; ++e) {
        k_pages.set((page * ps + pos % ps) * kHkv * kDim + e, s.old_k.get((b * kCapacity + pos) * kHkv * kDim + e));
        v_pages.set((page * ps + pos % ps) * kHkv * kDim + e, s.old_v.get((b * kCapacity + pos) * kHkv * kDim + e));
      }
    }
  return table;
}

// The reference: logical keys [old tokens from slot leftpad[b] on, rotated new tokens], q
// rotated at its positions (slot numbers).
std::vector<double> reference_out(const Inputs& s, bool interleaved, const AttentionOptions& o,
                                  const std::int64_t* leftpad = nullptr) {
  std::vector<double> out;
  for (std::int64_t b = 0; b < kBatch; ++b) {
    const std::int64_t first = leftpad != nullptr ? leftpad[b] : 0, n = kSeqlens[b] + kNew;
    Tensor k(DType::f32, {1, n - first, kHkv, kDim}), v(DType::f32, {1, n - first, kHkv, kDim});
    Tensor q(DType::f32, {1, kSq, kHq, kDim});
    for (std::int64_t pos = first; pos < n; ++pos)
      for (std::int64_t h = 0; h < kHkv; ++h) {
        std::vector<float> kr(kDim), vr(kDim);
        for (std::int64_t e = 0; e < kDim; ++e) {
          const bool fresh = pos >= kSeqlens[b];
          const std::int64_t t = pos - kSeqlens[b];
          kr[e] = fresh ? s.new_k.get(((b * kNew + t) * kHkv + h) * kDim + e) : s.old_k.get(((b * kCapacity + pos) * kHkv + h) * kDim + e);
          vr[e] = fresh ? s.new_v.get(((b * kNew + t) * kHkv + h) * kDim + e) : s.old_v.get(((b * kCapacity + pos) * kHkv + h) * kDim + e);
        }
        if (pos >= kSeqlens[b]) rotate(kr, pos, s.cos, s.sin, interleaved);
        for (std::int64_t e = 0; e < kDim; ++e)
          k.set(((pos - first) * kHkv + h) * kDim + e, kr[e]), v.set(((pos - first) * kHkv + h) * kDim + e, vr[e]);
      }
    for (std::int64_t i = 0; i < kSq; ++i)
      for (std::int64_t h = 0; h < kHq; ++h) {
        std::vector<float> qr(kDim);
        for (std::int64_t e = 0; e < kDim; ++e) qr[e] = s.q.get(((b * kSq + i) * kHq + h) * kDim + e);
        rotate(qr, kSeqlens[b] + i, s.cos, s.sin, interleaved);  // causal: per-query positions
        for (std::int64_t e = 0; e < kDim; ++e) q.set((i * kHq + h) * kDim + e, qr[e]);
      }
    const reference::Result r = reference::attention(q.view(), k.view(), v.view(), o);
    out.insert(out.end(), r.out.begin(), r.out.end());
  }
  return out;
}

TEST(KvCache, ContiguousAndPagedMatchTheReference) {
  for (bool interleaved : {true, false}) {
    SCOPED_TRACE(interleaved ? "interleaved rotary" : "half-split rotary");
    const Inputs s;
    AttentionOptions o;
    o.causal = true;
    Tensor sinks(DType::f32, {kHq});  // the half-split run with attention sinks
    for (std::int64_t h = 0; h < kHq; ++h) sinks.set(h, 1.5f - static_cast<float>(h));
    if (!interleaved) o.sinks = sinks.view();
    const std::vector<double> want = reference_out(s, interleaved, o);

    Tensor k_cache = s.old_k, v_cache = s.old_v;
    for (std::int64_t b = 0; b < kBatch; ++b)  // slots beyond the cached tokens hold guards
      for (std::int64_t pos = kSeqlens[b]; pos < kCapacity; ++pos)
        for (std::int64_t e = 0; e < kHkv * kDim; ++e)
          k_cache.set((b * kCapacity + pos) * kHkv * kDim + e, kSentinel), v_cache.set((b * kCapacity + pos) * kHkv * kDim + e, kSentinel);
    KvCache c{k_cache.view(), v_cache.view(), {}, s.seqlens.view(), {}, s.new_k.view(), s.new_v.view(),
              s.cos.view(), s.sin.view(), interleaved};
    const ForwardResult contiguous = forward_with_kvcache(s.q.view(), c, o);
    EXPECT_LE(max_abs_error(contiguous.out, want), 1e-5);
    for (std::int64_t b = 0; b < kBatch; ++b)  // only the appended slots changed
      for (std::int64_t pos = kSeqlens[b] + kNew; pos < kCapacity; ++pos)
        ASSERT_EQ(k_cache.get((b * kCapacity + pos) * kHkv * kDim), kSentinel) << "b " << b << " pos " << pos;
    for (std::int64_t b = 0; b < kBatch; ++b)  // appended values land unrotated
      for (std::int64_t e = 0; e < kHkv * kDim; ++e)
        ASSERT_EQ(v_cache.get((b * kCapacity + kSeqlens[b]) * kHkv * kDim + e), s.new_v.get(b * kNew * kHkv * kDim + e));

    for (std::int64_t ps : {1, 3, 16, 256}) {
      SCOPED_TRACE("page size " + std::to_string(ps));
      Tensor k_pages, v_pages;
      const Tensor table = make_paged(s, ps, k_pages, v_pages);
      KvCache pc{k_pages.view(), v_pages.view(), table.view(), s.seqlens.view(), {}, s.new_k.view(),
                 s.new_v.view(), s.cos.view(), s.sin.view(), interleaved};
      const ForwardResult paged = forward_with_kvcache(s.q.view(), pc, o);
      EXPECT_EQ(std::memcmp(paged.out.data(), contiguous.out.data(), static_cast<std::size_t>(paged.out.numel()) * 4), 0);
      std::int64_t changed = 0;
      for (std::int64_t i = 0; i < k_pages.numel(); i += kDim) changed += k_pages.get(i) != kSentinel;
      std::int64_t expected = 0;
      for (std::int64_t b = 0; b < kBatch; ++b) expected += (kSeqlens[b] + kNew) * kHkv;
      EXPECT_EQ(changed, expected) << "slots written outside the named ones";
    }
  }
}

TEST(KvCache, LeftPaddedSlotsAreNeverAttended) {
  // Padding slots hold a huge sentinel: attending to one would dominate the output.
  constexpr std::int64_t kLeftpad[kBatch] = {2, 0, 17};
  const Inputs s;
  Tensor leftpad(DType::i32, {kBatch});
  for (std::int64_t b = 0; b < kBatch; ++b) leftpad.set(b, static_cast<float>(kLeftpad[b]));
  for (bool causal : {true, false}) {
    AttentionOptions o;
    o.causal = causal;
    if (!causal) o.window_size = {9, 0};  // windows count logical positions from the end
    SCOPED_TRACE(causal ? "causal" : "window (9, 0)");
    const std::vector<double> want = reference_out(s, true, o, kLeftpad);
    Tensor k_cache = s.old_k, v_cache = s.old_v;
    for (std::int64_t b = 0; b < kBatch; ++b)
      for (std::int64_t pos = 0; pos < kCapacity; ++pos)
        if (pos < kLeftpad[b] || pos >= kSeqlens[b])
          for (std::int64_t e = 0; e < kHkv * kDim; ++e)
            k_cache.set((b * kCapacity + pos) * kHkv * kDim + e, kSentinel),
                v_cache.set((b * kCapacity + pos) * kHkv * kDim + e, kSentinel);
    KvCache c{k_cache.view(), v_cache.view(), {}, s.seqlens.view(), {}, s.new_k.view(), s.new_v.view(),
              s.cos.view(), s.sin.view(), true};
    c.cache_leftpad = leftpad.view();
    const ForwardResult got = forward_with_kvcache(s.q.view(), c, o);
    EXPECT_LE(max_abs_error(got.out, want), 1e-5);
    for (std::int64_t b = 0; b < kBatch; ++b)  // the padding stays as it was
      for (std::int64_t pos = 0; pos < kLeftpad[b]; ++pos)
        ASSERT_EQ(k_cache.get((b * kCapacity + pos) * kHkv * kDim), kSentinel) << "b " << b << " pos " << pos;
  }
}

TEST(KvCache, BadInputNamesTheArgument) {
  const Inputs s;
  Tensor k_cache = s.old_k, v_cache = s.old_v;
  auto expect = [&](const KvCache& c, const std::string& fragment) {
    try {
      forward_with_kvcache(s.q.view(), c, {});
      ADD_FAILURE() << "expected flashattn::Error containing " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  Tensor full(DType::i32, {kBatch});
  full.set(2, 63.0f);
  expect({k_cache.view(), v_cache.view(), {}, full.view(), {}, s.new_k.view(), s.new_v.view()},
         "cache_seqlens: [2] = 63 plus 3 new tokens does not fit the cache capacity 64");
  Tensor table(DType::i32, {kBatch, 4});
  table.set(0, 99.0f);
  Tensor pages(DType::f32, {12, 16, kHkv, kDim});
  expect({pages.view(), pages.view(), table.view(), s.seqlens.view()}, "block_table: [0, 0] = 99 outside");
  Tensor wide_cos(DType::f32, {128, 20}), wide_sin(DType::f32, {128, 20});
  expect({k_cache.view(), v_cache.view(), {}, s.seqlens.view(), {}, s.new_k.view(), s.new_v.view(), wide_cos.view(),
          wide_sin.view()},
         "rotary_cos: rotary_dim 40 exceeds head_dim 32");
  Tensor leftpad(DType::i32, {kBatch});
  leftpad.set(2, 41.0f);
  KvCache padded{k_cache.view(), v_cache.view(), {}, s.seqlens.view()};
  padded.cache_leftpad = leftpad.view();
  expect(padded, "cache_leftpad: [2] = 41 outside [0, cache_seqlens[2] = 40]");
  leftpad.set(2, -1.0f);
  expect(padded, "cache_leftpad: [2] = -1 outside");
  leftpad.set(2, 0.0f);
  KvCache paged_padded{pages.view(), pages.view(), table.view(), s.seqlens.view()};
  paged_padded.cache_leftpad = leftpad.view();
  expect(paged_padded, "cache_leftpad: not supported with a paged cache");
  Tensor empty_pages(DType::f32, {12, 0, kHkv, kDim});
  expect({empty_pages.view(), empty_pages.view(), table.view(), s.seqlens.view()}, "page size 0");
  // Named for what the caller passed: fewer cache rows than sequences without cache_batch_idx
  // (it blamed cache_batch_idx), more new tokens than the capacity without cache_seqlens (it
  // printed a cache_seqlens of -1).
  Tensor two_rows(DType::f32, {2, 64, kHkv, kDim});
  expect({two_rows.view(), two_rows.view(), {}, s.seqlens.view()}, "k_cache: 2 cache rows but q has batch 3");
  Tensor small(DType::f32, {kBatch, 2, kHkv, kDim});
  expect({small.view(), small.view(), {}, {}, {}, s.new_k.view(), s.new_v.view()},
         "k: 3 new tokens of sequence 0 do not fit the cache capacity 2");
  // A batch of none appending two tokens each is a call with nothing to do (its k was refused:
  // the expected seqlen_new came from the first sequence).
  const Tensor q0(DType::f32, {0, 1, kHq, kDim}), k0(DType::f32, {0, 2, kHkv, kDim});
  Tensor cache0(DType::f32, {0, 8, kHkv, kDim});
  KvCache none{cache0.view(), cache0.view()};
  none.k = k0.view(), none.v = k0.view();
  EXPECT_EQ(forward_with_kvcache(q0.view(), none).out.numel(), 0);
}

}  // namespace
}  // namespace flashattn::test

namespace flashattn::test {
namespace {

// A window bound of at least the cache's capacity counts as unbounded, as upstream's: such a
// call is not windowed, so q rotates at cache_seqlens[b] (it rotated at cache_seqlens[b] + i,
// 0.7 off) — contiguous and paged, the capacity seqlen_cache or max_pages·page_size.
TEST(KvCache, WindowsAsWideAsTheCacheAreNoWindow) {
  const std::int64_t cap = 16, d = 8;
  const Tensor q = random_tensor(DType::f32, {1, 4, 2, d}, 61);
  const Tensor k_new = random_tensor(DType::f32, {1, 4, 1, d}, 62), v_new = random_tensor(DType::f32, {1, 4, 1, d}, 63);
  const Tensor pool = random_tensor(DType::f32, {1, cap, 1, d}, 64);
  Tensor cos(DType::f32, {cap, d / 2}), sin(DType::f32, {cap, d / 2}), seqlens(DType::i32, {1}), table(DType::i32, {1, 4});
  for (std::int64_t e = 0; e < cos.numel(); ++e)
    cos.set(e, static_cast<float>(std::cos(0.4 * static_cast<double>(e))));
  for (std::int64_t e = 0; e < sin.numel(); ++e)
    sin.set(e, static_cast<float>(std::sin(0.4 * static_cast<double>(e))));
  seqlens.set(0, 5.0f);
  for (std::int64_t pg = 0; pg < 4; ++pg) table.set(pg, static_cast<float>(pg));
  for (const bool paged : {false, true}) {
    SCOPED_TRACE(paged ? "paged" : "contiguous");
    const auto run = [&](std::int64_t left, std::int64_t right) {
      Tensor k_cache = paged ? Tensor(DType::f32, {4, 4, 1, d}) : pool, v_cache = k_cache;
      if (paged) std::memcpy(k_cache.data(), pool.data(), static_cast<std::size_t>(pool.numel()) * 4);
      v_cache = k_cache;
      KvCache c;
      c.k_cache = k_cache.view(), c.v_cache = v_cache.view(), c.cache_seqlens = seqlens.view();
      if (paged) c.block_table = table.view();
      c.k = k_new.view(), c.v = v_new.view(), c.rotary_cos = cos.view(), c.rotary_sin = sin.view();
      AttentionOptions o;
      o.window_size = {left, right};
      return forward_with_kvcache(q.view(), c, o);
    };
    const ForwardResult none = run(-1, -1);
    for (const auto& [left, right] : {std::pair<std::int64_t, std::int64_t>{100, 100}, {cap, cap}, {-1, cap}}) {
      const ForwardResult wide = run(left, right);
      for (std::int64_t e = 0; e < none.out.numel(); ++e)
        ASSERT_EQ(wide.out.get(e), none.out.get(e)) << "window (" << left << ", " << right << "), out element " << e;
    }
  }
}

// A batch of sequences of different lengths, one query each, takes the decode kernel in one
// parallel region (their (sequence, key chunk) items shared by the threads): every
// sequence still matches the float64 reference on its own keys — with its own ALiBi
// slopes row — for 1, 2 and 3 threads and automatic, 1 and 3 key splits.
TEST(KvCache, SequencesOfABatchDecodeTogetherEachAsAlone) {
  constexpr std::int64_t kHq = 8, kHkv = 2, kDim = 40, kPage = 16;
  const std::int64_t lengths[] = {1, 5, 16, 33, 517, 200, 64};
  const auto batch = static_cast<std::int64_t>(std::size(lengths));
  const std::int64_t per_seq = (517 + kPage - 1) / kPage, pages = batch * per_seq;
  Tensor k_pages(DType::f32, {pages, kPage, kHkv, kDim}), v_pages(DType::f32, {pages, kPage, kHkv, kDim});
  Tensor table(DType::i32, {batch, per_seq}), seqlens(DType::i32, {batch}), slopes(DType::f32, {batch, kHq});
  const Tensor q = random_tensor(DType::f32, {batch, 1, kHq, kDim}, 100);
  const Tensor pool_k = random_tensor(DType::f32, {pages, kPage, kHkv, kDim}, 101);
  const Tensor pool_v = random_tensor(DType::f32, {pages, kPage, kHkv, kDim}, 102);
  for (std::int64_t i = 0; i < k_pages.numel(); ++i) k_pages.set(i, pool_k.get(i)), v_pages.set(i, pool_v.get(i));
  for (std::int64_t i = 0; i < batch * per_seq; ++i) table.set(i, static_cast<float>((i * 5) % pages));  // 5 coprime with 231
  for (std::int64_t b = 0; b < batch; ++b) {
    seqlens.set(b, static_cast<float>(lengths[b]));
    for (std::int64_t h = 0; h < kHq; ++h) slopes.set(b * kHq + h, 0.01f * static_cast<float>(1 + (b + h) % 4));
  }
  for (int threads : {1, 2, 3})
    for (int splits : {0, 1, 3}) {
      SCOPED_TRACE(std::to_string(threads) + " threads, num_splits " + std::to_string(splits));
      AttentionOptions o;
      o.num_threads = threads;
      o.num_splits = splits;
      o.alibi_slopes = slopes.view();
      KvCache c{k_pages.view(), v_pages.view(), table.view(), seqlens.view()};
      const ForwardResult got = forward_with_kvcache(q.view(), c, o);
      for (std::int64_t b = 0; b < batch; ++b) {
        SCOPED_TRACE("sequence " + std::to_string(b) + " of " + std::to_string(lengths[b]) + " keys");
        const std::int64_t n = lengths[b], row = kHkv * kDim;
        Tensor qb(DType::f32, {1, 1, kHq, kDim}), kb(DType::f32, {1, n, kHkv, kDim}), vb(DType::f32, {1, n, kHkv, kDim});
        Tensor sb(DType::f32, {kHq});
        for (std::int64_t e = 0; e < kHq * kDim; ++e) qb.set(e, q.get(b * kHq * kDim + e));
        for (std::int64_t h = 0; h < kHq; ++h) sb.set(h, slopes.get(b * kHq + h));
        for (std::int64_t j = 0; j < n; ++j) {
          const auto page = static_cast<std::int64_t>(table.get(b * per_seq + j / kPage));
          for (std::int64_t e = 0; e < row; ++e) {
            kb.set(j * row + e, k_pages.get((page * kPage + j % kPage) * row + e));
            vb.set(j * row + e, v_pages.get((page * kPage + j % kPage) * row + e));
          }
        }
        AttentionOptions ob;
        ob.alibi_slopes = sb.view();
        const AttentionProblem p = AttentionProblem::from_sizes(1, 1, n, kHq, kHkv, kDim, kDim, DType::f32, ob);
        ASSERT_EQ(plan_forward(p, CpuHardware::detect(threads)).kernel, ForwardKernel::decode);
        const reference::Result want = reference::attention(qb.view(), kb.view(), vb.view(), ob);
        const double tolerance = std::max(1e-5, 2.0 * naive_output_error(naive_same_precision(p, ob, qb, kb, vb), want.out, p.dtype, ob.exp2));
        double error = 0.0;
        for (std::int64_t e = 0; e < kHq * kDim; ++e)
          error = std::max(error, abs_difference(got.out.get(b * kHq * kDim + e), want.out[static_cast<std::size_t>(e)]));
        EXPECT_LE(error, tolerance);
        for (std::int64_t h = 0; h < kHq; ++h)
          ASSERT_NEAR(got.lse.get(b * kHq + h), want.lse[static_cast<std::size_t>(h)], 1e-4) << "lse of head " << h;
      }
    }
}

// 20 queries × 2 q heads per kv head is beyond the decode kernel: the tiled kernels pack K
// and V straight from the pages.
void expect_paged_prefill_equals_contiguous(ForwardKernel kernel) {
  const std::int64_t sq = 20, ps = 5, cap = 45, hkv = 2, d = 16;
  const Tensor q = random_tensor(DType::bf16, {1, sq, 4, d}, 1);
  const Tensor k = random_tensor(DType::bf16, {1, cap, hkv, d}, 2), v = random_tensor(DType::bf16, {1, cap, hkv, d}, 3);
  Tensor seqlens(DType::i32, {1});
  seqlens.set(0, 41.0f);
  const std::int64_t pages = cap / ps;
  Tensor k_pages(DType::bf16, {pages, ps, hkv, d}), v_pages(DType::bf16, {pages, ps, hkv, d}), table(DType::i32, {1, pages});
  for (std::int64_t pg = 0; pg < pages; ++pg) {
    const std::int64_t page = (pg * 4) % pages;  // 4 is coprime with 9 pages: a permutation
    table.set(pg, static_cast<float>(page));
    for (std::int64_t e = 0; e < ps * hkv * d; ++e) {
      k_pages.set(page * ps * hkv * d + e, k.get(pg * ps * hkv * d + e));
      v_pages.set(page * ps * hkv * d + e, v.get(pg * ps * hkv * d + e));
    }
  }
  Tensor k_cont = k, v_cont = v;
  AttentionOptions o;
  o.causal = true;
  KvCache contiguous{k_cont.view(), v_cont.view(), {}, seqlens.view()};
  KvCache paged{k_pages.view(), v_pages.view(), table.view(), seqlens.view()};
  const AttentionProblem p = AttentionProblem::from_sizes(1, sq, 41, 4, hkv, d, d, DType::bf16, o);
  o.kernel = kernel;
  EXPECT_EQ(plan_forward(p, CpuHardware::detect(0), 0, 0, kernel).kernel, kernel);
  const ForwardResult a = forward_with_kvcache(q.view(), contiguous, o);
  const ForwardResult b = forward_with_kvcache(q.view(), paged, o);
  EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), static_cast<std::size_t>(a.out.numel()) * 2), 0);
  EXPECT_EQ(std::memcmp(a.lse.data(), b.lse.data(), static_cast<std::size_t>(a.lse.numel()) * 4), 0);
}

TEST(KvCache, PagedPrefillThroughTheTiledKernelEqualsContiguous) {
  expect_paged_prefill_equals_contiguous(ForwardKernel::tiled);
}

TEST(KvCache, PagedPrefillThroughTheTiledBf16KernelEqualsContiguous) {
  if (!CpuHardware::detect(0).bf16_dot) GTEST_SKIP() << "no AVX512-BF16 on this CPU: tiled_bf16 cannot run here";
  expect_paged_prefill_equals_contiguous(ForwardKernel::tiled_bf16);
}

}  // namespace
}  // namespace flashattn::test

namespace flashattn::test {
namespace {

TEST(KvCache, DecodingPairsThroughAPagedCacheMatchTheReference) {
  // (Sq, Sk) pairs of the issue: the cache holds Sk − Sq tokens and the Sq queries arrive
  // as new tokens; small heads keep the 131072-key float64 reference quick.
  const std::pair<std::int64_t, std::int64_t> pairs[] = {{1, 128},    {1, 339},    {3, 1024},   {64, 800},
                                                         {1, 20000}, {16, 20000}, {1, 131072}};
  constexpr std::int64_t hq = 2, hkv = 1, d = 16, ps = 256;
  std::uint64_t seed = 300;
  for (const auto& [sq, sk] : pairs) {
    SCOPED_TRACE("Sq=" + std::to_string(sq) + " Sk=" + std::to_string(sk));
    const Tensor q = random_tensor(DType::f32, {1, sq, hq, d}, seed);
    const Tensor k = random_tensor(DType::f32, {1, sk, hkv, d}, seed + 1);
    const Tensor v = random_tensor(DType::f32, {1, sk, hkv, d}, seed + 2);
    seed += 3;
    const std::int64_t pages = (sk + ps - 1) / ps, cached = sk - sq, row = hkv * d;
    Tensor k_pages(DType::f32, {pages, ps, hkv, d}), v_pages(DType::f32, {pages, ps, hkv, d});
    Tensor table(DType::i32, {1, pages}), seqlens(DType::i32, {1});
    Tensor k_new(DType::f32, {1, sq, hkv, d}), v_new(DType::f32, {1, sq, hkv, d});
    for (std::int64_t pg = 0; pg < pages; ++pg) table.set(pg, static_cast<float>(pages - 1 - pg));
    seqlens.set(0, static_cast<float>(cached));
    for (std::int64_t pos = 0; pos < sk; ++pos)
      for (std::int64_t e = 0; e < row; ++e) {
        const std::int64_t slot = ((pages - 1 - pos / ps) * ps + pos % ps) * row + e;
        if (pos < cached) {
          k_pages.set(slot, k.get(pos * row + e));
          v_pages.set(slot, v.get(pos * row + e));
        } else {
          k_new.set((pos - cached) * row + e, k.get(pos * row + e));
          v_new.set((pos - cached) * row + e, v.get(pos * row + e));
        }
      }
    AttentionOptions o;
    o.causal = true;
    const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
    KvCache c{k_pages.view(), v_pages.view(), table.view(), seqlens.view(), {}, k_new.view(), v_new.view()};
    const ForwardResult got = forward_with_kvcache(q.view(), c, o);
    EXPECT_LE(max_abs_error(got.out, want.out), 1e-5);
    for (std::int64_t i = 0; i < got.lse.numel(); ++i)
      ASSERT_NEAR(got.lse.get(i), want.lse[static_cast<std::size_t>(i)], 1e-5 + 1e-6 * std::fabs(want.lse[static_cast<std::size_t>(i)]));
  }
}

// The decode kernel reads K and V in place, a block of keys at a time: blocks straddle
// pages of every size, 339 keys are no multiple of a key block or of the four-way
// reduction, head dims leave ragged vector tails (D 40 and Dv 24 on 16 lanes, D 3 and
// Dv 5 below every vector width) and GQA groups of 3 leave padding rows. Every compiled
// SIMD target and floating cache dtype, one and several splits, against the float64
// reference within twice the naive same-precision error; slots past the sequence hold
// NaN, so reading one would show.
TEST(KvCache, DecodeKernelMatchesTheReferenceOnEveryLayout) {
  struct Shape {
    std::int64_t hq, hkv, d, dv;
  };
  // One row per kv head (multi-head attention: {2, 2, 3, 5}, {5, 5, 64, 72}) and two ({6, 3,
  // 96, 33}), which the kernel takes as they are (DecodeSingleRowsEqualTheirRowsInFours).
  const Shape shapes[] = {{6, 2, 40, 24}, {16, 2, 128, 128}, {2, 2, 3, 5}, {5, 5, 64, 72}, {6, 3, 96, 33}};
  constexpr std::int64_t keys = 339;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for_each_simd_target([&](const std::string&) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f16})
      for (const Shape& s : shapes) {
        SCOPED_TRACE(to_string(dtype) + " Hq " + std::to_string(s.hq) + " Hkv " + std::to_string(s.hkv) + " D " +
                     std::to_string(s.d) + " Dv " + std::to_string(s.dv));
        const Tensor q = random_tensor(dtype, {1, 1, s.hq, s.d}, 70);
        const Tensor k = random_tensor(dtype, {1, keys, s.hkv, s.d}, 71);
        const Tensor v = random_tensor(dtype, {1, keys, s.hkv, s.dv}, 72);
        AttentionOptions o;
        const AttentionProblem p = AttentionProblem::from_sizes(1, 1, keys, s.hq, s.hkv, s.d, s.dv, dtype, o);
        ASSERT_EQ(plan_forward(p, CpuHardware::detect(0)).kernel, ForwardKernel::decode);
        const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
        const double tolerance = std::max(1e-5, 2.0 * naive_output_error(naive_same_precision(p, o, q, k, v), want.out, p.dtype, o.exp2));
        for (std::int64_t ps : {0, 1, 3, 16, 256}) {
          SCOPED_TRACE(ps == 0 ? std::string("contiguous") : "page size " + std::to_string(ps));
          const std::int64_t pages = ps > 0 ? (keys + ps - 1) / ps : 1, slots = ps > 0 ? ps : keys + 5;
          Tensor k_cache(dtype, {pages, slots, s.hkv, s.d}), v_cache(dtype, {pages, slots, s.hkv, s.dv});
          Tensor table(DType::i32, {1, pages}), seqlens(DType::i32, {1});
          for (std::int64_t i = 0; i < k_cache.numel(); ++i) k_cache.set(i, nan);
          for (std::int64_t i = 0; i < v_cache.numel(); ++i) v_cache.set(i, nan);
          for (std::int64_t pg = 0; pg < pages; ++pg) table.set(pg, static_cast<float>(pages - 1 - pg));  // reversed
          seqlens.set(0, static_cast<float>(keys));
          for (std::int64_t pos = 0; pos < keys; ++pos) {
            const std::int64_t row = ps > 0 ? (pages - 1 - pos / ps) * ps + pos % ps : pos;
            for (std::int64_t e = 0; e < s.hkv * s.d; ++e) k_cache.set(row * s.hkv * s.d + e, k.get(pos * s.hkv * s.d + e));
            for (std::int64_t e = 0; e < s.hkv * s.dv; ++e)
              v_cache.set(row * s.hkv * s.dv + e, v.get(pos * s.hkv * s.dv + e));
          }
          for (int splits : {1, 4}) {
            SCOPED_TRACE("splits " + std::to_string(splits));
            o.num_splits = splits;
            KvCache c{k_cache.view(), v_cache.view(), ps > 0 ? table.view() : TensorView{}, seqlens.view()};
            const ForwardResult got = forward_with_kvcache(q.view(), c, o);
            EXPECT_LE(max_abs_error(got.out, want.out), tolerance);
            for (std::int64_t i = 0; i < got.lse.numel(); ++i)
              ASSERT_NEAR(got.lse.get(i), want.lse[static_cast<std::size_t>(i)], 1e-4) << "lse " << i;
          }
        }
      }
  });
}

// A kv head with one or two query rows (multi-head attention's decode, a group of two q heads)
// over a cache of values is planned as those rows (block_q 1 or 2), not padded to four, and
// the decode kernel's products then take them alone: their outputs and lse are bit for bit
// those of the same rows among four of a kv head (copies beside them), on every compiled SIMD
// target, in every K/V dtype, with and without the ragged last pair of a row.
TEST(KvCache, DecodeSingleRowsEqualTheirRowsInFours) {
  const CpuHardware hw = CpuHardware::detect(2);
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    EXPECT_EQ(plan_forward(AttentionProblem::from_sizes(1, 1, 339, 8, 8, 64, 64, dtype, {}), hw).block_q, 1);
    EXPECT_EQ(plan_forward(AttentionProblem::from_sizes(1, 1, 339, 8, 4, 64, 64, dtype, {}), hw).block_q, 2);
    EXPECT_EQ(plan_forward(AttentionProblem::from_sizes(1, 2, 339, 8, 8, 64, 64, dtype, {}), hw).block_q, 2);
    EXPECT_EQ(plan_forward(AttentionProblem::from_sizes(1, 1, 339, 6, 2, 64, 64, dtype, {}), hw).block_q, 4);
    EXPECT_EQ(plan_forward(AttentionProblem::from_sizes(1, 1, 339, 10, 2, 64, 64, dtype, {}), hw).block_q, 8);
  }
  // FP8 and int8 caches keep their rows in fours.
  const AttentionProblem mha = AttentionProblem::from_sizes(1, 1, 339, 8, 8, 64, 64, DType::f32, {});
  for (bool fp8 : {true, false}) {
    detail::ProblemInternals quantized;
    (fp8 ? quantized.fp8_kv_cache : quantized.int8_kv_cache) = true;
    EXPECT_EQ(cpu::plan_forward(mha, quantized, hw, 0, 0, ForwardKernel::decode, std::nullopt).block_q, 4);
  }
  constexpr std::int64_t keys = 339;
  for_each_simd_target([&](const std::string&) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f16})
      for (std::int64_t d : {40, 128}) {
        SCOPED_TRACE(to_string(dtype) + " D " + std::to_string(d));
        const Tensor q1 = random_tensor(dtype, {1, 1, 3, d}, 90);
        const Tensor k = random_tensor(dtype, {1, keys, 3, d}, 91);
        const Tensor v = random_tensor(dtype, {1, keys, 3, d}, 92);
        Tensor q4(dtype, {1, 1, 12, d});  // q head 4h + i is q1's head h
        for (std::int64_t h = 0; h < 12; ++h)
          for (std::int64_t e = 0; e < d; ++e) q4.set(h * d + e, q1.get(h / 4 * d + e));
        Tensor q2(dtype, {1, 1, 6, d});  // q head 2h + i is q1's head h, i < 2
        for (std::int64_t h = 0; h < 6; ++h)
          for (std::int64_t e = 0; e < d; ++e) q2.set(h * d + e, q1.get(h / 2 * d + e));
        AttentionOptions o;
        o.num_splits = 1;
        o.num_threads = 1;
        const ForwardResult alone = forward(q1.view(), k.view(), v.view(), o);
        const ForwardResult twos = forward(q2.view(), k.view(), v.view(), o);
        const ForwardResult fours = forward(q4.view(), k.view(), v.view(), o);
        for (std::int64_t h = 0; h < 3; ++h) {
          for (std::int64_t e = 0; e < d; ++e) {
            ASSERT_EQ(alone.out.get(h * d + e), fours.out.get(4 * h * d + e)) << "head " << h << ", element " << e;
            for (std::int64_t i = 0; i < 2; ++i)
              ASSERT_EQ(twos.out.get((2 * h + i) * d + e), fours.out.get((4 * h + i) * d + e))
                  << "head " << h << ", row " << i << ", element " << e;
          }
          ASSERT_EQ(alone.lse.get(h), fours.lse.get(4 * h)) << "head " << h;
          for (std::int64_t i = 0; i < 2; ++i) ASSERT_EQ(twos.lse.get(2 * h + i), fours.lse.get(4 * h + i)) << "head " << h;
        }
      }
  });
}

// The decode kernels' FP8 paths widen e4m3 codes in registers and apply each (page, kv
// head) descale to scores and probabilities: a cache of random codes — every code but the
// two NaNs, subnormal ones included — with descales per page and kv head that differ by up
// to 2^12, against the float64 reference on the dequantized values, on every compiled SIMD
// target, for the layouts and shapes above and one of D 256 with q rows scaled by 2^±20.
// decode is held to upstream's rule in float32 (twice a naive float32 implementation's
// error); decode_fp16 and decode_bf16, where the CPU has AVX512-FP16 (AVX512-BF16), to twice
// the error of their yardstick (narrow_precision_attention), at least twice one rounding of
// max|v| in half (bf16).
void expect_fp8_codes_read_on_every_layout(ForwardKernel kernel) {
  struct Shape {
    std::int64_t hq, hkv, d, dv;
  };
  // The last: DeepSeek's MLA decode (tests/test_mla.cpp), above decode_fp16's head_dim bound of 512.
  const Shape shapes[] = {{6, 2, 40, 24}, {16, 2, 128, 128}, {2, 2, 3, 5}, {4, 1, 256, 64}, {16, 1, 576, 512}};
  constexpr std::int64_t keys = 339;
  for_each_simd_target([&](const std::string&) {
    for (const Shape& s : shapes) {
      if (kernel == ForwardKernel::decode_fp16 && s.d > 512) continue;  // an Error: Mla.DecodeFp16IsNeverPlannedAboveItsHeadDim
      SCOPED_TRACE("Hq " + std::to_string(s.hq) + " Hkv " + std::to_string(s.hkv) + " D " + std::to_string(s.d) +
                   " Dv " + std::to_string(s.dv));
      Tensor q = random_tensor(DType::f32, {1, 1, s.hq, s.d}, 80);
      if (s.d == 256)  // rows far from 1 in both directions: decode_fp16 scales them into range
        for (std::int64_t i = 0; i < q.numel(); ++i) q.set(i, q.get(i) * (i / s.d % 2 == 0 ? 0x1p20f : 0x1p-20f));
      AttentionOptions o;
      const AttentionProblem p = AttentionProblem::from_sizes(1, 1, keys, s.hq, s.hkv, s.d, s.dv, DType::f32, o);
      for (std::int64_t ps : {0, 3, 16}) {
        SCOPED_TRACE(ps == 0 ? std::string("contiguous") : "page size " + std::to_string(ps));
        const std::int64_t pages = ps > 0 ? (keys + ps - 1) / ps : 1, slots = ps > 0 ? ps : keys;
        Tensor k_cache(DType::u8, {pages, slots, s.hkv, s.d}), v_cache(DType::u8, {pages, slots, s.hkv, s.dv});
        Tensor k_scale(DType::f32, {pages, s.hkv}), v_scale(DType::f32, {pages, s.hkv});
        Tensor table(DType::i32, {1, pages}), seqlens(DType::i32, {1});
        Tensor k(DType::f32, {1, keys, s.hkv, s.d}), v(DType::f32, {1, keys, s.hkv, s.dv});  // dequantized
        Tensor kc(DType::f32, {1, keys, s.hkv, s.d}), vc(DType::f32, {1, keys, s.hkv, s.dv});  // codes' values
        Tensor kd(DType::f32, {1, keys, s.hkv}), vd(DType::f32, {1, keys, s.hkv});  // descales per key
        for (std::int64_t i = 0; i < pages * s.hkv; ++i) {
          k_scale.set(i, 0x1p-7f * static_cast<float>(1 + i % 5));
          v_scale.set(i, (i % 2 == 0 ? 0x1p-5f : 0x1p7f) / static_cast<float>(1 + i % 3));
        }
        std::mt19937_64 rng(81 + static_cast<std::uint64_t>(ps));
        auto fill = [&](Tensor& codes, const Tensor& scale, Tensor& values, Tensor& code_values, Tensor& descales,
                        std::int64_t dim, std::int64_t pos, std::int64_t page, std::int64_t slot) {
          for (std::int64_t h = 0; h < s.hkv; ++h) {
            descales.set(pos * s.hkv + h, scale.get(page * s.hkv + h));
            for (std::int64_t e = 0; e < dim; ++e) {
              std::uint8_t code;
              do code = static_cast<std::uint8_t>(rng()); while ((code & 0x7F) == 0x7F);  // no NaN
              codes.data_as<std::uint8_t>()[((page * slots + slot) * s.hkv + h) * dim + e] = code;
              code_values.set((pos * s.hkv + h) * dim + e, fp8_to_float(code, Fp8Format::e4m3));
              values.set((pos * s.hkv + h) * dim + e, fp8_to_float(code, Fp8Format::e4m3) * scale.get(page * s.hkv + h));
            }
          }
        };
        for (std::int64_t pg = 0; pg < pages; ++pg) table.set(pg, static_cast<float>(pages - 1 - pg));  // reversed
        seqlens.set(0, static_cast<float>(keys));
        for (std::int64_t pos = 0; pos < keys; ++pos) {
          const std::int64_t page = ps > 0 ? pages - 1 - pos / ps : 0, slot = ps > 0 ? pos % ps : pos;
          fill(k_cache, k_scale, k, kc, kd, s.d, pos, page, slot);
          fill(v_cache, v_scale, v, vc, vd, s.dv, pos, page, slot);
        }
        const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
        const double naive_float = naive_output_error(naive_same_precision(p, o, q, k, v), want.out, p.dtype, o.exp2);
        const bool narrow = kernel != ForwardKernel::decode;
        const reference::Result yardstick =
            narrow ? narrow_precision_attention(kernel, q, kc, kd, vc, vd, o) : reference::Result{};
        double v_max = 0.0;
        for (std::int64_t i = 0; i < v.numel(); ++i) v_max = std::max(v_max, static_cast<double>(std::fabs(v.get(i))));
        for (int splits : {1, 4}) {
            SCOPED_TRACE(std::string(to_string(kernel)) + ", splits " + std::to_string(splits));
            o.kernel = kernel;
            o.num_splits = splits;
            KvCache c{k_cache.view(), v_cache.view(), ps > 0 ? table.view() : TensorView{}, seqlens.view()};
            c.k_scale = k_scale.view();
            c.v_scale = v_scale.view();
            const ForwardResult got = forward_with_kvcache(q.view(), c, o);
            // The narrow kernels: twice the yardstick's error, or twice one rounding of the
            // largest value where that is more (narrow_rounding).
            const double tolerance = std::max(
                1e-5, 2.0 * (narrow ? std::max(yardstick_error(yardstick.out, want.out, "the narrow-precision yardstick's out", kNaiveOutputShare), narrow_rounding(kernel) * v_max)
                                    : naive_float));
            EXPECT_LE(max_abs_error(got.out, want.out), tolerance);
            const double lse_tolerance = narrow ? 1e-4 + 2.0 * yardstick_error(yardstick.lse, want.lse, "the narrow-precision yardstick's lse", INFINITY) : 1e-4;
            for (std::int64_t i = 0; i < got.lse.numel(); ++i)
              ASSERT_NEAR(got.lse.get(i), want.lse[static_cast<std::size_t>(i)],
                          lse_tolerance * std::max(1.0, std::fabs(want.lse[static_cast<std::size_t>(i)])))
                  << "lse " << i;
          }
      }
    }
  });
}

TEST(KvCache, DecodeKernelReadsEveryFp8CodeOnEveryLayout) {
  expect_fp8_codes_read_on_every_layout(ForwardKernel::decode);
}

TEST(KvCache, DecodeFp16KernelReadsEveryFp8CodeOnEveryLayout) {
  if (!CpuHardware::detect(0).decode_fp16) GTEST_SKIP() << "no AVX512-FP16 on this CPU: decode_fp16 cannot run here";
  expect_fp8_codes_read_on_every_layout(ForwardKernel::decode_fp16);
}

TEST(KvCache, DecodeBf16KernelReadsEveryFp8CodeOnEveryLayout) {
  if (!CpuHardware::detect(0).decode_bf16) GTEST_SKIP() << "no AVX512-BF16 on this CPU: decode_bf16 cannot run here";
  expect_fp8_codes_read_on_every_layout(ForwardKernel::decode_bf16);
}

// decode_bf16 widens e4m3 codes through byte tables where the CPU has AVX512-VBMI, else
// through half precision and float32 (bf16_decode.hpp): the other widening against the
// reference on every layout (the test above ran the default), then both on one cache of
// random codes (every code but NaN, subnormal ones included) for the same bits — head dims
// with tails of 32 codes and of fewer, an odd number of keys (a pair missing its second).
TEST(KvCache, DecodeBf16WideningsGiveTheSameBits) {
  if (!CpuHardware::detect(0).decode_bf16) GTEST_SKIP() << "no AVX512-BF16 on this CPU: decode_bf16 cannot run here";
  struct Restore {
    bool on;
    ~Restore() { cpu::bf16decode::set_byte_tables(on); }
  } restore{cpu::bf16decode::byte_tables()};
  cpu::bf16decode::set_byte_tables(false);
  expect_fp8_codes_read_on_every_layout(ForwardKernel::decode_bf16);
  cpu::bf16decode::set_byte_tables(true);
  if (!cpu::bf16decode::byte_tables())
    GTEST_SKIP() << "no AVX512-VBMI on this CPU: decode_bf16's byte tables cannot run here (the other widening was checked)";
  for (const auto [d, dv] : {std::pair<std::int64_t, std::int64_t>{128, 128}, {40, 24}, {96, 72}, {3, 5}, {576, 512}}) {
    SCOPED_TRACE("D " + std::to_string(d) + " Dv " + std::to_string(dv));
    constexpr std::int64_t keys = 77, hq = 8, hkv = 2;
    std::mt19937_64 rng(d * 1000 + dv);
    auto codes = [&](std::int64_t dim) {
      Tensor t(DType::u8, {1, keys, hkv, dim});
      for (std::int64_t i = 0; i < t.numel(); ++i) {
        std::uint8_t code;
        do code = static_cast<std::uint8_t>(rng()); while ((code & 0x7F) == 0x7F);  // no NaN
        t.data_as<std::uint8_t>()[i] = code;
      }
      return t;
    };
    Tensor k_cache = codes(d), v_cache = codes(dv), k_scale(DType::f32, {1, hkv}), v_scale(DType::f32, {1, hkv});
    for (std::int64_t h = 0; h < hkv; ++h) {
      k_scale.set(h, 0x1p-6f * static_cast<float>(h + 1));
      v_scale.set(h, 0x1p-4f);
    }
    Tensor seqlens(DType::i32, {1});
    seqlens.set(0, static_cast<float>(keys));
    const Tensor q = random_tensor(DType::f32, {1, 1, hq, d}, 90);
    KvCache c{k_cache.view(), v_cache.view(), TensorView{}, seqlens.view()};
    c.k_scale = k_scale.view();
    c.v_scale = v_scale.view();
    AttentionOptions o;
    o.kernel = ForwardKernel::decode_bf16;
    const ForwardResult tables = forward_with_kvcache(q.view(), c, o);
    cpu::bf16decode::set_byte_tables(false);
    const ForwardResult widened = forward_with_kvcache(q.view(), c, o);
    cpu::bf16decode::set_byte_tables(true);
    ASSERT_EQ(tables.out.numel(), widened.out.numel());
    auto bytes = [](const Tensor& t) { return static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype()); };
    EXPECT_EQ(std::memcmp(tables.out.data(), widened.out.data(), bytes(tables.out)), 0);
    EXPECT_EQ(std::memcmp(tables.lse.data(), widened.lse.data(), bytes(tables.lse)), 0);
  }
}

#if defined(__x86_64__) || defined(__i386__)
// Reading FP8 codes must not depend on the CPU's denormals-are-zero mode (set by e.g.
// torch.set_flush_denormal(True)): subnormal e4m3 codes are |values| below 2^-6, which a
// float32 2^-120 times the value — the obvious bit trick — would hold as a subnormal that
// DAZ reads as 0. A cache of random codes (subnormal ones included, descale 1) through the
// decode kernels (one query: decode, decode_fp16 where the CPU has AVX512-FP16, whose
// halves hold subnormal codes as subnormals, and decode_bf16 where it has AVX512-BF16, whose
// bf16 values of them are normal) and the tiled kernel (20 queries), one thread
// so that the mode set here is the kernel's, on every compiled SIMD target: with DAZ and
// flush-to-zero on, the outputs still match the float64 reference on the dequantized
// values within twice the naive float32 error (the narrow kernels: their yardstick's, as
// above). kernel: decode, decode_fp16 or decode_bf16, for the one query.
void expect_fp8_codes_read_with_daz(ForwardKernel kernel) {
  constexpr std::int64_t kHq = 8, kHkv = 2, kDim = 40, kKeys = 300;
  constexpr unsigned kDazFtz = 0x8040;  // MXCSR: flush-to-zero (bit 15), denormals-are-zero (bit 6)
  Tensor codes_k(DType::u8, {1, kKeys, kHkv, kDim}), codes_v(DType::u8, {1, kKeys, kHkv, kDim});
  Tensor k(DType::f32, {1, kKeys, kHkv, kDim}), v(DType::f32, {1, kKeys, kHkv, kDim});
  Tensor k_scale(DType::f32, {1, kHkv}), v_scale(DType::f32, {1, kHkv}), seqlens(DType::i32, {1});
  for (std::int64_t h = 0; h < kHkv; ++h) k_scale.set(h, 1.0f), v_scale.set(h, 1.0f);
  seqlens.set(0, static_cast<float>(kKeys));
  // Every third code subnormal (or ±0); then V all subnormal, so that an output made of
  // them alone shows a flushed one.
  for (bool subnormal_v : {false, true}) {
    SCOPED_TRACE(subnormal_v ? "V codes all subnormal" : "every third code subnormal");
    std::mt19937_64 rng(90);
    for (auto [codes, values] : {std::pair{&codes_k, &k}, std::pair{&codes_v, &v}})
      for (std::int64_t i = 0; i < codes->numel(); ++i) {
        std::uint8_t code;
        do code = static_cast<std::uint8_t>(rng()); while ((code & 0x7F) == 0x7F);  // no NaN
        if (i % 3 == 0 || (subnormal_v && codes == &codes_v)) code &= 0x87;
        codes->data_as<std::uint8_t>()[i] = code;
        values->set(i, fp8_to_float(code, Fp8Format::e4m3));
      }
    // 20 queries (the tiled kernel) once, beside decode.
    const std::vector<std::int64_t> queries = kernel == ForwardKernel::decode ? std::vector<std::int64_t>{1, 20}
                                                                              : std::vector<std::int64_t>{1};
    for_each_simd_target([&](const std::string&) {
      for (std::int64_t sq : queries) {
        SCOPED_TRACE("queries " + std::to_string(sq));
        const Tensor q = random_tensor(DType::f32, {1, sq, kHq, kDim}, 91);
        AttentionOptions o;
        o.num_threads = 1;
        o.causal = true;
        o.kernel = sq == 1 ? kernel : ForwardKernel::automatic;
        SCOPED_TRACE(to_string(o.kernel));
        const AttentionProblem p = AttentionProblem::from_sizes(1, sq, kKeys, kHq, kHkv, kDim, kDim, DType::f32, o);
        const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
        double bound = std::max(1e-5, 2.0 * naive_output_error(naive_same_precision(p, o, q, k, v), want.out, p.dtype, o.exp2));
        if (o.kernel != ForwardKernel::decode && o.kernel != ForwardKernel::automatic) {  // as in DecodeKernelReadsEveryFp8CodeOnEveryLayout
          Tensor ones(DType::f32, {1, kKeys, kHkv});
          for (std::int64_t i = 0; i < ones.numel(); ++i) ones.set(i, 1.0f);
          double v_max = 0.0;
          for (std::int64_t i = 0; i < v.numel(); ++i) v_max = std::max(v_max, static_cast<double>(std::fabs(v.get(i))));
          const reference::Result yardstick = narrow_precision_attention(o.kernel, q, k, ones, v, ones, o);
          bound = 2.0 * std::max(yardstick_error(yardstick.out, want.out, "the narrow-precision yardstick's out", kNaiveOutputShare), narrow_rounding(o.kernel) * v_max);
        }
        KvCache c{codes_k.view(), codes_v.view(), TensorView{}, seqlens.view()};
        c.k_scale = k_scale.view();
        c.v_scale = v_scale.view();
        const unsigned saved = _mm_getcsr();
        _mm_setcsr(saved | kDazFtz);
        const ForwardResult got = forward_with_kvcache(q.view(), c, o);
        _mm_setcsr(saved);
        EXPECT_LE(max_abs_error(got.out, want.out), bound);
      }
    });
  }
}

TEST(KvCache, Fp8CodesReadTheSameWithDenormalsAreZero) { expect_fp8_codes_read_with_daz(ForwardKernel::decode); }

TEST(KvCache, Fp8CodesReadTheSameWithDenormalsAreZeroInDecodeFp16) {
  if (!CpuHardware::detect(1).decode_fp16) GTEST_SKIP() << "no AVX512-FP16 on this CPU: decode_fp16 cannot run here";
  expect_fp8_codes_read_with_daz(ForwardKernel::decode_fp16);
}

TEST(KvCache, Fp8CodesReadTheSameWithDenormalsAreZeroInDecodeBf16) {
  if (!CpuHardware::detect(1).decode_bf16) GTEST_SKIP() << "no AVX512-BF16 on this CPU: decode_bf16 cannot run here";
  expect_fp8_codes_read_with_daz(ForwardKernel::decode_bf16);
}
#endif

// The online softmax's rescale branch in the decode kernels' FP8 paths, on every compiled
// SIMD target: one query of 4 q heads over 2 kv heads against 1000 keys of an FP8 cache
// whose scores rise along the keys (key j's first K column j·0.1/(scale·log2e), so 0.1 log2
// units a key, rounded to e4m3 — still non-decreasing), at thresholds 0 and 8. The cache
// entry point does not report rescale_counts; KernelCounters::rescales, counted by every
// forward kernel, must show the branch ran, and the output must match the float64
// reference on the dequantized cache (decode: twice the naive float32 error; the narrow
// kernels: twice their yardstick's, as above).
void expect_fp8_decode_rescales(ForwardKernel kernel) {
  constexpr std::int64_t kKeys = 1000, kHq = 4, kHkv = 2, kDim = 32;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  Tensor codes_k(DType::u8, {1, kKeys, kHkv, kDim}), codes_v(DType::u8, {1, kKeys, kHkv, kDim});
  Tensor k(DType::f32, {1, kKeys, kHkv, kDim}), v(DType::f32, {1, kKeys, kHkv, kDim});
  Tensor k_scale(DType::f32, {1, kHkv}), v_scale(DType::f32, {1, kHkv}), seqlens(DType::i32, {1});
  Tensor ones(DType::f32, {1, kKeys, kHkv});  // descales per key, for the yardstick
  for (std::int64_t i = 0; i < ones.numel(); ++i) ones.set(i, 1.0f);
  for (std::int64_t h = 0; h < kHkv; ++h) k_scale.set(h, 1.0f), v_scale.set(h, 1.0f);
  seqlens.set(0, static_cast<float>(kKeys));
  const Tensor random_k = random_tensor(DType::f32, {1, kKeys, kHkv, kDim}, 92);
  const Tensor random_v = random_tensor(DType::f32, {1, kKeys, kHkv, kDim}, 93);
  for (std::int64_t i = 0; i < k.numel(); ++i) {
    const std::int64_t key = i / (kHkv * kDim);
    const float x = i % kDim == 0 ? static_cast<float>(key) * 0.1f / (scale * OnlineSoftmaxState::kLog2e)
                                  : random_k.get(i);
    codes_k.data_as<std::uint8_t>()[i] = float_to_fp8(x, Fp8Format::e4m3);
    codes_v.data_as<std::uint8_t>()[i] = float_to_fp8(random_v.get(i), Fp8Format::e4m3);
    k.set(i, fp8_to_float(codes_k.data_as<std::uint8_t>()[i], Fp8Format::e4m3));
    v.set(i, fp8_to_float(codes_v.data_as<std::uint8_t>()[i], Fp8Format::e4m3));
  }
  Tensor q(DType::f32, {1, 1, kHq, kDim});
  for (std::int64_t i = 0; i < q.numel(); ++i) q.set(i, i % kDim == 0 ? 1.0f : 0.0f);
  double v_max = 0.0;
  for (std::int64_t i = 0; i < v.numel(); ++i) v_max = std::max(v_max, static_cast<double>(std::fabs(v.get(i))));
  for_each_simd_target([&](const std::string&) {
    for (float threshold : {0.0f, 8.0f}) {
      SCOPED_TRACE(std::string(to_string(kernel)) + " threshold " + std::to_string(threshold));
      AttentionOptions o;
      o.kernel = kernel;
      o.num_splits = 1;
      o.num_threads = 2;
      o.rescale_threshold = threshold;
      const AttentionProblem p = AttentionProblem::from_sizes(1, 1, kKeys, kHq, kHkv, kDim, kDim, DType::f32, o);
      const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
      const double bound =
          kernel != ForwardKernel::decode
              ? 2.0 * std::max(yardstick_error(narrow_precision_attention(kernel, q, k, ones, v, ones, o).out, want.out, "the narrow-precision yardstick\'s out", kNaiveOutputShare),
                               narrow_rounding(kernel) * v_max)
              : std::max(1e-5, 2.0 * naive_output_error(naive_same_precision(p, o, q, k, v), want.out, p.dtype, o.exp2));
      KvCache c{codes_k.view(), codes_v.view(), TensorView{}, seqlens.view()};
      c.k_scale = k_scale.view();
      c.v_scale = v_scale.view();
      KernelCounters counters;
      o.counters = &counters;
      const ForwardResult got = forward_with_kvcache(q.view(), c, o);
      EXPECT_GT(counters.rescales, 0) << "the rescale branch never ran";
      EXPECT_LE(max_abs_error(got.out, want.out), bound);
    }
  });
}

TEST(KvCache, Fp8DecodeKernelRescalesOnRisingScores) { expect_fp8_decode_rescales(ForwardKernel::decode); }

TEST(KvCache, Fp8DecodeFp16KernelRescalesOnRisingScores) {
  if (!CpuHardware::detect(0).decode_fp16)
    GTEST_SKIP() << "no AVX512-FP16 on this CPU: decode_fp16 cannot run here";
  expect_fp8_decode_rescales(ForwardKernel::decode_fp16);
}

TEST(KvCache, Fp8DecodeBf16KernelRescalesOnRisingScores) {
  if (!CpuHardware::detect(0).decode_bf16)
    GTEST_SKIP() << "no AVX512-BF16 on this CPU: decode_bf16 cannot run here";
  expect_fp8_decode_rescales(ForwardKernel::decode_bf16);
}

}  // namespace
}  // namespace flashattn::test

namespace flashattn::test {
namespace {

// An FP8 e4m3 cache filled by appends of growing magnitude (so pages re-encode), checked
// after every append: (1) every stored value against the logical one within the documented
// bound 2^-4·|x| + 2^-9·descale; (2) the output against the float64 reference on the
// dequantized cache (float32 rounding only, by upstream's rule); (3) against the
// reference on the logical cache within what the quantization explains: with δ the
// largest score change scale·Σ_e |q_e·δk_e| over keys, softmax weights move by at most
// e^(2δ) − 1 in sum (each ratio p'/p lies in [e^-2δ, e^2δ]), so
// |δo| ≤ (e^(2δ) − 1)·max|v̂| + max|δv|.
struct Fp8Cache {
  static constexpr std::int64_t kBatch = 2, kHq = 4, kHkv = 2, kDim = 24, kCap = 64;
  std::int64_t page_size;  // 0: contiguous
  std::int64_t pages;
  Tensor k_codes, v_codes, k_scale, v_scale, table;
  std::vector<std::vector<float>> k_logical, v_logical;  // per sequence: (tokens, kHkv, kDim)
  static constexpr std::uint8_t kGuard = 0x55;

  explicit Fp8Cache(std::int64_t ps) : page_size(ps), k_logical(kBatch), v_logical(kBatch) {
    const std::int64_t per_seq = ps > 0 ? (kCap + ps - 1) / ps : 0;
    pages = ps > 0 ? kBatch * per_seq : kBatch;
    const std::int64_t slots = ps > 0 ? ps : kCap;
    k_codes = Tensor(DType::u8, {pages, slots, kHkv, kDim});
    v_codes = Tensor(DType::u8, {pages, slots, kHkv, kDim});
    std::memset(k_codes.data(), kGuard, static_cast<std::size_t>(k_codes.numel()));
    std::memset(v_codes.data(), kGuard, static_cast<std::size_t>(v_codes.numel()));
    k_scale = Tensor(DType::f32, {pages, kHkv});
    v_scale = Tensor(DType::f32, {pages, kHkv});
    table = Tensor(DType::i32, {kBatch, std::max<std::int64_t>(per_seq, 1)});
    for (std::int64_t b = 0; b < kBatch; ++b)
      for (std::int64_t pg = 0; pg < per_seq; ++pg) table.set(b * per_seq + pg, static_cast<float>((pg * kBatch + b + 1) % pages));
  }
  std::int64_t per_seq() const { return table.shape()[1]; }
  // (page, slot) of token pos of sequence b.
  std::pair<std::int64_t, std::int64_t> locate(std::int64_t b, std::int64_t pos) const {
    if (page_size == 0) return {b, pos};
    return {static_cast<std::int64_t>(table.get(b * per_seq() + pos / page_size)), pos % page_size};
  }
  float value(const Tensor& codes, const Tensor& scale, std::int64_t b, std::int64_t pos, std::int64_t h, std::int64_t e) const {
    const auto [page, slot] = locate(b, pos);
    const std::int64_t slots = codes.shape()[1];
    const std::uint8_t code = codes.data_as<std::uint8_t>()[((page * slots + slot) * kHkv + h) * kDim + e];
    return fp8_to_float(code, Fp8Format::e4m3) * scale.get(page * kHkv + h);
  }
  KvCache view(const Tensor& seqlens) {
    KvCache c;
    c.k_cache = k_codes.view();
    c.v_cache = v_codes.view();
    if (page_size > 0) c.block_table = table.view();
    c.cache_seqlens = seqlens.view();
    c.k_scale = k_scale.view();
    c.v_scale = v_scale.view();
    return c;
  }
};

void check_fp8_cache_run(std::int64_t page_size) {
  using C = Fp8Cache;
  Fp8Cache cache(page_size);
  Tensor cos{DType::f32, {C::kCap, 4}}, sin{DType::f32, {C::kCap, 4}};  // rotary_dim 8 of 24
  for (std::int64_t p = 0; p < C::kCap; ++p)
    for (std::int64_t i = 0; i < 4; ++i) {
      cos.set(p * 4 + i, static_cast<float>(std::cos(0.3 * static_cast<double>(p * (i + 1)))));
      sin.set(p * 4 + i, static_cast<float>(std::sin(0.3 * static_cast<double>(p * (i + 1)))));
    }
  const std::int64_t chunks[] = {5, 1, 20, 13, 1};  // 20 new queries run the tiled kernel
  const float magnitudes[] = {0.5f, 4.0f, 1.0f, 30.0f, 0.01f};
  std::int64_t seqlen = 0;
  std::uint64_t seed = 40;
  for (std::size_t step = 0; step < std::size(chunks); ++step) {
    const std::int64_t n = chunks[step];
    SCOPED_TRACE("append " + std::to_string(step) + " of " + std::to_string(n) + " tokens at " + std::to_string(seqlen));
    Tensor k_new = random_tensor(DType::f32, {C::kBatch, n, C::kHkv, C::kDim}, seed++);
    Tensor v_new = random_tensor(DType::f32, {C::kBatch, n, C::kHkv, C::kDim}, seed++);
    for (std::int64_t i = 0; i < k_new.numel(); ++i)
      k_new.set(i, k_new.get(i) * magnitudes[step]), v_new.set(i, v_new.get(i) * magnitudes[step]);
    const Tensor q = random_tensor(DType::f32, {C::kBatch, n, C::kHq, C::kDim}, seed++);
    Tensor seqlens(DType::i32, {C::kBatch});
    for (std::int64_t b = 0; b < C::kBatch; ++b) seqlens.set(b, static_cast<float>(seqlen));
    KvCache c = cache.view(seqlens);
    c.k = k_new.view();
    c.v = v_new.view();
    c.rotary_cos = cos.view();
    c.rotary_sin = sin.view();
    AttentionOptions o;
    o.causal = true;
    // The float32 decode kernel for few rows (decode_fp16's precision has its own test above),
    // the planner's choice (tiled) for many.
    if (n * (C::kHq / C::kHkv) <= 16) o.kernel = ForwardKernel::decode;
    const ForwardResult got = forward_with_kvcache(q.view(), c, o);

    // The logical tokens (keys rotated) and q rotated at its positions.
    Tensor q_rot(DType::f32, {C::kBatch, n, C::kHq, C::kDim});
    for (std::int64_t b = 0; b < C::kBatch; ++b) {
      for (std::int64_t t = 0; t < n; ++t)
        for (std::int64_t h = 0; h < C::kHkv; ++h) {
          std::vector<float> kr(C::kDim);
          for (std::int64_t e = 0; e < C::kDim; ++e) kr[e] = k_new.get(((b * n + t) * C::kHkv + h) * C::kDim + e);
          rotate(kr, seqlen + t, cos, sin, true);
          for (std::int64_t e = 0; e < C::kDim; ++e) {
            cache.k_logical[b].push_back(kr[e]);
            cache.v_logical[b].push_back(v_new.get(((b * n + t) * C::kHkv + h) * C::kDim + e));
          }
        }
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t h = 0; h < C::kHq; ++h) {
          std::vector<float> qr(C::kDim);
          for (std::int64_t e = 0; e < C::kDim; ++e) qr[e] = q.get(((b * n + i) * C::kHq + h) * C::kDim + e);
          rotate(qr, seqlen + i, cos, sin, true);
          for (std::int64_t e = 0; e < C::kDim; ++e) q_rot.set(((b * n + i) * C::kHq + h) * C::kDim + e, qr[e]);
        }
    }
    seqlen += n;

    for (std::int64_t b = 0; b < C::kBatch; ++b) {
      Tensor k_hat(DType::f32, {1, seqlen, C::kHkv, C::kDim}), v_hat(DType::f32, {1, seqlen, C::kHkv, C::kDim});
      Tensor k_log(DType::f32, {1, seqlen, C::kHkv, C::kDim}), v_log(DType::f32, {1, seqlen, C::kHkv, C::kDim});
      double dv_max = 0.0, v_hat_max = 0.0;
      for (std::int64_t pos = 0; pos < seqlen; ++pos)
        for (std::int64_t h = 0; h < C::kHkv; ++h) {
          const std::int64_t page = cache.locate(b, pos).first;
          for (std::int64_t e = 0; e < C::kDim; ++e) {
            const std::int64_t i = (pos * C::kHkv + h) * C::kDim + e;
            const float kx = cache.k_logical[b][static_cast<std::size_t>(i)], vx = cache.v_logical[b][static_cast<std::size_t>(i)];
            const float kq = cache.value(cache.k_codes, cache.k_scale, b, pos, h, e);
            const float vq = cache.value(cache.v_codes, cache.v_scale, b, pos, h, e);
            ASSERT_LE(std::fabs(kq - kx), 0x1p-4f * std::fabs(kx) + 0x1p-9f * cache.k_scale.get(page * C::kHkv + h))
                << "k b " << b << " pos " << pos << " h " << h << " e " << e;
            ASSERT_LE(std::fabs(vq - vx), 0x1p-4f * std::fabs(vx) + 0x1p-9f * cache.v_scale.get(page * C::kHkv + h))
                << "v b " << b << " pos " << pos << " h " << h << " e " << e;
            k_hat.set(i, kq), v_hat.set(i, vq), k_log.set(i, kx), v_log.set(i, vx);
            dv_max = std::max(dv_max, static_cast<double>(std::fabs(vq - vx)));
            v_hat_max = std::max(v_hat_max, static_cast<double>(std::fabs(vq)));
          }
        }
      Tensor qb(DType::f32, {1, n, C::kHq, C::kDim});
      std::memcpy(qb.data(), q_rot.data_as<float>() + b * n * C::kHq * C::kDim, static_cast<std::size_t>(qb.numel()) * 4);
      const reference::Result on_hat = reference::attention(qb.view(), k_hat.view(), v_hat.view(), o);
      const reference::Result on_logical = reference::attention(qb.view(), k_log.view(), v_log.view(), o);
      double delta = 0.0;  // largest score change, scaled
      for (std::int64_t i = 0; i < n * C::kHq; ++i)
        for (std::int64_t pos = 0; pos < seqlen; ++pos) {
          double s = 0.0;
          const std::int64_t h = (i % C::kHq) / (C::kHq / C::kHkv);
          for (std::int64_t e = 0; e < C::kDim; ++e) {
            const std::int64_t kv = (pos * C::kHkv + h) * C::kDim + e;
            s += std::fabs(static_cast<double>(qb.get(i * C::kDim + e)) * (k_hat.get(kv) - k_log.get(kv)));
          }
          delta = std::max(delta, s / std::sqrt(static_cast<double>(C::kDim)));
        }
      const double explained = std::expm1(2.0 * delta) * v_hat_max + dv_max;
      double err_hat = 0.0, err_logical = 0.0;
      for (std::int64_t i = 0; i < qb.numel(); ++i) {
        const double x = got.out.get(b * qb.numel() + i);
        err_hat = std::max(err_hat, abs_difference(x, on_hat.out[static_cast<std::size_t>(i)]));
        err_logical = std::max(err_logical, abs_difference(x, on_logical.out[static_cast<std::size_t>(i)]));
      }
      // Scores reach ~100 once keys of magnitude 30 arrive: float32 is judged by upstream's
      // rule, at most twice a naive float32 implementation's error (1e-5 at least).
      const AttentionProblem p = AttentionProblem::from_sizes(1, n, seqlen, C::kHq, C::kHkv, C::kDim, C::kDim, DType::f32, o);
      const double naive = naive_output_error(naive_same_precision(p, o, qb, k_hat, v_hat), on_hat.out, p.dtype, o.exp2);
      EXPECT_LE(err_hat, std::max(1e-5, 2.0 * naive)) << "sequence " << b;
      EXPECT_LE(err_logical, explained + 1e-5) << "sequence " << b;
    }
  }
  // Nothing written beyond the appended slots.
  const std::int64_t slots = cache.k_codes.shape()[1];
  std::vector<char> used(static_cast<std::size_t>(cache.pages * slots), 0);
  for (std::int64_t b = 0; b < C::kBatch; ++b)
    for (std::int64_t pos = 0; pos < seqlen; ++pos) {
      const auto [page, slot] = cache.locate(b, pos);
      used[static_cast<std::size_t>(page * slots + slot)] = 1;
    }
  for (std::int64_t i = 0; i < cache.pages * slots; ++i)
    if (used[static_cast<std::size_t>(i)] == 0)
      for (std::int64_t e = 0; e < C::kHkv * C::kDim; ++e)
        ASSERT_EQ(cache.k_codes.data_as<std::uint8_t>()[i * C::kHkv * C::kDim + e], Fp8Cache::kGuard) << "slot " << i;
}

TEST(KvCache, Fp8CacheQuantizesOnAppendWithinTheStatedBound) {
  for_each_simd_target([](const std::string&) {
    for (std::int64_t ps : {0, 1, 3, 16}) {
      SCOPED_TRACE(ps == 0 ? std::string("contiguous") : "page size " + std::to_string(ps));
      check_fp8_cache_run(ps);
    }
  });
}

// A page whose stored descale is subnormal (finite and > 0: valid) takes an append: the
// codes are made with 1 / descale, which would be +∞ — zeros became NaN codes (0x7F/0xFF)
// that no append may write. The descale grows to a normal one and the old token is
// re-encoded at the same value.
TEST(KvCache, Fp8AppendOntoASubnormalDescaleWritesNoNaNCode) {
  for (const float stored : {1e-40f, 1e-30f}) {
    SCOPED_TRACE(stored);
    Tensor kc(DType::u8, {1, 4, 1, 4}), vc(DType::u8, {1, 4, 1, 4});
    std::memset(kc.data(), 0x38, 16);  // e4m3 1.0
    std::memset(vc.data(), 0x38, 16);
    Tensor ks(DType::f32, {1, 1}), vs(DType::f32, {1, 1}), seqlens(DType::i32, {1});
    ks.set(0, stored), vs.set(0, stored), seqlens.set(0, 1.0f);
    Tensor q(DType::f32, {1, 1, 1, 4}), k(DType::f32, {1, 1, 1, 4}), v(DType::f32, {1, 1, 1, 4});
    for (std::int64_t e = 0; e < 4; ++e) q.set(e, 1.0f), k.set(e, e == 1 ? 3.0f * stored : 0.0f), v.set(e, 0.0f);
    KvCache c{kc.view(), vc.view()};
    c.k_scale = ks.view(), c.v_scale = vs.view(), c.cache_seqlens = seqlens.view(), c.k = k.view(), c.v = v.view();
    AttentionOptions o;
    o.num_threads = 1;
    const ForwardResult r = forward_with_kvcache(q.view(), c, o);
    for (const Tensor* codes : {&kc, &vc})
      for (std::int64_t i = 0; i < 8; ++i)
        ASSERT_NE(codes->data_as<std::uint8_t>()[i] & 0x7F, 0x7F) << "slot " << i / 4 << " element " << i % 4;
    for (const Tensor* scale : {&ks, &vs}) EXPECT_GE(scale->get(0), FLT_MIN);
    // The old token (all `stored`) and the new one (3·stored at element 1) read back.
    for (std::int64_t e = 0; e < 4; ++e) {
      EXPECT_NEAR(fp8_to_float(kc.data_as<std::uint8_t>()[e], Fp8Format::e4m3) * ks.get(0), stored, stored * 0x1p-4f);
      EXPECT_NEAR(fp8_to_float(kc.data_as<std::uint8_t>()[4 + e], Fp8Format::e4m3) * ks.get(0), k.get(e),
                  stored * 0x1p-3f);
    }
    for (std::int64_t e = 0; e < 4; ++e) ASSERT_TRUE(std::isfinite(r.out.get(e))) << e;
    ASSERT_TRUE(std::isfinite(r.lse.get(0)));
  }
}

TEST(KvCache, Fp8CacheBadInputNamesTheArgument) {
  Fp8Cache cache(16);
  Tensor seqlens(DType::i32, {Fp8Cache::kBatch});
  seqlens.set(0, 3.0f);  // sequence 0 holds tokens in its first page, whose descale is 0
  const Tensor q = random_tensor(DType::f32, {Fp8Cache::kBatch, 1, Fp8Cache::kHq, Fp8Cache::kDim}, 1);
  Tensor k_new = random_tensor(DType::f32, {Fp8Cache::kBatch, 1, Fp8Cache::kHkv, Fp8Cache::kDim}, 2);
  const std::vector<std::uint8_t> before(cache.k_codes.data_as<std::uint8_t>(),
                                         cache.k_codes.data_as<std::uint8_t>() + cache.k_codes.numel());
  KvCache c = cache.view(seqlens);
  c.k = k_new.view();
  c.v = k_new.view();
  expect_error([&] { forward_with_kvcache(q.view(), c); }, {"k_scale: [1, 0] = 0", "not a finite positive descale"});
  for (std::int64_t i = 0; i < cache.k_scale.numel(); ++i) cache.k_scale.set(i, 1.0f), cache.v_scale.set(i, 1.0f);
  k_new.set(5, NAN);
  expect_error([&] { forward_with_kvcache(q.view(), c); }, {"k: [0, 0, 0, 5] is not finite"});
  k_new.set(5, 0.5f);
  // Keys finite before rotary but not after it (a non-finite table entry, or an overflow):
  // named as rotated, before the append (whose codes and descale would take them) writes.
  Tensor cos(DType::f32, {8, 4}), sin(DType::f32, {8, 4});
  for (std::int64_t i = 0; i < cos.numel(); ++i) cos.set(i, 1.0f), sin.set(i, 0.0f);
  cos.set(3 * 4 + 1, NAN);  // position 3: sequence 0's new token
  KvCache rotated = c;
  rotated.rotary_cos = cos.view();
  rotated.rotary_sin = sin.view();
  expect_error([&] { forward_with_kvcache(q.view(), rotated); },
               {"k: [0, 0, 0, 2] rotated at position 3 is not finite", "rotary_cos"});
  cos.set(3 * 4 + 1, 1.0f);
  k_new.set(0, 3e38f), k_new.set(1, 3e38f);  // finite; the rotation's sum (interleaved pairs) overflows
  sin.set(3 * 4, 1.0f);
  expect_error([&] { forward_with_kvcache(q.view(), rotated); }, {"k: [0, 0, 0, 1] rotated at position 3 is not finite"});
  k_new.set(0, 0.5f), k_new.set(1, 0.5f);
  // An appended descale is written: a stride-0 view (an expanded tensor) would share it among pages.
  KvCache shared = c;
  shared.k_scale = MutableTensorView(cache.k_scale.data(), DType::f32, {cache.pages, Fp8Cache::kHkv}, {0, 1});
  expect_error([&] { forward_with_kvcache(q.view(), shared); },
               {"k_scale: stride 0 of dim 0", "outputs need distinct addresses"});
  EXPECT_EQ(std::memcmp(before.data(), cache.k_codes.data(), before.size()), 0) << "a rejected call wrote the cache";
  KvCache no_scales = c;
  no_scales.v_scale = {};
  expect_error([&] { forward_with_kvcache(q.view(), no_scales); }, {"v_scale"});
  Tensor bf16_cache(DType::bf16, {4, 16, Fp8Cache::kHkv, Fp8Cache::kDim});
  KvCache scaled{bf16_cache.view(), bf16_cache.view()};
  scaled.k_scale = cache.k_scale.view();
  const Tensor qb = random_tensor(DType::bf16, {1, 1, Fp8Cache::kHq, Fp8Cache::kDim}, 3);
  expect_error([&] { forward_with_kvcache(qb.view(), scaled); }, {"k_scale, v_scale: descales belong to an FP8 cache"});
}

}  // namespace
}  // namespace flashattn::test

namespace flashattn::test {
namespace {

// decode_fp16 is planned by default for an FP8 or int8 cache with few rows per kv head
// where the CPU has AVX512-FP16, else decode_bf16 where VDPBF16PS outpaces FMA; asked for
// where it cannot run, either is an Error
// that names the kernel and the reason, raised before an append writes the cache. The
// hardware with and without it is simulated through the library's internal planner (the
// one forward_with_kvcache calls, src/cpu/planner.hpp); the plan a real call ran on this
// CPU is read from its report (plans_run).
TEST(KvCache, DecodeFp16IsPlannedForQuantizedCachesOnly) {
  CpuHardware with = CpuHardware::detect(1), without = with;
  with.decode_fp16 = true;
  without.decode_fp16 = false;
  without.decode_bf16 = false;
  constexpr detail::ProblemInternals kFp8Cache{.fp8_kv_cache = true};
  constexpr detail::ProblemInternals kInt8Cache{.int8_kv_cache = true};
  const AttentionProblem p = AttentionProblem::from_sizes(1, 1, 500, 32, 8, 128, 128, DType::bf16, {});
  EXPECT_EQ(cpu::plan_forward(p, kFp8Cache, with).kernel, ForwardKernel::decode_fp16);
  EXPECT_EQ(cpu::plan_forward(p, kFp8Cache, without).kernel, ForwardKernel::decode);
  // int8 codes: decode_fp16 where it runs, as for FP8.
  EXPECT_EQ(cpu::plan_forward(p, kInt8Cache, with).kernel, ForwardKernel::decode_fp16);
  EXPECT_EQ(cpu::plan_forward(p, kInt8Cache, with, 0, 0, ForwardKernel::decode_fp16).kernel, ForwardKernel::decode_fp16);
  EXPECT_EQ(cpu::plan_forward(p, kInt8Cache, without).kernel, ForwardKernel::decode);
  expect_error([&] { cpu::plan_forward(p, kInt8Cache, without, 0, 0, ForwardKernel::decode_fp16); },
               {"kernel decode_fp16", "AVX512-FP16 (this one: no)"});
  expect_error([&] { cpu::plan_forward(p, kFp8Cache, without, 0, 0, ForwardKernel::decode_fp16); },
               {"kernel decode_fp16", "AVX512-FP16 (this one: no)"});
  // Without AVX512-FP16: decode_bf16 where VDPBF16PS outpaces FMA (AMD Zen 4: bf16_dot_fast
  // without AMX), decode where it does not (Intel's VDPBF16PS, or AMX's tiles, which decode
  // does not use); asked for without AVX512-BF16, an Error.
  CpuHardware zen4 = without, intel = without;
  zen4.decode_bf16 = intel.decode_bf16 = true;
  zen4.int8_dot = intel.int8_dot = true;
  zen4.bf16_dot_fast = true;
  zen4.amx_bf16 = false;
  intel.bf16_dot_fast = true;
  intel.amx_bf16 = true;
  for (const detail::ProblemInternals& cache : {kFp8Cache, kInt8Cache}) {
    EXPECT_EQ(cpu::plan_forward(p, cache, zen4).kernel, ForwardKernel::decode_bf16);
    EXPECT_EQ(cpu::plan_forward(p, cache, intel).kernel, ForwardKernel::decode);
    EXPECT_EQ(cpu::plan_forward(p, cache, intel, 0, 0, ForwardKernel::decode_bf16).kernel, ForwardKernel::decode_bf16);
    expect_error([&] { cpu::plan_forward(p, cache, without, 0, 0, ForwardKernel::decode_bf16); },
                 {"kernel decode_bf16", "AVX512-BF16 (this one: no)"});
  }
  // The planner takes VNNI from the hardware it is given, not from the CPU running the test:
  // without it, int8 codes plan decode (FP8 still decode_bf16) and asking names it.
  CpuHardware zen4_without_vnni = zen4;
  zen4_without_vnni.int8_dot = false;
  EXPECT_EQ(cpu::plan_forward(p, kFp8Cache, zen4_without_vnni).kernel, ForwardKernel::decode_bf16);
  EXPECT_EQ(cpu::plan_forward(p, kInt8Cache, zen4_without_vnni).kernel, ForwardKernel::decode);
  expect_error([&] { cpu::plan_forward(p, kInt8Cache, zen4_without_vnni, 0, 0, ForwardKernel::decode_bf16); },
               {"kernel decode_bf16", "AVX512-VNNI (this one: no)"});
  // No head-dim bound of its own: DeepSeek's MLA decode (head_dim 576) too.
  const AttentionProblem mla = AttentionProblem::from_sizes(1, 1, 500, 16, 1, 576, 512, DType::bf16, {});
  EXPECT_EQ(cpu::plan_forward(mla, kFp8Cache, zen4).kernel, ForwardKernel::decode_bf16);
  expect_error([&] { plan_forward(p, zen4, 0, 0, ForwardKernel::decode_bf16); },
               {"kernel decode_bf16", "a quantized KV cache, FP8 (e4m3) or int8 codes (k/v: bf16)"});
  // A bf16 cache: the problem as given, as the public planner plans it.
  EXPECT_EQ(plan_forward(p, with).kernel, ForwardKernel::decode);
  EXPECT_EQ(cpu::plan_forward(p, {}, with).kernel, ForwardKernel::decode);
  expect_error([&] { plan_forward(p, with, 0, 0, ForwardKernel::decode_fp16); },
               {"kernel decode_fp16", "a quantized KV cache, FP8 (e4m3) or int8 codes (k/v: bf16)"});
  const AttentionProblem many_rows = AttentionProblem::from_sizes(1, 8, 500, 32, 8, 128, 128, DType::f32, {});
  expect_error([&] { cpu::plan_forward(many_rows, kFp8Cache, with, 0, 0, ForwardKernel::decode_fp16); },
               {"at most 16 query rows per kv head", "seqlen_q: 32"});

  // For real: an FP8 cache runs the kernel the planner chose for this CPU; a bf16 cache of
  // the same shape runs decode.
  const Tensor q16 = random_tensor(DType::bf16, {1, 1, 4, 32}, 7);
  Tensor cached(DType::i32, {1});
  cached.set(0, 24.0f);
  Fp8CacheTensors fp8 = fp8_cache({1, 24, 2, 32});
  KvCache fp8_kv = fp8.cache();
  fp8_kv.cache_seqlens = cached.view();
  PlansRun ran;
  AttentionOptions reporting;
  reporting.num_threads = 1;
  reporting.plans_run = &ran;
  forward_with_kvcache(q16.view(), fp8_kv, reporting);
  ASSERT_EQ(ran.forward.size(), 1u);
  EXPECT_EQ(ran.forward[0].kernel, cpu::plan_forward(AttentionProblem::from_sizes(1, 1, 24, 4, 2, 32, 32, DType::bf16, {}),
                                                     kFp8Cache, CpuHardware::detect(1))
                                       .kernel);
  EXPECT_TRUE(is_decode(ran.forward[0].kernel));
  Tensor k_bf16 = random_tensor(DType::bf16, {1, 24, 2, 32}, 8), v_bf16 = random_tensor(DType::bf16, {1, 24, 2, 32}, 9);
  forward_with_kvcache(q16.view(), KvCache{k_bf16.view(), v_bf16.view(), TensorView{}, cached.view()}, reporting);
  ASSERT_EQ(ran.forward.size(), 1u);
  EXPECT_EQ(ran.forward[0].kernel, ForwardKernel::decode);
  for (const ForwardKernel k : {ForwardKernel::decode_fp16, ForwardKernel::decode_bf16})
    EXPECT_EQ(parse_forward_kernel(to_string(k)), k);
  EXPECT_STREQ(to_string(ForwardKernel::decode_fp16), "decode_fp16");
  EXPECT_STREQ(to_string(ForwardKernel::decode_bf16), "decode_bf16");

  // A request the call rules out (here a bf16 cache) leaves an appending call's cache as it was.
  Tensor k_cache(DType::bf16, {1, 8, 2, 16}), v_cache(DType::bf16, {1, 8, 2, 16}), seqlens(DType::i32, {1});
  seqlens.set(0, 3.0f);
  const Tensor q = random_tensor(DType::bf16, {1, 1, 4, 16}, 5), k_new = random_tensor(DType::bf16, {1, 1, 2, 16}, 6);
  KvCache c{k_cache.view(), v_cache.view(), TensorView{}, seqlens.view()};
  c.k = k_new.view();
  c.v = k_new.view();
  AttentionOptions o;
  for (const ForwardKernel k : {ForwardKernel::decode_fp16, ForwardKernel::decode_bf16}) {
    o.kernel = k;
    expect_error([&] { forward_with_kvcache(q.view(), c, o); }, {"kernel " + std::string(to_string(k)), "k/v: bf16"});
    for (std::int64_t i = 0; i < k_cache.numel(); ++i) ASSERT_EQ(k_cache.get(i), 0.0f) << "slot " << i;
  }
}

}  // namespace
}  // namespace flashattn::test
