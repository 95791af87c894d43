// The backward kernel of FlashAttention-2 (docs/algorithm.md §2–§3) for one thread block: block_n keys
// of one (batch, kv head), 16 per warp, so that dK and dV accumulate in registers with no
// cross-warp reduction; the block visits every Q tile of every q head of the kv head's
// group that sees its keys, recomputes P = exp2(S·scale·log2e − lse·log2e) from the
// forward's lse, and adds its share of dQ = dS·K to a float32 accumulator (atomics, or in
// K/V-tile order when deterministic). The per-row pre-pass (delta = rowsum(dO∘O)) and the
// dQ conversion pass are scalar functions below, shared with the emulation as well.
#pragma once

#include <cmath>

#include "src/cuda/forward_body.hpp"
#include "src/cuda/layout.hpp"
#include "src/cuda/params.hpp"

namespace flashattn::cuda {

inline constexpr float kLog2e = 1.442695040888963407f;

// Padded rows of the per-row workspaces: every (batch, q head) owns whole Q tiles.
FLASHATTN_HD std::int64_t padded_rows(int seqlen_q, int block_m) {
  return (seqlen_q + block_m - 1) / block_m * static_cast<std::int64_t>(block_m);
}

// Pre-pass, one row (batch, head, row < padded_rows): delta = rowsum(dO ∘ O) and lse in
// log2 units. Rows without a visible key (lse = −∞) and padding rows get +∞, so that their
// recomputed P is exp2(−∞) = 0 rather than NaN; padding rows get delta 0.
template <class Load>
FLASHATTN_HD void prepare_row(const BackwardParams& p, int block_m, int batch, int head, std::int64_t row,
                              Load load) {
  const std::int64_t index = (static_cast<std::int64_t>(batch) * p.heads_q + head) * padded_rows(p.seqlen_q, block_m) + row;
  float delta = 0.0f, lse_log2 = INFINITY;
  if (row < p.seqlen_q) {
    const std::int64_t o = batch * p.out.batch_stride + row * p.out.row_stride + head * p.out.head_stride;
    const std::int64_t g = batch * p.dout.batch_stride + row * p.dout.row_stride + head * p.dout.head_stride;
    for (int d = 0; d < p.head_dim; ++d)
      delta += load(static_cast<const std::uint16_t*>(p.out.data)[o + d]) *
               load(static_cast<const std::uint16_t*>(p.dout.data)[g + d]);
    const float lse = p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + row];
    if (lse != -INFINITY) lse_log2 = lse * kLog2e;
  }
  p.row_stats[index] = lse_log2;
  p.row_stats[p.stats_rows + index] = delta;
}

// Conversion pass, one row: dq = scale · dq_accum, rounded to the element type.
template <class Store>
FLASHATTN_HD void convert_dq_row(const BackwardParams& p, int block_m, int batch, int head, std::int64_t row,
                                 Store store) {
  const float* acc = p.dq_accum + ((static_cast<std::int64_t>(batch) * p.heads_q + head) * padded_rows(p.seqlen_q, block_m) + row) *
                                      p.head_dim_padded;
  const std::int64_t g = batch * p.dq.batch_stride + row * p.dq.row_stride + head * p.dq.head_stride;
  for (int d = 0; d < p.head_dim; ++d) static_cast<std::uint16_t*>(p.dq.data)[g + d] = store(acc[d] * p.scale);
}

// Threads per block of the per-row passes (pre-pass, dQ conversion): one row each.
inline constexpr int kRowThreads = 128;

// A launch grid, (x, y, z) blocks as launched.
struct Grid {
  std::int64_t x, y, z;
  bool empty() const { return x == 0 || y == 0 || z == 0; }
};

// The grids of a backward call: `rows` for the per-row passes — (blocks of kRowThreads
// padded rows, heads_q, batch) — and `blocks` for the dK/dV/dQ kernel — (K/V tiles, heads_kv,
// batch).
struct BackwardGrids {
  Grid rows, blocks;
};
inline BackwardGrids backward_grids(const BackwardParams& p, std::int64_t batch, int block_m, std::int64_t n_blocks) {
  return {{(padded_rows(p.seqlen_q, block_m) + kRowThreads - 1) / kRowThreads, p.heads_q, batch},
          {n_blocks, p.heads_kv, batch}};
}

