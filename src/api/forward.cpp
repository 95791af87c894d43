// forward(): checked once here, then run by the backend of the tensors' device.
#include "flashattn/attention.hpp"
#include "src/api/backend.hpp"
#include "src/api/float32_out.hpp"
#include "src/api/route.hpp"
#include "src/api/run.hpp"

namespace flashattn {
namespace {

void routed_forward(const TensorView& q, const TensorView& k, const TensorView& v, const MutableTensorView& out,
                    const MutableTensorView& lse, const AttentionOptions& options, detail::OutputDtypes outputs,
                    float* lse_sums = nullptr) {
  detail::run_forward(
      detail::route("forward", &detail::Backend::forward, {{"q", q}, {"k", k}, {"v", v}, {"out", out}, {"lse", lse}}),
      q, k, v, out, lse, options, outputs, lse_sums);
}

}  // namespace

void forward(const TensorView& q, const TensorView& k, const TensorView& v, const MutableTensorView& out,
             const MutableTensorView& lse, const AttentionOptions& options) {
  routed_forward(q, k, v, out, lse, options, detail::OutputDtypes::inputs);
}

void detail::forward_into_float32(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const MutableTensorView& out, const MutableTensorView& lse,
                                  const AttentionOptions& options, float* lse_sums) {
  routed_forward(q, k, v, out, lse, options, OutputDtypes::inputs_or_f32, lse_sums);
}

ForwardResult forward(const TensorView& q, const TensorView& k, const TensorView& v,
                      const AttentionOptions& options) {
  const AttentionProblem p = AttentionProblem::from_inputs(q, k, v, options);
  ForwardResult result{Tensor(p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}),
                       Tensor(DType::f32, {p.batch, p.heads_q, p.seqlen_q})};
  forward(q, k, v, result.out.view(), result.lse.view(), options);
  return result;
}

}  // namespace flashattn
