// The CPU tiled forward kernels, compiled once per Highway SIMD target (foreach_target) and
// dispatched once per call. One work item = one block of Q rows of one (batch, head) and
// its share of the keys (ForwardSchedule, flashattn/plan.hpp); it streams every visible K/V
// tile through fast memory (docs/algorithm.md §2–§3):
//
//   pack K/V (kv_pack-inl.h), load Q tile
//   for each K/V tile:  S = Q·Kᵀ·softmax_scale·log2e → mask → online-softmax update
//                       (P = 2^(S − m)) → õ += P·V
//   epilogue: o = õ / ℓ, lse = (m + log2 ℓ)·ln2
//
// Both products run on one register-blocked micro-kernel, each row strip over only the keys
// it may see (FindStripKeys); S never leaves the L2 cache. The kernels "tiled" and
// "tiled_bf16" differ only in that micro-kernel and the operands it reads (Fp32Products:
// float32 FMAs; Bf16Products: AVX512-BF16 dot products on bf16 operands, bf16_dot.hpp).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/cpu/kernels/tiled_forward.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>  // avx2_kernel_geometry's F16C check
#endif

#include "flashattn/online_softmax.hpp"
#include "flashattn/error.hpp"
#include "src/core/element.hpp"
#include "src/cpu/kernels/bf16_dot.hpp"
#include "src/cpu/kernels/forward_kernel.hpp"
#include "src/cpu/kernels/forward_rows-inl.h"
#include "src/cpu/kernels/kv_pack-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// K/V of one (batch, kv head) for keys [from, to) through PackKeys, placed by `place`.
template <class PlaceFn>
void PackHead(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t b, std::int64_t kv_head, std::int64_t from,
              std::int64_t to, PlaceFn place) {
  if (!prm.switches.reuse_packed_kv) ws.packed = {};  // measurement: pack again what is packed
  PackKeys(KvRows{&prm.k, &prm.v, &prm.paged, b, kv_head}, prm.problem.seqlen_k, prm.plan.block_k, from, to,
           prm.switches.software_prefetch, ws.packed, ws.counters, place);
}

// row(r, i, j, n_r, cols): each row r < rows_run of the tile over its strip's span — query
// i (RowQuery), keys j.. of which n_r are real, cols with padding, at column j − j0 of the
// row; rows of an empty span are left alone.
template <class RowFn>
HWY_INLINE void ForEachSpanRow(std::int64_t i0, std::int64_t rows_run, std::int64_t rows, std::int64_t real,
                               std::int64_t j0, std::int64_t n, const StripKeys* HWY_RESTRICT keys, RowFn row) {
  for (std::int64_t r = 0; r < rows_run; ++r) {
    const StripKeys k = keys[r / kMicroRows];
    if (k.begin == k.end) continue;
    row(r, RowQuery(i0, r, rows, real), j0 + k.begin, std::min(n, k.end) - k.begin, k.end - k.begin);
  }
}

// micro(s, c, span): õ(strip s, panel c) += P(strip, span)·V(span, panel), for every output
// panel c: a strip's P is zero outside its span, so its depth is the span alone. Panels
// outermost, as in ScoreTile.
template <class MicroFn>
HWY_INLINE void AccumulateTile(const StripKeys* HWY_RESTRICT keys, std::int64_t strips, std::int64_t dv_pad,
                               MicroFn micro) {
  for (std::int64_t c = 0; c < dv_pad; c += kMicroCols)
    for (std::int64_t s = 0; s < strips; ++s)
      if (keys[s].begin != keys[s].end) micro(s, c, keys[s]);
}

// A work item's õ is not zeroed first: each row strip's first P·V stores its product, and
// later ones add to it (ws.strip_fresh, set per item by TiledItem). The strips of this tile
// with keys to compute have been written.
HWY_INLINE void StripsWritten(ForwardWorkspace& ws, const StripKeys* HWY_RESTRICT keys, std::int64_t strips) {
  for (std::int64_t s = 0; s < strips; ++s)
    if (keys[s].begin != keys[s].end) ws.strip_fresh[static_cast<std::size_t>(s)] = 0;
}

