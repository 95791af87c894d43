// The CPU forward kernel, compiled once per Highway SIMD target (foreach_target) and
// dispatched once per call. One work item = one block of Q rows of one (batch, head);
// it streams every visible K/V tile through fast memory (docs/algorithm.md §2–§3):
//
//   load Q tile
//   for each K/V tile:  S = Q·Kᵀ·softmax_scale·log2e → mask → online-softmax update
//                       (P = 2^(S − m)) → õ += P·V
//   epilogue: o = õ / ℓ, lse = (m + log2 ℓ)·ln2
//
// Both products run on one register-blocked micro-kernel, each row strip over only the keys
// it may see (FindStripKeys); S never leaves the L2 cache. The kernels "tiled" and
// "tiled_bf16" differ only in that micro-kernel and the operands it reads (Fp32Products:
// float32 FMAs; Bf16Products: AVX512-BF16 dot products on bf16 operands, bf16_dot.hpp).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/cpu/forward_kernel.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "flashattn/online_softmax.hpp"
#include "flashattn/error.hpp"
#include "src/core/element.hpp"
#include "src/cpu/bf16_dot.hpp"
#include "src/cpu/fp16_decode.hpp"
#include "src/cpu/forward_kernel.hpp"
#include "src/cpu/fp8-inl.h"
#include "src/cpu/score_mods-inl.h"
#include "src/cpu/simd_math-inl.h"
#include "src/cpu/tile_ops-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Row (b, j, kv_head) of k or v, through the block table when the cache is paged.
const void* KvRow(const ForwardParams& prm, const TensorView& t, std::int64_t b, std::int64_t j,
                  std::int64_t kv_head) {
  if (prm.paged.block_table == nullptr) return RowPointer(t, b, j, kv_head);
  const std::int64_t page = prm.paged.block_table[(j / prm.paged.page_size) * prm.paged.table_stride];
  return RowPointer(t, page, j % prm.paged.page_size, kv_head);
}

// The factor that turns row (b, j, kv_head) of an FP8 pool into values; 1 otherwise.
float KvDescale(const ForwardParams& prm, const float* descale, std::int64_t b, std::int64_t j,
                std::int64_t kv_head) {
  if (descale == nullptr) return 1.0f;
  const std::int64_t page = prm.paged.block_table == nullptr
                                ? b
                                : prm.paged.block_table[(j / prm.paged.page_size) * prm.paged.table_stride];
  return descale[page * prm.paged.descale_page_stride + kv_head * prm.paged.descale_head_stride];
}

// Prefetches the cache lines of the `bytes` bytes from `row` on: a row that is read
// kRowPrefetchDistance rows later.
HWY_INLINE void PrefetchRow(const void* row, std::int64_t bytes) {
  for (std::int64_t off = 0; off < bytes; off += kCacheLineBytes) hwy::Prefetch(static_cast<const char*>(row) + off);
}

// The producer role (docs/algorithm.md §4) on a CPU: lay out K and V of one (batch, kv head) for keys
// [from, to), whole tiles at a time, reusing what is packed. Both are cut into the
// micro-kernel's B panels of kMicroCols columns, each stored contiguously, so that a
// micro-kernel reads its B panel as one sequential stream. (Row-major tiles put consecutive
// rows of a panel block_k or head_dim_v floats apart, 512 B at 128: all in the same few L1
// sets, which hold too few of them for the panel to stay in L1 while the row strips reuse
// it.) `place(j, k_row, v_row)` puts key j's rows, as stored, into its panels; null rows
// are the keys that pad the last tile, which must be zeros: masked scores must meet finite
// K and V.
template <class PlaceFn>
void PackKeys(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t b, std::int64_t kv_head,
              std::int64_t from, std::int64_t to, PlaceFn place) {
  const AttentionProblem& p = prm.problem;
  const std::int64_t bc = prm.plan.block_k;
  if (!prm.switches.reuse_packed_kv) ws.packed = {};  // measurement: pack again what is packed
  const std::int64_t begin = ws.packed.first_to_pack(b, kv_head, from / bc * bc);
  const std::int64_t end = std::min(p.seqlen_k, (to + bc - 1) / bc * bc);
  const std::int64_t k_bytes = p.head_dim * static_cast<std::int64_t>(dtype_size(prm.k.dtype));
  const std::int64_t v_bytes = p.head_dim_v * static_cast<std::int64_t>(dtype_size(prm.v.dtype));
  for (std::int64_t j = begin; j < end; ++j) {
    if (prm.switches.software_prefetch && j + kRowPrefetchDistance < end) {
      PrefetchRow(KvRow(prm, prm.k, b, j + kRowPrefetchDistance, kv_head), k_bytes);
      PrefetchRow(KvRow(prm, prm.v, b, j + kRowPrefetchDistance, kv_head), v_bytes);
    }
    place(j, KvRow(prm, prm.k, b, j, kv_head), KvRow(prm, prm.v, b, j, kv_head));
  }
  if (end == p.seqlen_k && begin < end)
    for (std::int64_t j = end; j % bc != 0; ++j) place(j, nullptr, nullptr);
  if (end > begin) ws.counters.kv_packed += (end - begin) * (p.head_dim + p.head_dim_v);
  ws.packed.done(end);
}

