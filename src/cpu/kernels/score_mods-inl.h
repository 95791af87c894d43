// The attention variants applied to one row of a score tile (docs/algorithm.md §6), shared by the
// forward and backward kernels, compiled per Highway target. Scores arrive in log2 units
// (Q was pre-scaled by softmax_scale·log2e); the float64 reference states the same
// semantics in natural units (src/core/reference.cpp, Semantics).
#if defined(FLASHATTN_CPU_SCORE_MODS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHATTN_CPU_SCORE_MODS_INL_H_
#undef FLASHATTN_CPU_SCORE_MODS_INL_H_
#else
#define FLASHATTN_CPU_SCORE_MODS_INL_H_
#endif

#include <hwy/cache_control.h>
#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include "flashattn/dropout.hpp"
#include "flashattn/online_softmax.hpp"
#include "flashattn/options.hpp"
#include "flashattn/problem.hpp"
#include "src/core/element.hpp"
#include "src/core/problem_internals.hpp"
#include "src/cpu/kernels/mask_blocks.hpp"
#include "src/cpu/kernels/strip_keys.hpp"
#include "src/cpu/kernels/tile_ops-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The variants of one (batch, head), resolved once per work item.
struct RowMods {
  const AttentionProblem* problem;
  const TensorView* block_mask;  // null when there is none
  float softcap2 = 0.0f;         // softcap·log2e, 0 when off
  float alibi_slope2 = 0.0f;     // slope·log2e, 0 when off
  bool alibi = false;
  std::uint32_t dropout_threshold = 0;
  float dropout_scale = 1.0f;  // 1/(1 − p)
  std::int64_t batch = 0, head = 0;  // batch counts from internals.batch_offset (varlen, KV cache)
  bool fp8_probabilities = false;    // forward_fp8: P rounded to e4m3 before P·V
  // options.attn_mask (null when there is none) and, broadcast, the offset of this (batch,
  // head)'s plane and its row and column strides (0 along a size-1 dim).
  const TensorView* attn_mask = nullptr;
  std::int64_t mask_base = 0, mask_row_stride = 0, mask_col_stride = 0;
  // attn_mask's block summary (null without one: a bias in the backward) and this (batch,
  // head)'s plane in it.
  const DenseMaskBlocks* mask_blocks = nullptr;
  std::int64_t mask_blocks_plane = 0;
  const std::int32_t* mask_spans = nullptr;  // the plane's row blocks' spans (DenseMaskBlocks::spans)
  // options.score_hook (null when there is none) and, where it has a block mask, the
  // offset of this (batch, head)'s plane in it (docs/algorithm.md §6.2).
  const ScoreHook* hook = nullptr;
  std::int64_t hook_blocks_base = 0;
  // Its partial blocks' kept bytes (ScoreHook::partial_slots, null without them) and this
  // (batch, head)'s plane in the slots.
  const std::int32_t* hook_slots = nullptr;
  std::int64_t hook_slots_base = 0;

  RowMods(const AttentionProblem& p, const detail::ProblemInternals& internals, const TensorView& alibi_slopes,
          const TensorView& mask, const TensorView& dense_mask, const DenseMaskBlocks& dense_blocks,
          const ScoreHook& score_hook, std::int64_t b, std::int64_t h)
      : problem(&p), block_mask(p.block_mask_block_size > 0 ? &mask : nullptr),
        batch(b + internals.batch_offset), head(h), fp8_probabilities(internals.fp8_probabilities) {
    if (score_hook.apply != nullptr) {
      hook = &score_hook;
      const TensorView& m = score_hook.block_mask;
      if (score_hook.block_size > 0)
        hook_blocks_base = (m.shape[0] > 1 ? batch * m.strides[0] : 0) + (m.shape[1] > 1 ? h * m.strides[1] : 0);
      if (const TensorView& slots = score_hook.partial_slots; slots.data != nullptr) {
        hook_slots = static_cast<const std::int32_t*>(slots.data);
        hook_slots_base =
            (slots.shape[0] > 1 ? batch * slots.strides[0] : 0) + (slots.shape[1] > 1 ? h * slots.strides[1] : 0);
      }
    }
    if (p.attn_mask != AttentionProblem::MaskKind::none) {
      attn_mask = &dense_mask;
      const auto stride = [&](int d) { return dense_mask.shape[d] > 1 ? dense_mask.strides[d] : 0; };
      mask_base = batch * stride(0) + h * stride(1);
      mask_row_stride = stride(2);
      mask_col_stride = stride(3);
      if (dense_blocks.states != nullptr) {
        mask_blocks = &dense_blocks;
        mask_blocks_plane = dense_blocks.plane(batch, h);
        mask_spans = dense_blocks.spans + 2 * dense_blocks.plane_index(batch, h) * dense_blocks.row_blocks;
      }
    }
    constexpr float kLog2e = OnlineSoftmaxState::kLog2e;
    softcap2 = p.softcap * kLog2e;
    alibi = p.alibi;
    if (alibi) {
      const float slope = alibi_slopes.rank == 1
                              ? detail::load_element(alibi_slopes, h * alibi_slopes.strides[0])
                              : detail::load_element(alibi_slopes, batch * alibi_slopes.strides[0] +
                                                                       h * alibi_slopes.strides[1]);
      alibi_slope2 = slope * kLog2e;
    }
    if (p.dropout_p > 0.0f) {
      dropout_threshold = flashattn::dropout_threshold(p.dropout_p);
      dropout_scale = 1.0f / (1.0f - p.dropout_p);
    }
  }

