// CPU forward driver: validate, plan, then run the work items on OpenMP threads.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/problem.hpp"
#include "src/core/validate.hpp"
#include "src/cpu/allocate.hpp"
#include "src/cpu/drivers.hpp"
#include "src/cpu/kernels/forward_kernel.hpp"
#include "src/cuda/backend.hpp"

namespace flashattn {

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

// The grid of (Q tile, K/V tile) pairs — (kv head, K/V chunk) pairs for the decode kernel —
// that a problem's tiles are computed or skipped from.
std::int64_t grid_tiles(const AttentionProblem& p, const CpuForwardPlan& plan) {
  const std::int64_t k_tiles = (p.seqlen_k + plan.block_k - 1) / plan.block_k;
  const std::int64_t row_tiles =
      is_decode(plan.kernel) ? p.batch * p.heads_kv : p.batch * p.heads_q * plan.q_blocks;
  return row_tiles * k_tiles;
}

// Adds the threads' counts to the caller's counters; skipped tiles are the rest of `grid`
// (summed over the jobs that ran in the threads' region).
void add_counters(std::int64_t grid, const std::vector<cpu::ForwardWorkspace>& workspaces, KernelCounters& counters) {
  KernelCounters sum;
  for (const cpu::ForwardWorkspace& ws : workspaces) sum += ws.counters;
  sum.tiles_skipped = std::max<std::int64_t>(0, grid - sum.tiles_computed);
  counters += sum;
}

// One validated problem and what its work items read and write; `paged` (when its table is
// set) maps key j of batch element 0 to a page of the k and v pools.
struct ForwardJob {
  AttentionProblem problem;
  TensorView q, k, v;
  MutableTensorView out, lse;
  AttentionOptions options;
  cpu::PagedKv paged;
};

// A job's plan and the split-KV partial results its items write before the merge.
struct PlannedJob {
  CpuForwardPlan plan;
  hwy::AlignedFreeUniquePtr<float[]> split_out, split_lse;  // checked allocations: an Error when memory runs out
  cpu::ForwardParams params;
};

// Plans and runs the jobs. Jobs that all take the decode kernel (one sequence each of a KV
// cache, one token per sequence) share one parallel region: their items — (sequence, key
// chunk) — go to the threads together, so a batch of short sequences costs one start-up of
// the threads, not one per sequence, and needs fewer key splits — whose partial results go
// to freshly allocated memory, page faults included, before their merge — to keep them
// busy. Other jobs run one after the other, each in its own region.
void run_forward_jobs(const std::vector<ForwardJob>& jobs) {
  std::vector<ForwardJob> live;  // jobs with output rows
  for (const ForwardJob& job : jobs)
    if (job.problem.batch > 0 && job.problem.seqlen_q > 0) live.push_back(job);
  if (live.empty()) return;  // no rows: no rescale counts either
  const AttentionOptions& options = live.front().options;  // the call's: threads, splits, counters
  const CpuHardware hw = CpuHardware::detect(options.num_threads);
  std::vector<PlannedJob> planned(live.size());
  for (std::size_t j = 0; j < live.size(); ++j)
    planned[j].plan = plan_forward(live[j].problem, hw, live[j].options);
  const bool shared = live.size() > 1 && std::all_of(planned.begin(), planned.end(), [](const PlannedJob& j) {
                        return is_decode(j.plan.kernel);
                      });
  // Split keys only as far as the sequences leave threads idle.
  if (shared && options.num_splits == 0 && options.switches.q_tile_parallelism) {
    const auto sequences = static_cast<std::int64_t>(live.size());
    const auto splits = static_cast<int>((2 * hw.threads + sequences - 1) / sequences);
    for (std::size_t j = 0; j < live.size(); ++j)
      planned[j].plan = plan_forward(live[j].problem, hw, splits, live[j].options.block_q, live[j].options.kernel);
  }
  for (std::size_t j = 0; j < live.size(); ++j) {
    const ForwardJob& job = live[j];
    const AttentionProblem& p = job.problem;
    PlannedJob& pj = planned[j];
    const std::int64_t split_rows = pj.plan.splits > 1 ? pj.plan.splits * p.batch * p.heads_q * p.seqlen_q : 0;
    pj.split_out = cpu::allocate_floats(static_cast<std::size_t>(split_rows * p.head_dim_v));
    pj.split_lse = cpu::allocate_floats(static_cast<std::size_t>(split_rows));
    pj.params = {p, pj.plan, job.q, job.k, job.v, job.out, job.lse, job.options.alibi_slopes, job.options.block_mask,
                 pj.split_out.get(), pj.split_lse.get(), job.paged, job.options.rescale_counts,
                 job.options.switches};
  }

  // Runs jobs [first, last) in one region: the threads' workspaces fit the largest plan.
  auto run = [&](std::size_t first, std::size_t last) {
    std::size_t widest = first;
    for (std::size_t j = first; j < last; ++j)
      if (planned[j].plan.workspace_bytes_per_thread > planned[widest].plan.workspace_bytes_per_thread) widest = j;
    // The items of one (batch, kv head) are consecutive and share its packed K/V (tiled
    // kernel). A thread that takes single items packs every kv head it touches (with 2
    // threads, each head twice); so the groups that divide evenly among the threads go out
    // whole, each packed once, and only the remaining groups go out item by item, which
    // keeps the threads balanced.
    struct Units {
      std::int64_t whole_groups, group_items;
    };
    std::vector<Units> units;
    std::vector<std::int64_t> ends;  // prefix sums of the jobs' units
    for (std::size_t j = first; j < last; ++j) {
      const AttentionProblem& p = live[j].problem;
      const CpuForwardPlan& plan = planned[j].plan;
      const std::int64_t groups = plan.kernel == ForwardKernel::tiled ? p.batch * p.heads_kv : 0;
      const std::int64_t whole_groups = groups / plan.threads * plan.threads;
      const std::int64_t group_items = groups > 0 ? plan.work_items / groups : 1;
      units.push_back({whole_groups, group_items});
      ends.push_back((ends.empty() ? 0 : ends.back()) + whole_groups + (plan.work_items - whole_groups * group_items));
    }
    const int threads = static_cast<int>(std::clamp<std::int64_t>(ends.back(), 1, hw.threads));
    // Workspaces are allocated here, before the threads start, so that running out of memory
    // is an exception for the caller rather than a termination inside an OpenMP region.
    std::vector<cpu::ForwardWorkspace> workspaces;
    workspaces.reserve(static_cast<std::size_t>(threads));
    for (int t = 0; t < threads; ++t) workspaces.emplace_back(planned[widest].plan, live[widest].problem);
    std::vector<cpu::ForwardWorkItemFn> kernels;
    for (std::size_t j = first; j < last; ++j) kernels.push_back(cpu::forward_work_item_kernel(planned[j].plan.kernel));
    // The first write to the caller's memory: planning and allocation, which may throw, are done.
    for (std::size_t j = first; j < last; ++j) zero_rescale_counts(live[j].options);
#pragma omp parallel num_threads(threads)
    {
      cpu::ForwardWorkspace& workspace = workspaces[static_cast<std::size_t>(omp_get_thread_num())];
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t unit = 0; unit < ends.back(); ++unit) {
        const auto j = static_cast<std::size_t>(std::upper_bound(ends.begin(), ends.end(), unit) - ends.begin());
        const std::int64_t u = unit - (j > 0 ? ends[j - 1] : 0);
        const Units& g = units[j];
        const cpu::ForwardParams& params = planned[first + j].params;
        if (u < g.whole_groups) {
          for (std::int64_t item = u * g.group_items; item < (u + 1) * g.group_items; ++item)
            kernels[j](params, workspace, item);
        } else {
          kernels[j](params, workspace, g.whole_groups * g.group_items + (u - g.whole_groups));
        }
      }
    }
    if (options.counters != nullptr) {
      std::int64_t grid = 0;
      for (std::size_t j = first; j < last; ++j) grid += grid_tiles(live[j].problem, planned[j].plan);
      add_counters(grid, workspaces, *options.counters);
    }
    for (std::size_t j = first; j < last; ++j) {
      const AttentionProblem& p = live[j].problem;
      const CpuForwardPlan& plan = planned[j].plan;
      if (plan.splits > 1)
        merge_attention_states(
            TensorView(planned[j].split_out.get(), DType::f32, {plan.splits, p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}),
            TensorView(planned[j].split_lse.get(), DType::f32, {plan.splits, p.batch, p.heads_q, p.seqlen_q}),
            live[j].out, live[j].lse, plan.threads);
    }
  };
  if (shared) {
    run(0, live.size());
  } else {
    for (std::size_t j = 0; j < live.size(); ++j) run(j, j + 1);
  }
}

