#include "tests/support/case.hpp"

#include <cmath>
#include <sstream>
#include <utility>

#include "tools/support/random_inputs.hpp"

namespace flashattn::test {

Case::Case(const Shape& shape, DType dtype, AttentionOptions options, std::uint64_t seed)
    : shape_(shape),
      problem_(AttentionProblem::from_sizes(shape.batch, shape.seqlen_q, shape.seqlen_k, shape.heads_q,
                                            shape.heads_kv, shape.head_dim, shape.head_dim_v, dtype, options)),
      options_(std::move(options)),
      seed_(seed) {}

Case Case::with(const std::function<void(AttentionOptions&)>& edit) const {
  AttentionOptions options = options_;
  edit(options);
  Case c(shape_, problem_.dtype, std::move(options), seed_);
  c.alibi_slopes_ = alibi_slopes_;
  return c;
}

Case Case::with_alibi() const {
  auto slopes = std::make_shared<Tensor>(DType::f32, std::vector<std::int64_t>{shape_.heads_q});
  for (std::int64_t h = 0; h < shape_.heads_q; ++h) slopes->set(h, std::exp2(-1.0f - 0.5f * static_cast<float>(h)));
  Case c = with([&](AttentionOptions& o) { o.alibi_slopes = std::as_const(*slopes).view(); });
  c.alibi_slopes_ = std::move(slopes);
  return c;
}

Inputs Case::inputs() const {
  support::Qkv qkv = support::random_inputs(problem_, seed_);
  const AttentionProblem& p = problem_;
  return {std::move(qkv.q), std::move(qkv.k), std::move(qkv.v),
          support::random_tensor(p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}, seed_ + 3)};
}

std::string Case::describe() const {
  const AttentionOptions& o = options_;
  std::ostringstream s;
  s << problem_.describe() << " threads=" << o.num_threads;
  if (o.num_splits != 0) s << " num_splits=" << o.num_splits;
  if (o.block_q != 0) s << " block_q=" << o.block_q;
  if (o.kernel != ForwardKernel::automatic) s << " kernel=" << to_string(o.kernel);
  if (o.backward_kernel != BackwardKernel::automatic) s << " backward_kernel=" << to_string(o.backward_kernel);
  if (o.deterministic) s << " deterministic";
  s << " input_seed=" << seed_;
  return s.str();
}

}  // namespace flashattn::test
