// forward_varlen_paged with shared prefixes (cascade attention): random groups of sequences —
// decode rows, prefill chunks, sequences without rows or without keys of their own — that
// continue prefixes ending inside a page, beside sequences without a prefix, over pages
// shuffled in NaN-filled pools. Each sequence against the float64 reference of its prefix
// and own keys concatenated, and against the unshared call over those keys within the
// merge's rounding; bit-identical on 1, 2 and 3 threads; the prefix's keys packed once;
// an FP8 pool; bad calls rejected by name before anything is written.
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

constexpr std::int64_t kHq = 6, kHkv = 2, kDim = 32, kRow = kHkv * kDim;

// A sequence: its query rows, its own keys (after its prefix's) and its prefix (−1: none).
struct Seq {
  std::int64_t rows, own, prefix;
};

// A paged batch with shared prefixes, and the same sequences without sharing: each one's
// prefix and own keys copied into pages of its own in a second pair of pools. Sequence b's
// inputs are cases[b]'s (batch 1, prefix keys + own keys) with the first prefix keys those of
// its prefix's first sequence.
struct SharedBatch {
  std::vector<Case> cases;
  std::vector<Inputs> inputs;
  std::vector<std::int64_t> prefix_keys;
  Tensor q, cu_q, k_pool, v_pool, table, seqused, prefix_table, prefix_seqused, prefix_idx;
  Tensor flat_k_pool, flat_v_pool, flat_table, flat_seqused;
  std::int64_t max_q = 0;

  PagedKvBatch kv() const {
    PagedKvBatch r{k_pool.view(), v_pool.view(), table.view(), seqused.view(), {}, {}, {}, {}, {}};
    r.prefix_block_table = prefix_table.view();
    r.prefix_seqused_k = prefix_seqused.view();
    r.prefix_idx = prefix_idx.view();
    return r;
  }
  PagedKvBatch unshared_kv() const {
    return {flat_k_pool.view(), flat_v_pool.view(), flat_table.view(), flat_seqused.view(), {}, {}, {}, {}, {}};
  }
  ForwardResult run(const AttentionOptions& o) const { return forward_varlen_paged(q.view(), cu_q.view(), max_q, kv(), o); }
  ForwardResult run_unshared(const AttentionOptions& o) const {
    return forward_varlen_paged(q.view(), cu_q.view(), max_q, unshared_kv(), o);
  }
  std::int64_t rows(std::size_t b) const {
    return cu_q.get(static_cast<std::int64_t>(b) + 1) - cu_q.get(static_cast<std::int64_t>(b));
  }
};

// Pools of `pages` pages filled with NaN (read, they would poison the output), and a table
// of `rows` rows whose entries past a row's pages are −1.
void nan_pools(Tensor& k, Tensor& v, std::int64_t pages, std::int64_t page_size, DType dtype) {
  k = Tensor(dtype, {pages, page_size, kHkv, kDim});
  v = Tensor(dtype, {pages, page_size, kHkv, kDim});
  for (std::int64_t i = 0; i < k.numel(); ++i)
    k.set(i, std::numeric_limits<float>::quiet_NaN()), v.set(i, std::numeric_limits<float>::quiet_NaN());
}

// Keys [from, from + n) of `in` into the pages of table row `row` from key `at` on.
void store_keys(const Inputs& in, std::int64_t from, std::int64_t n, Tensor& k_pool, Tensor& v_pool,
                const Tensor& table, std::int64_t row, std::int64_t at) {
  const std::int64_t page_size = k_pool.shape()[1], width = table.shape()[1];
  for (std::int64_t j = 0; j < n; ++j) {
    const auto page = static_cast<std::int64_t>(table.get(row * width + (at + j) / page_size));
    const std::int64_t slot = (page * page_size + (at + j) % page_size) * kRow;
    for (std::int64_t e = 0; e < kRow; ++e) {
      k_pool.set(slot + e, in.k.get((from + j) * kRow + e));
      v_pool.set(slot + e, in.v.get((from + j) * kRow + e));
    }
  }
}