// The tiled kernel's two products on float32 FMAs (MicroTile): K and V converted to float32
// at packing (quantized caches' codes dequantized), Q pre-scaled by softmax_scale·log2e as it is loaded.
struct Fp32Products {
  // K tiles as panels of kMicroCols keys, each (head_dim, kMicroCols) — Kᵀ; V tiles as panels
  // of kMicroCols columns, each (block_k, kMicroCols). A panel's K rows are transposed in
  // registers at its last key (TransposeKeyRows) and each V row is stored a vector at a time
  // into its panels; padding keys and the columns from head_dim_v to head_dim_v_padded are
  // zeros. Float32 rows without scales and of whole vectors (head_dim and head_dim_v multiples
  // of kLanes) are read in place: the K rows' pointers are kept until the panel's last key,
  // the V row is stored straight into the panels. Other rows are converted first (quantized
  // caches' codes dequantized), K into k_rows, V into v_row: packing then moves the converted
  // values. Either way the panels hold the same values. (A panel's row pointers live only in
  // one call: PackKeys begins every call at a tile's first key, so each panel's keys come in
  // the call that ends it.)
  static void Pack(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t b, std::int64_t kv_head,
                   std::int64_t from, std::int64_t to) {
    const std::int64_t bc = prm.plan.block_k, d = prm.problem.head_dim, dv = prm.problem.head_dim_v;
    const std::int64_t dv_pad = prm.plan.head_dim_v_padded;
    const std::int64_t ld = (d + kLanes - 1) / kLanes * kLanes;
    const DF df;
    const bool in_place = prm.k.dtype == DType::f32 && prm.v.dtype == DType::f32 && prm.paged.k.scale == nullptr &&
                          prm.paged.v.scale == nullptr && d % kLanes == 0 && dv % kLanes == 0;
    float* k_rows = ws.k_rows.get();  // (kMicroCols, ld): the keys of one panel, converted; in place: row 0 zeros
    float* v_row = ws.v_row.get();    // (dv_pad)
    if (in_place)
      std::fill(k_rows, k_rows + ld, 0.0f);
    else
      for (std::int64_t e = 0; e < kMicroCols; ++e) std::fill(k_rows + e * ld + d, k_rows + (e + 1) * ld, 0.0f);
    std::fill(v_row + dv, v_row + dv_pad, 0.0f);
    const float* panel_rows[kMicroCols];  // in place: the panel's K rows
    const KvRows kv{&prm.k, &prm.v, &prm.paged, b, kv_head};
    PackHead(prm, ws, b, kv_head, from, to, [&](std::int64_t j, const void* k_row, const void* v_row_src) {
      const std::int64_t e = j % kMicroCols, at = j - ws.packed.begin;  // at: its place (packed_head.hpp)
      const float* v_src = v_row;  // the V row's values, dv_pad of them
      if (in_place) {
        panel_rows[e] = k_row != nullptr ? static_cast<const float*>(k_row) : k_rows;
        if (v_row_src != nullptr) v_src = static_cast<const float*>(v_row_src);
      } else if (k_row != nullptr) {
        kv.load_k(j, k_row, d, k_rows + e * ld);
        kv.load_v(j, v_row_src, dv, v_row);
      } else {
        std::fill(k_rows + e * ld, k_rows + e * ld + d, 0.0f);
      }
      if (v_row_src == nullptr) std::fill(v_row, v_row + dv, 0.0f);
      {  // Locals and restrict (their own scope): the closure's captures would otherwise be reloaded after every store.
        const float* HWY_RESTRICT src = v_src;
        const std::int64_t real = v_src == v_row ? dv_pad : dv;  // in place: the caller's row ends at dv
        float* HWY_RESTRICT vt = ws.v_packed.get() + (at / bc) * bc * dv_pad + (at % bc) * kMicroCols;
        for (std::int64_t c = 0, stride = bc; c < dv_pad; c += kLanes)
          hn::Store(c < real ? hn::LoadU(df, src + c) : hn::Zero(df), df,
                    vt + (c - c % kMicroCols) * stride + c % kMicroCols);
      }
      if (e == kMicroCols - 1) {
        float* panel = ws.k_packed.get() + (at / bc) * d * bc + (at % bc) / kMicroCols * d * kMicroCols;
        if (in_place)
          TransposeKeyRows(df, panel_rows, d, panel, kMicroCols);
        else
          TransposeKeys(df, k_rows, ld, d, panel, kMicroCols);
      }
    });
  }

  // Rows [at, at + rows) of the Q tile from queries i0.. of head h, times
  // softmax_scale·log2e; rows up to at + rows_pad zero.
  static void LoadQ(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t b, std::int64_t h, std::int64_t i0,
                    std::int64_t rows, std::int64_t rows_pad, std::int64_t at) {
    const AttentionProblem& p = prm.problem;
    const std::int64_t d = p.head_dim;
    float* q_tile = ws.q_tile.get() + at * d;  // (rows_pad, d)
    const float q_scale = p.softmax_scale * OnlineSoftmaxState::kLog2e;
    const std::int64_t q_bytes = d * static_cast<std::int64_t>(dtype_size(p.dtype));
    for (std::int64_t r = 0; r < rows; ++r) {
      if (prm.switches.software_prefetch && r + kRowPrefetchDistance < rows)
        PrefetchRow(RowPointer(prm.q, b, i0 + r + kRowPrefetchDistance, h), q_bytes);
      LoadRow(RowPointer(prm.q, b, i0 + r, h), p.dtype, d, q_scale, q_tile + r * d);
    }
    std::fill(q_tile + rows * d, q_tile + rows_pad * d, 0.0f);
  }