// P = 2^(S − m) of columns [from, to) with one of the exp2 implementations; returns Σ P.
template <class Exp2Fn>
HWY_INLINE VF ExpRange(Exp2Fn exp2, float* HWY_RESTRICT srow, std::int64_t from, std::int64_t to, VF vm, VF vsum) {
  const DF df;
  for (std::int64_t j = from; j < to; j += kLanes) {
    const VF pj = exp2(df, hn::Sub(hn::Load(df, srow + j), vm));
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

// Variants, mask and online-softmax update of one score row of query i, in place:
// S(cols) of keys j0.. → P (dropout applied after the row sum, which must not see it).
// õ (orow, ldo floats) is rescaled when the reference maximum moves by more than the
// problem's rescale threshold; `rescales` counts those moves.
// `deferred` false (a measurement switch): the output is kept normalized at every tile, as
// FlashAttention-1 did — orow holds õ/ℓ, rescaled by ℓ_old·factor/ℓ_new, and P is divided by
// ℓ_new — instead of dividing õ by ℓ once at the end.
void SoftmaxRow(const RowMods& mods, float* HWY_RESTRICT srow, std::int64_t i, std::int64_t j0,
                std::int64_t n, std::int64_t cols, OnlineSoftmaxState& state, float* HWY_RESTRICT orow,
                std::int64_t ldo, std::int32_t& rescales, bool deferred) {
  const DF df;
  const AttentionProblem& p = *mods.problem;
  mods.apply(srow, nullptr, i, j0, n, cols);
  VF vmax = hn::Set(df, kNegInf);
  for (std::int64_t j = 0; j < cols; j += kLanes) vmax = hn::Max(vmax, hn::Load(df, srow + j));
  float tile_max = hn::GetLane(hn::MaxOfLanes(df, vmax));
  // Max may drop a NaN (x86 returns its second operand when either is NaN): a row whose
  // visible scores are all NaN could read as a row without visible keys. It must be NaN.
  if (tile_max == kNegInf && std::any_of(srow, srow + cols, [](float s) { return std::isnan(s); }))
    tile_max = std::numeric_limits<float>::quiet_NaN();
  const float old_max = state.max;
  const float factor = state.rescale_to(tile_max, p.rescale_threshold);
  if (state.max != old_max && old_max != kNegInf) ++rescales;
  if (deferred && factor != 1.0f) {
    const VF vf = hn::Set(df, factor);
    for (std::int64_t c = 0; c < ldo; c += kLanes) hn::Store(hn::Mul(hn::Load(df, orow + c), vf), df, orow + c);
  }
  if (state.max == kNegInf) {  // nothing visible yet: P = 0, never 2^(−∞ + ∞)
    std::fill(srow, srow + cols, 0.0f);
    return;
  }
  const std::int64_t poly_cols = Poly3Columns(p, cols);
  const VF vm = hn::Set(df, state.max);
  VF vsum = ExpRange([](DF d, VF x) { return Exp2Poly3(d, x); }, srow, 0, poly_cols, vm, hn::Zero(df));
  vsum = ExpRange([](DF d, VF x) { return Exp2(d, x); }, srow, poly_cols, cols, vm, vsum);
  const float scaled_sum = state.sum;  // ℓ_old · factor
  state.add(hn::GetLane(hn::SumOfLanes(df, vsum)));
  if (p.fp8_probabilities)
    for (std::int64_t j = 0; j < cols; j += kLanes)
      hn::Store(RoundToFp8(df, hn::Load(df, srow + j), Fp8Format::e4m3), df, srow + j);
  if (!deferred) {
    const VF vo = hn::Set(df, scaled_sum * state.inverse_sum()), vp = hn::Set(df, state.inverse_sum());
    for (std::int64_t c = 0; c < ldo; c += kLanes) hn::Store(hn::Mul(hn::Load(df, orow + c), vo), df, orow + c);
    for (std::int64_t j = 0; j < cols; j += kLanes) hn::Store(hn::Mul(hn::Load(df, srow + j), vp), df, srow + j);
  }
  if (mods.dropout_threshold != 0) mods.apply_dropout(srow, i, j0, cols);
}

// The keys of tile [j0, j0 + n) that each row strip of the Q tile starting at query i0
// computes. Key ranges are non-decreasing in the row, so strip s (queries i0 + s·kMicroRows
// on; padding rows count as the last query) sees at most [its first row's begin, its last
// row's end); rounded out to whole panels of kMicroCols keys, that is its span. Outside it
// every score of the strip is masked (causal, window): no S micro-tile, no exponential and
// no P·V depth is spent there, so a diagonal tile costs about its visible triangle, not its
// square. A strip that sees none of the tile's keys gets an empty span and is skipped: its
// softmax state and õ stay as they are, exactly what an all-masked row would leave.
void FindStripKeys(const AttentionProblem& p, std::int64_t i0, std::int64_t strips, std::int64_t j0, std::int64_t n,
                   StripKeys* HWY_RESTRICT keys) {
  for (std::int64_t s = 0; s < strips; ++s) {
    const std::int64_t first = std::min(i0 + s * kMicroRows, p.seqlen_q - 1);
    const std::int64_t last = std::min(i0 + (s + 1) * kMicroRows - 1, p.seqlen_q - 1);
    const std::int64_t lo = std::max<std::int64_t>(p.key_range(first).begin - j0, 0);
    const std::int64_t hi = std::min(p.key_range(last).end - j0, n);
    keys[s] = lo < hi ? StripKeys{lo / kMicroCols * kMicroCols, (hi + kMicroCols - 1) / kMicroCols * kMicroCols}
                      : StripKeys{};
  }
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

// The online-softmax update of every row over its strip's span (SoftmaxRow); rows of an
// empty span are left alone. The tile's rows are consecutive queries of one head; padded
// rows copy the last query.
void SoftmaxTile(const RowMods& mods, float* HWY_RESTRICT s, std::int64_t lds, std::int64_t i0,
                 std::int64_t rows, std::int64_t j0, std::int64_t n, const StripKeys* HWY_RESTRICT keys,
                 OnlineSoftmaxState* HWY_RESTRICT state, float* HWY_RESTRICT o_acc, std::int64_t ldo,
                 std::int32_t* rescales, bool deferred) {
  const AttentionProblem& p = *mods.problem;
  for (std::int64_t r = 0; r < rows; ++r) {
    const StripKeys k = keys[r / kMicroRows];
    if (k.begin == k.end) continue;
    SoftmaxRow(mods, s + r * lds + k.begin, std::min(i0 + r, p.seqlen_q - 1), j0 + k.begin,
               std::min(n, k.end) - k.begin, k.end - k.begin, state[r], o_acc + r * ldo, ldo,
               rescales[r], deferred);
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

// Row (b, i, h) of out.
HWY_INLINE void* OutputRow(const ForwardParams& prm, std::int64_t b, std::int64_t i, std::int64_t h) {
  return static_cast<unsigned char*>(prm.out.data) +
         detail::offset4(prm.out, b, i, h, 0) * static_cast<std::int64_t>(dtype_size(prm.out.dtype));
}

// The output row of query i of (b, h), or its split's partial, from õ and the state; its
// rescale count is added to the row's total when counted (splits of one row may run
// concurrently), and to the thread's counters.
void StoreOutputRow(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t split, std::int64_t b, std::int64_t h,
                    std::int64_t i, const float* orow, const OnlineSoftmaxState& state, std::int32_t rescales) {
  const AttentionProblem& p = prm.problem;
  ws.counters.rescales += rescales;
  if (prm.rescale_counts.data != nullptr) {
    const MutableTensorView& c = prm.rescale_counts;
    std::atomic_ref<std::int32_t>(static_cast<std::int32_t*>(c.data)[b * c.strides[0] + h * c.strides[1] + i * c.strides[2]])
        .fetch_add(rescales, std::memory_order_relaxed);
  }
  // Kept normalized at every tile (the deferred_normalization switch off): nothing left to divide.
  const float inverse = prm.switches.deferred_normalization || state.sum == 0.0f ? state.inverse_sum() : 1.0f;
  if (prm.plan.splits > 1) {
    StoreRow(orow, p.head_dim_v, inverse,
             prm.split_out + (((split * p.batch + b) * p.seqlen_q + i) * p.heads_q + h) * p.head_dim_v, DType::f32);
    prm.split_lse[((split * p.batch + b) * p.heads_q + h) * p.seqlen_q + i] = state.lse();
    return;
  }
  StoreRow(orow, p.head_dim_v, inverse, OutputRow(prm, b, i, h), prm.out.dtype);
  static_cast<float*>(prm.lse.data)[b * prm.lse.strides[0] + h * prm.lse.strides[1] + i * prm.lse.strides[2]] =
      state.lse();
}

// The tiled kernel's two products on float32 FMAs (MicroTile): K and V converted to float32
// at packing (FP8 codes dequantized), Q pre-scaled by softmax_scale·log2e as it is loaded.
struct Fp32Products {
  // K tiles as panels of kMicroCols keys, each (head_dim, kMicroCols) — Kᵀ; V tiles as panels
  // of kMicroCols columns, each (block_k, kMicroCols).
  static void Pack(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t b, std::int64_t kv_head,
                   std::int64_t from, std::int64_t to) {
    const std::int64_t bc = prm.plan.block_k, d = prm.problem.head_dim, dv = prm.problem.head_dim_v;
    const std::int64_t dv_pad = prm.plan.head_dim_v_padded;
    float* krow = ws.q_tile.get();  // scratch: Q is loaded after packing
    float* vrow = ws.o_acc.get();   // scratch (dv_pad floats): õ is zeroed after packing
    PackKeys(prm, ws, b, kv_head, from, to, [&](std::int64_t j, const void* k_row, const void* v_row) {
      const bool zero = k_row == nullptr;
      if (!zero) {
        LoadRow(k_row, prm.k.dtype, d, KvDescale(prm, prm.paged.k_descale, b, j, kv_head), krow);
        LoadRow(v_row, prm.v.dtype, dv, KvDescale(prm, prm.paged.v_descale, b, j, kv_head), vrow);
      }
      float* kt = ws.k_packed.get() + (j / bc) * d * bc + (j % bc) / kMicroCols * d * kMicroCols + j % kMicroCols;
      float* vt = ws.v_packed.get() + (j / bc) * bc * dv_pad + (j % bc) * kMicroCols;
      for (std::int64_t c = 0; c < d; ++c) kt[c * kMicroCols] = zero ? 0.0f : krow[c];
      for (std::int64_t c = 0; c < dv_pad; c += kMicroCols)
        for (std::int64_t e = 0; e < kMicroCols; ++e) vt[c * bc + e] = zero || c + e >= dv ? 0.0f : vrow[c + e];
    });
  }

  // Rows [0, rows) of the Q tile from queries i0.., times softmax_scale·log2e; rows up to
  // rows_pad zero.
  static void LoadQ(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t b, std::int64_t h, std::int64_t i0,
                    std::int64_t rows, std::int64_t rows_pad) {
    const AttentionProblem& p = prm.problem;
    const std::int64_t d = p.head_dim;
    float* q_tile = ws.q_tile.get();  // (rows_pad, d)
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
  static void Scores(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t j0, const StripKeys* keys,
                     std::int64_t strips, std::int64_t n_pad) {
    const std::int64_t d = prm.problem.head_dim, bc = prm.plan.block_k;
    const float* q_tile = ws.q_tile.get();
    const float* k_tile = ws.k_packed.get() + (j0 / bc) * d * bc;
    float* s_tile = ws.s_tile.get();  // (rows_pad, bc)
    ScoreTile(keys, strips, n_pad, [&](std::int64_t s, std::int64_t j) {
      MicroTile<false>({q_tile + s * kMicroRows * d, d}, k_tile + j / kMicroCols * d * kMicroCols, kMicroCols,
                       s_tile + s * kMicroRows * bc + j, bc, d);
    });
  }

  // õ += P·V(keys j0..), P in place in the S tile.
  static void Accumulate(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t j0, const StripKeys* keys,
                         std::int64_t strips) {
    const std::int64_t bc = prm.plan.block_k, dv_pad = prm.plan.head_dim_v_padded;
    const float* s_tile = ws.s_tile.get();
    const float* v_tile = ws.v_packed.get() + j0 * dv_pad;
    float* o_acc = ws.o_acc.get();
    AccumulateTile(keys, strips, dv_pad, [&](std::int64_t s, std::int64_t c, StripKeys k) {
      MicroTile<true>({s_tile + s * kMicroRows * bc + k.begin, bc}, v_tile + c / kMicroCols * bc * kMicroCols + k.begin * kMicroCols,
                      kMicroCols, o_acc + s * kMicroRows * dv_pad + c, dv_pad, k.end - k.begin);
    });
  }
};

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// The tiled kernel's two products on AVX512-BF16 dot products (bf16_dot.hpp), for bf16 q, k
// and v: every operand is bf16 with pairs along the product's depth, read as stored. S =
// Q·Kᵀ takes Q unscaled — exact inputs — and applies softmax_scale·log2e to S in float32 as
// the micro-tile is stored, so nothing is rounded that upstream does not round; P is rounded
// to bf16 (nearest even) before P·V, as upstream rounds it, while ℓ sums the float32 P.
// The bf16 micro-tile is this target's micro-tile, so strips, spans and panels are the
// float32 kernel's.
struct Bf16Products {
  static_assert(kMicroRows == bf16dot::kRows && kMicroCols == bf16dot::kCols, "one micro-tile for both kernels");

  static std::int64_t EvenHeadDim(const ForwardParams& prm) { return (prm.problem.head_dim + 1) / 2 * 2; }

  // K tiles as panels of kMicroCols keys, each (head_dim_pairs, kMicroCols, 2): step p holds
  // every key's elements 2p and 2p + 1 side by side (an odd head_dim ends with a zero); V
  // tiles as panels of kMicroCols columns, each (block_k / 2, kMicroCols, 2): step p holds
  // every column's values of keys 2p and 2p + 1.
  static void Pack(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t b, std::int64_t kv_head,
                   std::int64_t from, std::int64_t to) {
    const std::int64_t bc = prm.plan.block_k, d = prm.problem.head_dim, dv = prm.problem.head_dim_v;
    const std::int64_t dv_pad = prm.plan.head_dim_v_padded, d_even = EvenHeadDim(prm);
    constexpr std::int64_t kStep = bf16dot::kPairStep;
    PackKeys(prm, ws, b, kv_head, from, to, [&](std::int64_t j, const void* k_row, const void* v_row) {
      const auto* k = static_cast<const std::uint16_t*>(k_row);
      const auto* v = static_cast<const std::uint16_t*>(v_row);
      std::uint16_t* kt =
          ws.k_pairs.get() + (j / bc) * d_even * bc + (j % bc) / kMicroCols * d_even * kMicroCols + j % kMicroCols * 2;
      for (std::int64_t e = 0; e < d; ++e) kt[e / 2 * kStep + e % 2] = k != nullptr ? k[e] : 0;
      if (d < d_even) kt[d / 2 * kStep + 1] = 0;
      std::uint16_t* vt = ws.v_pairs.get() + (j / bc) * bc * dv_pad + (j % bc) / 2 * kStep + j % 2;
      for (std::int64_t c = 0; c < dv_pad; ++c)
        vt[c / kMicroCols * bc * kMicroCols + c % kMicroCols * 2] = v != nullptr && c < dv ? v[c] : 0;
    });
  }

  // Rows [0, rows) of the bf16 Q tile from queries i0.., as stored (head_dim padded to even
  // with a zero); rows up to rows_pad zero.
  static void LoadQ(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t b, std::int64_t h, std::int64_t i0,
                    std::int64_t rows, std::int64_t rows_pad) {
    const std::int64_t d = prm.problem.head_dim, d_even = EvenHeadDim(prm);
    std::uint16_t* q = ws.q_bf16.get();  // (rows_pad, d_even)
    const std::int64_t q_bytes = d * static_cast<std::int64_t>(sizeof(std::uint16_t));
    for (std::int64_t r = 0; r < rows; ++r) {
      if (prm.switches.software_prefetch && r + kRowPrefetchDistance < rows)
        PrefetchRow(RowPointer(prm.q, b, i0 + r + kRowPrefetchDistance, h), q_bytes);
      std::memcpy(q + r * d_even, RowPointer(prm.q, b, i0 + r, h), static_cast<std::size_t>(q_bytes));
      if (d < d_even) q[r * d_even + d] = 0;
    }
    std::fill(q + rows * d_even, q + rows_pad * d_even, std::uint16_t{0});
  }

  static void Scores(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t j0, const StripKeys* keys,
                     std::int64_t strips, std::int64_t n_pad) {
    const std::int64_t d_even = EvenHeadDim(prm), bc = prm.plan.block_k;
    const float scale = prm.problem.softmax_scale * OnlineSoftmaxState::kLog2e;
    const std::uint16_t* q = ws.q_bf16.get();
    const std::uint16_t* k_tile = ws.k_pairs.get() + (j0 / bc) * d_even * bc;
    float* s_tile = ws.s_tile.get();  // (rows_pad, bc)
    ScoreTile(keys, strips, n_pad, [&](std::int64_t s, std::int64_t j) {
      bf16dot::DotStore(q + s * kMicroRows * d_even, d_even, k_tile + j / kMicroCols * d_even * kMicroCols, d_even / 2,
                        scale, s_tile + s * kMicroRows * bc + j, bc);
    });
  }

  // P of each strip's span rounded into the bf16 P tile, then õ += P·V(keys j0..).
  static void Accumulate(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t j0, const StripKeys* keys,
                         std::int64_t strips) {
    const std::int64_t bc = prm.plan.block_k, dv_pad = prm.plan.head_dim_v_padded;
    const float* s_tile = ws.s_tile.get();
    std::uint16_t* p_tile = ws.p_bf16.get();  // (rows_pad, bc)
    for (std::int64_t s = 0; s < strips; ++s)
      for (std::int64_t r = s * kMicroRows; r < (s + 1) * kMicroRows && keys[s].begin != keys[s].end; ++r)
        bf16dot::RoundToBf16(s_tile + r * bc + keys[s].begin, p_tile + r * bc + keys[s].begin,
                             keys[s].end - keys[s].begin);
    const std::uint16_t* v_tile = ws.v_pairs.get() + j0 * dv_pad;
    float* o_acc = ws.o_acc.get();
    AccumulateTile(keys, strips, dv_pad, [&](std::int64_t s, std::int64_t c, StripKeys k) {
      bf16dot::DotAccumulate(p_tile + s * kMicroRows * bc + k.begin, bc,
                             v_tile + c / kMicroCols * bc * kMicroCols + k.begin * kMicroCols, (k.end - k.begin) / 2,
                             o_acc + s * kMicroRows * dv_pad + c, dv_pad);
    });
  }
};
#endif

// One work item of the tiled kernels: a Q tile of one (batch, head) against its visible K/V
// tiles; Products (Fp32Products, Bf16Products) computes the two matrix products.
template <class Products>
void TiledItem(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t item) {
  const AttentionProblem& p = prm.problem;
  const CpuForwardPlan& plan = prm.plan;
  const std::int64_t d = p.head_dim, dv_pad = plan.head_dim_v_padded;
  const std::int64_t bq = plan.block_q, bc = plan.block_k;

  // Items run head-major; within a head, causal blocks run longest first; the splits of
  // one Q tile are consecutive items.
  const std::int64_t split = item % plan.splits;
  const std::int64_t t = item / plan.splits % plan.q_blocks, bh = item / plan.splits / plan.q_blocks;
  const std::int64_t h = bh % p.heads_q, b = bh / p.heads_q;
  const std::int64_t q_block = p.causal ? plan.q_blocks - 1 - t : t;
  const std::int64_t kv_head = h / (p.heads_q / p.heads_kv);
  const std::int64_t i0 = q_block * bq;
  const std::int64_t rows = std::min(bq, p.seqlen_q - i0);
  const std::int64_t rows_pad = (rows + kMicroRows - 1) / kMicroRows * kMicroRows;
  const std::int64_t strips = rows_pad / kMicroRows;
  // Key ranges are non-decreasing in the row: the block spans [first row's begin, last
  // row's end); tiles outside it (causal, window) are never touched. Split-KV gives each
  // split a contiguous share of those tiles.
  const std::int64_t first_tile = p.key_range(i0).begin / bc;
  const std::int64_t tiles = std::max<std::int64_t>(0, (p.key_range(i0 + rows - 1).end + bc - 1) / bc - first_tile);
  const std::int64_t key_begin = std::max(p.key_range(i0).begin, (first_tile + tiles * split / plan.splits) * bc);
  const std::int64_t key_end = std::min(p.key_range(i0 + rows - 1).end,
                                        (first_tile + tiles * (split + 1) / plan.splits) * bc);
  const RowMods mods(p, prm.alibi_slopes, prm.block_mask, b, h);

  Products::Pack(prm, ws, b, kv_head, key_begin, key_end);
  Products::LoadQ(prm, ws, b, h, i0, rows, rows_pad);
  ws.counters.q_read += rows * d;

  float* o_acc = ws.o_acc.get();  // (rows_pad, dv_pad)
  std::fill(o_acc, o_acc + rows_pad * dv_pad, 0.0f);
  OnlineSoftmaxState* state = ws.states.data();
  std::fill(state, state + rows_pad, OnlineSoftmaxState{});
  std::int32_t* rescales = ws.rescales.data();
  std::fill(rescales, rescales + rows_pad, 0);

  for (std::int64_t j0 = key_begin / bc * bc; j0 < key_end; j0 += bc) {
    const std::int64_t n = std::min(bc, key_end - j0);
    const std::int64_t n_pad = (n + kMicroCols - 1) / kMicroCols * kMicroCols;
    if (!mods.tile_has_work(i0, rows, j0, n)) continue;  // block-sparse: skip it entirely
    ws.counters.tiles_computed += 1;
    ws.counters.scores += rows * n;
    ws.counters.k_read += n * d;
    ws.counters.v_read += n * p.head_dim_v;

    StripKeys* keys = ws.strip_keys.data();  // (strips)
    FindStripKeys(p, i0, strips, j0, n, keys);
    Products::Scores(prm, ws, j0, keys, strips, n_pad);
    SoftmaxTile(mods, ws.s_tile.get(), bc, i0, rows_pad, j0, n, keys, state, o_acc, dv_pad, rescales,
                prm.switches.deferred_normalization);
    Products::Accumulate(prm, ws, j0, keys, strips);
  }

  // Epilogue: normalize once (deferred normalization) and store lse — a split's partial
  // result goes to the float32 buffers that merge_attention_states combines.
  const std::int64_t out_bytes = p.head_dim_v * static_cast<std::int64_t>(dtype_size(prm.out.dtype));
  for (std::int64_t r = 0; r < rows; ++r) {
    if (prm.switches.software_prefetch && plan.splits == 1 && r + kRowPrefetchDistance < rows)
      PrefetchRow(OutputRow(prm, b, i0 + r + kRowPrefetchDistance, h), out_bytes);
    StoreOutputRow(prm, ws, split, b, h, i0 + r, o_acc + r * dv_pad, state[r], rescales[r]);
  }
  ws.counters.o_written += rows * p.head_dim_v;
  ws.counters.lse_written += rows;
}

void ForwardWorkItem(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t item) {
  TiledItem<Fp32Products>(prm, ws, item);
}

// The tiled_bf16 work item where this target has one (AVX-512, whose micro-tile the bf16
// micro-kernel shares), else null.
ForwardWorkItemFn TiledBf16WorkItem() {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  return &TiledItem<Bf16Products>;
#else
  return nullptr;
#endif
}

// Storage formats the decode kernel reads K and V rows in, one instantiation each: the
// format is resolved once per call, not per row.
enum class KvFormat { f32, bf16, f16, e4m3 };

// The decode kernel reads K and V rows a pair of vectors (2·kLanes values) at a time.
// bf16 splits a pair into its even and its odd elements — one load and two integer
// operations, against two widening loads and two shifts for the values in order — so the
// Q rows it multiplies and the õ rows it adds to hold every whole pair in that order too;
// the other formats, and the scalar target's one-lane pairs, keep the order.
template <KvFormat F>
constexpr bool kEvenOdd = F == KvFormat::bf16 && HWY_TARGET != HWY_SCALAR;
constexpr std::int64_t kPair = 2 * kLanes;
static_assert(kMicroCols % kPair == 0, "a padded õ row is a whole number of pairs");

// Position within its pair (in row order) of lane i of the pair's vector `half` (0 or 1).
template <KvFormat F>
constexpr std::int64_t PairIndex(std::int64_t half, std::int64_t i) {
  return kEvenOdd<F> ? 2 * i + half : half * kLanes + i;
}

// What LoadKv's and LoadKvPair's values are short of the stored ones by: e4m3 codes are
// read as halves 2^-8 times their values, so scores and probabilities are multiplied by
// 2^8 — exactly, before their descales. 1 for the other formats.
template <KvFormat F>
constexpr float kKvUnit = F == KvFormat::e4m3 ? kE4m3HalfUnit : 1.0f;

// kLanes values of a K/V row from element e on, as float32, times 1/kKvUnit (FP8 codes
// without their descale, which is applied to the score or the probability instead).
template <KvFormat F>
HWY_INLINE VF LoadKv(const unsigned char* HWY_RESTRICT row, std::int64_t e) {
  const DF df;
  if constexpr (F == KvFormat::f32) {
    return hn::LoadU(df, reinterpret_cast<const float*>(row) + e);
  } else if constexpr (F == KvFormat::bf16) {
    const hn::Rebind<hwy::bfloat16_t, DF> dbf;
    return hn::PromoteTo(df, hn::LoadU(dbf, reinterpret_cast<const hwy::bfloat16_t*>(row) + e));
  } else if constexpr (F == KvFormat::f16) {
    const hn::Rebind<hwy::float16_t, DF> dh;
    return hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(row) + e));
  } else {  // e4m3: 2^-8 times the values (E4m3HalfBits)
    const hn::Rebind<std::int8_t, DF> d8;
    const hn::Rebind<std::int16_t, DF> d16;
    const auto bits = E4m3HalfBits(d16, hn::PromoteTo(d16, hn::LoadU(d8, reinterpret_cast<const std::int8_t*>(row) + e)));
    return hn::PromoteTo(df, hn::BitCast(hn::Rebind<hwy::float16_t, DF>(), bits));
  }
}

// The pair of vectors of a K/V row from element e on (e a multiple of kPair), in the order
// PairIndex gives, times 1/kKvUnit.
template <KvFormat F>
HWY_INLINE void LoadKvPair(const unsigned char* HWY_RESTRICT row, std::int64_t e, VF& lo, VF& hi) {
#if HWY_TARGET != HWY_SCALAR
  const DF df;
  if constexpr (kEvenOdd<F>) {
    // 32-bit lane i holds element 2i in its low half and 2i + 1 in its high half.
    const hn::RebindToUnsigned<DF> du;
    const auto bits = hn::LoadU(du, reinterpret_cast<const std::uint32_t*>(row + 2 * e));
    lo = hn::BitCast(df, hn::ShiftLeft<16>(bits));
    hi = hn::BitCast(df, hn::And(bits, hn::Set(du, 0xFFFF0000u)));
    return;
  } else if constexpr (F == KvFormat::e4m3) {  // a pair's codes widened at once
    const hn::Repartition<std::int16_t, DF> d16;
    const hn::Rebind<std::int8_t, decltype(d16)> d8;
    const hn::Rebind<hwy::float16_t, DF> dh;
    const hn::Twice<decltype(dh)> dh2;
    const auto h = hn::BitCast(dh2, E4m3HalfBits(d16, hn::PromoteTo(d16, hn::LoadU(d8, reinterpret_cast<const std::int8_t*>(row) + e))));
    lo = hn::PromoteTo(df, hn::LowerHalf(dh, h));
    hi = hn::PromoteTo(df, hn::UpperHalf(dh, h));
    return;
  }
#endif
  lo = LoadKv<F>(row, e);
  hi = LoadKv<F>(row, e + kLanes);
}

// The last `n` < kPair values of a row from element e on, zero-filled to a pair in row
// order (the ragged end of a row, whatever the format), times 1/kKvUnit.
template <KvFormat F>
HWY_INLINE void LoadKvTailPair(const unsigned char* HWY_RESTRICT row, std::int64_t e, std::int64_t n, DType dtype,
                               VF& lo, VF& hi) {
  HWY_ALIGN float part[kPair] = {};
  LoadRow(row + e * static_cast<std::int64_t>(dtype_size(dtype)), dtype, std::min(n, kPair), 1.0f / kKvUnit<F>, part);
  lo = hn::Load(DF(), part);
  hi = hn::Load(DF(), part + kLanes);
}

// Four sums at once, over every lane of a0, a1, a2, a3: lane 4·block + k of the result
// holds block `block`'s part of Σ a_k. Within every 128-bit block, interleaving (a0, a1)
// and (a2, a3) and adding the halves leaves the four partial sums side by side.
#if HWY_TARGET != HWY_SCALAR
HWY_INLINE VF BlockSums4(VF a0, VF a1, VF a2, VF a3) {
  static_assert(kLanes % 4 == 0, "whole 128-bit blocks of four floats");
  const DF df;
  // Per block: t01 = [a0₀+a0₂, a1₀+a1₂, a0₁+a0₃, a1₁+a1₃], t23 likewise; as 64-bit lanes
  // their low and high pairs interleave to [Σa0, Σa1, Σa2, Σa3] halves.
  const VF t01 = hn::Add(hn::InterleaveLower(df, a0, a1), hn::InterleaveUpper(df, a0, a1));
  const VF t23 = hn::Add(hn::InterleaveLower(df, a2, a3), hn::InterleaveUpper(df, a2, a3));
  const hn::RepartitionToWide<hn::RebindToUnsigned<DF>> du64;
  const auto w01 = hn::BitCast(du64, t01), w23 = hn::BitCast(du64, t23);
  return hn::Add(hn::BitCast(df, hn::InterleaveLower(du64, w01, w23)), hn::BitCast(df, hn::InterleaveUpper(du64, w01, w23)));
}

// The lanes of v summed block-wise into one 128-bit block: dst[i] = Σ_blocks v[4·block + i].
template <class D>
HWY_INLINE void StoreBlockSum(D d, hn::Vec<D> v, float* HWY_RESTRICT dst) {
  if constexpr (hn::MaxLanes(D()) <= 4) {
    hn::StoreU(v, d, dst);
  } else {
    const hn::Half<D> dh;
    StoreBlockSum(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)), dst);
  }
}
#endif

// Rows [c] of `keys` for keys j0 + c, c < count: one block-table lookup per page, not per row.
void ResolveKeys(const ForwardParams& prm, std::int64_t b, std::int64_t j0, std::int64_t count, DecodeKeys& keys) {
  const PagedKv& pg = prm.paged;
  const std::int64_t page_size = pg.block_table != nullptr ? pg.page_size : j0 + count;  // contiguous: one page
  std::int64_t page_index = pg.block_table != nullptr ? j0 / page_size : 0;
  std::int64_t slot = pg.block_table != nullptr ? j0 % page_size : j0;
  for (std::int64_t c = 0; c < count;) {
    const std::int64_t page = pg.block_table != nullptr ? pg.block_table[page_index * pg.table_stride] : b;
    const float* kd = pg.k_descale != nullptr ? pg.k_descale + page * pg.descale_page_stride : nullptr;
    const float* vd = pg.v_descale != nullptr ? pg.v_descale + page * pg.descale_page_stride : nullptr;
    for (; c < count && slot < page_size; ++c, ++slot) {
      keys.k[c] = static_cast<const unsigned char*>(RowPointer(prm.k, page, slot, 0));
      keys.v[c] = static_cast<const unsigned char*>(RowPointer(prm.v, page, slot, 0));
      keys.k_descale[c] = kd;
      keys.v_descale[c] = vd;
    }
    slot = 0;
    ++page_index;
  }
}

// The scores of four rows and `count` ≤ 4 keys: s[r·lds + k] = (row r of the panel)·krows[k]
// for r < 4, k < count, with K's values as LoadKvPair reads them (kKvUnit and the FP8
// descale are applied later, per column). The panel holds, per pair of K vectors, the four
// rows' values of the first vector, then of the second, in LoadKvPair's order (row order in
// the ragged last pair). Sixteen FMA chains, one per (key, row), and one reduction for
// their sixteen sums: the reduction, not the products, is what one key at a time paid for.
template <KvFormat F>
HWY_INLINE void ScoreKeys4(const float* HWY_RESTRICT panel, const unsigned char* const* krows, std::int64_t count,
                           std::int64_t d, DType dtype, float* HWY_RESTRICT s, std::int64_t lds) {
  const DF df;
  const unsigned char* row[4];
  for (std::int64_t k = 0; k < 4; ++k) row[k] = krows[std::min(k, count - 1)];  // a short group repeats its last key
  VF acc[4][4];  // [key][row]
  for (auto& key : acc)
    for (VF& a : key) a = hn::Zero(df);
  auto step = [&](std::int64_t k, VF lo, VF hi, const float* HWY_RESTRICT q) {
    for (std::int64_t r = 0; r < 4; ++r) {
      acc[k][r] = hn::MulAdd(hn::Load(df, q + r * kLanes), lo, acc[k][r]);
      acc[k][r] = hn::MulAdd(hn::Load(df, q + (4 + r) * kLanes), hi, acc[k][r]);
    }
  };
  VF lo, hi;
  std::int64_t e = 0;
  for (; e + kPair <= d; e += kPair, panel += 4 * kPair)
    for (std::int64_t k = 0; k < 4; ++k) {
      LoadKvPair<F>(row[k], e, lo, hi);
      step(k, lo, hi, panel);
    }
  if (e < d)
    for (std::int64_t k = 0; k < 4; ++k) {
      LoadKvTailPair<F>(row[k], e, d - e, dtype, lo, hi);
      step(k, lo, hi, panel);
    }
  HWY_ALIGN float sums[4][4];  // [row][key]
  for (std::int64_t r = 0; r < 4; ++r) {
#if HWY_TARGET == HWY_SCALAR
    for (std::int64_t k = 0; k < 4; ++k) sums[r][k] = hn::GetLane(acc[k][r]);
#else
    const VF u = BlockSums4(acc[0][r], acc[1][r], acc[2][r], acc[3][r]);
    if (count == 4) {
      StoreBlockSum(df, u, s + r * lds);
      continue;
    }
    StoreBlockSum(df, u, sums[r]);
#endif
    for (std::int64_t k = 0; k < count; ++k) s[r * lds + k] = sums[r][k];
  }
}

// õ rows [0, 4) (row stride ldo), pair e, += P rows [0, 4) (row stride ldp) · the kv head's
// V rows of keys [0, n) (at `offset` bytes from keys.v): eight FMA chains, õ in registers.
template <KvFormat F>
HWY_INLINE void AccumulatePair4(const float* HWY_RESTRICT p0, std::int64_t ldp, const DecodeKeys& keys,
                                std::int64_t offset, std::int64_t n, std::int64_t e, std::int64_t dv, DType dtype,
                                float* HWY_RESTRICT o0, std::int64_t ldo) {
  const DF df;
  VF a0 = hn::Load(df, o0), a1 = hn::Load(df, o0 + ldo), a2 = hn::Load(df, o0 + 2 * ldo), a3 = hn::Load(df, o0 + 3 * ldo);
  VF b0 = hn::Load(df, o0 + kLanes), b1 = hn::Load(df, o0 + ldo + kLanes);
  VF b2 = hn::Load(df, o0 + 2 * ldo + kLanes), b3 = hn::Load(df, o0 + 3 * ldo + kLanes);
  auto step = [&](VF lo, VF hi, std::int64_t c) {
    const VF w0 = hn::Set(df, p0[c]), w1 = hn::Set(df, p0[ldp + c]);
    const VF w2 = hn::Set(df, p0[2 * ldp + c]), w3 = hn::Set(df, p0[3 * ldp + c]);
    a0 = hn::MulAdd(w0, lo, a0);
    b0 = hn::MulAdd(w0, hi, b0);
    a1 = hn::MulAdd(w1, lo, a1);
    b1 = hn::MulAdd(w1, hi, b1);
    a2 = hn::MulAdd(w2, lo, a2);
    b2 = hn::MulAdd(w2, hi, b2);
    a3 = hn::MulAdd(w3, lo, a3);
    b3 = hn::MulAdd(w3, hi, b3);
  };
  VF lo, hi;
  if (e + kPair <= dv) {
    std::int64_t c = 0;
    for (; c + 2 <= n; c += 2) {  // two keys per pass: half the loop overhead
      LoadKvPair<F>(keys.v[c] + offset, e, lo, hi);
      step(lo, hi, c);
      LoadKvPair<F>(keys.v[c + 1] + offset, e, lo, hi);
      step(lo, hi, c + 1);
    }
    if (c < n) {
      LoadKvPair<F>(keys.v[c] + offset, e, lo, hi);
      step(lo, hi, c);
    }
  } else {  // the ragged end of the row: values past Dv read as zeros
    for (std::int64_t c = 0; c < n; ++c) {
      LoadKvTailPair<F>(keys.v[c] + offset, e, dv - e, dtype, lo, hi);
      step(lo, hi, c);
    }
  }
  hn::Store(a0, df, o0);
  hn::Store(a1, df, o0 + ldo);
  hn::Store(a2, df, o0 + 2 * ldo);
  hn::Store(a3, df, o0 + 3 * ldo);
  hn::Store(b0, df, o0 + kLanes);
  hn::Store(b1, df, o0 + ldo + kLanes);
  hn::Store(b2, df, o0 + 2 * ldo + kLanes);
  hn::Store(b3, df, o0 + 3 * ldo + kLanes);
}

// The decode kernel (a few query rows, many keys): item = (batch, split), a contiguous key
// chunk read for every kv head. Its rows are every (q head, query) pair, grouped per kv head
// in fours, so each K and V row is read exactly once, in place and converted in registers,
// and each key's kv heads — adjacent in memory — are read together: no packing, no
// micro-tile padding. Per block of keys: S = Q·Kᵀ four rows by four keys at once (one
// reduction for the sixteen dot products), the online softmax, then õ += P·V with
// four rows and a pair of õ vectors in registers.
template <KvFormat F>
void DecodeItem(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t item) {
  const AttentionProblem& p = prm.problem;
  const CpuForwardPlan& plan = prm.plan;
  const std::int64_t d = p.head_dim, dv = p.head_dim_v, bc = plan.block_k, dv_pad = plan.head_dim_v_padded;
  const std::int64_t d_span = (d + kPair - 1) / kPair * kPair;  // a Q row: whole pairs
  const std::int64_t hkv = p.heads_kv, group = p.heads_q / hkv, rows = group * p.seqlen_q;
  const std::int64_t rows4 = plan.block_q, all_rows = hkv * rows4;  // a kv head's rows, in fours
  const auto elem = static_cast<std::int64_t>(dtype_size(prm.k.dtype));
  const std::int64_t k_head = prm.k.strides[2] * elem, v_head = prm.v.strides[2] * elem;  // bytes
  const std::int64_t k_row = d * elem, v_row = dv * elem;  // bytes of a K and a V row
  const std::int64_t descale_head = prm.paged.descale_head_stride;
  const std::int64_t split = item % plan.splits, b = item / plan.splits;
  const std::int64_t first_tile = p.key_range(0).begin / bc;
  const std::int64_t tiles = std::max<std::int64_t>(0, (p.key_range(p.seqlen_q - 1).end + bc - 1) / bc - first_tile);
  const std::int64_t key_begin = std::max(p.key_range(0).begin, (first_tile + tiles * split / plan.splits) * bc);
  const std::int64_t key_end =
      std::min(p.key_range(p.seqlen_q - 1).end, (first_tile + tiles * (split + 1) / plan.splits) * bc);

  // Row g·rows4 + r (r < rows) is query r % Sq of q head g·group + r / Sq; rows r ≥ rows of
  // each kv head g are zero padding. Each four rows form a ScoreKeys4 panel (4 · d_span).
  // decode_fp16 (FP8 caches on AVX512-FP16): the products in half precision (fp16dot), each
  // panel's rows packed to halves, scaled by powers of two that q_unit undoes on the scores.
  const bool fp16 = F == KvFormat::e4m3 && plan.kernel == ForwardKernel::decode_fp16;
  const std::int64_t panel_halves = 4 * ((d + fp16dot::kHalves - 1) / fp16dot::kHalves) * fp16dot::kHalves;
  const std::int64_t d_pad = (d + 31) / 32 * 32;  // as the workspace sized q_tile: at least d_span
  float* q_panels = ws.q_tile.get();             // (heads_kv · rows4, d_span)
  float* q_row = q_panels + all_rows * d_pad;    // one row in row order, loaded (decode_fp16: four)
  auto* q_halves = reinterpret_cast<std::uint16_t*>(q_panels);  // decode_fp16: (panels, panel_halves)
  float* q_unit = q_row + 4 * d_pad;             // decode_fp16: (heads_kv · rows4)
  const float q_scale = p.softmax_scale * OnlineSoftmaxState::kLog2e;
  auto load_q = [&](std::int64_t g, std::int64_t r, float* dst) {  // row r of kv head g, scaled
    LoadRow(RowPointer(prm.q, b, r % p.seqlen_q, g * group + r / p.seqlen_q), p.dtype, d, q_scale, dst);
  };
  if (fp16) {
    for (std::int64_t i = 0; i < all_rows / 4; ++i) {
      const std::int64_t g = 4 * i / rows4, r0 = 4 * i % rows4, live = std::clamp<std::int64_t>(rows - r0, 0, 4);
      for (std::int64_t r = r0; r < r0 + live; ++r) load_q(g, r, q_row + (r - r0) * d);
      fp16dot::PackQ4(q_row, d, live, d, q_halves + i * panel_halves, q_unit + 4 * i);
    }
  } else {
    std::fill(q_panels, q_panels + all_rows * d_span, 0.0f);
    for (std::int64_t g = 0; g < hkv; ++g)
      for (std::int64_t r = 0; r < rows; ++r) {
        load_q(g, r, q_row);
        float* panel = q_panels + (g * rows4 + r / 4 * 4) * d_span + r % 4 * kLanes;
        for (std::int64_t e = 0; e < d; e += kPair)
          for (std::int64_t half = 0; half < 2; ++half)
            for (std::int64_t i = 0; i < kLanes; ++i) {
              const std::int64_t x = e + (e + kPair <= d ? PairIndex<F>(half, i) : half * kLanes + i);
              panel[4 * e + half * 4 * kLanes + i] = x < d ? q_row[x] : 0.0f;
            }
      }
  }
  float* o_acc = ws.o_acc.get();  // (heads_kv · rows4, dv_pad), whole pairs in LoadKvPair's order
  std::fill(o_acc, o_acc + all_rows * dv_pad, 0.0f);
  OnlineSoftmaxState* state = ws.states.data();
  std::fill(state, state + all_rows, OnlineSoftmaxState{});
  std::int32_t* rescales = ws.rescales.data();
  std::fill(rescales, rescales + all_rows, 0);
  float* s_tile = ws.s_tile.get();  // (heads_kv · rows4, bc)
  DecodeKeys& keys = ws.decode_keys;  // (bc + kDecodePrefetchKeys)
  float* factor = ws.o_acc.get() + all_rows * dv_pad;  // (bc): a kv head's K, then V, descales per key (FP8)
  float* v_unit = q_unit + all_rows;  // decode_fp16: (heads_kv) what a key block's P·V sums are multiplied by
  ws.counters.q_read += hkv * rows * d;

  for (std::int64_t j0 = key_begin; j0 < key_end; j0 += bc) {
    const std::int64_t n = std::min(bc, key_end - j0), cols = (n + kLanes - 1) / kLanes * kLanes;
    const std::int64_t ahead = std::min(n + kDecodePrefetchKeys, key_end - j0);  // keys resolved
    ResolveKeys(prm, b, j0, ahead, keys);
    ws.counters.tiles_computed += hkv;  // one (kv head, key block) tile each, as the cost model counts
    ws.counters.scores += hkv * rows * n;
    ws.counters.k_read += hkv * n * d;
    ws.counters.v_read += hkv * n * dv;
    for (std::int64_t c = 0; c < n; c += 4) {  // S columns [c, c + 4) = Q·k_(j0+c+i)
      const std::int64_t count = std::min<std::int64_t>(4, n - c);
      // Fetch the K and V rows of the keys kDecodePrefetchKeys ahead, a kv head's rows beside
      // its scores, so that the fetches spread out: four keys read at once interleave four
      // streams, which the hardware prefetcher does not follow.
      const std::int64_t fetch_end = std::min(c + count + kDecodePrefetchKeys, ahead);
      const unsigned char* krows[4];
      for (std::int64_t i = 0; i < count; ++i) krows[i] = keys.k[c + i];
      if (fp16) {
        const fp16dot::Fetch fetch{keys.k.data() + c + kDecodePrefetchKeys, keys.v.data() + c + kDecodePrefetchKeys,
                                   std::max<std::int64_t>(0, fetch_end - c - kDecodePrefetchKeys), k_row, v_row, v_head};
        fp16dot::ScoreKeys4(q_halves, all_rows / 4, rows4 / 4, krows, k_head, count, d, s_tile + c, bc, fetch);
        continue;
      }
      const float* panel = q_panels;
      float* s = s_tile + c;
      for (std::int64_t g = 0; g < hkv; ++g) {
        for (std::int64_t i = c + kDecodePrefetchKeys; i < fetch_end; ++i) {
          for (std::int64_t off = 0; off < k_row; off += kCacheLineBytes) hwy::Prefetch(keys.k[i] + g * k_head + off);
          for (std::int64_t off = 0; off < v_row; off += kCacheLineBytes) hwy::Prefetch(keys.v[i] + g * v_head + off);
        }
        for (std::int64_t r = 0; r < rows4; r += 4, panel += 4 * d_span, s += 4 * bc)
          ScoreKeys4<F>(panel, krows, count, d, prm.k.dtype, s, bc);
        for (std::int64_t i = 0; i < count; ++i) krows[i] += k_head;
      }
    }
    for (std::int64_t g = 0; g < hkv; ++g) {
      if constexpr (F == KvFormat::e4m3) {  // Q·(values·descale) = (Q·values read)·(kKvUnit·descale)
        for (std::int64_t c = 0; c < cols; ++c) factor[c] = c < n ? kKvUnit<F> * keys.k_descale[c][g * descale_head] : 0.0f;
        for (std::int64_t r = 0; r < rows; ++r) {
          float* srow = s_tile + (g * rows4 + r) * bc;
          const VF unit = hn::Set(DF(), fp16 ? q_unit[g * rows4 + r] : 1.0f);  // decode_fp16: the q row's scaling undone
          for (std::int64_t c = 0; c < n; c += kLanes)
            hn::Store(hn::Mul(hn::Mul(hn::Load(DF(), srow + c), hn::Load(DF(), factor + c)), unit), DF(), srow + c);
        }
        // P·(values·descale) = (P·kKvUnit·descale)·(values read). decode_fp16: P·descale·2^u
        // with 2^u bringing the largest descale below 2^8 (so P at most 256 in half
        // precision), and kKvUnit·2^-u applied to the float32 sums (v_unit).
        for (std::int64_t c = 0; c < cols; ++c) factor[c] = c < n ? keys.v_descale[c][g * descale_head] : 0.0f;
        float v_scale = kKvUnit<F>;
        if (fp16) {
          VF largest = hn::Zero(DF());
          for (std::int64_t c = 0; c < cols; c += kLanes) largest = hn::Max(largest, hn::Load(DF(), factor + c));
          int exponent = 0;
          const float most = hn::GetLane(hn::MaxOfLanes(DF(), largest));
          if (most > 0.0f && std::isfinite(most)) std::frexp(most, &exponent);  // most < 2^exponent
          v_scale = std::ldexp(1.0f, std::clamp(8 - exponent, -100, 100));
          v_unit[g] = kKvUnit<F> / v_scale;
        }
        for (std::int64_t c = 0; c < cols; c += kLanes)
          hn::Store(hn::Mul(hn::Load(DF(), factor + c), hn::Set(DF(), v_scale)), DF(), factor + c);
      }
      for (std::int64_t r = 0; r < rows4; ++r) {
        float* srow = s_tile + (g * rows4 + r) * bc;
        if (r >= rows) {  // padding rows: no probability mass
          std::fill(srow, srow + cols, 0.0f);
          continue;
        }
        std::fill(srow + n, srow + cols, 0.0f);
        const RowMods mods(p, prm.alibi_slopes, prm.block_mask, b, g * group + r / p.seqlen_q);
        SoftmaxRow(mods, srow, r % p.seqlen_q, j0, n, cols, state[g * rows4 + r], o_acc + (g * rows4 + r) * dv_pad,
                   dv_pad, rescales[g * rows4 + r], prm.switches.deferred_normalization);
        if constexpr (F == KvFormat::e4m3) {
          for (std::int64_t c = 0; c < cols; c += kLanes)
            hn::Store(hn::Mul(hn::Load(DF(), srow + c), hn::Load(DF(), factor + c)), DF(), srow + c);
          if (fp16) fp16dot::PairHalves(srow, reinterpret_cast<std::uint32_t*>(srow), cols);  // in place
        }
      }
    }
    for (std::int64_t g = 0; g < hkv; ++g)
      for (std::int64_t r = g * rows4; r < (g + 1) * rows4; r += 4)
        if (fp16)
          fp16dot::AccumulateRows4(reinterpret_cast<const std::uint32_t*>(s_tile + r * bc), bc, keys.v.data(), g * v_head,
                                   n, dv, v_unit[g], o_acc + r * dv_pad, dv_pad);
        else
          for (std::int64_t e = 0; e < dv_pad; e += kPair)
            AccumulatePair4<F>(s_tile + r * bc, bc, keys, g * v_head, n, e, dv, prm.v.dtype, o_acc + r * dv_pad + e,
                               dv_pad);
  }
  for (std::int64_t g = 0; g < hkv; ++g)
    for (std::int64_t r = 0; r < rows; ++r) {
      float* orow = o_acc + (g * rows4 + r) * dv_pad;
      if constexpr (kEvenOdd<F>)  // whole pairs back into row order
        for (std::int64_t e = 0; e + kPair <= dv; e += kPair) {
          HWY_ALIGN float pair[kPair];
          for (std::int64_t half = 0; half < 2; ++half)
            for (std::int64_t i = 0; i < kLanes; ++i) pair[PairIndex<F>(half, i)] = orow[e + half * kLanes + i];
          std::copy(pair, pair + kPair, orow + e);
        }
      StoreOutputRow(prm, ws, split, b, g * group + r / p.seqlen_q, r % p.seqlen_q, orow, state[g * rows4 + r],
                     rescales[g * rows4 + r]);
    }
  ws.counters.o_written += hkv * rows * dv;
  ws.counters.lse_written += hkv * rows;
}

void ForwardDecodeItem(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t item) {
  switch (prm.k.dtype) {
    case DType::f32: return DecodeItem<KvFormat::f32>(prm, ws, item);
    case DType::bf16: return DecodeItem<KvFormat::bf16>(prm, ws, item);
    case DType::f16: return DecodeItem<KvFormat::f16>(prm, ws, item);
    case DType::u8: return DecodeItem<KvFormat::e4m3>(prm, ws, item);
    case DType::i32: return;  // never an attention operand: rejected by validation
  }
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
HWY_EXPORT(ForwardWorkItem);
HWY_EXPORT(ForwardDecodeItem);
HWY_EXPORT(TiledBf16WorkItem);

KernelGeometry kernel_geometry() { return HWY_DYNAMIC_DISPATCH(GetKernelGeometry)(); }

bool tiled_bf16_available() {
  return bf16dot::available() && HWY_DYNAMIC_DISPATCH(TiledBf16WorkItem)() != nullptr;
}

ForwardWorkItemFn forward_work_item_kernel(ForwardKernel kernel) {
  kernel_geometry();  // the first dispatched call picks the target; then the table is direct
  switch (kernel) {
    case ForwardKernel::tiled: return &HWY_DYNAMIC_DISPATCH(ForwardWorkItem);
    case ForwardKernel::decode: return &HWY_DYNAMIC_DISPATCH(ForwardDecodeItem);
    case ForwardKernel::decode_fp16:
      if (!fp16dot::available())  // as for tiled_bf16: never an illegal instruction
        throw Error("kernel decode_fp16: this CPU (AVX512-FP16) cannot run it");
      return &HWY_DYNAMIC_DISPATCH(ForwardDecodeItem);
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
