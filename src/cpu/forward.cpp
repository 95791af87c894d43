// CPU forward driver: validate, plan, then run the work items on OpenMP threads.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/problem.hpp"
#include "src/core/validate.hpp"
#include "src/cpu/allocate.hpp"
#include "src/cpu/drivers.hpp"
#include "src/cpu/forward_kernel.hpp"
#include "src/cuda/backend.hpp"

namespace flashattn {
namespace cpu {

namespace {
std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

// Tiles held at once: one, or (decode) one per kv head — Q rows and a block of V rows each.
std::size_t tiles_held(const CpuForwardPlan& plan, const AttentionProblem& p) {
  return static_cast<std::size_t>(plan.kernel == ForwardKernel::decode ? p.heads_kv : 1);
}
}  // namespace

std::size_t forward_workspace_bytes(const CpuForwardPlan& plan, const AttentionProblem& p) {
  const std::size_t bq = static_cast<std::size_t>(plan.block_q) * tiles_held(plan, p);
  const auto bc = static_cast<std::size_t>(plan.block_k);
  const auto d = static_cast<std::size_t>(p.head_dim);
  const auto dv_pad = static_cast<std::size_t>(plan.head_dim_v_padded);
  const std::size_t keys_pad =
      plan.kernel == ForwardKernel::tiled ? round_up(static_cast<std::size_t>(p.seqlen_k), bc) : 0;
  const std::size_t d_pad = round_up(d, 16);
  const std::size_t floats = bq * d_pad + bq * bc + bq * dv_pad + keys_pad * d + keys_pad * dv_pad;
  const std::size_t keys = plan.kernel == ForwardKernel::decode ? bc + kDecodePrefetchKeys : 0;
  const auto strips = static_cast<std::size_t>(plan.block_q / plan.hardware.micro_rows);
  return floats * sizeof(float) + bq * (sizeof(OnlineSoftmaxState) + sizeof(std::int32_t)) + keys * sizeof(DecodeKey) +
         strips * sizeof(StripKeys);
}

ForwardWorkspace::ForwardWorkspace(const CpuForwardPlan& plan, const AttentionProblem& p)
    : states(static_cast<std::size_t>(plan.block_q) * tiles_held(plan, p)),
      rescales(static_cast<std::size_t>(plan.block_q) * tiles_held(plan, p)),
      strip_keys(static_cast<std::size_t>(plan.block_q / plan.hardware.micro_rows)) {
  const std::size_t bq = static_cast<std::size_t>(plan.block_q) * tiles_held(plan, p);
  const auto bc = static_cast<std::size_t>(plan.block_k);
  const auto d = static_cast<std::size_t>(p.head_dim);
  const auto dv_pad = static_cast<std::size_t>(plan.head_dim_v_padded);
  const std::size_t keys_pad =
      plan.kernel == ForwardKernel::tiled ? round_up(static_cast<std::size_t>(p.seqlen_k), bc) : 0;
  const std::size_t d_pad = round_up(d, 16);  // a whole number of vectors on every target
  q_tile = allocate_floats(bq * d_pad);
  if (plan.kernel == ForwardKernel::decode) decode_keys.resize(bc + kDecodePrefetchKeys);
  s_tile = allocate_floats(bq * bc);
  o_acc = allocate_floats(bq * dv_pad);
  k_packed = allocate_floats(keys_pad * d + 1);
  v_packed = allocate_floats(keys_pad * dv_pad + 1);
}

}  // namespace cpu

namespace {

// Zeroes options.rescale_counts (when set): the kernels add each row's count to it.
void zero_rescale_counts(const AttentionOptions& options) {
  const MutableTensorView& c = options.rescale_counts;
  if (c.data == nullptr) return;
  for (std::int64_t b = 0; b < c.shape[0]; ++b)
    for (std::int64_t h = 0; h < c.shape[1]; ++h)
      for (std::int64_t i = 0; i < c.shape[2]; ++i)
        static_cast<std::int32_t*>(c.data)[b * c.strides[0] + h * c.strides[1] + i * c.strides[2]] = 0;
}

// Adds the threads' counts to the caller's counters; skipped tiles are the rest of the
// grid of (Q tile, K/V tile) pairs — (kv head, K/V chunk) pairs for the decode kernel.
void add_counters(const AttentionProblem& p, const CpuForwardPlan& plan,
                  const std::vector<cpu::ForwardWorkspace>& workspaces, KernelCounters& counters) {
  KernelCounters sum;
  for (const cpu::ForwardWorkspace& ws : workspaces) sum += ws.counters;
  const std::int64_t k_tiles = (p.seqlen_k + plan.block_k - 1) / plan.block_k;
  const std::int64_t row_tiles =
      plan.kernel == ForwardKernel::decode ? p.batch * p.heads_kv : p.batch * p.heads_q * plan.q_blocks;
  sum.tiles_skipped = std::max<std::int64_t>(0, row_tiles * k_tiles - sum.tiles_computed);
  counters += sum;
}

// Plans and runs a validated problem; `paged` (when its table is set) maps key j of batch
// element 0 to a page of the k and v pools.
void run_forward(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                 const MutableTensorView& out, const MutableTensorView& lse, const AttentionOptions& options,
                 const cpu::PagedKv& paged) {
  zero_rescale_counts(options);
  if (p.batch == 0 || p.seqlen_q == 0) return;
  const CpuForwardPlan plan = plan_forward(p, CpuHardware::detect(options.num_threads), options.num_splits, options.block_q);
  const std::int64_t split_rows = plan.splits > 1 ? plan.splits * p.batch * p.heads_q * p.seqlen_q : 0;
  std::vector<float> split_out(static_cast<std::size_t>(split_rows * p.head_dim_v));
  std::vector<float> split_lse(static_cast<std::size_t>(split_rows));
  const cpu::ForwardParams params{p, plan, q, k, v, out, lse, options.alibi_slopes, options.block_mask,
                                  split_out.data(), split_lse.data(), paged, options.rescale_counts};
  const cpu::ForwardWorkItemFn kernel = cpu::forward_work_item_kernel(plan.kernel);
  // Workspaces are allocated here, before the threads start, so that running out of memory
  // is an exception for the caller rather than a termination inside an OpenMP region.
  std::vector<cpu::ForwardWorkspace> workspaces;
  workspaces.reserve(static_cast<std::size_t>(plan.threads));
  for (int t = 0; t < plan.threads; ++t) workspaces.emplace_back(plan, p);
  // The items of one (batch, kv head) are consecutive and share its packed K/V. A thread
  // that takes single items packs every kv head it touches (with 2 threads, each head twice);
  // so the groups that divide evenly among the threads go out whole, each packed once, and
  // only the remaining groups go out item by item, which keeps the threads balanced.
  const std::int64_t groups = plan.kernel == ForwardKernel::tiled ? p.batch * p.heads_kv : 0;
  const std::int64_t whole_groups = groups / plan.threads * plan.threads;
  const std::int64_t group_items = groups > 0 ? plan.work_items / groups : 1;
  const std::int64_t units = whole_groups + (plan.work_items - whole_groups * group_items);
#pragma omp parallel num_threads(plan.threads)
  {
    cpu::ForwardWorkspace& workspace = workspaces[static_cast<std::size_t>(omp_get_thread_num())];
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t unit = 0; unit < units; ++unit) {
      if (unit < whole_groups) {
        for (std::int64_t item = unit * group_items; item < (unit + 1) * group_items; ++item)
          kernel(params, workspace, item);
      } else {
        kernel(params, workspace, whole_groups * group_items + (unit - whole_groups));
      }
    }
  }
  if (options.counters != nullptr) add_counters(p, plan, workspaces, *options.counters);
  if (plan.splits > 1)
    merge_attention_states(
        TensorView(split_out.data(), DType::f32, {plan.splits, p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}),
        TensorView(split_lse.data(), DType::f32, {plan.splits, p.batch, p.heads_q, p.seqlen_q}), out, lse, plan.threads);
}

}  // namespace

