// The naive same-precision attention whose error sets the tolerance of the kernels' outputs
// and gradients (naive.hpp).
#include "tests/support/naive.hpp"

#include <algorithm>
#include <cmath>

#include "flashattn/exp2.hpp"
#include "flashattn/online_softmax.hpp"
#include "flashattn/plan.hpp"
#include "flashattn/reference.hpp"

namespace flashattn::test {

namespace {

// e^x as a kernel run with `options` computes it: through the poly3 cubic when the options
// let the kernel use it (poly3, and mixed, whose worst case that is), else std::exp. The
// naive yardsticks below use it, so that a kernel's error is set beside that of a naive
// implementation with the same exponential.
float naive_exp(const AttentionOptions& options, float x) {
  if (options.exp2 != Exp2Impl::poly3 && options.exp2 != Exp2Impl::mixed) return std::exp(x);
  const float power = x * 1.44269504f;
  float y = 0.0f;
  exp2_array(Exp2Impl::poly3, &power, &y, 1);
  return y;
}

// Attention in the inputs' precision with float32 accumulation, rounding to dtype either at
// every step (naive_same_precision) or only where the kernels round
// (rounded_where_the_kernel_rounds); both described below.
enum class Rounding { every_step, where_the_kernel_rounds };
std::vector<double> same_precision_attention(const AttentionProblem& p, const AttentionOptions& options,
                                             const Tensor& q, const Tensor& k, const Tensor& v,
                                             Rounding rounding, std::int64_t batch_offset) {
  const bool every_step = rounding == Rounding::every_step;
  const reference::Semantics sem{&p, &options, batch_offset};
  std::vector<double> out(static_cast<std::size_t>(p.batch * p.seqlen_q * p.heads_q * p.head_dim_v));
  const std::int64_t group = p.heads_q / p.heads_kv;
  std::vector<float> s(static_cast<std::size_t>(p.seqlen_k));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads_q; ++h)
      for (std::int64_t i = 0; i < p.seqlen_q; ++i) {
        const std::int64_t kvh = h / group;
        float m = -INFINITY, sum = 0.0f;
        for (std::int64_t j = 0; j < p.seqlen_k; ++j) {
          s[j] = -INFINITY;
          if (!sem.visible(i, j)) continue;
          float dot = 0.0f;
          for (std::int64_t d = 0; d < p.head_dim; ++d)
            dot += q.get(((b * p.seqlen_q + i) * p.heads_q + h) * p.head_dim + d) *
                   k.get(((b * p.seqlen_k + j) * p.heads_kv + kvh) * p.head_dim + d);
          s[j] = every_step ? round_to(p.dtype, static_cast<float>(sem.score(b, h, i, j, round_to(p.dtype, dot))))
                            : static_cast<float>(sem.score(b, h, i, j, dot));
          m = std::fmax(m, s[j]);
        }
        // The sink (options.sinks) joins the denominator with no value (docs/algorithm.md §6.1).
        const float sink = p.sinks ? static_cast<float>(sem.sink(h)) : -INFINITY;
        m = std::fmax(m, sink);
        if (m == -INFINITY) continue;
        if (p.sinks) sum += naive_exp(options, sink - m);
        for (std::int64_t j = 0; j < p.seqlen_k; ++j) sum += (s[j] = naive_exp(options, s[j] - m));
        for (std::int64_t j = 0; j < p.seqlen_k; ++j) {
          const auto keep = static_cast<float>(sem.dropout_weight(b, h, i, j));
          s[j] = every_step ? round_to(p.dtype, round_to(p.dtype, s[j] / sum) * keep) : round_to(p.dtype, s[j] * keep);
        }
        for (std::int64_t d = 0; d < p.head_dim_v; ++d) {
          float acc = 0.0f;
          for (std::int64_t j = 0; j < p.seqlen_k; ++j)
            acc += s[j] * v.get(((b * p.seqlen_k + j) * p.heads_kv + kvh) * p.head_dim_v + d);
          out[static_cast<std::size_t>(((b * p.seqlen_q + i) * p.heads_q + h) * p.head_dim_v + d)] =
              round_to(p.dtype, every_step ? acc : acc / sum);
        }
      }
  return out;
}

}  // namespace

std::vector<double> naive_same_precision(const AttentionProblem& p, const AttentionOptions& options,
                                         const Tensor& q, const Tensor& k, const Tensor& v,
                                         std::int64_t batch_offset) {
  return same_precision_attention(p, options, q, k, v, Rounding::every_step, batch_offset);
}