enum class BackwardPass { prepare, blocks, convert };

// Runs a backward call's passes in order through launch(pass, grid) — the device launches
// (backward.cu) and the CPU emulation alike — leaving out those whose grid is empty, which
// CUDA rejects (cudaErrorInvalidConfiguration) and which have nothing to do: without
// queries (seqlen_q = 0) only the dK/dV kernel runs, whose blocks see no Q tile and write
// dk = dv = 0; without keys (seqlen_k = 0) only the per-row passes, and the conversion writes
// dq = 0 from the zeroed accumulator.
template <class Launch>
void run_backward_passes(const BackwardGrids& grids, Launch&& launch) {
  if (!grids.rows.empty()) launch(BackwardPass::prepare, grids.rows);
  if (!grids.blocks.empty()) launch(BackwardPass::blocks, grids.blocks);
  if (!grids.rows.empty()) launch(BackwardPass::convert, grids.rows);
}

template <class F, int kDTiles>
struct BackwardWarpState {
  F dk[kDTiles][4];
  F dv[kDTiles][4];
};

template <BackwardTile kTile, class E, class Block>
FLASHATTN_HD void backward_block(Block& block, const BackwardParams& p, int n_block, int kv_head, int batch) {
  using W = typename Block::Warp;
  using F = typename W::F;
  using U = typename W::U;
  constexpr int kD = kTile.head_dim;
  constexpr int kBM = kTile.block_m, kBN = kTile.block_n;
  constexpr int kRowChunks = kTile.row_chunks();
  constexpr int kStepM = kTile.step_m;    // Q rows of one step of a visit (the Sᵀ, dPᵀ registers)
  constexpr int kQTiles = kStepM / kMmaN;  // n8 tiles of Sᵀ (columns: Q rows)
  constexpr int kDTiles = kD / kMmaN;    // n8 tiles of dK, dV
  constexpr int kDSteps = kD / kMmaK;
  constexpr int kRowSteps = kStepM / kMmaK;  // k16 steps over a step's Q rows (dV, dK)
  constexpr int kKeySteps = kBN / kMmaK;  // k16 steps over keys (dQ)
  constexpr int kDqCols = 32;             // dQ columns per pass: 16 accumulators a thread
  constexpr int kDqUnits = kBM / kMmaM * (kD / kDqCols);
  constexpr int kDsChunks = kBN / kChunkElements;
  static_assert(kTile.n_tiles() == 1, "one m16 tile of keys per warp");
  static_assert(kBM % kStepM == 0 && kStepM % kMmaK == 0 && kD % kDqCols == 0 && (kDqUnits % kTile.warps == 0 || kTile.warps % kDqUnits == 0));
  static_assert(kTile.warps <= Block::kLocalWarps || Block::kLocalWarps == 1);

  const int tile_bytes_n = kBN * kD * 2, tile_bytes_m = kBM * kD * 2;
  const int smem_k = block.smem_base();
  const int smem_v = smem_k + tile_bytes_n;
  const int smem_q = smem_v + tile_bytes_n;
  const int smem_do = smem_q + tile_bytes_m;
  const int smem_ds = smem_do + tile_bytes_m;     // dS (block_m, block_n), 16-bit, swizzled
  const int smem_lse = smem_ds + kBM * kBN * 2;   // lse·log2e, then delta: block_m floats each
  const int smem_delta = smem_lse + kBM * 4;
  const std::int64_t key0 = static_cast<std::int64_t>(n_block) * kBN;
  const std::int64_t rows_padded = padded_rows(p.seqlen_q, kBM);
  const int group = p.heads_q / p.heads_kv;
  const QueryBlocks qblocks = query_blocks(key0, kBM, p.seqlen_q, p.seqlen_k, p.causal);
  const int m_blocks_total = static_cast<int>(rows_padded / kBM);
  const auto* k_base = byte_offset(static_cast<const char*>(p.k.data),
                                   2 * (batch * p.k.batch_stride + kv_head * p.k.head_stride));
  const auto* v_base = byte_offset(static_cast<const char*>(p.v.data),
                                   2 * (batch * p.v.batch_stride + kv_head * p.v.head_stride));

  BackwardWarpState<F, kDTiles> states[Block::kLocalWarps];
  block.each_warp([&](W& w, int local) {
    auto& st = states[local];
    FLASHATTN_UNROLL
    for (int dt = 0; dt < kDTiles; ++dt)
      FLASHATTN_UNROLL
      for (int e = 0; e < 4; ++e) st.dk[dt][e] = st.dv[dt][e] = F(0.0f);
    load_tile<kBN, kRowChunks, kTile.threads()>(w, smem_k, k_base, 2 * p.k.row_stride, key0, p.seqlen_k, p.head_dim);
    load_tile<kBN, kRowChunks, kTile.threads()>(w, smem_v, v_base, 2 * p.v.row_stride, key0, p.seqlen_k, p.head_dim);
    w.commit();
  });

  for (int hq = kv_head * group; hq < (kv_head + 1) * group; ++hq)
    for (int m_block = qblocks.begin; m_block < qblocks.end; ++m_block) {
      const std::int64_t row0 = static_cast<std::int64_t>(m_block) * kBM;
      const std::int64_t row_index0 = (static_cast<std::int64_t>(batch) * p.heads_q + hq) * rows_padded + row0;
      // ---- load Q, dO (block_m, D) and the rows' lse·log2e and delta
      block.each_warp([&](W& w, int) {
        const auto* q_base = byte_offset(static_cast<const char*>(p.q.data),
                                         2 * (batch * p.q.batch_stride + hq * p.q.head_stride));
        const auto* do_base = byte_offset(static_cast<const char*>(p.dout.data),
                                          2 * (batch * p.dout.batch_stride + hq * p.dout.head_stride));
        load_tile<kBM, kRowChunks, kTile.threads()>(w, smem_q, q_base, 2 * p.q.row_stride, row0, p.seqlen_q, p.head_dim);
        load_tile<kBM, kRowChunks, kTile.threads()>(w, smem_do, do_base, 2 * p.dout.row_stride, row0, p.seqlen_q,
                                                    p.head_dim);
        constexpr int kRowVectorChunks = kBM * 4 / kChunkBytes;  // per float vector
        static_assert(2 * kRowVectorChunks <= kWarpSize);
        if (w.warp() == 0) {
          const auto lane = w.lane();
          const auto second = lane >= kRowVectorChunks;
          const auto chunk = lane % kRowVectorChunks;
          // lanes [0, 16) copy the lse·log2e of the tile's rows, lanes [16, 32) their delta
          const auto offset = (w.widen(chunk * kChunkBytes) + row_index0 * 4) +
                              w.select(second, p.stats_rows * 4, std::int64_t{0});
          w.cp_async_if(lane < 2 * kRowVectorChunks, w.select(second, smem_delta, smem_lse) + chunk * kChunkBytes,
                        p.row_stats, offset);
        }
        w.commit();
        w.template wait<0>();
      });
      block.barrier();

      block.each_warp([&](W& w, int local) {
        auto& st = states[local];
        const auto lane = w.lane();
        const auto ld_row = ldmatrix_source_row(lane);
        const auto ld_matrix = ldmatrix_source_matrix(lane);
        const auto row_fastest = x4_block_row_fastest(ld_matrix);
        const auto col_fastest = x4_block_col_fastest(ld_matrix);
        const int warp_key0 = w.warp() * kMmaM;

        // The visit's Q rows in steps of step_m: the Sᵀ and dPᵀ registers hold one step.
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
        for (int step0 = 0; step0 < kBM; step0 += kStepM) {
          // ---- Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the warp's 16 keys                 // (16, step_m) each
          F s[kQTiles][4], dp[kQTiles][4];
          FLASHATTN_UNROLL
          for (int nt = 0; nt < kQTiles; ++nt)
            FLASHATTN_UNROLL
            for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = F(0.0f);
          for (int ks = 0; ks < kDSteps; ++ks) {
            U a_k[4], a_v[4];
            const auto a_offset = tile_offset(warp_key0 + row_fastest.row * 8 + ld_row, ks * kMmaK + row_fastest.col * 8,
                                              kRowChunks);
            w.template ldmatrix_x4<false>(a_k, smem_k + a_offset);
            w.template ldmatrix_x4<false>(a_v, smem_v + a_offset);
            FLASHATTN_UNROLL
            for (int nt = 0; nt < kQTiles; nt += 2) {
              U b[4];
              const auto b_offset = tile_offset(step0 + nt * kMmaN + col_fastest.row * 8 + ld_row,
                                                ks * kMmaK + col_fastest.col * 8, kRowChunks);
              w.template ldmatrix_x4<false>(b, smem_q + b_offset);
              W::template mma<E>(s[nt], a_k, b[0], b[1]);
              W::template mma<E>(s[nt + 1], a_k, b[2], b[3]);
              w.template ldmatrix_x4<false>(b, smem_do + b_offset);
              W::template mma<E>(dp[nt], a_v, b[0], b[1]);
              W::template mma<E>(dp[nt + 1], a_v, b[2], b[3]);
            }
          }

          // ---- Pᵀ = exp2(Sᵀ·scale·log2e − lse·log2e), causal mask; dSᵀ = Pᵀ ∘ (dPᵀ − delta)
          const bool diagonal = p.causal && key0 + kBN - 1 > row0 + (p.seqlen_k - p.seqlen_q);
          FLASHATTN_UNROLL
          for (int nt = 0; nt < kQTiles; ++nt)
            FLASHATTN_UNROLL
            for (int e = 0; e < 4; ++e) {
              const auto rc = mma_c_element(lane, e);
              const auto col = step0 + rc.col + nt * kMmaN;  // Q row within the tile
              const F lse_log2 = w.lds_f32(smem_lse + col * 4);
              const F delta = w.lds_f32(smem_delta + col * 4);
              F prob = W::exp2(s[nt][e] * p.scale_log2 - lse_log2);
              if (diagonal) {
                const auto key = rc.row + (static_cast<int>(key0) + warp_key0);
                prob = w.select(key_visible(col + static_cast<int>(row0), key, p.seqlen_q, p.seqlen_k, true), prob, 0.0f);
              }
              s[nt][e] = prob;
              dp[nt][e] = prob * (dp[nt][e] - delta);
            }

          // ---- dV += Pᵀ dO and dK += dSᵀ Q: the accumulators are the A fragments  // (16, D) each
          FLASHATTN_UNROLL
          for (int ks = 0; ks < kRowSteps; ++ks) {
            U a_p[4], a_ds[4];
            FLASHATTN_UNROLL
            for (int r = 0; r < 4; ++r) {
              const int t = 2 * ks + c_tile_of_a_register(r), c = c_first_of_a_register(r);
              a_p[r] = W::template pack<E>(s[t][c], s[t][c + 1]);
              a_ds[r] = W::template pack<E>(dp[t][c], dp[t][c + 1]);
            }
            FLASHATTN_UNROLL
            for (int dt = 0; dt < kDTiles; dt += 2) {
              U b[4];
              const auto b_offset = tile_offset(step0 + ks * kMmaK + row_fastest.row * 8 + ld_row,
                                                dt * kMmaN + row_fastest.col * 8, kRowChunks);
              w.template ldmatrix_x4<true>(b, smem_do + b_offset);
              W::template mma<E>(st.dv[dt], a_p, b[0], b[1]);
              W::template mma<E>(st.dv[dt + 1], a_p, b[2], b[3]);
              w.template ldmatrix_x4<true>(b, smem_q + b_offset);
              W::template mma<E>(st.dk[dt], a_ds, b[0], b[1]);
              W::template mma<E>(st.dk[dt + 1], a_ds, b[2], b[3]);
            }
          }

          // ---- dS (block_m, block_n) to shared memory for dQ: element (Q row, key)
          FLASHATTN_UNROLL
          for (int nt = 0; nt < kQTiles; ++nt)
            FLASHATTN_UNROLL
            for (int e = 0; e < 4; e += 2) {
              const auto rc = mma_c_element(lane, e);
              const U pair = W::template pack<E>(dp[nt][e], dp[nt][e + 1]);
              const auto key = rc.row + warp_key0;
              w.sts_u16(smem_ds + tile_offset(step0 + rc.col + nt * kMmaN, key, kDsChunks), pair & 0xFFFFu);
              w.sts_u16(smem_ds + tile_offset(step0 + rc.col + nt * kMmaN + 1, key, kDsChunks), pair >> 16);
            }
        }
      });
      block.barrier();

      // ---- dQ (block_m, D) += dS K, in units of (16 rows, 32 columns) spread over the warps
      const int turn_index = (batch * p.heads_q + hq) * m_blocks_total + m_block;
      if (p.deterministic) block.wait_turn(p.dq_turn + turn_index, n_block);
      block.each_warp([&](W& w, int) {
        const auto lane = w.lane();
        const auto ld_row = ldmatrix_source_row(lane);
        const auto ld_matrix = ldmatrix_source_matrix(lane);
        const auto row_fastest = x4_block_row_fastest(ld_matrix);
        for (int unit = w.warp(); unit < kDqUnits; unit += kTile.warps) {
          const int mt = unit / (kD / kDqCols), col0 = unit % (kD / kDqCols) * kDqCols;
          F dq[kDqCols / kMmaN][4];
          FLASHATTN_UNROLL
          for (int dt = 0; dt < kDqCols / kMmaN; ++dt)
            FLASHATTN_UNROLL
            for (int e = 0; e < 4; ++e) dq[dt][e] = F(0.0f);
          FLASHATTN_UNROLL
          for (int ks = 0; ks < kKeySteps; ++ks) {
            U a[4];
            w.template ldmatrix_x4<false>(a, smem_ds + tile_offset(mt * kMmaM + row_fastest.row * 8 + ld_row,
                                                                   ks * kMmaK + row_fastest.col * 8, kDsChunks));
            FLASHATTN_UNROLL
            for (int dt = 0; dt < kDqCols / kMmaN; dt += 2) {
              U b[4];
              w.template ldmatrix_x4<true>(b, smem_k + tile_offset(ks * kMmaK + row_fastest.row * 8 + ld_row,
                                                                   col0 + dt * kMmaN + row_fastest.col * 8, kRowChunks));
              W::template mma<E>(dq[dt], a, b[0], b[1]);
              W::template mma<E>(dq[dt + 1], a, b[2], b[3]);
            }
          }
          FLASHATTN_UNROLL
          for (int dt = 0; dt < kDqCols / kMmaN; ++dt)
            FLASHATTN_UNROLL
            for (int e = 0; e < 4; ++e) {
              const auto rc = mma_c_element(lane, e);
              const auto row = w.widen(rc.row + mt * kMmaM) + row_index0;
              const auto col = rc.col + (col0 + dt * kMmaN);
              // padding rows of the accumulator absorb their (zero-P) shares; they are never read
              if (p.deterministic)
                W::store_f32(col < p.head_dim_padded, p.dq_accum, row * p.head_dim_padded + w.widen(col),
                             dq[dt][e] + W::load_f32(p.dq_accum, row * p.head_dim_padded + w.widen(col)));
              else
                W::atomic_add(col < p.head_dim_padded, p.dq_accum, row * p.head_dim_padded + w.widen(col), dq[dt][e]);
            }
        }
      });
      if (p.deterministic) block.release_turn(p.dq_turn + turn_index, n_block + 1);
      block.barrier();  // the next Q tile overwrites Q, dO and dS
    }

  // ---- epilogue: dK · scale and dV for the real keys and columns
  block.each_warp([&](W& w, int local) {
    auto& st = states[local];
    if (qblocks.begin >= qblocks.end) w.template wait<0>();  // only K and V were loaded
    const auto lane = w.lane();
    auto* dk_base = byte_offset(static_cast<char*>(p.dk.data),
                                2 * (batch * p.dk.batch_stride + kv_head * p.dk.head_stride));
    auto* dv_base = byte_offset(static_cast<char*>(p.dv.data),
                                2 * (batch * p.dv.batch_stride + kv_head * p.dv.head_stride));
    FLASHATTN_UNROLL
    for (int dt = 0; dt < kDTiles; ++dt)
      FLASHATTN_UNROLL
      for (int e = 0; e < 4; ++e) {
        const auto rc = mma_c_element(lane, e);
        const auto key = w.widen(rc.row + w.warp() * kMmaM) + key0;
        const auto col = rc.col + dt * kMmaN;
        const auto ok = key < static_cast<std::int64_t>(p.seqlen_k) && col < p.head_dim;
        W::template store<E>(ok, dk_base, key * p.dk.row_stride + w.widen(col), st.dk[dt][e] * p.scale);
        W::template store<E>(ok, dv_base, key * p.dv.row_stride + w.widen(col), st.dv[dt][e]);
      }
  });
}

}  // namespace flashattn::cuda
