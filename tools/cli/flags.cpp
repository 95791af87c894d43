#include "tools/cli/flags.hpp"

#include <algorithm>
#include <tuple>

#include "tools/support/npy.hpp"

namespace flashattn::cli {

AttentionOptions ShapeFlags::options() const {
  AttentionOptions o;
  o.causal = causal;
  o.softmax_scale = softmax_scale;
  o.num_threads = threads;
  o.num_splits = num_splits;
  o.kernel = parse_forward_kernel(kernel);
  o.backward_kernel = parse_backward_kernel(backward_kernel);
  if (pack_gqa != "auto") o.pack_gqa = pack_gqa == "on";
  return o;
}

AttentionProblem ShapeFlags::problem(const std::optional<AttentionOptions>& o) const {
  return AttentionProblem::from_sizes(batch, seqlen_q.value_or(seqlen), seqlen_k.value_or(seqlen),
                                      heads, heads_kv.value_or(heads), dim, dim_v.value_or(dim),
                                      parse_dtype(dtype), o ? *o : options());
}

void VariantFlags::apply(AttentionOptions& o) {
  if (!window_size.empty()) o.window_size = {window_size[0], window_size[1]};
  o.softcap = softcap;
  o.dropout_p = dropout_p;
  o.seed = seed;
  if (!alibi_slopes_path.empty()) {
    alibi_slopes = support::read_npy(alibi_slopes_path);
    o.alibi_slopes = alibi_slopes.view();
  }
  if (!block_mask_path.empty()) {
    block_mask = support::read_npy(block_mask_path);
    o.block_mask = block_mask.view();
    o.block_mask_block_size = block_size;
  }
  if (!attn_mask_path.empty()) {
    attn_mask = support::read_npy(attn_mask_path);
    o.attn_mask = attn_mask.view();
  }
}

bool VariantFlags::needs_flashattn_only() const {
  return softcap > 0.0f || dropout_p > 0.0f || !alibi_slopes_path.empty() || !block_mask_path.empty() ||
         !attn_mask_path.empty();
}

VarlenOffsets read_varlen_offsets(const std::string& q_path, const std::string& k_path) {
  VarlenOffsets o;
  o.q = support::read_npy(q_path);
  o.k = support::read_npy(k_path);
  for (const auto& [flag, t, at, longest] :
       {std::tuple{"--cu-seqlens-q", &o.q, &o.at_q, &o.max_q}, std::tuple{"--cu-seqlens-k", &o.k, &o.at_k, &o.max_k}}) {
    if (t->dtype() != DType::i32 || t->shape().size() != 1 || t->numel() < 2)
      throw Error(std::string(flag) + ": expected int32 offsets of rank 1, at least two (0 and the total), got " +
                  to_string(t->dtype()) + " of shape (" + std::to_string(t->shape().empty() ? 0 : t->shape()[0]) +
                  (t->shape().size() == 1 ? ")" : ", ...) of rank " + std::to_string(t->shape().size())));
    const std::int32_t* x = t->data_as<std::int32_t>();
    at->assign(x, x + t->numel());
    if (at->front() != 0) throw Error(std::string(flag) + ": must start at 0, got " + std::to_string(at->front()));
    for (std::size_t b = 1; b < at->size(); ++b) {
      if ((*at)[b] < (*at)[b - 1])
        throw Error(std::string(flag) + ": decreasing at " + std::to_string(b) + " (" + std::to_string((*at)[b - 1]) +
                    ", then " + std::to_string((*at)[b]) + ")");
      *longest = std::max(*longest, (*at)[b] - (*at)[b - 1]);
    }
  }
  if (o.at_q.size() != o.at_k.size())
    throw Error("--cu-seqlens-q: " + std::to_string(o.at_q.size()) + " offsets but --cu-seqlens-k has " +
                std::to_string(o.at_k.size()) + " (one sequence each: as many of both)");
  return o;
}

}  // namespace flashattn::cli
