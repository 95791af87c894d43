// The CPU forward driver: plan checked jobs, then run their work items on OpenMP threads.
#include <omp.h>

#include <algorithm>
#include <span>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/problem.hpp"
#include "src/cpu/allocate.hpp"
#include "src/cpu/drivers.hpp"
#include "src/cpu/forward_kernel.hpp"

namespace flashattn {
namespace cpu {

namespace {
std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

// Tiles held at once: one, or (decode) one per kv head — Q rows and a block of V rows each.
std::size_t tiles_held(const CpuForwardPlan& plan, const AttentionProblem& p) {
  return static_cast<std::size_t>(is_decode(plan.kernel) ? p.heads_kv : 1);
}
}  // namespace

// Elements of each workspace buffer for a plan: forward_workspace_bytes and the workspace's
// constructor read the same sizes.
struct WorkspaceSizes {
  std::size_t q_floats, s_floats, o_floats, k_floats, v_floats;  // float32
  std::size_t q_bf16, p_bf16, k_pairs, v_pairs;                  // bf16 (tiled_bf16)
};

WorkspaceSizes workspace_sizes(const CpuForwardPlan& plan, const AttentionProblem& p) {
  const std::size_t bq = static_cast<std::size_t>(plan.block_q) * tiles_held(plan, p);
  const auto bc = static_cast<std::size_t>(plan.block_k);
  const auto d = static_cast<std::size_t>(p.head_dim);
  const auto dv_pad = static_cast<std::size_t>(plan.head_dim_v_padded);
  const bool decode = is_decode(plan.kernel), bf16 = plan.kernel == ForwardKernel::tiled_bf16;
  const std::size_t keys_pad = decode ? 0 : round_up(static_cast<std::size_t>(p.seqlen_k), bc);
  const std::size_t d_pad = round_up(d, 32);  // a whole number of pairs of vectors on every target
  const std::size_t d_even = round_up(d, 2);  // whole bf16 pairs
  WorkspaceSizes s{};
  // decode: a row loaded besides the panels; decode_fp16: four, the rows' units and the kv
  // heads' (DecodeItem's layout).
  s.q_floats = bf16 ? 0 : decode ? (bq + 4) * d_pad + 2 * bq : bq * d_pad;
  s.s_floats = bq * bc;
  s.o_floats = bq * dv_pad + (decode ? bc : 0);
  s.k_floats = bf16 ? 0 : keys_pad * d;
  s.v_floats = bf16 ? 0 : keys_pad * dv_pad;
  if (bf16) {
    s.q_bf16 = bq * d_even;
    s.p_bf16 = bq * bc;
    s.k_pairs = keys_pad * d_even;
    s.v_pairs = keys_pad * dv_pad;
  }
  return s;
}

std::size_t forward_workspace_bytes(const CpuForwardPlan& plan, const AttentionProblem& p) {
  const std::size_t bq = static_cast<std::size_t>(plan.block_q) * tiles_held(plan, p);
  const auto bc = static_cast<std::size_t>(plan.block_k);
  const WorkspaceSizes w = workspace_sizes(plan, p);
  const std::size_t floats = w.q_floats + w.s_floats + w.o_floats + w.k_floats + w.v_floats;
  const std::size_t halves = w.q_bf16 + w.p_bf16 + w.k_pairs + w.v_pairs;
  const std::size_t keys = is_decode(plan.kernel) ? bc + kDecodePrefetchKeys : 0;
  const auto strips = static_cast<std::size_t>(plan.block_q / plan.hardware.micro_rows);
  return floats * sizeof(float) + halves * sizeof(std::uint16_t) + bq * (sizeof(OnlineSoftmaxState) + sizeof(std::int32_t)) +
         keys * DecodeKeys::kBytesPerKey + strips * sizeof(StripKeys);
}

ForwardWorkspace::ForwardWorkspace(const CpuForwardPlan& plan, const AttentionProblem& p)
    : states(static_cast<std::size_t>(plan.block_q) * tiles_held(plan, p)),
      rescales(static_cast<std::size_t>(plan.block_q) * tiles_held(plan, p)),
      strip_keys(static_cast<std::size_t>(plan.block_q / plan.hardware.micro_rows)) {
  const WorkspaceSizes w = workspace_sizes(plan, p);
  q_tile = allocate_floats(w.q_floats);
  if (is_decode(plan.kernel)) decode_keys.resize(static_cast<std::size_t>(plan.block_k + kDecodePrefetchKeys));
  s_tile = allocate_floats(w.s_floats);
  o_acc = allocate_floats(w.o_floats);
  k_packed = allocate_floats(w.k_floats + 1);
  v_packed = allocate_floats(w.v_floats + 1);
  if (plan.kernel == ForwardKernel::tiled_bf16) {
    q_bf16 = allocate_array<std::uint16_t>(w.q_bf16);
    p_bf16 = allocate_array<std::uint16_t>(w.p_bf16);
    k_pairs = allocate_array<std::uint16_t>(w.k_pairs);
    v_pairs = allocate_array<std::uint16_t>(w.v_pairs);
  }
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
  for (const detail::ForwardJob& job : live) problems.push_back(job.problem);
  const std::vector<CpuForwardPlan> plans = plan_forward_together(problems, hw, options);
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
  if (options.plans_run != nullptr) options.plans_run->forward.insert(options.plans_run->forward.end(), plans.begin(), plans.end());
}

void cpu::check_forward(const detail::ForwardJob& job) {
  plan_forward(job.problem, CpuHardware::detect(job.options.num_threads), job.options);
}

}  // namespace flashattn
