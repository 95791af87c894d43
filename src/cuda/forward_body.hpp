// The forward kernel of FlashAttention-2 (docs/algorithm.md §2–§3) for one thread block: one Q tile of
// one (batch, head), its rows split among the warps, K/V tiles streamed through a
// two-stage cp.async ring in shared memory, S = QKᵀ and O += PV on mma.m16n8k16 with
// 16-bit inputs and f32 accumulators, the online softmax in registers with exp2.
//
// Written once over a warp's operations (`Block::Warp`): on the device each thread runs it
// with scalar registers (kernels.cuh), on the host the emulation runs whole warps of
// 32-lane registers (emulation.hpp), so the tests execute these very lines.
#pragma once

#include "src/cuda/layout.hpp"
#include "src/cuda/params.hpp"

namespace flashattn::cuda {

inline constexpr float kLn2 = 0.693147180559945309f;  // lse in natural log = log2 form · ln 2

// Copies rows [first_row, first_row + kRows) of a (seqlen, D) matrix (row stride in bytes)
// into a swizzled shared-memory tile, every thread of the block taking every threads-th
// 16-byte chunk. Rows past seqlen and columns past head_dim are zero-filled (cp.async's
// source size), which pads D up to the tile's bucket and the last tile of a ragged sequence.
template <int kRows, int kRowChunks, int kThreads, class W>
FLASHATTN_HD void load_tile(W& w, int smem_tile, const void* base, std::int64_t row_stride_bytes,
                            std::int64_t first_row, std::int64_t seqlen, int head_dim) {
  static_assert(kRows * kRowChunks % kThreads == 0, "whole rounds of chunks per thread");
  for (int round = 0; round < kRows * kRowChunks / kThreads; ++round) {
    const auto chunk = w.lane() + (w.warp() * kWarpSize + round * kThreads);
    const auto row = chunk / kRowChunks;
    const auto col_chunk = chunk % kRowChunks;
    const auto global_row = w.widen(row) + first_row;
    const auto col_bytes = (head_dim - col_chunk * kChunkElements) * 2;
    const auto valid = global_row < seqlen && col_bytes > 0;
    const auto bytes = w.select(valid, w.select(col_bytes < kChunkBytes, col_bytes, kChunkBytes), 0);
    const auto offset = w.select(valid, global_row * row_stride_bytes + w.widen(col_chunk) * kChunkBytes,
                                 std::int64_t{0});
    w.cp_async(smem_tile + tile_offset(row, col_chunk * kChunkElements, kRowChunks), base, offset, bytes);
  }
}

// The running softmax state of the rows a thread holds: 2 rows (accumulator halves) per
// m16 tile; `sum` is this thread's partial row sum, reduced across the quad only at the end.
template <class F, int kMTiles, int kDTiles>
struct ForwardWarpState {
  F o[kMTiles][kDTiles][4];
  F max[kMTiles][2];
  F sum[kMTiles][2];
};

template <ForwardTile kTile, class E, class Block>
FLASHATTN_HD void forward_block(Block& block, const ForwardParams& p, int m_block, int head, int batch) {
  using W = typename Block::Warp;
  using F = typename W::F;
  using U = typename W::U;
  constexpr int kD = kTile.head_dim;
  constexpr int kMTiles = kTile.m_tiles();
  constexpr int kNTiles = kTile.block_n / kMmaN;   // n8 tiles of S
  constexpr int kDTiles = kD / kMmaN;              // n8 tiles of O
  constexpr int kDSteps = kD / kMmaK;              // k16 steps of QKᵀ
  constexpr int kKeySteps = kTile.block_n / kMmaK; // k16 steps of PV
  constexpr int kRowChunks = kTile.row_chunks();
  constexpr int kKvTileBytes = kTile.block_n * kD * 2;
  static_assert(kTile.stages == 2, "the loop below double-buffers");
  static_assert(kMTiles >= 1 && kTile.warp_rows() % kMmaM == 0 && kTile.block_n % kMmaK == 0 && kD % kMmaK == 0);
  static_assert(kTile.warps <= Block::kLocalWarps || Block::kLocalWarps == 1);

  const int smem_q = block.smem_base();
  const int smem_kv = smem_q + kTile.block_m * kD * 2;  // stage s: K at + 2 s · tile, V after it
  const int kv_head = head / (p.heads_q / p.heads_kv);
  const auto* q_base = byte_offset(static_cast<const char*>(p.q.data),
                                   2 * (batch * p.q.batch_stride + head * p.q.head_stride));
  const auto* k_base = byte_offset(static_cast<const char*>(p.k.data),
                                   2 * (batch * p.k.batch_stride + kv_head * p.k.head_stride));
  const auto* v_base = byte_offset(static_cast<const char*>(p.v.data),
                                   2 * (batch * p.v.batch_stride + kv_head * p.v.head_stride));
  const std::int64_t row0 = static_cast<std::int64_t>(m_block) * kTile.block_m;
  const KeyBlocks blocks = key_blocks(row0, kTile.block_m, kTile.block_n, p.seqlen_q, p.seqlen_k, p.causal);

  auto load_kv = [&](W& w, int n_block, int stage) {
    const int sk = smem_kv + 2 * stage * kKvTileBytes;
    const std::int64_t key0 = static_cast<std::int64_t>(n_block) * kTile.block_n;
    load_tile<kTile.block_n, kRowChunks, kTile.threads()>(w, sk, k_base, 2 * p.k.row_stride, key0, p.seqlen_k, p.head_dim);
    load_tile<kTile.block_n, kRowChunks, kTile.threads()>(w, sk + kKvTileBytes, v_base, 2 * p.v.row_stride, key0,
                                                         p.seqlen_k, p.head_dim);
  };

  ForwardWarpState<F, kMTiles, kDTiles> states[Block::kLocalWarps];
  block.each_warp([&](W& w, int local) {
    auto& st = states[local];
    FLASHATTN_UNROLL
    for (int mt = 0; mt < kMTiles; ++mt) {
      FLASHATTN_UNROLL
      for (int dt = 0; dt < kDTiles; ++dt)
        FLASHATTN_UNROLL
        for (int e = 0; e < 4; ++e) st.o[mt][dt][e] = F(0.0f);
      FLASHATTN_UNROLL
      for (int h = 0; h < 2; ++h) {
        st.max[mt][h] = F(-INFINITY);
        st.sum[mt][h] = F(0.0f);
      }
    }
    load_tile<kTile.block_m, kRowChunks, kTile.threads()>(w, smem_q, q_base, 2 * p.q.row_stride, row0, p.seqlen_q,
                                                         p.head_dim);
    if (blocks.end > 0) load_kv(w, blocks.end - 1, 0);
    w.commit();
  });

  // K/V tiles from the last to the first: the masked ones (ragged end, causal diagonal)
  // come first, while the running maximum is still being found.
  for (int i = 0; i < blocks.end; ++i) {
    const int n_block = blocks.end - 1 - i;
    const int stage = i % 2;
    block.each_warp([&](W& w, int) {
      if (n_block > 0) {  // prefetch the next tile into the other stage, then wait for this one
        load_kv(w, n_block - 1, 1 - stage);
        w.commit();
        w.template wait<1>();
      } else {
        w.template wait<0>();
      }
    });
    block.barrier();
    block.each_warp([&](W& w, int local) {
      auto& st = states[local];
      const int sk = smem_kv + 2 * stage * kKvTileBytes;
      const int sv = sk + kKvTileBytes;
      const auto lane = w.lane();
      const auto ld_row = ldmatrix_source_row(lane);
      const auto ld_matrix = ldmatrix_source_matrix(lane);
      const auto a_block = x4_block_row_fastest(ld_matrix);
      const auto k_block = x4_block_col_fastest(ld_matrix);
      const int warp_row0 = w.warp() * kTile.warp_rows();

      // ---- S = Q Kᵀ (block_n keys)                                        // (warp_rows, block_n)
      F s[kMTiles][kNTiles][4];
      FLASHATTN_UNROLL
      for (int mt = 0; mt < kMTiles; ++mt)
        FLASHATTN_UNROLL
        for (int nt = 0; nt < kNTiles; ++nt)
          FLASHATTN_UNROLL
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = F(0.0f);
      for (int ks = 0; ks < kDSteps; ++ks) {  // not unrolled: registers for S, not for loads
        U a[kMTiles][4];
        FLASHATTN_UNROLL
        for (int mt = 0; mt < kMTiles; ++mt)
          w.template ldmatrix_x4<false>(a[mt], smem_q + tile_offset(warp_row0 + mt * kMmaM + a_block.row * 8 + ld_row,
                                                                     ks * kMmaK + a_block.col * 8, kRowChunks));
        FLASHATTN_UNROLL
        for (int nt = 0; nt < kNTiles; nt += 2) {
          U b[4];
          w.template ldmatrix_x4<false>(b, sk + tile_offset(nt * kMmaN + k_block.row * 8 + ld_row,
                                                             ks * kMmaK + k_block.col * 8, kRowChunks));
          FLASHATTN_UNROLL
          for (int mt = 0; mt < kMTiles; ++mt) {
            W::template mma<E>(s[mt][nt], a[mt], b[0], b[1]);
            W::template mma<E>(s[mt][nt + 1], a[mt], b[2], b[3]);
          }
        }
      }

      // ---- mask: keys past seqlen_k and, when causal, right of the diagonal
      if (n_block >= blocks.unmasked) {
        FLASHATTN_UNROLL
        for (int mt = 0; mt < kMTiles; ++mt)
          FLASHATTN_UNROLL
          for (int nt = 0; nt < kNTiles; ++nt)
            FLASHATTN_UNROLL
            for (int e = 0; e < 4; ++e) {
              const auto rc = mma_c_element(lane, e);
              // 32-bit: sequence lengths are below 2^31 (checked by the API layer)
              const auto row = rc.row + (static_cast<int>(row0) + warp_row0 + mt * kMmaM);
              const auto key = rc.col + (n_block * kTile.block_n + nt * kMmaN);
              s[mt][nt][e] = w.select(key_visible(row, key, p.seqlen_q, p.seqlen_k, p.causal), s[mt][nt][e], -INFINITY);
            }
      }

      // ---- online softmax: new row maxima (quad reduction), rescale O and the sum, P = exp2
      FLASHATTN_UNROLL
      for (int mt = 0; mt < kMTiles; ++mt)
        FLASHATTN_UNROLL
        for (int h = 0; h < 2; ++h) {
          F row_max = st.max[mt][h];
          FLASHATTN_UNROLL
          for (int nt = 0; nt < kNTiles; ++nt)
            row_max = W::max(row_max, W::max(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
          FLASHATTN_UNROLL
          for (int mask = 1; mask < kQuad; mask *= 2) row_max = W::max(row_max, W::shfl_xor(row_max, mask));
          // A row with no visible key yet keeps max −∞: use 0 so that exp2 gives 0, not NaN.
          const F max_scaled = w.select(row_max == -INFINITY, 0.0f, row_max * p.scale_log2);
          const F rescale = W::exp2(st.max[mt][h] * p.scale_log2 - max_scaled);
          st.max[mt][h] = row_max;
          F tile_sum = F(0.0f);
          FLASHATTN_UNROLL
          for (int nt = 0; nt < kNTiles; ++nt)
            FLASHATTN_UNROLL
            for (int e = 2 * h; e < 2 * h + 2; ++e) {
              s[mt][nt][e] = W::exp2(s[mt][nt][e] * p.scale_log2 - max_scaled);
              tile_sum = tile_sum + s[mt][nt][e];
            }
          st.sum[mt][h] = st.sum[mt][h] * rescale + tile_sum;
          FLASHATTN_UNROLL
          for (int dt = 0; dt < kDTiles; ++dt)
            FLASHATTN_UNROLL
            for (int e = 2 * h; e < 2 * h + 2; ++e) st.o[mt][dt][e] = st.o[mt][dt][e] * rescale;
        }

      // ---- O += P V: P's accumulators are the A fragments, V is read transposed      // (warp_rows, D)
      const auto v_block = x4_block_row_fastest(ld_matrix);
      FLASHATTN_UNROLL
      for (int ks = 0; ks < kKeySteps; ++ks) {
        U a[kMTiles][4];
        FLASHATTN_UNROLL
        for (int mt = 0; mt < kMTiles; ++mt)
          FLASHATTN_UNROLL
          for (int r = 0; r < 4; ++r) {
            const auto& c = s[mt][2 * ks + c_tile_of_a_register(r)];
            a[mt][r] = W::template pack<E>(c[c_first_of_a_register(r)], c[c_first_of_a_register(r) + 1]);
          }
        FLASHATTN_UNROLL
        for (int dt = 0; dt < kDTiles; dt += 2) {
          U b[4];
          w.template ldmatrix_x4<true>(b, sv + tile_offset(ks * kMmaK + v_block.row * 8 + ld_row,
                                                            dt * kMmaN + v_block.col * 8, kRowChunks));
          FLASHATTN_UNROLL
          for (int mt = 0; mt < kMTiles; ++mt) {
            W::template mma<E>(st.o[mt][dt], a[mt], b[0], b[1]);
            W::template mma<E>(st.o[mt][dt + 1], a[mt], b[2], b[3]);
          }
        }
      }
    });
    block.barrier();  // the next iteration's prefetch overwrites this stage
  }

  // ---- epilogue: O / ℓ and lse = (max · scale + ln ℓ) for the real rows and columns
  block.each_warp([&](W& w, int local) {
    auto& st = states[local];
    if (blocks.end == 0) w.template wait<0>();  // only Q was loaded
    const auto lane = w.lane();
    const int warp_row0 = w.warp() * kTile.warp_rows();
    auto* out_base = byte_offset(static_cast<char*>(p.out.data),
                                 2 * (batch * p.out.batch_stride + head * p.out.head_stride));
    float* lse_base = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride;
    FLASHATTN_UNROLL
    for (int mt = 0; mt < kMTiles; ++mt)
      FLASHATTN_UNROLL
      for (int h = 0; h < 2; ++h) {
        F sum = st.sum[mt][h];
        FLASHATTN_UNROLL
        for (int mask = 1; mask < kQuad; mask *= 2) sum = sum + W::shfl_xor(sum, mask);
        const F inverse = w.select(sum > 0.0f, 1.0f / sum, 0.0f);
        const auto row = w.widen(mma_c_element(lane, 2 * h).row) + (row0 + warp_row0 + mt * kMmaM);
        const auto row_ok = row < static_cast<std::int64_t>(p.seqlen_q);
        FLASHATTN_UNROLL
        for (int dt = 0; dt < kDTiles; ++dt)
          FLASHATTN_UNROLL
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            const auto col = mma_c_element(lane, e).col + dt * kMmaN;
            W::template store<E>(row_ok && col < p.head_dim, out_base, row * p.out.row_stride + w.widen(col),
                                 st.o[mt][dt][e] * inverse);
          }
        const F lse = w.select(sum > 0.0f, (st.max[mt][h] * p.scale_log2 + W::log2(sum)) * kLn2, -INFINITY);
        W::store_f32(row_ok && lane % kQuad == 0, lse_base, row, lse);
      }
  });
}

}  // namespace flashattn::cuda
