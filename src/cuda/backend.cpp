#include "src/cuda/backend.hpp"

#include <cstdint>
#include <limits>
#include <string>

#include "flashattn/cuda_plan.hpp"
#include "flashattn/error.hpp"
#include "flashattn/problem.hpp"
#include "src/core/validate.hpp"
#include "src/cuda/backward_body.hpp"
#include "src/cuda/launch.hpp"

namespace flashattn::cuda {
namespace {

std::string str(std::int64_t v) { return std::to_string(v); }

// The views' metadata, as the cpu-side checks (shapes, strides, overlap) read it.
TensorView host_meta(const TensorView& view) { return view.on(Device::cpu); }

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
  if (p.dropout_p != 0.0f) throw Error("dropout_p: " + std::to_string(p.dropout_p) + " is not supported on cuda");
  if (p.block_mask_block_size != 0 || options.block_mask.data != nullptr)
    throw Error("block_mask: not supported on cuda");
  if (options.counters != nullptr) throw Error("counters: not supported on cuda");
  if (p.heads_q > kMaxGridDim || p.batch > kMaxGridDim)
    throw Error("heads_q " + str(p.heads_q) + " / batch " + str(p.batch) + ": at most " + str(kMaxGridDim) +
                " each on cuda");
}

Operand operand(const TensorView& v) { return {v.data, v.strides[0], v.strides[1], v.strides[2]}; }
MutableOperand operand(const MutableTensorView& v) { return {v.data, v.strides[0], v.strides[1], v.strides[2]}; }

}  // namespace

Device common_device(std::initializer_list<std::pair<const char*, const TensorView*>> views) {
  const auto& [first_name, first] = *views.begin();
  for (const auto& [name, view] : views)
    if (view->device != first->device)
      throw Error(std::string(name) + ": on " + to_string(view->device) + " but " + first_name + " is on " +
                  to_string(first->device) + " (all tensors of a call must be on one device)");
  return first->device;
}

void forward(const TensorView& q, const TensorView& k, const TensorView& v, const MutableTensorView& out,
             const MutableTensorView& lse, const AttentionOptions& options) {
  const AttentionProblem p = AttentionProblem::from_inputs(host_meta(q), host_meta(k), host_meta(v), options);
  detail::check_forward_outputs(p, host_meta(q), host_meta(k), host_meta(v), host_meta(out), host_meta(lse));
  check_supported(p, options);
  for (const auto& [name, view] : {std::pair{"q", q}, {"k", k}, {"v", v}, {"out", TensorView(out)}})
    check_operand(name, view);
  const CudaForwardPlan plan = plan_cuda_forward(p);
  if (p.batch == 0 || p.seqlen_q == 0) return;
  const ForwardParams params{operand(q), operand(k), operand(v), operand(out), static_cast<float*>(lse.data),
                             lse.strides[0], lse.strides[1], static_cast<int>(p.seqlen_q),
                             static_cast<int>(p.seqlen_k), static_cast<int>(p.heads_q), static_cast<int>(p.heads_kv),
                             static_cast<int>(p.head_dim), p.softmax_scale * kLog2e, p.causal};
  launch_forward(params, plan, p.dtype == DType::bf16);
}

void backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& out, const TensorView& lse, const MutableTensorView& dq,
              const MutableTensorView& dk, const MutableTensorView& dv, const AttentionOptions& options) {
  const AttentionProblem p = AttentionProblem::from_inputs(host_meta(q), host_meta(k), host_meta(v), options);
  check_supported(p, options);
  const std::pair<const char*, TensorView> operands[] = {{"dout", dout}, {"q", q},   {"k", k},   {"v", v},
                                                         {"out", out},   {"dq", dq}, {"dk", dk}, {"dv", dv}};
  constexpr const char* kOutLayout = "(batch, seqlen_q, heads_q, head_dim_v)";
  for (const auto& [name, view] : {std::pair{"dout", dout}, {"out", out}}) {
    detail::check_view(name, host_meta(view), 4, kOutLayout);
    detail::check_dtype(name, view, q.dtype, "must have q's dtype");
    detail::check_shape(name, view, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}, kOutLayout);
  }
  detail::check_view("lse", host_meta(lse), 3, "(batch, heads_q, seqlen_q)");
  detail::check_dtype("lse", lse, DType::f32, "lse is always float32");
  detail::check_shape("lse", lse, {p.batch, p.heads_q, p.seqlen_q}, "(batch, heads_q, seqlen_q)");
  const std::pair<const char*, const TensorView*> like[] = {{"q", &q}, {"k", &k}, {"v", &v}};
  const std::pair<const char*, TensorView> grads[] = {{"dq", dq}, {"dk", dk}, {"dv", dv}};
  for (int g = 0; g < 3; ++g) {
    const auto& [name, grad] = grads[g];
    const TensorView& ref = *like[g].second;
    detail::check_view(name, host_meta(grad), 4, "(like its input)");
    detail::check_dtype(name, grad, ref.dtype, "gradients have their input's dtype");
    detail::check_shape(name, grad, {ref.shape[0], ref.shape[1], ref.shape[2], ref.shape[3]}, "(the shape of its input)");
    detail::check_output_layout(name, host_meta(grad));
    for (const auto& [in_name, input] : {std::pair{"dout", dout}, {"q", q}, {"k", k}, {"v", v}, {"out", out},
                                         {"lse", lse}})
      detail::check_no_overlap(name, host_meta(grad), in_name, host_meta(input));
    for (int o = 0; o < g; ++o) detail::check_no_overlap(name, host_meta(grad), grads[o].first, host_meta(grads[o].second));
  }
  for (const auto& [name, view] : operands) check_operand(name, view);
  const CudaBackwardPlan plan = plan_cuda_backward(p, options.deterministic);
  // Without keys dq is zero, without queries dk and dv are: the launch writes them
  // (run_backward_passes); only an empty batch has nothing to write.
  if (p.batch == 0) return;
  BackwardParams params{};
  params.q = operand(q);
  params.k = operand(k);
  params.v = operand(v);
  params.out = operand(out);
  params.dout = operand(dout);
  params.dq = operand(dq);
  params.dk = operand(dk);
  params.dv = operand(dv);
  params.lse = static_cast<const float*>(lse.data);
  params.lse_batch_stride = lse.strides[0];
  params.lse_head_stride = lse.strides[1];
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
  params.deterministic = options.deterministic;
  launch_backward(params, plan, p.dtype == DType::bf16);
}

}  // namespace flashattn::cuda
