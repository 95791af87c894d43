// CPU backward driver: validate, plan, D = rowsum(dO∘O), then the passes on OpenMP threads.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/error.hpp"
#include "src/core/validate.hpp"
#include "src/cpu/kernels/backward_kernel.hpp"
#include "src/cpu/allocate.hpp"
#include "src/cpu/drivers.hpp"
#include "src/cuda/backend.hpp"

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

namespace {

void check_backward_args(const AttentionProblem& p, const TensorView& dout, const TensorView& q,
                         const TensorView& k, const TensorView& v, const TensorView& out,
                         const TensorView& lse, const TensorView& dq, const TensorView& dk,
                         const TensorView& dv) {
  using namespace detail;
  constexpr const char* kOutLayout = "(batch, seqlen_q, heads_q, head_dim_v)";
  check_view("dout", dout, 4, kOutLayout);
  check_dtype("dout", dout, q.dtype, "dout must have q's dtype");
  check_shape("dout", dout, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}, kOutLayout);
  check_view("out", out, 4, kOutLayout);
  check_dtype("out", out, q.dtype, "out must have q's dtype");
  check_shape("out", out, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}, kOutLayout);
  check_view("lse", lse, 3, "(batch, heads_q, seqlen_q)");
  check_dtype("lse", lse, DType::f32, "lse is always float32");
  check_shape("lse", lse, {p.batch, p.heads_q, p.seqlen_q}, "(batch, heads_q, seqlen_q)");
  const std::pair<const char*, const TensorView*> grads[] = {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}};
  const std::pair<const char*, const TensorView*> like[] = {{"q", &q}, {"k", &k}, {"v", &v}};
  for (int g = 0; g < 3; ++g) {
    const auto& [name, grad] = grads[g];
    const TensorView& ref = *like[g].second;
    check_view(name, *grad, 4, "(like its input)");
    check_dtype(name, *grad, ref.dtype, "gradients have their input's dtype");
    check_shape(name, *grad, {ref.shape[0], ref.shape[1], ref.shape[2], ref.shape[3]},
                "(the shape of its input)");
    check_output_layout(name, *grad);
    for (const auto& [in_name, input] : {std::pair{"dout", dout}, {"q", q}, {"k", k}, {"v", v},
                                         {"out", out}, {"lse", lse}})
      check_no_overlap(name, *grad, in_name, input);
    for (int o = 0; o < g; ++o) check_no_overlap(name, *grad, grads[o].first, *grads[o].second);
  }
}

}  // namespace

AttentionProblem detail::validate_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                           const TensorView& v, const TensorView& out, const TensorView& lse,
                                           const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                           const AttentionOptions& options, std::int64_t batch_offset) {
  detail::reject_rescale_counts("backward", options);
  AttentionProblem problem = AttentionProblem::from_inputs(q, k, v, options);
  problem.batch_offset = batch_offset;
  check_backward_args(problem, dout, q, k, v, out, lse, dq, dk, dv);
  if (problem.batch > 0)
    plan_backward(problem, CpuHardware::detect(options.num_threads), options.deterministic, options.backward_kernel);
  return problem;
}

void detail::backward_impl(const TensorView& dout, const TensorView& q, const TensorView& k,
                           const TensorView& v, const TensorView& out, const TensorView& lse,
                           const MutableTensorView& dq, const MutableTensorView& dk,
                           const MutableTensorView& dv, const AttentionOptions& options,
                           std::int64_t batch_offset) {
  const AttentionProblem p = validate_backward(dout, q, k, v, out, lse, dq, dk, dv, options, batch_offset);
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
  const cpu::BackwardParams params{p,      plan, dout, q,  k,  v,  out, lse, dq, dk, dv,
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
}

void backward(const TensorView& dout, const TensorView& q, const TensorView& k,
              const TensorView& v, const TensorView& out, const TensorView& lse,
              const MutableTensorView& dq, const MutableTensorView& dk, const MutableTensorView& dv,
              const AttentionOptions& options) {
  const TensorView dq_view = dq, dk_view = dk, dv_view = dv;
  if (cuda::common_device({{"dout", &dout}, {"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse},
                           {"dq", &dq_view}, {"dk", &dk_view}, {"dv", &dv_view}}) == Device::cuda)
    return cuda::backward(dout, q, k, v, out, lse, dq, dk, dv, options);
  detail::backward_impl(dout, q, k, v, out, lse, dq, dk, dv, options, 0);
}

BackwardResult backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& out, const TensorView& lse,
                        const AttentionOptions& options) {
  const AttentionProblem p = AttentionProblem::from_inputs(q, k, v, options);
  BackwardResult r{Tensor(p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim}),
                   Tensor(p.dtype, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim}),
                   Tensor(p.dtype, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim_v})};
  backward(dout, q, k, v, out, lse, r.dq.view(), r.dk.view(), r.dv.view(), options);
  return r;
}

}  // namespace flashattn
