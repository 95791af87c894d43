// The forward kernels' row steps, shared by the tiled and the decode forward (one Highway
// compilation unit each), compiled per target: the mask, the online-softmax update of a
// score row, the output row's store, and the per-item bookkeeping. Include inside the
// per-target section.
#if defined(FLASHATTN_CPU_FORWARD_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHATTN_CPU_FORWARD_ROWS_INL_H_
#undef FLASHATTN_CPU_FORWARD_ROWS_INL_H_
#else
#define FLASHATTN_CPU_FORWARD_ROWS_INL_H_
#endif

#include <hwy/highway.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>

#include "flashattn/online_softmax.hpp"
#include "src/cpu/kernels/forward_kernel.hpp"
#include "src/cpu/kernels/fp8-inl.h"
#include "src/cpu/kernels/score_mods-inl.h"
#include "src/cpu/kernels/simd_math-inl.h"
#include "src/cpu/kernels/tile_ops-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The mask step: the variants (softcap, ALiBi) of one score row of query i, keys j0.. (n of
// them, cols with padding), and −∞ at every key the row may not see (score_mods-inl.h);
// score_scale ≠ 1: the row is unscaled and its bias step scales it (RowMods::only_adds_bias).
HWY_INLINE void MaskRow(const RowMods& mods, float* HWY_RESTRICT srow, std::int64_t i, std::int64_t j0, std::int64_t n,
                        std::int64_t cols, float score_scale = 1.0f) {
  mods.apply(srow, nullptr, i, j0, n, cols, score_scale);
}

// P = 2^(c·S − m) of columns [from, to) with one of the exp2 implementations, one rounding
// for c·S − m (with c = 1 exactly S − m); returns Σ P.
// Two vectors a step, summed in order (the sum's rounding is the one-vector loop's).
template <class Exp2Fn>
HWY_INLINE VF ExpRange(Exp2Fn exp2, float* HWY_RESTRICT srow, std::int64_t from, std::int64_t to, VF vc, VF vm,
                       VF vsum) {
  const DF df;
  std::int64_t j = from;
  for (; j + 2 * kLanes <= to; j += 2 * kLanes) {
    const VF p0 = exp2(df, hn::MulSub(hn::Load(df, srow + j), vc, vm));
    const VF p1 = exp2(df, hn::MulSub(hn::Load(df, srow + j + kLanes), vc, vm));
    hn::Store(p0, df, srow + j);
    hn::Store(p1, df, srow + j + kLanes);
    vsum = hn::Add(hn::Add(vsum, p0), p1);
  }
  for (; j < to; j += kLanes) {
    const VF pj = exp2(df, hn::MulSub(hn::Load(df, srow + j), vc, vm));
    hn::Store(pj, df, srow + j);
    vsum = hn::Add(vsum, pj);
  }
  return vsum;
}

// Columns [0, result) of a row of `cols` go through the cubic exp2, the rest through the
// exact one; mixed rounds its share to whole vectors.
HWY_INLINE std::int64_t Poly3Columns(const AttentionProblem& p, std::int64_t cols) {
  if (p.exp2 == Exp2Impl::poly3) return cols;
  if (p.exp2 != Exp2Impl::mixed) return 0;
  const float vectors = p.exp2_poly3_fraction * static_cast<float>(cols / kLanes);
  return static_cast<std::int64_t>(std::lround(vectors)) * kLanes;
}

