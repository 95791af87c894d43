// The FP8 forward (docs/algorithm.md §4) on the CPU. A CPU has no FP8 multiplier, so this is an
// emulation of FP8 *numerics*, not of FP8 speed: the operands are the FP8 values
// (codes × descale, exactly what an FP8 tensor core multiplies, up to one float32 rounding
// of the descale product), the products accumulate in float32 as on a tensor core, and P
// is rounded to e4m3 before P·V inside the kernel. The dequantized copies cost
// 4 bytes per element of q, k and v for the duration of the call.
#include <cmath>

#include "flashattn/attention.hpp"
#include "flashattn/error.hpp"
#include "src/core/validate.hpp"
#include "src/cpu/drivers.hpp"

namespace flashattn {

void forward_fp8(const Fp8View& q, const Fp8View& k, const Fp8View& v, const MutableTensorView& out,
                 const MutableTensorView& lse, const AttentionOptions& options) {
  const Tensor qf = detail::dequantize_fp8("q", q);
  const Tensor kf = detail::dequantize_fp8("k", k);
  const Tensor vf = detail::dequantize_fp8("v", v);
  AttentionProblem problem = AttentionProblem::from_inputs(qf.view(), kf.view(), vf.view(), options);
  // Unrescaled probabilities reach 2^threshold and must stay within e4m3's range.
  const float max_threshold = std::floor(std::log2(fp8_info(Fp8Format::e4m3).max));
  if (problem.rescale_threshold > max_threshold)
    throw Error("rescale_threshold: at most " + std::to_string(max_threshold) +
                " with FP8 probabilities (P <= 2^threshold must fit e4m3's max 448), got " +
                std::to_string(problem.rescale_threshold));
  problem.fp8_probabilities = true;
  detail::check_forward_output_views(problem, q.codes, k.codes, v.codes, out, lse);
  detail::check_rescale_counts(problem, options, q.codes, k.codes, v.codes, out, lse);
  detail::run_forward_problem(problem, qf.view(), kf.view(), vf.view(), out, lse, options);
}

ForwardResult forward_fp8(const Fp8View& q, const Fp8View& k, const Fp8View& v, DType out_dtype,
                          const AttentionOptions& options) {
  detail::check_view("q.codes", q.codes, 4, "(batch, seqlen_q, heads_q, head_dim)");
  detail::check_view("v.codes", v.codes, 4, "(batch, seqlen_k, heads_kv, head_dim_v)");
  ForwardResult result{Tensor(out_dtype, {q.codes.shape[0], q.codes.shape[1], q.codes.shape[2], v.codes.shape[3]}),
                       Tensor(DType::f32, {q.codes.shape[0], q.codes.shape[2], q.codes.shape[1]})};
  forward_fp8(q, k, v, result.out.view(), result.lse.view(), options);
  return result;
}

}  // namespace flashattn