// Fills table row `row` with the next pages of `order` for `keys` keys.
void take_pages(Tensor& table, std::int64_t row, std::int64_t keys, std::int64_t page_size,
                const std::vector<std::int32_t>& order, std::size_t& next) {
  const std::int64_t width = table.shape()[1];
  for (std::int64_t pg = 0; pg < width; ++pg)
    table.set(row * width + pg, pg * page_size < keys ? static_cast<float>(order[next++]) : -1.0f);
}

SharedBatch make_shared(const std::vector<Seq>& seqs, const std::vector<std::int64_t>& prefix_keys, DType dtype,
                        std::int64_t page_size, const AttentionOptions& o, std::uint64_t seed) {
  SharedBatch r;
  r.prefix_keys = prefix_keys;
  const auto batch = static_cast<std::int64_t>(seqs.size()), prefixes = static_cast<std::int64_t>(prefix_keys.size());
  auto pages_of = [&](std::int64_t keys) { return (keys + page_size - 1) / page_size; };
  std::int64_t total_q = 0, pages = 3, flat_pages = 0, width = 1, flat_width = 1, prefix_width = 1;  // 3 pages unread
  std::vector<std::int64_t> first(static_cast<std::size_t>(prefixes), -1);
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    const Seq& s = seqs[b];
    const std::int64_t p_keys = s.prefix < 0 ? 0 : prefix_keys[static_cast<std::size_t>(s.prefix)];
    r.cases.emplace_back(Shape{1, s.rows, p_keys + s.own, kHq, kHkv, kDim, kDim}, dtype, o, seed + 10 * b);
    r.inputs.push_back(r.cases.back().inputs());
    if (s.prefix >= 0) {
      std::int64_t& f = first[static_cast<std::size_t>(s.prefix)];
      if (f < 0) f = static_cast<std::int64_t>(b);
      const Inputs& lead = r.inputs[static_cast<std::size_t>(f)];
      for (std::int64_t e = 0; e < p_keys * kRow; ++e) r.inputs.back().k.set(e, lead.k.get(e)), r.inputs.back().v.set(e, lead.v.get(e));
    }
    total_q += s.rows;
    r.max_q = std::max(r.max_q, s.rows);
    pages += pages_of(s.own);
    flat_pages += pages_of(p_keys + s.own);
    width = std::max(width, pages_of(s.own) + 1);
    flat_width = std::max(flat_width, pages_of(p_keys + s.own) + 1);
  }
  for (std::int64_t keys : prefix_keys) pages += pages_of(keys), prefix_width = std::max(prefix_width, pages_of(keys) + 1);
  std::vector<std::int32_t> order(static_cast<std::size_t>(pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(seed)));
  nan_pools(r.k_pool, r.v_pool, pages, page_size, dtype);
  nan_pools(r.flat_k_pool, r.flat_v_pool, std::max<std::int64_t>(flat_pages, 1), page_size, dtype);
  std::vector<std::int32_t> flat_order(static_cast<std::size_t>(flat_pages));
  std::iota(flat_order.begin(), flat_order.end(), 0);
  r.table = Tensor(DType::i32, {batch, width});
  r.seqused = Tensor(DType::i32, {batch});
  r.flat_table = Tensor(DType::i32, {batch, flat_width});
  r.flat_seqused = Tensor(DType::i32, {batch});
  r.prefix_table = Tensor(DType::i32, {prefixes, prefix_width});
  r.prefix_seqused = Tensor(DType::i32, {prefixes});
  r.prefix_idx = Tensor(DType::i32, {batch});
  r.cu_q = Tensor(DType::i32, {batch + 1});
  r.q = Tensor(dtype, {total_q, kHq, kDim});
  std::size_t next = 0, flat_next = 0;
  for (std::int64_t p = 0; p < prefixes; ++p) {
    const std::int64_t keys = prefix_keys[static_cast<std::size_t>(p)];
    r.prefix_seqused.set(p, static_cast<float>(keys));
    take_pages(r.prefix_table, p, keys, page_size, order, next);
    const std::int64_t f = first[static_cast<std::size_t>(p)];
    if (f >= 0) store_keys(r.inputs[static_cast<std::size_t>(f)], 0, keys, r.k_pool, r.v_pool, r.prefix_table, p, 0);
  }
  std::int64_t q0 = 0;
  r.cu_q.set(0, 0.0f);
  for (std::int64_t b = 0; b < batch; ++b) {
    const Seq& s = seqs[static_cast<std::size_t>(b)];
    const Inputs& in = r.inputs[static_cast<std::size_t>(b)];
    const std::int64_t p_keys = s.prefix < 0 ? 0 : prefix_keys[static_cast<std::size_t>(s.prefix)];
    for (std::int64_t e = 0; e < s.rows * kHq * kDim; ++e) r.q.set(q0 * kHq * kDim + e, in.q.get(e));
    q0 += s.rows;
    r.cu_q.set(b + 1, static_cast<float>(q0));
    r.prefix_idx.set(b, static_cast<float>(s.prefix));
    r.seqused.set(b, static_cast<float>(s.own));
    take_pages(r.table, b, s.own, page_size, order, next);
    store_keys(in, p_keys, s.own, r.k_pool, r.v_pool, r.table, b, 0);
    r.flat_seqused.set(b, static_cast<float>(p_keys + s.own));
    take_pages(r.flat_table, b, p_keys + s.own, page_size, flat_order, flat_next);
    store_keys(in, 0, p_keys + s.own, r.flat_k_pool, r.flat_v_pool, r.flat_table, b, 0);
  }
  return r;
}