  bool block_kept(std::int64_t i, std::int64_t j) const {
    const std::int64_t bs = problem->block_mask_block_size;
    return detail::load_element(*block_mask, (i / bs) * block_mask->strides[0] +
                                                 (j / bs) * block_mask->strides[1]) != 0.0f;
  }

  // The ScoreBlock of the score hook's block mask holding (i, j); partial without one.
  ScoreBlock hook_block(std::int64_t i, std::int64_t j) const {
    if (hook->block_size == 0) return ScoreBlock::partial;
    const TensorView& m = hook->block_mask;
    const std::int64_t bs = hook->block_size;
    return static_cast<ScoreBlock>(
        static_cast<const std::uint8_t*>(m.data)[hook_blocks_base + (i / bs) * m.strides[2] + (j / bs) * m.strides[3]]);
  }

  // The slot in ScoreHook::partial_keep of query i's block `block` of keys (−1: its bytes are
  // not held); hook_slots must be set.
  std::int32_t hook_slot(std::int64_t i, std::int64_t block) const {
    const TensorView& slots = hook->partial_slots;
    return hook_slots[hook_slots_base + (i / hook->block_size) * slots.strides[2] + block * slots.strides[3]];
  }

  // Is any block of the score hook's block mask that meets the tile not empty? True without one.
  bool hook_keeps_any(std::int64_t i0, std::int64_t rows, std::int64_t j0, std::int64_t n) const {
    if (hook == nullptr || hook->block_size == 0) return true;
    const std::int64_t bs = hook->block_size;
    for (std::int64_t i = i0 / bs * bs; i < i0 + rows; i += bs)
      for (std::int64_t j = j0 / bs * bs; j < j0 + n; j += bs)
        if (hook_block(i, j) != ScoreBlock::empty) return true;
    return false;
  }

  // The keys [begin, end) outside which the blocks of attn_mask's summary and of the score
  // hook's block mask hide every key from the queries [i0, i0 + rows) (whole blocks: a
  // document mask's other documents); every key without them. A tile beyond them holds no
  // work, and the walks of tile_has_work need not visit it.
  std::pair<std::int64_t, std::int64_t> kept_keys(std::int64_t i0, std::int64_t rows) const {
    std::int64_t begin = 0, end = problem->seqlen_k;
    const auto narrow = [&](std::int64_t first_block, std::int64_t end_block, std::int64_t width) {
      begin = std::max(begin, first_block * width);
      end = std::min(end, end_block * width);
    };
    if (mask_blocks != nullptr) {
      const DenseMaskBlocks& m = *mask_blocks;
      std::int64_t first = m.col_blocks, last = 0;
      for (std::int64_t bi = i0 / m.block_rows; bi <= (i0 + rows - 1) / m.block_rows; ++bi)
        if (mask_spans[2 * bi] < mask_spans[2 * bi + 1]) {
          first = std::min<std::int64_t>(first, mask_spans[2 * bi]);
          last = std::max<std::int64_t>(last, mask_spans[2 * bi + 1]);
        }
      narrow(first, last, m.block_cols);
    }
    if (hook != nullptr && hook->block_size > 0) {
      const TensorView& m = hook->block_mask;
      const std::int64_t bs = hook->block_size, blocks = m.shape[3];
      std::int64_t first = blocks, last = 0;
      for (std::int64_t bi = i0 / bs; bi <= (i0 + rows - 1) / bs; ++bi) {
        const std::uint8_t* row = static_cast<const std::uint8_t*>(m.data) + hook_blocks_base + bi * m.strides[2];
        const auto kept = [&](std::int64_t bj) { return static_cast<ScoreBlock>(row[bj * m.strides[3]]) != ScoreBlock::empty; };
        std::int64_t lo = 0, hi = blocks;
        while (lo < hi && !kept(lo)) ++lo;
        while (hi > lo && !kept(hi - 1)) --hi;
        if (lo < hi) first = std::min(first, lo), last = std::max(last, hi);
      }
      narrow(first, last, bs);
    }
    return {begin, std::max(begin, end)};
  }

