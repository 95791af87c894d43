// DenseMaskSummary (mask_blocks.hpp): one pass over attn_mask, its boolean rows' running
// minimum and maximum on the CPU's widest SIMD target (foreach_target, dispatched once per call).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/cpu/kernels/mask_blocks.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>

#include "flashattn/options.hpp"  // classify_block

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// low[c] = min(low[c], row[c]), high[c] = max(high[c], row[c]) for c < n.
void MinMaxBytes(const std::uint8_t* HWY_RESTRICT row, std::int64_t n, std::uint8_t* HWY_RESTRICT low,
                 std::uint8_t* HWY_RESTRICT high) {
  const hn::ScalableTag<std::uint8_t> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t c = 0;
  for (; c + lanes <= n; c += lanes) {
    const auto v = hn::LoadU(d, row + c);
    hn::StoreU(hn::Min(hn::LoadU(d, low + c), v), d, low + c);
    hn::StoreU(hn::Max(hn::LoadU(d, high + c), v), d, high + c);
  }
  for (; c < n; ++c) {
    low[c] = std::min(low[c], row[c]);
    high[c] = std::max(high[c], row[c]);
  }
}

// The same for rows 1..rows − 1 of a block whose row 0 is at `row` (rows `stride` bytes
// apart): a vector of columns at a time through every row, its running minimum and
// maximum in registers — one load a row and vector, where MinMaxBytes row by row loads and
// stores low and high for each.
void MinMaxRows(const std::uint8_t* HWY_RESTRICT row, std::int64_t stride, std::int64_t rows, std::int64_t n,
                std::uint8_t* HWY_RESTRICT low, std::uint8_t* HWY_RESTRICT high) {
  const hn::ScalableTag<std::uint8_t> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t c = 0;
  for (; c + lanes <= n; c += lanes) {
    auto vlo = hn::LoadU(d, low + c), vhi = hn::LoadU(d, high + c);
    for (std::int64_t i = 1; i < rows; ++i) {
      const auto v = hn::LoadU(d, row + i * stride + c);
      vlo = hn::Min(vlo, v);
      vhi = hn::Max(vhi, v);
    }
    hn::StoreU(vlo, d, low + c);
    hn::StoreU(vhi, d, high + c);
  }
  for (; c < n; ++c)
    for (std::int64_t i = 1; i < rows; ++i) {
      low[c] = std::min(low[c], row[i * stride + c]);
      high[c] = std::max(high[c], row[i * stride + c]);
    }
}

// Whether some byte of high[c0, c1) is not 0 (some entry of the block kept) and some byte of
// low[c0, c1) is 0 (some entry hidden): vectors of 16 bytes (a forward key panel is 8-32
// bytes, a backward tile's 128) tested against zero — no reduction of the bytes themselves,
// whose horizontal minimum and maximum cost a dozen shuffles a block on AVX2.
HWY_INLINE void BlockKeptHidden(const std::uint8_t* HWY_RESTRICT low, const std::uint8_t* HWY_RESTRICT high,
                                std::int64_t c0, std::int64_t c1, bool& kept, bool& hidden) {
  const hn::CappedTag<std::uint8_t, 16> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t c = c0;
  kept = false;
  hidden = false;
  if (c + lanes <= c1) {
    auto vlo = hn::LoadU(d, low + c), vhi = hn::LoadU(d, high + c);
    for (c += lanes; c + lanes <= c1; c += lanes) {
      vlo = hn::Min(vlo, hn::LoadU(d, low + c));
      vhi = hn::Max(vhi, hn::LoadU(d, high + c));
    }
    const auto zero = hn::Zero(d);
    kept = !hn::AllTrue(d, hn::Eq(vhi, zero));
    hidden = !hn::AllFalse(d, hn::Eq(vlo, zero));
  }
  for (; c < c1; ++c) {
    kept = kept || high[c] != 0;
    hidden = hidden || low[c] == 0;
  }
}

