#include "tools/cli/serve.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>

#include "tools/cli/measure.hpp"

namespace flashattn::cli {

ServeCase ServeCase::issue() {
  ServeCase c;
  c.name = "issue";
  for (std::int64_t i = 0; i < 4; ++i) c.prefill_cached.push_back(i * 8192 / 3);
  for (std::int64_t i = 0; i < 60; ++i) c.decode_keys.push_back(512 + i * (16384 - 512) / 59);
  return c;
}

ServeCase ServeCase::smoke() {
  ServeCase c;
  c.name = "smoke";
  c.prefill_rows = 64;
  c.prefill_cached = {0, 300};
  c.decode_keys = {100, 2500, 700, 33};
  c.heads = 8;
  c.heads_kv = 2;
  c.dim = 64;
  c.shared_sequences = 4;
  c.shared_prefix = 320;
  c.shared_own = 20;
  c.chunk_sequences = 3;
  c.chunk_rows = 5;
  c.chunk_cached = 200;
  return c;
}

namespace {

// A batch of sequences (query rows, keys) over consecutive pages of the pools.
struct Batch {
  Tensor q, cu_q, table, seqused;
  std::int64_t max_q = 0;
};

Batch make_batch(const ServeCase& c, const std::vector<std::pair<std::int64_t, std::int64_t>>& seqs,
                 const std::vector<std::int64_t>& first_page, std::int64_t width) {
  Batch r;
  const auto n = static_cast<std::int64_t>(seqs.size());
  std::int64_t total = 0;
  for (const auto& [rows, keys] : seqs) total += rows, r.max_q = std::max(r.max_q, rows);
  const AttentionProblem p = AttentionProblem::from_sizes(1, std::max<std::int64_t>(total, 1), 1, c.heads, c.heads_kv,
                                                          c.dim, c.dim, c.dtype, {});
  r.q = Tensor(c.dtype, {total, c.heads, c.dim});
  const Tensor q = random_inputs(p, 5).q;
  std::memcpy(r.q.data(), q.data(), static_cast<std::size_t>(r.q.numel()) * dtype_size(c.dtype));
  r.cu_q = Tensor(DType::i32, {n + 1});
  r.table = Tensor(DType::i32, {n, width});
  r.seqused = Tensor(DType::i32, {n});
  std::int32_t* cu = r.cu_q.data_as<std::int32_t>();
  cu[0] = 0;
  for (std::int64_t b = 0; b < n; ++b) {
    const auto [rows, keys] = seqs[static_cast<std::size_t>(b)];
    cu[b + 1] = cu[b] + static_cast<std::int32_t>(rows);
    r.seqused.data_as<std::int32_t>()[b] = static_cast<std::int32_t>(keys);
    for (std::int64_t pg = 0; pg < width; ++pg)
      r.table.data_as<std::int32_t>()[b * width + pg] =
          static_cast<std::int32_t>(first_page[static_cast<std::size_t>(b)] + std::min(pg, (keys + c.page_size - 1) / c.page_size - 1));
  }
  return r;
}

// Pseudo-random bf16/f16/f32 values in [−1, 1) without the cost of a normal generator:
// the pools of the issue's batch hold a billion of them.
void fill(Tensor& t) {
  std::uint64_t x = 0x9E3779B97F4A7C15ull;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    t.set(i, static_cast<float>(static_cast<std::int64_t>(x >> 40) - (1ll << 23)) / static_cast<float>(1 << 23));
  }
}

// The K and V bytes of `keys` keys.
double kv_bytes(const ServeCase& c, std::int64_t keys) {
  return static_cast<double>(keys) * static_cast<double>(2 * c.heads_kv * c.dim) * static_cast<double>(dtype_size(c.dtype));
}

// Median seconds of `first` and of `second` over `repeats` runs each, timed alternately after
// a warm-up pair, so that a load that changes during the run (a shared machine) weighs on
// both alike; which runs first swaps every round, so that neither always finds the other's
// data in the caches.
template <class First, class Second>
std::pair<double, double> alternate(int repeats, const First& first, const Second& second) {
  std::vector<double> a, b;
  for (int r = 0; r <= repeats; ++r) {
    for (bool which : {r % 2 == 0, r % 2 != 0}) {
      const auto t0 = std::chrono::steady_clock::now();
      which ? first() : second();
      if (r > 0)
        (which ? a : b).push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  let_worker_threads_sleep();
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  return {a[a.size() / 2], b[b.size() / 2]};
}

// One decode step of c.shared_sequences sequences that continue one prefix of
// c.shared_prefix keys with c.shared_own keys each: (shared, unshared) median seconds of
// `repeats` runs, the unshared call's table rows being the prefix's pages followed by the
// sequence's own.
std::pair<double, double> time_shared_prefix(const ServeCase& c, int repeats) {
  const std::int64_t n = c.shared_sequences, prefix_pages = (c.shared_prefix + c.page_size - 1) / c.page_size;
  const std::int64_t own_pages = (c.shared_own + c.page_size - 1) / c.page_size;
  const std::int64_t pages = prefix_pages + n * own_pages;
  Tensor k_pool(c.dtype, {pages, c.page_size, c.heads_kv, c.dim}), v_pool(c.dtype, {pages, c.page_size, c.heads_kv, c.dim});
  fill(k_pool);
  fill(v_pool);
  // The prefix fills whole pages, so that the unshared call reads the same pages.
  if (c.shared_prefix % c.page_size != 0)
    throw Error("serve case " + c.name + ": shared_prefix " + std::to_string(c.shared_prefix) +
                " is not a multiple of page_size " + std::to_string(c.page_size));
  const std::int64_t prefix_keys = c.shared_prefix;
  std::vector<std::pair<std::int64_t, std::int64_t>> own(static_cast<std::size_t>(n), {1, c.shared_own});
  std::vector<std::int64_t> first_page;
  for (std::int64_t b = 0; b < n; ++b) first_page.push_back(prefix_pages + b * own_pages);
  const Batch shared = make_batch(c, own, first_page, own_pages);
  Tensor unshared_table(DType::i32, {n, prefix_pages + own_pages}), unshared_keys(DType::i32, {n});
  Tensor prefix_table(DType::i32, {1, prefix_pages}), prefix_keys_t(DType::i32, {1}), prefix_idx(DType::i32, {n});
  for (std::int64_t pg = 0; pg < prefix_pages; ++pg) prefix_table.data_as<std::int32_t>()[pg] = static_cast<std::int32_t>(pg);
  prefix_keys_t.data_as<std::int32_t>()[0] = static_cast<std::int32_t>(prefix_keys);
  for (std::int64_t b = 0; b < n; ++b) {
    prefix_idx.data_as<std::int32_t>()[b] = 0;
    unshared_keys.data_as<std::int32_t>()[b] = static_cast<std::int32_t>(prefix_keys + c.shared_own);
    for (std::int64_t pg = 0; pg < prefix_pages + own_pages; ++pg)
      unshared_table.data_as<std::int32_t>()[b * (prefix_pages + own_pages) + pg] =
          pg < prefix_pages ? static_cast<std::int32_t>(pg) : shared.table.data_as<std::int32_t>()[b * own_pages + pg - prefix_pages];
  }
  AttentionOptions options;
  options.causal = true;
  options.num_threads = c.threads;
  PagedKvBatch with{k_pool.view(), v_pool.view(), shared.table.view(), shared.seqused.view(), {}, {}, {}, {}, {}};
  with.prefix_block_table = prefix_table.view();
  with.prefix_seqused_k = prefix_keys_t.view();
  with.prefix_idx = prefix_idx.view();
  const PagedKvBatch without{k_pool.view(), v_pool.view(), unshared_table.view(), unshared_keys.view(), {}, {}, {}, {}, {}};
  return alternate(
      repeats, [&] { forward_varlen_paged(shared.q.view(), shared.cu_q.view(), 1, with, options); },
      [&] { forward_varlen_paged(shared.q.view(), shared.cu_q.view(), 1, without, options); });
}

// One step of c.chunk_sequences sequences adding c.chunk_rows tokens each over
// c.chunk_cached cached ones, causal, each over its own pages: (pack_gqa on, pack_gqa off)
// median seconds of `repeats` runs.
std::pair<double, double> time_chunks(const ServeCase& c, int repeats) {
  const std::int64_t keys = c.chunk_cached + c.chunk_rows, pages_each = (keys + c.page_size - 1) / c.page_size;
  Tensor k_pool(c.dtype, {c.chunk_sequences * pages_each, c.page_size, c.heads_kv, c.dim});
  Tensor v_pool(c.dtype, k_pool.shape());
  fill(k_pool);
  fill(v_pool);
  std::vector<std::int64_t> first_page;
  for (std::int64_t b = 0; b < c.chunk_sequences; ++b) first_page.push_back(b * pages_each);
  const Batch batch = make_batch(c, std::vector<std::pair<std::int64_t, std::int64_t>>(
                                        static_cast<std::size_t>(c.chunk_sequences), {c.chunk_rows, keys}),
                                 first_page, pages_each);
  const PagedKvBatch kv{k_pool.view(), v_pool.view(), batch.table.view(), batch.seqused.view(), {}, {}, {}, {}, {}};
  AttentionOptions packed;
  packed.causal = true;
  packed.num_threads = c.threads;
  packed.pack_gqa = true;
  AttentionOptions unpacked = packed;
  unpacked.pack_gqa = false;
  return alternate(
      repeats, [&] { forward_varlen_paged(batch.q.view(), batch.cu_q.view(), c.chunk_rows, kv, packed); },
      [&] { forward_varlen_paged(batch.q.view(), batch.cu_q.view(), c.chunk_rows, kv, unpacked); });
}

}  // namespace

ServeMeasurement measure_serve(const ServeCase& c, int repeats) {
  std::vector<std::pair<std::int64_t, std::int64_t>> seqs;  // (query rows, keys)
  for (std::int64_t cached : c.prefill_cached) seqs.emplace_back(c.prefill_rows, cached + c.prefill_rows);
  for (std::int64_t keys : c.decode_keys) seqs.emplace_back(1, keys);
  std::vector<std::int64_t> first_page;
  std::int64_t pages = 0, width = 1;
  for (const auto& [rows, keys] : seqs) {
    first_page.push_back(pages);
    const std::int64_t n = (keys + c.page_size - 1) / c.page_size;
    pages += n;
    width = std::max(width, n);
  }
  Tensor k_pool(c.dtype, {pages, c.page_size, c.heads_kv, c.dim}), v_pool(c.dtype, {pages, c.page_size, c.heads_kv, c.dim});
  fill(k_pool);
  fill(v_pool);
  ServeMeasurement m;
  m.pool_bytes = 2 * static_cast<std::size_t>(k_pool.numel()) * dtype_size(c.dtype);
  AttentionOptions options;
  options.causal = true;
  options.num_threads = c.threads;
  auto call = [&](const Batch& b) {
    const PagedKvBatch kv{k_pool.view(), v_pool.view(), b.table.view(), b.seqused.view(), {}, {}, {}, {}, {}};
    forward_varlen_paged(b.q.view(), b.cu_q.view(), b.max_q, kv, options);
  };
  const Batch all = make_batch(c, seqs, first_page, width);
  std::vector<Batch> each;
  for (std::size_t s = 0; s < seqs.size(); ++s) each.push_back(make_batch(c, {seqs[s]}, {first_page[s]}, width));
  const std::size_t prefills = c.prefill_cached.size();
  const Batch decode = make_batch(c, {seqs.begin() + static_cast<std::ptrdiff_t>(prefills), seqs.end()},
                                  {first_page.begin() + static_cast<std::ptrdiff_t>(prefills), first_page.end()}, width);
  m.seconds = median_seconds([&] { call(all); }, repeats, 1, "serve " + c.name + ": one call");
  let_worker_threads_sleep();
  m.per_sequence_seconds = median_seconds([&] { for (const Batch& b : each) call(b); }, repeats, 1,
                                          "serve " + c.name + ": one call per sequence");
  let_worker_threads_sleep();
  m.decode_seconds = median_seconds([&] { call(decode); }, repeats, 1, "serve " + c.name + ": decode rows");
  let_worker_threads_sleep();
  std::int64_t decode_keys = 0;
  for (std::int64_t k : c.decode_keys) decode_keys += k;
  m.decode_gbps = kv_bytes(c, decode_keys) / m.decode_seconds / 1e9;
  std::tie(m.shared_prefix_seconds, m.unshared_prefix_seconds) = time_shared_prefix(c, repeats);
  std::tie(m.chunk_seconds, m.chunk_unpacked_seconds) = time_chunks(c, repeats);
  m.chunk_gbps = kv_bytes(c, c.chunk_sequences * (c.chunk_cached + c.chunk_rows)) / m.chunk_seconds / 1e9;
  return m;
}

}  // namespace flashattn::cli