  // Narrows columns [lo, hi) of a tile (keys j0 + c) for the queries [first, last] to those
  // between the first and the last block that a block mask keeps for any of them — the
  // attn_mask's summary, the score hook's block mask, the block-sparse block_mask:
  // every key outside is hidden from every one of those queries, so a strip of rows on a
  // mask's diagonal computes about its visible blocks, as FindStripKeys does for causal.
  void narrow_span(std::int64_t first, std::int64_t last, std::int64_t j0, std::int64_t& lo, std::int64_t& hi) const {
    // Drops whole blocks of `width` keys from both ends while `hidden(block's first key)`.
    const auto trim = [&](std::int64_t width, auto hidden) {
      while (lo < hi && hidden(j0 + lo)) lo = ((j0 + lo) / width + 1) * width - j0;
      while (hi > lo && hidden(j0 + hi - 1)) hi = std::max(lo, (j0 + hi - 1) / width * width - j0);
    };
    const std::int64_t rows = last - first + 1;
    if (mask_blocks != nullptr)
      trim(mask_blocks->block_cols, [&](std::int64_t j) { return !dense_mask_keeps_any(first, rows, j, 1); });
    if (hook != nullptr && hook->block_size > 0)
      trim(hook->block_size, [&](std::int64_t j) { return !hook_keeps_any(first, rows, j, 1); });
    if (block_mask != nullptr)
      trim(problem->block_mask_block_size, [&](std::int64_t j) { return !block_mask_keeps_any(first, rows, j, 1); });
  }

  // Narrows [lo, hi) further by whole panels of `panel` keys (tile-relative, as the strips'
  // spans are rounded) that no query of [first, last] keeps by the score hook's bytes of its
  // partial blocks (ScoreHook::partial_keep): within a document mask's diagonal block, a strip
  // of rows computes to its last row's diagonal, not to the block's end. Nothing without the
  // bytes.
  void narrow_to_kept_bytes(std::int64_t first, std::int64_t last, std::int64_t j0, std::int64_t panel,
                            std::int64_t& lo, std::int64_t& hi) const {
    if (hook_slots == nullptr) return;
    while (lo < hi) {
      const std::int64_t end = std::min(hi, (lo / panel + 1) * panel);
      if (hook_keeps_key_of(first, last, j0 + lo, j0 + end)) break;
      lo = end;
    }
    while (hi > lo) {
      const std::int64_t begin = std::max(lo, (hi - 1) / panel * panel);
      if (hook_keeps_key_of(first, last, j0 + begin, j0 + hi)) break;
      hi = begin;
    }
  }

  // May a query of [first, last] keep a key of [j_begin, j_end)? By the bytes of a partial
  // block that holds them; true where the keys span two blocks or a query's block is full or
  // partial without bytes (mask_mod decides there).
  bool hook_keeps_key_of(std::int64_t first, std::int64_t last, std::int64_t j_begin, std::int64_t j_end) const {
    const std::int64_t bs = hook->block_size, block = j_begin / bs;
    if ((j_end - 1) / bs != block) return true;
    const std::uint8_t* keep = static_cast<const std::uint8_t*>(hook->partial_keep.data);
    for (std::int64_t i = first; i <= last; ++i) {
      const ScoreBlock state = hook_block(i, j_begin);
      if (state == ScoreBlock::empty) continue;
      const std::int32_t slot = state == ScoreBlock::partial ? hook_slot(i, block) : -1;
      if (slot < 0) return true;
      const std::uint8_t* row = keep + (slot * bs + i % bs) * bs;  // the block's keys from block·bs
      for (std::int64_t j = j_begin; j < j_end; ++j)
        if (row[j - block * bs] != 0) return true;
    }
    return false;
  }

  // Does apply() only hide scores (set them to −∞), never change a visible one? Then a
  // positive factor on the scores commutes with it (the softmax may take unscaled scores).
  bool only_hides() const {
    return softcap2 == 0.0f && !alibi && hook == nullptr &&
           (attn_mask == nullptr || problem->attn_mask == AttentionProblem::MaskKind::boolean);
  }

  // Is the only change apply() makes to a visible score the addition of a bias read per key
  // (a float attn_mask whose summary makes every block it does not hide partial)? Then the
  // products may leave S unscaled and apply() scale it as it adds the bias (score_scale).
  bool only_adds_bias() const {
    return softcap2 == 0.0f && !alibi && hook == nullptr && problem->attn_mask == AttentionProblem::MaskKind::bias &&
           mask_col_stride != 0 && mask_blocks != nullptr;
  }

  // Does a backward pass need d(score)/d(scaled score) from apply()? (softcap's tanh, score_mod)
  bool needs_grad() const { return softcap2 > 0.0f || (hook != nullptr && hook->score != nullptr); }

