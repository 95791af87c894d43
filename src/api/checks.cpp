#include "src/api/checks.hpp"

#include <cmath>
#include <string>
#include <utility>

#include "flashattn/error.hpp"
#include "src/core/validate.hpp"

namespace flashattn::detail {

void check_apart_from_options(const char* name, const TensorView& output, const AttentionOptions& options) {
  if (output.data == nullptr) return;
  for (const auto& [in_name, input] :
       {std::pair{"attn_mask", options.attn_mask}, {"alibi_slopes", options.alibi_slopes},
        {"block_mask", options.block_mask}, {"sinks", options.sinks}, {"dlse", options.dlse},
        {"score_hook.block_mask", options.score_hook.block_mask}})
    if (input.data != nullptr) check_no_overlap(name, output, in_name, input);
}

AttentionProblem check_forward_call(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const TensorView& out, const TensorView& lse, const AttentionOptions& options,
                                    OutputDtypes outputs) {
  AttentionProblem problem = AttentionProblem::from_inputs(q, k, v, options);
  if (outputs == OutputDtypes::inputs_or_f32 && out.dtype == DType::f32)
    check_forward_output_views(problem, q, k, v, out, lse);
  else
    check_forward_outputs(problem, q, k, v, out, lse);
  check_rescale_counts(problem, options, q, k, v, out, lse);
  for (const auto& [name, output] : {std::pair{"out", out}, {"lse", lse}, {"rescale_counts", options.rescale_counts}})
    check_apart_from_options(name, output, options);
  return problem;
}

AttentionProblem check_backward_call(const TensorView& dout, const TensorView& q, const TensorView& k,
                                     const TensorView& v, const TensorView& out, const TensorView& lse,
                                     const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                     const AttentionOptions& options, OutputDtypes grad_dtypes) {
  reject_rescale_counts("backward", options);
  AttentionProblem p = AttentionProblem::from_inputs(q, k, v, options);
  if (options.score_hook.score != nullptr && options.score_hook.derivative == nullptr)
    throw Error("score_hook: its score_mod has no derivative, which backward needs (write it generic over "
                "flex::Dual or wrap it in flex::WithDerivative, flex.hpp)");
  constexpr const char* kOutLayout = "(batch, seqlen_q, heads_q, head_dim_v)";
  check_tensor("dout", dout, q.dtype, "dout must have q's dtype", {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v},
               kOutLayout);
  check_tensor("out", out, q.dtype, "out must have q's dtype", {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v},
               kOutLayout);
  check_tensor("lse", lse, DType::f32, "lse is always float32", {p.batch, p.heads_q, p.seqlen_q},
               "(batch, heads_q, seqlen_q)");
  const std::pair<const char*, const TensorView*> grads[] = {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}};
  const TensorView* like[] = {&q, &k, &v};
  for (int g = 0; g < 3; ++g) {
    const auto& [name, grad] = grads[g];
    const TensorView& ref = *like[g];
    const bool f32 = grad_dtypes == OutputDtypes::inputs_or_f32 && grad->dtype == DType::f32;
    check_tensor(name, *grad, f32 ? DType::f32 : ref.dtype, "gradients have their input's dtype",
                 {ref.shape[0], ref.shape[1], ref.shape[2], ref.shape[3]}, "(the shape of its input)");
    check_output_layout(name, *grad);
    for (const auto& [in_name, input] :
         {std::pair{"dout", dout}, {"q", q}, {"k", k}, {"v", v}, {"out", out}, {"lse", lse}})
      check_no_overlap(name, *grad, in_name, input);
    check_apart_from_options(name, *grad, options);
    for (int o = 0; o < g; ++o) check_no_overlap(name, *grad, grads[o].first, *grads[o].second);
  }
  if (options.dlse.data != nullptr || options.dlse.rank != 0)
    check_tensor("dlse", options.dlse, DType::f32, "dlse is float32, as lse", {p.batch, p.heads_q, p.seqlen_q},
                 "(batch, heads_q, seqlen_q), lse's shape");
  if (options.dsinks.data != nullptr || options.dsinks.rank != 0) {
    if (!p.sinks) throw Error("dsinks: set without sinks");
    check_tensor("dsinks", options.dsinks.on(Device::cpu), DType::f32, "dsinks is float32", {p.heads_q}, "(heads_q)");
    check_output_layout("dsinks", options.dsinks);
    for (const auto& [in_name, input] :
         {std::pair{"dout", dout}, {"q", q}, {"k", k}, {"v", v}, {"out", out}, {"lse", lse}, {"dq", dq}, {"dk", dk},
          {"dv", dv}})
      check_no_overlap("dsinks", options.dsinks, in_name, input);
    check_apart_from_options("dsinks", options.dsinks, options);
  }
  if (options.dbias.data != nullptr || options.dbias.rank != 0) {
    const TensorView& bias = options.attn_mask;
    if (p.attn_mask != AttentionProblem::MaskKind::bias)
      throw Error(std::string("dbias: set without a float attn_mask (") +
                  (p.attn_mask == AttentionProblem::MaskKind::none ? "none is set" : "a boolean mask has no gradient") +
                  ")");
    if (options.score_hook.apply != nullptr)
      throw Error("dbias: not supported with a score_hook (the bias gradient would need score_mod's derivative "
                  "apart from the softcap's)");
    check_tensor("dbias", options.dbias.on(Device::cpu), DType::f32, "dbias is float32",
                 {bias.shape[0], bias.shape[1], bias.shape[2], bias.shape[3]}, "(attn_mask's shape)");
    check_output_layout("dbias", options.dbias);
    for (const auto& [in_name, input] :
         {std::pair{"dout", dout}, {"q", q}, {"k", k}, {"v", v}, {"out", out}, {"lse", lse}, {"dq", dq}, {"dk", dk},
          {"dv", dv}, {"dsinks", options.dsinks}})
      check_no_overlap("dbias", options.dbias, in_name, input);
    check_apart_from_options("dbias", options.dbias, options);
  }
  return p;
}

