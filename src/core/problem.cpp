#include "flashattn/problem.hpp"

#include <cmath>
#include <sstream>

#include "flashattn/error.hpp"
#include "validate.hpp"

namespace flashattn {
namespace {

constexpr const char* kQLayout = "(batch, seqlen_q, heads_q, head_dim)";
constexpr const char* kKLayout = "(batch, seqlen_k, heads_kv, head_dim)";
constexpr const char* kVLayout = "(batch, seqlen_k, heads_kv, head_dim_v)";

void require(bool ok, const std::string& message) {
  if (!ok) throw Error(message);
}

std::string str(std::int64_t v) { return std::to_string(v); }

}  // namespace

AttentionProblem AttentionProblem::from_sizes(std::int64_t batch, std::int64_t seqlen_q,
                                              std::int64_t seqlen_k, std::int64_t heads_q,
                                              std::int64_t heads_kv, std::int64_t head_dim,
                                              std::int64_t head_dim_v, DType dtype,
                                              const AttentionOptions& options) {
  require(batch >= 0, "batch: must be >= 0, got " + str(batch));
  require(seqlen_q >= 0, "seqlen_q: must be >= 0, got " + str(seqlen_q));
  require(seqlen_k >= 0, "seqlen_k: must be >= 0, got " + str(seqlen_k));
  require(heads_q >= 1, "heads_q: must be >= 1, got " + str(heads_q));
  require(heads_kv >= 1, "heads_kv: must be >= 1, got " + str(heads_kv));
  require(heads_q % heads_kv == 0, "heads: q has " + str(heads_q) +
                                       " heads, not a multiple of k/v's " + str(heads_kv) +
                                       " heads (grouped-query attention needs heads_q = "
                                       "g · heads_kv)");
  require(head_dim >= 1 && head_dim <= kMaxHeadDim,
          "head_dim: " + str(head_dim) + " out of range [1, " + str(kMaxHeadDim) + "]");
  require(head_dim_v >= 1 && head_dim_v <= kMaxHeadDim,
          "head_dim_v: " + str(head_dim_v) + " out of range [1, " + str(kMaxHeadDim) + "]");
  if (options.softmax_scale)
    require(std::isfinite(*options.softmax_scale),
            "softmax_scale: must be finite, got " + std::to_string(*options.softmax_scale));
  require(options.num_threads >= 0,
          "num_threads: must be >= 0 (0 = all cores), got " + str(options.num_threads));

  AttentionProblem p;
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.head_dim = head_dim;
  p.head_dim_v = head_dim_v;
  p.dtype = dtype;
  p.causal = options.causal;
  p.softmax_scale = options.softmax_scale
                        ? *options.softmax_scale
                        : static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  return p;
}

AttentionProblem AttentionProblem::from_inputs(const TensorView& q, const TensorView& k,
                                               const TensorView& v,
                                               const AttentionOptions& options) {
  detail::check_view("q", q, 4, kQLayout);
  detail::check_view("k", k, 4, kKLayout);
  detail::check_view("v", v, 4, kVLayout);
  detail::check_dtype("k", k, q.dtype, "k must have q's dtype");
  detail::check_dtype("v", v, q.dtype, "v must have q's dtype");
  require(k.shape[0] == q.shape[0], "k: batch " + str(k.shape[0]) +
                                        " does not match q batch " + str(q.shape[0]));
  require(v.shape[0] == q.shape[0], "v: batch " + str(v.shape[0]) +
                                        " does not match q batch " + str(q.shape[0]));
  require(v.shape[1] == k.shape[1], "v: seqlen " + str(v.shape[1]) +
                                        " does not match k seqlen " + str(k.shape[1]));
  require(v.shape[2] == k.shape[2], "v: heads " + str(v.shape[2]) +
                                        " does not match k heads " + str(k.shape[2]));
  require(k.shape[3] == q.shape[3], "k: head_dim " + str(k.shape[3]) +
                                        " does not match q head_dim " + str(q.shape[3]));
  return from_sizes(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
                    v.shape[3], q.dtype, options);
}

std::int64_t AttentionProblem::visible_keys(std::int64_t row) const {
  if (!causal) return seqlen_k;
  const std::int64_t last = row + seqlen_k - seqlen_q;  // last visible key index
  return last < 0 ? 0 : (last + 1 < seqlen_k ? last + 1 : seqlen_k);
}

double AttentionProblem::forward_flops() const {
  double scores = 0.0;
  if (!causal) {
    scores = static_cast<double>(seqlen_q) * static_cast<double>(seqlen_k);
  } else {
    for (std::int64_t i = 0; i < seqlen_q; ++i) scores += static_cast<double>(visible_keys(i));
  }
  return 2.0 * scores * static_cast<double>(head_dim + head_dim_v) *
         static_cast<double>(batch * heads_q);
}

double AttentionProblem::conventional_forward_flops() const {
  const double full = 4.0 * static_cast<double>(batch) * static_cast<double>(heads_q) *
                      static_cast<double>(seqlen_q) * static_cast<double>(seqlen_k) *
                      static_cast<double>(head_dim);
  return causal ? full / 2.0 : full;
}

std::string AttentionProblem::describe() const {
  std::ostringstream s;
  s << "batch=" << batch << " seqlen_q=" << seqlen_q << " seqlen_k=" << seqlen_k
    << " heads_q=" << heads_q << " heads_kv=" << heads_kv << " head_dim=" << head_dim
    << " head_dim_v=" << head_dim_v << " dtype=" << to_string(dtype)
    << " causal=" << (causal ? "true" : "false") << " softmax_scale=" << softmax_scale;
  return s.str();
}

}  // namespace flashattn
