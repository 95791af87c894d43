// The CPU forward driver: plan checked jobs, then run their work items on OpenMP threads.
#include <omp.h>

#include <algorithm>
#include <numeric>
#include <span>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/problem.hpp"
#include "src/core/merge.hpp"
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
      is_decode(plan.kernel) ? p.batch * p.heads_kv : p.batch * p.heads_q / plan.heads_per_item * plan.q_blocks;
  return row_tiles * k_tiles;
}

// Adds the threads' counts to the caller's counters; skipped tiles are the rest of `grid`
// (summed over the jobs that ran in the threads' region).
void add_counters(std::int64_t grid, const cpu::ForwardWorkspaces& workspaces, KernelCounters& counters) {
  KernelCounters sum;
  for (const auto& ws : workspaces.all()) sum += ws->counters;
  sum.tiles_skipped = std::max<std::int64_t>(0, grid - sum.tiles_computed);
  counters += sum;
}

// A job's plan and the split-KV partial results its items write before the merge.
struct PlannedJob {
  CpuForwardPlan plan;
  // Checked allocations (an Error when memory runs out); split_states: the splits' maxima, then their sums.
  hwy::AlignedFreeUniquePtr<float[]> split_out, split_states;
  cpu::DenseMaskSummary mask_blocks;  // attn_mask's, by the micro-tile's strips and panels
  cpu::ForwardParams params;
};

PlannedJob planned_job(const detail::ForwardJob& job, const CpuForwardPlan& plan) {
  PlannedJob pj;
  pj.plan = plan;
  const AttentionProblem& p = job.problem;
  const std::int64_t split_rows = plan.splits > 1 ? plan.splits * p.batch * p.heads_q * p.seqlen_q : 0;
  pj.split_out = cpu::allocate_floats(static_cast<std::size_t>(split_rows * p.head_dim_v));
  pj.split_states = cpu::allocate_floats(static_cast<std::size_t>(2 * split_rows));
  pj.mask_blocks = cpu::DenseMaskSummary(job.options.attn_mask, p.seqlen_q, p.seqlen_k, plan.hardware.micro_rows,
                                         plan.hardware.micro_cols, plan.threads, /*bias_blocks=*/true);
  pj.params = {p, job.internals, plan, job.q, job.k, job.v, job.out, job.lse,
               job.options.alibi_slopes, job.options.block_mask, job.options.sinks, job.options.attn_mask,
               pj.mask_blocks.blocks(), job.options.score_hook, pj.split_out.get(), pj.split_states.get(),
               pj.split_states.get() + split_rows, job.paged, job.lse_sums,
               job.options.rescale_counts, job.options.switches};
  return pj;
}

// The jobs with output rows.
std::vector<detail::ForwardJob> live_jobs(std::span<const detail::ForwardJob> jobs) {
  std::vector<detail::ForwardJob> live;
  for (const detail::ForwardJob& job : jobs)
    if (job.problem.batch > 0 && job.problem.seqlen_q > 0) live.push_back(job);
  return live;
}