// Random groups: 1–3 prefixes of 0–300 keys (one without sequences), each continued by 1–5
// consecutive sequences, with sequences without a prefix between the groups; rows 0, 1 or a
// prefill chunk, own keys from rows − 1 (a causal row sees the whole prefix) up.
struct Layout {
  std::vector<Seq> seqs;
  std::vector<std::int64_t> prefix_keys;
};

Layout random_layout(std::uint64_t seed) {
  std::mt19937 rng(static_cast<unsigned>(seed));
  auto pick = [&](std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng); };
  const std::int64_t row_choices[] = {0, 1, 1, 1, 3, 17};
  auto seq = [&](std::int64_t prefix) {
    const std::int64_t rows = row_choices[pick(0, 5)];
    return Seq{rows, std::max<std::int64_t>(0, rows - 1) + (pick(0, 3) == 0 ? 0 : pick(0, 60)), prefix};
  };
  Layout l;
  const std::int64_t prefixes = pick(1, 3);
  for (std::int64_t p = 0; p <= prefixes; ++p) {
    l.prefix_keys.push_back(pick(0, 300));
    if (pick(0, 1) == 0) l.seqs.push_back(seq(-1));
    if (p == prefixes) break;  // the last prefix has no sequences
    for (std::int64_t m = pick(1, 5); m > 0; --m) l.seqs.push_back(seq(p));
  }
  return l;
}

// Sequence b's rows of a batch result, as the (1, rows, heads, dim) result of a batch of one.
ForwardResult sequence_result(const ForwardResult& all, const SharedBatch& batch, std::size_t b) {
  return packed_rows(all, batch.cu_q.get(static_cast<std::int64_t>(b)), batch.rows(b));
}

