// The CPU decode forward kernels (a few query rows, many keys), compiled once per Highway
// SIMD target (foreach_target) and dispatched once per call. Item = (batch, split), a
// contiguous key chunk read for every kv head. Its rows are every (q head, query) pair,
// grouped per kv head in fours, so each K and V row is read exactly once, in place and
// converted in registers, and each key's kv heads — adjacent in memory — are read
// together: no packing, no micro-tile padding (docs/algorithm.md §2–§3):
//
//   load Q panels (four rows each)
//   for each block of keys:  resolve their rows (paged: once per page)
//                            S = Q·Kᵀ four rows by four keys at once (one reduction for the
//                            sixteen dot products) → FP8 descales → mask → online softmax
//                            → õ += P·V with four rows and a pair of õ vectors in registers
//   epilogue: o = õ / ℓ, lse
//
// decode reads every K/V storage format (one instantiation each of the products); a cache
// with int8 codes (u8 or s8, kv_quant.hpp) reads each of K and V in its own format, the
// scales and zero points applied to scores and probabilities (DecodeQuantItem); decode_fp16
// (FP8 and int8 caches on AVX512-FP16) and decode_bf16 (the same on AVX512-BF16) run the same
// steps with the products in half precision (fp16_decode.hpp) or on bf16 dot products
// (bf16_decode.hpp): the narrow products, NarrowProducts.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/cpu/kernels/decode_forward.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "flashattn/error.hpp"
#include "flashattn/online_softmax.hpp"
#include "src/core/element.hpp"
#include "src/cpu/kernels/forward_kernel.hpp"
#include "src/cpu/kernels/bf16_decode.hpp"
#include "src/cpu/kernels/fp16_decode.hpp"
#include "src/cpu/kernels/forward_rows-inl.h"
#include "src/cpu/kernels/int8_dot.hpp"
#include "src/cpu/kernels/kv_pack-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Storage formats the decode kernel reads K and V rows in, one instantiation each: the
// format is resolved once per call, not per row.
enum class KvFormat { f32, bf16, f16, e4m3, u8, s8 };
template <KvFormat F>
constexpr bool kInt8 = F == KvFormat::u8 || F == KvFormat::s8;
// u8 codes are read as code − 128 (exact) and their zero points z as z − 128: the value
// (code − z)·scale is the same, but for values centred in their range (z near 128, the
// per-token choice for centred data) the zero-point terms ΣQ·(z − 128) and Σ P·scale·(z − 128)
// nearly vanish instead of cancelling most of the products' magnitude.
constexpr std::int32_t kU8Centre = 128;

// The decode kernel reads K and V rows a pair of vectors (2·kLanes values) at a time.
// bf16 splits a pair into its even and its odd elements — one load and two integer
// operations, against two widening loads and two shifts for the values in order — so the
// Q rows it multiplies and the õ rows it adds to hold every whole pair in that order too;
// the other formats, and the scalar target's one-lane pairs, keep the order.
template <KvFormat F>
constexpr bool kEvenOdd = F == KvFormat::bf16 && HWY_TARGET != HWY_SCALAR;
// The formats whose kv heads may have one or two rows (ScoreKeys): the caches of values (the
// plan keeps FP8 and int8 caches in fours).
template <KvFormat F>
constexpr bool kFewRows = F == KvFormat::f32 || F == KvFormat::bf16 || F == KvFormat::f16;
constexpr std::int64_t kPair = 2 * kLanes;
static_assert(kMicroCols % kPair == 0, "a padded õ row is a whole number of pairs");

// Position within its pair (in row order) of lane i of the pair's vector `half` (0 or 1).
template <KvFormat F>
constexpr std::int64_t PairIndex(std::int64_t half, std::int64_t i) {
  return kEvenOdd<F> ? 2 * i + half : half * kLanes + i;
}

// What LoadKv's and LoadKvPair's values are short of the stored ones by: e4m3 codes are
// read as halves 2^-8 times their values, so scores and probabilities are multiplied by
// 2^8 — exactly, before their descales. 1 for the other formats (int8 codes read as the
// integers they are, their scales and zero points applied to scores and probabilities).
template <KvFormat F>
constexpr float kKvUnit = F == KvFormat::e4m3 ? kE4m3HalfUnit : 1.0f;

