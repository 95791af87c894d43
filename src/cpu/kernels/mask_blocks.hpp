// The per-call summary of a boolean attn_mask, or of a float one (a bias) where the caller
// asks (docs/algorithm.md §6): one ScoreBlock — empty, partial or full (boolean only) — per
// (mask plane, block of rows, block of keys), built once by the driver in one pass over the mask; the forward's blocks are its micro-tile's row strips and
// key panels, the backward's its tiles. The kernels skip empty tiles and narrow each strip's
// keys to its non-empty blocks without reading the mask, apply nothing on full blocks and
// read the mask only in partial ones.
#pragma once

#include <cstdint>
#include <vector>

#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::cpu {

// What the kernels read: null `states` without a boolean mask. A size-1 query (key) dim of
// the mask is one block of block_rows = seqlen_q (block_cols = seqlen_k), so lookups need
// no case for broadcasting.
struct DenseMaskBlocks {
  const std::uint8_t* states = nullptr;  // ScoreBlock values, (planes, row_blocks, col_blocks)
  std::int64_t block_rows = 1, block_cols = 1;
  std::int64_t row_blocks = 0, col_blocks = 0;
  std::int64_t mask_batch = 1, mask_heads = 1;  // the mask's dims 0 and 1 (1 or batch, heads_q)
  // A boolean mask's partial blocks, copied out (null without them): slots as `states` (−1
  // where a block is not partial), bytes (slots, block_rows, block_cols), row-major within a
  // block, non-zero keeps the key — the kernels read these, contiguous and shared by the heads,
  // instead of rows of the mask a row apart (DenseMaskSummary keeps them within a budget).
  const std::int32_t* slots = nullptr;
  const std::uint8_t* keep = nullptr;
  // Per (plane, row block), at 2·(plane·row_blocks + row block): the column blocks from its
  // first non-empty one to past its last (an empty span where all are) — a tile outside every
  // span of its row blocks is empty without a look at its states (a document mask's other
  // documents).
  const std::int32_t* spans = nullptr;

  // The index of (batch, head)'s plane, and its offset in `states`.
  std::int64_t plane_index(std::int64_t batch, std::int64_t head) const {
    return (mask_batch > 1 ? batch : 0) * mask_heads + (mask_heads > 1 ? head : 0);
  }
  std::int64_t plane(std::int64_t batch, std::int64_t head) const {
    return plane_index(batch, head) * row_blocks * col_blocks;
  }
};

// The summary's storage, owned by the driver for the call. `mask` is options.attn_mask, of a
// problem of seqlen_q × seqlen_k: summarised when boolean, and when a bias with
// `bias_blocks` (its all −∞ blocks empty, the others partial; the backward, whose dbias
// covers every entry, does not ask); the blocks are block_rows × block_cols; the pass over
// the mask runs on `threads` threads. A boolean mask of full rows and columns (no size-1
// query or key dim) also has its partial blocks' bytes copied out where they fit
// create_block_mask's budget (flex::detail::partial_blocks_fit); a random mask has none.
class DenseMaskSummary {
 public:
  DenseMaskSummary() = default;
  DenseMaskSummary(const TensorView& mask, std::int64_t seqlen_q, std::int64_t seqlen_k, std::int64_t block_rows,
                   std::int64_t block_cols, int threads, bool bias_blocks = false);
  const DenseMaskBlocks& blocks() const { return blocks_; }

 private:
  // The boolean mask m's partial blocks into keep_, indexed by slots_, within the budget.
  void copy_partial_blocks(const std::uint8_t* m, const TensorView& mask, int threads);

  std::vector<std::uint8_t> states_;
  std::vector<std::int32_t> spans_;
  std::vector<std::int32_t> slots_;
  std::vector<std::uint8_t> keep_;
  DenseMaskBlocks blocks_;
};

}  // namespace flashattn::cpu
