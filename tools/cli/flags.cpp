#include "tools/cli/flags.hpp"

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

}  // namespace flashattn::cli