// The online-softmax update of one score row of query i, in place, after its variants and
// mask (MaskRow): S(cols) of keys j0.. → P (dropout applied after the row sum, which must
// not see it). The row holds the scores over `score_scale` (> 0; 1 where the products
// scaled them): the maximum and the exponent take the factor, so a kernel whose products
// store unscaled scores (tiled_bf16 on AMX tiles) needs no pass to scale them — valid
// where the mask step only hides scores (RowMods::only_hides).
// õ (orow, ldo floats) is rescaled when the reference maximum moves by more than
// `rescale_threshold` (the problem's, or 0 where P must stay ≤ 1); `rescales` counts those moves.
// `deferred` false (a measurement switch): the output is kept normalized at every tile, as
// FlashAttention-1 did — orow holds õ/ℓ, rescaled by ℓ_old·factor/ℓ_new, and P is divided by
// ℓ_new — instead of dividing õ by ℓ once at the end.
static void SoftmaxRow(const RowMods& mods, float* HWY_RESTRICT srow, std::int64_t i, std::int64_t j0,
                std::int64_t cols, OnlineSoftmaxState& state, float* HWY_RESTRICT orow,
                std::int64_t ldo, std::int32_t& rescales, bool deferred, float rescale_threshold,
                float score_scale = 1.0f) {
  const DF df;
  const AttentionProblem& p = *mods.problem;
  // Four maxima in turn: one chain would wait on each Max's latency (a row of 256 scores is
  // 16 vectors).
  VF vmax = hn::Set(df, kNegInf), m1 = vmax, m2 = vmax, m3 = vmax;
  std::int64_t j = 0;
  for (; j + 4 * kLanes <= cols; j += 4 * kLanes) {
    vmax = hn::Max(vmax, hn::Load(df, srow + j));
    m1 = hn::Max(m1, hn::Load(df, srow + j + kLanes));
    m2 = hn::Max(m2, hn::Load(df, srow + j + 2 * kLanes));
    m3 = hn::Max(m3, hn::Load(df, srow + j + 3 * kLanes));
  }
  for (; j < cols; j += kLanes) vmax = hn::Max(vmax, hn::Load(df, srow + j));
  vmax = hn::Max(hn::Max(vmax, m1), hn::Max(m2, m3));
  float tile_max = hn::GetLane(hn::MaxOfLanes(df, vmax)) * score_scale;
  // Max may drop a NaN (x86 returns its second operand when either is NaN): a row whose
  // visible scores are all NaN could read as a row without visible keys. It must be NaN.
  if (tile_max == kNegInf && std::any_of(srow, srow + cols, [](float s) { return std::isnan(s); }))
    tile_max = std::numeric_limits<float>::quiet_NaN();
  const float old_max = state.max;
  const float factor = state.rescale_to(tile_max, rescale_threshold);
  if (state.max != old_max && old_max != kNegInf) ++rescales;
  // A row's first visible tile (old_max −∞) finds õ zero — or NaN from a V that P = 0
  // multiplied — which the factor 0 would leave as it is.
  if (deferred && factor != 1.0f && old_max != kNegInf) {
    const VF vf = hn::Set(df, factor);
    for (std::int64_t c = 0; c < ldo; c += kLanes) hn::Store(hn::Mul(hn::Load(df, orow + c), vf), df, orow + c);
  }
  if (state.max == kNegInf) {  // nothing visible yet: P = 0, never 2^(−∞ + ∞)
    std::fill(srow, srow + cols, 0.0f);
    return;
  }
  const std::int64_t poly_cols = Poly3Columns(p, cols);
  const VF vm = hn::Set(df, state.max), vc = hn::Set(df, score_scale);
  VF vsum = ExpRange([](DF d, VF x) { return Exp2Poly3(d, x); }, srow, 0, poly_cols, vc, vm, hn::Zero(df));
  vsum = ExpRange([](DF d, VF x) { return Exp2(d, x); }, srow, poly_cols, cols, vc, vm, vsum);
  const float scaled_sum = state.sum;  // ℓ_old · factor
  state.add(hn::GetLane(hn::SumOfLanes(df, vsum)));
  if (mods.fp8_probabilities)
    for (std::int64_t j = 0; j < cols; j += kLanes)
      hn::Store(RoundToFp8(df, hn::Load(df, srow + j), Fp8Format::e4m3), df, srow + j);
  if (!deferred) {
    const VF vo = hn::Set(df, scaled_sum * state.inverse_sum()), vp = hn::Set(df, state.inverse_sum());
    for (std::int64_t c = 0; c < ldo; c += kLanes) hn::Store(hn::Mul(hn::Load(df, orow + c), vo), df, orow + c);
    for (std::int64_t j = 0; j < cols; j += kLanes) hn::Store(hn::Mul(hn::Load(df, srow + j), vp), df, srow + j);
  }
  if (mods.dropout_threshold != 0) mods.apply_dropout(srow, i, j0, cols);
}