std::vector<double> rounded_where_the_kernel_rounds(const AttentionProblem& p, const AttentionOptions& options,
                                                    const Tensor& q, const Tensor& k, const Tensor& v) {
  return same_precision_attention(p, options, q, k, v, Rounding::where_the_kernel_rounds, 0);
}

NaiveGradients naive_backward_same_precision(const AttentionProblem& p, const AttentionOptions& options,
                                             const Tensor& dout, const Tensor& q, const Tensor& k,
                                             const Tensor& v) {
  const reference::Semantics sem{&p, &options};
  const std::int64_t d = p.head_dim, dv = p.head_dim_v, group = p.heads_q / p.heads_kv;
  const std::int64_t sq = p.seqlen_q, sk = p.seqlen_k;
  auto qi = [&](std::int64_t b, std::int64_t i, std::int64_t h, std::int64_t dim) {
    return ((b * sq + i) * p.heads_q + h) * dim;
  };
  auto ki = [&](std::int64_t b, std::int64_t j, std::int64_t h, std::int64_t dim) {
    return ((b * sk + j) * p.heads_kv + h) * dim;
  };
  std::vector<float> dq(static_cast<std::size_t>(q.numel())), dk(static_cast<std::size_t>(k.numel())),
      dvv(static_cast<std::size_t>(v.numel()));
  // Per head: P (undropped), W (dropout weights), G (dscore/ddot), dS, all (sq, sk).
  std::vector<float> prob(static_cast<std::size_t>(sq * sk)), w(prob.size()), g(prob.size()), ds(prob.size());
  std::vector<float> o(static_cast<std::size_t>(sq * dv));
  const bool bias = p.attn_mask == AttentionProblem::MaskKind::bias;
  const auto& m = options.attn_mask.shape;
  std::vector<float> dbias(static_cast<std::size_t>(bias ? m[0] * m[1] * m[2] * m[3] : 0));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      const std::int64_t kvh = h / group;
      for (std::int64_t i = 0; i < sq; ++i) {
        float m = -INFINITY, sum = 0.0f;
        float* pr = prob.data() + i * sk;  // no element to index when sk = 0
        for (std::int64_t j = 0; j < sk; ++j) {
          const std::size_t e = static_cast<std::size_t>(i * sk + j);
          pr[j] = -INFINITY;
          w[e] = static_cast<float>(sem.dropout_weight(b, h, i, j));
          if (!sem.visible(i, j)) continue;
          float dot = 0.0f;
          for (std::int64_t c = 0; c < d; ++c) dot += q.get(qi(b, i, h, d) + c) * k.get(ki(b, j, kvh, d) + c);
          dot = round_to(p.dtype, dot);
          g[e] = static_cast<float>(sem.score_gradient(b, h, i, j, dot));
          pr[j] = round_to(p.dtype, static_cast<float>(sem.score(b, h, i, j, dot)));
          m = std::fmax(m, pr[j]);
        }
        const float sink = p.sinks ? static_cast<float>(sem.sink(h)) : -INFINITY;  // as the forward's
        m = std::fmax(m, sink);
        if (m == -INFINITY) {
          std::fill(pr, pr + sk, 0.0f);
        } else {
          if (p.sinks) sum += naive_exp(options, sink - m);
          for (std::int64_t j = 0; j < sk; ++j) sum += (pr[j] = naive_exp(options, pr[j] - m));
          for (std::int64_t j = 0; j < sk; ++j) pr[j] = round_to(p.dtype, pr[j] / sum);
        }
        for (std::int64_t c = 0; c < dv; ++c) {
          float acc = 0.0f;
          for (std::int64_t j = 0; j < sk; ++j)
            acc += round_to(p.dtype, pr[j] * w[static_cast<std::size_t>(i * sk + j)]) * v.get(ki(b, j, kvh, dv) + c);
          o[static_cast<std::size_t>(i * dv + c)] = round_to(p.dtype, acc);
        }
      }
      for (std::int64_t i = 0; i < sq; ++i) {
        float delta = 0.0f;
        for (std::int64_t c = 0; c < dv; ++c) delta += dout.get(qi(b, i, h, dv) + c) * o[static_cast<std::size_t>(i * dv + c)];
        for (std::int64_t j = 0; j < sk; ++j) {
          const std::size_t e = static_cast<std::size_t>(i * sk + j);
          float dp = 0.0f;
          for (std::int64_t c = 0; c < dv; ++c) dp += dout.get(qi(b, i, h, dv) + c) * v.get(ki(b, j, kvh, dv) + c);
          ds[e] = prob[e] == 0.0f ? 0.0f
                                  : round_to(p.dtype, prob[e] * (w[e] * round_to(p.dtype, dp) - delta) * g[e]);
          if (bias && prob[e] != 0.0f)
            dbias[static_cast<std::size_t>(
                (((m[0] > 1 ? b : 0) * m[1] + (m[1] > 1 ? h : 0)) * m[2] + (m[2] > 1 ? i : 0)) * m[3] + (m[3] > 1 ? j : 0))] +=
                round_to(p.dtype, prob[e] * (w[e] * round_to(p.dtype, dp) - delta));
        }
      }
      for (std::int64_t i = 0; i < sq; ++i)
        for (std::int64_t c = 0; c < d; ++c) {
          float acc = 0.0f;
          for (std::int64_t j = 0; j < sk; ++j) acc += ds[static_cast<std::size_t>(i * sk + j)] * k.get(ki(b, j, kvh, d) + c);
          dq[static_cast<std::size_t>(qi(b, i, h, d) + c)] = round_to(p.dtype, acc);
        }
      for (std::int64_t j = 0; j < sk; ++j) {  // this head's share of dK, dV
        for (std::int64_t c = 0; c < d; ++c) {
          float acc = 0.0f;
          for (std::int64_t i = 0; i < sq; ++i) acc += ds[static_cast<std::size_t>(i * sk + j)] * q.get(qi(b, i, h, d) + c);
          dk[static_cast<std::size_t>(ki(b, j, kvh, d) + c)] += round_to(p.dtype, acc);
        }
        for (std::int64_t c = 0; c < dv; ++c) {
          float acc = 0.0f;
          for (std::int64_t i = 0; i < sq; ++i) {
            const std::size_t e = static_cast<std::size_t>(i * sk + j);
            acc += round_to(p.dtype, prob[e] * w[e]) * dout.get(qi(b, i, h, dv) + c);
          }
          dvv[static_cast<std::size_t>(ki(b, j, kvh, dv) + c)] += round_to(p.dtype, acc);
        }
      }
    }
  NaiveGradients r;
  for (float x : dq) r.dq.push_back(x);
  for (float x : dk) r.dk.push_back(round_to(p.dtype, x));
  for (float x : dvv) r.dv.push_back(round_to(p.dtype, x));
  for (float x : dbias) r.dbias.push_back(x);
  return r;
}