  // The S tile of keys j0.. (n_pad of them) over each strip's span.
  // S = Q·Kᵀ, scaled: LoadQ scaled Q (`scale` is always 1 here: kMayLeaveScoresUnscaled).
  static constexpr bool kMayLeaveScoresUnscaled = false;
  // A last strip of at most kTailRows real rows runs the half-height micro-tile (ws.half_tail).
  static constexpr bool kHalfTail = true;
  static void Scores(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t j0, const StripKeys* keys,
                     std::int64_t strips, std::int64_t n_pad, float /*scale*/) {
    const std::int64_t d = prm.problem.head_dim, bc = prm.plan.block_k;
    const float* q_tile = ws.q_tile.get();
    const float* k_tile = ws.k_packed.get() + ((j0 - ws.packed.begin) / bc) * d * bc;
    float* s_tile = ws.s_tile.get();  // (rows_pad, bc)
    const std::int64_t tail = ws.half_tail ? strips - 1 : strips;  // the half-height strip, if any
    ScoreTile(keys, strips, n_pad, [&](std::int64_t s, std::int64_t j) {
      const MatA q{q_tile + s * kMicroRows * d, d};
      const float* k_panel = k_tile + j / kMicroCols * d * kMicroCols;
      float* out = s_tile + s * kMicroRows * bc + j;
      if (s != tail)
        MicroTile<false>(q, k_panel, kMicroCols, out, bc, d);
      else
        MicroTile<false, kTailRows>(q, k_panel, kMicroCols, out, bc, d);
    });
  }

  // Row r's P, columns [at, at + cols) of the S tile, is final: the float32 product reads it
  // in place.
  static void FinishRow(ForwardWorkspace&, std::int64_t, std::int64_t, std::int64_t, std::int64_t) {}

  // õ += P·V(keys j0..), P in place in the S tile; a fresh strip's õ = P·V (StripsWritten).
  static void Accumulate(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t j0, const StripKeys* keys,
                         std::int64_t strips) {
    const std::int64_t bc = prm.plan.block_k, dv_pad = prm.plan.head_dim_v_padded;
    const float* s_tile = ws.s_tile.get();
    const float* v_tile = ws.v_packed.get() + (j0 - ws.packed.begin) * dv_pad;
    float* o_acc = ws.o_acc.get();
    const std::uint8_t* fresh = ws.strip_fresh.data();
    const std::int64_t tail = ws.half_tail ? strips - 1 : strips;  // as in Scores
    AccumulateTile(keys, strips, dv_pad, [&](std::int64_t s, std::int64_t c, StripKeys k) {
      const MatA p_rows{s_tile + s * kMicroRows * bc + k.begin, bc};
      const float* v_panel = v_tile + c / kMicroCols * bc * kMicroCols + k.begin * kMicroCols;
      float* o = o_acc + s * kMicroRows * dv_pad + c;
      const std::int64_t depth = k.end - k.begin;
      if (s == tail && fresh[s])
        MicroTile<false, kTailRows>(p_rows, v_panel, kMicroCols, o, dv_pad, depth);
      else if (s == tail)
        MicroTile<true, kTailRows>(p_rows, v_panel, kMicroCols, o, dv_pad, depth);
      else if (fresh[s])
        MicroTile<false>(p_rows, v_panel, kMicroCols, o, dv_pad, depth);
      else
        MicroTile<true>(p_rows, v_panel, kMicroCols, o, dv_pad, depth);
    });
    StripsWritten(ws, keys, strips);
  }
};

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// The tiled kernel's two products on AVX512-BF16 dot products (bf16_dot.hpp), for bf16 q, k
// and v: every operand is bf16 with pairs along the product's depth, read as stored. S =
// Q·Kᵀ takes Q unscaled — exact inputs — and softmax_scale·log2e multiplies S in float32, as
// the micro-tile is stored or, where the mask step only hides scores, in the softmax's
// exponent (TiledItem), so nothing is rounded that upstream does not round; P is rounded
// to bf16 (nearest even) before P·V, as upstream rounds it, while ℓ sums the float32 P.
// The bf16 micro-tile is this target's micro-tile, so strips, spans and panels are the
// float32 kernel's.
struct Bf16Products {
  static_assert(kMicroRows == bf16dot::kRows && kMicroCols == bf16dot::kCols, "one micro-tile for both kernels");

