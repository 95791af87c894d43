// Paged variable-length batches (forward_varlen_paged): check the call — offsets, the page
// pools, the block table, the key counts, the scales of quantized pools, the shared prefixes,
// the outputs — then make each sequence a batch-1 problem on views of q and the outputs that
// reads the pools in place through its row of the block table (the PagedKv of a KV cache),
// and each shared prefix one problem on its sequences' query rows, every one checked before
// the backend runs them all together and merges each prefix's partial result with its
// sequences' own.
#include <algorithm>
#include <string>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/error.hpp"
#include "src/api/backend.hpp"
#include "src/api/checks.hpp"
#include "src/api/route.hpp"
#include "src/api/sequences.hpp"
#include "src/core/validate.hpp"

namespace flashattn {
namespace {

std::string str(std::int64_t v) { return std::to_string(v); }
bool is_set(const TensorView& t) { return t.data != nullptr || t.rank != 0; }

// The call's sizes and each sequence's query offsets and key count, checked; with shared
// prefixes, each prefix's key count and its sequences [first, end) (first == end: none).
struct PagedCall {
  bool quantized = false;  // u8 codes, read as each pool's PoolScales say
  std::int64_t batch = 0, page_size = 0;
  std::vector<std::int64_t> cu_q, keys;
  std::vector<std::int64_t> prefix_keys, prefix_first, prefix_end;
};

detail::PoolScales k_scales(const PagedKvBatch& kv) {
  return {"k_cache", "k_scale", "k_zero_point", "k_quant", kv.k_quant, kv.k_scale, kv.k_zero_point};
}
detail::PoolScales v_scales(const PagedKvBatch& kv) {
  return {"v_cache", "v_scale", "v_zero_point", "v_quant", kv.v_quant, kv.v_scale, kv.v_zero_point};
}

// The pools: q's dtype, or u8 codes in both with their scales; one page layout.
void check_pools(const TensorView& q, const PagedKvBatch& kv, PagedCall& r) {
  detail::check_view("q", q, 3, "(total_q, heads_q, head_dim)");
  r.quantized = detail::check_cache_pools(q, kv.k_cache, kv.v_cache, k_scales(kv), v_scales(kv),
                                          "(num_pages, page_size, heads_kv, head_dim)",
                                          "(num_pages, page_size, heads_kv, head_dim_v)");
  if (kv.k_cache.shape[2] < 1 || q.shape[1] % kv.k_cache.shape[2] != 0)
    throw Error("k_cache: heads_kv " + str(kv.k_cache.shape[2]) + " does not divide q's heads_q " + str(q.shape[1]));
  r.page_size = kv.k_cache.shape[1];
  if (r.page_size < 1) throw Error("k_cache: page size " + str(r.page_size) + " must be >= 1");
}

std::int64_t entry(const TensorView& t, std::int64_t i) {
  return static_cast<const std::int32_t*>(t.data)[i * t.strides[0]];
}

// Page pg of row `row` of a block table.
std::int64_t table_page(const TensorView& table, std::int64_t row, std::int64_t pg) {
  return static_cast<const std::int32_t*>(table.data)[row * table.strides[0] + pg * table.strides[1]];
}

// The key counts `counts` (int32 (rows)) of the rows of a block table `table_name` (int32
// (rows, max_pages)): each within the row's pages, every page it reads a page of the pools
// and, in a quantized pool, with finite positive scales (and finite zero points) for the
// slots read. Returns the counts.
std::vector<std::int64_t> check_table(const PagedKvBatch& kv, const PagedCall& r, const char* table_name,
                                      const TensorView& table, const char* counts_name, const TensorView& counts) {
  const std::int64_t rows = table.shape[0];
  detail::check_tensor(counts_name, counts, DType::i32, "key counts are int32", {rows}, "(rows of its block table)");
  const std::int64_t capacity = table.shape[1] * r.page_size, pages = kv.k_cache.shape[0];
  std::vector<std::int64_t> keys;
  for (std::int64_t b = 0; b < rows; ++b) {
    const std::int64_t n = entry(counts, b);
    if (n < 0 || n > capacity)
      throw Error(std::string(counts_name) + ": [" + str(b) + "] = " + str(n) + " outside [0, max_pages · page_size = " +
                  str(capacity) + "]");
    keys.push_back(n);
    for (std::int64_t pg = 0; pg < (n + r.page_size - 1) / r.page_size; ++pg) {
      const std::int64_t page = table_page(table, b, pg);
      if (page < 0 || page >= pages)
        throw Error(std::string(table_name) + ": [" + str(b) + ", " + str(pg) + "] = " + str(page) +
                    " outside the cache's " + str(pages) + " pages");
      if (!r.quantized) continue;
      const std::int64_t slots = std::min(r.page_size, n - pg * r.page_size);
      for (const detail::PoolScales& pool : {k_scales(kv), v_scales(kv)})
        detail::check_scale_values(pool, page, 0, slots, kv.k_cache.shape[2], [&] {
          const std::string row = &table == &kv.block_table ? "sequence " : std::string(table_name) + " row ";
          return row + str(b) + " reads page " + str(page);
        });
    }
  }
  return keys;
}

// The block table and key counts: every page a sequence reads is a page of the pools and,
// in a quantized pool, has finite positive scales (and finite zero points) for the slots read.
void check_tables(const PagedKvBatch& kv, PagedCall& r) {
  detail::check_view("block_table", kv.block_table, 2, "(batch, max_pages)");
  detail::check_dtype("block_table", kv.block_table, DType::i32, "int32 page numbers");
  if (kv.block_table.shape[0] != r.batch)
    throw Error("block_table: " + str(kv.block_table.shape[0]) + " rows but cu_seqlens_q has batch " + str(r.batch));
  r.keys = check_table(kv, r, "block_table", kv.block_table, "seqused_k", kv.seqused_k);
}

bool has_prefixes(const PagedKvBatch& kv) {
  return is_set(kv.prefix_block_table) || is_set(kv.prefix_seqused_k) || is_set(kv.prefix_idx);
}

// What a prefix pass cannot compute: masks and biases that depend on each query row's
// absolute position (the pass sees one block of rows from many sequences). (Dropout no
// paged batch takes: check_paged_call.)
void check_prefix_options(const AttentionOptions& options) {
  constexpr const char* kWhy = " not supported with shared prefixes (prefix_idx): the prefix pass does not know each "
                               "query row's position";
  if (options.window_size.left >= 0 || options.window_size.right >= 0)
    throw Error("window_size: (" + str(options.window_size.left) + ", " + str(options.window_size.right) + ")" + kWhy);
  if (is_set(options.alibi_slopes)) throw Error(std::string("alibi_slopes:") + kWhy);
}

// The shared prefixes: their tables and key counts as the sequences'; each sequence's prefix
// in range; the sequences of a prefix consecutive, none reading a page of its prefix, and
// under causal each query row seeing the whole prefix.
void check_prefixes(const PagedKvBatch& kv, const AttentionOptions& options, PagedCall& r) {
  if (!has_prefixes(kv)) return;
  for (const auto& [name, t] : {std::pair{"prefix_block_table", kv.prefix_block_table},
                                {"prefix_seqused_k", kv.prefix_seqused_k}, {"prefix_idx", kv.prefix_idx}})
    if (!is_set(t))
      throw Error(std::string(name) + ": unset, but shared prefixes take prefix_block_table, prefix_seqused_k and "
                                      "prefix_idx together");
  check_prefix_options(options);
  detail::check_view("prefix_block_table", kv.prefix_block_table, 2, "(num_prefixes, max_prefix_pages)");
  detail::check_dtype("prefix_block_table", kv.prefix_block_table, DType::i32, "int32 page numbers");
  r.prefix_keys = check_table(kv, r, "prefix_block_table", kv.prefix_block_table, "prefix_seqused_k",
                              kv.prefix_seqused_k);
  const std::int64_t prefixes = kv.prefix_block_table.shape[0];
  detail::check_tensor("prefix_idx", kv.prefix_idx, DType::i32, "prefix indices are int32", {r.batch}, "(batch)");
  r.prefix_first.assign(static_cast<std::size_t>(prefixes), 0);
  r.prefix_end.assign(static_cast<std::size_t>(prefixes), 0);
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> pages(static_cast<std::size_t>(prefixes));  // (page, index)
  for (std::int64_t b = 0; b < r.batch; ++b) {
    const std::int64_t p = entry(kv.prefix_idx, b);
    if (p < -1 || p >= prefixes)
      throw Error("prefix_idx: [" + str(b) + "] = " + str(p) + " outside [-1, num_prefixes = " + str(prefixes) + ")");
    if (p < 0) continue;
    const auto pi = static_cast<std::size_t>(p);
    if (r.prefix_first[pi] == r.prefix_end[pi]) {
      r.prefix_first[pi] = b;
    } else if (r.prefix_end[pi] != b) {
      throw Error("prefix_idx: sequences " + str(r.prefix_end[pi] - 1) + " and " + str(b) + " continue prefix " +
                  str(p) + " but sequence " + str(r.prefix_end[pi]) +
                  " between them does not: the sequences of a prefix must be consecutive");
    }
    r.prefix_end[pi] = b + 1;
    const auto bi = static_cast<std::size_t>(b);
    const std::int64_t rows = r.cu_q[bi + 1] - r.cu_q[bi], own = r.keys[bi];
    if (options.causal && r.prefix_keys[pi] > 0 && own < rows - 1)
      throw Error("seqused_k: [" + str(b) + "] = " + str(own) + " keys after prefix " + str(p) + " for " + str(rows) +
                  " causal query rows: a row would not see the whole prefix (needs seqused_k >= rows − 1)");
    if (pages[pi].empty()) {
      for (std::int64_t pg = 0; pg < (r.prefix_keys[pi] + r.page_size - 1) / r.page_size; ++pg)
        pages[pi].emplace_back(table_page(kv.prefix_block_table, p, pg), pg);
      std::sort(pages[pi].begin(), pages[pi].end());
    }
    for (std::int64_t pg = 0; pg < (own + r.page_size - 1) / r.page_size; ++pg) {
      const std::int64_t page = table_page(kv.block_table, b, pg);
      const auto same = std::lower_bound(pages[pi].begin(), pages[pi].end(), std::pair{page, std::int64_t{0}});
      if (same != pages[pi].end() && same->first == page)
        throw Error("block_table: [" + str(b) + ", " + str(pg) + "] = " + str(page) +
                    " is also a page of the sequence's shared prefix (prefix_block_table: [" + str(p) + ", " +
                    str(same->second) + "])");
    }
  }
}

PagedCall check_paged_call(const TensorView& q, const TensorView& cu_seqlens_q, std::int64_t max_seqlen_q,
                           const PagedKvBatch& kv, const AttentionOptions& options) {
  detail::reject_rescale_counts("forward_varlen_paged", options);
  detail::reject_attn_mask("forward_varlen_paged", options);
  detail::reject_top_left("forward_varlen_paged", options);
  detail::reject_score_hook("forward_varlen_paged", options);
  if (is_set(options.block_mask)) throw Error("block_mask: not supported with variable-length batches");
  // A paged batch is inference only (as the Python interface says): a dropout mask is keyed
  // by the sequence's index in the batch, which would break the batch invariance promised
  // for a sequence's out and lse.
  if (options.dropout_p != 0.0f)
    throw Error("dropout_p: " + std::to_string(options.dropout_p) +
                " not supported by forward_varlen_paged (a paged batch is inference only)");
  PagedCall r;
  check_pools(q, kv, r);
  r.cu_q = detail::read_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q");
  r.batch = static_cast<std::int64_t>(r.cu_q.size()) - 1;
  check_tables(kv, r);
  detail::check_sequence_options(options, r.batch, q.shape[1]);
  check_prefixes(kv, options, r);
  return r;
}

const detail::Backend& paged_backend(const TensorView& q, const TensorView& cu_seqlens_q, const PagedKvBatch& kv,
                                     const TensorView& out, const TensorView& lse) {
  return detail::route("forward_varlen_paged", &detail::Backend::forward_varlen_paged,
                       {{"q", q},
                        {"cu_seqlens_q", cu_seqlens_q},
                        {"k_cache", kv.k_cache},
                        {"v_cache", kv.v_cache},
                        {"block_table", kv.block_table},
                        {"seqused_k", kv.seqused_k},
                        {"k_scale", kv.k_scale},
                        {"v_scale", kv.v_scale},
                        {"prefix_block_table", kv.prefix_block_table},
                        {"prefix_seqused_k", kv.prefix_seqused_k},
                        {"prefix_idx", kv.prefix_idx},
                        {"k_zero_point", kv.k_zero_point},
                        {"v_zero_point", kv.v_zero_point},
                        {"out", out},
                        {"lse", lse}});
}

// A job over query rows [q0, q0 + rows) of q that reads `keys` keys through row `row` of
// `table` (a block table) and writes out and lse (batch-1 views).
detail::ForwardJob paged_job(const TensorView& q, const PagedKvBatch& kv, const PagedCall& r, const TensorView& table,
                             std::int64_t row, std::int64_t keys, std::int64_t q0, std::int64_t rows,
                             const MutableTensorView& out, const MutableTensorView& lse, const AttentionOptions& options,
                             std::int64_t batch_offset) {
  detail::ForwardJob job{{},
                         detail::cache_internals(batch_offset, r.quantized, kv.k_quant, kv.v_quant),
                         detail::packed_sequence(q, q0, rows),
                         kv.k_cache,
                         kv.v_cache,
                         out,
                         lse,
                         options,
                         {}};
  job.paged.block_table = static_cast<const std::int32_t*>(table.data) + row * table.strides[0];
  job.paged.table_stride = table.strides[1];
  job.paged.page_size = r.page_size;
  if (r.quantized) {
    job.paged.k = detail::kv_scales(k_scales(kv), true, 0, 0);
    job.paged.v = detail::kv_scales(v_scales(kv), true, 0, 0);
  }
  job.problem = AttentionProblem::from_sizes(1, rows, keys, q.shape[1], kv.k_cache.shape[2], q.shape[2],
                                             kv.v_cache.shape[3], q.dtype, job.options);
  return job;
}

// The partial results of the sequences that continue a shared prefix, before their merge:
// float32 out (2, rows, heads_q, head_dim_v) and each row's softmax state — max (log2 units)
// and ℓ, each (2, heads_q, rows) — pass 0 the prefixes', pass 1 the sequences' own, over
// those sequences' query rows, prefix after prefix. States, not lses: a float32 lse rounds
// m + log ℓ to m where the scores are huge, and the merge would weigh the passes alike.
class Partials {
 public:
  Partials(std::int64_t rows, std::int64_t heads, std::int64_t dim_v)
      : rows_(rows), heads_(heads), dim_v_(dim_v), out_(DType::f32, {2, rows, heads, dim_v}),
        max_(DType::f32, {2, heads, rows}), sum_(DType::f32, {2, heads, rows}) {}
  // Rows [from, from + n) of a pass, as a job's (1, n, heads_q, head_dim_v) out and (1,
  // heads_q, n) state (ForwardJob::lse, ForwardJob::lse_sums).
  MutableTensorView out(int pass, std::int64_t from, std::int64_t n) {
    return detail::packed_sequence(MutableTensorView(out_.data_as<float>() + pass * rows_ * heads_ * dim_v_, DType::f32,
                                                     {rows_, heads_, dim_v_}),
                                   from, n);
  }
  MutableTensorView max(int pass, std::int64_t from, std::int64_t n) {
    return detail::packed_lse(MutableTensorView(max_.data_as<float>() + pass * heads_ * rows_, DType::f32, {heads_, rows_}),
                              from, n);
  }
  float* sums(int pass, std::int64_t from) { return sum_.data_as<float>() + pass * heads_ * rows_ + from; }
  // Both passes of rows [from, from + n) merged into out and lse (batch-1 views).
  detail::StateMerge merge(std::int64_t from, std::int64_t n, const MutableTensorView& out,
                           const MutableTensorView& lse) {
    const std::int64_t pass_out = rows_ * heads_ * dim_v_, pass_state = heads_ * rows_;
    return {TensorView(out_.data_as<float>() + from * heads_ * dim_v_, DType::f32, {2, 1, n, heads_, dim_v_},
                       {pass_out, pass_out, heads_ * dim_v_, dim_v_, 1}),
            TensorView(max_.data_as<float>() + from, DType::f32, {2, 1, heads_, n}, {pass_state, pass_state, rows_, 1}),
            sums(0, from), out, lse};
  }