// Where the planner runs a pass on tiled_bf16 (bf16 inputs, automatic kernel, a CPU whose
// bf16 products outpace FMA: AMX), that pass rounds P to bf16 before P·V, each P by at most
// bf16's unit roundoff 2^-8 of itself: its out moves by at most 2^-8·max|v|, and the shared
// and unshared calls, whose passes take different kernels, by 2^-7·max|v| between them. 0
// where every pass keeps P in float32.
double bf16_probability_rounding(const SharedBatch& batch, const AttentionOptions& o) {
  if (batch.q.dtype() != DType::bf16 || o.kernel != ForwardKernel::automatic ||
      !CpuHardware::detect(o.num_threads).bf16_dot_fast)
    return 0.0;
  double v_max = 0.0;
  for (const Inputs& in : batch.inputs)
    for (std::int64_t i = 0; i < in.v.numel(); ++i) v_max = std::max(v_max, std::abs(static_cast<double>(in.v.get(i))));
  return std::ldexp(v_max, -7);
}

// The shared call against the unshared one: the same keys in another order of summation and
// one merge, so out within float32 reordering (kFloat32OutTolerance) plus one rounding to the
// output dtype (an ulp where the two land on either side of a rounding boundary), plus P's
// rounding to bf16 where a pass runs tiled_bf16 (`p_rounding`, bf16_probability_rounding);
// lse as against the reference.
void expect_within_merge_rounding(const ForwardResult& shared, const ForwardResult& unshared, double p_rounding = 0.0) {
  const DType dtype = shared.out.dtype();
  for (std::int64_t i = 0; i < shared.out.numel(); ++i) {
    const double want = unshared.out.get(i);
    ASSERT_LE(abs_difference(shared.out.get(i), want), kFloat32OutTolerance + ulp(dtype, want) + p_rounding)
        << "out element " << i << ": " << shared.out.get(i) << " shared, " << want << " unshared";
  }
  std::vector<double> lse(static_cast<std::size_t>(unshared.lse.numel()));
  for (std::size_t i = 0; i < lse.size(); ++i) lse[i] = unshared.lse.get(static_cast<std::int64_t>(i));
  expect_lse_near(shared.lse, lse);
}

AttentionOptions variant(const std::string& name) {
  AttentionOptions o;
  o.causal = name != "plain";
  if (name == "softcap") o.softcap = 5.0f;
  return o;
}

TEST(SharedPrefix, EachSequenceMatchesTheReferenceAndTheUnsharedCall) {
  for_each_simd_target([&](const std::string&) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f16})
      for (const char* name : {"plain", "causal", "softcap"})
        for (std::int64_t page_size : {16, 5}) {
          const std::uint64_t seed = 100 * page_size + static_cast<std::uint64_t>(dtype) * 7 + name[1];
          const Layout layout = random_layout(seed);
          SCOPED_TRACE(std::string(name) + " " + to_string(dtype) + " page size " + std::to_string(page_size) +
                       " layout seed " + std::to_string(seed));
          AttentionOptions o = variant(name);
          o.num_threads = 3;
          const SharedBatch batch = make_shared(layout.seqs, layout.prefix_keys, dtype, page_size, o, seed);
          const ForwardResult shared = batch.run(o), unshared = batch.run_unshared(o);
          expect_within_merge_rounding(shared, unshared, bf16_probability_rounding(batch, o));
          for (std::size_t b = 0; b < layout.seqs.size(); ++b) {
            if (batch.rows(b) == 0) continue;
            SCOPED_TRACE("sequence " + std::to_string(b) + " of prefix " + std::to_string(layout.seqs[b].prefix));
            check_forward(batch.cases[b], batch.inputs[b], sequence_result(shared, batch, b));
          }
        }
  });
}

// Sinks join each sequence's own pass once: a sequence without keys of its own still gets
// the sink in its denominator.
TEST(SharedPrefix, SinksCountOncePerRow) {
  const Tensor sinks = random_tensor(DType::f32, {kHq}, 41);
  AttentionOptions o;
  o.causal = true;
  o.sinks = sinks.view();
  const SharedBatch batch = make_shared({{1, 0, 0}, {3, 7, 0}, {1, 5, -1}, {1, 0, 1}}, {37, 0}, DType::bf16, 16, o, 43);
  expect_within_merge_rounding(batch.run(o), batch.run_unshared(o), bf16_probability_rounding(batch, o));
  const ForwardResult shared = batch.run(o);
  for (std::size_t b = 0; b < batch.cases.size(); ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    check_forward(batch.cases[b], batch.inputs[b], sequence_result(shared, batch, b));
  }
}

