// Variable-length packed batches: check the offsets, then run every sequence as its own
// (batch 1) problem on strided views of the packed tensors (sequences.hpp), every one
// checked before the first writes. The backend runs them one after the other.
#include <tuple>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/error.hpp"
#include "src/api/backend.hpp"
#include "src/api/checks.hpp"
#include "src/api/route.hpp"
#include "src/api/sequences.hpp"
#include "src/core/validate.hpp"

namespace flashattn {
namespace {

std::string str(std::int64_t v) { return std::to_string(v); }

struct Offsets {
  std::vector<std::int64_t> q, k;
  std::int64_t batch() const { return static_cast<std::int64_t>(q.size()) - 1; }
};

Offsets check_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                     const VarlenSeqlens& s, const AttentionOptions& options) {
  detail::check_view("q", q, 3, "(total_q, heads_q, head_dim)");
  detail::check_view("k", k, 3, "(total_k, heads_kv, head_dim)");
  detail::check_view("v", v, 3, "(total_k, heads_kv, head_dim_v)");
  if (v.shape[0] != k.shape[0])
    throw Error("v: total_k " + str(v.shape[0]) + " does not match k total_k " + str(k.shape[0]));
  if (options.block_mask.data != nullptr || options.block_mask.rank != 0)
    throw Error("block_mask: not supported with variable-length batches");
  detail::reject_attn_mask("the variable-length entry points", options);
  detail::reject_top_left("the variable-length entry points", options);
  detail::reject_score_hook("the variable-length entry points", options);
  Offsets o{detail::read_offsets("cu_seqlens_q", s.cu_seqlens_q, q.shape[0], s.max_seqlen_q, "max_seqlen_q"),
            detail::read_offsets("cu_seqlens_k", s.cu_seqlens_k, k.shape[0], s.max_seqlen_k, "max_seqlen_k")};
  if (o.q.size() != o.k.size())
    throw Error("cu_seqlens_k: " + str(static_cast<std::int64_t>(o.k.size())) + " offsets but cu_seqlens_q has " +
                str(static_cast<std::int64_t>(o.q.size())) + " (both are batch + 1)");
  return o;
}

// out (total_q, heads_q, head_dim_v) in q's dtype and lse (heads_q, total_q) float32, whole:
// the per-sequence checks see only the views cut from them.
void check_out_shapes(const TensorView& q, const TensorView& v, const TensorView& out,
                      const TensorView& lse) {
  detail::check_tensor("out", out, q.dtype, "out must have q's dtype", {q.shape[0], q.shape[1], v.shape[2]},
                       "(total_q, heads_q, head_dim_v)");
  detail::check_tensor("lse", lse, DType::f32, "lse is always float32", {q.shape[1], q.shape[0]}, "(heads_q, total_q)");
}

}  // namespace

void forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                    const VarlenSeqlens& seqlens, const MutableTensorView& out,
                    const MutableTensorView& lse, const AttentionOptions& options) {
  const detail::Backend& backend =
      detail::route("forward_varlen", &detail::Backend::forward_varlen,
                    {{"q", q}, {"k", k}, {"v", v}, {"cu_seqlens_q", seqlens.cu_seqlens_q},
                     {"cu_seqlens_k", seqlens.cu_seqlens_k}, {"out", out}, {"lse", lse}});
  const Offsets o = check_varlen(q, k, v, seqlens, options);
  check_out_shapes(q, v, out, lse);
  detail::check_outputs_apart({{"out", out}, {"lse", lse}},
                              {{"q", q}, {"k", k}, {"v", v}, {"cu_seqlens_q", seqlens.cu_seqlens_q},
                               {"cu_seqlens_k", seqlens.cu_seqlens_k}});
  detail::check_apart_from_options("out", out, options);
  detail::check_apart_from_options("lse", lse, options);
  detail::check_sequence_options(options, o.batch(), q.shape[1]);
  detail::reject_rescale_counts("forward_varlen", options);
  std::vector<detail::ForwardJob> jobs;
  for (std::int64_t b = 0; b < o.batch(); ++b) {
    const std::int64_t q0 = o.q[b], sq = o.q[b + 1] - q0, k0 = o.k[b], sk = o.k[b + 1] - k0;
    detail::ForwardJob job{{},
                           {.batch_offset = b},
                           detail::packed_sequence(q, q0, sq),
                           detail::packed_sequence(k, k0, sk),
                           detail::packed_sequence(v, k0, sk),
                           detail::packed_sequence(out, q0, sq),
                           detail::packed_lse(lse, q0, sq),
                           detail::sequence_options(options, b),
                           {}};
    job.problem = detail::check_forward_call(job.q, job.k, job.v, job.out, job.lse, job.options);
    backend.check_forward(job);
    jobs.push_back(job);
  }
  detail::begin_run(options);
  backend.forward_varlen(jobs);
}

