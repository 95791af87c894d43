#include "flashattn/reference.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <limits>

#include "element.hpp"
#include "flashattn/dropout.hpp"

namespace flashattn::reference {

bool Semantics::visible(std::int64_t i, std::int64_t j) const {
  const AttentionProblem::KeyRange r = problem->key_range(i);
  if (j < r.begin || j >= r.end) return false;
  if (problem->block_mask_block_size == 0) return true;
  const std::int64_t bs = problem->block_mask_block_size;
  const TensorView& m = options->block_mask;
  return detail::load_element(m, (i / bs) * m.strides[0] + (j / bs) * m.strides[1]) != 0.0f;
}

double Semantics::slope(std::int64_t b, std::int64_t h) const {
  const TensorView& a = options->alibi_slopes;
  return a.rank == 1 ? detail::load_element(a, h * a.strides[0])
                     : detail::load_element(a, (b + batch_offset) * a.strides[0] + h * a.strides[1]);
}

double Semantics::sink(std::int64_t h) const {
  return detail::load_element(options->sinks, h * options->sinks.strides[0]);
}

double Semantics::mask(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
  if (problem->attn_mask == AttentionProblem::MaskKind::none) return 0.0;
  const TensorView& m = options->attn_mask;
  const std::int64_t index[4] = {b, h, i, j};
  std::int64_t offset = 0;
  for (int d = 0; d < 4; ++d)
    if (m.shape[d] > 1) offset += index[d] * m.strides[d];
  const double x = detail::load_element(m, offset);
  // A finite bias beyond ±kLargestScaled counts as ±kLargestScaled (options.hpp): only −∞ hides a key.
  constexpr double kLargest = AttentionProblem::kLargestScaled;
  if (problem->attn_mask == AttentionProblem::MaskKind::bias) return std::isfinite(x) ? std::clamp(x, -kLargest, kLargest) : x;
  return x != 0.0 ? 0.0 : -std::numeric_limits<double>::infinity();
}

double Semantics::builtin_score(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j, double dot) const {
  const AttentionProblem& p = *problem;
  double s = dot * static_cast<double>(p.softmax_scale);
  if (p.softcap > 0.0f) s = p.softcap * std::tanh(s / p.softcap);
  if (p.alibi) s -= slope(b, h) * static_cast<double>(std::llabs(p.diagonal(i) - j));
  return s + mask(b, h, i, j);
}

bool Semantics::hook_keeps(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
  const ScoreHook& hook = options->score_hook;
  if (hook.apply == nullptr) return true;
  ScoreBlock state = ScoreBlock::partial;
  if (hook.block_size > 0) {
    const TensorView& m = hook.block_mask;
    const std::int64_t bs = hook.block_size;
    const std::int64_t offset = (m.shape[0] > 1 ? b * m.strides[0] : 0) + (m.shape[1] > 1 ? h * m.strides[1] : 0) +
                                (i / bs) * m.strides[2] + (j / bs) * m.strides[3];
    state = static_cast<ScoreBlock>(static_cast<const std::uint8_t*>(m.data)[offset]);
  }
  if (state == ScoreBlock::empty) return false;
  return state == ScoreBlock::full || hook.mask == nullptr || hook.mask(hook.mods, b, h, i, j);
}

double Semantics::score(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j, double dot) const {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  const double s = builtin_score(b, h, i, j, dot);
  if (s == kNegInf || !hook_keeps(b, h, i, j)) return kNegInf;
  const ScoreHook& hook = options->score_hook;
  return hook.score != nullptr ? hook.score(hook.mods, s, b, h, i, j) : s;
}

double Semantics::score_gradient(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j, double dot) const {
  const double scale = problem->softmax_scale;
  double g = scale;
  if (problem->softcap > 0.0f) {
    const double t = std::tanh(dot * scale / problem->softcap);
    g *= 1.0 - t * t;
  }
  const ScoreHook& hook = options->score_hook;
  if (hook.score == nullptr) return g;
  const double s = builtin_score(b, h, i, j, dot);
  return s == -std::numeric_limits<double>::infinity() ? g : g * hook.derivative(hook.mods, s, b, h, i, j);
}

double Semantics::dropout_weight(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
  const AttentionProblem& p = *problem;
  if (p.dropout_p <= 0.0f) return 1.0;
  return dropout_keep(p.seed, p.offset, b + batch_offset, h, i, j, p.dropout_p)
             ? 1.0 / (1.0 - p.dropout_p)
             : 0.0;
}

namespace {

double dot_row(const AttentionProblem& p, const TensorView& q, const TensorView& k, std::int64_t b,
               std::int64_t h, std::int64_t kv_head, std::int64_t i, std::int64_t j) {
  double dot = 0.0;
  for (std::int64_t c = 0; c < p.head_dim; ++c)
    dot += static_cast<double>(detail::load_element(q, detail::offset4(q, b, i, h, c))) *
           static_cast<double>(detail::load_element(k, detail::offset4(k, b, j, kv_head, c)));
  return dot;
}

// lse = max + log_sum, kept in two parts: where |max| is so large that double cannot hold
// max + log Σ (a bias of float32's lowest on every key), P = e^((s − max) − log_sum) still
// sums to 1.
struct RowLse {
  double max = -std::numeric_limits<double>::infinity(), log_sum = 0.0;
  double lse() const { return max + log_sum; }
};

RowLse softmax_row(const AttentionProblem& p, const AttentionOptions& options, const TensorView& q,
                   const TensorView& k, const TensorView& v, std::int64_t b, std::int64_t h, std::int64_t i,
                   double* out_row, std::int64_t batch_offset) {
  const Semantics sem{&p, &options, batch_offset};
  const std::int64_t kv_head = h / (p.heads_q / p.heads_kv);
  std::fill(out_row, out_row + p.head_dim_v, 0.0);
  // S row (visible keys only) = score(q_i·k_j), P row = softmax(S row), o = Σ P·w·V.
  std::vector<std::int64_t> keys;
  std::vector<double> s;
  const AttentionProblem::KeyRange range = p.key_range(i);
  for (std::int64_t j = range.begin; j < range.end; ++j) {
    if (!sem.visible(i, j)) continue;
    const double sj = sem.score(b, h, i, j, dot_row(p, q, k, b, h, kv_head, i, j));
    if (sj == -std::numeric_limits<double>::infinity()) continue;  // hidden by attn_mask
    keys.push_back(j);
    s.push_back(sj);
  }
  // The sink: one more logit in the denominator, with no value.
  const double sink = p.sinks ? sem.sink(h) : -std::numeric_limits<double>::infinity();
  if (keys.empty()) return {sink, 0.0};
  const double m = std::max(*std::max_element(s.begin(), s.end()), sink);
  double sum = std::exp(sink - m);
  for (double& x : s) sum += (x = std::exp(x - m));
  for (std::size_t n = 0; n < keys.size(); ++n) {
    const std::int64_t j = keys[n];
    const double pj = s[n] / sum * sem.dropout_weight(b, h, i, j);
    for (std::int64_t c = 0; c < p.head_dim_v; ++c)
      out_row[c] += pj * static_cast<double>(detail::load_element(v, detail::offset4(v, b, j, kv_head, c)));
  }
  return {m, std::log(sum)};
}

}  // namespace

void attention_row(const AttentionProblem& p, const AttentionOptions& options, const TensorView& q,
                   const TensorView& k, const TensorView& v, std::int64_t b, std::int64_t h,
                   std::int64_t i, double* out_row, double* lse, std::int64_t batch_offset) {
  *lse = softmax_row(p, options, q, k, v, b, h, i, out_row, batch_offset).lse();
}

namespace {

// The first exception a row task threw inside an OpenMP region (a score hook's score_mod or
// mask_mod, a caller's function): kept, the other tasks skipped, and rethrown once the
// region has ended — an exception may not leave an OpenMP region (it ends the process).
class FirstException {
 public:
  template <class Task>
  void run(Task task) noexcept {
    if (failed_.load(std::memory_order_relaxed)) return;
    try {
      task();
    } catch (...) {
      if (!failed_.exchange(true)) error_ = std::current_exception();
    }
  }
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;
};

}  // namespace

Result attention(const TensorView& q, const TensorView& k, const TensorView& v,
                 const AttentionOptions& options) {
  const AttentionProblem p = AttentionProblem::from_inputs(q, k, v, options);
  Result r;
  r.out.resize(static_cast<std::size_t>(p.batch * p.seqlen_q * p.heads_q * p.head_dim_v));
  r.lse.resize(static_cast<std::size_t>(p.batch * p.heads_q * p.seqlen_q));
  FirstException errors;
#pragma omp parallel for collapse(3) schedule(dynamic, 16)
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads_q; ++h)
      for (std::int64_t i = 0; i < p.seqlen_q; ++i)
        errors.run([&] {
          attention_row(p, options, q, k, v, b, h, i,
                        &r.out[static_cast<std::size_t>(((b * p.seqlen_q + i) * p.heads_q + h) * p.head_dim_v)],
                        &r.lse[static_cast<std::size_t>((b * p.heads_q + h) * p.seqlen_q + i)]);
        });
  errors.rethrow();
  return r;
}

