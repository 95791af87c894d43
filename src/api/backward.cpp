// backward(): checked once here, then run by the backend of the tensors' device.
#include "flashattn/attention.hpp"
#include "src/api/backend.hpp"
#include "src/api/float32_out.hpp"
#include "src/api/route.hpp"
#include "src/api/run.hpp"

namespace flashattn {
namespace {

void routed_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                     const TensorView& out, const TensorView& lse, const MutableTensorView& dq,
                     const MutableTensorView& dk, const MutableTensorView& dv, const AttentionOptions& options,
                     detail::OutputDtypes grads) {
  detail::run_backward(detail::route("backward", &detail::Backend::backward,
                                    {{"dout", dout}, {"q", q}, {"k", k}, {"v", v}, {"out", out}, {"lse", lse},
                                     {"dq", dq}, {"dk", dk}, {"dv", dv}}),
                       dout, q, k, v, out, lse, dq, dk, dv, options, grads);
}

}  // namespace

void backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& out, const TensorView& lse, const MutableTensorView& dq, const MutableTensorView& dk,
              const MutableTensorView& dv, const AttentionOptions& options) {
  routed_backward(dout, q, k, v, out, lse, dq, dk, dv, options, detail::OutputDtypes::inputs);
}

void detail::backward_into_float32(const TensorView& dout, const TensorView& q, const TensorView& k,
                                   const TensorView& v, const TensorView& out, const TensorView& lse,
                                   const MutableTensorView& dq, const MutableTensorView& dk,
                                   const MutableTensorView& dv, const AttentionOptions& options) {
  routed_backward(dout, q, k, v, out, lse, dq, dk, dv, options, OutputDtypes::inputs_or_f32);
}

BackwardResult backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse, const AttentionOptions& options) {
  const AttentionProblem p = AttentionProblem::from_inputs(q, k, v, options);
  BackwardResult r{Tensor(p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim}),
                   Tensor(p.dtype, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim}),
                   Tensor(p.dtype, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim_v})};
  backward(dout, q, k, v, out, lse, r.dq.view(), r.dk.view(), r.dv.view(), options);
  return r;
}

}  // namespace flashattn
