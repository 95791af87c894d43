// Internal interface between the CPU backward driver (backward.cpp) and the per-SIMD-
// target kernel (tiled_backward.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <atomic>
#include <mutex>
#include <vector>

#include <hwy/aligned_allocator.h>

#include "flashattn/counters.hpp"
#include "flashattn/plan.hpp"
#include "flashattn/problem.hpp"
#include "flashattn/tensor.hpp"
#include "src/core/problem_internals.hpp"
#include "src/cpu/kernels/mask_blocks.hpp"
#include "src/cpu/kernels/packed_head.hpp"
#include "src/cpu/kernels/strip_keys.hpp"

namespace flashattn::cpu {

struct BackwardParams {
  AttentionProblem problem;
  detail::ProblemInternals internals;  // a sequence's batch index
  CpuBackwardPlan plan;
  TensorView dout, q, k, v, out, lse;
  MutableTensorView dq, dk, dv;
  TensorView alibi_slopes, block_mask;  // from the options; empty when unused
  TensorView attn_mask;                 // from the options; empty when unused
  DenseMaskBlocks attn_mask_blocks;     // a boolean attn_mask's tiles (the driver's summary)
  ScoreHook score_hook;                 // from the options; apply null when unused
  TensorView sinks;                     // from the options; empty when unused
  TensorView dlse;                      // from the options; empty when unused
  float* delta = nullptr;     // (batch, heads_q, seqlen_q): D = rowsum(dO ∘ O) − dlse
  // (batch, heads_q, seqlen_q), filled with delta: each row's exp2 offset of P in two parts,
  // P = 2^((S' − lse2) − lse2_low) — lse·log2e and 0, or, where float32 cannot hold the lse
  // to the precision P needs, the row's maximum score and log2 ℓ (BackwardDelta).
  float* lse2 = nullptr;
  float* lse2_low = nullptr;
  float* dq_accum = nullptr;  // (batch, heads_q, seqlen_q, head_dim_padded), float32
  // Default mode: kDqLockStripes locks over the Q tiles of dq_accum; tiles add in any order.
  std::mutex* dq_locks = nullptr;
  // Deterministic mode: one ticket per (batch, head, q block) holding the next K/V block
  // allowed to add its share, so every Q tile sums its shares in K/V-block order.
  std::atomic<std::int64_t>* dq_tickets = nullptr;
  // options.dbias (float32, attn_mask's shape, zeroed by the driver); null data when not
  // requested. dbias_shared: work items add into the same elements (dbias broadcast over the
  // batch, over heads of several kv heads, or over the keys of several K/V blocks), so each
  // item sums its share in its workspace's dbias_tile and adds it in a fixed order: with
  // dbias_in_item_order (keys broadcast), one ticket holding the next work item allowed to
  // add (items are claimed in increasing order, so the wait ends); else dbias_tickets[k
  // block] holding the next batch·heads_kv + kv head allowed to add.
  MutableTensorView dbias;
  bool dbias_shared = false;
  bool dbias_in_item_order = false;
  std::atomic<std::int64_t>* dbias_tickets = nullptr;
};

// Is lse·log2e (float32) so large that the backward recomputes the row's exp2 offset from its
// own scores (BackwardDelta: BackwardParams::lse2, lse2_low)? At 2^10 a float32 lse·log2e is
// off by up to 2^-14, P by 4e-5 relative, about a naive float32 softmax's error; beyond, the
// error grows with |lse| (3e-4 at a −1e4 padding bias), and past 2^30 (a −1e9 bias on every
// key) m + log2 ℓ rounds to m, so P = 2^(S' − lse·log2e) sums to ℓ, not 1. Only rows with
// |lse| ≥ 710 qualify: a large bias or score_mod constant on every key the row sees, or
// scores as large.
inline bool IsLargeLse2(float lse2) { return std::abs(lse2) >= 1024.0f && std::isfinite(lse2); }

// The large rows of one (batch, head): `count` ≤ kLargeRowsPerItem row indices from `rows`.
// The driver finds them in the forward's lse before its threads start and hands them out as
// work items of their own (BackwardLargeRowsFn), so that a head whose every row is large
// spreads over every thread; the kernel recomputes them 8·micro_rows at a time.
inline constexpr std::int64_t kLargeRowsPerItem = 64;
struct LargeRowItem {
  std::int64_t batch_head = 0;
  const std::int64_t* rows = nullptr;
  std::int64_t count = 0;
};

// One work item's share of a shared dbias (BackwardParams::dbias_shared): (planes, rows,
// cols) with planes its q heads (1 where dbias broadcasts over heads), rows seqlen_q (or 1)
// and cols block_k (or 1), float32, contiguous.
struct DbiasTileShape {
  std::int64_t planes = 0, rows = 0, cols = 0;
  DbiasTileShape(const CpuBackwardPlan& plan, const AttentionProblem& p, const TensorView& dbias)
      : planes(dbias.shape[1] > 1 ? p.heads_q / p.heads_kv : 1), rows(dbias.shape[2]),
        cols(dbias.shape[3] > 1 ? plan.block_k : 1) {}
  std::int64_t size() const { return planes * rows * cols; }
};

// Striped locks guard the dQ accumulator in the default mode: enough stripes that two
// threads rarely meet, few enough to cost nothing to create.
inline constexpr std::int64_t kDqLockStripes = 1024;

// The float32 backward's B operands — the Q and dO tiles (dK += dSᵀ·Q', dV += Pᵀ·dO), the
// packed K rows (dQ += dS·K), Kᵀ and Vᵀ (S' = Q'·Kᵀ, dP = dO·Vᵀ) — are read a row per depth
// step: rows of 128 floats (D_pad or block_k), 512 B, 8 lines, fall in 8 of L1's 64 sets
// and evict each other within a micro-tile's panel. One vector more per row (an odd number
// of lines for every multiple of 32 floats) spreads them over the sets.
inline constexpr std::int64_t kRowLdPad = 16;
inline constexpr std::int64_t RowLd(std::int64_t padded) { return padded + kRowLdPad; }

// The most rows a Q tile is padded to a multiple of (tiled_bf16's; the float32 kernel pads to
// micro_rows, and block_q is a multiple of those): a tile of at most block_q rows, padded to
// micro_rows or to a divisor of kMaxRowMultiple, has at most StripsFor(block_q, micro_rows)
// row strips.
inline constexpr std::int64_t kMaxRowMultiple = 32;
inline std::size_t StripsFor(std::int64_t block_q, std::int64_t micro_rows) {
  const std::int64_t rows = (block_q + kMaxRowMultiple - 1) / kMaxRowMultiple * kMaxRowMultiple;
  return static_cast<std::size_t>((rows + micro_rows - 1) / micro_rows);
}
// The strips of micro_rows key rows a K/V tile of block_k keys has (the float32 kernel's
// dV/dK products, BackwardWorkspace::key_strip_rows).
inline std::size_t KeyStripsFor(std::int64_t block_k, std::int64_t micro_rows) {
  return static_cast<std::size_t>((block_k + micro_rows - 1) / micro_rows);
}

// The most a thread's Q/dO copy (BackwardWorkspace::q_kept, CpuBackwardPlan::keep_q_rows)
// may take; past it the float32 kernel gathers each Q tile's rows anew for every K/V tile.
// Beyond kQCacheFreeBytes for all threads together, the copies are kept only where they take
// no more than the q and dout they copy (plan_backward).
inline constexpr std::size_t kQCacheBytes = std::size_t{64} << 20;
inline constexpr std::size_t kQCacheFreeBytes = std::size_t{16} << 20;

// Per-thread scratch, sized by the plan. Like the forward, K and V of one (batch, kv
// head) are packed once per thread and reused by that head's work items.
struct BackwardWorkspace {
  BackwardWorkspace(const CpuBackwardPlan& plan, const AttentionProblem& problem);

