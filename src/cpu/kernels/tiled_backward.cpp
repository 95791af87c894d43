// The CPU backward kernel (docs/algorithm.md §2 recomputation, §3 parallel over K/V blocks, §5
// deterministic dQ), compiled once per Highway SIMD target. Per pair of tiles
// (Q rows i, K/V columns j), with S' = Q·scale·log2e·Kᵀ in log2 units:
//
//   P  = 2^(S' − lse·log2e)           recomputed from the forward's lse, masked to 0
//   dP = dO·Vᵀ,  dS = P ∘ (dP − D)    with D = rowsum(dO ∘ O) precomputed
//   dV += Pᵀ·dO,  dK += scale·dSᵀ·Q,  dQ += scale·dS·K
//
// Every product runs on the forward's micro-kernel; Pᵀ and dSᵀ are read in place
// through a transposed view (MatA), never copied.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/cpu/kernels/tiled_backward.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <thread>
#include <tuple>

#include "flashattn/online_softmax.hpp"
#include "flashattn/error.hpp"
#include "src/core/element.hpp"
#include "src/cpu/kernels/backward_kernel.hpp"
#include "src/cpu/kernels/bf16_dot.hpp"
#include "src/cpu/kernels/forward_kernel.hpp"
#include "src/cpu/kernels/kv_pack-inl.h"
#include "src/cpu/kernels/score_mods-inl.h"
#include "src/cpu/kernels/simd_math-inl.h"
#include "src/cpu/kernels/tile_ops-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

std::int64_t RoundUp(std::int64_t n, std::int64_t m) { return (n + m - 1) / m * m; }

// The backward reads K and V as ordinary views (its entry points take no block table).
constexpr PagedKv kUnpaged{};

// K/V of one (batch, kv head) for keys [from, to) through PackKeys (kv_pack-inl.h), as the
// forward packs them, placed by `place`.
template <class PlaceFn>
void PackHead(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t b, std::int64_t kv_head, std::int64_t from,
              std::int64_t to, PlaceFn place) {
  PackKeys(KvRows{&prm.k, &prm.v, &kUnpaged, b, kv_head}, prm.problem.seqlen_k, prm.plan.block_k, from, to, true,
           ws.packed, ws.counters, place);
}

float* LsePointer(const BackwardParams& prm, std::int64_t b, std::int64_t h, std::int64_t i) {
  return const_cast<float*>(static_cast<const float*>(prm.lse.data)) + b * prm.lse.strides[0] +
         h * prm.lse.strides[1] + i * prm.lse.strides[2];
}

void* OutRowPointer(const MutableTensorView& t, std::int64_t b, std::int64_t s, std::int64_t h) {
  return static_cast<unsigned char*>(t.data) +
         detail::offset4(t, b, s, h, 0) * static_cast<std::int64_t>(dtype_size(t.dtype));
}

// Large rows (IsLargeLse2) recomputed together, up to this many at a time: whole micro-tiles
// of rows, so that their scores run on the products' micro-kernel.
constexpr std::int64_t kLargeRowGroup = 8 * kMicroRows;
static_assert(kLargeRowGroup <= kLargeRowsPerItem, "a group fits the workspace's large-row buffers");

// How far, relative to |lse·log2e|, a large row's own m + log2 ℓ may lie from the caller's
// lse·log2e and still be the same normaliser: 8 to 16 float32 ulps, the roundings of the
// forward's scores, of lse and of its product with log2e. A row whose keys are split between
// calls (ring_backward) differs by log2 of its mass outside this call's keys: a share below
// about 7e-4 at |lse| = 710 (1e-2 at 1e4) passes as the same, the error P then carries.
constexpr double kLargeLseAgreement = 0x1p-20;

// The exp2 offsets of an item's large rows of (b, h) in two parts, (m, log2 ℓ), into
// prm.lse2 and prm.lse2_low: m the maximum of the row's scores S' (and of the sink's logit),
// ℓ = Σ 2^(S' − m) over the keys it sees (and the sink). The scores are computed as the
// tiles compute them — Q·scale·log2e and K rows converted as the f32 products convert them,
// K/V tile by K/V tile on the micro-kernel (one FMA chain per score in head-dim order), then
// RowMods::apply — so that where a bias dominates the scores, S' − m in the tiles is exact
// and P = 2^((S' − m) − log2 ℓ) sums to 1 — where they agree with the caller's lse. A row
// that sees no key gets (−∞, 0).
void BackwardLargeRows(const BackwardParams& prm, BackwardWorkspace& ws, const LargeRowItem& item) {
  const AttentionProblem& p = prm.problem;
  const std::int64_t b = item.batch_head / p.heads_q, h = item.batch_head % p.heads_q;
  const RowMods mods(p, prm.internals, prm.alibi_slopes, prm.block_mask, prm.attn_mask, prm.attn_mask_blocks,
                     prm.score_hook, b, h);
  const DF df;
  const std::int64_t d_ld = RowLd(prm.plan.head_dim_padded);
  const std::int64_t bc = prm.plan.block_k, d = p.head_dim, d_pad = prm.plan.head_dim_padded;
  const std::int64_t kv_head = h / (p.heads_q / p.heads_kv), first_row = (b * p.heads_q + h) * p.seqlen_q;
  const float q_scale = p.softmax_scale * OnlineSoftmaxState::kLog2e;
  const float sink2 = prm.sinks.data != nullptr
                          ? static_cast<const float*>(prm.sinks.data)[h * prm.sinks.strides[0]] * OnlineSoftmaxState::kLog2e
                          : -std::numeric_limits<float>::infinity();
  for (std::int64_t g0 = 0; g0 < item.count; g0 += kLargeRowGroup) {
    const std::int64_t count = std::min(kLargeRowGroup, item.count - g0);
    const std::int64_t count_pad = RoundUp(count, kMicroRows);
    const std::int64_t* group = item.rows + g0;
    for (std::int64_t r = 0; r < count_pad; ++r) {
      float* qrow = ws.large_q.get() + r * d_ld;
      if (r < count) LoadRow(RowPointer(prm.q, b, group[r], h), p.dtype, d, q_scale, qrow);
      std::fill(qrow + (r < count ? d : 0), qrow + d_pad, 0.0f);
    }
    // Per row: the maximum so far and Σ 2^(S' − max), starting from the sink alone.
    float m[kLargeRowGroup];
    double l[kLargeRowGroup];
    std::fill(m, m + count, sink2);
    std::fill(l, l + count, sink2 == -std::numeric_limits<float>::infinity() ? 0.0 : 1.0);
    for (std::int64_t j0 = 0; j0 < p.seqlen_k; j0 += bc) {
      const std::int64_t n = std::min(bc, p.seqlen_k - j0), n_pad = RoundUp(n, kMicroCols);
      bool any = false;
      for (std::int64_t r = 0; r < count && !any; ++r) any = mods.tile_has_work(group[r], 1, j0, n);
      if (!any) continue;
      for (std::int64_t c0 = 0; c0 < n_pad; c0 += kMicroCols) {
        for (std::int64_t e = 0; e < kMicroCols; ++e) {
          float* row = ws.large_k_rows.get() + e * d_pad;
          const std::int64_t j = j0 + c0 + e;
          if (j < p.seqlen_k) LoadRow(RowPointer(prm.k, b, j, kv_head), prm.k.dtype, d, 1.0f, row);
          std::fill(row + (j < p.seqlen_k ? d : 0), row + d_pad, 0.0f);
        }
        TransposeKeys(df, ws.large_k_rows.get(), d_pad, d, ws.large_kt.get() + c0, n_pad);
      }
      TileGemm<false>({ws.large_q.get(), d_ld}, ws.large_kt.get(), n_pad, ws.large_scores.get(), n_pad, count_pad,
                      n_pad, d);
      for (std::int64_t r = 0; r < count; ++r) {
        if (!mods.tile_has_work(group[r], 1, j0, n)) continue;
        float* scores = ws.large_scores.get() + r * n_pad;
        mods.apply(scores, nullptr, group[r], j0, n, n_pad);
        const float tile_max = *std::max_element(scores, scores + n_pad);
        if (tile_max == -std::numeric_limits<float>::infinity()) continue;
        const float m_new = std::max(m[r], tile_max);
        VF sum = hn::Zero(df);
        for (std::int64_t c = 0; c < n_pad; c += kLanes)
          sum = hn::Add(sum, Exp2(df, hn::Sub(hn::Load(df, scores + c), hn::Set(df, m_new))));
        l[r] = l[r] * std::exp2(static_cast<double>(m[r]) - m_new) + hn::GetLane(hn::SumOfLanes(df, sum));
        m[r] = m_new;
      }
    }
    for (std::int64_t r = 0; r < count; ++r) {
      const std::int64_t row = first_row + group[r];
      if (!(l[r] > 0.0)) {  // no key of this call, and no sink
        prm.lse2[row] = -std::numeric_limits<float>::infinity();
        continue;
      }
      // The caller's lse stays the normaliser where it disagrees with this call's keys beyond
      // its float32 rounding (kLargeLseAgreement): it came from more keys than this call sees
      // (ring_backward's shards, a backward split over keys), and P = 2^(S' − lse·log2e)
      // is then as exact as that lse.
      const double own = static_cast<double>(m[r]) + std::log2(l[r]), given = prm.lse2[row];
      if (std::abs(own - given) > std::abs(given) * kLargeLseAgreement) continue;
      prm.lse2[row] = m[r];
      prm.lse2_low[row] = static_cast<float>(std::log2(l[r]));
    }
  }
  ws.counters.large_lse_rows += item.count;
}

