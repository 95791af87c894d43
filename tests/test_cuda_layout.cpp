// The index arithmetic of the CUDA kernels (src/cuda/layout.hpp) against the PTX ISA's
// tables ("Matrix fragments for mma.m16n8k16 with floating point type", "ldmatrix"),
// written out here by hand, and against brute force for the tile iteration.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <utility>

#include "src/cuda/layout.hpp"

namespace flashattn::cuda {
namespace {

using RC = std::pair<int, int>;
RC rc(RowCol<int> x) { return {x.row, x.col}; }

TEST(CudaLayout, MmaFragmentsMatchTheIsaTables) {
  // A: a0..a7 of lanes 0, 5 (group 1, thread 1) and 31 (group 7, thread 3).
  const RC a0[] = {{0, 0}, {0, 1}, {8, 0}, {8, 1}, {0, 8}, {0, 9}, {8, 8}, {8, 9}};
  const RC a5[] = {{1, 2}, {1, 3}, {9, 2}, {9, 3}, {1, 10}, {1, 11}, {9, 10}, {9, 11}};
  const RC a31[] = {{7, 6}, {7, 7}, {15, 6}, {15, 7}, {7, 14}, {7, 15}, {15, 14}, {15, 15}};
  for (int e = 0; e < 8; ++e) {
    EXPECT_EQ(rc(mma_a_element(0, e)), a0[e]) << e;
    EXPECT_EQ(rc(mma_a_element(5, e)), a5[e]) << e;
    EXPECT_EQ(rc(mma_a_element(31, e)), a31[e]) << e;
  }
  // B (k, n): b0..b3.
  const RC b0[] = {{0, 0}, {1, 0}, {8, 0}, {9, 0}};
  const RC b31[] = {{6, 7}, {7, 7}, {14, 7}, {15, 7}};
  // C (row, col): c0..c3.
  const RC c0[] = {{0, 0}, {0, 1}, {8, 0}, {8, 1}};
  const RC c31[] = {{7, 6}, {7, 7}, {15, 6}, {15, 7}};
  for (int e = 0; e < 4; ++e) {
    EXPECT_EQ(rc(mma_b_element(0, e)), b0[e]) << e;
    EXPECT_EQ(rc(mma_b_element(31, e)), b31[e]) << e;
    EXPECT_EQ(rc(mma_c_element(0, e)), c0[e]) << e;
    EXPECT_EQ(rc(mma_c_element(31, e)), c31[e]) << e;
  }
}

// Every element of each operand is held by exactly one (lane, element).
TEST(CudaLayout, MmaFragmentsCoverEachOperandOnce) {
  std::set<RC> a, b, c;
  for (int lane = 0; lane < kWarpSize; ++lane) {
    for (int e = 0; e < 8; ++e) a.insert(rc(mma_a_element(lane, e)));
    for (int e = 0; e < 4; ++e) b.insert(rc(mma_b_element(lane, e)));
    for (int e = 0; e < 4; ++e) c.insert(rc(mma_c_element(lane, e)));
  }
  EXPECT_EQ(a.size(), 16u * 16u);
  EXPECT_EQ(b.size(), 16u * 8u);
  EXPECT_EQ(c.size(), 16u * 8u);
  EXPECT_EQ(*a.rbegin(), RC(15, 15));
  EXPECT_EQ(*b.rbegin(), RC(15, 7));
  EXPECT_EQ(*c.rbegin(), RC(15, 7));
}

TEST(CudaLayout, LdmatrixMatchesTheIsaTable) {
  // Lane t receives row t / 4, columns 2 (t % 4) and 2 (t % 4) + 1 of each matrix.
  EXPECT_EQ(rc(ldmatrix_element(0, 0, false)), RC(0, 0));
  EXPECT_EQ(rc(ldmatrix_element(1, 1, false)), RC(0, 3));
  EXPECT_EQ(rc(ldmatrix_element(4, 0, false)), RC(1, 0));
  EXPECT_EQ(rc(ldmatrix_element(31, 1, false)), RC(7, 7));
  EXPECT_EQ(rc(ldmatrix_element(1, 1, true)), RC(3, 0));
  // Lane t supplies row t % 8 of matrix t / 8.
  EXPECT_EQ(ldmatrix_source_matrix(17), 2);
  EXPECT_EQ(ldmatrix_source_row(17), 1);
}

// The element (row, col) of the stored 16x16 tile that lane `lane` receives in half `half`
// of register `reg` of an x4 ldmatrix whose matrices are placed by `block`.
template <class Block>
RC x4_received(int lane, int reg, int half, bool trans, Block block) {
  const RowCol<int> b = block(reg);
  const RowCol<int> e = ldmatrix_element(lane, half, trans);
  return {b.row * 8 + e.row, b.col * 8 + e.col};
}

TEST(CudaLayout, LdmatrixPlacementsGiveTheMmaOperands) {
  for (int lane = 0; lane < kWarpSize; ++lane)
    for (int reg = 0; reg < 4; ++reg)
      for (int half = 0; half < 2; ++half) {
        SCOPED_TRACE("lane " + std::to_string(lane) + " reg " + std::to_string(reg) + " half " + std::to_string(half));
        // A operand stored row-major (Q, K, V, dS), untransposed, row-fastest matrices.
        EXPECT_EQ(x4_received(lane, reg, half, false, x4_block_row_fastest<int>), rc(mma_a_element(lane, 2 * reg + half)));
        // B operand of two n8 tiles stored n-major (K for QKᵀ), untransposed, col-fastest:
        // registers {0, 1} are n-tile 0, {2, 3} n-tile 1; stored (n, k).
        const RowCol<int> kn = mma_b_element(lane, 2 * (reg % 2) + half);
        EXPECT_EQ(x4_received(lane, reg, half, false, x4_block_col_fastest<int>), RC((reg / 2) * 8 + kn.col, kn.row));
        // B operand stored k-major (V for PV), transposed, row-fastest: stored (k, n).
        EXPECT_EQ(x4_received(lane, reg, half, true, x4_block_row_fastest<int>), RC(kn.row, (reg / 2) * 8 + kn.col));
      }
}

TEST(CudaLayout, AccumulatorsOfTwoTilesAreTheNextAFragment) {
  for (int lane = 0; lane < kWarpSize; ++lane)
    for (int reg = 0; reg < 4; ++reg)
      for (int half = 0; half < 2; ++half) {
        const RowCol<int> c = mma_c_element(lane, c_first_of_a_register(reg) + half);
        EXPECT_EQ(rc(mma_a_element(lane, 2 * reg + half)), RC(c.row, c.col + 8 * c_tile_of_a_register(reg)))
            << "lane " << lane << " reg " << reg;
      }
}

TEST(CudaLayout, SwizzleIsABijectionWithoutBankConflicts) {
  for (const int row_chunks : {8, 16, 32}) {  // whole 128-byte lines (layout.hpp)
    SCOPED_TRACE("row_chunks " + std::to_string(row_chunks));
    constexpr int kRows = 64;
    std::set<int> offsets;
    for (int row = 0; row < kRows; ++row)
      for (int col = 0; col < row_chunks * kChunkElements; ++col) offsets.insert(tile_offset(row, col, row_chunks));
    EXPECT_EQ(offsets.size(), static_cast<std::size_t>(kRows * row_chunks * kChunkElements));
    EXPECT_EQ(*offsets.rbegin(), kRows * row_chunks * kChunkBytes - 2);
    // An ldmatrix phase: one chunk column of 8 consecutive rows hits 8 distinct bank groups.
    for (int row0 = 0; row0 < kRows; row0 += 8)
      for (int chunk = 0; chunk < row_chunks; ++chunk) {
        std::set<int> groups;
        for (int r = row0; r < row0 + 8; ++r) groups.insert(tile_offset(r, chunk * kChunkElements, row_chunks) / kChunkBytes % 8);
        EXPECT_EQ(groups.size(), 8u) << "rows " << row0 << " chunk " << chunk;
      }
  }
}

TEST(CudaLayout, KeyBlocksMatchBruteForce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 3000; ++trial) {
    const int block_m = 16 << (rng() % 4), block_n = 16 << (rng() % 3);
    const std::int64_t sq = 1 + rng() % 300, sk = rng() % 300;
    const bool causal = rng() % 2;
    const std::int64_t row0 = static_cast<std::int64_t>(rng() % ((sq + block_m - 1) / block_m)) * block_m;
    const KeyBlocks kb = key_blocks(row0, block_m, block_n, sq, sk, causal);
    SCOPED_TRACE("sq " + std::to_string(sq) + " sk " + std::to_string(sk) + " row0 " + std::to_string(row0) + " bm " +
                 std::to_string(block_m) + " bn " + std::to_string(block_n) + " causal " + std::to_string(causal));
    int last_seen = -1;
    for (int n = 0; n * block_n < sk + block_n; ++n) {
      bool any = false, all = true;
      for (std::int64_t i = row0; i < std::min<std::int64_t>(row0 + block_m, sq); ++i)
        for (std::int64_t j = std::int64_t{n} * block_n; j < std::int64_t{n + 1} * block_n; ++j) {
          const bool seen = key_visible(i, j, sq, sk, causal);
          any = any || seen;
          all = all && seen;
        }
      if (any) last_seen = n;
      if (n < kb.unmasked) ASSERT_TRUE(all) << "tile " << n << " is marked unmasked";
    }
    ASSERT_EQ(kb.end, last_seen + 1);
    ASSERT_LE(kb.unmasked, kb.end);
  }
}

TEST(CudaLayout, QueryBlocksMatchBruteForce) {
  std::mt19937 rng(8);
  for (int trial = 0; trial < 3000; ++trial) {
    const int block_m = 16 << (rng() % 3), block_n = 16 << (rng() % 3);
    const std::int64_t sq = 1 + rng() % 300, sk = 1 + rng() % 300;
    const bool causal = rng() % 2;
    const std::int64_t key0 = static_cast<std::int64_t>(rng() % ((sk + block_n - 1) / block_n)) * block_n;
    const QueryBlocks qb = query_blocks(key0, block_m, sq, sk, causal);
    for (int m = 0; m * block_m < sq; ++m) {
      bool any = false;
      for (std::int64_t i = std::int64_t{m} * block_m; i < std::min<std::int64_t>(std::int64_t{m + 1} * block_m, sq); ++i)
        for (std::int64_t j = key0; j < std::min<std::int64_t>(key0 + block_n, sk); ++j) any = any || key_visible(i, j, sq, sk, causal);
      if (any) ASSERT_TRUE(m >= qb.begin && m < qb.end) << "tile " << m << " sees the keys but is skipped";
      if (m < qb.begin) ASSERT_FALSE(any);
    }
    ASSERT_EQ(qb.end, (sq + block_m - 1) / block_m);
  }
}

// The tile table the Plan reads: shapes the kernels' static_asserts accept and shared
// memory within what a thread block may opt into on sm_80 (163 KiB).
TEST(CudaLayout, TileTablesFitTheTargets) {
  constexpr int kSm80MaxSharedBytes = 163 * 1024;
  for (const ForwardTile& t : kForwardTiles) {
    EXPECT_EQ(t.row_chunks() % kSwizzleChunks, 0);
    EXPECT_EQ(t.warp_rows() % kMmaM, 0);
    EXPECT_EQ(t.block_n % kMmaK, 0);
    EXPECT_LE(t.smem_bytes(), kSm80MaxSharedBytes) << t.head_dim;
  }
  for (const BackwardTile& t : kBackwardTiles) {
    EXPECT_EQ(t.warp_keys(), kMmaM);
    EXPECT_EQ(t.row_chunks() % kSwizzleChunks, 0);
    EXPECT_EQ(t.block_n / kChunkElements % kSwizzleChunks, 0);  // the dS tile
    EXPECT_LE(t.smem_bytes(), kSm80MaxSharedBytes) << t.head_dim;
  }
}

}  // namespace
}  // namespace flashattn::cuda
