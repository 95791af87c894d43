// The option groups several subcommands share, as plain values: the shape flags (named the
// same way in every subcommand) and the attention variants. main.cpp, the one file that
// sees the command-line parser, declares them and fills these structs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace flashattn::cli {

// decode, decode_fp16 or decode_bf16 by name: kernels of bench's decode cases only.
inline bool is_decode_kernel(const std::string& kernel) { return kernel.rfind("decode", 0) == 0; }

struct ShapeFlags {
  std::int64_t batch = 1;
  std::int64_t seqlen = 4096;
  std::optional<std::int64_t> seqlen_q, seqlen_k;
  std::int64_t heads = 16;
  std::optional<std::int64_t> heads_kv;
  std::int64_t dim = 128;
  std::optional<std::int64_t> dim_v;
  std::string dtype = "bf16";
  bool causal = true;
  std::optional<float> softmax_scale;
  int threads = 0;
  int num_splits = 0;
  std::string kernel = "auto";  // AttentionOptions::kernel by name
  std::string backward_kernel = "auto";  // AttentionOptions::backward_kernel by name
  std::string pack_gqa = "auto";         // AttentionOptions::pack_gqa: auto (unset), on, off

  // A benchmark's forward or backward case of this dtype: a --kernel tiled_bf16 request applies
  // to its bf16 cases, the others (f32) keep the planner's choice, so that one run times both;
  // a decode kernel applies to the decode cases only (bench.cpp), never to these.
  void set_case_dtype(const std::string& case_dtype) {
    dtype = case_dtype;
    if ((kernel == "tiled_bf16" && dtype != "bf16") || is_decode_kernel(kernel)) kernel = "auto";
    if (backward_kernel == "tiled_bf16" && dtype != "bf16") backward_kernel = "auto";
  }
  AttentionOptions options() const;
  // Validated problem of these sizes with `options` (by default this->options()).
  AttentionProblem problem(const std::optional<AttentionOptions>& options = std::nullopt) const;
};

// The attention variants, named as upstream's Python arguments; side inputs come from
// .npy files and stay alive here while options point at them.
struct VariantFlags {
  std::vector<std::int64_t> window_size;  // (left, right), −1 = unbounded
  float softcap = 0.0f;
  std::string alibi_slopes_path;  // float32 (heads_q) or (batch, heads_q)
  float dropout_p = 0.0f;
  std::uint64_t seed = 0;
  std::string block_mask_path;  // bool/uint8 (q blocks, k blocks)
  std::int64_t block_size = 0;
  std::string attn_mask_path;  // bool/uint8 mask or float bias, rank 4, broadcastable to (B, Hq, Sq, Sk)
  Tensor alibi_slopes, block_mask, attn_mask;

  // Loads the files and sets the variant fields of `options`.
  void apply(AttentionOptions& options);
  bool needs_flashattn_only() const;  // beyond what the standard baseline implements
};

// A packed variable-length batch's offsets, from the .npy files of --cu-seqlens-q and
// --cu-seqlens-k: int32, rank 1, as many of each (at least two), each from 0 and
// non-decreasing — an Error naming the flag otherwise, before any offset is used as a length.
struct VarlenOffsets {
  Tensor q, k;                      // as read, for VarlenSeqlens
  std::vector<std::int64_t> at_q, at_k;
  std::int64_t max_q = 0, max_k = 0;  // the longest sequence
  std::int64_t batch() const { return static_cast<std::int64_t>(at_q.size()) - 1; }
};
VarlenOffsets read_varlen_offsets(const std::string& q_path, const std::string& k_path);

}  // namespace flashattn::cli
