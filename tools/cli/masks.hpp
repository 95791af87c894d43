// The mask bench cases (`bench --ops masks`, issue 24): a causal document mask over packed
// documents as a mask_mod with its block mask, as forward_varlen over the documents and as a
// dense boolean attn_mask, beside the unmasked kernel on the same tokens; and a relative-bias
// score_mod beside plain causal. GFLOP/s count the visible pairs only (4·D flops each).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace flashattn::cli {

struct MaskCase {
  std::string name;
  std::int64_t documents = 8, document_tokens = 512;  // packed into one sequence of their sum
  std::int64_t heads = 8, dim = 64;
  // create_block_mask's block (FlexAttention's default): the kernels get it as blocks of 32
  // (BlockMask::kernel_blocks).
  std::int64_t block = 128;
  DType dtype = DType::f32;
  int threads = 0;

  // Issue 24's: 8 documents of 512 tokens, 8 heads, D 64, float32.
  static MaskCase issue();
  // A small one of the same kinds, for the CLI smoke test.
  static MaskCase smoke();
  std::int64_t tokens() const { return documents * document_tokens; }
};

// One form, timed (forward, median of the repeats).
struct MaskRun {
  std::string form;  // unmasked, causal, mask_mod, varlen, dense_bool, score_mod
  double seconds = 0.0;
  double visible_pairs = 0.0;  // (query, key) pairs the form keeps, over every head
  double gflops = 0.0;         // 4·D·visible_pairs / seconds
  std::string kernel;          // the plan's
  double max_diff = 0.0;       // max |out − varlen's out| for the document forms, else 0
};

struct MaskMeasurement {
  double create_block_mask_seconds = 0.0;  // once per mask (median)
  std::vector<MaskRun> runs;               // in the order of MaskRun::form's list
  const MaskRun& run(const std::string& form) const;
};
MaskMeasurement measure_masks(const MaskCase& c, int repeats);

}  // namespace flashattn::cli