  static std::int64_t EvenHeadDim(const ForwardParams& prm) { return (prm.problem.head_dim + 1) / 2 * 2; }

  // K tiles as panels of kMicroCols keys, each (head_dim_pairs, kMicroCols, 2): step p holds
  // every key's elements 2p and 2p + 1 side by side (an odd head_dim ends with a zero) — the
  // float32 kernel's Kᵀ panel with a pair of bf16 for each float, so a panel's K rows, copied
  // into k_pair_rows, are transposed as 32-bit pairs at its last key (TransposeKeys); V
  // tiles as panels of kMicroCols columns, each (block_k / 2, kMicroCols, 2): step p holds
  // every column's values of keys 2p and 2p + 1, the two V rows (copied into v_pair_rows, zero
  // past head_dim_v) interleaved a vector at a time at the pair's second key (InterleavePairs).
  // Keys arrive in order and in whole panels (PackHead), so every pair is completed.
  static void Pack(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t b, std::int64_t kv_head,
                   std::int64_t from, std::int64_t to) {
    const std::int64_t bc = prm.plan.block_k, d = prm.problem.head_dim, dv = prm.problem.head_dim_v;
    const std::int64_t dv_pad = prm.plan.head_dim_v_padded, d_even = EvenHeadDim(prm);
    const std::int64_t ld_pairs = (d_even / 2 + kLanes - 1) / kLanes * kLanes;
    constexpr std::int64_t kStep = bf16dot::kPairStep;
    const hn::ScalableTag<std::uint32_t> du32;
    std::uint16_t* k_rows = ws.k_pair_rows.get();  // (kMicroCols, 2·ld_pairs): the keys of one panel
    for (std::int64_t e = 0; e < kMicroCols; ++e)
      std::fill(k_rows + e * 2 * ld_pairs + d, k_rows + (e + 1) * 2 * ld_pairs, std::uint16_t{0});
    std::uint16_t* v_rows = ws.v_pair_rows.get();  // (2, dv_pad): keys 2p and 2p + 1
    for (std::uint16_t* row : {v_rows, v_rows + dv_pad}) std::fill(row + dv, row + dv_pad, std::uint16_t{0});
    PackHead(prm, ws, b, kv_head, from, to, [&](std::int64_t j, const void* k_row, const void* v_row) {
      const auto* v = static_cast<const std::uint16_t*>(v_row);
      const std::int64_t e = j % kMicroCols, at = j - ws.packed.begin;  // at: its place (packed_head.hpp)
      std::uint16_t* k_dst = k_rows + e * 2 * ld_pairs;
      if (k_row != nullptr)
        std::memcpy(k_dst, k_row, static_cast<std::size_t>(d) * sizeof(std::uint16_t));
      else
        std::fill(k_dst, k_dst + d, std::uint16_t{0});
      if (e == kMicroCols - 1)
        TransposeKeys(du32, reinterpret_cast<const std::uint32_t*>(k_rows), ld_pairs, d_even / 2,
                      reinterpret_cast<std::uint32_t*>(ws.k_pairs.get() + (at / bc) * d_even * bc +
                                                       (at % bc) / kMicroCols * d_even * kMicroCols),
                      kMicroCols);
      std::uint16_t* v_dst = v_rows + (j % 2) * dv_pad;
      if (v != nullptr)
        std::memcpy(v_dst, v, static_cast<std::size_t>(dv) * sizeof(std::uint16_t));
      else
        std::fill(v_dst, v_dst + dv, std::uint16_t{0});
      if (j % 2 == 1)
        InterleavePairs(v_rows, v_rows + dv_pad, dv_pad,
                        ws.v_pairs.get() + (at / bc) * bc * dv_pad + (at % bc) / 2 * kStep, bc * kMicroCols);
    });
  }