void run_forward(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                 const MutableTensorView& out, const MutableTensorView& lse, const AttentionOptions& options,
                 const cpu::PagedKv& paged) {
  run_forward_jobs({{p, q, k, v, out, lse, options, paged}});
}

}  // namespace

AttentionProblem detail::validate_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                          const TensorView& out, const TensorView& lse,
                                          const AttentionOptions& options, std::int64_t batch_offset) {
  AttentionProblem problem = AttentionProblem::from_inputs(q, k, v, options);
  problem.batch_offset = batch_offset;
  detail::check_forward_outputs(problem, q, k, v, out, lse);
  detail::check_rescale_counts(problem, options, q, k, v, out, lse);
  plan_forward(problem, CpuHardware::detect(options.num_threads), options);
  return problem;
}

void detail::forward_impl(const TensorView& q, const TensorView& k, const TensorView& v,
                          const MutableTensorView& out, const MutableTensorView& lse,
                          const AttentionOptions& options, std::int64_t batch_offset) {
  run_forward(validate_forward(q, k, v, out, lse, options, batch_offset), q, k, v, out, lse, options, {});
}

void detail::run_forward_problem(const AttentionProblem& problem, const TensorView& q, const TensorView& k,
                                 const TensorView& v, const MutableTensorView& out, const MutableTensorView& lse,
                                 const AttentionOptions& options) {
  run_forward(problem, q, k, v, out, lse, options, {});
}

