// The CPU backward driver: plan a checked job, D = rowsum(dO∘O), then the passes on OpenMP threads.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/error.hpp"
#include "flashattn/online_softmax.hpp"
#include "src/core/element.hpp"
#include "src/cpu/kernels/backward_kernel.hpp"
#include "src/cpu/allocate.hpp"
#include "src/cpu/drivers.hpp"

namespace flashattn {

void cpu::check_backward(const detail::BackwardJob& job) {
  if (job.problem.batch > 0)
    plan_backward(job.problem, CpuHardware::detect(job.options.num_threads), job.options.deterministic,
                  job.options.backward_kernel);
}

namespace {

// The rows whose exp2 offset the large-row pass recomputes (cpu::IsLargeLse2 of the forward's
// lse), found before the threads start: their pass's buffers are allocated only where a call
// has such rows, and its items (up to 8 micro-tiles of rows of one (batch, head)) spread over
// every thread however few heads hold them.
struct LargeRows {
  std::vector<std::int64_t> rows;
  std::vector<cpu::LargeRowItem> items;
};

LargeRows large_rows(const TensorView& lse, const AttentionProblem& p, const CpuBackwardPlan& plan) {
  LargeRows r;
  const auto* data = static_cast<const float*>(lse.data);
  const std::int64_t per_item = std::min<std::int64_t>(8 * plan.hardware.micro_rows, cpu::kLargeRowsPerItem);
  std::vector<std::size_t> starts;  // each item's first row in r.rows, pointed at once r.rows stops growing
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads_q; ++h)
      for (std::int64_t i = 0, in_item = 0; i < p.seqlen_q; ++i) {
        const float lse2 = data[b * lse.strides[0] + h * lse.strides[1] + i * lse.strides[2]] * OnlineSoftmaxState::kLog2e;
        if (!cpu::IsLargeLse2(lse2)) continue;
        if (in_item == 0) {
          r.items.push_back({b * p.heads_q + h, nullptr, 0});
          starts.push_back(r.rows.size());
        }
        r.rows.push_back(i);
        ++r.items.back().count;
        in_item = (in_item + 1) % per_item;
      }
  for (std::size_t k = 0; k < r.items.size(); ++k) r.items[k].rows = r.rows.data() + starts[k];
  return r;
}

}  // namespace