// Every query and key the same, scores near 1e30: each row's softmax is uniform over its
// keys, so its output is the mean of its prefix's and own values weighed by their counts. A
// float32 lse rounds m + log ℓ to m there, and a merge of the passes through their lses
// weighed them alike; the passes hand the merge their states (max and ℓ) apart. Passes
// whole and split over the keys (num_splits 3: the split merge hands on the state too).
TEST(SharedPrefix, HugeScoresWeighThePassesByTheirKeys) {
  const std::vector<Seq> seqs{{2, 16, 0}, {1, 40, 0}, {1, 7, 1}};
  for (int splits : {1, 3})
    for (int threads : {1, 3}) {
      SCOPED_TRACE(std::to_string(threads) + " threads, num_splits " + std::to_string(splits));
      AttentionOptions o;
      o.num_threads = threads;
      o.num_splits = splits;
      o.softmax_scale = 3e28f;  // q·k = kDim: every score 9.6e29
      SharedBatch batch = make_shared(seqs, {300, 90}, DType::f32, 16, o, 61);
      for (std::int64_t i = 0; i < batch.q.numel(); ++i) batch.q.set(i, 1.0f);
      for (Tensor* pool : {&batch.k_pool, &batch.flat_k_pool})
        for (std::int64_t i = 0; i < pool->numel(); ++i)
          if (!std::isnan(pool->get(i))) pool->set(i, 1.0f);
      PlansRun plans;
      o.plans_run = &plans;
      const ForwardResult shared = batch.run(o);
      if (splits > 1)
        EXPECT_TRUE(std::any_of(plans.forward.begin(), plans.forward.end(), [](const CpuForwardPlan& p) { return p.splits > 1; }));
      expect_within_merge_rounding(shared, batch.run_unshared(o));
      for (std::size_t b = 0; b < seqs.size(); ++b) {
        const Inputs& in = batch.inputs[b];
        const std::int64_t keys = batch.prefix_keys[static_cast<std::size_t>(seqs[b].prefix)] + seqs[b].own;
        for (std::int64_t i = 0; i < batch.rows(b); ++i)
          for (std::int64_t h = 0; h < kHq; ++h)
            for (std::int64_t c = 0; c < kDim; ++c) {
              double mean = 0.0;
              for (std::int64_t j = 0; j < keys; ++j) mean += in.v.get((j * kHkv + h / (kHq / kHkv)) * kDim + c);
              mean /= static_cast<double>(keys);
              const std::int64_t at = ((batch.cu_q.get(static_cast<std::int64_t>(b)) + i) * kHq + h) * kDim + c;
              ASSERT_NEAR(shared.out.get(at), mean, kFloat32OutTolerance)
                  << "sequence " << b << " row " << i << " head " << h << " column " << c;
            }
      }
    }
}

// One decode group of 32 sequences, a prefill chunk and a sequence without prefix: bit for
// bit the same on 1, 2 and 3 threads, with and without key splits.
TEST(SharedPrefix, BitIdenticalOnAnyThreads) {
  std::vector<Seq> seqs{{9, 20, -1}};
  for (std::int64_t m = 0; m < 32; ++m) seqs.push_back({1, m % 7, 0});
  seqs.push_back({5, 9, 1});
  const SharedBatch batch = make_shared(seqs, {2600, 77}, DType::bf16, 16, variant("causal"), 5);
  for (int splits : {0, 1}) {
    ForwardResult first;
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE(std::to_string(threads) + " threads, num_splits " + std::to_string(splits));
      AttentionOptions o = variant("causal");
      o.num_threads = threads;
      o.num_splits = splits;
      const ForwardResult r = batch.run(o);
      if (threads == 1) {
        first = r;
        expect_within_merge_rounding(r, batch.run_unshared(o), bf16_probability_rounding(batch, o));
      } else {
        EXPECT_TRUE(bitwise_equal(r.out, first.out));
        EXPECT_TRUE(bitwise_equal(r.lse, first.lse));
      }
    }
  }
}