  // Rows [at, at + rows) of the bf16 Q tile from queries i0.. of head h, as stored
  // (head_dim padded to even with a zero); rows up to at + rows_pad zero. (Read in place
  // instead, from the caller's rows, the products ran 5% slower at S = 128: each tile load
  // then gathers 16 rows from 16 pages, once per key panel.)
  static void LoadQ(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t b, std::int64_t h, std::int64_t i0,
                    std::int64_t rows, std::int64_t rows_pad, std::int64_t at) {
    const std::int64_t d = prm.problem.head_dim, d_even = EvenHeadDim(prm);
    std::uint16_t* q = ws.q_bf16.get() + at * d_even;  // (rows_pad, d_even)
    const std::int64_t q_bytes = d * static_cast<std::int64_t>(sizeof(std::uint16_t));
    for (std::int64_t r = 0; r < rows; ++r) {
      if (prm.switches.software_prefetch && r + kRowPrefetchDistance < rows)
        PrefetchRow(RowPointer(prm.q, b, i0 + r + kRowPrefetchDistance, h), q_bytes);
      std::memcpy(q + r * d_even, RowPointer(prm.q, b, i0 + r, h), static_cast<std::size_t>(q_bytes));
      if (d < d_even) q[r * d_even + d] = 0;
    }
    std::fill(q + rows * d_even, q + rows_pad * d_even, std::uint16_t{0});
  }

  // With AMX, kBlockStrips strips (32 rows) that share their span — every strip of a tile
  // that no causal diagonal, window or mask cuts — run as one product of 32 × 32 blocks
  // (bf16dot::DotBlock: four 16-row tiles in flight, where a micro-tile keeps two of 8 rows);
  // other strips, and every strip without AMX, one micro-tile at a time. Each element's
  // products are summed in the same order either way.
  static constexpr std::int64_t kBlockStrips = 32 / kMicroRows;
  static bool SharedSpan(const StripKeys* keys, std::int64_t strips) {
    if (strips != kBlockStrips || keys[0].begin == keys[0].end || !bf16dot::uses_amx()) return false;
    for (std::int64_t s = 1; s < kBlockStrips; ++s)
      if (keys[s].begin != keys[0].begin || keys[s].end != keys[0].end) return false;
    return true;
  }

  // S times `scale` (softmax_scale·log2e, or 1 where the softmax takes the factor: see
  // TiledItem). On AMX tiles a factor other than 1 is a pass over the stored scores.
  static constexpr bool kMayLeaveScoresUnscaled = true;
  // Whole strips only: the bf16 micro-kernels (and AMX's blocks of strips) have one height.
  static constexpr bool kHalfTail = false;
  static void Scores(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t j0, const StripKeys* keys,
                     std::int64_t strips, std::int64_t n_pad, float scale) {
    const std::int64_t d_even = EvenHeadDim(prm), bc = prm.plan.block_k, panel_stride = d_even * kMicroCols;
    const std::uint16_t* k_tile = ws.k_pairs.get() + ((j0 - ws.packed.begin) / bc) * d_even * bc;
    for (std::int64_t s0 = 0; s0 < strips; s0 += kBlockStrips) {
      const std::int64_t group = std::min(kBlockStrips, strips - s0);
      const std::uint16_t* q = ws.q_bf16.get() + s0 * kMicroRows * d_even;
      float* s_tile = ws.s_tile.get() + s0 * kMicroRows * bc;  // (rows_pad, bc)
      if (SharedSpan(keys + s0, group)) {
        const StripKeys k = keys[s0];
        bf16dot::DotBlock(q, d_even, k_tile + k.begin / kMicroCols * panel_stride, panel_stride, bf16dot::kPairStep,
                          d_even / 2, scale, false, s_tile + k.begin, bc, kBlockStrips * kMicroRows, k.end - k.begin);
        continue;
      }
      ScoreTile(keys + s0, group, n_pad, [&](std::int64_t s, std::int64_t j) {
        bf16dot::DotStore(q + s * kMicroRows * d_even, d_even, k_tile + j / kMicroCols * panel_stride, d_even / 2,
                          scale, s_tile + s * kMicroRows * bc + j, bc);
      });
    }
  }

  // Row r's P (columns [at, at + cols) of the S tile, rows bc apart) rounded into the bf16 P
  // tile as soon as the softmax has written it, while the row is in L1.
  static void FinishRow(ForwardWorkspace& ws, std::int64_t bc, std::int64_t r, std::int64_t at, std::int64_t cols) {
    bf16dot::RoundToBf16(ws.s_tile.get() + r * bc + at, ws.p_bf16.get() + r * bc + at, cols);
  }