Tensor attention_probs(const TensorView& q, const TensorView& k, const TensorView& v,
                       const AttentionOptions& options, std::int64_t batch_offset) {
  const AttentionProblem p = AttentionProblem::from_inputs(q, k, v, options);
  const Semantics sem{&p, &options, batch_offset};
  Tensor probs(DType::f32, {p.batch, p.heads_q, p.seqlen_q, p.seqlen_k});
  float* out = probs.data_as<float>();
  const std::int64_t group = p.heads_q / p.heads_kv;
  FirstException errors;
#pragma omp parallel for collapse(3) schedule(dynamic, 16)
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads_q; ++h)
      for (std::int64_t i = 0; i < p.seqlen_q; ++i) errors.run([&] {
        std::vector<double> out_row(static_cast<std::size_t>(p.head_dim_v));
        const RowLse lse = softmax_row(p, options, q, k, v, b, h, i, out_row.data(), batch_offset);
        float* row = out + ((b * p.heads_q + h) * p.seqlen_q + i) * p.seqlen_k;
        for (std::int64_t j = 0; j < p.seqlen_k; ++j) {
          const bool seen = sem.visible(i, j) && !std::isinf(lse.max);
          const double sij = seen ? sem.score(b, h, i, j, dot_row(p, q, k, b, h, h / group, i, j)) : 0.0;
          row[j] = seen ? static_cast<float>(std::exp((sij - lse.max) - lse.log_sum) *
                                             sem.dropout_weight(b, h, i, j))
                        : 0.0f;
        }
      });
  errors.rethrow();
  return probs;
}