void cpu::run_backward(const detail::BackwardJob& job) {
  const AttentionProblem& p = job.problem;
  const AttentionOptions& options = job.options;
  if (p.batch == 0) return;
  if (p.seqlen_q == 0) {  // no query, no gradient of K or V: zeros, in work bounded by dk and dv, not batch·heads
    for (const MutableTensorView* grad : {&job.dk, &job.dv})
      for (std::int64_t b = 0; b < grad->shape[0] && grad->numel() > 0; ++b)
        for (std::int64_t j = 0; j < grad->shape[1]; ++j)
          for (std::int64_t h = 0; h < grad->shape[2]; ++h)
            for (std::int64_t e = 0; e < grad->shape[3]; ++e)
              detail::store_element(*grad, detail::offset4(*grad, b, j, h, e), 0.0f);
    return;
  }
  const std::int64_t heads = p.batch * p.heads_q;
  CpuBackwardPlan plan =
      plan_backward(p, CpuHardware::detect(options.num_threads), options.deterministic, options.backward_kernel);
  if (!options.switches.reuse_packed_kv && plan.keep_q_rows) {  // measurement: gather Q tiles again
    plan.keep_q_rows = false;
    plan.workspace_bytes_per_thread = cpu::backward_workspace_bytes(plan, p);
  }
  const cpu::BackwardKernels kernels = cpu::backward_kernels(plan.kernel);

  const std::size_t d_pad = static_cast<std::size_t>(plan.head_dim_padded);
  const std::size_t rows = static_cast<std::size_t>(heads * p.seqlen_q);
  auto delta = cpu::allocate_floats(rows + 1);
  auto lse2 = cpu::allocate_floats(rows + 1);
  auto lse2_low = cpu::allocate_floats(rows + 1);
  auto dq_accum = cpu::allocate_floats_written(rows * d_pad + 1);  // zeroed by the D pass
  std::unique_ptr<std::mutex[]> dq_locks;
  std::unique_ptr<std::atomic<std::int64_t>[]> dq_tickets;
  if (plan.deterministic) {
    const std::size_t tiles = static_cast<std::size_t>(heads * plan.q_blocks);
    dq_tickets = std::make_unique<std::atomic<std::int64_t>[]>(tiles);
    for (std::size_t t = 0; t < tiles; ++t) dq_tickets[t].store(0, std::memory_order_relaxed);
  } else {
    dq_locks = std::make_unique<std::mutex[]>(cpu::kDqLockStripes);
  }
  // dbias: items share its elements where it broadcasts over the batch, over the q heads of
  // more than one kv head, or over the keys of more than one K/V block; they add in a fixed
  // order then (in item order when the keys broadcast, else per K/V block).
  const MutableTensorView& dbias = options.dbias;
  const bool dbias_in_item_order = dbias.data != nullptr && dbias.shape[3] == 1 && plan.k_blocks > 1;
  const bool dbias_shared = dbias_in_item_order || (dbias.data != nullptr && ((dbias.shape[0] == 1 && p.batch > 1) ||
                                                                              (dbias.shape[1] == 1 && p.heads_kv > 1)));
  std::unique_ptr<std::atomic<std::int64_t>[]> dbias_tickets;
  if (dbias_shared) {
    const std::int64_t tickets = dbias_in_item_order ? 1 : plan.k_blocks;
    dbias_tickets = std::make_unique<std::atomic<std::int64_t>[]>(static_cast<std::size_t>(tickets));
    for (std::int64_t t = 0; t < tickets; ++t) dbias_tickets[t].store(0, std::memory_order_relaxed);
  }
  const cpu::DenseMaskSummary mask_blocks(options.attn_mask, p.seqlen_q, p.seqlen_k, plan.block_q, plan.block_k,
                                          plan.threads);
  const cpu::BackwardParams params{p, job.internals, plan, job.dout, job.q, job.k, job.v, job.out, job.lse,
                                   job.dq, job.dk, job.dv,
                                   options.alibi_slopes, options.block_mask, options.attn_mask, mask_blocks.blocks(),
                                   options.score_hook, options.sinks, options.dlse,
                                   delta.get(), lse2.get(), lse2_low.get(), dq_accum.get(), dq_locks.get(), dq_tickets.get(),
                                   dbias, dbias_shared, dbias_in_item_order, dbias_tickets.get()};
  // Items are handed out strictly in order (an atomic counter, not an OpenMP schedule):
  // the deterministic mode's tickets rely on K/V block kb − 1 starting before kb.
  std::atomic<std::int64_t> next_item{0};
  // Workspaces are allocated before the threads start: out of memory is an exception for
  // the caller, not a termination inside an OpenMP region.
  std::vector<cpu::BackwardWorkspace> workspaces;
  workspaces.reserve(static_cast<std::size_t>(plan.threads));
  const LargeRows large = large_rows(job.lse, p, plan);
  for (int t = 0; t < plan.threads; ++t) {
    workspaces.emplace_back(plan, p);
    if (dbias_shared) workspaces.back().dbias_tile = cpu::allocate_floats(cpu::DbiasTileShape(plan, p, dbias).size());
    if (!large.items.empty()) workspaces.back().allocate_large_rows(plan);
  }
  const auto large_items = static_cast<std::int64_t>(large.items.size());
  const std::int64_t dbias_rows = dbias.data != nullptr ? dbias.shape[0] * dbias.shape[1] * dbias.shape[2] : 0;
#pragma omp parallel num_threads(plan.threads)
  {
    cpu::BackwardWorkspace& workspace = workspaces[static_cast<std::size_t>(omp_get_thread_num())];
    // dbias zeroed row by row; the delta pass's barrier ends it before any item adds.
#pragma omp for schedule(static) nowait
    for (std::int64_t r = 0; r < dbias_rows; ++r) {
      float* row = static_cast<float*>(dbias.data) + r / (dbias.shape[1] * dbias.shape[2]) * dbias.strides[0] +
                   r / dbias.shape[2] % dbias.shape[1] * dbias.strides[1] + r % dbias.shape[2] * dbias.strides[2];
      for (std::int64_t j = 0; j < dbias.shape[3]; ++j) row[j * dbias.strides[3]] = 0.0f;
    }
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t bh = 0; bh < heads; ++bh) kernels.delta(params, workspace, bh);
    if (large_items > 0) {  // every thread sees the same count
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t item = 0; item < large_items; ++item)
        kernels.large_rows(params, workspace, large.items[static_cast<std::size_t>(item)]);
    }
    for (std::int64_t item = next_item++; item < plan.kv_work_items; item = next_item++)
      kernels.kv_item(params, workspace, item);
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t bh = 0; bh < heads; ++bh) kernels.store_dq(params, workspace, bh);
  }
  if (options.dsinks.data != nullptr) {
    // dsinks_h = −Σ_{b,i} e^{sink_h − lse}·D (docs/algorithm.md "Attention sinks"), one
    // thread in (b, i) order: the same bits for every thread count. A large row's lse as the
    // kernels took it (lse2 + lse2_low, log2 units, against the sink in float32 as they
    // scale it). Added to what the caller zeroed (src/cpu/backend.cpp): the sequences of
    // backward_varlen add up.
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      const float sink = static_cast<const float*>(options.sinks.data)[h * options.sinks.strides[0]];
      double sum = 0.0;
      for (std::int64_t b = 0; b < p.batch; ++b)
        for (std::int64_t i = 0; i < p.seqlen_q; ++i) {
          const std::size_t row = static_cast<std::size_t>((b * p.heads_q + h) * p.seqlen_q + i);
          const float lse = static_cast<const float*>(job.lse.data)[b * job.lse.strides[0] + h * job.lse.strides[1] +
                                                                    i * job.lse.strides[2]];
          // A row given lse −∞ sees nothing, as the kernels take it (a forward with sinks
          // never returns it): no share of the sink either.
          if (lse == -std::numeric_limits<float>::infinity()) continue;
          const double e = cpu::IsLargeLse2(lse * OnlineSoftmaxState::kLog2e)
                               ? std::exp2((static_cast<double>(sink * OnlineSoftmaxState::kLog2e) - lse2[row]) -
                                           lse2_low[row])
                               : std::exp(static_cast<double>(sink) - lse);
          sum += e * delta[row];
        }
      static_cast<float*>(options.dsinks.data)[h * options.dsinks.strides[0]] -= static_cast<float>(sum);
    }
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