AttentionProblem check_forward_fp8_call(const Fp8View& q, const Fp8View& k, const Fp8View& v, const TensorView& out,
                                        const TensorView& lse, const AttentionOptions& options) {
  reject_attn_mask("forward_fp8", options);
  reject_top_left("forward_fp8", options);
  reject_score_hook("forward_fp8", options);
  check_fp8_input("q", q);
  check_fp8_input("k", k);
  check_fp8_input("v", v);
  // The problem of the values the codes stand for: the codes' shapes, in float32.
  auto values = [](const TensorView& codes) {
    TensorView shape = codes;
    shape.dtype = DType::f32;
    return shape;
  };
  AttentionProblem problem = AttentionProblem::from_inputs(values(q.codes), values(k.codes), values(v.codes), options);
  // Unrescaled probabilities reach 2^threshold and must stay within e4m3's range.
  const float max_threshold = std::floor(std::log2(fp8_info(Fp8Format::e4m3).max));
  if (problem.rescale_threshold > max_threshold)
    throw Error("rescale_threshold: at most " + std::to_string(max_threshold) +
                " with FP8 probabilities (P <= 2^threshold must fit e4m3's max 448), got " +
                std::to_string(problem.rescale_threshold));
  check_forward_output_views(problem, q.codes, k.codes, v.codes, out, lse);
  check_rescale_counts(problem, options, q.codes, k.codes, v.codes, out, lse);
  for (const auto& [name, output] : {std::pair{"out", out}, {"lse", lse}, {"rescale_counts", options.rescale_counts}}) {
    if (output.data == nullptr) continue;
    for (const auto& [in_name, descale] : {std::pair{"q_descale", q.descale}, {"k_descale", k.descale},
                                           {"v_descale", v.descale}})
      check_no_overlap(name, output, in_name, descale);
    check_apart_from_options(name, output, options);
  }
  return problem;
}

bool check_cache_pools(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                       const PoolScales& k, const PoolScales& v, const char* k_layout, const char* v_layout) {
  if (!is_floating(q.dtype)) throw Error("q: dtype " + to_string(q.dtype) + " is not a floating dtype (f32, bf16, f16)");
  check_view("k_cache", k_cache, 4, k_layout);
  check_view("v_cache", v_cache, 4, v_layout);
  const bool quantized = k_cache.dtype == DType::u8;
  if (quantized) {
    check_dtype("v_cache", v_cache, DType::u8, "a quantized cache holds codes (e4m3, u8 or s8) in both pools");
  } else {
    check_dtype("k_cache", k_cache, q.dtype, "the cache has q's dtype, or u8 for quantized codes");
    check_dtype("v_cache", v_cache, q.dtype, "the cache has q's dtype");
    if (k.scale.data != nullptr || k.scale.rank != 0 || v.scale.data != nullptr || v.scale.rank != 0)
      throw Error("k_scale, v_scale: descales belong to an FP8 cache (u8 codes), not a " + to_string(q.dtype) + " cache");
    reject_pool_scales(k, q.dtype);
    reject_pool_scales(v, q.dtype);
  }
  for (int d : {0, 1, 2})
    if (v_cache.shape[d] != k_cache.shape[d])
      throw Error("v_cache: shape " + shape_string(v_cache) + " does not match k_cache " + shape_string(k_cache) +
                  " in dim " + std::to_string(d));
  if (k_cache.shape[3] != q.shape[q.rank - 1])
    throw Error("k_cache: head_dim " + std::to_string(k_cache.shape[3]) + " does not match q's " +
                std::to_string(q.shape[q.rank - 1]));
  if (quantized) {
    check_pool_scales(k, k_cache);
    check_pool_scales(v, v_cache);
  }
  return quantized;
}

}  // namespace flashattn::detail