// Each block of `block` bytes of [0, n) (the last may be shorter) classified from the running
// minimum (low) and maximum (high) of its entries over the rows read — empty, full or partial
// (classify_block) — into states; `boolean` false (a bias: its values are still to be added)
// makes every block that keeps an entry partial.
void BlockStates(const std::uint8_t* HWY_RESTRICT low, const std::uint8_t* HWY_RESTRICT high, std::int64_t n,
                 std::int64_t block, bool boolean, std::uint8_t* HWY_RESTRICT states) {
  for (std::int64_t c0 = 0, k = 0; c0 < n; c0 += block, ++k) {
    bool kept, hidden;
    BlockKeptHidden(low, high, c0, std::min(n, c0 + block), kept, hidden);
    states[k] = static_cast<std::uint8_t>(classify_block(kept, hidden || !boolean));
  }
}

// Whether BlockStates would make every block partial; false at the first that is not.
bool AllBlocksPartial(const std::uint8_t* HWY_RESTRICT low, const std::uint8_t* HWY_RESTRICT high, std::int64_t n,
                      std::int64_t block, bool boolean) {
  for (std::int64_t c0 = 0; c0 < n; c0 += block) {
    bool kept, hidden;
    BlockKeptHidden(low, high, c0, std::min(n, c0 + block), kept, hidden);
    if (classify_block(kept, hidden || !boolean) != ScoreBlock::partial) return false;
  }
  return true;
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "flashattn/flex.hpp"
#include "src/cpu/kernels/mask_blocks.hpp"

namespace flashattn::cpu {

HWY_EXPORT(MinMaxBytes);
HWY_EXPORT(MinMaxRows);
HWY_EXPORT(BlockStates);
HWY_EXPORT(AllBlocksPartial);

namespace {

// visible[c] |= (entry c of the row is not −∞), from the entries' bits (−∞ has one pattern).
template <class Bits>
void OrNotMinusInfinity(const void* row_data, std::int64_t n, Bits minus_infinity, std::uint8_t* __restrict visible) {
  const auto* __restrict row = static_cast<const Bits*>(row_data);
  for (std::int64_t c = 0; c < n; ++c) visible[c] |= static_cast<std::uint8_t>(row[c] != minus_infinity);
}

}  // namespace

DenseMaskSummary::DenseMaskSummary(const TensorView& mask, std::int64_t seqlen_q, std::int64_t seqlen_k,
                                   std::int64_t block_rows, std::int64_t block_cols, int threads, bool bias_blocks) {
  if (mask.data == nullptr || (mask.dtype != DType::u8 && !bias_blocks)) return;
  const bool boolean = mask.dtype == DType::u8;
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
  spans_.resize(static_cast<std::size_t>(2 * planes * b.row_blocks));
  const auto* m = static_cast<const std::uint8_t*>(mask.data);
  const std::int64_t element = static_cast<std::int64_t>(dtype_size(mask.dtype));
  const auto min_max = HWY_DYNAMIC_DISPATCH(MinMaxBytes);
  const auto min_max_rows = HWY_DYNAMIC_DISPATCH(MinMaxRows);
  const auto block_states = HWY_DYNAMIC_DISPATCH(BlockStates);
  const auto all_blocks_partial = HWY_DYNAMIC_DISPATCH(AllBlocksPartial);
  // One (plane, row block) per iteration: element-wise over its rows (whole rows, the last
  // dim contiguous where it is longer than 1; a boolean mask's on the widest SIMD target,
  // its first row alone and the others together (MinMaxRows), a bias's row by row,
  // vectorised by the compiler), then each column block classified (BlockStates). A boolean
  // mask's block is empty where its largest entry is 0, full where its smallest is not; a
  // bias's is empty where every entry is −∞, else partial (its values are still to be added).
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (std::int64_t item = 0; item < planes * b.row_blocks; ++item) {
    const std::int64_t plane = item / b.row_blocks, rb = item % b.row_blocks;
    const std::int64_t base = plane / b.mask_heads * mask.strides[0] + plane % b.mask_heads * mask.strides[1];
    const std::int64_t row_end = std::min(rows, (rb + 1) * b.block_rows);
    std::vector<std::uint8_t> lowest(static_cast<std::size_t>(cols), 0xFF), highest(lowest.size(), 0);
    // Locals and restrict: a byte store may alias anything, the loop's bound included.
    std::uint8_t* __restrict low = lowest.data();
    std::uint8_t* __restrict high = highest.data();
    const std::int64_t n = cols, row_stride = mask.strides[2];
    for (std::int64_t i = rb * b.block_rows; i < row_end; ++i) {
      const std::uint8_t* row = m + (base + i * row_stride) * element;
      switch (mask.dtype) {
        case DType::u8: min_max(row, n, low, high); break;
        case DType::f32: OrNotMinusInfinity<std::uint32_t>(row, n, 0xFF800000u, high); break;
        case DType::bf16: OrNotMinusInfinity<std::uint16_t>(row, n, 0xFF80u, high); break;
        default: OrNotMinusInfinity<std::uint16_t>(row, n, 0xFC00u, high); break;  // f16
      }
      // Every column block partial after the block's first row — a bias with a finite value
      // in each, a boolean mask with both values in each (a random mask's usual case) —
      // settles the row block: its other rows are not read.
      if (i == rb * b.block_rows && i + 1 < row_end && all_blocks_partial(low, high, cols, b.block_cols, boolean)) break;
      if (boolean) {  // the block's other rows at once (row i is in low and high)
        min_max_rows(row, row_stride, row_end - i, n, low, high);
        break;
      }
    }
    std::uint8_t* states = states_.data() + item * b.col_blocks;
    block_states(low, high, cols, b.block_cols, boolean, states);
    const auto empty = [&](std::int64_t block) { return static_cast<ScoreBlock>(states[block]) == ScoreBlock::empty; };
    std::int64_t first = 0, end = b.col_blocks;
    while (first < end && empty(first)) ++first;
    while (end > first && empty(end - 1)) --end;
    spans_[static_cast<std::size_t>(2 * item)] = static_cast<std::int32_t>(first);
    spans_[static_cast<std::size_t>(2 * item + 1)] = static_cast<std::int32_t>(end);
  }
  b.states = states_.data();
  b.spans = spans_.data();
  if (boolean && rows > 1 && cols > 1) copy_partial_blocks(m, mask, threads);
}

void DenseMaskSummary::copy_partial_blocks(const std::uint8_t* m, const TensorView& mask, int threads) {
  DenseMaskBlocks& b = blocks_;
  const std::int64_t count = std::count(states_.begin(), states_.end(), static_cast<std::uint8_t>(ScoreBlock::partial));
  const std::int64_t size = b.block_rows * b.block_cols, rows = mask.shape[2], cols = mask.shape[3];
  if (!flex::detail::partial_blocks_fit(count, size, b.mask_batch * b.mask_heads, rows, cols)) return;
  slots_.resize(states_.size());
  const std::vector<std::int64_t> at =
      flex::detail::number_partial_blocks(states_.data(), static_cast<std::int64_t>(states_.size()), slots_.data());
  keep_.assign(static_cast<std::size_t>(count * size), 0);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::int64_t slot = 0; slot < count; ++slot) {
    const std::int64_t e = at[static_cast<std::size_t>(slot)], cb = e % b.col_blocks;
    const std::int64_t rb = e / b.col_blocks % b.row_blocks, plane = e / (b.col_blocks * b.row_blocks);
    const std::int64_t base = plane / b.mask_heads * mask.strides[0] + plane % b.mask_heads * mask.strides[1];
    const std::int64_t c0 = cb * b.block_cols, width = std::min(cols, c0 + b.block_cols) - c0;
    for (std::int64_t r = 0; r < b.block_rows && rb * b.block_rows + r < rows; ++r)
      std::copy_n(m + base + (rb * b.block_rows + r) * mask.strides[2] + c0, width,
                  keep_.data() + slot * size + r * b.block_cols);
  }
  b.slots = slots_.data();
  b.keep = keep_.data();
}

}  // namespace flashattn::cpu
#endif  // HWY_ONCE