  // õ += P·V(keys j0..), P in the bf16 P tile (FinishRow); a fresh strip's õ = P·V
  // (StripsWritten): on AMX blocks of four strips, stored where all four are fresh.
  static void Accumulate(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t j0, const StripKeys* keys,
                         std::int64_t strips) {
    const std::int64_t bc = prm.plan.block_k, dv_pad = prm.plan.head_dim_v_padded;
    const std::uint16_t* p_tile = ws.p_bf16.get();  // (rows_pad, bc)
    const std::uint16_t* v_tile = ws.v_pairs.get() + (j0 - ws.packed.begin) * dv_pad;
    const std::int64_t panel_stride = bc * kMicroCols;
    const std::uint8_t* fresh = ws.strip_fresh.data();
    for (std::int64_t s0 = 0; s0 < strips; s0 += kBlockStrips) {  // as in Scores
      const std::int64_t group = std::min(kBlockStrips, strips - s0);
      const std::uint16_t* p_rows = p_tile + s0 * kMicroRows * bc;
      float* o_acc = ws.o_acc.get() + s0 * kMicroRows * dv_pad;
      if (SharedSpan(keys + s0, group)) {
        const StripKeys k = keys[s0];
        const bool store = std::all_of(fresh + s0, fresh + s0 + group, [](std::uint8_t f) { return f != 0; });
        if (!store)  // some strips fresh, some not: the fresh ones' õ zeroed, then all added to
          for (std::int64_t s = s0; s < s0 + group; ++s)
            if (fresh[s]) std::fill(o_acc + (s - s0) * kMicroRows * dv_pad, o_acc + (s - s0 + 1) * kMicroRows * dv_pad, 0.0f);
        bf16dot::DotBlock(p_rows + k.begin, bc, v_tile + k.begin * kMicroCols, panel_stride, bf16dot::kPairStep,
                          (k.end - k.begin) / 2, 1.0f, !store, o_acc, dv_pad, kBlockStrips * kMicroRows, dv_pad);
        continue;
      }
      AccumulateTile(keys + s0, group, dv_pad, [&](std::int64_t s, std::int64_t c, StripKeys k) {
        const std::uint16_t* p = p_rows + s * kMicroRows * bc + k.begin;
        const std::uint16_t* v = v_tile + c / kMicroCols * panel_stride + k.begin * kMicroCols;
        float* o = o_acc + s * kMicroRows * dv_pad + c;
        if (fresh[s0 + s])
          bf16dot::DotStore(p, bc, v, (k.end - k.begin) / 2, 1.0f, o, dv_pad);
        else
          bf16dot::DotAccumulate(p, bc, v, (k.end - k.begin) / 2, o, dv_pad);
      });
    }
    StripsWritten(ws, keys, strips);
  }
};
#endif