// D = rowsum(dO ∘ O) − dlse and the exp2 offsets of P (BackwardParams::lse2, lse2_low) of every
// row of (b, h), as lse·log2e: BackwardLargeRows then redoes the large rows'. Zeroes the
// head's rows of the dQ accumulator (by the thread that first touches them, all threads at
// once, not one thread before the region).
void BackwardDelta(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t bh) {
  const AttentionProblem& p = prm.problem;
  const std::int64_t dq_floats = p.seqlen_q * prm.plan.head_dim_padded;
  std::fill(prm.dq_accum + bh * dq_floats, prm.dq_accum + (bh + 1) * dq_floats, 0.0f);
  const std::int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const DF df;
  const std::int64_t dv = p.head_dim_v, dv_lanes = RoundUp(dv, kLanes);
  float* o_row = ws.delta_rows.get();
  float* go_row = o_row + dv_lanes;
  for (std::int64_t i = 0; i < p.seqlen_q; ++i) {
    LoadRow(RowPointer(prm.out, b, i, h), p.dtype, dv, 1.0f, o_row);
    LoadRow(RowPointer(prm.dout, b, i, h), p.dtype, dv, 1.0f, go_row);
    std::fill(o_row + dv, o_row + dv_lanes, 0.0f);
    std::fill(go_row + dv, go_row + dv_lanes, 0.0f);
    VF acc = hn::Zero(df);
    for (std::int64_t c = 0; c < dv; c += kLanes) acc = hn::MulAdd(hn::Load(df, o_row + c), hn::Load(df, go_row + c), acc);
    const std::int64_t row = bh * p.seqlen_q + i;
    prm.delta[row] = hn::GetLane(hn::SumOfLanes(df, acc));
    if (prm.dlse.data != nullptr)  // ∂lse_i/∂s_ij = P_ij: dS_ij = P_ij·(dP_ij − (D_i − dlse_i))
      prm.delta[row] -= static_cast<const float*>(prm.dlse.data)[b * prm.dlse.strides[0] + h * prm.dlse.strides[1] +
                                                                 i * prm.dlse.strides[2]];
    prm.lse2[row] = *LsePointer(prm, b, h, i) * OnlineSoftmaxState::kLog2e;
    prm.lse2_low[row] = 0.0f;
  }
  ws.counters.o_read += p.seqlen_q * dv;
  ws.counters.dout_read += p.seqlen_q * dv;
}

// Loads the exp2 offsets and D of rows [i0, i0 + rows) of (b, h); rows up to rows_pad get zeros.
void LoadRowStats(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t b, std::int64_t h,
                  std::int64_t i0, std::int64_t rows, std::int64_t rows_pad) {
  const std::int64_t first = (b * prm.problem.heads_q + h) * prm.problem.seqlen_q + i0;
  for (std::int64_t r = 0; r < rows_pad; ++r) {
    ws.row_lse2[r] = r < rows ? prm.lse2[first + r] : 0.0f;
    ws.row_lse2_low[r] = r < rows ? prm.lse2_low[first + r] : 0.0f;
    ws.row_delta[r] = r < rows ? prm.delta[first + r] : 0.0f;
  }
}

// Where the Q and dO tile of rows [i0, ..) of (b, h) is kept in the thread's copy of its kv
// head's tiles (BackwardWorkspace::q_kept): its index among the group · q_blocks tiles of the
// copy, −1 where the plan keeps none; and whether it was converted there by an earlier K/V
// tile. A tile not yet converted is marked converted: the caller converts it now. A new kv
// head starts the copy over.
struct KeptTile {
  std::int64_t index = -1;
  bool converted = false;
};
KeptTile KeepTile(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t b, std::int64_t h, std::int64_t i0) {
  if (ws.kept_converted.empty()) return {};
  const AttentionProblem& p = prm.problem;
  const std::int64_t group = p.heads_q / p.heads_kv, kv = b * p.heads_kv + h / group;
  if (ws.kept_kv != kv) {
    ws.kept_kv = kv;
    std::fill(ws.kept_converted.begin(), ws.kept_converted.end(), std::uint8_t{0});
  }
  const std::int64_t index = h % group * prm.plan.q_blocks + i0 / prm.plan.block_q;
  std::uint8_t& converted = ws.kept_converted[static_cast<std::size_t>(index)];
  const KeptTile kept{index, converted != 0};
  converted = 1;
  return kept;
}

// Whether each of the `strips` row strips spans the whole tile of n_pad columns: no causal
// diagonal, window or mask narrows any of them.
bool WholeSpans(const StripKeys* keys, std::int64_t strips, std::int64_t n_pad) {
  for (std::int64_t s = 0; s < strips; ++s)
    if (keys[s].begin != 0 || keys[s].end != n_pad) return false;
  return true;
}

// The backward's five products on float32 FMAs (the forward's micro-kernel), K and V
// widened at packing, Q pre-scaled by scale·log2e as it is loaded.
struct Fp32BackwardProducts {
  static constexpr std::int64_t kRowMultiple = kMicroRows;  // a Q tile's rows, padded (within StripsFor's strips)
  // The scores ScoresAndDp computes: each strip over its span.
  static std::int64_t ScoresComputed(const StripKeys* keys, std::int64_t rows_pad, std::int64_t /*n_pad*/) {
    return SpanScores(keys, rows_pad / kMicroRows, false);
  }

