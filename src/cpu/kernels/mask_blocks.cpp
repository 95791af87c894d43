// DenseMaskSummary (mask_blocks.hpp): one pass over attn_mask, a boolean row block's
// columns folded into bits (which columns some row keeps, which some row hides) on the CPU's
// widest SIMD target (foreach_target, dispatched once per call), its blocks classified from
// the bits.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/cpu/kernels/mask_blocks.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include <algorithm>
#include <bit>
#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Over the rows [0, rows) of a block of a boolean mask, row 0 at `row`, rows `stride` bytes
// apart, columns [0, n): bit c of `kept` (word c / 64, bit c % 64) set where some row keeps
// column c (a byte not 0), of `hidden` where some row hides it (a byte 0); the ceil(n / 64)
// words of each are written whole. A vector of columns at a time through every row, its
// minimum and maximum in registers, then compared with zero into bits (StoreMaskBits): one
// load a row and vector, no byte of the block stored.
void RowBlockBits(const std::uint8_t* HWY_RESTRICT row, std::int64_t stride, std::int64_t rows, std::int64_t n,
                  std::uint64_t* HWY_RESTRICT kept, std::uint64_t* HWY_RESTRICT hidden) {
  const hn::ScalableTag<std::uint8_t> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t words = (n + 63) / 64;
  std::fill(kept, kept + words, std::uint64_t{0});
  std::fill(hidden, hidden + words, std::uint64_t{0});
  std::int64_t c = 0;
  // Whole bytes of bits a vector (not HWY_SCALAR's one lane), in the words' byte order.
  if (lanes % 8 == 0 && std::endian::native == std::endian::little) {
    auto* kept_bytes = reinterpret_cast<std::uint8_t*>(kept);
    auto* hidden_bytes = reinterpret_cast<std::uint8_t*>(hidden);
    const auto zero = hn::Zero(d);
    // Two vectors of columns a pass through the rows: half the loop's own instructions.
    for (; c + 2 * lanes <= n; c += 2 * lanes) {
      auto low0 = hn::LoadU(d, row + c), high0 = low0;
      auto low1 = hn::LoadU(d, row + c + lanes), high1 = low1;
      for (const std::uint8_t* r = row + stride + c; r < row + rows * stride + c; r += stride) {
        const auto v0 = hn::LoadU(d, r), v1 = hn::LoadU(d, r + lanes);
        low0 = hn::Min(low0, v0);
        high0 = hn::Max(high0, v0);
        low1 = hn::Min(low1, v1);
        high1 = hn::Max(high1, v1);
      }
      hn::StoreMaskBits(d, hn::Ne(high0, zero), kept_bytes + c / 8);
      hn::StoreMaskBits(d, hn::Eq(low0, zero), hidden_bytes + c / 8);
      hn::StoreMaskBits(d, hn::Ne(high1, zero), kept_bytes + (c + lanes) / 8);
      hn::StoreMaskBits(d, hn::Eq(low1, zero), hidden_bytes + (c + lanes) / 8);
    }
    for (; c + lanes <= n; c += lanes) {
      auto low = hn::LoadU(d, row + c), high = low;
      for (std::int64_t i = 1; i < rows; ++i) {
        const auto v = hn::LoadU(d, row + i * stride + c);
        low = hn::Min(low, v);
        high = hn::Max(high, v);
      }
      hn::StoreMaskBits(d, hn::Ne(high, zero), kept_bytes + c / 8);
      hn::StoreMaskBits(d, hn::Eq(low, zero), hidden_bytes + c / 8);
    }
  }
  for (; c < n; ++c) {
    bool keeps = false, hides = false;
    for (std::int64_t i = 0; i < rows; ++i) {
      keeps = keeps || row[i * stride + c] != 0;
      hides = hides || row[i * stride + c] == 0;
    }
    kept[c / 64] |= std::uint64_t{keeps} << (c % 64);
    hidden[c / 64] |= std::uint64_t{hides} << (c % 64);
  }
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <omp.h>

#include "flashattn/flex.hpp"
#include "flashattn/options.hpp"  // classify_block
#include "src/cpu/kernels/mask_blocks.hpp"

namespace flashattn::cpu {

HWY_EXPORT(RowBlockBits);

namespace {

// Bits [c0, c1) of `bits` (bit c in word c / 64, as RowBlockBits), shifted to bit 0; at
// most 64 of them.
std::uint64_t bit_field(const std::uint64_t* bits, std::int64_t c0, std::int64_t c1) {
  const auto first = static_cast<std::uint64_t>(c0), width = static_cast<std::uint64_t>(c1 - c0);
  const std::uint64_t word = first / 64, offset = first % 64;
  std::uint64_t field = bits[word] >> offset;
  if (offset + width > 64) field |= bits[word + 1] << (64 - offset);  // offset > 0 here
  return width < 64 ? field & ((std::uint64_t{1} << width) - 1) : field;
}

// Is some bit of columns [c0, c1) set? (c0 < c1)
bool any_bit(const std::uint64_t* bits, std::int64_t c0, std::int64_t c1) {
  for (; c0 < c1; c0 += 64)
    if (bit_field(bits, c0, std::min(c1, c0 + 64)) != 0) return true;
  return false;
}

// The state of columns [c0, c1) from the row block's bits: empty where no column is kept,
// full where none is hidden (a boolean mask; a bias's kept blocks are partial: its values
// are still to be added).
ScoreBlock block_state(const std::uint64_t* kept, const std::uint64_t* hidden, std::int64_t c0, std::int64_t c1,
                       bool boolean) {
  if (!any_bit(kept, c0, c1)) return ScoreBlock::empty;
  return classify_block(true, !boolean || any_bit(hidden, c0, c1));
}

// states[k] = the state of block k of `block` columns of [0, n) (block_state). Where blocks
// tile the 64-bit words (block divides 64: the forward's key panels) a word's blocks are
// its fields, read off in place; bits at and past n are 0, so a last short block reads as
// its columns.
void classify_blocks(const std::uint64_t* kept, const std::uint64_t* hidden, std::int64_t n, std::int64_t block,
                     bool boolean, std::uint8_t* states) {
  const std::int64_t blocks = (n + block - 1) / block;
  if (64 % block != 0) {
    for (std::int64_t k = 0; k < blocks; ++k)
      states[k] = static_cast<std::uint8_t>(block_state(kept, hidden, k * block, std::min(n, (k + 1) * block), boolean));
    return;
  }
  const auto width = static_cast<std::uint64_t>(block);
  const std::uint64_t field = width == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << width) - 1;
  for (std::int64_t k = 0; k < blocks; ++k) {
    const auto bit = static_cast<std::uint64_t>(k) * width;
    const std::uint64_t keeps = kept[bit / 64] >> (bit % 64) & field;
    const std::uint64_t hides = hidden[bit / 64] >> (bit % 64) & field;
    states[k] = static_cast<std::uint8_t>(classify_block(keeps != 0, !boolean || hides != 0));
  }
}

// Is every block of `block` columns of [0, n) partial?
bool all_blocks_partial(const std::uint64_t* kept, const std::uint64_t* hidden, std::int64_t n, std::int64_t block,
                        bool boolean) {
  for (std::int64_t c0 = 0; c0 < n; c0 += block)
    if (block_state(kept, hidden, c0, std::min(n, c0 + block), boolean) != ScoreBlock::partial) return false;
  return true;
}

// The first kept column of [0, n) and one past the last, or {n, 0} where none is.
std::pair<std::int64_t, std::int64_t> kept_columns(const std::uint64_t* kept, std::int64_t n) {
  const std::int64_t words = (n + 63) / 64;
  std::int64_t first = n, last = 0;
  for (std::int64_t w = 0; w < words; ++w)
    if (kept[w] != 0) {
      first = w * 64 + std::countr_zero(kept[w]);
      break;
    }
  for (std::int64_t w = words - 1; w >= 0; --w)
    if (kept[w] != 0) {
      last = w * 64 + 64 - std::countl_zero(kept[w]);
      break;
    }
  return {first, last};
}

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
  const auto row_block_bits = HWY_DYNAMIC_DISPATCH(RowBlockBits);
  // Each thread's kept and hidden bits and, for a bias, its row block's visible bytes:
  // allocated here, where running out of memory is an exception for the caller. A word
  // more for each of the bits: StoreMaskBits may write 8 bytes where it stores fewer.
  const std::int64_t words = (cols + 63) / 64 + 1, visible_words = boolean ? 0 : (cols + 7) / 8;
  const std::int64_t thread_words = 2 * words + visible_words;
  const int team = std::max(threads, 1);
  std::vector<std::uint64_t> scratch(static_cast<std::size_t>(team * thread_words));
  // One (plane, row block) per iteration. A boolean mask's rows at once (RowBlockBits); a
  // bias's row by row (is each entry −∞?, vectorised by the compiler), then its visible
  // bytes into bits. Every column block is then classified from the bits.
#pragma omp parallel num_threads(team)
  {
    std::uint64_t* kept = scratch.data() + omp_get_thread_num() * thread_words;
    std::uint64_t* hidden = kept + words;
    auto* visible = reinterpret_cast<std::uint8_t*>(hidden + words);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t item = 0; item < planes * b.row_blocks; ++item) {
      const std::int64_t plane = item / b.row_blocks, rb = item % b.row_blocks;
      const std::int64_t base = plane / b.mask_heads * mask.strides[0] + plane % b.mask_heads * mask.strides[1];
      const std::int64_t row_begin = rb * b.block_rows, row_end = std::min(rows, row_begin + b.block_rows);
      const std::int64_t row_stride = mask.strides[2];
      const std::uint8_t* first_row = m + (base + row_begin * row_stride) * element;
      if (boolean) {
        // Every column block partial in the block's first row (a random mask's usual case)
        // settles the row block; its first block decides whether to look.
        const std::int64_t first_block = std::min(cols, b.block_cols);
        row_block_bits(first_row, row_stride, 1, first_block, kept, hidden);
        bool settled = false;
        if (row_end - row_begin > 1 &&
            block_state(kept, hidden, 0, first_block, true) == ScoreBlock::partial) {
          row_block_bits(first_row, row_stride, 1, cols, kept, hidden);
          settled = all_blocks_partial(kept, hidden, cols, b.block_cols, true);
        }
        if (!settled) row_block_bits(first_row, row_stride, row_end - row_begin, cols, kept, hidden);
      } else {
        std::fill(visible, visible + cols, std::uint8_t{0});
        bool settled = false;
        for (std::int64_t i = row_begin; i < row_end && !settled; ++i) {
          const std::uint8_t* row = m + (base + i * row_stride) * element;
          switch (mask.dtype) {
            case DType::f32: OrNotMinusInfinity<std::uint32_t>(row, cols, 0xFF800000u, visible); break;
            case DType::bf16: OrNotMinusInfinity<std::uint16_t>(row, cols, 0xFF80u, visible); break;
            default: OrNotMinusInfinity<std::uint16_t>(row, cols, 0xFC00u, visible); break;  // f16
          }
          // A finite value in every column block after the block's first row settles it.
          if (i == row_begin && i + 1 < row_end) {
            row_block_bits(visible, 0, 1, cols, kept, hidden);
            settled = all_blocks_partial(kept, hidden, cols, b.block_cols, false);
          }
        }
        if (!settled) row_block_bits(visible, 0, 1, cols, kept, hidden);
      }
      std::uint8_t* states = states_.data() + item * b.col_blocks;
      classify_blocks(kept, hidden, cols, b.block_cols, boolean, states);
      const auto [first, last] = kept_columns(kept, cols);
      spans_[static_cast<std::size_t>(2 * item)] = static_cast<std::int32_t>(first < last ? first / b.block_cols : 0);
      spans_[static_cast<std::size_t>(2 * item + 1)] =
          static_cast<std::int32_t>(first < last ? (last - 1) / b.block_cols + 1 : 0);
    }
  }
  b.states = states_.data();
  b.spans = spans_.data();
  if (boolean && rows > 1 && cols > 1) copy_partial_blocks(m, mask, threads);
}

void DenseMaskSummary::copy_partial_blocks(const std::uint8_t* m, const TensorView& mask, int threads) {
  DenseMaskBlocks& b = blocks_;
  const std::int64_t count = std::count(states_.begin(), states_.end(), static_cast<std::uint8_t>(ScoreBlock::partial));
  const std::int64_t size = b.block_rows * b.block_cols, rows = mask.shape[2], cols = mask.shape[3];
  if (!flex::detail::partial_blocks_fit(count, b.block_rows, b.block_cols, b.mask_batch * b.mask_heads, rows, cols))
    return;
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