// One work item of the tiled kernels: a Q tile of one (batch, head) — or, under pack_gqa,
// of every q head of one kv head, their rows stacked head after head — against its visible
// K/V tiles; Products (Fp32Products, Bf16Products) computes the two matrix products.
template <class Products>
void TiledItem(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t item) {
  const AttentionProblem& p = prm.problem;
  const CpuForwardPlan& plan = prm.plan;
  const std::int64_t d = p.head_dim, dv_pad = plan.head_dim_v_padded, bc = plan.block_k;

  const ForwardWorkItem w = plan.work_item(p, item);
  const std::int64_t b = w.batch, h0 = w.head, heads = w.heads, split = w.split, i0 = w.row_begin, rows = w.rows;
  const std::int64_t kv_head = h0 / (p.heads_q / p.heads_kv);
  // The heads' rows back to back (row e·rows + r: head h0 + e, query i0 + r), the tile padded
  // to whole strips once; a strip may end one head's rows and begin the next's, each row
  // masked to its own query.
  const std::int64_t rows_pad = (heads * rows + kMicroRows - 1) / kMicroRows * kMicroRows;
  const std::int64_t strips = rows_pad / kMicroRows;
  // A last strip of at most kTailRows real rows computes kTailRows (Products::kHalfTail):
  // rows_run of the tile's rows are computed, the rest neither computed nor read.
  ws.half_tail = Products::kHalfTail && heads * rows - (strips - 1) * kMicroRows <= kTailRows;
  const std::int64_t rows_run = ws.half_tail ? rows_pad - (kMicroRows - kTailRows) : rows_pad;
  const std::int64_t key_begin = w.key_begin, key_end = w.key_end;
  // The planner packs no variant that differs per q head, so head h0's serve every head.
  const RowMods mods(p, prm.internals, prm.alibi_slopes, prm.block_mask, prm.attn_mask, prm.attn_mask_blocks,
                     prm.score_hook, b, h0);
  // softmax_scale·log2e: applied by the products, or, where they may leave S unscaled and the
  // mask step only hides scores, by the softmax with its exponent's subtraction
  // (score_scale of SoftmaxRow) — one multiply-add where a pass over S would be.
  const float scale = p.softmax_scale * OnlineSoftmaxState::kLog2e;
  const bool softmax_scales = Products::kMayLeaveScoresUnscaled && mods.only_hides() && scale > 0.0f;
  // Or, where the mask step's only change to a score is a bias it reads per key, by the mask
  // step as it adds the bias (RowMods::only_adds_bias): s·scale + bias·log2e, one pass.
  const bool mask_scales = Products::kMayLeaveScoresUnscaled && !softmax_scales && mods.only_adds_bias();

  // The tiles at either end of the item's keys that the masks leave no work in (block masks,
  // a dense mask's summary: a document mask's other documents) are neither packed nor
  // visited.
  std::int64_t work_begin = w.first_block, work_end = key_end;
  // (first_block may lie past key_end: rows whose window begins past the last key.)
  if (const auto [kept_begin, kept_end] = mods.kept_keys(i0, rows); work_begin < work_end) {
    if (kept_begin > work_begin) work_begin = std::min(work_end, work_begin + (kept_begin - work_begin) / bc * bc);
    if (kept_end < work_end)
      work_end = std::min(work_end, std::max(work_begin, work_begin + (kept_end - work_begin + bc - 1) / bc * bc));
  }
  const auto has_work = [&](std::int64_t j0) { return mods.tile_has_work(i0, rows, j0, std::min(bc, key_end - j0)); };
  while (work_begin < work_end && !has_work(work_begin)) work_begin += bc;
  while (work_end > work_begin) {
    const std::int64_t last = work_begin + (work_end - 1 - work_begin) / bc * bc;  // the last tile's first key
    if (has_work(last)) break;
    work_end = last;
  }
  if (work_begin < work_end) Products::Pack(prm, ws, b, kv_head, std::max(key_begin, work_begin), work_end);
  for (std::int64_t e = 0; e < heads; ++e)  // the last head's rows end with the tile's padding
    Products::LoadQ(prm, ws, b, h0 + e, i0, rows, e + 1 < heads ? rows : rows_pad - e * rows, e * rows);
  ws.counters.q_read += heads * rows * d;

  float* s_tile = ws.s_tile.get();  // (rows_pad, bc)
  float* o_acc = ws.o_acc.get();      // (rows_pad, dv_pad)
  OnlineSoftmaxState* state = ws.states.data();
  std::int32_t* rescales = ws.rescales.data();
  const bool deferred = prm.switches.deferred_normalization;
  // õ written by each strip's first P·V (StripsWritten) — except where the softmax rescales
  // it at every tile (FlashAttention-1's normalization, the switch off): zeroed.
  ResetStates(ws, rows_pad);
  std::fill(ws.strip_fresh.begin(), ws.strip_fresh.begin() + strips, static_cast<std::uint8_t>(deferred));
  if (!deferred) std::fill(o_acc, o_acc + rows_pad * dv_pad, 0.0f);

  for (std::int64_t j0 = work_begin; j0 < work_end; j0 += bc) {
    const std::int64_t n = std::min(bc, key_end - j0);
    const std::int64_t n_pad = (n + kMicroCols - 1) / kMicroCols * kMicroCols;
    if (!mods.tile_has_work(i0, rows, j0, n)) continue;  // block-sparse: skip it entirely
    CountTiles(ws.counters, 1, heads * rows, n, d, p.head_dim_v);
    if (Products::kHalfTail) ws.counters.rows_computed += rows_run;

    StripKeys* keys = ws.strip_keys.data();  // (strips)
    FindStripKeys(p, mods, i0, strips, rows, heads * rows, j0, n, keys);
    ws.counters.scores_computed += SpanScores(keys, strips, ws.half_tail);
    Products::Scores(prm, ws, j0, keys, strips, n_pad, softmax_scales || mask_scales ? 1.0f : scale);
    // Row by row, while the row is in L1: the mask step, then the online-softmax update.
    ForEachSpanRow(i0, rows_run, rows, heads * rows, j0, n, keys, [&](std::int64_t r, std::int64_t i, std::int64_t j,
                                                                    std::int64_t n_r, std::int64_t cols) {
      float* srow = s_tile + r * bc + (j - j0);
      MaskRow(mods, srow, i, j, n_r, cols, mask_scales ? scale : 1.0f);
      if (prm.switches.software_prefetch) mods.prefetch_dense_mask(i, j0 + bc, std::min(j0 + 2 * bc, key_end));
      SoftmaxRow(mods, srow, i, j, cols, state[r], o_acc + r * dv_pad, dv_pad, rescales[r], deferred,
                 p.rescale_threshold, softmax_scales ? scale : 1.0f);
      Products::FinishRow(ws, bc, r, j - j0, cols);
    });
    Products::Accumulate(prm, ws, j0, keys, strips);
  }

  // Epilogue: normalize once (deferred normalization) and store lse — a split's partial
  // result goes to the float32 buffers that merge_attention_states combines. Strips that saw
  // no key have õ zero.
  for (std::int64_t s = 0; s < strips; ++s)
    if (ws.strip_fresh[static_cast<std::size_t>(s)])
      std::fill(o_acc + s * kMicroRows * dv_pad, o_acc + (s + 1) * kMicroRows * dv_pad, 0.0f);
  const std::int64_t out_bytes = p.head_dim_v * static_cast<std::int64_t>(dtype_size(prm.out.dtype));
  for (std::int64_t e = 0; e < heads; ++e) {
    for (std::int64_t r = 0; r < rows; ++r) {
      if (prm.switches.software_prefetch && plan.splits == 1 && r + kRowPrefetchDistance < rows)
        PrefetchRow(OutputRow(prm, b, i0 + r + kRowPrefetchDistance, h0 + e), out_bytes);
      const std::int64_t t = e * rows + r;  // the row in the tile
      StoreOutputRow(prm, ws, split, b, h0 + e, i0 + r, o_acc + t * dv_pad, state[t], rescales[t]);
    }
  }
  ws.counters.o_written += heads * rows * p.head_dim_v;
  ws.counters.lse_written += heads * rows;
}