  // Does any row of [i0, i0 + rows) keep any key of [j0, j0 + n)? Tiles that fail are
  // skipped entirely (window, causal, block mask, attn_mask's summary's and the score
  // hook's empty blocks).
  bool tile_has_work(std::int64_t i0, std::int64_t rows, std::int64_t j0, std::int64_t n) const {
    const AttentionProblem& p = *problem;
    // key_range bounds are non-decreasing in the row, so the first and last rows bound it.
    if (p.key_range(i0 + rows - 1).end <= j0 || p.key_range(i0).begin >= j0 + n) return false;
    return hook_keeps_any(i0, rows, j0, n) && dense_mask_keeps_any(i0, rows, j0, n) &&
           block_mask_keeps_any(i0, rows, j0, n);
  }

  // Does the block-sparse block_mask keep any block that meets the tile? True without one.
  bool block_mask_keeps_any(std::int64_t i0, std::int64_t rows, std::int64_t j0, std::int64_t n) const {
    if (block_mask == nullptr) return true;
    const std::int64_t bs = problem->block_mask_block_size;
    for (std::int64_t bi = i0 / bs; bi <= (i0 + rows - 1) / bs; ++bi)
      for (std::int64_t bj = j0 / bs; bj <= (j0 + n - 1) / bs; ++bj)
        if (block_kept(bi * bs, bj * bs)) return true;
    return false;
  }

  // Is any block of attn_mask's summary that meets the tile not empty? True without one
  // (the backward does not summarise a bias: its dbias covers every entry). The summary's blocks
  // are the forward's strips and panels or the backward's tiles.
  bool dense_mask_keeps_any(std::int64_t i0, std::int64_t rows, std::int64_t j0, std::int64_t n) const {
    if (mask_blocks == nullptr) return true;
    const DenseMaskBlocks& m = *mask_blocks;
    const std::int64_t bj0 = j0 / m.block_cols, bj1 = (j0 + n - 1) / m.block_cols + 1;
    const std::uint8_t* plane = m.states + mask_blocks_plane;
    for (std::int64_t bi = i0 / m.block_rows; bi <= (i0 + rows - 1) / m.block_rows; ++bi) {
      // Only the blocks within the row block's span can be non-empty.
      const std::int64_t from = std::max<std::int64_t>(bj0, mask_spans[2 * bi]);
      const std::int64_t to = std::min<std::int64_t>(bj1, mask_spans[2 * bi + 1]);
      for (std::int64_t bj = from; bj < to; ++bj)
        if (static_cast<ScoreBlock>(plane[bi * m.col_blocks + bj]) != ScoreBlock::empty) return true;
    }
    return false;
  }

  // attn_mask on columns [lo, hi) of row i (keys j0 + c), one span per block of
  // its summary: an empty block's keys hidden without reading the mask, a full block's
  // left as they are, a partial block's read (apply_dense_mask).
  void apply_mask_blocks(float* HWY_RESTRICT s, std::int64_t i, std::int64_t j0, std::int64_t lo, std::int64_t hi,
                         float score_scale = 1.0f) const {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    const DenseMaskBlocks& m = *mask_blocks;
    if (lo >= hi) return;
    // The row's states, walked block by block (one division per row, not two per block).
    std::int64_t block = (j0 + lo) / m.block_cols;
    const std::uint8_t* states = m.states + mask_blocks_plane + i / m.block_rows * m.col_blocks;
    for (std::int64_t c = lo; c < hi;) {
      // A run of blocks in one state at a time: one read of the mask for consecutive partial
      // blocks (a bias's are all partial).
      const auto state = static_cast<ScoreBlock>(states[block]);
      std::int64_t end = std::min(hi, (block + 1) * m.block_cols - j0);
      for (++block; end < hi && static_cast<ScoreBlock>(states[block]) == state; ++block)
        end = std::min(hi, (block + 1) * m.block_cols - j0);
      if (state == ScoreBlock::empty) {
        std::fill(s + c, s + end, kNegInf);
      } else if (state == ScoreBlock::partial && m.slots != nullptr) {  // each block's bytes, copied out
        const std::int64_t row = mask_blocks_plane + i / m.block_rows * m.col_blocks;
        for (std::int64_t at = c; at < end;) {
          const std::int64_t bj = (j0 + at) / m.block_cols, to = std::min(end, (bj + 1) * m.block_cols - j0);
          const std::uint8_t* keep = m.keep + m.slots[row + bj] * m.block_rows * m.block_cols +
                                     i % m.block_rows * m.block_cols + (j0 + at - bj * m.block_cols);
          hide_unkept(s + at, nullptr, keep, to - at);
          at = to;
        }
      } else if (state == ScoreBlock::partial) {
        apply_dense_mask(s, i, j0, c, end, score_scale);
      }
      c = end;
    }
  }