void detail::forward_impl(const TensorView& q, const TensorView& k, const TensorView& v,
                          const MutableTensorView& out, const MutableTensorView& lse,
                          const AttentionOptions& options, std::int64_t batch_offset) {
  AttentionProblem problem = AttentionProblem::from_inputs(q, k, v, options);
  problem.batch_offset = batch_offset;
  detail::check_forward_outputs(problem, q, k, v, out, lse);
  detail::check_rescale_counts(problem, options, q, k, v, out, lse);
  run_forward(problem, q, k, v, out, lse, options, {});
}

void detail::run_forward_problem(const AttentionProblem& problem, const TensorView& q, const TensorView& k,
                                 const TensorView& v, const MutableTensorView& out, const MutableTensorView& lse,
                                 const AttentionOptions& options) {
  run_forward(problem, q, k, v, out, lse, options, {});
}

void detail::forward_cache(const TensorView& q, const TensorView& k_pool, const TensorView& v_pool,
                           const CacheSource& source, std::int64_t seqlen_k, const MutableTensorView& out,
                           const MutableTensorView& lse, const AttentionOptions& options,
                           std::int64_t batch_offset) {
  AttentionProblem problem = AttentionProblem::from_sizes(q.shape[0], q.shape[1], seqlen_k, q.shape[2], k_pool.shape[2],
                                                          q.shape[3], v_pool.shape[3], q.dtype, options);
  problem.batch_offset = batch_offset;
  detail::check_forward_outputs(problem, q, k_pool, v_pool, out, lse);
  const std::int64_t page_size = source.block_table != nullptr ? k_pool.shape[1] : 0;
  run_forward(problem, q, k_pool, v_pool, out, lse, options,
              {source.block_table, source.table_stride, page_size, source.k_descale, source.v_descale,
               source.descale_page_stride, source.descale_head_stride});
}