// Runs the jobs' work items in one parallel region, job after job in the order given, and
// in the same region merges the split ones, then runs `merges` (which read what the jobs
// wrote). Every thread's workspace holds the buffers of every plan.
void run_region(std::span<const detail::ForwardJob> live, std::span<PlannedJob> planned, const CpuHardware& hw,
                const AttentionOptions& options, std::span<const detail::StateMerge> merges = {}) {
  cpu::ForwardLayout layout(planned[0].plan, live[0].problem);
  for (std::size_t j = 1; j < live.size(); ++j) layout.widen(cpu::ForwardLayout(planned[j].plan, live[j].problem));
  // The items of one (batch, kv head) are consecutive and share its packed K/V (the tiled
  // kernels). A thread that takes single items packs every kv head it touches (with 2
  // threads, each head twice); so the groups that divide evenly among the threads go out
  // whole, each packed once, and only the remaining groups go out item by item, which
  // keeps the threads balanced.
  struct Units {
    std::int64_t whole_groups, group_items;
  };
  std::vector<Units> units;
  std::vector<std::int64_t> ends;  // prefix sums of the jobs' units
  for (std::size_t j = 0; j < live.size(); ++j) {
    const AttentionProblem& p = live[j].problem;
    const CpuForwardPlan& plan = planned[j].plan;
    const std::int64_t groups = is_decode(plan.kernel) ? 0 : p.batch * p.heads_kv;
    const std::int64_t whole_groups = groups / plan.threads * plan.threads;
    const std::int64_t group_items = groups > 0 ? forward_items_per_kv_head(p, plan.schedule()) : 1;
    units.push_back({whole_groups, group_items});
    ends.push_back((ends.empty() ? 0 : ends.back()) + whole_groups + (plan.work_items - whole_groups * group_items));
  }
  const int threads = static_cast<int>(std::clamp<std::int64_t>(ends.back(), 1, hw.threads));
  std::vector<std::int64_t> merge_ends{0};  // prefix sums of the split jobs' merge shares (0 for the others)
  for (std::size_t j = 0; j < live.size(); ++j) {
    const AttentionProblem& p = live[j].problem;
    const std::int64_t rows = p.batch * p.seqlen_q * p.heads_q;
    merge_ends.push_back(merge_ends.back() + (planned[j].plan.splits > 1 ? std::min<std::int64_t>(rows, threads) : 0));
  }
  merge_ends.erase(merge_ends.begin());
  // Workspaces are taken (kept from earlier calls, or allocated) here, before the threads
  // start, so that running out of memory is an exception for the caller rather than a
  // termination inside an OpenMP region.
  cpu::ForwardWorkspaces workspaces(layout, threads);
  std::vector<cpu::ForwardWorkItemFn> kernels;
  for (const PlannedJob& pj : planned) kernels.push_back(cpu::forward_work_item_kernel(pj.plan));
  // The first write to the caller's memory: planning and allocation, which may throw, are done.
  for (const detail::ForwardJob& job : live) zero_rescale_counts(job.options);
#pragma omp parallel num_threads(threads)
  {
    cpu::ForwardWorkspace& workspace = workspaces[static_cast<std::size_t>(omp_get_thread_num())];
    std::size_t packed_for = live.size();  // the job whose K/V the workspace's packed buffers hold
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t unit = 0; unit < ends.back(); ++unit) {
      const auto j = static_cast<std::size_t>(std::upper_bound(ends.begin(), ends.end(), unit) - ends.begin());
      const std::int64_t u = unit - (j > 0 ? ends[j - 1] : 0);
      const Units& g = units[j];
      const cpu::ForwardParams& params = planned[j].params;
      if (j != packed_for) {  // every job is batch element 0 of its own views: what is packed is another's
        workspace.packed = {};
        packed_for = j;
      }
      if (u < g.whole_groups) {
        for (std::int64_t item = u * g.group_items; item < (u + 1) * g.group_items; ++item)
          kernels[j](params, workspace, item);
      } else {
        kernels[j](params, workspace, g.whole_groups * g.group_items + (u - g.whole_groups));
      }
    }
    // Second phase, after the barrier that ends the loop above: the split jobs' merges, each
    // job's rows in as many shares as threads (a row's merge does not depend on the thread
    // count or on which thread runs it), so that a single decode row's merge is not one
    // thread's while the others wait. A phase without work is not entered: its loop's closing
    // barrier would cost a call of a few µs (decode over a short cache) a µs or two. (Every
    // thread takes the same branch: the counts are shared.)
    if (merge_ends.back() > 0) {
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t share = 0; share < merge_ends.back(); ++share) {
        const auto j = static_cast<std::size_t>(std::upper_bound(merge_ends.begin(), merge_ends.end(), share) -
                                                merge_ends.begin());
        const AttentionProblem& p = live[j].problem;
        const CpuForwardPlan& plan = planned[j].plan;
        const std::int64_t shares = merge_ends[j] - (j > 0 ? merge_ends[j - 1] : 0);
        const std::int64_t rows = p.batch * p.seqlen_q * p.heads_q, s = share - (merge_ends[j] - shares);
        const TensorView outs(planned[j].split_out.get(), DType::f32,
                              {plan.splits, p.batch, p.seqlen_q, p.heads_q, p.head_dim_v});
        const TensorView maxes(planned[j].params.split_max, DType::f32, {plan.splits, p.batch, p.heads_q, p.seqlen_q});
        detail::merge_states(outs, maxes, planned[j].params.split_sum, live[j].out, live[j].lse, live[j].lse_sums,
                             rows * s / shares, rows * (s + 1) / shares);
      }
    }
    // Third phase, after the split merges wrote the jobs' outputs: the caller's merges.
    if (!merges.empty()) {
#pragma omp for schedule(dynamic, 1)
      for (std::size_t m = 0; m < merges.size(); ++m)
        detail::merge_states(merges[m].outs, merges[m].maxes, merges[m].sums, merges[m].out, merges[m].lse, nullptr,
                             0, merges[m].outs.shape[1] * merges[m].outs.shape[2] * merges[m].outs.shape[3]);
    }
  }
  if (options.counters != nullptr) {
    std::int64_t grid = 0;
    for (std::size_t j = 0; j < live.size(); ++j) grid += grid_tiles(live[j].problem, planned[j].plan);
    add_counters(grid, workspaces, *options.counters);
  }
}