  // dK and dV of a K/V tile accumulate as rows of keys: (block_k, D_pad), (block_k, Dv_pad),
  // n keys padded to whole micro-tiles of rows (block_k is a multiple of those and of columns).
  static std::int64_t KeyRows(std::int64_t n) { return RoundUp(n, kMicroRows); }
  static void ZeroDkDv(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t n) {
    std::fill(ws.dk_acc.get(), ws.dk_acc.get() + KeyRows(n) * prm.plan.head_dim_padded, 0.0f);
    std::fill(ws.dv_acc.get(), ws.dv_acc.get() + KeyRows(n) * prm.plan.head_dim_v_padded, 0.0f);
  }

  // dK = scale·dSᵀ·Q = ln2·dSᵀ·Q' because Q' = Q·scale·log2e.
  static void StoreDkDv(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t b, std::int64_t kv_head,
                        std::int64_t j0, std::int64_t n) {
    const AttentionProblem& p = prm.problem;
    for (std::int64_t r = 0; r < n; ++r) {
      StoreRow(ws.dk_acc.get() + r * prm.plan.head_dim_padded, p.head_dim, OnlineSoftmaxState::kLn2,
               OutRowPointer(prm.dk, b, j0 + r, kv_head), prm.dk.dtype);
      StoreRow(ws.dv_acc.get() + r * prm.plan.head_dim_v_padded, p.head_dim_v, 1.0f,
               OutRowPointer(prm.dv, b, j0 + r, kv_head), prm.dv.dtype);
    }
  }

  // Packs Kᵀ and Vᵀ (one (dim, block_k) panel per tile) and K (rows padded to D_pad) of one
  // (batch, kv head) for keys [from, to), whole tiles at a time, reusing what is packed: each
  // key's K row converted into k_packed and its V row into row_scratch, then every
  // kMicroCols keys (block_k is a multiple) their rows transposed in registers into the
  // tile's columns (TransposeKeys, as the forward packs).
  static void Pack(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t b, std::int64_t kv_head,
                   std::int64_t from, std::int64_t to) {
    const AttentionProblem& p = prm.problem;
    const std::int64_t bc = prm.plan.block_k, d = p.head_dim, dv = p.head_dim_v;
    const std::int64_t d_pad = prm.plan.head_dim_padded, dv_pad = prm.plan.head_dim_v_padded;
    float* v_rows = ws.row_scratch.get();  // (kMicroCols, dv_pad): the V rows of one block of keys
    PackHead(prm, ws, b, kv_head, from, to, [&](std::int64_t j, const void* k_row, const void* v_row) {
      const std::int64_t tile = j / bc, col = j % bc, e = j % kMicroCols;
      float* krow = ws.k_packed.get() + j * RowLd(d_pad);
      if (k_row != nullptr) LoadRow(k_row, prm.k.dtype, d, 1.0f, krow);
      std::fill(krow + (k_row != nullptr ? d : 0), krow + d_pad, 0.0f);  // padding keys: zeros
      float* vrow = v_rows + e * dv_pad;
      if (v_row != nullptr) LoadRow(v_row, prm.v.dtype, dv, 1.0f, vrow);
      std::fill(vrow + (v_row != nullptr ? dv : 0), vrow + dv_pad, 0.0f);
      if (e == kMicroCols - 1) {
        const DF df;
        TransposeKeys(df, ws.k_packed.get() + (j - e) * RowLd(d_pad), RowLd(d_pad), d,
                      ws.kt_packed.get() + tile * d * RowLd(bc) + col - e, RowLd(bc));
        TransposeKeys(df, v_rows, dv_pad, dv, ws.vt_packed.get() + tile * dv * RowLd(bc) + col - e, RowLd(bc));
      }
    });
  }

  // The Q tile (scaled by scale·log2e) and the dO tile of rows [i0, i0 + rows) of (b, h),
  // rows up to rows_pad zero, at ws.q_rows and ws.do_rows: in the thread's copy of its kv
  // head's tiles (BackwardWorkspace::q_kept), converted there at the tile's first use, or,
  // without the copy, converted into q_tile and do_tile.
  static void LoadQ(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t b, std::int64_t h,
                    std::int64_t i0, std::int64_t rows, std::int64_t rows_pad) {
    const std::int64_t bq = prm.plan.block_q;
    const std::int64_t d_ld = RowLd(prm.plan.head_dim_padded), dv_ld = RowLd(prm.plan.head_dim_v_padded);
    const KeptTile kept = KeepTile(prm, ws, b, h, i0);
    float* q = kept.index < 0 ? ws.q_tile.get() : ws.q_kept.get() + kept.index * bq * d_ld;
    float* dout = kept.index < 0 ? ws.do_tile.get() : ws.do_kept.get() + kept.index * bq * dv_ld;
    ws.q_rows = q;
    ws.do_rows = dout;
    if (!kept.converted) ConvertQ(prm, b, h, i0, rows, rows_pad, q, dout);
  }

  // Rows [i0, i0 + rows) of Q·scale·log2e and of dO of (b, h) into q and dout (rows
  // RowLd(D_pad) and RowLd(Dv_pad) floats apart); rows up to rows_pad and columns past D, Dv
  // zero.
  static void ConvertQ(const BackwardParams& prm, std::int64_t b, std::int64_t h, std::int64_t i0, std::int64_t rows,
                       std::int64_t rows_pad, float* HWY_RESTRICT q, float* HWY_RESTRICT dout) {
    const AttentionProblem& p = prm.problem;
    const std::int64_t d = p.head_dim, dv = p.head_dim_v;
    const std::int64_t d_pad = prm.plan.head_dim_padded, dv_pad = prm.plan.head_dim_v_padded;
    const float q_scale = p.softmax_scale * OnlineSoftmaxState::kLog2e;
    for (std::int64_t r = 0; r < rows_pad; ++r) {
      float* qrow = q + r * RowLd(d_pad);
      float* dorow = dout + r * RowLd(dv_pad);
      if (r < rows) {
        LoadRow(RowPointer(prm.q, b, i0 + r, h), p.dtype, d, q_scale, qrow);
        LoadRow(RowPointer(prm.dout, b, i0 + r, h), p.dtype, dv, 1.0f, dorow);
      } else {
        std::fill(qrow, qrow + d, 0.0f);
        std::fill(dorow, dorow + dv, 0.0f);
      }
      std::fill(qrow + d, qrow + d_pad, 0.0f);
      std::fill(dorow + dv, dorow + dv_pad, 0.0f);
    }
  }

