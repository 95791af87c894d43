// Traffic and tile counters of the CPU kernels: what one call actually read, wrote and
// computed, for the cost model to be checked against (docs/algorithm.md §7.1, docs/cost_model.md).
//
// Off by default: a call counts only when AttentionOptions::counters points here. The
// kernels count per tile and per work item (a few integer additions beside a tile's
// 2·Br·Bc·(D + Dv) flops) into their own thread's workspace, and the call adds the
// threads' sums to *counters once, at its end — no atomics, no sharing. The counts are
// added, so one struct can total several calls; a struct must not be shared by calls
// running at the same time.
//
// Elements, not bytes: the kernels read the caller's tensors in their dtype but stream
// K/V tiles from float32 packed copies, so bytes depend on which memory is meant. The
// cost model (cost_model.hpp) turns elements into bytes for the hardware it describes.
#pragma once

#include <cstdint>

namespace flashattn {

struct KernelCounters {
  // Forward and backward.
  std::int64_t q_read = 0;         // Q elements loaded into Q tiles
  std::int64_t k_read = 0;         // K elements streamed into the tile loop, once per (Q tile, K/V tile) pair
  std::int64_t v_read = 0;         // V elements, likewise (backward: once per K/V tile)
  std::int64_t kv_packed = 0;      // K and V elements converted from the caller's memory into packed tiles
  std::int64_t tiles_computed = 0;  // (Q tile, K/V tile) pairs computed
  std::int64_t tiles_skipped = 0;   // pairs of the tile grid skipped (causal, window, block mask,
                                    // a boolean attn_mask's or a score_hook's empty blocks)
  std::int64_t scores = 0;          // score entries of the computed tiles (rows × keys, no padding)
  // (tiled kernels) score entries the products computed: each row strip of a computed tile
  // over its span of the tile's keys — the keys some row of it may see, in whole micro-tile
  // panels (docs/algorithm.md §3) — its padding rows and columns included; the bf16 backward
  // (tiled_bf16) computes whole tiles. Against `scores`: what the narrowing of causal
  // diagonals, windows and masks left of the tiles. Depends on the micro-tile's geometry.
  std::int64_t scores_computed = 0;
  // Forward.
  std::int64_t o_written = 0;    // output elements written (split-KV: each split's partial output)
  std::int64_t lse_written = 0;  // log-sum-exps written (likewise per split)
  // (tiled forward, float32 products) Q rows the products computed over the computed tiles:
  // each tile's real rows and its last strip's padding — to a whole micro-tile strip, or to
  // its half-height (a last strip of at most half a strip's real rows).
  std::int64_t rows_computed = 0;
  // Online-softmax rescales: moves of a row's reference maximum after its first visible key
  // (per split), as AttentionOptions::rescale_counts counts them per row — here for every
  // forward kernel and entry point, forward_with_kvcache and forward_varlen included.
  std::int64_t rescales = 0;
  // Backward.
  std::int64_t o_read = 0;           // O elements read for D = rowsum(dO ∘ O)
  std::int64_t dout_read = 0;        // dO elements read (the D pass and every tile pair)
  std::int64_t stats_read = 0;       // lse and D values read per tile pair
  std::int64_t dq_accum_read = 0;    // float32 dQ accumulator elements read (each tile pair, then the store)
  std::int64_t dq_accum_written = 0; // float32 dQ accumulator elements written (each tile pair)
  std::int64_t dq_written = 0;       // dq elements written
  std::int64_t dk_written = 0;       // dk elements written
  std::int64_t dv_written = 0;       // dv elements written
  // Rows whose lse is too large for P to be recomputed from it (|lse| ≥ 710: a large bias or
  // score_mod constant on every key the row sees): their P is normalized by their own scores,
  // recomputed once per row before the tiles (those K reads are not in k_read).
  std::int64_t large_lse_rows = 0;

  KernelCounters& operator+=(const KernelCounters& o) {
    q_read += o.q_read;
    k_read += o.k_read;
    v_read += o.v_read;
    kv_packed += o.kv_packed;
    tiles_computed += o.tiles_computed;
    tiles_skipped += o.tiles_skipped;
    scores += o.scores;
    scores_computed += o.scores_computed;
    o_written += o.o_written;
    lse_written += o.lse_written;
    rows_computed += o.rows_computed;
    rescales += o.rescales;
    o_read += o.o_read;
    dout_read += o.dout_read;
    stats_read += o.stats_read;
    dq_accum_read += o.dq_accum_read;
    dq_accum_written += o.dq_accum_written;
    dq_written += o.dq_written;
    dk_written += o.dk_written;
    dv_written += o.dv_written;
    large_lse_rows += o.large_lse_rows;
    return *this;
  }
};

}  // namespace flashattn