// kLanes values of a K/V row from element e on, as float32, times 1/kKvUnit (FP8 codes
// without their descale, int8 codes without scale and zero point: those are applied to
// the score or the probability instead).
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
  } else if constexpr (F == KvFormat::s8) {  // the codes as integers, −128..127
    const hn::Rebind<std::int8_t, DF> d8;
    return hn::ConvertTo(df, hn::PromoteTo(hn::RebindToSigned<DF>(), hn::LoadU(d8, reinterpret_cast<const std::int8_t*>(row) + e)));
  } else if constexpr (F == KvFormat::u8) {  // code − kU8Centre, −128..127 (its zero point is read likewise)
    const hn::Rebind<std::uint8_t, DF> d8;
    const hn::RebindToSigned<DF> di;
    const auto codes = hn::BitCast(di, hn::PromoteTo(hn::RebindToUnsigned<DF>(), hn::LoadU(d8, row + e)));
    return hn::ConvertTo(df, hn::Sub(codes, hn::Set(di, kU8Centre)));
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
  if constexpr (kInt8<F>) {  // codes 0 past the row: Q is zero there, and õ's padding is never stored
    HWY_ALIGN unsigned char codes[kPair] = {};
    std::memcpy(codes, row + e, static_cast<std::size_t>(std::min(n, kPair)));
    LoadKvPair<F>(codes, 0, lo, hi);
    return;
  }
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

// Rows [c] of `keys` for keys j0 + c, c < count: one block-table lookup and one address per
// page, the rows after it a stride apart (per-row address arithmetic was a sixth of the
// kernel's time at 1024 keys, f32, D 64).
void ResolveKeys(const ForwardParams& prm, std::int64_t b, std::int64_t j0, std::int64_t count, DecodeKeys& keys) {
  const PagedKv& pg = prm.paged;
  const KvRows kv{&prm.k, &prm.v, &pg, b, 0};
  const std::int64_t page_size = pg.block_table != nullptr ? pg.page_size : j0 + count;  // contiguous: one page
  const std::int64_t k_step = prm.k.strides[1] * static_cast<std::int64_t>(dtype_size(prm.k.dtype));
  const std::int64_t v_step = prm.v.strides[1] * static_cast<std::int64_t>(dtype_size(prm.v.dtype));
  // The entries of a scale or zero-point table (null: none) for `run` slots from `slot` on.
  auto fill = [](const float* table, const KvScales& scales, std::int64_t page, std::int64_t slot, std::int64_t run,
                 const float** dst) {
    for (std::int64_t i = 0; i < run; ++i)
      dst[i] = table != nullptr ? table + scales.offset(page, slot + i, 0) : nullptr;
  };
  for (std::int64_t c = 0; c < count;) {
    const std::int64_t page = kv.page(j0 + c), slot = (j0 + c) % page_size;
    const std::int64_t run = std::min(count - c, page_size - slot);  // the keys of this page
    const auto* k_row = static_cast<const unsigned char*>(RowPointer(prm.k, page, slot, 0));
    const auto* v_row = static_cast<const unsigned char*>(RowPointer(prm.v, page, slot, 0));
    for (std::int64_t i = 0; i < run; ++i) {
      keys.k[c + i] = k_row + i * k_step;
      keys.v[c + i] = v_row + i * v_step;
    }
    fill(pg.k.scale, pg.k, page, slot, run, keys.k_descale.data() + c);
    fill(pg.v.scale, pg.v, page, slot, run, keys.v_descale.data() + c);
    fill(pg.k.zero_point, pg.k, page, slot, run, keys.k_zero_point.data() + c);
    fill(pg.v.zero_point, pg.v, page, slot, run, keys.v_zero_point.data() + c);
    c += run;
  }
}

// The products take a kv head's rows R at a time: in fours (R = 4, padded), or all at once
// where a kv head has one or two over a cache of values (R = 1: multi-head attention's
// decode; R = 2: a group of two q heads; the plan's block_q is 1 or 2 then, kFewRows):
// padded to four, three or two of their four rows were computed and dropped. A row's sums
// are the same either way, bit for bit.
//
// The scores of R rows and `count` ≤ 4 keys: s[r·lds + k] = (row r of the panel)·krows[k]
// for r < R, k < count, with K's values as LoadKvPair reads them (kKvUnit and the FP8
// descale are applied later, per column). The panel holds, per pair of K vectors, the R
// rows' values of the first vector, then of the second, in LoadKvPair's order (row order in
// the ragged last pair). 4·R FMA chains, one per (key, row), and one reduction per row for
// its four sums: the reduction, not the products, is what one key at a time paid for.
template <KvFormat F, int R>
HWY_INLINE void ScoreKeys(const float* HWY_RESTRICT panel, const unsigned char* const* krows, std::int64_t count,
                          std::int64_t d, DType dtype, float* HWY_RESTRICT s, std::int64_t lds) {
  const DF df;
  const unsigned char* row[4];
  for (std::int64_t k = 0; k < 4; ++k) row[k] = krows[std::min(k, count - 1)];  // a short group repeats its last key
  VF acc[4][R];  // [key][row]
  for (auto& key : acc)
    for (VF& a : key) a = hn::Zero(df);
  auto madd = [&](std::int64_t k, std::int64_t r, VF lo, VF hi, const float* HWY_RESTRICT q) {
    acc[k][r] = hn::MulAdd(hn::Load(df, q + r * kLanes), lo, acc[k][r]);
    acc[k][r] = hn::MulAdd(hn::Load(df, q + (R + r) * kLanes), hi, acc[k][r]);
  };
  VF lo, hi;
  std::int64_t e = 0;
  for (; e + kPair <= d; e += kPair, panel += R * kPair)
    for (std::int64_t k = 0; k < 4; ++k) {
      LoadKvPair<F>(row[k], e, lo, hi);
      for (std::int64_t r = 0; r < R; ++r) madd(k, r, lo, hi, panel);
    }
  if (e < d)
    for (std::int64_t k = 0; k < 4; ++k) {
      LoadKvTailPair<F>(row[k], e, d - e, dtype, lo, hi);
      for (std::int64_t r = 0; r < R; ++r) madd(k, r, lo, hi, panel);
    }
  HWY_ALIGN float sums[R][4];  // [row][key]
  for (std::int64_t r = 0; r < R; ++r) {
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

// õ rows [0, R) (row stride ldo), pair e, += P rows [0, R) (row stride ldp) · the kv head's
// V rows of keys [0, n) (at `offset` bytes from keys.v): 2·R FMA chains, õ in registers.
template <KvFormat F, int R>
HWY_INLINE void AccumulatePair(const float* HWY_RESTRICT p0, std::int64_t ldp, const DecodeKeys& keys,
                               std::int64_t offset, std::int64_t n, std::int64_t e, std::int64_t dv, DType dtype,
                               float* HWY_RESTRICT o0, std::int64_t ldo) {
  const DF df;
  VF a[R], b[R];  // õ's two vectors of each row
  for (std::int64_t r = 0; r < R; ++r) {
    a[r] = hn::Load(df, o0 + r * ldo);
    b[r] = hn::Load(df, o0 + r * ldo + kLanes);
  }
  auto madd = [&](std::int64_t r, VF lo, VF hi, std::int64_t c) {
    const VF w = hn::Set(df, p0[r * ldp + c]);
    a[r] = hn::MulAdd(w, lo, a[r]);
    b[r] = hn::MulAdd(w, hi, b[r]);
  };
  // Key c's V pair into every row's chains.
  auto step = [&](std::int64_t c) {
    VF lo, hi;
    LoadKvPair<F>(keys.v[c] + offset, e, lo, hi);
    for (std::int64_t r = 0; r < R; ++r) madd(r, lo, hi, c);
  };
  if (e + kPair <= dv) {
    std::int64_t c = 0;
    for (; c + 2 <= n; c += 2) {  // two keys per pass: half the loop overhead
      step(c);
      step(c + 1);
    }
    if (c < n) step(c);
  } else {  // the ragged end of the row: values past Dv read as zeros
    VF lo, hi;
    for (std::int64_t c = 0; c < n; ++c) {
      LoadKvTailPair<F>(keys.v[c] + offset, e, dv - e, dtype, lo, hi);
      for (std::int64_t r = 0; r < R; ++r) madd(r, lo, hi, c);
    }
  }
  for (std::int64_t r = 0; r < R; ++r) {
    hn::Store(a[r], df, o0 + r * ldo);
    hn::Store(b[r], df, o0 + r * ldo + kLanes);
  }
}

// The shape of one decode work item. Row g·rows4 + r (r < rows) is query r % Sq of q head
// g·group + r / Sq; rows r ≥ rows of each kv head g are zero padding.
struct DecodeShape {
  std::int64_t d, dv, bc, dv_pad;
  std::int64_t d_span;            // a Q row in a panel: whole pairs
  std::int64_t hkv, group, rows;  // rows: a kv head's real rows, group · seqlen_q
  std::int64_t rows4, all_rows;   // a kv head's rows in fours (or its one or two); every kv head's
  std::int64_t k_head, v_head;    // bytes from one kv head's row of a key to the next's
  std::int64_t k_row, v_row;      // bytes of a K and a V row
  ForwardWorkItem item;

  DecodeShape(const ForwardParams& prm, std::int64_t index) : item(prm.plan.work_item(prm.problem, index)) {
    const AttentionProblem& p = prm.problem;
    d = p.head_dim;
    dv = p.head_dim_v;
    bc = prm.plan.block_k;
    dv_pad = prm.plan.head_dim_v_padded;
    d_span = (d + kPair - 1) / kPair * kPair;
    hkv = p.heads_kv;
    group = p.heads_q / hkv;
    rows = group * p.seqlen_q;
    rows4 = prm.plan.block_q;
    all_rows = hkv * rows4;
    const auto elem = static_cast<std::int64_t>(dtype_size(prm.k.dtype));
    k_head = prm.k.strides[2] * elem;
    v_head = prm.v.strides[2] * elem;
    k_row = d * elem;
    v_row = dv * elem;
  }
};

// Row r of kv head g's rows, times softmax_scale·log2e, into dst (d floats).
HWY_INLINE void LoadQRow(const ForwardParams& prm, const DecodeShape& sh, std::int64_t g, std::int64_t r, float* dst) {
  const AttentionProblem& p = prm.problem;
  LoadRow(RowPointer(prm.q, sh.item.batch, r % p.seqlen_q, g * sh.group + r / p.seqlen_q), p.dtype, sh.d,
          p.softmax_scale * OnlineSoftmaxState::kLog2e, dst);
}

// The Q panels (decode): each four rows of a kv head (or its one or two: ScoreKeys) form a
// ScoreKeys panel (4 · d_span floats, or rows4 · d_span) in the q tile, (heads_kv · rows4,
// d_span), zeros past d and in the padding rows.
template <KvFormat F>
void LoadQPanels(const ForwardParams& prm, ForwardWorkspace& ws, const DecodeShape& sh) {
  const std::int64_t d = sh.d, d_span = sh.d_span, pr = std::min<std::int64_t>(sh.rows4, 4);  // a panel's rows
  float* q_panels = ws.q_tile.get();
  float* q_row = ws.q_rows.get();  // one row in row order, loaded
  // Every real row's d_span values are written below (the ragged pair with its zeros): only
  // padding rows, which share their panels' vectors with real ones, need the zeros first.
  if (sh.rows < sh.rows4) std::fill(q_panels, q_panels + sh.all_rows * d_span, 0.0f);
  for (std::int64_t g = 0; g < sh.hkv; ++g)
    for (std::int64_t r = 0; r < sh.rows; ++r) {
      LoadQRow(prm, sh, g, r, q_row);
      float* panel = q_panels + (g * sh.rows4 + r / pr * pr) * d_span + r % pr * kLanes;
      std::int64_t e = 0;
#if HWY_TARGET != HWY_SCALAR
      const DF df;
      for (; e + kPair <= d; e += kPair) {  // whole pairs: a vector each, in PairIndex's order
        const VF lo = hn::LoadU(df, q_row + e), hi = hn::LoadU(df, q_row + e + kLanes);
        hn::StoreU(kEvenOdd<F> ? hn::ConcatEven(df, hi, lo) : lo, df, panel + pr * e);
        hn::StoreU(kEvenOdd<F> ? hn::ConcatOdd(df, hi, lo) : hi, df, panel + pr * e + pr * kLanes);
      }
#endif
      for (; e < d; e += kPair)
        for (std::int64_t half = 0; half < 2; ++half)
          for (std::int64_t i = 0; i < kLanes; ++i) {
            const std::int64_t x = e + (e + kPair <= d ? PairIndex<F>(half, i) : half * kLanes + i);
            panel[pr * e + half * pr * kLanes + i] = x < d ? q_row[x] : 0.0f;
          }
    }
}

// The products of decode_fp16 (half precision) and decode_bf16 (bf16 dot products): the same
// interface, each over 16-bit Q panels of four rows (fp16_decode.hpp, bf16_decode.hpp).
struct NarrowProducts {
  int (*q_exponent)(KvCodes);  // Q rows are brought below 2^q_exponent
  int (*p_exponent)(KvCodes);  // P·factor to at most 2^p_exponent
  void (*pack_q4)(const float*, std::int64_t, std::int64_t, std::int64_t, int, std::uint16_t*, float*);
  void (*score_keys4)(KvCodes, const std::uint16_t*, std::int64_t, std::int64_t, const unsigned char* const*,
                      std::int64_t, std::int64_t, std::int64_t, float*, std::int64_t, const fp16dot::Fetch&);
  void (*pair)(const float*, std::uint32_t*, std::int64_t);  // P as accumulate_rows4 reads it, in place
  void (*accumulate_rows4)(KvCodes, const std::uint32_t*, std::int64_t, const unsigned char* const*, std::int64_t,
                           std::int64_t, std::int64_t, float, float*, std::int64_t);
  // The scores of int8 K codes on int8dot's integer products instead (DecodeQuantItem).
  bool int8_scores_on_vnni;
};
static_assert(fp16dot::kHalves == bf16decode::kPanelLanes, "one panel layout for both");
constexpr NarrowProducts kFp16Products{
    [](KvCodes c) { return fp16dot::q_exponent(c); }, [](KvCodes c) { return fp16dot::p_exponent(c); },
    &fp16dot::PackQ4, &fp16dot::ScoreKeys4, &fp16dot::PairHalves, &fp16dot::AccumulateRows4, false};
// bf16's int8 scores widened every code to float32 and narrowed it to bf16 (seven
// instructions a vector, for four products): on int8dot's VPDPBUSD, with none, the
// Sapphire Rapids of docs/performance.md ran decode_bf16 over int8 caches 18–23% faster at
// 4096 tokens, 6–10% at 32768 (thirtieth session); decode_fp16's two (a widening, a
// conversion) stay its own.
constexpr NarrowProducts kBf16Products{
    [](KvCodes) { return bf16decode::kTop; }, [](KvCodes) { return bf16decode::kTop; },
    &bf16decode::PackQ4, &bf16decode::ScoreKeys4, &bf16decode::PairKeys, &bf16decode::AccumulateRows4, true};

// The Q panels (decode_fp16, decode_bf16): each four rows packed to 16 bits in the q tile
// (pack_q4), each row scaled by a power of two below 2^top that its q unit undoes on the scores.
void PackQNarrow(const ForwardParams& prm, ForwardWorkspace& ws, const DecodeShape& sh, const NarrowProducts& np,
                 int top) {
  const std::int64_t d = sh.d;
  const std::int64_t panel_halves = 4 * ((d + fp16dot::kHalves - 1) / fp16dot::kHalves) * fp16dot::kHalves;
  auto* q_halves = reinterpret_cast<std::uint16_t*>(ws.q_tile.get());  // (panels, panel_halves)
  float* q_rows = ws.q_rows.get();  // a panel's four rows in row order, loaded
  for (std::int64_t i = 0; i < sh.all_rows / 4; ++i) {
    const std::int64_t g = 4 * i / sh.rows4, r0 = 4 * i % sh.rows4;
    const std::int64_t live = std::clamp<std::int64_t>(sh.rows - r0, 0, 4);
    for (std::int64_t r = r0; r < r0 + live; ++r) LoadQRow(prm, sh, g, r, q_rows + (r - r0) * d);
    np.pack_q4(q_rows, d, live, d, top, q_halves + i * panel_halves, ws.q_units.get() + 4 * i);
  }
}

// S columns [c, c + 4) = Q·k_(j0+c+i) of every kv head's rows, for the block's n keys. The K
// and V rows of the keys kDecodePrefetchKeys ahead (of `ahead` resolved) are fetched, a kv
// head's rows beside its scores, so that the fetches spread out: four keys read at once
// interleave four streams, which the hardware prefetcher does not follow. The fetches go to
// L2 (prefetcht1), not L1: measured on the Xeon of docs/performance.md, the int8 steps at
// 32k tokens ran 10–20% faster and bf16's no slower.
template <KvFormat F>
void ScoreBlock(const ForwardParams& prm, ForwardWorkspace& ws, const DecodeShape& sh, std::int64_t n,
                std::int64_t ahead) {
  const DecodeKeys& keys = ws.decode_keys;
  const std::int64_t hkv = sh.hkv, rows4 = sh.rows4, d = sh.d, d_span = sh.d_span, bc = sh.bc;
  const std::int64_t k_head = sh.k_head, v_head = sh.v_head, k_row = sh.k_row, v_row = sh.v_row;
  const DType dtype = prm.k.dtype;
  const float* q_panels = ws.q_tile.get();
  float* s_tile = ws.s_tile.get();
  for (std::int64_t c = 0; c < n; c += 4) {
    const std::int64_t count = std::min<std::int64_t>(4, n - c);
    const std::int64_t fetch_end = std::min(c + count + kDecodePrefetchKeys, ahead);
    const unsigned char* krows[4];
    for (std::int64_t i = 0; i < count; ++i) krows[i] = keys.k[c + i];
    const float* panel = q_panels;
    float* s = s_tile + c;
    for (std::int64_t g = 0; g < hkv; ++g) {
      for (std::int64_t i = c + kDecodePrefetchKeys; i < fetch_end; ++i) {
        for (std::int64_t off = 0; off < k_row; off += kCacheLineBytes) __builtin_prefetch(keys.k[i] + g * k_head + off, 0, 2);
        for (std::int64_t off = 0; off < v_row; off += kCacheLineBytes) __builtin_prefetch(keys.v[i] + g * v_head + off, 0, 2);
      }
      if (kFewRows<F> && rows4 < 4) {  // one or two rows, a panel of their own
        if constexpr (kFewRows<F>) {
          if (rows4 == 1)
            ScoreKeys<F, 1>(panel, krows, count, d, dtype, s, bc);
          else
            ScoreKeys<F, 2>(panel, krows, count, d, dtype, s, bc);
        }
        panel += rows4 * d_span;
        s += rows4 * bc;
      } else {
        for (std::int64_t r = 0; r < rows4; r += 4, panel += 4 * d_span, s += 4 * bc)
          ScoreKeys<F, 4>(panel, krows, count, d, dtype, s, bc);
      }
      for (std::int64_t i = 0; i < count; ++i) krows[i] += k_head;
    }
  }
}

// ScoreBlock on the narrow products on K codes of format `codes`: they prefetch as ScoreBlock
// does.
void ScoreBlockNarrow(ForwardWorkspace& ws, const DecodeShape& sh, const NarrowProducts& np, KvCodes codes,
                      std::int64_t n, std::int64_t ahead) {
  const DecodeKeys& keys = ws.decode_keys;
  const auto* q_halves = reinterpret_cast<const std::uint16_t*>(ws.q_tile.get());
  for (std::int64_t c = 0; c < n; c += 4) {
    const std::int64_t count = std::min<std::int64_t>(4, n - c);
    const std::int64_t fetch_end = std::min(c + count + kDecodePrefetchKeys, ahead);
    const unsigned char* krows[4];
    for (std::int64_t i = 0; i < count; ++i) krows[i] = keys.k[c + i];
    const fp16dot::Fetch fetch{keys.k.data() + c + kDecodePrefetchKeys, keys.v.data() + c + kDecodePrefetchKeys,
                               std::max<std::int64_t>(0, fetch_end - c - kDecodePrefetchKeys), sh.k_row, sh.v_row,
                               sh.v_head};
    np.score_keys4(codes, q_halves, sh.all_rows / 4, sh.rows4 / 4, krows, sh.k_head, count, sh.d,
                        ws.s_tile.get() + c, sh.bc, fetch);
  }
}

// FP8: Q·(values·descale) = (Q·values read)·(kKvUnit·descale), on kv head g's real rows;
// q_units (the narrow products', else null) also undoes each row's Q scaling. With r =
// kKvUnit·unit, a power of two, the score is (S·descale)·r where r ≥ 1 and S·(descale·r)
// where r < 1: the same bits either way, but neither product passes float32's largest unless
// the score does — kKvUnit·descale alone does for descales above 2^120, which an append of
// values near float32's largest chooses, and S·q unit for Q near it.
HWY_INLINE void DescaleScores(const ForwardParams& prm, ForwardWorkspace& ws, const DecodeShape& sh, std::int64_t g,
                   std::int64_t n, std::int64_t cols, const float* q_units) {
  constexpr float kUnit = kKvUnit<KvFormat::e4m3>;
  const std::int64_t descale_head = prm.paged.k.head_stride;
  float* factor = ws.descales.get();
  const DecodeKeys& keys = ws.decode_keys;
  for (std::int64_t c = 0; c < cols; ++c) factor[c] = c < n ? keys.k_descale[c][g * descale_head] : 0.0f;
  for (std::int64_t r = 0; r < sh.rows; ++r) {
    float* srow = ws.s_tile.get() + (g * sh.rows4 + r) * sh.bc;
    // q units are powers of two of at most 2^126 (RowShift), so r is one of at most 2^134:
    // as two factors, each within float32's range.
    const float unit = q_units != nullptr ? q_units[g * sh.rows4 + r] : 1.0f;
    const bool up = unit * kUnit >= 1.0f;
    const VF r1 = hn::Set(DF(), unit), r2 = hn::Set(DF(), kUnit);
    for (std::int64_t c = 0; c < n; c += kLanes) {
      const VF s = hn::Load(DF(), srow + c), f = hn::Load(DF(), factor + c);
      hn::Store(up ? hn::Mul(hn::Mul(hn::Mul(s, f), r1), r2) : hn::Mul(s, hn::Mul(hn::Mul(f, r1), r2)), DF(), srow + c);
    }
  }
}

// FP8: the block's V descales of kv head g (0 past n) into ws.descales.
HWY_INLINE void LoadVDescales(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t g, std::int64_t n, std::int64_t cols) {
  const std::int64_t descale_head = prm.paged.v.head_stride;
  float* factor = ws.descales.get();
  for (std::int64_t c = 0; c < cols; ++c) factor[c] = c < n ? ws.decode_keys.v_descale[c][g * descale_head] : 0.0f;
}

// x[c] *= y[c] for c < cols (a whole number of vectors).
HWY_INLINE void MulRow(float* HWY_RESTRICT x, const float* HWY_RESTRICT y, std::int64_t cols) {
  for (std::int64_t c = 0; c < cols; c += kLanes)
    hn::Store(hn::Mul(hn::Load(DF(), x + c), hn::Load(DF(), y + c)), DF(), x + c);
}

// x[c] *= scale for c < cols (a whole number of vectors).
HWY_INLINE void ScaleRow(float* HWY_RESTRICT x, float scale, std::int64_t cols) {
  for (std::int64_t c = 0; c < cols; c += kLanes)
    hn::Store(hn::Mul(hn::Load(DF(), x + c), hn::Set(DF(), scale)), DF(), x + c);
}

// The float32 products' P·V over a quantized V: P·factor (P up to 2^8 under the rescale
// threshold, the factor a V scale or descale) times the codes read (|code − 128| ≤ 128 for
// int8, 2^-8·value for e4m3). For factors near float32's largest — which appends of values
// near it choose, or a caller's scales — those products overflow where the values do not.
// So each kv head's factors are taken ws.v_units[g] times (1, or a power of two below 1 from
// the first block whose largest factor passes 2^kVFactorTop on), õ of its rows held in those
// units: a head whose unit falls has its õ rescaled; FinishVUnits multiplies it back at the
// end. Caches of ordinary scales never leave unit 1: the same bits as without.
constexpr int kVFactorTop = 100;

HWY_INLINE void StartVUnits(ForwardWorkspace& ws, const DecodeShape& sh) {
  std::fill(ws.v_units.get(), ws.v_units.get() + sh.hkv, 1.0f);
}

// The unit of kv head g's V factors (cols of them) for this block; rescales õ where it falls.
HWY_INLINE float VFactorUnit(ForwardWorkspace& ws, const DecodeShape& sh, std::int64_t g, const float* factor,
                             std::int64_t cols) {
  const float most = *std::max_element(factor, factor + cols);
  int exponent = 0;
  std::frexp(most, &exponent);  // most < 2^exponent
  const float unit = std::ldexp(1.0f, -std::max(0, exponent - kVFactorTop));
  float& held = ws.v_units[g];
  if (unit < held) {
    for (std::int64_t r = g * sh.rows4; r < g * sh.rows4 + sh.rows; ++r)
      ScaleRow(ws.o_acc.get() + r * sh.dv_pad, unit / held, sh.dv_pad);
    held = unit;
  }
  return held;
}

// õ of every real row back from its head's unit, times `unit` (kKvUnit for e4m3 values read
// 2^-8 times their size: the factors leave it out, so that they overflow no sooner).
HWY_INLINE void FinishVUnits(ForwardWorkspace& ws, const DecodeShape& sh, float unit) {
  for (std::int64_t g = 0; g < sh.hkv; ++g) {
    const float factor = unit / ws.v_units[g];
    if (factor == 1.0f) continue;
    for (std::int64_t r = g * sh.rows4; r < g * sh.rows4 + sh.rows; ++r)
      ScaleRow(ws.o_acc.get() + r * sh.dv_pad, factor, sh.dv_pad);
  }
}

// Mask and online softmax of kv head g's rows over the block's keys j0.. (n, cols with
// padding); padding rows get no probability mass. `finish(srow)` then turns each real row's
// P into what the P·V step reads. With `narrow` products P must stay ≤ 1 (their power of two
// keeps P·factor ≤ 2^p_exponent, fp16_decode.hpp: a P of 2^8 under the problem's rescale
// threshold overflowed half precision), so those rows rescale at every new maximum.
template <class FinishFn>
HWY_INLINE void SoftmaxRows(const ForwardParams& prm, ForwardWorkspace& ws, const DecodeShape& sh, std::int64_t g, std::int64_t j0,
                 std::int64_t n, std::int64_t cols, bool narrow, FinishFn finish) {
  const AttentionProblem& p = prm.problem;
  for (std::int64_t r = 0; r < sh.rows4; ++r) {
    float* srow = ws.s_tile.get() + (g * sh.rows4 + r) * sh.bc;
    if (r >= sh.rows) {
      std::fill(srow, srow + cols, 0.0f);
      continue;
    }
    std::fill(srow + n, srow + cols, 0.0f);
    const std::int64_t row = g * sh.rows4 + r, i = r % p.seqlen_q;
    const RowMods mods(p, prm.internals, prm.alibi_slopes, prm.block_mask, prm.attn_mask, prm.attn_mask_blocks,
                       prm.score_hook, sh.item.batch, g * sh.group + r / p.seqlen_q);
    MaskRow(mods, srow, i, j0, n, cols);
    SoftmaxRow(mods, srow, i, j0, cols, ws.states[static_cast<std::size_t>(row)], ws.o_acc.get() + row * sh.dv_pad,
               sh.dv_pad, ws.rescales[static_cast<std::size_t>(row)], prm.switches.deferred_normalization,
               narrow ? 0.0f : p.rescale_threshold);
    finish(srow);
  }
}

// õ += P·V of the block's n keys, every kv head's rows R at a time (ScoreKeys).
template <KvFormat F, int R>
void AccumulateRows(const ForwardParams& prm, ForwardWorkspace& ws, const DecodeShape& sh, std::int64_t n) {
  const std::int64_t hkv = sh.hkv, rows4 = sh.rows4, bc = sh.bc, dv = sh.dv, dv_pad = sh.dv_pad, v_head = sh.v_head;
  const DType dtype = prm.v.dtype;
  const float* s_tile = ws.s_tile.get();
  float* o_acc = ws.o_acc.get();
  for (std::int64_t g = 0; g < hkv; ++g)
    for (std::int64_t r = g * rows4; r < (g + 1) * rows4; r += R)
      for (std::int64_t e = 0; e < dv_pad; e += kPair)
        AccumulatePair<F, R>(s_tile + r * bc, bc, ws.decode_keys, g * v_head, n, e, dv, dtype,
                             o_acc + r * dv_pad + e, dv_pad);
}

template <KvFormat F>
void AccumulateBlock(const ForwardParams& prm, ForwardWorkspace& ws, const DecodeShape& sh, std::int64_t n) {
  if constexpr (kFewRows<F>) {
    if (sh.rows4 == 1) return AccumulateRows<F, 1>(prm, ws, sh, n);
    if (sh.rows4 == 2) return AccumulateRows<F, 2>(prm, ws, sh, n);
  }
  AccumulateRows<F, 4>(prm, ws, sh, n);
}

// AccumulateBlock on the narrow products on V codes of format `codes`, P as their pair step
// left it.
void AccumulateBlockNarrow(ForwardWorkspace& ws, const DecodeShape& sh, const NarrowProducts& np, KvCodes codes,
                           std::int64_t n) {
  for (std::int64_t g = 0; g < sh.hkv; ++g)
    for (std::int64_t r = g * sh.rows4; r < (g + 1) * sh.rows4; r += 4)
      np.accumulate_rows4(codes, reinterpret_cast<const std::uint32_t*>(ws.s_tile.get() + r * sh.bc), sh.bc,
                               ws.decode_keys.v.data(), g * sh.v_head, n, sh.dv, ws.v_units[g],
                               ws.o_acc.get() + r * sh.dv_pad, sh.dv_pad);
}

#if HWY_TARGET != HWY_SCALAR
// The whole pairs of an õ row back into row order, the inverse of LoadQPanels' ConcatEven
// and ConcatOdd (element 2i of a pair is lane i of its even vector, 2i + 1 lane i of its odd
// one): a 128-bit block at a time, where InterleaveLower and InterleaveUpper pair the lanes,
// every block of a pair loaded before any is stored. (Element by element through a pair on
// the stack, this was a sixth of a 16-token decode step: each vector load waited for eight
// scalar stores.)
HWY_INLINE void PairsToRowOrder(float* HWY_RESTRICT orow, std::int64_t dv) {
  const hn::Full128<float> d4;
  constexpr std::int64_t kBlocks = kLanes / 4;
  for (std::int64_t e = 0; e + kPair <= dv; e += kPair) {
    hn::Vec<decltype(d4)> even[kBlocks], odd[kBlocks];
    for (std::int64_t b = 0; b < kBlocks; ++b) {
      even[b] = hn::LoadU(d4, orow + e + 4 * b);
      odd[b] = hn::LoadU(d4, orow + e + kLanes + 4 * b);
    }
    for (std::int64_t b = 0; b < kBlocks; ++b) {
      hn::StoreU(hn::InterleaveLower(d4, even[b], odd[b]), d4, orow + e + 8 * b);
      hn::StoreU(hn::InterleaveUpper(d4, even[b], odd[b]), d4, orow + e + 8 * b + 4);
    }
  }
}
#endif

// Epilogue: every real row's output (or split partial) and lse. Rows in pair order are
// reordered first, all of them: the stores have left for the cache by the time StoreOutputRow
// reads them a vector at a time.
template <KvFormat F>
void StoreRows(const ForwardParams& prm, ForwardWorkspace& ws, const DecodeShape& sh) {
  const AttentionProblem& p = prm.problem;
#if HWY_TARGET != HWY_SCALAR
  if constexpr (kEvenOdd<F>)
    for (std::int64_t g = 0; g < sh.hkv; ++g)
      for (std::int64_t r = 0; r < sh.rows; ++r) PairsToRowOrder(ws.o_acc.get() + (g * sh.rows4 + r) * sh.dv_pad, sh.dv);
#endif
  for (std::int64_t g = 0; g < sh.hkv; ++g)
    for (std::int64_t r = 0; r < sh.rows; ++r) {
      const std::int64_t row = g * sh.rows4 + r;
      StoreOutputRow(prm, ws, sh.item.split, sh.item.batch, g * sh.group + r / p.seqlen_q, r % p.seqlen_q,
                     ws.o_acc.get() + row * sh.dv_pad, ws.states[static_cast<std::size_t>(row)],
                     ws.rescales[static_cast<std::size_t>(row)]);
    }
  ws.counters.o_written += sh.hkv * sh.rows * sh.dv;
  ws.counters.lse_written += sh.hkv * sh.rows;
}

// One decode work item, K and V in storage format F.
template <KvFormat F>
void DecodeItem(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t item) {
  const DecodeShape sh(prm, item);
  LoadQPanels<F>(prm, ws, sh);
  ResetRows(ws, sh.all_rows, sh.dv_pad);
  if constexpr (F == KvFormat::e4m3) StartVUnits(ws, sh);
  ws.counters.q_read += sh.hkv * sh.rows * sh.d;
  const std::int64_t key_end = sh.item.key_end;
  for (std::int64_t j0 = sh.item.first_block; j0 < key_end; j0 += sh.bc) {
    const std::int64_t n = std::min(sh.bc, key_end - j0), cols = (n + kLanes - 1) / kLanes * kLanes;
    const std::int64_t ahead = std::min(n + kDecodePrefetchKeys, key_end - j0);  // keys resolved
    ResolveKeys(prm, sh.item.batch, j0, ahead, ws.decode_keys);
    CountTiles(ws.counters, sh.hkv, sh.rows, n, sh.d, sh.dv);  // one (kv head, key block) tile each
    ScoreBlock<F>(prm, ws, sh, n, ahead);
    for (std::int64_t g = 0; g < sh.hkv; ++g) {
      if constexpr (F == KvFormat::e4m3) {  // P·(values·descale) = (P·kKvUnit·descale)·(values read)
        DescaleScores(prm, ws, sh, g, n, cols, nullptr);
        LoadVDescales(prm, ws, g, n, cols);  // kKvUnit is applied to õ at the end (FinishVUnits)
        ScaleRow(ws.descales.get(), VFactorUnit(ws, sh, g, ws.descales.get(), cols), cols);
        SoftmaxRows(prm, ws, sh, g, j0, n, cols, false, [&](float* srow) { MulRow(srow, ws.descales.get(), cols); });
      } else {
        SoftmaxRows(prm, ws, sh, g, j0, n, cols, false, [](float*) {});
      }
    }
    AccumulateBlock<F>(prm, ws, sh, n);
  }
  if constexpr (F == KvFormat::e4m3) FinishVUnits(ws, sh, kKvUnit<F>);
  StoreRows<F>(prm, ws, sh);
}

// A quantized pool's codes as the KvFormat that reads them: fn(integral_constant<F>).
template <class Fn>
HWY_INLINE void WithCodes(KvCodes codes, Fn fn) {
  switch (codes) {
    case KvCodes::e4m3: return fn(std::integral_constant<KvFormat, KvFormat::e4m3>());
    case KvCodes::u8: return fn(std::integral_constant<KvFormat, KvFormat::u8>());
    case KvCodes::s8: return fn(std::integral_constant<KvFormat, KvFormat::s8>());
  }
}

// ΣQ of every real row (times softmax_scale·log2e, before any rounding to half) into
// sums[row]: a zero point z of K costs a score scale·z·ΣQ.
void LoadQSums(const ForwardParams& prm, ForwardWorkspace& ws, const DecodeShape& sh, float* sums) {
  float* row = ws.q_rows.get();
  for (std::int64_t g = 0; g < sh.hkv; ++g)
    for (std::int64_t r = 0; r < sh.rows; ++r) {
      LoadQRow(prm, sh, g, r, row);
      float sum = 0.0f;
      for (std::int64_t e = 0; e < sh.d; ++e) sum += row[e];
      sums[g * sh.rows4 + r] = sum;
    }
}

// Each of the block's keys' factor and zero point for kv head g: factor[c] = unit·scale,
// zero[c] = its zero point as LoadKv reads u8 codes, z − kU8Centre (0 without zero points),
// plus `shift` (both 0 past n). (Q·codes read − ΣQ·zero)·factor is the key's score, and
// P·factor what multiplies its codes in P·V; shift: what the codes read are above LoadKv's
// (int8dot's scores read them 128 higher).
HWY_INLINE void LoadKeyFactors(const float* const* scales, const float* const* zero_points, std::int64_t head_stride,
                               float unit, float shift, std::int64_t g, std::int64_t n, std::int64_t cols,
                               float* factor, float* zero) {
  for (std::int64_t c = 0; c < cols; ++c) {
    factor[c] = c < n ? unit * scales[c][g * head_stride] : 0.0f;
    zero[c] = c < n ? (zero_points[c] != nullptr ? zero_points[c][g * head_stride] - kU8Centre : 0.0f) + shift : 0.0f;
  }
}

// The power of two that P·factor is multiplied by (the narrow products): it brings the largest
// of the block's `cols` factors (V descales or scales, > 0) to at most 2^top, so P·factor is
// at most 2^top in half precision or bf16 — for every finite factor: the exponent is within
// ±126 (a normal float and its inverse), as RowShift's.
float NarrowVScale(const float* factors, std::int64_t cols, int top) {
  VF largest = hn::Zero(DF());
  for (std::int64_t c = 0; c < cols; c += kLanes) largest = hn::Max(largest, hn::Load(DF(), factors + c));
  int exponent = 0;
  const float most = hn::GetLane(hn::MaxOfLanes(DF(), largest));
  if (most > 0.0f && std::isfinite(most)) std::frexp(most, &exponent);  // most < 2^exponent
  return std::ldexp(1.0f, std::clamp(top - exponent, -126, 126));
}

// One decode work item on a cache with int8 codes in K or V (the other pool may be e4m3), each
// read in its own format (ScoreBlock and AccumulateBlock of its KvFormat; with `narrow`, the
// narrow products of its codes), then:
//   S = Q·((code − z)·scale)    = (Q·code − ΣQ·z)·scale                (per key: LoadKeyFactors)
//   õ += P·((code − z)·scale)  = (P·scale)·code − Σ_keys (P·scale)·z   (per row: one term)
// with kKvUnit in the factors of an e4m3 pool, whose z is 0. The narrow products also undo
// each Q row's power of two on its scores (q units) and P·scale's on the P·V sums (v units),
// as DecodeNarrowItem does. decode_bf16's scores of int8 K codes run on int8dot's integer
// products, which read the codes 128 higher: ΣQ·128 more comes off each score.
void DecodeQuantItem(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t item, const NarrowProducts* narrow) {
  const KvScales& ks = prm.paged.k;
  const KvScales& vs = prm.paged.v;
  const float k_unit = ks.codes == KvCodes::e4m3 ? kKvUnit<KvFormat::e4m3> : 1.0f;
  const float v_unit = vs.codes == KvCodes::e4m3 ? kKvUnit<KvFormat::e4m3> : 1.0f;
  const bool int8_scores = narrow != nullptr && narrow->int8_scores_on_vnni && ks.codes != KvCodes::e4m3;
  NarrowProducts products;
  if (int8_scores) {  // P·V stays the narrow kernel's
    products = *narrow;
    products.q_exponent = [](KvCodes) { return int8dot::kTop; };
    products.pack_q4 = &int8dot::PackQ4;
    products.score_keys4 = &int8dot::ScoreKeys4;
    narrow = &products;
  }
  const bool q_sums_needed = ks.zero_point != nullptr || int8_scores;
  // An e4m3 K without the narrow products: its scores take kKvUnit after the descale, as
  // DescaleScores's (e4m3 has no zero points, so the ΣQ term is zero).
  const float k_first = narrow != nullptr ? k_unit : 1.0f, k_after = narrow != nullptr ? 1.0f : k_unit;
  const float k_shift = int8_scores ? static_cast<float>(kU8Centre) : 0.0f;
  const DecodeShape sh(prm, item);
  if (narrow != nullptr)
    PackQNarrow(prm, ws, sh, *narrow, narrow->q_exponent(ks.codes));
  else
    LoadQPanels<KvFormat::u8>(prm, ws, sh);  // row order, as every byte format reads
  const float* q_units = narrow != nullptr ? ws.q_units.get() : nullptr;  // (all_rows): PackQNarrow's
  float* q_sums = ws.q_units.get() + sh.all_rows;            // (all_rows): ΣQ of each row
  float* v_terms = q_sums + sh.all_rows;                     // (all_rows): what V's zero points take from õ
  if (q_sums_needed) LoadQSums(prm, ws, sh, q_sums);
  float* k_factor = ws.descales.get();  // (block_k) each
  float* k_zero = k_factor + sh.bc;
  float* v_factor = k_zero + sh.bc;
  float* v_zero = v_factor + sh.bc;
  float* k_zero_factor = v_zero + sh.bc;  // the narrow products' zero·factor
  ResetRows(ws, sh.all_rows, sh.dv_pad);
  if (narrow == nullptr) StartVUnits(ws, sh);
  ws.counters.q_read += sh.hkv * sh.rows * sh.d;
  const std::int64_t key_end = sh.item.key_end;
  const DecodeKeys& keys = ws.decode_keys;
  for (std::int64_t j0 = sh.item.first_block; j0 < key_end; j0 += sh.bc) {
    const std::int64_t n = std::min(sh.bc, key_end - j0), cols = (n + kLanes - 1) / kLanes * kLanes;
    const std::int64_t ahead = std::min(n + kDecodePrefetchKeys, key_end - j0);  // keys resolved
    ResolveKeys(prm, sh.item.batch, j0, ahead, ws.decode_keys);
    CountTiles(ws.counters, sh.hkv, sh.rows, n, sh.d, sh.dv);
    if (narrow != nullptr)
      ScoreBlockNarrow(ws, sh, *narrow, ks.codes, n, ahead);
    else
      WithCodes(ks.codes, [&](auto f) { ScoreBlock<decltype(f)::value>(prm, ws, sh, n, ahead); });
    for (std::int64_t g = 0; g < sh.hkv; ++g) {
      LoadKeyFactors(keys.k_descale.data(), keys.k_zero_point.data(), ks.head_stride, k_first, k_shift, g, n, cols,
                     k_factor, k_zero);
      // Narrow products: S·(q unit·factor) − ΣQ·(zero·factor): the small factors first, so
      // that a product of the narrow sums (up to 2^15) and a q unit (up to 2^126) never
      // overflows before the scale takes it back (q·softmax_scale near float32's largest gave inf).
      if (narrow != nullptr) {
        std::copy(k_zero, k_zero + cols, k_zero_factor);
        MulRow(k_zero_factor, k_factor, cols);
      }
      for (std::int64_t r = 0; r < sh.rows; ++r) {
        const std::int64_t row = g * sh.rows4 + r;
        float* srow = ws.s_tile.get() + row * sh.bc;
        const VF q_sum = hn::Set(DF(), q_sums_needed ? q_sums[row] : 0.0f);
        const VF q_unit = hn::Set(DF(), q_units != nullptr ? q_units[row] : 1.0f);
        if (narrow != nullptr) {
          for (std::int64_t c = 0; c < cols; c += kLanes) {
            const VF unit_factor = hn::Mul(q_unit, hn::Load(DF(), k_factor + c));
            hn::Store(hn::NegMulAdd(q_sum, hn::Load(DF(), k_zero_factor + c), hn::Mul(hn::Load(DF(), srow + c), unit_factor)),
                      DF(), srow + c);
          }
          continue;
        }
        // float32 products (no q unit): (S − ΣQ·zero)·factor·k_after, the codes' sum before
        // the scale — (code − 128)·scale and (zero − 128)·scale alone pass float32's largest
        // for scales above 2^120 / 128 where (code − zero)·scale does not.
        const VF after = hn::Set(DF(), k_after);
        for (std::int64_t c = 0; c < cols; c += kLanes) {
          const VF codes = hn::NegMulAdd(q_sum, hn::Load(DF(), k_zero + c), hn::Load(DF(), srow + c));
          hn::Store(hn::Mul(hn::Mul(codes, hn::Load(DF(), k_factor + c)), after), DF(), srow + c);
        }
      }
      LoadKeyFactors(keys.v_descale.data(), keys.v_zero_point.data(), vs.head_stride, narrow != nullptr ? v_unit : 1.0f,
                     0.0f, g, n, cols, v_factor, v_zero);
      // Narrow products: P·factor·2^u ≤ 2^p_exponent; the sums are multiplied back by 2^-u.
      const float v_scale = narrow != nullptr ? NarrowVScale(v_factor, cols, narrow->p_exponent(vs.codes)) : 1.0f;
      if (narrow != nullptr) {
        ScaleRow(v_factor, v_scale, cols);
        ws.v_units[g] = 1.0f / v_scale;
      } else {
        ScaleRow(v_factor, VFactorUnit(ws, sh, g, v_factor, cols), cols);
      }
      SoftmaxRows(prm, ws, sh, g, j0, n, cols, narrow != nullptr, [&](float* srow) {
        MulRow(srow, v_factor, cols);
        if (vs.zero_point != nullptr) {
          VF sum = hn::Zero(DF());
          for (std::int64_t c = 0; c < cols; c += kLanes)
            sum = hn::MulAdd(hn::Load(DF(), srow + c), hn::Load(DF(), v_zero + c), sum);
          v_terms[(srow - ws.s_tile.get()) / sh.bc] = hn::GetLane(hn::SumOfLanes(DF(), sum)) / v_scale;
        }
        if (narrow != nullptr) narrow->pair(srow, reinterpret_cast<std::uint32_t*>(srow), cols);  // in place
      });
    }
    if (narrow != nullptr)
      AccumulateBlockNarrow(ws, sh, *narrow, vs.codes, n);
    else
      WithCodes(vs.codes, [&](auto f) { AccumulateBlock<decltype(f)::value>(prm, ws, sh, n); });
    if (vs.zero_point != nullptr)
      for (std::int64_t g = 0; g < sh.hkv; ++g)
        for (std::int64_t r = g * sh.rows4; r < g * sh.rows4 + sh.rows; ++r) {
          float* orow = ws.o_acc.get() + r * sh.dv_pad;
          const float term = v_terms[r];
          for (std::int64_t e = 0; e < sh.dv; ++e) orow[e] -= term;
        }
  }
  if (narrow == nullptr) FinishVUnits(ws, sh, v_unit);  // v_unit: an e4m3 V's kKvUnit, as DecodeItem's
  StoreRows<KvFormat::u8>(prm, ws, sh);
}

// One decode_fp16 or decode_bf16 work item: DecodeItem's steps on an FP8 cache with the
// narrow products. P·(values·descale) = (P·descale·2^u)·(values read) with 2^u from
// NarrowVScale, and kKvUnit·2^-u applied to the float32 sums (v_units).
void DecodeNarrowItem(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t item, const NarrowProducts& np) {
  constexpr KvFormat F = KvFormat::e4m3;
  const DecodeShape sh(prm, item);
  PackQNarrow(prm, ws, sh, np, np.q_exponent(KvCodes::e4m3));
  ResetRows(ws, sh.all_rows, sh.dv_pad);
  ws.counters.q_read += sh.hkv * sh.rows * sh.d;
  const std::int64_t key_end = sh.item.key_end;
  for (std::int64_t j0 = sh.item.first_block; j0 < key_end; j0 += sh.bc) {
    const std::int64_t n = std::min(sh.bc, key_end - j0), cols = (n + kLanes - 1) / kLanes * kLanes;
    const std::int64_t ahead = std::min(n + kDecodePrefetchKeys, key_end - j0);  // keys resolved
    ResolveKeys(prm, sh.item.batch, j0, ahead, ws.decode_keys);
    CountTiles(ws.counters, sh.hkv, sh.rows, n, sh.d, sh.dv);
    ScoreBlockNarrow(ws, sh, np, KvCodes::e4m3, n, ahead);
    for (std::int64_t g = 0; g < sh.hkv; ++g) {
      DescaleScores(prm, ws, sh, g, n, cols, ws.q_units.get());
      LoadVDescales(prm, ws, g, n, cols);
      const float v_scale = NarrowVScale(ws.descales.get(), cols, np.p_exponent(KvCodes::e4m3));
      ws.v_units[g] = kKvUnit<F> / v_scale;
      ScaleRow(ws.descales.get(), v_scale, cols);
      SoftmaxRows(prm, ws, sh, g, j0, n, cols, true, [&](float* srow) {
        MulRow(srow, ws.descales.get(), cols);
        np.pair(srow, reinterpret_cast<std::uint32_t*>(srow), cols);  // in place
      });
    }
    AccumulateBlockNarrow(ws, sh, np, KvCodes::e4m3, n);
  }
  StoreRows<F>(prm, ws, sh);
}

void ForwardDecodeItem(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t item) {
  switch (prm.k.dtype) {
    case DType::f32: return DecodeItem<KvFormat::f32>(prm, ws, item);
    case DType::bf16: return DecodeItem<KvFormat::bf16>(prm, ws, item);
    case DType::f16: return DecodeItem<KvFormat::f16>(prm, ws, item);
    case DType::u8:
      if (prm.internals.int8_kv_cache) return DecodeQuantItem(prm, ws, item, nullptr);
      return DecodeItem<KvFormat::e4m3>(prm, ws, item);
    case DType::i32: return;  // never an attention operand: rejected by validation
  }
}

// decode_fp16 and decode_bf16 read quantized caches only (the plan checks); a hand-made plan
// on another cache runs decode.
void ForwardDecodeNarrowItem(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t item,
                             const NarrowProducts& np) {
  if (prm.k.dtype != DType::u8) return ForwardDecodeItem(prm, ws, item);
  if (prm.internals.int8_kv_cache) return DecodeQuantItem(prm, ws, item, &np);
  DecodeNarrowItem(prm, ws, item, np);
}

void ForwardDecodeFp16Item(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t item) {
  ForwardDecodeNarrowItem(prm, ws, item, kFp16Products);
}

void ForwardDecodeBf16Item(const ForwardParams& prm, ForwardWorkspace& ws, std::int64_t item) {
  ForwardDecodeNarrowItem(prm, ws, item, kBf16Products);
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace flashattn::cpu {

HWY_EXPORT(ForwardDecodeItem);
HWY_EXPORT(ForwardDecodeFp16Item);
HWY_EXPORT(ForwardDecodeBf16Item);

ForwardWorkItemFn decode_work_item_kernel(ForwardKernel kernel, bool avx2) {
  kernel_geometry();  // the first dispatched call picks the target; then the table is direct
  if (avx2) {
    // A hand-made plan naming it where avx2_kernel_geometry() is nullopt: never an illegal instruction.
    if (kernel != ForwardKernel::decode || !avx2_kernel_geometry())
      throw Error(std::string("plan: avx2_decode with kernel ") + to_string(kernel) +
                  " needs the decode kernel and a compiled, enabled AVX2 target this CPU runs");
#if HWY_TARGETS & HWY_AVX2
    return &N_AVX2::ForwardDecodeItem;
#endif
  }
  if (kernel == ForwardKernel::decode_fp16) {
    if (!fp16dot::available())  // as for tiled_bf16: never an illegal instruction
      throw Error("kernel decode_fp16: this CPU (AVX512-FP16) cannot run it");
    return &HWY_DYNAMIC_DISPATCH(ForwardDecodeFp16Item);
  }
  if (kernel == ForwardKernel::decode_bf16) {
    if (!bf16decode::available())
      throw Error("kernel decode_bf16: this CPU (AVX512-BF16) cannot run it");
    return &HWY_DYNAMIC_DISPATCH(ForwardDecodeBf16Item);
  }
  return &HWY_DYNAMIC_DISPATCH(ForwardDecodeItem);
}

}  // namespace flashattn::cpu
#endif  // HWY_ONCE