  // Fetches toward the caches the attn_mask entries of row i over keys [j_begin, j_end) that
  // the mask step will read: those of the summary's partial blocks (the forward summarises
  // every mask; a bias's blocks are all partial or empty). The tiled forward asks for the
  // next key tile's while it masks this one: consecutive rows of the mask lie a row apart,
  // each on a page of its own, where the hardware prefetchers do not follow. Nothing where the
  // summary copied its partial blocks out (DenseMaskBlocks::keep, read instead of the mask).
  // (Inlined where it is called: a call to a function whose only effect is prefetching is
  // dropped by GCC's IPA, which sees no side effect; tests/prefetch_emitted.sh checks.)
  HWY_INLINE void prefetch_dense_mask(std::int64_t i, std::int64_t j_begin, std::int64_t j_end) const {
    if (mask_blocks == nullptr || mask_col_stride == 0 || mask_blocks->slots != nullptr) return;
    const DenseMaskBlocks& m = *mask_blocks;
    const std::int64_t element = static_cast<std::int64_t>(dtype_size(attn_mask->dtype));
    const auto* row = static_cast<const unsigned char*>(attn_mask->data) + (mask_base + i * mask_row_stride) * element;
    const std::uint8_t* states = m.states + mask_blocks_plane + i / m.block_rows * m.col_blocks;
    for (std::int64_t block = j_begin / m.block_cols; block * m.block_cols < j_end; ++block) {
      if (static_cast<ScoreBlock>(states[block]) != ScoreBlock::partial) continue;
      const std::int64_t to = std::min(j_end, (block + 1) * m.block_cols) * element;
      for (std::int64_t at = std::max(j_begin, block * m.block_cols) * element; at < to; at += 64) hwy::Prefetch(row + at);
    }
  }

  // The mask step of options.attn_mask on columns [lo, hi) of a row (keys j0 + c): adds the
  // bias (in log2 units, as the scores) or sets the hidden scores to −∞. The row's entries
  // are contiguous (attn_mask's last dim is) or one value (a size-1 key dim): whole vectors
  // are loaded and widened to float32 (u8 to u32, bf16 and f16 promoted), the tail by element.
  // A bias with score_scale ≠ 1 (only_adds_bias) takes scores not yet scaled: s·score_scale +
  // bias·log2e. A finite bias beyond ±kLargestBias (AttentionProblem::kLargestScaled) is
  // taken as ±kLargestBias, so that bias·log2e stays finite: a row whose every bias is
  // finfo(float32).min (transformers' padding) weighs its keys alike, as the definition does,
  // instead of hiding them all as −∞ would; only −∞ hides a key.
  static constexpr float kLargestBias = AttentionProblem::kLargestScaled;
  static float bounded_bias(float bias) {
    return std::isfinite(bias) ? std::clamp(bias, -kLargestBias, kLargestBias) : bias;
  }
  template <class DF, class V>
  static V BoundedBias(DF df, V bias) {
    const auto largest = hn::Set(df, kLargestBias);
    const auto beyond = hn::Gt(hn::Abs(bias), largest);  // ±∞ too, never NaN
    if (HWY_LIKELY(hn::AllFalse(df, beyond))) return bias;
    return hn::IfThenElse(hn::And(beyond, hn::IsFinite(bias)), hn::CopySign(largest, bias), bias);
  }
  void apply_dense_mask(float* HWY_RESTRICT s, std::int64_t i, std::int64_t j0, std::int64_t lo, std::int64_t hi,
                        float score_scale = 1.0f) const {
    using DF = hn::ScalableTag<float>;
    const DF df;
    const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    constexpr float kLog2e = OnlineSoftmaxState::kLog2e;
    const std::int64_t row = mask_base + i * mask_row_stride;
    const std::int64_t first = row + j0 * mask_col_stride;  // the element of column 0
    if (mask_col_stride == 0) {  // one entry for the whole row
      const float x = detail::load_element(*attn_mask, first);
      if (problem->attn_mask == AttentionProblem::MaskKind::boolean) {
        if (x == 0.0f) std::fill(s + lo, s + hi, kNegInf);
      } else {
        const float scaled = bounded_bias(x) * kLog2e;
        for (std::int64_t c = lo; c < hi; ++c) s[c] += scaled;
      }
      return;
    }
    std::int64_t c = lo;
    // s += bias·log2e over whole vectors; load(c) gives the bias of columns c.. as float32.
    const auto bias_loop = [&](auto load) {
      const auto log2e = hn::Set(df, kLog2e);
      if (score_scale != 1.0f) {
        const auto scale = hn::Set(df, score_scale);
        for (; c + lanes <= hi; c += lanes)
          hn::StoreU(hn::MulAdd(hn::LoadU(df, s + c), scale, hn::Mul(BoundedBias(df, load(c)), log2e)), df, s + c);
        return;
      }
      for (; c + lanes <= hi; c += lanes)
        hn::StoreU(hn::MulAdd(BoundedBias(df, load(c)), log2e, hn::LoadU(df, s + c)), df, s + c);
    };
    switch (attn_mask->dtype) {
      case DType::u8:
        hide_unkept(s + c, nullptr, static_cast<const std::uint8_t*>(attn_mask->data) + first + c, hi - c);
        return;
      case DType::f32: {
        const auto* m = static_cast<const float*>(attn_mask->data) + first;
        bias_loop([&](std::int64_t at) { return hn::LoadU(df, m + at); });
        break;
      }
      case DType::bf16: {
        const auto* m = static_cast<const hwy::bfloat16_t*>(attn_mask->data) + first;
        const hn::Rebind<hwy::bfloat16_t, DF> dbf;
        bias_loop([&](std::int64_t at) { return hn::PromoteTo(df, hn::LoadU(dbf, m + at)); });
        break;
      }
      default: {  // f16
        const auto* m = static_cast<const hwy::float16_t*>(attn_mask->data) + first;
        const hn::Rebind<hwy::float16_t, DF> dh;
        bias_loop([&](std::int64_t at) { return hn::PromoteTo(df, hn::LoadU(dh, m + at)); });
        break;
      }
    }
    const hn::CappedTag<float, 1> d1;  // the tail by the vectors' formula
    for (; c < hi; ++c) {
      const float bias = bounded_bias(detail::load_element(*attn_mask, first + c));
      s[c] = score_scale != 1.0f
                 ? hn::GetLane(hn::MulAdd(hn::Set(d1, s[c]), hn::Set(d1, score_scale), hn::Set(d1, bias * kLog2e)))
                 : hn::GetLane(hn::MulAdd(hn::Set(d1, bias), hn::Set(d1, kLog2e), hn::Set(d1, s[c])));
    }
  }