// The prefix's keys are packed once per kv head for all its sequences' rows (tiled kernel, one
// thread, no key splits): the call packs P·heads_kv·(D + Dv) elements more than the same call
// whose prefix is empty, where the unshared call packs them once per sequence.
TEST(SharedPrefix, PrefixKeysPackedOncePerKvHead) {
  constexpr std::int64_t kPrefix = 1000, kMembers = 12;
  std::vector<Seq> seqs;
  for (std::int64_t m = 0; m < kMembers; ++m) seqs.push_back({1, 3 + m, 0});
  SharedBatch batch = make_shared(seqs, {kPrefix}, DType::f32, 16, {}, 9);
  AttentionOptions o;
  o.num_threads = 1;
  o.num_splits = 1;
  o.kernel = ForwardKernel::tiled;
  auto packed = [&](const SharedBatch& b, bool shared) {
    KernelCounters c;
    AttentionOptions counted = o;
    counted.counters = &c;
    shared ? b.run(counted) : b.run_unshared(counted);
    return c.kv_packed;
  };
  const std::int64_t with_prefix = packed(batch, true), unshared = packed(batch, false);
  batch.prefix_seqused.set(0, 0.0f);
  const std::int64_t without_prefix = packed(batch, true);
  EXPECT_EQ(with_prefix - without_prefix, kPrefix * kHkv * 2 * kDim);
  EXPECT_EQ(unshared - without_prefix, kMembers * kPrefix * kHkv * 2 * kDim);
}

// An FP8 pool: prefixes of whole pages, so that the unshared call reads the same pages (its
// table row is the prefix's pages, then the sequence's own) with the same descales. The tiled
// kernel for both calls: the planner would take decode_fp16, whose half-precision sums (a few
// percent of the codes' quantization error, tested in test_fp8.cpp) differ with the key split.
TEST(SharedPrefix, Fp8PoolEqualsTheUnsharedCall) {
  constexpr std::int64_t kPage = 16, kPages = 40;
  Fp8CacheTensors f = fp8_cache({kPages, kPage, kHkv, kDim});
  for (std::int64_t i = 0; i < f.k_scale.numel(); ++i) f.k_scale.set(i, 0.03125f * static_cast<float>(1 + i % 3));
  const std::vector<Seq> seqs{{1, 5, 0}, {4, 40, 0}, {1, 0, 0}, {2, 17, -1}, {1, 33, 1}, {1, 1, 1}};
  const std::vector<std::int64_t> prefix_keys{5 * kPage, 2 * kPage};
  std::vector<std::int32_t> order(kPages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(3));
  const auto batch = static_cast<std::int64_t>(seqs.size());
  Tensor table(DType::i32, {batch, 4}), seqused(DType::i32, {batch}), flat(DType::i32, {batch, 9}),
      flat_seqused(DType::i32, {batch}), prefix_table(DType::i32, {2, 5}), prefix_seqused(DType::i32, {2}),
      prefix_idx(DType::i32, {batch}), cu_q(DType::i32, {batch + 1});
  std::size_t next = 0;
  for (std::int64_t p = 0; p < 2; ++p) {
    prefix_seqused.set(p, static_cast<float>(prefix_keys[static_cast<std::size_t>(p)]));
    take_pages(prefix_table, p, prefix_keys[static_cast<std::size_t>(p)], kPage, order, next);
  }
  std::int64_t total = 0;
  cu_q.set(0, 0.0f);
  for (std::int64_t b = 0; b < batch; ++b) {
    const Seq& s = seqs[static_cast<std::size_t>(b)];
    take_pages(table, b, s.own, kPage, order, next);
    seqused.set(b, static_cast<float>(s.own));
    prefix_idx.set(b, static_cast<float>(s.prefix));
    const std::int64_t p_pages = s.prefix < 0 ? 0 : prefix_keys[static_cast<std::size_t>(s.prefix)] / kPage;
    for (std::int64_t pg = 0; pg < 9; ++pg)
      flat.set(b * 9 + pg, pg < p_pages ? prefix_table.get(s.prefix * 5 + pg) : pg - p_pages < 4 ? table.get(b * 4 + pg - p_pages) : -1.0f);
    flat_seqused.set(b, static_cast<float>(p_pages * kPage + s.own));
    total += s.rows;
    cu_q.set(b + 1, static_cast<float>(total));
  }
  const Tensor q = random_tensor(DType::bf16, {total, kHq, kDim}, 17);
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    AttentionOptions o;
    o.causal = causal;
    o.num_threads = 2;
    o.kernel = ForwardKernel::tiled;
    PagedKvBatch kv{f.k_codes.view(), f.v_codes.view(), table.view(), seqused.view(), f.k_scale.view(), f.v_scale.view()};
    kv.prefix_block_table = prefix_table.view();
    kv.prefix_seqused_k = prefix_seqused.view();
    kv.prefix_idx = prefix_idx.view();
    const PagedKvBatch unshared{f.k_codes.view(), f.v_codes.view(), flat.view(), flat_seqused.view(), f.k_scale.view(),
                                f.v_scale.view()};
    expect_within_merge_rounding(forward_varlen_paged(q.view(), cu_q.view(), 4, kv, o),
                                 forward_varlen_paged(q.view(), cu_q.view(), 4, unshared, o));
  }
}