  // S' = Q'·Kᵀ into p_tile and dP = dO·Vᵀ into ds_tile, for K/V tile `tile`, each row strip
  // over its span of `keys` (FindStripKeys) only: elsewhere the tiles keep what they held,
  // which ComputePAndDS replaces by zeros.
  // S' from the pre-scaled Q (`scale` is always 1 here: kMayLeaveScoresUnscaled).
  static constexpr bool kMayLeaveScoresUnscaled = false;
  static void ScoresAndDp(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t tile,
                          std::int64_t rows_pad, std::int64_t n_pad, float /*scale*/, const StripKeys* keys) {
    const std::int64_t bc = prm.plan.block_k, d = prm.problem.head_dim, dv = prm.problem.head_dim_v;
    const std::int64_t strips = rows_pad / kMicroRows;
    if (WholeSpans(keys, strips, n_pad)) {  // the whole tile, without a look at each micro-tile's span
      TileGemm<false>({ws.q_rows, RowLd(prm.plan.head_dim_padded)}, ws.kt_packed.get() + tile * d * RowLd(bc),
                      RowLd(bc), ws.p_tile.get(), bc, rows_pad, n_pad, d);
      TileGemm<false>({ws.do_rows, RowLd(prm.plan.head_dim_v_padded)}, ws.vt_packed.get() + tile * dv * RowLd(bc),
                      RowLd(bc), ws.ds_tile.get(), bc, rows_pad, n_pad, dv);
      return;
    }
    for (const auto& [a, ld, b, c, depth] :
         {std::tuple{ws.q_rows, RowLd(prm.plan.head_dim_padded), ws.kt_packed.get() + tile * d * RowLd(bc),
                     ws.p_tile.get(), d},
          std::tuple{ws.do_rows, RowLd(prm.plan.head_dim_v_padded), ws.vt_packed.get() + tile * dv * RowLd(bc),
                     ws.ds_tile.get(), dv}})
      ScoreTile(keys, strips, n_pad, [&, a = a, ld = ld, b = b, c = c, depth = depth](std::int64_t s, std::int64_t j) {
        MicroTile<false>({a + s * kMicroRows * ld, ld}, b + j, RowLd(bc), c + s * kMicroRows * bc + j, bc, depth);
      });
  }

  // dV += Pᵀ·dO and dK += dSᵀ·Q' (Pᵀ, dSᵀ read through transposed views) over the n keys'
  // KeyRows, and this tile's dQ share dS·K into dq_tile over the n_pad columns. P and dS are
  // zero outside each row strip's span of `keys` (ComputePAndDS), so each product's depth is
  // narrowed to where they are not: dQ's row strip to its span of keys, a strip of key rows of
  // dV and dK to the row strips whose spans it meets. Columns of P and dS past n_pad up to
  // KeyRows(n) (the key rows' micro-tile padding) become zeros.
  static void Gradients(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t j0, std::int64_t rows_pad,
                        std::int64_t n, std::int64_t n_pad, const StripKeys* keys) {
    const std::int64_t bc = prm.plan.block_k, key_rows = KeyRows(n), strips = rows_pad / kMicroRows;
    const std::int64_t d_pad = prm.plan.head_dim_padded, dv_pad = prm.plan.head_dim_v_padded;
    for (std::int64_t r = 0; r < rows_pad && key_rows > n_pad; ++r) {
      std::fill(ws.p_tile.get() + r * bc + n_pad, ws.p_tile.get() + r * bc + key_rows, 0.0f);
      std::fill(ws.ds_tile.get() + r * bc + n_pad, ws.ds_tile.get() + r * bc + key_rows, 0.0f);
    }
    if (WholeSpans(keys, strips, n_pad)) {  // every product over the whole tile
      TileGemm<true>({ws.p_tile.get(), 1, bc}, ws.do_rows, RowLd(dv_pad), ws.dv_acc.get(), dv_pad, key_rows, dv_pad,
                     rows_pad);
      TileGemm<true>({ws.ds_tile.get(), 1, bc}, ws.q_rows, RowLd(d_pad), ws.dk_acc.get(), d_pad, key_rows, d_pad,
                     rows_pad);
      TileGemm<false>({ws.ds_tile.get(), bc}, ws.k_packed.get() + j0 * RowLd(d_pad), RowLd(d_pad), ws.dq_tile.get(),
                      d_pad, rows_pad, d_pad, n_pad);
      return;
    }
    // The Q tile rows (whole strips) that each strip of key rows meets.
    StripKeys* depth = ws.key_strip_rows.data();
    for (std::int64_t k0 = 0; k0 < key_rows; k0 += kMicroRows) {
      StripKeys& rows = depth[k0 / kMicroRows];
      rows = {};
      for (std::int64_t s = 0; s < strips; ++s) {
        if (keys[s].begin >= k0 + kMicroRows || keys[s].end <= k0) continue;
        if (rows.begin == rows.end) rows.begin = s * kMicroRows;
        rows.end = (s + 1) * kMicroRows;
      }
    }
    for (const auto& [a, b, ldb, c, ldc] :
         {std::tuple{ws.p_tile.get(), ws.do_rows, RowLd(dv_pad), ws.dv_acc.get(), dv_pad},
          std::tuple{ws.ds_tile.get(), ws.q_rows, RowLd(d_pad), ws.dk_acc.get(), d_pad}})
      for (std::int64_t col = 0; col < ldc; col += kMicroCols)
        for (std::int64_t k0 = 0; k0 < key_rows; k0 += kMicroRows) {
          const StripKeys rows = depth[k0 / kMicroRows];
          if (rows.begin != rows.end)
            MicroTile<true>({a + k0 + rows.begin * bc, 1, bc}, b + rows.begin * ldb + col, ldb, c + k0 * ldc + col, ldc,
                            rows.end - rows.begin);
        }
    const float* k_rows = ws.k_packed.get() + j0 * RowLd(d_pad);
    for (std::int64_t col = 0; col < d_pad; col += kMicroCols)
      for (std::int64_t s = 0; s < strips; ++s) {
        const StripKeys k = keys[s];
        MicroTile<false>({ws.ds_tile.get() + s * kMicroRows * bc + k.begin, bc}, k_rows + k.begin * RowLd(d_pad) + col,
                         RowLd(d_pad), ws.dq_tile.get() + s * kMicroRows * d_pad + col, d_pad, k.end - k.begin);
      }
  }
};

// Waits until `ticket` reaches `turn`: in deterministic mode K/V block `turn` is next to add
// into a Q tile; with a shared dbias, (batch, kv head) `turn` is next to add into a k block's
// columns. Work items are handed out in order, so the item it waits for is already running.
void WaitForTicket(const std::atomic<std::int64_t>& ticket, std::int64_t turn) {
  while (ticket.load(std::memory_order_acquire) != turn) std::this_thread::yield();
}

// Where the dS rows of one (batch, q head) against one K/V tile add up for options.dbias:
// row i's key j0 + c at base[i·row_stride + c·col_stride] (0 along a broadcast dim) —
// dbias itself, or the item's dbias_tile when items share dbias elements. Null base: no dbias.
struct DbiasRows {
  float* base = nullptr;
  std::int64_t row_stride = 0, col_stride = 0;
};

// The offset of dbias element (b, h, 0, j0), broadcast.
std::int64_t DbiasOffset(const MutableTensorView& db, std::int64_t b, std::int64_t h, std::int64_t j0) {
  const auto stride = [&](int d) { return db.shape[d] > 1 ? db.strides[d] : 0; };
  return b * stride(0) + h * stride(1) + j0 * stride(3);
}

DbiasRows DbiasTarget(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t b, std::int64_t h,
                      std::int64_t kv_head, std::int64_t j0) {
  const MutableTensorView& db = prm.dbias;
  if (db.data == nullptr) return {};
  if (!prm.dbias_shared)
    return {static_cast<float*>(db.data) + DbiasOffset(db, b, h, j0), db.shape[2] > 1 ? db.strides[2] : 0,
            db.shape[3] > 1 ? db.strides[3] : 0};
  const DbiasTileShape t(prm.plan, prm.problem, db);
  const std::int64_t plane = t.planes > 1 ? h - kv_head * t.planes : 0;
  return {ws.dbias_tile.get() + plane * t.rows * t.cols, t.rows > 1 ? t.cols : 0, t.cols > 1 ? 1 : 0};
}

