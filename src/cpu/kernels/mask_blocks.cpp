#include "src/cpu/kernels/mask_blocks.hpp"

#include <algorithm>

namespace flashattn::cpu {

DenseMaskSummary::DenseMaskSummary(const TensorView& mask, std::int64_t seqlen_q, std::int64_t seqlen_k,
                                   std::int64_t block_rows, std::int64_t block_cols, int threads) {
  if (mask.data == nullptr || mask.dtype != DType::u8) return;
  const std::int64_t rows = mask.shape[2], cols = mask.shape[3];
  DenseMaskBlocks& b = blocks_;
  b.block_rows = rows > 1 ? block_rows : std::max<std::int64_t>(seqlen_q, 1);
  b.block_cols = cols > 1 ? block_cols : std::max<std::int64_t>(seqlen_k, 1);
  b.row_blocks = (rows + b.block_rows - 1) / b.block_rows;
  b.col_blocks = (cols + b.block_cols - 1) / b.block_cols;
  b.mask_batch = mask.shape[0];
  b.mask_heads = mask.shape[1];
  const std::int64_t planes = b.mask_batch * b.mask_heads;
  states_.resize(static_cast<std::size_t>(planes * b.row_blocks * b.col_blocks));
  const auto* m = static_cast<const std::uint8_t*>(mask.data);
  // One (plane, row block) per iteration, its rows in storage order: the smallest and the
  // largest entry of each row's span of each column block, byte min / max reductions the
  // compiler vectorises (the last dim is contiguous where it is longer than 1). A block is
  // empty where its largest entry is 0, full where its smallest is not.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (std::int64_t item = 0; item < planes * b.row_blocks; ++item) {
    const std::int64_t plane = item / b.row_blocks, rb = item % b.row_blocks;
    const std::int64_t base = plane / b.mask_heads * mask.strides[0] + plane % b.mask_heads * mask.strides[1];
    const std::int64_t row_end = std::min(rows, (rb + 1) * b.block_rows);
    std::vector<std::uint8_t> lowest(static_cast<std::size_t>(b.col_blocks), 0xFF), highest(lowest.size(), 0);
    for (std::int64_t i = rb * b.block_rows; i < row_end; ++i) {
      const std::uint8_t* row = m + base + i * mask.strides[2];
      for (std::int64_t cb = 0; cb < b.col_blocks; ++cb) {
        const std::int64_t c0 = cb * b.block_cols, c1 = std::min(cols, c0 + b.block_cols);
        std::uint8_t lo = 0xFF, hi = 0;
        for (std::int64_t c = c0; c < c1; ++c) {
          lo = std::min(lo, row[c]);
          hi = std::max(hi, row[c]);
        }
        const auto at = static_cast<std::size_t>(cb);
        lowest[at] = std::min(lowest[at], lo);
        highest[at] = std::max(highest[at], hi);
      }
    }
    std::uint8_t* states = states_.data() + item * b.col_blocks;
    for (std::size_t cb = 0; cb < lowest.size(); ++cb)
      states[cb] = static_cast<std::uint8_t>(highest[cb] == 0  ? ScoreBlock::empty
                                             : lowest[cb] != 0 ? ScoreBlock::full
                                                               : ScoreBlock::partial);
  }
  b.states = states_.data();
}

}  // namespace flashattn::cpu
