// forward_with_kvcache against the float64 reference built from the logical (unpaged)
// cache: contiguous and paged caches, page sizes 1..256, appended tokens with rotary
// embeddings, GQA, causal; appends touch only the slots they name.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "test_util.hpp"

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

// The reference: logical keys [old tokens, rotated new tokens], q rotated at its positions.
std::vector<double> reference_out(const Inputs& s, bool interleaved, const AttentionOptions& o) {
  std::vector<double> out;
  for (std::int64_t b = 0; b < kBatch; ++b) {
    const std::int64_t n = kSeqlens[b] + kNew;
    Tensor k(DType::f32, {1, n, kHkv, kDim}), v(DType::f32, {1, n, kHkv, kDim}), q(DType::f32, {1, kSq, kHq, kDim});
    for (std::int64_t pos = 0; pos < n; ++pos)
      for (std::int64_t h = 0; h < kHkv; ++h) {
        std::vector<float> kr(kDim), vr(kDim);
        for (std::int64_t e = 0; e < kDim; ++e) {
          const bool fresh = pos >= kSeqlens[b];
          const std::int64_t t = pos - kSeqlens[b];
          kr[e] = fresh ? s.new_k.get(((b * kNew + t) * kHkv + h) * kDim + e) : s.old_k.get(((b * kCapacity + pos) * kHkv + h) * kDim + e);
          vr[e] = fresh ? s.new_v.get(((b * kNew + t) * kHkv + h) * kDim + e) : s.old_v.get(((b * kCapacity + pos) * kHkv + h) * kDim + e);
        }
        if (pos >= kSeqlens[b]) rotate(kr, pos, s.cos, s.sin, interleaved);
        for (std::int64_t e = 0; e < kDim; ++e) k.set((pos * kHkv + h) * kDim + e, kr[e]), v.set((pos * kHkv + h) * kDim + e, vr[e]);
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
  Tensor empty_pages(DType::f32, {12, 0, kHkv, kDim});
  expect({empty_pages.view(), empty_pages.view(), table.view(), s.seqlens.view()}, "page size 0");
}

}  // namespace
}  // namespace flashattn::test

namespace flashattn::test {
namespace {

TEST(KvCache, PagedPrefillThroughTheTiledKernelEqualsContiguous) {
  // 20 queries × 2 q heads per kv head is beyond the decode kernel: the tiled kernel packs
  // K and V straight from the pages.
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
  EXPECT_EQ(plan_forward(p, CpuHardware::detect(0)).kernel, ForwardKernel::tiled);
  const ForwardResult a = forward_with_kvcache(q.view(), contiguous, o);
  const ForwardResult b = forward_with_kvcache(q.view(), paged, o);
  EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), static_cast<std::size_t>(a.out.numel()) * 2), 0);
  EXPECT_EQ(std::memcmp(a.lse.data(), b.lse.data(), static_cast<std::size_t>(a.lse.numel()) * 4), 0);
}

}  // namespace
}  // namespace flashattn::test