// dst[c·col_stride] += ds[c] for c < n; col_stride 0 (a broadcast key dim) adds the row's
// sum, taken left to right.
void AddDbiasRow(const float* HWY_RESTRICT ds, std::int64_t n, float* HWY_RESTRICT dst, std::int64_t col_stride) {
  if (col_stride == 0) {
    float sum = 0.0f;
    for (std::int64_t c = 0; c < n; ++c) sum += ds[c];
    *dst += sum;
  } else if (col_stride == 1) {
    const DF df;
    std::int64_t c = 0;
    for (; c + kLanes <= n; c += kLanes) hn::StoreU(hn::Add(hn::LoadU(df, dst + c), hn::Load(df, ds + c)), df, dst + c);
    for (; c < n; ++c) dst[c] += ds[c];
  } else {
    for (std::int64_t c = 0; c < n; ++c) dst[c * col_stride] += ds[c];
  }
}

// A shared dbias: item (b, kv head, k block)'s dbias_tile added into dbias once every lower
// item (dbias_in_item_order), else the items of the same k block and lower
// batch·heads_kv + kv head, have added theirs.
void AddDbiasTile(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t b, std::int64_t kv_head,
                  std::int64_t kb, std::int64_t j0, std::int64_t n) {
  const MutableTensorView& db = prm.dbias;
  const DbiasTileShape t(prm.plan, prm.problem, db);
  const std::int64_t bkv = b * prm.problem.heads_kv + kv_head;
  std::atomic<std::int64_t>& ticket = prm.dbias_tickets[prm.dbias_in_item_order ? 0 : kb];
  const std::int64_t turn = prm.dbias_in_item_order ? bkv * prm.plan.k_blocks + kb : bkv;
  WaitForTicket(ticket, turn);
  for (std::int64_t plane = 0; plane < t.planes; ++plane) {
    float* out = static_cast<float*>(db.data) + DbiasOffset(db, b, kv_head * t.planes + plane, j0);
    for (std::int64_t r = 0; r < t.rows; ++r)
      AddDbiasRow(ws.dbias_tile.get() + (plane * t.rows + r) * t.cols, t.cols > 1 ? n : 1, out + r * db.strides[2],
                  t.cols > 1 ? db.strides[3] : 0);
  }
  ticket.store(turn + 1, std::memory_order_release);
}

