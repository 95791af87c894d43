// K/V packing shared by the tiled forward and the tiled backward, compiled per Highway
// target: the paged-KV reader (KvRows), row prefetch, and PackKeys, which lays out one
// (batch, kv head)'s keys whole tiles at a time and keeps what a thread has packed.
// The decode forward resolves its key rows through KvRows as well.
// Include inside the per-target section.
#if defined(FLASHATTN_CPU_KV_PACK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHATTN_CPU_KV_PACK_INL_H_
#undef FLASHATTN_CPU_KV_PACK_INL_H_
#else
#define FLASHATTN_CPU_KV_PACK_INL_H_
#endif

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>

#include "flashattn/counters.hpp"
#include "flashattn/tensor.hpp"
#include "src/cpu/kernels/forward_kernel.hpp"
#include "src/cpu/kernels/packed_head.hpp"
#include "src/cpu/kernels/tile_ops-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {

// The K and V rows of one (batch, kv head): key j is row j of batch b, or — paged — row
// j % page_size of page block_table[(j / page_size) · table_stride] of the pools.
struct KvRows {
  const TensorView* k;
  const TensorView* v;
  const PagedKv* paged;
  std::int64_t batch, kv_head;

  // The page (batch row of the views) that holds key j.
  std::int64_t page(std::int64_t j) const {
    return paged->block_table == nullptr ? batch : paged->block_table[(j / paged->page_size) * paged->table_stride];
  }
  const void* row(const TensorView& t, std::int64_t j) const {
    if (paged->block_table == nullptr) return RowPointer(t, batch, j, kv_head);
    return RowPointer(t, page(j), j % paged->page_size, kv_head);
  }
  const void* k_row(std::int64_t j) const { return row(*k, j); }
  const void* v_row(std::int64_t j) const { return row(*v, j); }
  // The slot (row within its page) of key j: j itself in an ordinary view.
  std::int64_t slot(std::int64_t j) const { return paged->block_table == nullptr ? j : j % paged->page_size; }
  // n values of key j's row `src` of a pool in `dtype` read with `scales` into dst: a
  // quantized pool's codes dequantized with the key's scale (and zero point).
  void load(const void* src, DType dtype, const KvScales& scales, std::int64_t j, std::int64_t n, float* dst) const {
    if (scales.scale == nullptr) return LoadRow(src, dtype, n, 1.0f, dst);
    const std::int64_t at = scales.offset(page(j), slot(j), kv_head);
    if (!scales.int8()) return LoadRow(src, dtype, n, scales.scale[at], dst);
    LoadInt8Row(src, scales.codes, n, scales.scale[at], scales.zero_point != nullptr ? scales.zero_point[at] : 0.0f,
                dst);
  }
  void load_k(std::int64_t j, const void* src, std::int64_t n, float* dst) const {
    load(src, k->dtype, paged->k, j, n, dst);
  }
  void load_v(std::int64_t j, const void* src, std::int64_t n, float* dst) const {
    load(src, v->dtype, paged->v, j, n, dst);
  }
};

// Transposes the kLanes × kLanes block of 32-bit values held in v (rows in, columns out),
// in registers: log2(kLanes) rounds of a perfect unshuffle across each pair of vectors
// (ConcatEven, ConcatOdd). Element (r, c) — index bits r·kLanes + c — moves to the place
// whose bits are those rotated right by one, so after log2(kLanes) rounds row and column
// have swapped. AVX-512: 4 rounds of 16 two-source permutes for 256 values, where a
// strided scalar store per value costs 256 stores. HWY_SCALAR's one lane is its own transpose.
template <class D>
HWY_INLINE void TransposeLanes([[maybe_unused]] D d, [[maybe_unused]] hn::Vec<D>* HWY_RESTRICT v) {
#if HWY_TARGET != HWY_SCALAR
  constexpr std::int64_t kHalf = kLanes / 2;
  for (std::int64_t round = 1; round < kLanes; round *= 2) {
    hn::Vec<D> t[kLanes];
    for (std::int64_t i = 0; i < kHalf; ++i) {
      t[i] = hn::ConcatEven(d, v[2 * i + 1], v[2 * i]);
      t[kHalf + i] = hn::ConcatOdd(d, v[2 * i + 1], v[2 * i]);
    }
    for (std::int64_t i = 0; i < kLanes; ++i) v[i] = t[i];
  }
#endif
}

// panel[c·panel_stride + e] = rows[e][c] for the kMicroCols rows e and columns c < cols
// (32-bit values: float, or a pair of bf16): the transpose of a block of kMicroCols keys.
// Each row is read in whole vectors (the values from cols to cols rounded up to kLanes are
// read and dropped: a caller's row must hold them, or cols be a multiple of kLanes); panel
// and panel_stride keep every store vector-aligned.
template <class D>
HWY_INLINE void TransposeKeyRows(D d, const hn::TFromD<D>* const* HWY_RESTRICT rows, std::int64_t cols,
                                 hn::TFromD<D>* HWY_RESTRICT panel, std::int64_t panel_stride) {
  for (std::int64_t c0 = 0; c0 < cols; c0 += kLanes)
    for (std::int64_t half = 0; half < kMicroVecs; ++half) {
      hn::Vec<D> v[kLanes];  // keys half·kLanes.., columns c0..
      for (std::int64_t r = 0; r < kLanes; ++r) v[r] = hn::LoadU(d, rows[half * kLanes + r] + c0);
      TransposeLanes(d, v);
      for (std::int64_t c = 0; c < std::min(kLanes, cols - c0); ++c)
        hn::Store(v[c], d, panel + (c0 + c) * panel_stride + half * kLanes);
    }
}