void forward(const TensorView& q, const TensorView& k, const TensorView& v,
             const MutableTensorView& out, const MutableTensorView& lse,
             const AttentionOptions& options) {
  const TensorView out_view = out, lse_view = lse;
  if (cuda::common_device({{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out_view}, {"lse", &lse_view}}) == Device::cuda)
    return cuda::forward(q, k, v, out, lse, options);
  detail::forward_impl(q, k, v, out, lse, options, 0);
}

void detail::check_sequence_options(const AttentionOptions& options, std::int64_t batch,
                                    std::int64_t heads_q) {
  const TensorView& a = options.alibi_slopes;
  if (a.rank != 2) return;  // rank 1 (or anything else) is checked per sequence
  check_view("alibi_slopes", a, 2, "(batch, heads_q)");
  check_dtype("alibi_slopes", a, DType::f32, "slopes are float32");
  check_shape("alibi_slopes", a, {batch, heads_q}, "(batch, heads_q)");
}

AttentionOptions detail::sequence_options(const AttentionOptions& options, std::int64_t b) {
  AttentionOptions o = options;
  const TensorView& a = options.alibi_slopes;
  if (a.rank == 2 && a.data != nullptr) {
    o.alibi_slopes.data = static_cast<const float*>(a.data) + b * a.strides[0];
    o.alibi_slopes.rank = 1;
    o.alibi_slopes.shape = {a.shape[1], 0, 0, 0, 0};
    o.alibi_slopes.strides = {a.strides[1], 0, 0, 0, 0};
  }
  return o;
}

ForwardResult forward(const TensorView& q, const TensorView& k, const TensorView& v,
                      const AttentionOptions& options) {
  const AttentionProblem p = AttentionProblem::from_inputs(q, k, v, options);
  ForwardResult result{Tensor(p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}),
                       Tensor(DType::f32, {p.batch, p.heads_q, p.seqlen_q})};
  forward(q, k, v, result.out.view(), result.lse.view(), options);
  return result;
}

std::string cpu_simd_target() { return cpu::kernel_geometry().target; }

}  // namespace flashattn
