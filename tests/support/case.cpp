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

Fp8CacheTensors fp8_cache(const std::vector<std::int64_t>& shape) {
  Fp8CacheTensors c{Tensor(DType::u8, shape), Tensor(DType::u8, shape), Tensor(DType::f32, {shape[0], shape[2]}),
                    Tensor(DType::f32, {shape[0], shape[2]})};
  for (std::int64_t i = 0; i < c.k_codes.numel(); ++i) {
    c.k_codes.data_as<std::uint8_t>()[i] = static_cast<std::uint8_t>(i % 113);
    c.v_codes.data_as<std::uint8_t>()[i] = static_cast<std::uint8_t>(i % 101);
  }
  for (std::int64_t i = 0; i < c.k_scale.numel(); ++i) {
    c.k_scale.set(i, 0.5f);
    c.v_scale.set(i, 0.25f);
  }
  return c;
}

KvCache Fp8CacheTensors::cache() {
  KvCache c;
  c.k_cache = k_codes.view();
  c.v_cache = v_codes.view();
  c.k_scale = k_scale.view();
  c.v_scale = v_scale.view();
  return c;
}

}  // namespace flashattn::test