// TransposeKeyRows of the kMicroCols rows ld values apart from `rows` (ld a multiple of
// kLanes, so that each row holds the values read past cols).
template <class D>
HWY_INLINE void TransposeKeys(D d, const hn::TFromD<D>* HWY_RESTRICT rows, std::int64_t ld, std::int64_t cols,
                              hn::TFromD<D>* HWY_RESTRICT panel, std::int64_t panel_stride) {
  const hn::TFromD<D>* row[kMicroCols];
  for (std::int64_t e = 0; e < kMicroCols; ++e) row[e] = rows + e * ld;
  TransposeKeyRows(d, row, cols, panel, panel_stride);
}

// Rows a and b (16-bit values, bf16) as the pairs (a[c], b[c]) for c < cols, a multiple of
// the vector: column c at dst + (c / kMicroCols)·panel_stride + 2·(c % kMicroCols) — two keys'
// rows as one step of panels of kMicroCols columns with pairs of keys along the depth. A
// vector of columns at a time: each widened to 32 bits, b's half on top.
HWY_INLINE void InterleavePairs(const std::uint16_t* HWY_RESTRICT a, const std::uint16_t* HWY_RESTRICT b,
                                std::int64_t cols, std::uint16_t* HWY_RESTRICT dst, std::int64_t panel_stride) {
  const hn::ScalableTag<std::uint32_t> du32;
  const hn::Rebind<std::uint16_t, decltype(du32)> du16;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(du32));
  static_assert(kMicroCols % HWY_LANES(std::uint32_t) == 0, "whole vectors of columns in a panel");
  for (std::int64_t c = 0; c < cols; c += lanes) {
    const auto pairs = hn::Or(hn::PromoteTo(du32, hn::LoadU(du16, a + c)),
                              hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(du16, b + c))));
    hn::StoreU(pairs, du32, reinterpret_cast<std::uint32_t*>(dst + c / kMicroCols * panel_stride + 2 * (c % kMicroCols)));
  }
}

// Prefetches the cache lines of the `bytes` bytes from `row` on: a row that is read
// kRowPrefetchDistance rows later.
HWY_INLINE void PrefetchRow(const void* row, std::int64_t bytes) {
  for (std::int64_t off = 0; off < bytes; off += kCacheLineBytes) hwy::Prefetch(static_cast<const char*>(row) + off);
}

// The producer role (docs/algorithm.md §4) on a CPU: lay out K and V of `rows` for keys
// [from, to) of seqlen_k, whole tiles of block_k at a time, extending what `packed` holds.
// Each kernel cuts them into its micro-kernel's B panels, each stored contiguously, so that
// a micro-kernel reads its B panel as one sequential stream. (Row-major tiles put
// consecutive rows of a panel block_k or head_dim_v floats apart, 512 B at 128: all in the
// same few L1 sets, which hold too few of them for the panel to stay in L1 while the row
// strips reuse it.) `place(j, k_row, v_row)` puts key j's rows, as stored, into its panels;
// null rows are the keys that pad the last tile, which must be zeros: masked scores must
// meet finite K and V. Keys come in order, whole tiles from a tile's first key to its last
// (padding included), so a place that gathers a panel's keys may write the panel at its
// last key. With `prefetch`, the rows kRowPrefetchDistance keys ahead are fetched.
template <class PlaceFn>
void PackKeys(const KvRows& rows, std::int64_t seqlen_k, std::int64_t block_k, std::int64_t from, std::int64_t to,
              bool prefetch, PackedHead& packed, KernelCounters& counters, PlaceFn place) {
  const std::int64_t bc = block_k;
  const std::int64_t begin = packed.first_to_pack(rows.batch, rows.kv_head, from / bc * bc);
  const std::int64_t end = std::min(seqlen_k, (to + bc - 1) / bc * bc);
  const std::int64_t d = rows.k->shape[3], dv = rows.v->shape[3];
  const std::int64_t k_bytes = d * static_cast<std::int64_t>(dtype_size(rows.k->dtype));
  const std::int64_t v_bytes = dv * static_cast<std::int64_t>(dtype_size(rows.v->dtype));
  for (std::int64_t j = begin; j < end; ++j) {
    if (prefetch && j + kRowPrefetchDistance < end) {
      PrefetchRow(rows.k_row(j + kRowPrefetchDistance), k_bytes);
      PrefetchRow(rows.v_row(j + kRowPrefetchDistance), v_bytes);
    }
    place(j, rows.k_row(j), rows.v_row(j));
  }
  if (end == seqlen_k && begin < end)
    for (std::int64_t j = end; j % bc != 0; ++j) place(j, nullptr, nullptr);
  if (end > begin) counters.kv_packed += (end - begin) * (d + dv);
  packed.done(end);
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