// x rounded to the nearest half-precision value, ties to even (±∞ beyond half's range).
float half(float x) {
  if (!std::isfinite(x) || x == 0.0f) return x;
  int exponent = 0;
  std::frexp(x, &exponent);  // |x| in [2^(exponent - 1), 2^exponent)
  const float quantum = std::ldexp(1.0f, std::max(exponent - 1, -14) - 10);  // half's ulp there (subnormals: 2^-24)
  const float rounded = std::nearbyint(x / quantum) * quantum;  // ties to even in the default rounding mode
  return std::fabs(rounded) > 65504.0f ? std::copysign(INFINITY, x) : rounded;
}

// The power of two that brings the largest finite |x| into [1, 2).
double unit_scale(const std::vector<double>& x) {
  double largest = 0.0;
  for (double e : x)
    if (std::isfinite(e)) largest = std::max(largest, std::fabs(e));
  int exponent = 0;
  if (largest > 0.0) std::frexp(largest, &exponent);
  return std::ldexp(1.0, 1 - exponent);
}

double narrow_rounding(ForwardKernel kernel) { return kernel == ForwardKernel::decode_bf16 ? 0x1p-9 : 0x1p-11; }

std::vector<ForwardKernel> narrow_decode_kernels() {
  const CpuHardware hw = CpuHardware::detect(1);
  std::vector<ForwardKernel> kernels;
  if (hw.decode_fp16) kernels.push_back(ForwardKernel::decode_fp16);
  if (hw.decode_bf16) kernels.push_back(ForwardKernel::decode_bf16);
  return kernels;
}