  // One score row of a tile: columns [0, cols) hold keys j0 + c. Applies softcap and
  // ALiBi in place and sets every score that row i may not see to −∞. With `grad`, also
  // stores d(capped)/d(raw) = 1 − tanh² for the backward pass.
  // score_scale ≠ 1 only where only_adds_bias(): the scores come unscaled, and the bias step
  // scales them.
  void apply(float* HWY_RESTRICT s, float* HWY_RESTRICT grad, std::int64_t i, std::int64_t j0,
             std::int64_t n, std::int64_t cols, float score_scale = 1.0f) const {
    const AttentionProblem& p = *problem;
    using DF = hn::ScalableTag<float>;
    const DF df;
    const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
    if (softcap2 > 0.0f) {
      const auto cap = hn::Set(df, softcap2), inv_cap = hn::Set(df, 1.0f / softcap2);
      const auto one = hn::Set(df, 1.0f);
      for (std::int64_t c = 0; c < cols; c += lanes) {
        const auto t = hn::Tanh(df, hn::Mul(hn::Load(df, s + c), inv_cap));
        hn::Store(hn::Mul(cap, t), df, s + c);
        if (grad != nullptr) hn::Store(hn::NegMulAdd(t, t, one), df, grad + c);
      }
    } else if (grad != nullptr) {
      std::fill(grad, grad + cols, 1.0f);
    }
    if (alibi) {  // s −= slope·|diagonal(i) − j|
      const auto diagonal = hn::Set(df, static_cast<float>(p.diagonal(i) - j0));
      const auto slope = hn::Set(df, alibi_slope2);
      for (std::int64_t c = 0; c < cols; c += lanes) {
        const auto distance = hn::Abs(hn::Sub(diagonal, hn::Iota(df, static_cast<float>(c))));
        hn::Store(hn::NegMulAdd(slope, distance, hn::Load(df, s + c)), df, s + c);
      }
    }
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    const AttentionProblem::KeyRange r = p.key_range(i);
    const std::int64_t lo = std::clamp<std::int64_t>(r.begin - j0, 0, n);
    const std::int64_t hi = std::clamp<std::int64_t>(r.end - j0, lo, n);
    std::fill(s, s + lo, kNegInf);
    std::fill(s + hi, s + cols, kNegInf);
    if (mask_blocks != nullptr) apply_mask_blocks(s, i, j0, lo, hi, score_scale);
    else if (attn_mask != nullptr) apply_dense_mask(s, i, j0, lo, hi, score_scale);
    if (block_mask != nullptr) {
      const std::int64_t bs = p.block_mask_block_size;
      for (std::int64_t c = lo; c < hi;) {
        const std::int64_t end = std::min(hi, ((j0 + c) / bs + 1) * bs - j0);  // end of this block
        if (!block_kept(i, j0 + c)) std::fill(s + c, s + end, kNegInf);
        c = end;
      }
    }
    if (hook != nullptr) apply_hook(s, grad, i, j0, lo, hi);
  }

