// The CUDA backend: its checks (16-bit operands, 16-byte rows, the features the kernels
// have) and the launches of forward and backward. Plain C++ (built with or without CUDA):
// the launches are in the CUDA translation units (or unavailable.cpp).
#include <cstdint>
#include <limits>
#include <string>

#include "flashattn/cuda_plan.hpp"
#include "flashattn/error.hpp"
#include "flashattn/problem.hpp"
#include "src/api/backend.hpp"
#include "src/cuda/backward_body.hpp"
#include "src/cuda/launch.hpp"

namespace flashattn::cuda {
namespace {

std::string str(std::int64_t v) { return std::to_string(v); }

// What the kernels need beyond the common checks: 16-bit floats, 16-byte rows (cp.async
// moves 16 bytes), 32-bit sequence indices, grid dimensions within CUDA's limits.
void check_operand(const char* name, const TensorView& view) {
  const std::string n = name;
  if (view.dtype != DType::bf16 && view.dtype != DType::f16)
    throw Error(n + ": dtype " + to_string(view.dtype) + " is not supported on cuda (bf16 or f16)");
  if (reinterpret_cast<std::uintptr_t>(view.data) % kChunkBytes != 0)
    throw Error(n + ": data must be 16-byte aligned on cuda");
  for (int d = 0; d < 3; ++d)
    if (view.strides[d] % kChunkElements != 0 && view.shape[d] > 1)
      throw Error(n + ": stride " + str(view.strides[d]) + " of dim " + str(d) +
                  " must be a multiple of 8 elements on cuda (16-byte rows; pad head_dim)");
  if (view.shape[1] > std::numeric_limits<int>::max())
    throw Error(n + ": sequence length " + str(view.shape[1]) + " exceeds 2^31 - 1 on cuda");
}

void check_supported(const AttentionProblem& p, const AttentionOptions& options) {
  constexpr std::int64_t kMaxGridDim = 65535;  // gridDim.y and .z
  if (p.head_dim_v != p.head_dim)
    throw Error("v: head_dim_v " + str(p.head_dim_v) + " differs from head_dim " + str(p.head_dim) +
                ", which cuda does not support");
  if (p.window_left >= 0 || (!p.causal && p.window_right >= 0))
    throw Error("window_size: (" + str(options.window_size.left) + ", " + str(options.window_size.right) +
                ") is not supported on cuda (causal is)");
  if (p.softcap != 0.0f) throw Error("softcap: " + std::to_string(p.softcap) + " is not supported on cuda");
  if (p.alibi) throw Error("alibi_slopes: not supported on cuda");
  if (p.sinks) throw Error("sinks are not supported on cuda");
  if (p.attn_mask != AttentionProblem::MaskKind::none) throw Error("attn_mask: not supported on cuda");
  if (p.causal_alignment != CausalAlignment::bottom_right)
    throw Error(std::string("causal_alignment: ") + to_string(p.causal_alignment) + " is not supported on cuda");
  if (options.score_hook.apply != nullptr) throw Error("score_hook: not supported on cuda");
  if (p.dropout_p != 0.0f) throw Error("dropout_p: " + std::to_string(p.dropout_p) + " is not supported on cuda");
  if (p.block_mask_block_size != 0 || options.block_mask.data != nullptr)
    throw Error("block_mask: not supported on cuda");
  if (options.counters != nullptr) throw Error("counters: not supported on cuda");
  if (options.dlse.data != nullptr || options.dlse.rank != 0) throw Error("dlse: not supported on cuda");
  if (options.rescale_counts.data != nullptr || options.rescale_counts.rank != 0)
    throw Error("rescale_counts: not supported on cuda");
  if (options.plans_run != nullptr) throw Error("plans_run: not supported on cuda (it reports the CPU's plans)");
  if (p.heads_q > kMaxGridDim || p.batch > kMaxGridDim)
    throw Error("heads_q " + str(p.heads_q) + " / batch " + str(p.batch) + ": at most " + str(kMaxGridDim) +
                " each on cuda");
}

Operand operand(const TensorView& v) { return {v.data, v.strides[0], v.strides[1], v.strides[2]}; }
MutableOperand operand(const MutableTensorView& v) { return {v.data, v.strides[0], v.strides[1], v.strides[2]}; }


void check_forward(const detail::ForwardJob& job) {
  check_supported(job.problem, job.options);
  if (job.options.pack_gqa.value_or(false) && job.problem.heads_q > job.problem.heads_kv)
    throw Error("pack_gqa: true is not supported on cuda (a thread block computes one q head's rows)");
  for (const auto& [name, view] : {std::pair{"q", job.q}, {"k", job.k}, {"v", job.v}, {"out", TensorView(job.out)}})
    check_operand(name, view);
  plan_cuda_forward(job.problem);
}

void forward(const detail::ForwardJob& job) {
  const AttentionProblem& p = job.problem;
  const CudaForwardPlan plan = plan_cuda_forward(p);
  if (p.batch == 0 || p.seqlen_q == 0) return;
  const ForwardParams params{operand(job.q), operand(job.k), operand(job.v), operand(job.out),
                             static_cast<float*>(job.lse.data), job.lse.strides[0], job.lse.strides[1],
                             static_cast<int>(p.seqlen_q), static_cast<int>(p.seqlen_k), static_cast<int>(p.heads_q),
                             static_cast<int>(p.heads_kv), static_cast<int>(p.head_dim), p.softmax_scale * kLog2e,
                             p.causal};
  launch_forward(params, plan, p.dtype == DType::bf16);
}

void check_backward(const detail::BackwardJob& job) {
  check_supported(job.problem, job.options);
  const std::pair<const char*, TensorView> operands[] = {{"dout", job.dout}, {"q", job.q},   {"k", job.k},
                                                         {"v", job.v},       {"out", job.out}, {"dq", job.dq},
                                                         {"dk", job.dk},     {"dv", job.dv}};
  for (const auto& [name, view] : operands) check_operand(name, view);
  plan_cuda_backward(job.problem, job.options.deterministic);
}

void backward(const detail::BackwardJob& job) {
  const AttentionProblem& p = job.problem;
  const CudaBackwardPlan plan = plan_cuda_backward(p, job.options.deterministic);
  // Without keys dq is zero, without queries dk and dv are: the launch writes them
  // (run_backward_passes); only an empty batch has nothing to write.
  if (p.batch == 0) return;
  BackwardParams params{};
  params.q = operand(job.q);
  params.k = operand(job.k);
  params.v = operand(job.v);
  params.out = operand(job.out);
  params.dout = operand(job.dout);
  params.dq = operand(job.dq);
  params.dk = operand(job.dk);
  params.dv = operand(job.dv);
  params.lse = static_cast<const float*>(job.lse.data);
  params.lse_batch_stride = job.lse.strides[0];
  params.lse_head_stride = job.lse.strides[1];
  params.stats_rows = p.batch * p.heads_q * plan.m_blocks * plan.block_m;
  params.head_dim_padded = plan.head_dim_padded;
  params.seqlen_q = static_cast<int>(p.seqlen_q);
  params.seqlen_k = static_cast<int>(p.seqlen_k);
  params.heads_q = static_cast<int>(p.heads_q);
  params.heads_kv = static_cast<int>(p.heads_kv);
  params.head_dim = static_cast<int>(p.head_dim);
  params.scale = p.softmax_scale;
  params.scale_log2 = p.softmax_scale * kLog2e;
  params.causal = p.causal;
  params.deterministic = job.options.deterministic;
  launch_backward(params, plan, p.dtype == DType::bf16);
}

}  // namespace
}  // namespace flashattn::cuda

namespace flashattn::detail {

// CUDA runs forward and backward; varlen, the KV cache and FP8 are the CPU's only.
const Backend& cuda_backend() {
  static constexpr Backend backend{
      .name = "cuda",
      .check_forward = cuda::check_forward,
      .check_backward = cuda::check_backward,
      .forward = cuda::forward,
      .backward = cuda::backward,
      .forward_varlen = nullptr,
      .backward_varlen = nullptr,
      .forward_with_kvcache = nullptr,
      .forward_varlen_paged = nullptr,
      .check_forward_fp8 = nullptr,
      .forward_fp8 = nullptr,
  };
  return backend;
}

}  // namespace flashattn::detail