void record_plans(const AttentionOptions& options, const std::vector<CpuForwardPlan>& plans) {
  if (options.plans_run != nullptr) options.plans_run->forward.insert(options.plans_run->forward.end(), plans.begin(), plans.end());
}

// The cost of a job's longest work item: the (row, key) pairs of its first item (causal Q
// tiles run longest first), every head's for the decode kernel, its heads' under pack_gqa.
std::int64_t longest_item(const detail::ForwardJob& job, const CpuForwardPlan& plan) {
  const ForwardWorkItem w = plan.work_item(job.problem, 0);
  return w.rows * std::max<std::int64_t>(1, w.key_end - w.key_begin) *
         (is_decode(plan.kernel) ? job.problem.heads_q : w.heads);
}

}  // namespace

// Plans and runs the jobs. Jobs that all take the decode kernel (one sequence each of a KV
// cache, one token per sequence) share one parallel region: their items — (sequence, key
// chunk) — go to the threads together, so a batch of short sequences costs one start-up of
// the threads, not one per sequence, and needs fewer key splits — whose partial results go
// to freshly allocated memory, page faults included, before their merge — to keep them
// busy. Other jobs run one after the other, each in its own region.
void cpu::run_forward_jobs(std::span<const detail::ForwardJob> jobs) {
  const std::vector<detail::ForwardJob> live = live_jobs(jobs);
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
  std::vector<PlannedJob> planned;
  for (std::size_t j = 0; j < live.size(); ++j) planned.push_back(planned_job(live[j], plans[j]));
  if (plans_share_region(plans)) {
    run_region(live, planned, hw, options);
  } else {
    for (std::size_t j = 0; j < live.size(); ++j) run_region({&live[j], 1}, {&planned[j], 1}, hw, options);
  }
  record_plans(options, plans);
}

// Every job planned alone (plan_forward_alone), all in one region, the jobs whose longest
// item is longest first: the threads start on the long prefill tiles and key shares and end
// on the short ones, which fill the gaps; the merges at the region's end.
void cpu::run_forward_batch(std::span<const detail::ForwardJob> jobs, std::span<const detail::StateMerge> merges) {
  const std::vector<detail::ForwardJob> live = live_jobs(jobs);
  if (live.empty()) return;
  const AttentionOptions& options = live.front().options;
  const CpuHardware hw = CpuHardware::detect(options.num_threads);
  std::vector<CpuForwardPlan> plans;
  for (const detail::ForwardJob& job : live) plans.push_back(cpu::plan_forward_alone(job.problem, job.internals, hw, job.options));
  std::vector<std::size_t> order(live.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::vector<std::int64_t> cost;
  for (std::size_t j = 0; j < live.size(); ++j) cost.push_back(longest_item(live[j], plans[j]));
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return cost[a] > cost[b]; });
  std::vector<detail::ForwardJob> ordered;
  std::vector<PlannedJob> planned;
  for (std::size_t j : order) {
    ordered.push_back(live[j]);
    planned.push_back(planned_job(live[j], plans[j]));
  }
  run_region(ordered, planned, hw, options, merges);
  record_plans(options, plans);
}

void cpu::check_forward(const detail::ForwardJob& job) {
  cpu::forward_kernel(job.problem, job.internals, CpuHardware::detect(job.options.num_threads), job.options.kernel);
  cpu::pack_gqa_request(job.problem, job.options);  // the planner's refusal, before a caller writes
}

}  // namespace flashattn
