// merge_attention_states: partial (out, lse) pairs combined with OnlineSoftmaxState::merge.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "element.hpp"
#include "flashattn/attention.hpp"
#include "flashattn/error.hpp"
#include "flashattn/online_softmax.hpp"
#include "merge.hpp"
#include "validate.hpp"

namespace flashattn {

namespace {

// Row (b, i, h) of the merge: out's row and its lse from every split's; acc holds
// head_dim_v doubles. Without `sums`, lses are the splits' natural-log lses; with them, lses
// hold the splits' maxima (log2 units) and `sums` (laid out as lses, from its own pointer)
// their ℓ. Without `out_sums`, lse receives the merged lse; with it, lse receives the merged
// state's max (log2 units) and `out_sums` (laid out as lse) its ℓ.
void merge_row(const TensorView& outs, const TensorView& lses, const float* sums, const MutableTensorView& out,
               const MutableTensorView& lse, float* out_sums, std::int64_t b, std::int64_t i, std::int64_t h,
               double* acc) {
  const auto* o = static_cast<const float*>(outs.data);
  const auto* l = static_cast<const float*>(lses.data);
  const std::int64_t splits = outs.shape[0], dv = outs.shape[4];
  std::fill(acc, acc + dv, 0.0);
  const auto split_at = [&](std::int64_t s) {
    return s * lses.strides[0] + b * lses.strides[1] + h * lses.strides[2] + i * lses.strides[3];
  };
  // Natural-log lses are weighed relative to the row's largest finite one: only their
  // differences (exact where they are close) are scaled to log2 units, not each lse, whose
  // rounding there would grow with |lse| (an error of |lse|·2^-24 in every weight), and an
  // lse near float32's largest does not overflow. The merged lse adds it back once.
  float shift = 0.0f;
  if (sums == nullptr) {
    float top = -std::numeric_limits<float>::infinity();
    for (std::int64_t s = 0; s < splits; ++s) top = std::max(top, l[split_at(s)]);
    if (std::isfinite(top)) shift = top;
  }
  OnlineSoftmaxState state;
  for (std::int64_t s = 0; s < splits; ++s) {
    const std::int64_t at = split_at(s);
    // A normalized partial output is õ/ℓ of its state; without the state, the state with ℓ = 1
    // at m = lse − shift (log2 units).
    OnlineSoftmaxState partial{l[at], sums != nullptr ? sums[at] : 1.0f};
    if (sums == nullptr) {
      const bool empty = l[at] == -std::numeric_limits<float>::infinity();
      partial = {empty ? l[at] : (l[at] - shift) * OnlineSoftmaxState::kLog2e, empty ? 0.0f : 1.0f};
    }
    OnlineSoftmaxState::MergeFactors f = state.merge(partial);
    f.other *= partial.sum == 0.0f ? 1.0f : partial.sum;  // õ = ℓ · the normalized row
    const float* row = o + s * outs.strides[0] + b * outs.strides[1] + i * outs.strides[2] + h * outs.strides[3];
    const std::int64_t step = outs.strides[4];
    if (step == 1) {  // the drivers' partial rows: the same sums, vectorised
      for (std::int64_t c = 0; c < dv; ++c) acc[c] = acc[c] * f.self + static_cast<double>(row[c]) * f.other;
    } else {
      for (std::int64_t c = 0; c < dv; ++c) acc[c] = acc[c] * f.self + static_cast<double>(row[c * step]) * f.other;
    }
  }
  const double inv = state.inverse_sum();
  const std::int64_t at = detail::offset4(out, b, i, h, 0), step_out = out.strides[3];
  for (std::int64_t c = 0; c < dv; ++c) detail::store_element(out, at + c * step_out, static_cast<float>(acc[c] * inv));
  const std::int64_t lse_at = b * lse.strides[0] + h * lse.strides[1] + i * lse.strides[2];
  static_cast<float*>(lse.data)[lse_at] = out_sums != nullptr ? state.max : state.lse() + shift;
  if (out_sums != nullptr) out_sums[lse_at] = state.sum;
}

}  // namespace

void merge_attention_states(const TensorView& outs, const TensorView& lses,
                            const MutableTensorView& out, const MutableTensorView& lse, int num_threads) {
  constexpr const char* kOutsLayout = "(splits, batch, seqlen_q, heads_q, head_dim_v)";
  detail::check_view("outs", outs, 5, kOutsLayout);
  detail::check_dtype("outs", outs, DType::f32, "partial outputs are float32");
  const std::int64_t splits = outs.shape[0], batch = outs.shape[1], sq = outs.shape[2];
  const std::int64_t heads = outs.shape[3], dv = outs.shape[4];
  detail::check_view("lses", lses, 4, "(splits, batch, heads_q, seqlen_q)");
  detail::check_dtype("lses", lses, DType::f32, "log-sum-exps are float32");
  detail::check_shape("lses", lses, {splits, batch, heads, sq}, "(splits, batch, heads_q, seqlen_q)");
  detail::check_view("out", out, 4, "(batch, seqlen_q, heads_q, head_dim_v)");
  if (!is_floating(out.dtype))
    throw Error("out: dtype " + to_string(out.dtype) + " is not a floating dtype (f32, bf16, f16)");
  detail::check_shape("out", out, {batch, sq, heads, dv}, "(batch, seqlen_q, heads_q, head_dim_v)");
  detail::check_tensor("lse", lse, DType::f32, "lse is always float32", {batch, heads, sq}, "(batch, heads_q, seqlen_q)");
  detail::check_output_layout("out", out);
  detail::check_output_layout("lse", lse);
  for (const auto& [name, input] : {std::pair{"outs", outs}, {"lses", lses}}) {
    detail::check_no_overlap("out", out, name, input);
    detail::check_no_overlap("lse", lse, name, input);
  }
  detail::check_no_overlap("lse", lse, "out", out);
  if (num_threads < 0 || num_threads > kMaxThreads)
    throw Error("num_threads: must be in [0, " + std::to_string(kMaxThreads) + "] (0 = all cores), got " +
                std::to_string(num_threads));

  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
#pragma omp parallel num_threads(threads)
  {
    std::vector<double> acc(static_cast<std::size_t>(dv));  // a row's sum, reused for the thread's rows
#pragma omp for collapse(3) schedule(static)
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t i = 0; i < sq; ++i)
        for (std::int64_t h = 0; h < heads; ++h) merge_row(outs, lses, nullptr, out, lse, nullptr, b, i, h, acc.data());
  }
}

void detail::merge_states(const TensorView& outs, const TensorView& maxes, const float* sums,
                          const MutableTensorView& out, const MutableTensorView& lse, float* out_sums,
                          std::int64_t row_begin, std::int64_t row_end) {
  double acc[AttentionProblem::kMaxHeadDim];  // on the stack: no allocation inside a running region
  const std::int64_t sq = outs.shape[2], heads = outs.shape[3];
  for (std::int64_t r = row_begin; r < row_end; ++r)
    merge_row(outs, maxes, sums, out, lse, out_sums, r / (sq * heads), r / heads % sq, r % heads, acc);
}

}  // namespace flashattn