  // The score hook on columns [lo, hi) of row i (keys j0 + c): one call per block of its
  // block mask (the whole span without one) — empty blocks hidden without a call, full
  // blocks called without mask_mod, or not at all without a score_mod.
  void apply_hook(float* HWY_RESTRICT s, float* HWY_RESTRICT grad, std::int64_t i, std::int64_t j0, std::int64_t lo,
                  std::int64_t hi) const {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    const std::int64_t bs = hook->block_size;
    if (lo >= hi) return;
    // The row's states, walked block by block (one division per row, not two per block).
    const TensorView& m = hook->block_mask;
    const std::uint8_t* states = bs > 0 ? static_cast<const std::uint8_t*>(m.data) + hook_blocks_base +
                                              (i / bs) * m.strides[2]
                                        : nullptr;
    std::int64_t block = bs > 0 ? (j0 + lo) / bs : 0;
    for (std::int64_t c = lo; c < hi; ++block) {
      const std::int64_t end = bs > 0 ? std::min(hi, (block + 1) * bs - j0) : hi;
      const ScoreBlock state = bs > 0 ? static_cast<ScoreBlock>(states[block * m.strides[3]]) : ScoreBlock::partial;
      if (state == ScoreBlock::empty) {
        std::fill(s + c, s + end, kNegInf);
      } else if (state == ScoreBlock::partial || hook->score != nullptr) {
        // A partial block whose bytes the hook holds: the score_mod alone, then the bytes.
        const std::int32_t slot = state == ScoreBlock::partial && hook_slots != nullptr ? hook_slot(i, block) : -1;
        float* g = grad != nullptr ? grad + c : nullptr;
        if (slot < 0 || hook->score != nullptr)
          hook->apply(hook->mods,
                      ScoreSpan{s + c, g, batch, head, i, j0 + c, end - c, slot < 0 && state == ScoreBlock::partial});
        if (slot >= 0) {
          const auto* keep = static_cast<const std::uint8_t*>(hook->partial_keep.data) + slot * bs * bs +
                             (i % bs) * bs + (j0 + c - block * bs);
          // The hook's mask_mod zeroes a hidden key's factor where it has a score_mod.
          hide_unkept(s + c, hook->score != nullptr ? g : nullptr, keep, end - c);
        }
      }
      c = end;
    }
  }

  // s[c] = −∞ (and grad[c] = 0, grad non-null) where keep[c] is 0, for c < n.
  static void hide_unkept(float* HWY_RESTRICT s, float* HWY_RESTRICT grad, const std::uint8_t* HWY_RESTRICT keep,
                          std::int64_t n) {
    using DF = hn::ScalableTag<float>;
    const DF df;
    const hn::Rebind<std::uint8_t, DF> d8;
    const hn::RebindToUnsigned<DF> du;
    const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    const auto hidden = hn::Set(df, kNegInf);
    std::int64_t c = 0;
    for (; c + lanes <= n; c += lanes) {
      const auto zero = hn::RebindMask(df, hn::Eq(hn::PromoteTo(du, hn::LoadU(d8, keep + c)), hn::Zero(du)));
      hn::StoreU(hn::IfThenElse(zero, hidden, hn::LoadU(df, s + c)), df, s + c);
      if (grad != nullptr) hn::StoreU(hn::IfThenZeroElse(zero, hn::LoadU(df, grad + c)), df, grad + c);
    }
    for (; c < n; ++c)
      if (keep[c] == 0) {
        s[c] = kNegInf;
        if (grad != nullptr) grad[c] = 0.0f;
      }
  }

  // Multiplies P row (keys j0 + c, c < cols) by the dropout weights: 0 where dropped,
  // 1/(1 − p) where kept — the same bits as flashattn::dropout_keep.
  void apply_dropout(float* HWY_RESTRICT prow, std::int64_t i, std::int64_t j0, std::int64_t cols) const {
    using DF = hn::ScalableTag<float>;
    const DF df;
    const hn::RebindToUnsigned<DF> du;
    const hn::RebindToSigned<DF> di;
    const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
    const std::uint32_t row_key = dropout_row_key(problem->seed, problem->offset, batch, head, i);
    // Dropped iff bits < threshold (unsigned), compared as signed after flipping the sign bit.
    const auto flip = hn::Set(du, 0x80000000u);
    const auto threshold = hn::BitCast(di, hn::Xor(hn::Set(du, dropout_threshold), flip));
    const auto key = hn::Set(du, row_key);
    const auto scale = hn::Set(df, dropout_scale);
    auto mix = [&](hn::Vec<decltype(du)> x) {
      x = hn::Xor(x, hn::ShiftRight<16>(x));
      x = hn::Mul(x, hn::Set(du, 0x7FEB352Du));
      x = hn::Xor(x, hn::ShiftRight<15>(x));
      x = hn::Mul(x, hn::Set(du, 0x846CA68Bu));
      return hn::Xor(x, hn::ShiftRight<16>(x));
    };
    for (std::int64_t c = 0; c < cols; c += lanes) {
      const auto column = hn::Iota(du, static_cast<std::uint32_t>(j0 + c) + 1u);
      const auto bits = mix(hn::Xor(key, mix(column)));
      const auto drop = hn::Gt(threshold, hn::BitCast(di, hn::Xor(bits, flip)));
      const auto p = hn::Mul(hn::Load(df, prow + c), scale);
      hn::Store(hn::IfThenZeroElse(hn::RebindMask(df, drop), p), df, prow + c);
    }
  }
};

