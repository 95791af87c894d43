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
#pragma omp parallel for collapse(3) schedule(dynamic, 16)
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads_q; ++h)
      for (std::int64_t i = 0; i < p.seqlen_q; ++i)
        attention_row(p, q, k, v, b, h, i,
                      &r.out[static_cast<std::size_t>(((b * p.seqlen_q + i) * p.heads_q + h) *
                                                      p.head_dim_v)],
                      &r.lse[static_cast<std::size_t>((b * p.heads_q + h) * p.seqlen_q + i)]);
  return r;
}

Gradients attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                             const TensorView& v, const AttentionOptions& options) {
  using detail::load_element;
  using detail::offset4;
  const AttentionProblem p = AttentionProblem::from_inputs(q, k, v, options);
  const std::int64_t d = p.head_dim, dv = p.head_dim_v, group = p.heads_q / p.heads_kv;
  Gradients g;
  g.dq.assign(static_cast<std::size_t>(p.batch * p.seqlen_q * p.heads_q * d), 0.0);
  g.dk.assign(static_cast<std::size_t>(p.batch * p.seqlen_k * p.heads_kv * d), 0.0);
  g.dv.assign(static_cast<std::size_t>(p.batch * p.seqlen_k * p.heads_kv * dv), 0.0);
  const double scale = p.softmax_scale;
  // One (batch, kv head) per task: its dk/dv rows are written by nobody else.
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t kvh = 0; kvh < p.heads_kv; ++kvh) {
      std::vector<double> out_row(static_cast<std::size_t>(dv)), prob(static_cast<std::size_t>(p.seqlen_k));
      for (std::int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
        for (std::int64_t i = 0; i < p.seqlen_q; ++i) {
          const std::int64_t n = p.visible_keys(i);
          if (n == 0) continue;
          double lse = 0.0;
          attention_row(p, q, k, v, b, h, i, out_row.data(), &lse);
          double delta = 0.0;  // D_i = rowsum(dO ∘ O) = Σ_j P_ij dP_ij
          for (std::int64_t c = 0; c < dv; ++c)
            delta += static_cast<double>(load_element(dout, offset4(dout, b, i, h, c))) *
                     out_row[static_cast<std::size_t>(c)];
          for (std::int64_t j = 0; j < n; ++j) {
            double s = 0.0;
            for (std::int64_t c = 0; c < d; ++c)
              s += static_cast<double>(load_element(q, offset4(q, b, i, h, c))) *
                   static_cast<double>(load_element(k, offset4(k, b, j, kvh, c)));
            const double pij = std::exp(s * scale - lse);
            double dp = 0.0;
            for (std::int64_t c = 0; c < dv; ++c) {
              const double go = load_element(dout, offset4(dout, b, i, h, c));
              dp += go * static_cast<double>(load_element(v, offset4(v, b, j, kvh, c)));
              g.dv[static_cast<std::size_t>(((b * p.seqlen_k + j) * p.heads_kv + kvh) * dv + c)] += pij * go;
            }
            const double ds = pij * (dp - delta) * scale;
            for (std::int64_t c = 0; c < d; ++c) {
              g.dq[static_cast<std::size_t>(((b * p.seqlen_q + i) * p.heads_q + h) * d + c)] +=
                  ds * static_cast<double>(load_element(k, offset4(k, b, j, kvh, c)));
              g.dk[static_cast<std::size_t>(((b * p.seqlen_k + j) * p.heads_kv + kvh) * d + c)] +=
                  ds * static_cast<double>(load_element(q, offset4(q, b, i, h, c)));
            }
          }
        }
    }
  return g;
}

}  // namespace flashattn::reference
