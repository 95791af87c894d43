#include "tools/baseline/standard_attention.hpp"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "flashattn/error.hpp"
#include "flashattn/problem.hpp"
#include "tools/baseline/softmax_rows.hpp"
#include "src/core/element.hpp"
#include "src/core/validate.hpp"

extern "C" {
char* openblas_get_corename(void);
void openblas_set_num_threads(int num_threads);
}

namespace flashattn::baseline {
namespace {

// The textbook baseline covers causal and sliding-window masks; other variants are
// flashattn's alone, and asking the baseline for them is an error, never a silent skip.
void require_plain(const AttentionProblem& p) {
  const char* unsupported = p.softcap > 0.0f         ? "softcap"
                            : p.alibi                ? "alibi_slopes"
                            : p.dropout_p > 0.0f     ? "dropout_p"
                            : p.block_mask_block_size ? "block_mask"
                                                     : nullptr;
  if (unsupported != nullptr)
    throw Error(std::string("standard attention baseline: ") + unsupported +
                " is not supported (it covers causal and window_size only)");
}

// Copies head `h` of a (batch, seqlen, heads, dim) view into a contiguous float matrix.
void gather_head(const TensorView& t, std::int64_t b, std::int64_t h, std::vector<float>& dst) {
  const std::int64_t rows = t.shape[1], cols = t.shape[3];
  dst.resize(static_cast<std::size_t>(rows * cols));
#pragma omp parallel for
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t c = 0; c < cols; ++c)
      dst[static_cast<std::size_t>(i * cols + c)] =
          detail::load_element(t, detail::offset4(t, b, i, h, c));
}

}  // namespace

std::size_t standard_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                               const MutableTensorView& out, const MutableTensorView& lse,
                               const AttentionOptions& options) {
  const AttentionProblem p = AttentionProblem::from_inputs(q, k, v, options);
  detail::check_forward_outputs(p, q, k, v, out, lse);
  require_plain(p);
  const int threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  set_blas_threads(threads);
  std::vector<float> qf, kf, vf, of(static_cast<std::size_t>(p.seqlen_q * p.head_dim_v));
  std::vector<float> s(static_cast<std::size_t>(p.seqlen_q * p.seqlen_k));
  const std::size_t peak =
      (s.size() + of.size() +
       static_cast<std::size_t>(p.seqlen_q * p.head_dim + p.seqlen_k * (p.head_dim + p.head_dim_v))) *
      sizeof(float);
  const int sq = static_cast<int>(p.seqlen_q), sk = static_cast<int>(p.seqlen_k);
  const int d = static_cast<int>(p.head_dim), dv = static_cast<int>(p.head_dim_v);
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      const std::int64_t kvh = h / (p.heads_q / p.heads_kv);
      gather_head(q, b, h, qf);
      gather_head(k, b, kvh, kf);
      gather_head(v, b, kvh, vf);
      if (sq > 0 && sk > 0)  // S = Q·Kᵀ
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, sq, sk, d, 1.0f, qf.data(), d,
                    kf.data(), d, 0.0f, s.data(), sk);
#pragma omp parallel for num_threads(threads)
      for (std::int64_t i = 0; i < p.seqlen_q; ++i) {  // P = softmax(scale · S)
        float* row_lse = static_cast<float*>(lse.data) + b * lse.strides[0] +
                         h * lse.strides[1] + i * lse.strides[2];
        const AttentionProblem::KeyRange r = p.key_range(i);
        softmax_row(s.data() + i * p.seqlen_k, r.begin, r.end, p.seqlen_k, p.softmax_scale, row_lse);
      }
      if (sk > 0) {  // O = P·V
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, sq, dv, sk, 1.0f, s.data(), sk,
                    vf.data(), dv, 0.0f, of.data(), dv);
      } else {
        std::fill(of.begin(), of.end(), 0.0f);
      }
#pragma omp parallel for num_threads(threads)
      for (std::int64_t i = 0; i < p.seqlen_q; ++i)
        for (std::int64_t c = 0; c < p.head_dim_v; ++c)
          detail::store_element(out, detail::offset4(out, b, i, h, c),
                                of[static_cast<std::size_t>(i * p.head_dim_v + c)]);
    }
  }
  return peak;
}

namespace {

// Writes a contiguous float matrix (rows, cols) · scale into head `h` of a 4-d view.
void scatter_head(const std::vector<float>& src, float scale, const MutableTensorView& t,
                  std::int64_t b, std::int64_t h) {
  const std::int64_t rows = t.shape[1], cols = t.shape[3];
#pragma omp parallel for
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t c = 0; c < cols; ++c)
      detail::store_element(t, detail::offset4(t, b, i, h, c),
                            src[static_cast<std::size_t>(i * cols + c)] * scale);
}

}  // namespace