// Row (b, i, h) of out.
HWY_INLINE void* OutputRow(const ForwardParams& prm, std::int64_t b, std::int64_t i, std::int64_t h) {
  return static_cast<unsigned char*>(prm.out.data) +
         detail::offset4(prm.out, b, i, h, 0) * static_cast<std::int64_t>(dtype_size(prm.out.dtype));
}

// The output row of query i of (b, h), or its split's partial, from õ and the state; its
// rescale count is added to the row's total when counted (splits of one row may run
// concurrently), and to the thread's counters.
static void StoreOutputRow(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t split, std::int64_t b, std::int64_t h,
                    std::int64_t i, const float* orow, const OnlineSoftmaxState& state, std::int32_t rescales) {
  const AttentionProblem& p = prm.problem;
  ws.counters.rescales += rescales;
  if (prm.rescale_counts.data != nullptr) {
    const MutableTensorView& c = prm.rescale_counts;
    std::atomic_ref<std::int32_t>(static_cast<std::int32_t*>(c.data)[b * c.strides[0] + h * c.strides[1] + i * c.strides[2]])
        .fetch_add(rescales, std::memory_order_relaxed);
  }
  // Kept normalized at every tile (the deferred_normalization switch off): nothing left to divide.
  float inverse = prm.switches.deferred_normalization || state.sum == 0.0f ? state.inverse_sum() : 1.0f;
  OnlineSoftmaxState final_state = state;
  if (p.sinks && split == 0) {
    // The sink joins split 0's keys as one more score with no value (docs/algorithm.md
    // "Attention sinks"): exactly once per row, and the split merge carries it on.
    const float sink = static_cast<const float*>(prm.sinks.data)[h * prm.sinks.strides[0]];
    const float kept = prm.switches.deferred_normalization ? 1.0f : state.sum;
    const OnlineSoftmaxState::MergeFactors f = final_state.merge({sink * OnlineSoftmaxState::kLog2e, 1.0f});
    inverse = f.self * kept * final_state.inverse_sum();
  }
  if (prm.plan.splits > 1) {
    StoreRow(orow, p.head_dim_v, inverse,
             prm.split_out + (((split * p.batch + b) * p.seqlen_q + i) * p.heads_q + h) * p.head_dim_v, DType::f32);
    const std::int64_t row = ((split * p.batch + b) * p.heads_q + h) * p.seqlen_q + i;
    prm.split_max[row] = final_state.max;
    prm.split_sum[row] = final_state.sum;
    return;
  }
  StoreRow(orow, p.head_dim_v, inverse, OutputRow(prm, b, i, h), prm.out.dtype);
  const std::int64_t lse_at = b * prm.lse.strides[0] + h * prm.lse.strides[1] + i * prm.lse.strides[2];
  static_cast<float*>(prm.lse.data)[lse_at] = prm.lse_sums != nullptr ? final_state.max : final_state.lse();
  if (prm.lse_sums != nullptr) prm.lse_sums[lse_at] = final_state.sum;
}

// A work item's rows start over: softmax state empty, no rescales.
HWY_INLINE void ResetStates(ForwardWorkspace& ws, std::int64_t rows) {
  std::fill(ws.states.data(), ws.states.data() + rows, OnlineSoftmaxState{});
  std::fill(ws.rescales.data(), ws.rescales.data() + rows, 0);
}

// ResetStates and õ zero; `rows` rows of ldo floats.
HWY_INLINE void ResetRows(ForwardWorkspace& ws, std::int64_t rows, std::int64_t ldo) {
  std::fill(ws.o_acc.get(), ws.o_acc.get() + rows * ldo, 0.0f);
  ResetStates(ws, rows);
}

// The counts of `tiles` computed tiles of `rows` query rows against n keys (counters.hpp):
// the cost model counts the same.
HWY_INLINE void CountTiles(KernelCounters& c, std::int64_t tiles, std::int64_t rows, std::int64_t n, std::int64_t d,
                           std::int64_t dv) {
  c.tiles_computed += tiles;
  c.scores += tiles * rows * n;
  c.k_read += tiles * n * d;
  c.v_read += tiles * n * dv;
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