TEST(SharedPrefix, RejectsBadCallsBeforeWriting) {
  const SharedBatch good = make_shared({{1, 4, 0}, {2, 30, 0}, {1, 3, -1}, {3, 5, 1}}, {40, 20}, DType::bf16, 16, {}, 5);
  Tensor out(DType::bf16, {good.q.shape()[0], kHq, kDim}), lse(DType::f32, {kHq, good.q.shape()[0]});
  for (std::int64_t i = 0; i < out.numel(); ++i) out.set(i, 7.0f);
  for (std::int64_t i = 0; i < lse.numel(); ++i) lse.set(i, 7.0f);
  auto expect_rejected = [&](const SharedBatch& bad, const AttentionOptions& o, const std::vector<std::string>& fragments,
                             const std::function<void(PagedKvBatch&)>& edit = [](PagedKvBatch&) {}) {
    SCOPED_TRACE(fragments.front());
    PagedKvBatch kv = bad.kv();
    edit(kv);
    expect_error([&] { forward_varlen_paged(bad.q.view(), bad.cu_q.view(), bad.max_q, kv, out.view(), lse.view(), o); },
                 fragments);
    for (std::int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.get(i), 7.0f);
    for (std::int64_t i = 0; i < lse.numel(); ++i) ASSERT_EQ(lse.get(i), 7.0f);
  };
  const std::int64_t pages = good.k_pool.shape()[0], width = good.prefix_table.shape()[1];
  SharedBatch b = good;
  b.prefix_idx.set(1, 2.0f);
  expect_rejected(b, {}, {"prefix_idx: [1] = 2", "num_prefixes = 2"});
  b = good;
  b.prefix_idx.set(0, -2.0f);
  expect_rejected(b, {}, {"prefix_idx: [0] = -2"});
  b = good;
  b.prefix_idx.set(2, 0.0f);  // 0, 0, 0, 1 is fine; 0, 1, 0 is not
  b.prefix_idx.set(1, 1.0f);
  expect_rejected(b, {}, {"prefix_idx: sequences 0 and 2 continue prefix 0", "sequence 1", "consecutive"});
  b = good;
  b.table.set(good.table.shape()[1] * 1 + 1, good.prefix_table.get(1));  // sequence 1's second page is prefix 0's
  expect_rejected(b, {}, {"block_table: [1, 1] = " + std::to_string(static_cast<int>(good.prefix_table.get(1))),
                          "prefix_block_table: [0, 1]"});
  b = good;
  b.prefix_table.set(width, static_cast<float>(pages));
  expect_rejected(b, {}, {"prefix_block_table: [1, 0] = " + std::to_string(pages), "outside the cache's"});
  b = good;
  b.prefix_seqused.set(0, static_cast<float>(width * 16 + 1));
  expect_rejected(b, {}, {"prefix_seqused_k: [0] = " + std::to_string(width * 16 + 1), "max_pages · page_size"});
  b = good;
  b.prefix_seqused.set(1, -1.0f);
  expect_rejected(b, {}, {"prefix_seqused_k: [1] = -1"});
  expect_rejected(good, {}, {"prefix_seqused_k: unset"}, [](PagedKvBatch& kv) { kv.prefix_seqused_k = {}; });
  expect_rejected(good, {}, {"prefix_block_table: unset"}, [](PagedKvBatch& kv) { kv.prefix_block_table = {}; });
  const Tensor short_idx(DType::i32, {2});
  expect_rejected(good, {}, {"prefix_idx"}, [&](PagedKvBatch& kv) { kv.prefix_idx = short_idx.view(); });
  const Tensor float_idx(DType::f32, {4});
  expect_rejected(good, {}, {"prefix_idx", "int32"}, [&](PagedKvBatch& kv) { kv.prefix_idx = float_idx.view(); });
  AttentionOptions causal;
  causal.causal = true;
  b = good;
  b.seqused.set(3, 1.0f);  // 3 causal rows over 1 own key: the first row would not see the prefix's last key
  expect_rejected(b, causal, {"seqused_k: [3] = 1", "3 causal query rows", "whole prefix"});
  AttentionOptions window;
  window.window_size = {8, 0};
  expect_rejected(good, window, {"window_size: (8, 0)", "shared prefixes"});
  const Tensor slopes = random_tensor(DType::f32, {kHq}, 3);
  AttentionOptions alibi;
  alibi.alibi_slopes = slopes.view();
  expect_rejected(good, alibi, {"alibi_slopes", "shared prefixes"});
  AttentionOptions dropout;
  dropout.dropout_p = 0.1f;
  expect_rejected(good, dropout, {"dropout_p", "a paged batch is inference only"});
}