  hwy::AlignedFreeUniquePtr<float[]> q_tile;   // (block_q, RowLd(D_pad)): Q·scale·log2e
  hwy::AlignedFreeUniquePtr<float[]> do_tile;  // (block_q, RowLd(Dv_pad)): dO
  // The Q and dO tiles of the q heads of one (batch, kv head) as the products read them,
  // kept across the thread's work items of that kv head (CpuBackwardPlan::keep_q_rows): each
  // K/V tile reads every Q tile of its heads, and tiles converted once into this contiguous
  // copy are read from it by the next items (each converted at its first use) instead of
  // gathered again from the caller's rows, H·D apart. Tile t of the group · q_blocks tiles
  // (q head h % group, Q tile i0 / block_q) at t · block_q rows: the float32 kernel's
  // Q·scale·log2e (rows of RowLd(D_pad)) and dO (RowLd(Dv_pad)) in q_kept and do_kept,
  // tiled_bf16's LoadQ tiles (rows, then transposed) in q_kept16 and do_kept16. Empty unless
  // the plan keeps them (then LoadQ builds each tile in q_tile, do_tile or q_bf16, do_bf16).
  hwy::AlignedFreeUniquePtr<float[]> q_kept, do_kept;
  hwy::AlignedFreeUniquePtr<std::uint16_t[]> q_kept16, do_kept16;
  std::int64_t kept_kv = -1;                  // the (batch · heads_kv + kv head) kept, −1: none
  std::vector<std::uint8_t> kept_converted;   // (group · q_blocks): tile converted already
  // The current tiles, where LoadQ put them: the float32 kernel's Q' and dO rows; tiled_bf16's
  // Q and dO, each followed by its transpose at block_q · D_pad (Dv_pad).
  const float* q_rows = nullptr;
  const float* do_rows = nullptr;
  const std::uint16_t* q_pairs = nullptr;
  const std::uint16_t* do_pairs = nullptr;
  hwy::AlignedFreeUniquePtr<float[]> p_tile;   // (block_q, block_k): P
  hwy::AlignedFreeUniquePtr<float[]> ds_tile;  // (block_q, block_k): dP, then dS in place
  hwy::AlignedFreeUniquePtr<float[]> g_tile;   // (block_q, block_k): softcap's 1 − tanh²
  hwy::AlignedFreeUniquePtr<float[]> w_tile;   // (block_q, block_k): dropout weights
  hwy::AlignedFreeUniquePtr<float[]> dq_tile;  // (block_q, D_pad)
  hwy::AlignedFreeUniquePtr<float[]> dk_acc;   // (block_k, D_pad); tiled_bf16: dKᵀ, (D_pad, block_k)
  hwy::AlignedFreeUniquePtr<float[]> dv_acc;   // (block_k, Dv_pad); tiled_bf16: dVᵀ, (Dv_pad, block_k)
  hwy::AlignedFreeUniquePtr<float[]> kt_packed;  // per tile (D, RowLd(block_k)): Kᵀ
  hwy::AlignedFreeUniquePtr<float[]> vt_packed;  // per tile (Dv, RowLd(block_k)): Vᵀ
  hwy::AlignedFreeUniquePtr<float[]> k_packed;   // (k tiles · block_k, RowLd(D_pad)): K
  // (micro_cols, max(D_pad, Dv_pad)): the float32 kernel's converted V rows of one block of
  // micro_cols keys while packing (tiled_bf16: empty)
  hwy::AlignedFreeUniquePtr<float[]> row_scratch;
  // (tiled_bf16) operands of the bf16 micro-kernel (bf16_dot.hpp), pairs along each
  // product's depth; empty otherwise. Per Q tile: Q and dO as stored (rows of D_pad, Dv_pad:
  // the A operands of S and dP), each followed by its transpose (Qᵀ, dOᵀ: the A operands of
  // dKᵀ and dVᵀ, whose depth is the tile's rows), with a scratch for pairing rows; P and dS
  // paired two rows at a time (row-pair p's words of every key, 2·block_k apart: B of dVᵀ
  // and dKᵀ); dS rows (dQ's A).
  hwy::AlignedFreeUniquePtr<std::uint16_t[]> q_bf16, do_bf16;      // (2 · block_q, D_pad), (2 · block_q, Dv_pad)
  hwy::AlignedFreeUniquePtr<std::uint16_t[]> pair_scratch;         // (block_q, max(D_pad, Dv_pad))
  hwy::AlignedFreeUniquePtr<std::uint16_t[]> pt_bf16, dst_bf16;    // (block_q / 2, block_k, 2)
  hwy::AlignedFreeUniquePtr<std::uint16_t[]> ds_bf16;              // (block_q, block_k)
  hwy::AlignedFreeUniquePtr<float[]> kv_rows;  // (block_k, max(D_pad, Dv_pad)): dK or dV, key rows of dKᵀ, dVᵀ
  // Per K/V tile, as panels: K and V with pairs along the head dims (S's and dP's B: micro_cols
  // keys, (D_even / 2, micro_cols, 2) each), K with pairs of keys (dQ's B: micro_cols columns,
  // (block_k / 2, micro_cols, 2) each).
  hwy::AlignedFreeUniquePtr<std::uint16_t[]> kt_pairs, vt_pairs, k_pairs;
  // While packing: the K and V rows of one panel of micro_cols keys, as stored ((micro_cols,
  // D_pad), then (micro_cols, Dv_pad)).
  hwy::AlignedFreeUniquePtr<std::uint16_t[]> pack_rows;
  hwy::AlignedFreeUniquePtr<float[]> dbias_tile;  // (DbiasTileShape) with a shared dbias, else empty
  std::vector<float> row_lse2;      // (block_q): each row's exp2 offset (BackwardParams::lse2)
  std::vector<float> row_lse2_low;  // (block_q): its low part (BackwardParams::lse2_low)
  std::vector<float> row_delta;  // (block_q): D of each row
  // (StripsFor): each row strip's span of the current K/V tile (FindStripKeys); (KeyStripsFor):
  // the Q tile rows each strip of key rows meets (the float32 kernel)
  std::vector<StripKeys> strip_keys, key_strip_rows;
  hwy::AlignedFreeUniquePtr<float[]> delta_rows;  // (2, Dv_pad): an O row and a dO row (BackwardDelta)
  // The large-row pass's buffers (BackwardLargeRowsFn), allocated by allocate_large_rows
  // where a call has large rows, else empty: Q rows·scale·log2e (kLargeRowsPerItem,
  // RowLd(D_pad)), micro_cols K rows (micro_cols, D_pad), a tile's Kᵀ (D_pad, block_k) and
  // the group's scores (kLargeRowsPerItem, block_k).
  hwy::AlignedFreeUniquePtr<float[]> large_q, large_k_rows, large_kt, large_scores;
  void allocate_large_rows(const CpuBackwardPlan& plan);
  PackedHead packed;  // which head k/v buffers hold, and how much of it
  KernelCounters counters;  // this thread's share of the call's counts (counters.hpp)
};

std::size_t backward_workspace_bytes(const CpuBackwardPlan& plan, const AttentionProblem& problem);
// The bytes of one thread's Q/dO copy (BackwardWorkspace::q_kept) were the plan to keep it.
std::size_t backward_q_rows_bytes(const CpuBackwardPlan& plan, const AttentionProblem& problem);

// One (batch, head) row range of D = rowsum(dO ∘ O), and of each row's exp2 offset lse·log2e
// (BackwardParams::lse2; lse2_low 0).
using BackwardDeltaFn = void (*)(const BackwardParams&, BackwardWorkspace&, std::int64_t batch_head);
// The two-part exp2 offsets of one item of large rows (IsLargeLse2), after the delta pass.
using BackwardLargeRowsFn = void (*)(const BackwardParams&, BackwardWorkspace&, const LargeRowItem&);
// dK, dV and the dQ shares of one K/V tile of one (batch, kv head).
using BackwardKvItemFn = void (*)(const BackwardParams&, BackwardWorkspace&, std::int64_t item);
// Epilogue: dq = dq_accum · scale in dq's dtype, for one (batch, head).
using BackwardStoreDqFn = void (*)(const BackwardParams&, BackwardWorkspace&, std::int64_t batch_head);

struct BackwardKernels {
  BackwardDeltaFn delta;
  BackwardLargeRowsFn large_rows;
  BackwardKvItemFn kv_item;
  BackwardStoreDqFn store_dq;
};
// The kernels of `kernel` (never automatic) on the dispatched SIMD target.
BackwardKernels backward_kernels(BackwardKernel kernel);

}  // namespace flashattn::cpu
