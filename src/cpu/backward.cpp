// The CPU backward driver: plan a checked job, D = rowsum(dO∘O), then the passes on OpenMP threads.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/error.hpp"
#include "src/cpu/kernels/backward_kernel.hpp"
#include "src/cpu/allocate.hpp"
#include "src/cpu/drivers.hpp"

namespace flashattn {
namespace cpu {

namespace {
std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

// Buffer sizes of one workspace: the float32 kernel's packed K/V are float32, tiled_bf16's
// bf16 (and its per-tile operands come on top of the float32 tiles both kernels use).
struct BackwardSizes {
  std::size_t bq, bc, d, dv, d_pad, dv_pad, keys_pad;
  bool bf16;
  BackwardSizes(const CpuBackwardPlan& plan, const AttentionProblem& p)
      : bq(static_cast<std::size_t>(plan.block_q)), bc(static_cast<std::size_t>(plan.block_k)),
        d(static_cast<std::size_t>(p.head_dim)), dv(static_cast<std::size_t>(p.head_dim_v)),
        d_pad(static_cast<std::size_t>(plan.head_dim_padded)),
        dv_pad(static_cast<std::size_t>(plan.head_dim_v_padded)),
        keys_pad(round_up(static_cast<std::size_t>(p.seqlen_k), bc)), bf16(plan.kernel == BackwardKernel::tiled_bf16) {}
  std::size_t floats() const {
    return bq * (d_pad + dv_pad + 4 * bc + d_pad) + bc * (d_pad + dv_pad) +
           (bf16 ? 0 : keys_pad * (d + dv + d_pad)) + std::max(d_pad, dv_pad);
  }
  std::size_t bf16_elements() const {
    return bf16 ? 2 * bq * (d_pad + dv_pad) + bq * std::max(d_pad, dv_pad) + 3 * bq * bc +
                      keys_pad * (round_up(d, 2) + round_up(dv, 2) + d_pad)
                : 0;
  }
};
}  // namespace

std::size_t backward_workspace_bytes(const CpuBackwardPlan& plan, const AttentionProblem& p) {
  const BackwardSizes s(plan, p);
  return s.floats() * sizeof(float) + s.bf16_elements() * sizeof(std::uint16_t) + s.bq * 2 * sizeof(float);
}

BackwardWorkspace::BackwardWorkspace(const CpuBackwardPlan& plan, const AttentionProblem& p)
    : row_lse2(static_cast<std::size_t>(plan.block_q)),
      row_delta(static_cast<std::size_t>(plan.block_q)) {
  const BackwardSizes s(plan, p);
  q_tile = allocate_floats(s.bq * s.d_pad);
  do_tile = allocate_floats(s.bq * s.dv_pad);
  p_tile = allocate_floats(s.bq * s.bc);
  ds_tile = allocate_floats(s.bq * s.bc);
  g_tile = allocate_floats(s.bq * s.bc);
  w_tile = allocate_floats(s.bq * s.bc);
  dq_tile = allocate_floats(s.bq * s.d_pad);
  dk_acc = allocate_floats(s.bc * s.d_pad);
  dv_acc = allocate_floats(s.bc * s.dv_pad);
  row_scratch = allocate_floats(std::max(s.d_pad, s.dv_pad));
  if (!s.bf16) {
    kt_packed = allocate_floats(s.keys_pad * s.d + 1);
    vt_packed = allocate_floats(s.keys_pad * s.dv + 1);
    k_packed = allocate_floats(s.keys_pad * s.d_pad + 1);
    return;
  }
  q_bf16 = allocate_array<std::uint16_t>(s.bq * s.d_pad);
  do_bf16 = allocate_array<std::uint16_t>(s.bq * s.dv_pad);
  qt_bf16 = allocate_array<std::uint16_t>(s.bq * s.d_pad);
  dot_bf16 = allocate_array<std::uint16_t>(s.bq * s.dv_pad);
  pair_scratch = allocate_array<std::uint16_t>(s.bq * std::max(s.d_pad, s.dv_pad));
  pt_bf16 = allocate_array<std::uint16_t>(s.bq * s.bc);
  dst_bf16 = allocate_array<std::uint16_t>(s.bq * s.bc);
  ds_bf16 = allocate_array<std::uint16_t>(s.bq * s.bc);
  kt_pairs = allocate_array<std::uint16_t>(s.keys_pad * round_up(s.d, 2));
  vt_pairs = allocate_array<std::uint16_t>(s.keys_pad * round_up(s.dv, 2));
  k_pairs = allocate_array<std::uint16_t>(s.keys_pad * s.d_pad);
}

}  // namespace cpu

void cpu::check_backward(const detail::BackwardJob& job) {
  if (job.problem.batch > 0)
    plan_backward(job.problem, CpuHardware::detect(job.options.num_threads), job.options.deterministic,
                  job.options.backward_kernel);
}

void cpu::run_backward(const detail::BackwardJob& job) {
  const AttentionProblem& p = job.problem;
  const AttentionOptions& options = job.options;
  if (p.batch == 0) return;
  const std::int64_t heads = p.batch * p.heads_q;
  const CpuBackwardPlan plan =
      plan_backward(p, CpuHardware::detect(options.num_threads), options.deterministic, options.backward_kernel);
  const cpu::BackwardKernels kernels = cpu::backward_kernels(plan.kernel);

  const std::size_t d_pad = static_cast<std::size_t>(plan.head_dim_padded);
  const std::size_t rows = static_cast<std::size_t>(heads * p.seqlen_q);
  auto delta = cpu::allocate_floats(rows + 1);
  auto dq_accum = cpu::allocate_floats(rows * d_pad + 1);
  std::fill(dq_accum.get(), dq_accum.get() + rows * d_pad, 0.0f);
  std::unique_ptr<std::mutex[]> dq_locks;
  std::unique_ptr<std::atomic<std::int64_t>[]> dq_tickets;
  if (plan.deterministic) {
    const std::size_t tiles = static_cast<std::size_t>(heads * plan.q_blocks);
    dq_tickets = std::make_unique<std::atomic<std::int64_t>[]>(tiles);
    for (std::size_t t = 0; t < tiles; ++t) dq_tickets[t].store(0, std::memory_order_relaxed);
  } else {
    dq_locks = std::make_unique<std::mutex[]>(cpu::kDqLockStripes);
  }
  const cpu::BackwardParams params{p, job.internals, plan, job.dout, job.q, job.k, job.v, job.out, job.lse,
                                   job.dq, job.dk, job.dv,
                                   options.alibi_slopes, options.block_mask,
                                   delta.get(), dq_accum.get(), dq_locks.get(), dq_tickets.get()};
  // Items are handed out strictly in order (an atomic counter, not an OpenMP schedule):
  // the deterministic mode's tickets rely on K/V block kb − 1 starting before kb.
  std::atomic<std::int64_t> next_item{0};
  // Workspaces are allocated before the threads start: out of memory is an exception for
  // the caller, not a termination inside an OpenMP region.
  std::vector<cpu::BackwardWorkspace> workspaces;
  workspaces.reserve(static_cast<std::size_t>(plan.threads));
  for (int t = 0; t < plan.threads; ++t) workspaces.emplace_back(plan, p);
#pragma omp parallel num_threads(plan.threads)
  {
    cpu::BackwardWorkspace& workspace = workspaces[static_cast<std::size_t>(omp_get_thread_num())];
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t bh = 0; bh < heads; ++bh) kernels.delta(params, workspace, bh);
    for (std::int64_t item = next_item++; item < plan.kv_work_items; item = next_item++)
      kernels.kv_item(params, workspace, item);
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t bh = 0; bh < heads; ++bh) kernels.store_dq(params, workspace, bh);
  }
  if (options.counters != nullptr) {
    KernelCounters sum;
    for (const cpu::BackwardWorkspace& ws : workspaces) sum += ws.counters;
    sum.tiles_skipped = heads * plan.q_blocks * plan.k_blocks - sum.tiles_computed;
    *options.counters += sum;
  }
  if (options.plans_run != nullptr) options.plans_run->backward.push_back(plan);
}

}  // namespace flashattn