// The query of row r of a Q tile of `rows` queries from i0 a head, its heads' rows back to
// back (pack_gqa), `real` rows in all: i0 + r % rows; padding rows repeat the last query.
HWY_INLINE std::int64_t RowQuery(std::int64_t i0, std::int64_t r, std::int64_t rows, std::int64_t real) {
  return i0 + (r < real ? r % rows : rows - 1);
}

// The keys of tile [j0, j0 + n) that each row strip of a Q tile (RowQuery's) computes. Key
// ranges are non-decreasing in the query, so a strip sees at most [its first query's begin,
// its last query's end) — every query of the tile's, where the strip ends one head's rows
// and begins the next's; within that, only the blocks some row of the strip may see under
// the block masks (RowMods::narrow_span) and, in a score hook's partial blocks, the panels
// some row keeps by their bytes (RowMods::narrow_to_kept_bytes); rounded out to whole panels
// of kMicroCols keys, that is its span. Outside it every score of the strip is masked (causal,
// window, the masks' empty blocks): no S micro-tile, no exponential and no P·V depth is spent
// there (the backward: no S' or dP micro-tile, no exponential, no depth of dQ, dK or dV), so a
// diagonal tile costs about its visible triangle, not its square. A strip that sees none of the tile's
// keys gets an empty span and is skipped: the forward leaves its softmax state and õ as they
// are, exactly what an all-masked row would leave; the backward's P and dS rows are zero.
inline void FindStripKeys(const AttentionProblem& p, const RowMods& mods, std::int64_t i0, std::int64_t strips,
                          std::int64_t rows, std::int64_t real, std::int64_t j0, std::int64_t n,
                          StripKeys* HWY_RESTRICT keys) {
  for (std::int64_t s = 0; s < strips; ++s) {
    const std::int64_t r0 = s * kMicroRows, r1 = std::min(r0 + kMicroRows, real) - 1;  // its real rows
    const bool wraps = r0 / rows != r1 / rows;
    const std::int64_t first = wraps ? i0 : RowQuery(i0, r0, rows, real);
    const std::int64_t last = wraps ? i0 + rows - 1 : RowQuery(i0, r1, rows, real);
    std::int64_t lo = std::max<std::int64_t>(p.key_range(first).begin - j0, 0);
    std::int64_t hi = std::min(p.key_range(last).end - j0, n);
    mods.narrow_span(first, last, j0, lo, hi);
    mods.narrow_to_kept_bytes(first, last, j0, kMicroCols, lo, hi);
    keys[s] = lo < hi ? StripKeys{lo / kMicroCols * kMicroCols, (hi + kMicroCols - 1) / kMicroCols * kMicroCols}
                      : StripKeys{};
  }
}

// The score entries `strips` row strips compute over their spans (KernelCounters::
// scores_computed): kMicroRows rows a strip, the last kTailRows where it runs at half height.
HWY_INLINE std::int64_t SpanScores(const StripKeys* HWY_RESTRICT keys, std::int64_t strips, bool half_tail) {
  std::int64_t sum = 0;
  for (std::int64_t s = 0; s < strips; ++s)
    sum += (half_tail && s == strips - 1 ? kTailRows : kMicroRows) * (keys[s].end - keys[s].begin);
  return sum;
}

// micro(s, j): S(strip s, panel j) = Q(strip)·Kᵀ(panel), for every panel j in the strip's
// span. Panels outermost: one packed K panel (contiguous) stays in L1 while the row strips
// pass over it.
template <class MicroFn>
HWY_INLINE void ScoreTile(const StripKeys* HWY_RESTRICT keys, std::int64_t strips, std::int64_t n_pad, MicroFn micro) {
  for (std::int64_t j = 0; j < n_pad; j += kMicroCols)
    for (std::int64_t s = 0; s < strips; ++s)
      if (keys[s].begin <= j && j < keys[s].end) micro(s, j);
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