ForwardResult forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                             const VarlenSeqlens& seqlens, const AttentionOptions& options) {
  detail::route("forward_varlen", &detail::Backend::forward_varlen,
                {{"q", q}, {"k", k}, {"v", v}, {"cu_seqlens_q", seqlens.cu_seqlens_q},
                 {"cu_seqlens_k", seqlens.cu_seqlens_k}});
  check_varlen(q, k, v, seqlens, options);
  ForwardResult r{Tensor(q.dtype, {q.shape[0], q.shape[1], v.shape[2]}),
                  Tensor(DType::f32, {q.shape[1], q.shape[0]})};
  forward_varlen(q, k, v, seqlens, r.out.view(), r.lse.view(), options);
  return r;
}

void backward_varlen(const TensorView& dout, const TensorView& q, const TensorView& k,
                     const TensorView& v, const TensorView& out, const TensorView& lse,
                     const VarlenSeqlens& seqlens, const MutableTensorView& dq,
                     const MutableTensorView& dk, const MutableTensorView& dv,
                     const AttentionOptions& options) {
  const detail::Backend& backend =
      detail::route("backward_varlen", &detail::Backend::backward_varlen,
                    {{"dout", dout}, {"q", q}, {"k", k}, {"v", v}, {"out", out}, {"lse", lse},
                     {"cu_seqlens_q", seqlens.cu_seqlens_q}, {"cu_seqlens_k", seqlens.cu_seqlens_k}, {"dq", dq},
                     {"dk", dk}, {"dv", dv}});
  const Offsets o = check_varlen(q, k, v, seqlens, options);
  check_out_shapes(q, v, out, lse);
  detail::check_sequence_options(options, o.batch(), q.shape[1]);
  detail::check_tensor("dout", dout, q.dtype, "dout must have q's dtype", {out.shape[0], out.shape[1], out.shape[2]},
                       "(total_q, heads_q, head_dim_v)");
  const std::tuple<const char*, TensorView, TensorView> grads[] = {{"dq", dq, q}, {"dk", dk, k}, {"dv", dv, v}};
  for (const auto& [name, grad, like] : grads)
    detail::check_tensor(name, grad, like.dtype, "gradients have their input's dtype",
                         {like.shape[0], like.shape[1], like.shape[2]}, "(the shape of its input)");
  detail::check_outputs_apart({{"dq", dq}, {"dk", dk}, {"dv", dv}},
                              {{"dout", dout}, {"q", q}, {"k", k}, {"v", v}, {"out", out}, {"lse", lse},
                               {"cu_seqlens_q", seqlens.cu_seqlens_q}, {"cu_seqlens_k", seqlens.cu_seqlens_k}});
  for (const auto& [name, grad] : {std::pair{"dq", dq}, {"dk", dk}, {"dv", dv}})
    detail::check_apart_from_options(name, grad, options);
  const bool dlse = options.dlse.data != nullptr || options.dlse.rank != 0;
  if (dlse)
    detail::check_tensor("dlse", options.dlse, DType::f32, "dlse is float32, as lse", {q.shape[1], q.shape[0]},
                         "(heads_q, total_q), lse's shape");
  std::vector<detail::BackwardJob> jobs;
  for (std::int64_t b = 0; b < o.batch(); ++b) {
    const std::int64_t q0 = o.q[b], sq = o.q[b + 1] - q0, k0 = o.k[b], sk = o.k[b + 1] - k0;
    detail::BackwardJob job{{},
                            {.batch_offset = b},
                            detail::packed_sequence(dout, q0, sq),
                            detail::packed_sequence(q, q0, sq),
                            detail::packed_sequence(k, k0, sk),
                            detail::packed_sequence(v, k0, sk),
                            detail::packed_sequence(out, q0, sq),
                            detail::packed_lse(lse, q0, sq),
                            detail::packed_sequence(dq, q0, sq),
                            detail::packed_sequence(dk, k0, sk),
                            detail::packed_sequence(dv, k0, sk),
                            detail::sequence_options(options, b)};
    if (dlse) job.options.dlse = detail::packed_lse(options.dlse, q0, sq);
    job.problem = detail::check_backward_call(job.dout, job.q, job.k, job.v, job.out, job.lse, job.dq, job.dk,
                                              job.dv, job.options);
    backend.check_backward(job);
    jobs.push_back(job);
  }
  detail::begin_run(options);
  backend.backward_varlen(jobs);
}

BackwardResult backward_varlen(const TensorView& dout, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& out, const TensorView& lse,
                               const VarlenSeqlens& seqlens, const AttentionOptions& options) {
  detail::route("backward_varlen", &detail::Backend::backward_varlen,
                {{"dout", dout}, {"q", q}, {"k", k}, {"v", v}, {"out", out}, {"lse", lse},
                 {"cu_seqlens_q", seqlens.cu_seqlens_q}, {"cu_seqlens_k", seqlens.cu_seqlens_k}});
  check_varlen(q, k, v, seqlens, options);
  BackwardResult r{Tensor(q.dtype, {q.shape[0], q.shape[1], q.shape[2]}),
                   Tensor(q.dtype, {k.shape[0], k.shape[1], k.shape[2]}),
                   Tensor(q.dtype, {v.shape[0], v.shape[1], v.shape[2]})};
  backward_varlen(dout, q, k, v, out, lse, seqlens, r.dq.view(), r.dk.view(), r.dv.view(), options);
  return r;
}

}  // namespace flashattn