std::size_t standard_attention_backward(const TensorView& dout, const TensorView& q,
                                        const TensorView& k, const TensorView& v,
                                        const MutableTensorView& dq, const MutableTensorView& dk,
                                        const MutableTensorView& dv,
                                        const AttentionOptions& options) {
  const AttentionProblem p = AttentionProblem::from_inputs(q, k, v, options);
  require_plain(p);
  const int threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  set_blas_threads(threads);
  const int sq = static_cast<int>(p.seqlen_q), sk = static_cast<int>(p.seqlen_k);
  const int d = static_cast<int>(p.head_dim), dvd = static_cast<int>(p.head_dim_v);
  const std::int64_t group = p.heads_q / p.heads_kv;
  std::vector<float> qf, kf, vf, gof, dqf(static_cast<std::size_t>(sq) * d);
  std::vector<float> dkf(static_cast<std::size_t>(sk) * d), dvf(static_cast<std::size_t>(sk) * dvd);
  std::vector<float> prob(static_cast<std::size_t>(sq) * sk), dp(prob.size());
  const std::size_t peak = (2 * prob.size() + dqf.size() + 2 * (dkf.size() + dvf.size()) +
                            static_cast<std::size_t>(sq) * (d + dvd)) * sizeof(float);
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t kvh = 0; kvh < p.heads_kv; ++kvh) {
      gather_head(k, b, kvh, kf);
      gather_head(v, b, kvh, vf);
      std::fill(dkf.begin(), dkf.end(), 0.0f);
      std::fill(dvf.begin(), dvf.end(), 0.0f);
      for (std::int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        gather_head(q, b, h, qf);
        gather_head(dout, b, h, gof);
        if (sq > 0 && sk > 0) {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, sq, sk, d, 1.0f, qf.data(), d,
                      kf.data(), d, 0.0f, prob.data(), sk);  // S
#pragma omp parallel for num_threads(threads)
          for (std::int64_t i = 0; i < p.seqlen_q; ++i) {  // P
            float lse = 0.0f;
            const AttentionProblem::KeyRange r = p.key_range(i);
            softmax_row(prob.data() + i * sk, r.begin, r.end, sk, p.softmax_scale, &lse);
          }
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, sk, dvd, sq, 1.0f, prob.data(), sk,
                      gof.data(), dvd, 1.0f, dvf.data(), dvd);  // dV += Pᵀ·dO
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, sq, sk, dvd, 1.0f, gof.data(), dvd,
                      vf.data(), dvd, 0.0f, dp.data(), sk);  // dP = dO·Vᵀ
#pragma omp parallel for num_threads(threads)
          for (std::int64_t i = 0; i < p.seqlen_q; ++i) {  // dS = P ∘ (dP − rowsum(P ∘ dP))
            float* pr = prob.data() + i * sk;
            float* dr = dp.data() + i * sk;
            float delta = 0.0f;
            for (int j = 0; j < sk; ++j) delta += pr[j] * dr[j];
            for (int j = 0; j < sk; ++j) dr[j] = pr[j] * (dr[j] - delta);
          }
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, sq, d, sk, 1.0f, dp.data(), sk,
                      kf.data(), d, 0.0f, dqf.data(), d);  // dQ = dS·K
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, sk, d, sq, 1.0f, dp.data(), sk,
                      qf.data(), d, 1.0f, dkf.data(), d);  // dK += dSᵀ·Q
        } else {
          std::fill(dqf.begin(), dqf.end(), 0.0f);
        }
        scatter_head(dqf, p.softmax_scale, dq, b, h);
      }
      scatter_head(dkf, p.softmax_scale, dk, b, kvh);
      scatter_head(dvf, 1.0f, dv, b, kvh);
    }
  return peak;
}

std::string openblas_corename() { return openblas_get_corename(); }

void set_blas_threads(int threads) { openblas_set_num_threads(threads); }

double sgemm_gflops(int n, int threads, int repeats) {
  set_blas_threads(threads);
  std::vector<float> a(static_cast<std::size_t>(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size());
  double best = 1e30;
  for (int r = 0; r < repeats + 1; ++r) {  // the first run is a warm-up
    const auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(),
                n, 0.0f, c.data(), n);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::min(best, sec);
  }
  return 2.0 * n * n * static_cast<double>(n) / best * 1e-9;
}

}  // namespace flashattn::baseline