// For the Q tile against K/V tile `j0` (n keys, n_pad columns), from S' in p_tile and dP in
// ds_tile: P·w into p_tile (w the dropout weights, 1 without dropout) and dS into ds_tile,
// with the variants of `mods` applied exactly as in the forward. Hidden scores become −∞,
// so P = 0 there. With `dbias`, each row's dS before the chain rule through softcap (the
// gradient of the score after the mask step; dbias excludes a score_hook) is added there.
// p_tile holds S' over `score_scale` (> 0; 1 where the products scaled it; other factors only
// where the mask step only hides scores): P = 2^(score_scale·S − lse2), one rounding, or for
// BackwardDelta's large rows (lse2_low ≠ 0) P = 2^((score_scale·S − lse2) − lse2_low). Each
// row is computed over its strip's span of `keys` (FindStripKeys, a strip of kMicroRows rows)
// and zero outside it, whatever the products left there.
void ComputePAndDS(BackwardWorkspace& ws, const RowMods& mods, const DbiasRows& dbias, std::int64_t bc,
                   std::int64_t i0, std::int64_t rows, std::int64_t rows_pad, std::int64_t j0, std::int64_t n,
                   std::int64_t n_pad, float score_scale, const StripKeys* keys) {
  const bool grad = mods.needs_grad(), dropout = mods.dropout_threshold != 0;
  const DF df;
  for (std::int64_t r = 0; r < rows_pad; ++r) {
    float* prow = ws.p_tile.get() + r * bc;
    float* dsrow = ws.ds_tile.get() + r * bc;
    float* grow = ws.g_tile.get() + r * bc;
    float* wrow = ws.w_tile.get() + r * bc;
    const StripKeys span = keys[r / kMicroRows];
    if (r >= rows || ws.row_lse2[r] == -std::numeric_limits<float>::infinity() || span.begin == span.end) {
      std::fill(prow, prow + n_pad, 0.0f);  // padding, a row that sees no key at all or none of these
      std::fill(dsrow, dsrow + n_pad, 0.0f);
      continue;
    }
    // Outside its strip's span the row hides every key: P and dS are zero there.
    const std::int64_t lo = span.begin, hi = span.end, real = std::min(n, hi) - lo;
    if (lo > 0 || hi < n_pad)
      for (float* row : {prow, dsrow}) {
        std::fill(row, row + lo, 0.0f);
        std::fill(row + hi, row + n_pad, 0.0f);
      }
    const std::int64_t i = i0 + r;
    mods.apply(prow + lo, grad ? grow + lo : nullptr, i, j0 + lo, real, hi - lo);
    if (dropout) {
      std::fill(wrow + lo, wrow + hi, 1.0f);
      mods.apply_dropout(wrow + lo, i, j0 + lo, hi - lo);
    }
    float row_lse2 = ws.row_lse2[r], row_scale = score_scale;
    if (ws.row_lse2_low[r] != 0.0f) {  // a large row's two-part offset, taken in a pass of its own
      const VF high = hn::Set(df, row_lse2), low = hn::Set(df, ws.row_lse2_low[r]), vc = hn::Set(df, score_scale);
      for (std::int64_t j = lo; j < hi; j += kLanes)
        hn::Store(hn::Sub(hn::MulSub(hn::Load(df, prow + j), vc, high), low), df, prow + j);
      row_lse2 = 0.0f;  // the loop below then takes the row as it is: x·1 − 0 = x
      row_scale = 1.0f;
    }
    const VF lse2 = hn::Set(df, row_lse2), vc = hn::Set(df, row_scale);
    const VF delta = hn::Set(df, ws.row_delta[r]);
    for (std::int64_t j = lo; j < hi; j += kLanes) {
      const VF pj = Exp2(df, hn::MulSub(hn::Load(df, prow + j), vc, lse2));
      VF dp = hn::Load(df, dsrow + j);
      VF pw = pj;
      if (dropout) {  // dP of the undropped P is w·dP of the dropped one
        const VF w = hn::Load(df, wrow + j);
        pw = hn::Mul(pj, w);
        dp = hn::Mul(dp, w);
      }
      VF ds = hn::Mul(pj, hn::Sub(dp, delta));
      if (grad) {  // through the tanh and score_mod; dbias's dS, from before it, takes g's place
        const VF g = hn::Load(df, grow + j);
        if (dbias.base != nullptr) hn::Store(ds, df, grow + j);
        ds = hn::Mul(ds, g);
      }
      hn::Store(pw, df, prow + j);
      hn::Store(ds, df, dsrow + j);
    }
    if (dbias.base != nullptr)
      AddDbiasRow((grad ? grow : dsrow) + lo, real, dbias.base + i * dbias.row_stride + lo * dbias.col_stride,
                  dbias.col_stride);
  }
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// The backward's five products on the bf16 micro-kernel (bf16_dot.hpp: AMX tiles or
// VDPBF16PS), for bf16 inputs: Q, dO, K and V are multiplied as stored; S' =
// scale·log2e·Q·Kᵀ is scaled in float32 as stored; P and dS are rounded to bf16 (nearest
// even) before they multiply — dV = Pᵀ·dO, dK = scale·dSᵀ·Q, dQ = scale·dS·K — as upstream
// rounds them. Every operand has its pairs along the product's depth: head dims for S and
// dP, keys for dQ, query rows for dV and dK, which are computed transposed (dVᵀ = dOᵀ·P,
// dKᵀ = Qᵀ·dS) so that their A operands, Qᵀ and dOᵀ, are row-major as tiles need them and
// P and dS, paired two rows at a time, are their B panels.
struct Bf16BackwardProducts {
  static_assert(kMicroRows == bf16dot::kRows && kMicroCols == bf16dot::kCols, "one micro-tile for both kernels");
  static constexpr std::int64_t kStep = bf16dot::kPairStep;

  // A Q tile's rows, padded: whole AMX chunks of 16 row pairs, the depth of dVᵀ and dKᵀ.
  static constexpr std::int64_t kRowMultiple = 32;
  static_assert(kMaxRowMultiple % kRowMultiple == 0, "the workspace's row strips (StripsFor) cover a padded tile");
  // The scores ScoresAndDp computes: the whole tile.
  static std::int64_t ScoresComputed(const StripKeys* /*keys*/, std::int64_t rows_pad, std::int64_t n_pad) {
    return rows_pad * n_pad;
  }
  static std::int64_t Even(std::int64_t n) { return (n + 1) / 2 * 2; }

  // dKᵀ and dVᵀ of a K/V tile accumulate as rows of head-dim columns: (D_pad, block_k),
  // (Dv_pad, block_k).
  static void ZeroDkDv(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t) {
    const std::int64_t bc = prm.plan.block_k;
    std::fill(ws.dk_acc.get(), ws.dk_acc.get() + prm.plan.head_dim_padded * bc, 0.0f);
    std::fill(ws.dv_acc.get(), ws.dv_acc.get() + prm.plan.head_dim_v_padded * bc, 0.0f);
  }

  // dK = scale·dSᵀ·Q (Q unscaled) and dV: dKᵀ and dVᵀ transposed 16 × 16 words at a time
  // into key rows (ws.kv_rows), each stored from there.
  static void StoreDkDv(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t b, std::int64_t kv_head,
                        std::int64_t j0, std::int64_t n) {
    const AttentionProblem& p = prm.problem;
    const std::int64_t bc = prm.plan.block_k;
    float* rows = ws.kv_rows.get();  // (block_k, width_pad)
    for (const auto& [acc, width, width_pad, scale, out] :
         {std::tuple{ws.dk_acc.get(), p.head_dim, prm.plan.head_dim_padded, p.softmax_scale, &prm.dk},
          std::tuple{ws.dv_acc.get(), p.head_dim_v, prm.plan.head_dim_v_padded, 1.0f, &prm.dv}}) {
      bf16dot::TransposeWords(reinterpret_cast<const std::uint32_t*>(acc), bc, reinterpret_cast<std::uint32_t*>(rows),
                              width_pad, width_pad, bc);
      for (std::int64_t r = 0; r < n; ++r)
        StoreRow(rows + r * width_pad, width, scale, OutRowPointer(*out, b, j0 + r, kv_head), out->dtype);
    }
  }

  // Per K/V tile of one (batch, kv head), keys [from, to), whole tiles, reusing what is
  // packed: kt_pairs and vt_pairs as panels of kMicroCols keys, step p holding each key's
  // elements 2p and 2p + 1 (S's and dP's B); k_pairs as panels of kMicroCols columns of K,
  // step p holding each column's values of keys 2p and 2p + 1 (dQ's B). The last tile's
  // padding keys are zeros, odd head dims end with a zero. Each key's rows are copied into
  // pack_rows (zero past the head dims): a panel's K and V rows transposed as 32-bit pairs at
  // its last key (TransposeKeys), a pair's K rows — neighbours in the panel, which starts at
  // an even key — interleaved at its second (InterleavePairs), as the forward packs.
  static void Pack(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t b, std::int64_t kv_head,
                   std::int64_t from, std::int64_t to) {
    const AttentionProblem& p = prm.problem;
    const std::int64_t bc = prm.plan.block_k, d = p.head_dim, dv = p.head_dim_v;
    const std::int64_t d_pad = prm.plan.head_dim_padded, dv_pad = prm.plan.head_dim_v_padded;
    const std::int64_t d_even = Even(d), dv_even = Even(dv);
    std::uint16_t* k_rows = ws.pack_rows.get();                // (kMicroCols, d_pad)
    std::uint16_t* v_rows = k_rows + kMicroCols * d_pad;       // (kMicroCols, dv_pad)
    for (std::int64_t e = 0; e < kMicroCols; ++e) {
      std::fill(k_rows + e * d_pad + d, k_rows + (e + 1) * d_pad, std::uint16_t{0});
      std::fill(v_rows + e * dv_pad + dv, v_rows + (e + 1) * dv_pad, std::uint16_t{0});
    }
    const hn::ScalableTag<std::uint32_t> du32;
    const auto as_pairs = [](std::uint16_t* x) { return reinterpret_cast<std::uint32_t*>(x); };
    PackHead(prm, ws, b, kv_head, from, to, [&](std::int64_t j, const void* k_row, const void* v_row) {
      const std::int64_t tile = j / bc, col = j % bc, e = j % kMicroCols;
      const auto copy = [](const void* src, std::int64_t n, std::uint16_t* dst) {
        if (src != nullptr)
          std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(std::uint16_t));
        else
          std::fill(dst, dst + n, std::uint16_t{0});
      };
      copy(k_row, d, k_rows + e * d_pad);
      copy(v_row, dv, v_rows + e * dv_pad);
      if (e == kMicroCols - 1) {
        const std::int64_t panel = col / kMicroCols * kMicroCols;  // the panel's first key in the tile
        TransposeKeys(du32, as_pairs(k_rows), d_pad / 2, d_even / 2,
                      as_pairs(ws.kt_pairs.get() + tile * bc * d_even + panel * d_even), kMicroCols);
        TransposeKeys(du32, as_pairs(v_rows), dv_pad / 2, dv_even / 2,
                      as_pairs(ws.vt_pairs.get() + tile * bc * dv_even + panel * dv_even), kMicroCols);
      }
      if (j % 2 == 1)
        InterleavePairs(k_rows + (e - 1) * d_pad, k_rows + e * d_pad, d_pad,
                        ws.k_pairs.get() + tile * bc * d_pad + col / 2 * kStep, bc * kMicroCols);
    });
  }

  // Q and dO rows of [i0, i0 + rows) as stored, zero-padded to D_pad, Dv_pad and to rows_pad
  // rows (S's and dP's A operands), and Qᵀ, dOᵀ: each column's values of the tile's rows, in
  // order (dKᵀ's and dVᵀ's A operands) — the rows paired, then the pairs transposed.
  // They are at ws.q_pairs (Q, then Qᵀ at block_q · D_pad) and ws.do_pairs (dO, then dOᵀ): in
  // the thread's copy of its kv head's tiles (BackwardWorkspace::q_kept16), built there at
  // the tile's first use, or, without the copy, built into q_bf16 and do_bf16.
  static void LoadQ(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t b, std::int64_t h,
                    std::int64_t i0, std::int64_t rows, std::int64_t rows_pad) {
    const std::int64_t bq = prm.plan.block_q, d_pad = prm.plan.head_dim_padded, dv_pad = prm.plan.head_dim_v_padded;
    const KeptTile kept = KeepTile(prm, ws, b, h, i0);
    std::uint16_t* q = ws.q_bf16.get();
    std::uint16_t* dout = ws.do_bf16.get();
    if (kept.index >= 0) {
      q = ws.q_kept16.get() + kept.index * bq * 2 * d_pad;
      dout = ws.do_kept16.get() + kept.index * bq * 2 * dv_pad;
    }
    ws.q_pairs = q;
    ws.do_pairs = dout;
    if (!kept.converted) PairQ(prm, ws, b, h, i0, rows, rows_pad, q, dout);
  }

  // LoadQ's tiles of rows [i0, i0 + rows) of (b, h) built into q and dout: each the rows,
  // (block_q, width_pad), then the transposed, from block_q · width_pad on.
  static void PairQ(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t b, std::int64_t h, std::int64_t i0,
                    std::int64_t rows, std::int64_t rows_pad, std::uint16_t* q, std::uint16_t* dout) {
    const AttentionProblem& p = prm.problem;
    const std::int64_t bq = prm.plan.block_q, d_pad = prm.plan.head_dim_padded, dv_pad = prm.plan.head_dim_v_padded;
    auto* paired = reinterpret_cast<std::uint32_t*>(ws.pair_scratch.get());  // (rows_pad / 2, width_pad) words
    for (const auto& [src, dst, transposed, width, width_pad] :
         {std::tuple{&prm.q, q, q + bq * d_pad, p.head_dim, d_pad},
          std::tuple{&prm.dout, dout, dout + bq * dv_pad, p.head_dim_v, dv_pad}}) {
      for (std::int64_t r = 0; r < rows_pad; ++r) {
        std::uint16_t* row = dst + r * width_pad;
        if (r < rows)
          std::memcpy(row, RowPointer(*src, b, i0 + r, h), static_cast<std::size_t>(width) * sizeof(std::uint16_t));
        std::fill(row + (r < rows ? width : 0), row + width_pad, std::uint16_t{0});
      }
      for (std::int64_t r = 0; r < rows_pad; r += 2)
        bf16dot::PairRowsBf16(dst + r * width_pad, dst + (r + 1) * width_pad,
                              reinterpret_cast<std::uint16_t*>(paired + r / 2 * width_pad), width_pad);
      bf16dot::TransposeWords(paired, width_pad, reinterpret_cast<std::uint32_t*>(transposed), rows_pad / 2,
                              rows_pad / 2, width_pad);
    }
  }

  // S times `scale` (softmax_scale·log2e, or 1 where ComputePAndDS takes the factor: see
  // KvItem) and dP. On AMX tiles a factor other than 1 is a pass over the stored scores.
  static constexpr bool kMayLeaveScoresUnscaled = true;
  static void ScoresAndDp(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t tile,
                          std::int64_t rows_pad, std::int64_t n_pad, float scale, const StripKeys* /*keys*/) {
    const AttentionProblem& p = prm.problem;
    const std::int64_t bc = prm.plan.block_k, d_pad = prm.plan.head_dim_padded, dv_pad = prm.plan.head_dim_v_padded;
    const std::int64_t d_even = Even(p.head_dim), dv_even = Even(p.head_dim_v);
    const std::uint16_t* kt = ws.kt_pairs.get() + tile * bc * d_even;
    const std::uint16_t* vt = ws.vt_pairs.get() + tile * bc * dv_even;
    bf16dot::DotBlock(ws.q_pairs, d_pad, kt, kMicroCols * d_even, kStep, d_even / 2, scale, false,
                      ws.p_tile.get(), bc, rows_pad, n_pad);
    bf16dot::DotBlock(ws.do_pairs, dv_pad, vt, kMicroCols * dv_even, kStep, dv_even / 2, 1.0f, false,
                      ws.ds_tile.get(), bc, rows_pad, n_pad);
  }

  static void Gradients(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t j0, std::int64_t rows_pad,
                        std::int64_t /*n*/, std::int64_t n_pad, const StripKeys* /*keys*/) {
    const std::int64_t bq = prm.plan.block_q, bc = prm.plan.block_k;
    const std::int64_t d_pad = prm.plan.head_dim_padded, dv_pad = prm.plan.head_dim_v_padded;
    // P and dS paired two rows at a time — word (row pair p, key j) at 2·(p·bc + j): the B
    // operands of dVᵀ and dKᵀ, kCols keys per panel, steps 2·bc apart; dS rows rounded as
    // they are for dQ.
    for (std::int64_t r = 0; r < rows_pad; r += 2) {
      bf16dot::PairRows(ws.p_tile.get() + r * bc, ws.p_tile.get() + (r + 1) * bc, ws.pt_bf16.get() + r * bc, n_pad);
      bf16dot::PairRows(ws.ds_tile.get() + r * bc, ws.ds_tile.get() + (r + 1) * bc, ws.dst_bf16.get() + r * bc, n_pad);
    }
    for (std::int64_t r = 0; r < rows_pad; ++r)
      bf16dot::RoundToBf16(ws.ds_tile.get() + r * bc, ws.ds_bf16.get() + r * bc, n_pad);
    // dVᵀ += dOᵀ·P, dKᵀ += Qᵀ·dS: rows are head-dim columns, the depth is the Q tile's rows.
    bf16dot::DotBlock(ws.do_pairs + bq * dv_pad, rows_pad, ws.pt_bf16.get(), 2 * kMicroCols, 2 * bc, rows_pad / 2, 1.0f, true,
                      ws.dv_acc.get(), bc, dv_pad, n_pad);
    bf16dot::DotBlock(ws.q_pairs + bq * d_pad, rows_pad, ws.dst_bf16.get(), 2 * kMicroCols, 2 * bc, rows_pad / 2, 1.0f, true,
                      ws.dk_acc.get(), bc, d_pad, n_pad);
    // dQ share = dS·K: the depth is the tile's keys.
    bf16dot::DotBlock(ws.ds_bf16.get(), bc, ws.k_pairs.get() + j0 / bc * bc * d_pad, kMicroCols * bc, kStep, n_pad / 2,
                      1.0f, false, ws.dq_tile.get(), d_pad, rows_pad, d_pad);
  }
};
#endif