 private:
  std::int64_t rows_, heads_, dim_v_;
  Tensor out_, max_, sum_;
};

}  // namespace

void forward_varlen_paged(const TensorView& q, const TensorView& cu_seqlens_q, std::int64_t max_seqlen_q,
                          const PagedKvBatch& kv, const MutableTensorView& out, const MutableTensorView& lse,
                          const AttentionOptions& options) {
  const detail::Backend& backend = paged_backend(q, cu_seqlens_q, kv, out, lse);
  const PagedCall r = check_paged_call(q, cu_seqlens_q, max_seqlen_q, kv, options);
  detail::check_tensor("out", out, q.dtype, "out must have q's dtype", {q.shape[0], q.shape[1], kv.v_cache.shape[3]},
                       "(total_q, heads_q, head_dim_v)");
  detail::check_tensor("lse", lse, DType::f32, "lse is always float32", {q.shape[1], q.shape[0]}, "(heads_q, total_q)");
  detail::check_outputs_apart({{"out", out}, {"lse", lse}},
                              {{"q", q}, {"cu_seqlens_q", cu_seqlens_q}, {"k_cache", kv.k_cache},
                               {"v_cache", kv.v_cache}, {"block_table", kv.block_table}, {"seqused_k", kv.seqused_k},
                               {"k_scale", kv.k_scale}, {"v_scale", kv.v_scale}, {"k_zero_point", kv.k_zero_point},
                               {"v_zero_point", kv.v_zero_point}, {"prefix_block_table", kv.prefix_block_table},
                               {"prefix_seqused_k", kv.prefix_seqused_k}, {"prefix_idx", kv.prefix_idx}});
  detail::check_apart_from_options("out", out, options);
  detail::check_apart_from_options("lse", lse, options);
  // Each prefix's sequences' rows in the partials start at row partial_row[p].
  const std::size_t prefixes = r.prefix_keys.size();
  std::vector<std::int64_t> partial_row(prefixes + 1, 0);
  for (std::size_t p = 0; p < prefixes; ++p)
    partial_row[p + 1] = partial_row[p] + r.cu_q[static_cast<std::size_t>(r.prefix_end[p])] -
                         r.cu_q[static_cast<std::size_t>(r.prefix_first[p])];
  Partials partials(partial_row.back(), q.shape[1], kv.v_cache.shape[3]);
  std::vector<detail::ForwardJob> jobs;
  std::vector<detail::StateMerge> merges;
  for (std::int64_t b = 0; b < r.batch; ++b) {
    const auto bi = static_cast<std::size_t>(b);
    const std::int64_t q0 = r.cu_q[bi], sq = r.cu_q[bi + 1] - q0;
    const std::int64_t p = prefixes > 0 ? entry(kv.prefix_idx, b) : -1;
    if (p < 0) {
      jobs.push_back(paged_job(q, kv, r, kv.block_table, b, r.keys[bi], q0, sq, detail::packed_sequence(out, q0, sq),
                               detail::packed_lse(lse, q0, sq), detail::sequence_options(options, b), b));
      continue;
    }
    const auto pi = static_cast<std::size_t>(p);
    const std::int64_t row = partial_row[pi] + q0 - r.cu_q[static_cast<std::size_t>(r.prefix_first[pi])];
    jobs.push_back(paged_job(q, kv, r, kv.block_table, b, r.keys[bi], q0, sq, partials.out(1, row, sq),
                             partials.max(1, row, sq), detail::sequence_options(options, b), b));
    jobs.back().lse_sums = partials.sums(1, row);
    if (sq > 0) merges.push_back(partials.merge(row, sq, detail::packed_sequence(out, q0, sq), detail::packed_lse(lse, q0, sq)));
  }
  // The prefix passes: every query row of the prefix's sequences sees every prefix key; the
  // sinks join the sequences' own passes, once per row.
  AttentionOptions prefix_options = options;
  prefix_options.causal = false;
  prefix_options.sinks = {};
  for (std::size_t p = 0; p < prefixes; ++p) {
    const std::int64_t first = r.prefix_first[p], q0 = r.cu_q[static_cast<std::size_t>(first)];
    const std::int64_t rows = partial_row[p + 1] - partial_row[p];
    if (rows == 0) continue;
    jobs.push_back(paged_job(q, kv, r, kv.prefix_block_table, static_cast<std::int64_t>(p), r.prefix_keys[p], q0, rows,
                             partials.out(0, partial_row[p], rows), partials.max(0, partial_row[p], rows),
                             prefix_options, first));
    jobs.back().lse_sums = partials.sums(0, partial_row[p]);
  }
  for (const detail::ForwardJob& job : jobs) {
    detail::check_forward_output_views(job.problem, job.q, job.k, job.v, job.out, job.lse);
    backend.check_forward(job);
  }
  detail::begin_run(options);
  backend.forward_varlen_paged(jobs, merges);
}

ForwardResult forward_varlen_paged(const TensorView& q, const TensorView& cu_seqlens_q, std::int64_t max_seqlen_q,
                                   const PagedKvBatch& kv, const AttentionOptions& options) {
  paged_backend(q, cu_seqlens_q, kv, {}, {});
  check_paged_call(q, cu_seqlens_q, max_seqlen_q, kv, options);
  ForwardResult r{Tensor(q.dtype, {q.shape[0], q.shape[1], kv.v_cache.shape[3]}),
                  Tensor(DType::f32, {q.shape[1], q.shape[0]})};
  forward_varlen_paged(q, cu_seqlens_q, max_seqlen_q, kv, r.out.view(), r.lse.view(), options);
  return r;
}

}  // namespace flashattn
