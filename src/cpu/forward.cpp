// The CPU forward driver: plan checked jobs, then run their work items on OpenMP threads.
#include <omp.h>

#include <algorithm>
#include <span>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/problem.hpp"
#include "src/cpu/allocate.hpp"
#include "src/cpu/drivers.hpp"
#include "src/cpu/kernels/forward_kernel.hpp"
#include "src/cpu/planner.hpp"

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

// A job's plan and the split-KV partial results its items write before the merge.
struct PlannedJob {
  CpuForwardPlan plan;
  hwy::AlignedFreeUniquePtr<float[]> split_out, split_lse;  // checked allocations: an Error when memory runs out
  cpu::ForwardParams params;
};

}  // namespace

// Plans and runs the jobs. Jobs that all take the decode kernel (one sequence each of a KV
// cache, one token per sequence) share one parallel region: their items — (sequence, key
// chunk) — go to the threads together, so a batch of short sequences costs one start-up of
// the threads, not one per sequence, and needs fewer key splits — whose partial results go
// to freshly allocated memory, page faults included, before their merge — to keep them
// busy. Other jobs run one after the other, each in its own region.
void cpu::run_forward_jobs(std::span<const detail::ForwardJob> jobs) {
  std::vector<detail::ForwardJob> live;  // jobs with output rows
  for (const detail::ForwardJob& job : jobs)
    if (job.problem.batch > 0 && job.problem.seqlen_q > 0) live.push_back(job);
  if (live.empty()) return;  // no rows: no rescale counts either
  const AttentionOptions& options = live.front().options;  // the call's: threads, splits, counters
  const CpuHardware hw = CpuHardware::detect(options.num_threads);
  std::vector<AttentionProblem> problems;
  std::vector<detail::ProblemInternals> internals;
  for (const detail::ForwardJob& job : live) {
    problems.push_back(job.problem);
    internals.push_back(job.internals);
  }
  const std::vector<CpuForwardPlan> plans = cpu::plan_forward_together(problems, internals, hw, options);
  const bool shared = plans_share_region(plans);
  std::vector<PlannedJob> planned(live.size());
  for (std::size_t j = 0; j < live.size(); ++j) {
    planned[j].plan = plans[j];
    const detail::ForwardJob& job = live[j];
    const AttentionProblem& p = job.problem;
    PlannedJob& pj = planned[j];
    const std::int64_t split_rows = pj.plan.splits > 1 ? pj.plan.splits * p.batch * p.heads_q * p.seqlen_q : 0;
    pj.split_out = cpu::allocate_floats(static_cast<std::size_t>(split_rows * p.head_dim_v));
    pj.split_lse = cpu::allocate_floats(static_cast<std::size_t>(split_rows));
    pj.params = {p, job.internals, pj.plan, job.q, job.k, job.v, job.out, job.lse,
                 job.options.alibi_slopes, job.options.block_mask, job.options.sinks,
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
      const std::int64_t group_items = groups > 0 ? forward_items_per_kv_head(p, plan.schedule()) : 1;
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
  if (options.plans_run != nullptr) options.plans_run->forward.insert(options.plans_run->forward.end(), plans.begin(), plans.end());
}

void cpu::check_forward(const detail::ForwardJob& job) {
  cpu::plan_forward(job.problem, job.internals, CpuHardware::detect(job.options.num_threads), job.options);
}

}  // namespace flashattn