Gradients attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                             const TensorView& v, const AttentionOptions& options) {
  using detail::load_element;
  using detail::offset4;
  const AttentionProblem p = AttentionProblem::from_inputs(q, k, v, options);
  const Semantics sem{&p, &options};
  const std::int64_t d = p.head_dim, dv = p.head_dim_v, group = p.heads_q / p.heads_kv;
  Gradients g;
  g.dq.assign(static_cast<std::size_t>(p.batch * p.seqlen_q * p.heads_q * d), 0.0);
  g.dk.assign(static_cast<std::size_t>(p.batch * p.seqlen_k * p.heads_kv * d), 0.0);
  g.dv.assign(static_cast<std::size_t>(p.batch * p.seqlen_k * p.heads_kv * dv), 0.0);
  g.dsinks.assign(static_cast<std::size_t>(p.sinks ? p.heads_q : 0), 0.0);
  std::vector<double> dsinks_bh(static_cast<std::size_t>(p.sinks ? p.batch * p.heads_q : 0), 0.0);
  // With a bias: dS of every (b, h, i, j), summed into dbias once the rows are done.
  const bool bias = p.attn_mask == AttentionProblem::MaskKind::bias;
  std::vector<double> ds_all(static_cast<std::size_t>(bias ? p.batch * p.heads_q * p.seqlen_q * p.seqlen_k : 0), 0.0);
  // One (batch, kv head) per task: its dk/dv rows are written by nobody else.
  FirstException errors;
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t kvh = 0; kvh < p.heads_kv; ++kvh) errors.run([&] {
      std::vector<double> out_row(static_cast<std::size_t>(dv));
      for (std::int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
        for (std::int64_t i = 0; i < p.seqlen_q; ++i) {
          const RowLse lse = softmax_row(p, options, q, k, v, b, h, i, out_row.data(), 0);
          if (std::isinf(lse.max)) continue;  // no visible key: no gradient
          double delta = 0.0;  // D_i = rowsum(dO ∘ O) = Σ_j P_ij dP_ij
          for (std::int64_t c = 0; c < dv; ++c)
            delta += static_cast<double>(load_element(dout, offset4(dout, b, i, h, c))) *
                     out_row[static_cast<std::size_t>(c)];
          if (options.dlse.data != nullptr)  // ∂lse_i/∂s_ij = P_ij
            delta -= static_cast<double>(load_element(
                options.dlse, b * options.dlse.strides[0] + h * options.dlse.strides[1] + i * options.dlse.strides[2]));
          // d/dsink of Σ dO∘O + dlse·lse: the sink's probability e^{sink − lse} times (0 − D_i).
          if (p.sinks) dsinks_bh[static_cast<std::size_t>(b * p.heads_q + h)] -= std::exp((sem.sink(h) - lse.max) - lse.log_sum) * delta;
          const AttentionProblem::KeyRange range = p.key_range(i);
          for (std::int64_t j = range.begin; j < range.end; ++j) {
            if (!sem.visible(i, j)) continue;
            const double dot = dot_row(p, q, k, b, h, kvh, i, j);
            const double sij = sem.score(b, h, i, j, dot);
            if (sij == -std::numeric_limits<double>::infinity()) continue;  // hidden: no gradient
            const double pij = std::exp((sij - lse.max) - lse.log_sum);
            const double w = sem.dropout_weight(b, h, i, j);
            double dp = 0.0;  // dP_ij = w · dO_i·V_j
            for (std::int64_t c = 0; c < dv; ++c) {
              const double go = load_element(dout, offset4(dout, b, i, h, c));
              dp += go * static_cast<double>(load_element(v, offset4(v, b, j, kvh, c)));
              g.dv[static_cast<std::size_t>(((b * p.seqlen_k + j) * p.heads_kv + kvh) * dv + c)] += pij * w * go;
            }
            const double ds_masked = pij * (w * dp - delta);  // d/d(score after the mask step)
            if (bias) ds_all[static_cast<std::size_t>(((b * p.heads_q + h) * p.seqlen_q + i) * p.seqlen_k + j)] = ds_masked;
            const double ds = ds_masked * sem.score_gradient(b, h, i, j, dot);
            for (std::int64_t c = 0; c < d; ++c) {
              g.dq[static_cast<std::size_t>(((b * p.seqlen_q + i) * p.heads_q + h) * d + c)] +=
                  ds * static_cast<double>(load_element(k, offset4(k, b, j, kvh, c)));
              g.dk[static_cast<std::size_t>(((b * p.seqlen_k + j) * p.heads_kv + kvh) * d + c)] +=
                  ds * static_cast<double>(load_element(q, offset4(q, b, i, h, c)));
            }
          }
        }
    });
  errors.rethrow();
  for (std::int64_t b = 0; b < p.batch && p.sinks; ++b)
    for (std::int64_t h = 0; h < p.heads_q; ++h)
      g.dsinks[static_cast<std::size_t>(h)] += dsinks_bh[static_cast<std::size_t>(b * p.heads_q + h)];
  if (bias) {
    const auto& m = options.attn_mask.shape;
    g.dbias.assign(static_cast<std::size_t>(m[0] * m[1] * m[2] * m[3]), 0.0);
    for (std::int64_t b = 0; b < p.batch; ++b)
      for (std::int64_t h = 0; h < p.heads_q; ++h)
        for (std::int64_t i = 0; i < p.seqlen_q; ++i)
          for (std::int64_t j = 0; j < p.seqlen_k; ++j) {
            const std::int64_t at = (((m[0] > 1 ? b : 0) * m[1] + (m[1] > 1 ? h : 0)) * m[2] + (m[2] > 1 ? i : 0)) * m[3] +
                                    (m[3] > 1 ? j : 0);
            g.dbias[static_cast<std::size_t>(at)] +=
                ds_all[static_cast<std::size_t>(((b * p.heads_q + h) * p.seqlen_q + i) * p.seqlen_k + j)];
          }
  }
  return g;
}

}  // namespace flashattn::reference
