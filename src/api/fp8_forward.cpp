// forward_fp8 (docs/algorithm.md §4): checked once here, then run by the backend of the
// tensors' device. The CPU backend computes FP8 numerics in float32 (src/cpu/backend.cpp):
// the operands are the FP8 values (codes × descale, exactly what an FP8 tensor core
// multiplies, up to one float32 rounding of the descale product), the products accumulate
// in float32 as on a tensor core, and P is rounded to e4m3 before P·V inside the kernel.
#include "flashattn/attention.hpp"
#include "src/api/backend.hpp"
#include "src/api/checks.hpp"
#include "src/api/route.hpp"
#include "src/core/validate.hpp"

namespace flashattn {

void forward_fp8(const Fp8View& q, const Fp8View& k, const Fp8View& v, const MutableTensorView& out,
                 const MutableTensorView& lse, const AttentionOptions& options) {
  const detail::Backend& backend = detail::route(
      "forward_fp8", &detail::Backend::forward_fp8,
      {{"q.codes", q.codes}, {"q.descale", q.descale}, {"k.codes", k.codes}, {"k.descale", k.descale},
       {"v.codes", v.codes}, {"v.descale", v.descale}, {"out", out}, {"lse", lse}});
  const detail::Fp8ForwardJob job{detail::check_forward_fp8_call(q, k, v, out, lse, options), q, k, v, out, lse, options};
  backend.check_forward_fp8(job);
  detail::begin_run(options);
  backend.forward_fp8(job);
}

ForwardResult forward_fp8(const Fp8View& q, const Fp8View& k, const Fp8View& v, DType out_dtype,
                          const AttentionOptions& options) {
  detail::route("forward_fp8", &detail::Backend::forward_fp8,
                {{"q.codes", q.codes}, {"k.codes", k.codes}, {"v.codes", v.codes}});
  detail::check_view("q.codes", q.codes, 4, "(batch, seqlen_q, heads_q, head_dim)");
  detail::check_view("v.codes", v.codes, 4, "(batch, seqlen_k, heads_kv, head_dim_v)");
  ForwardResult result{Tensor(out_dtype, {q.codes.shape[0], q.codes.shape[1], q.codes.shape[2], v.codes.shape[3]}),
                       Tensor(DType::f32, {q.codes.shape[0], q.codes.shape[2], q.codes.shape[1]})};
  forward_fp8(q, k, v, result.out.view(), result.lse.view(), options);
  return result;
}

}  // namespace flashattn
