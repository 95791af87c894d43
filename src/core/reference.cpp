#include "flashattn/reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "element.hpp"

namespace flashattn::reference {

void attention_row(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                   const TensorView& v, std::int64_t b, std::int64_t h, std::int64_t i,
                   double* out_row, double* lse) {
  using detail::load_element;
  using detail::offset4;
  const std::int64_t kv_head = h / (p.heads_q / p.heads_kv);
  const std::int64_t n = p.visible_keys(i);
  std::fill(out_row, out_row + p.head_dim_v, 0.0);
  if (n == 0) {
    *lse = -std::numeric_limits<double>::infinity();
    return;
  }
  // S row = scale · q_i · K_jᵀ, then P row = softmax(S row), then o = P row · V.
  std::vector<double> s(static_cast<std::size_t>(n));
  for (std::int64_t j = 0; j < n; ++j) {
    double dot = 0.0;
    for (std::int64_t d = 0; d < p.head_dim; ++d)
      dot += static_cast<double>(load_element(q, offset4(q, b, i, h, d))) *
             static_cast<double>(load_element(k, offset4(k, b, j, kv_head, d)));
    s[j] = dot * static_cast<double>(p.softmax_scale);
  }
  const double m = *std::max_element(s.begin(), s.end());
  double sum = 0.0;
  for (double& x : s) sum += (x = std::exp(x - m));
  for (std::int64_t j = 0; j < n; ++j) {
    const double pj = s[j] / sum;
    for (std::int64_t d = 0; d < p.head_dim_v; ++d)
      out_row[d] += pj * static_cast<double>(load_element(v, offset4(v, b, j, kv_head, d)));
  }
  *lse = m + std::log(sum);
}

Result attention(const TensorView& q, const TensorView& k, const TensorView& v,
                 const AttentionOptions& options) {
  const AttentionProblem p = AttentionProblem::from_inputs(q, k, v, options);
  Result r;
  r.out.resize(static_cast<std::size_t>(p.batch * p.seqlen_q * p.heads_q * p.head_dim_v));
  r.lse.resize(static_cast<std::size_t>(p.batch * p.heads_q * p.seqlen_q));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads_q; ++h)
      for (std::int64_t i = 0; i < p.seqlen_q; ++i)
        attention_row(p, q, k, v, b, h, i,
                      &r.out[static_cast<std::size_t>(((b * p.seqlen_q + i) * p.heads_q + h) *
                                                      p.head_dim_v)],
                      &r.lse[static_cast<std::size_t>((b * p.heads_q + h) * p.seqlen_q + i)]);
  return r;
}

}  // namespace flashattn::reference