void AddTile(const float* HWY_RESTRICT src, float* HWY_RESTRICT dst, std::int64_t n) {
  const DF df;
  for (std::int64_t e = 0; e < n; e += kLanes)
    hn::Store(hn::Add(hn::Load(df, dst + e), hn::Load(df, src + e)), df, dst + e);
}

// Item = (b, kv head, k block). Owns dK and dV of its K/V tile, so they need no
// synchronization; streams the Q tiles of every q head sharing the kv head and adds its
// dQ shares — under a striped lock in any order, or in K/V-block order (deterministic).
// Products (Fp32BackwardProducts, Bf16BackwardProducts) computes the five matrix products.
template <class Products>
void KvItem(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t item) {
  const AttentionProblem& p = prm.problem;
  const CpuBackwardPlan& plan = prm.plan;
  const std::int64_t bq = plan.block_q, bc = plan.block_k;
  const std::int64_t d_pad = plan.head_dim_padded;
  const std::int64_t kb = item % plan.k_blocks, bkv = item / plan.k_blocks;
  const std::int64_t kv_head = bkv % p.heads_kv, b = bkv / p.heads_kv;
  const std::int64_t group = p.heads_q / p.heads_kv;
  const std::int64_t j0 = kb * bc, n = std::min(bc, p.seqlen_k - j0);
  const std::int64_t n_pad = RoundUp(n, kMicroCols);  // the scores' columns
  Products::Pack(prm, ws, b, kv_head, j0, j0 + n);
  ws.counters.k_read += n * p.head_dim;
  ws.counters.v_read += n * p.head_dim_v;

  Products::ZeroDkDv(prm, ws, n);
  if (prm.dbias_shared) {
    const DbiasTileShape t(plan, p, prm.dbias);
    std::fill(ws.dbias_tile.get(), ws.dbias_tile.get() + t.size(), 0.0f);
  }
  for (std::int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
    const RowMods mods(p, prm.internals, prm.alibi_slopes, prm.block_mask, prm.attn_mask, prm.attn_mask_blocks,
                       prm.score_hook, b, h);
    // softmax_scale·log2e: applied by the products, or, where they may leave S' unscaled and
    // the mask step only hides scores, in P's exponent (as the forward's TiledItem).
    const float scale = p.softmax_scale * OnlineSoftmaxState::kLog2e;
    const bool exponent_scales = Products::kMayLeaveScoresUnscaled && mods.only_hides() && scale > 0.0f;
    const DbiasRows dbias = DbiasTarget(prm, ws, b, h, kv_head, j0);
    for (std::int64_t qb = 0; qb < plan.q_blocks; ++qb) {
      const std::int64_t i0 = qb * bq, rows = std::min(bq, p.seqlen_q - i0);
      if (!mods.tile_has_work(i0, rows, j0, n)) continue;  // causal, window, block mask
      const std::int64_t rows_pad = RoundUp(rows, Products::kRowMultiple);
      ws.counters.tiles_computed += 1;
      ws.counters.scores += rows * n;
      ws.counters.q_read += rows * p.head_dim;
      ws.counters.dout_read += rows * p.head_dim_v;
      ws.counters.stats_read += 2 * rows;  // lse and D
      ws.counters.dq_accum_read += rows * p.head_dim;
      ws.counters.dq_accum_written += rows * p.head_dim;
      LoadRowStats(prm, ws, b, h, i0, rows, rows_pad);
      Products::LoadQ(prm, ws, b, h, i0, rows, rows_pad);
      StripKeys* keys = ws.strip_keys.data();  // each row strip's keys of the tile
      FindStripKeys(p, mods, i0, (rows_pad + kMicroRows - 1) / kMicroRows, rows, rows, j0, n, keys);
      ws.counters.scores_computed += Products::ScoresComputed(keys, rows_pad, n_pad);
      Products::ScoresAndDp(prm, ws, kb, rows_pad, n_pad, exponent_scales ? 1.0f : scale, keys);
      ComputePAndDS(ws, mods, dbias, bc, i0, rows, rows_pad, j0, n, n_pad, exponent_scales ? scale : 1.0f, keys);
      // dV, dK and this K/V tile's dQ share, added to the shared float32 accumulator.
      Products::Gradients(prm, ws, j0, rows_pad, n, n_pad, keys);
      const float* dq_tile = ws.dq_tile.get();
      const std::int64_t tile_id = (b * p.heads_q + h) * plan.q_blocks + qb;
      float* dst = prm.dq_accum + ((b * p.heads_q + h) * p.seqlen_q + i0) * d_pad;
      if (prm.dq_tickets != nullptr) {
        WaitForTicket(prm.dq_tickets[tile_id], kb);
        AddTile(dq_tile, dst, rows * d_pad);
        prm.dq_tickets[tile_id].store(kb + 1, std::memory_order_release);
      } else {
        std::lock_guard<std::mutex> lock(prm.dq_locks[tile_id % kDqLockStripes]);
        AddTile(dq_tile, dst, rows * d_pad);
      }
    }
  }
  if (prm.dq_tickets != nullptr) {
    // Pass on the tickets of the Q tiles this K/V tile had no work for, in the same order.
    for (std::int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h)
      for (std::int64_t qb = 0; qb < plan.q_blocks; ++qb) {
        std::atomic<std::int64_t>& ticket = prm.dq_tickets[(b * p.heads_q + h) * plan.q_blocks + qb];
        if (ticket.load(std::memory_order_acquire) > kb) continue;
        WaitForTicket(ticket, kb);
        ticket.store(kb + 1, std::memory_order_release);
      }
  }
  if (prm.dbias_shared) AddDbiasTile(prm, ws, b, kv_head, kb, j0, n);
  Products::StoreDkDv(prm, ws, b, kv_head, j0, n);
  ws.counters.dk_written += n * p.head_dim;
  ws.counters.dv_written += n * p.head_dim_v;
}