// An FP8 pool: a prefix page with a zero descale is rejected like a sequence's.
TEST(SharedPrefix, RejectsBadFp8PrefixDescales) {
  Fp8CacheTensors f = fp8_cache({8, 16, kHkv, kDim});
  Tensor table(DType::i32, {1, 1}), seqused(DType::i32, {1}), prefix_table(DType::i32, {1, 2}),
      prefix_seqused(DType::i32, {1}), prefix_idx(DType::i32, {1}), cu_q(DType::i32, {2});
  table.set(0, 0.0f), seqused.set(0, 3.0f), prefix_table.set(0, 4.0f), prefix_table.set(1, 6.0f);
  prefix_seqused.set(0, 20.0f), prefix_idx.set(0, 0.0f), cu_q.set(0, 0.0f), cu_q.set(1, 1.0f);
  f.v_scale.set(6 * kHkv + 1, 0.0f);
  const Tensor q = random_tensor(DType::bf16, {1, kHq, kDim}, 1);
  PagedKvBatch kv{f.k_codes.view(), f.v_codes.view(), table.view(), seqused.view(), f.k_scale.view(), f.v_scale.view()};
  kv.prefix_block_table = prefix_table.view();
  kv.prefix_seqused_k = prefix_seqused.view();
  kv.prefix_idx = prefix_idx.view();
  expect_error([&] { forward_varlen_paged(q.view(), cu_q.view(), 1, kv); },
               {"v_scale: [6, 1]", "finite positive descale", "prefix_block_table row 0 reads page 6"});
}

}  // namespace
}  // namespace flashattn::test