reference::Result narrow_precision_attention(ForwardKernel kernel, const Tensor& q, const Tensor& kc, const Tensor& kd,
                                             const Tensor& vc, const Tensor& vd, const AttentionOptions& o,
                                             const Tensor* kz, const Tensor* vz, bool k_int8) {
  // The operands' rounding, and that of a run's partial sum: half and half, or bf16 and float32.
  const bool bf16 = kernel == ForwardKernel::decode_bf16;
  const bool integer_scores = bf16 && k_int8;
  auto narrow = [bf16](float x) { return bf16 ? round_to(DType::bf16, x) : half(x); };
  auto sum = [bf16](float x) { return bf16 ? x : half(x); };
  const std::int64_t batch = q.shape()[0], sq = q.shape()[1], hq = q.shape()[2], d = q.shape()[3];
  const std::int64_t sk = kc.shape()[1], hkv = kc.shape()[2], dv = vc.shape()[3];
  // q times softmax_scale·log2(e) in float, as a kernel scales it before rounding.
  const float scale = AttentionProblem::from_sizes(batch, sq, sk, hq, hkv, d, dv, DType::f32, o).softmax_scale *
                      OnlineSoftmaxState::kLog2e;
  reference::Result r;
  r.out.assign(static_cast<std::size_t>(batch * sq * hq * dv), 0.0);
  r.lse.assign(static_cast<std::size_t>(batch * hq * sq), 0.0);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < hq; ++h)
      for (std::int64_t i = 0; i < sq; ++i) {
        const std::int64_t g = h / (hq / hkv), end = o.causal ? std::min(sk, sk - sq + i + 1) : sk;
        std::vector<double> qi(static_cast<std::size_t>(d));
        for (std::int64_t e = 0; e < d; ++e) qi[e] = q.get(((b * sq + i) * hq + h) * d + e) * scale;  // in float
        const double q_unit = unit_scale(qi);
        std::vector<float> qh(static_cast<std::size_t>(d));
        for (std::int64_t e = 0; e < d; ++e) qh[e] = narrow(static_cast<float>(qi[e] * q_unit));
        std::vector<double> s(static_cast<std::size_t>(end));
        double m = -INFINITY;
        std::vector<double> qi_fixed(static_cast<std::size_t>(d));  // integer_scores: q in integers of 2^-13
        for (std::int64_t e = 0; e < d; ++e) qi_fixed[e] = std::nearbyint(qi[e] * q_unit * 0x1p13) * 0x1p-13;
        for (std::int64_t j = 0; j < end; ++j) {
          double total = 0.0;
          if (integer_scores) {
            double centre = 0.0;  // Σq · (K's zero point + 128)
            for (std::int64_t e = 0; e < d; ++e) {
              total += qi_fixed[e] * (kc.get(((b * sk + j) * hkv + g) * d + e) + 128.0);
              centre += qi[e] * ((kz != nullptr ? kz->get((b * sk + j) * hkv + g) : 0.0) + 128.0);
            }
            s[j] = (total / q_unit - centre) * kd.get((b * sk + j) * hkv + g);
            m = std::max(m, s[j]);
            continue;
          }
          for (std::int64_t e0 = 0; e0 < d; e0 += 8) {
            float run = 0.0f;
            for (std::int64_t e = e0; e < std::min(e0 + 8, d); ++e)
              run = sum(std::fma(qh[e], kc.get(((b * sk + j) * hkv + g) * d + e), run));
            total += run;
          }
          double centre = 0.0;  // Σq · K's zero point
          if (kz != nullptr)
            for (std::int64_t e = 0; e < d; ++e) centre += qi[e] * kz->get((b * sk + j) * hkv + g);
          s[j] = (total / q_unit - centre) * kd.get((b * sk + j) * hkv + g);
          m = std::max(m, s[j]);
        }
        double total_p = 0.0, centre = 0.0;  // centre: Σ p · V descale · V's zero point
        std::vector<double> weight(static_cast<std::size_t>(end));  // p · V descale
        for (std::int64_t j = 0; j < end; ++j) {
          const double p = std::exp2(s[j] - m);
          total_p += p;
          weight[j] = p * vd.get((b * sk + j) * hkv + g);
          if (vz != nullptr) centre += weight[j] * vz->get((b * sk + j) * hkv + g);
        }
        const double w_unit = unit_scale(weight);
        for (double& w : weight) w = narrow(static_cast<float>(w * w_unit));
        for (std::int64_t e = 0; e < dv; ++e) {
          double total = 0.0;
          for (std::int64_t j0 = 0; j0 < end; j0 += 16) {
            float run = 0.0f;
            for (std::int64_t j = j0; j < std::min(j0 + 16, end); ++j)
              run = sum(std::fma(static_cast<float>(weight[j]), vc.get(((b * sk + j) * hkv + g) * dv + e), run));
            total += run;
          }
          r.out[static_cast<std::size_t>(((b * sq + i) * hq + h) * dv + e)] = (total / w_unit - centre) / total_p;
        }
        r.lse[static_cast<std::size_t>((b * hq + h) * sq + i)] = (m + std::log2(total_p)) * std::log(2.0);
      }
  return r;
}

}  // namespace flashattn::test