void BackwardKvItem(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t item) {
  KvItem<Fp32BackwardProducts>(prm, ws, item);
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
void Bf16KvItem(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t item) {
  const bf16dot::TileScope tiles;  // the thread's AMX state handed back when the item ends
  KvItem<Bf16BackwardProducts>(prm, ws, item);
}
#endif

// The tiled_bf16 item where this target has one (AVX-512, whose micro-tile the bf16
// micro-kernel shares), else null.
BackwardKvItemFn TiledBf16KvItem() {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  return &Bf16KvItem;
#else
  return nullptr;
#endif
}

void BackwardStoreDq(const BackwardParams& prm, BackwardWorkspace& ws, std::int64_t bh) {
  const AttentionProblem& p = prm.problem;
  const std::int64_t b = bh / p.heads_q, h = bh % p.heads_q, d_pad = prm.plan.head_dim_padded;
  for (std::int64_t i = 0; i < p.seqlen_q; ++i)
    StoreRow(prm.dq_accum + (bh * p.seqlen_q + i) * d_pad, p.head_dim, p.softmax_scale,
             OutRowPointer(prm.dq, b, i, h), prm.dq.dtype);
  ws.counters.dq_accum_read += p.seqlen_q * p.head_dim;
  ws.counters.dq_written += p.seqlen_q * p.head_dim;
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace flashattn::cpu {

HWY_EXPORT(BackwardDelta);
HWY_EXPORT(BackwardLargeRows);
HWY_EXPORT(BackwardKvItem);
HWY_EXPORT(BackwardStoreDq);

HWY_EXPORT(TiledBf16KvItem);

BackwardKernels backward_kernels(BackwardKernel kernel) {
  kernel_geometry();  // the first dispatched call picks the target
  BackwardKvItemFn kv_item = &HWY_DYNAMIC_DISPATCH(BackwardKvItem);
  if (kernel == BackwardKernel::tiled_bf16) {
    // The plan checked this; the check here keeps a hand-made plan from an illegal instruction.
    kv_item = bf16dot::available() ? HWY_DYNAMIC_DISPATCH(TiledBf16KvItem)() : nullptr;
    if (kv_item == nullptr)
      throw Error("backward_kernel tiled_bf16: this CPU (AVX512-BF16) or SIMD target (" +
                  std::string(kernel_geometry().target) + ") cannot run it");
  }
  return {&HWY_DYNAMIC_DISPATCH(BackwardDelta), &HWY_DYNAMIC_DISPATCH(BackwardLargeRows), kv_item,
          &HWY_DYNAMIC_DISPATCH(BackwardStoreDq)};
}

}  // namespace flashattn::cpu
#endif  // HWY_ONCE
