// Paged variable-length batches (forward_varlen_paged): check the call — offsets, the page
// pools, the block table, the key counts, the scales of quantized pools, the outputs — then
// make each sequence a batch-1 problem on views of q and the outputs that reads the pools
// in place through its row of the block table (the PagedKv of a KV cache), every one
// checked before the backend runs them all together.
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

// The call's sizes and each sequence's query offsets and key count, checked.
struct PagedCall {
  bool quantized = false;  // u8 codes, read as each pool's PoolScales say
  std::int64_t batch = 0, page_size = 0;
  std::vector<std::int64_t> cu_q, keys;
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
  if (kv.k_cache.shape[3] != q.shape[2])
    throw Error("k_cache: head_dim " + str(kv.k_cache.shape[3]) + " does not match q's " + str(q.shape[2]));
  r.page_size = kv.k_cache.shape[1];
  if (r.page_size < 1) throw Error("k_cache: page size " + str(r.page_size) + " must be >= 1");
}

// The block table and key counts: every page a sequence reads is a page of the pools and,
// in a quantized pool, has finite positive scales (and finite zero points) for the slots read.
void check_tables(const PagedKvBatch& kv, PagedCall& r) {
  detail::check_view("block_table", kv.block_table, 2, "(batch, max_pages)");
  detail::check_dtype("block_table", kv.block_table, DType::i32, "int32 page numbers");
  if (kv.block_table.shape[0] != r.batch)
    throw Error("block_table: " + str(kv.block_table.shape[0]) + " rows but cu_seqlens_q has batch " + str(r.batch));
  detail::check_tensor("seqused_k", kv.seqused_k, DType::i32, "key counts are int32", {r.batch}, "(batch)");
  const std::int64_t capacity = kv.block_table.shape[1] * r.page_size, pages = kv.k_cache.shape[0];
  const auto* table = static_cast<const std::int32_t*>(kv.block_table.data);
  for (std::int64_t b = 0; b < r.batch; ++b) {
    const std::int64_t n = static_cast<const std::int32_t*>(kv.seqused_k.data)[b * kv.seqused_k.strides[0]];
    if (n < 0 || n > capacity)
      throw Error("seqused_k: [" + str(b) + "] = " + str(n) + " outside [0, max_pages · page_size = " + str(capacity) +
                  "]");
    r.keys.push_back(n);
    for (std::int64_t pg = 0; pg < (n + r.page_size - 1) / r.page_size; ++pg) {
      const std::int64_t page = table[b * kv.block_table.strides[0] + pg * kv.block_table.strides[1]];
      if (page < 0 || page >= pages)
        throw Error("block_table: [" + str(b) + ", " + str(pg) + "] = " + str(page) + " outside the cache's " +
                    str(pages) + " pages");
      if (!r.quantized) continue;
      const std::int64_t slots = std::min(r.page_size, n - pg * r.page_size);
      for (const detail::PoolScales& pool : {k_scales(kv), v_scales(kv)})
        detail::check_scale_values(pool, page, 0, slots, kv.k_cache.shape[2],
                                   [&] { return "sequence " + str(b) + " reads page " + str(page); });
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
  PagedCall r;
  check_pools(q, kv, r);
  r.cu_q = detail::read_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q");
  r.batch = static_cast<std::int64_t>(r.cu_q.size()) - 1;
  check_tables(kv, r);
  detail::check_sequence_options(options, r.batch, q.shape[1]);
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
                        {"k_zero_point", kv.k_zero_point},
                        {"v_zero_point", kv.v_zero_point},
                        {"out", out},
                        {"lse", lse}});
}

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
                               {"v_zero_point", kv.v_zero_point}});
  std::vector<detail::ForwardJob> jobs;
  for (std::int64_t b = 0; b < r.batch; ++b) {
    const std::int64_t q0 = r.cu_q[static_cast<std::size_t>(b)], sq = r.cu_q[static_cast<std::size_t>(b) + 1] - q0;
    detail::ForwardJob job{{},
                           detail::cache_internals(b, r.quantized, kv.k_quant, kv.v_quant),
                           detail::packed_sequence(q, q0, sq),
                           kv.k_cache,
                           kv.v_cache,
                           detail::packed_sequence(out, q0, sq),
                           detail::packed_lse(lse, q0, sq),
                           detail::sequence_options(options, b),
                           {}};
    job.paged.block_table = static_cast<const std::int32_t*>(kv.block_table.data) + b * kv.block_table.strides[0];
    job.paged.table_stride = kv.block_table.strides[1];
    job.paged.page_size = r.page_size;
    if (r.quantized) {
      job.paged.k = detail::kv_scales(k_scales(kv), true, 0, 0);
      job.paged.v = detail::kv_scales(v_scales(kv), true, 0, 0);
    }
    job.problem = AttentionProblem::from_sizes(1, sq, r.keys[static_cast<std::size_t>(b)], q.shape[1],
                                               kv.k_cache.shape[2], q.shape[2], kv.v_cache.shape[3], q.dtype,
                                               job.options);
    detail::check_forward_outputs(job.problem, job.q, job.k, job.v, job.out, job.lse);
    backend.check_forward(job);
    jobs.push_back(job);
  }
  detail::begin_run(options);
  backend.forward_varlen_paged(jobs);
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