void TiledWorkItem(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t item) {
  TiledItem<Fp32Products>(prm, ws, item);
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
void TiledBf16Item(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t item) {
  const bf16dot::TileScope tiles;  // the thread's AMX state handed back when the item ends
  TiledItem<Bf16Products>(prm, ws, item);
}
#endif

// The tiled_bf16 work item where this target has one (AVX-512, whose micro-tile the bf16
// micro-kernel shares), else null.
ForwardWorkItemFn TiledBf16WorkItem() {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  return &TiledBf16Item;
#else
  return nullptr;
#endif
}

KernelGeometry GetKernelGeometry() {
  return {hwy::TargetName(HWY_TARGET), static_cast<int>(kLanes), static_cast<int>(kMicroRows),
          static_cast<int>(kMicroCols)};
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace flashattn::cpu {

HWY_EXPORT(GetKernelGeometry);
HWY_EXPORT(TiledWorkItem);
HWY_EXPORT(TiledBf16WorkItem);

KernelGeometry kernel_geometry() { return HWY_DYNAMIC_DISPATCH(GetKernelGeometry)(); }

namespace {
std::atomic<bool> avx2_decode_enabled{true};
}  // namespace

void set_avx2_decode_enabled(bool enabled) { avx2_decode_enabled.store(enabled, std::memory_order_relaxed); }

std::optional<KernelGeometry> avx2_kernel_geometry() {
#if HWY_TARGETS & HWY_AVX2
  // Highway's AVX2 target needs these (hwy/targets.cc); the CPU is asked once. F16C from
  // CPUID leaf 1 directly: clang's __builtin_cpu_supports does not know it.
  static const bool runs = [] {
    __builtin_cpu_init();
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2") && f16c;
  }();
  if (runs && avx2_decode_enabled.load(std::memory_order_relaxed)) return N_AVX2::GetKernelGeometry();
#endif
  return std::nullopt;
}

bool tiled_bf16_available() {
  return bf16dot::available() && HWY_DYNAMIC_DISPATCH(TiledBf16WorkItem)() != nullptr;
}

ForwardWorkItemFn forward_work_item_kernel(const CpuForwardPlan& plan) {
  kernel_geometry();  // the first dispatched call picks the target; then the table is direct
  const ForwardKernel kernel = plan.kernel;
  switch (kernel) {
    case ForwardKernel::tiled: return &HWY_DYNAMIC_DISPATCH(TiledWorkItem);
    case ForwardKernel::decode:
    case ForwardKernel::decode_fp16:
    case ForwardKernel::decode_bf16: return decode_work_item_kernel(kernel, plan.avx2_decode);
    case ForwardKernel::tiled_bf16:
      // The plan checked this; the check here keeps a hand-made plan from an illegal instruction.
      if (!tiled_bf16_available())
        throw Error("kernel tiled_bf16: this CPU (AVX512-BF16) or SIMD target (" + std::string(kernel_geometry().target) +
                    ") cannot run it");
      return HWY_DYNAMIC_DISPATCH(TiledBf16WorkItem)();
    case ForwardKernel::automatic: break;
  }
  throw Error("forward kernel: a plan names its kernel, never automatic");
}

}  // namespace flashattn::cpu
#endif  // HWY_ONCE