namespace {
AttentionProblem cache_problem(const detail::CacheSequence& c) {
  AttentionProblem problem =
      AttentionProblem::from_sizes(c.q.shape[0], c.q.shape[1], c.seqlen_k, c.q.shape[2], c.k_pool.shape[2],
                                   c.q.shape[3], c.v_pool.shape[3], c.q.dtype, c.options);
  problem.batch_offset = c.batch_offset;
  problem.kv_dtype = c.k_pool.dtype;  // u8 for an FP8 cache
  detail::check_forward_outputs(problem, c.q, c.k_pool, c.v_pool, c.out, c.lse);
  return problem;
}
}  // namespace

void detail::validate_cache_sequence(const CacheSequence& c) {
  const AttentionProblem problem = cache_problem(c);
  plan_forward(problem, CpuHardware::detect(c.options.num_threads), c.options);
}

void detail::forward_cache(const std::vector<CacheSequence>& sequences) {
  std::vector<ForwardJob> jobs;
  for (const CacheSequence& c : sequences) {
    const AttentionProblem problem = cache_problem(c);
    const CacheSource& source = c.source;
    const std::int64_t page_size = source.block_table != nullptr ? c.k_pool.shape[1] : 0;
    jobs.push_back({problem, c.q, c.k_pool, c.v_pool, c.out, c.lse, c.options,
                    {source.block_table, source.table_stride, page_size, source.k_descale, source.v_descale,
                     source.descale_page_stride, source.descale_head_stride}});
  }
  run_forward_jobs(jobs);
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
