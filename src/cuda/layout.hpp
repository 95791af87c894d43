// The index arithmetic of the CUDA kernels, in plain C++ that compiles for the device
// (nvcc) and for the host (the unit tests and the CPU emulation of the kernels): tile
// shapes, the fragment maps of mma.m16n8k16 and ldmatrix (PTX ISA, "Matrix fragments for
// mma.m16n8k16" and "ldmatrix"), the shared-memory swizzle, and which K/V tiles a Q tile
// visits and which of them need a mask. The kernels and the emulation share every line.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLASHATTN_HD __host__ __device__ __forceinline__
// Register arrays must be indexed by constants: loops over fragments are unrolled fully
// (a dynamically indexed array would live in local memory, the stack the ptxas gate forbids).
#define FLASHATTN_UNROLL _Pragma("unroll")
#else
#define FLASHATTN_HD inline
#define FLASHATTN_UNROLL
#endif

namespace flashattn::cuda {

// ---- the tensor-core instruction: mma.sync.aligned.m16n8k16, 16-bit inputs, f32 accumulators
inline constexpr int kMmaM = 16;
inline constexpr int kMmaN = 8;
inline constexpr int kMmaK = 16;
inline constexpr int kWarpSize = 32;
inline constexpr int kQuad = 4;  // lanes that share one accumulator row ("threadID_in_group")

// The 16-bit element types of the operands, as compile-time tags.
struct Bf16 { static constexpr bool kIsBf16 = true; };
struct F16 { static constexpr bool kIsBf16 = false; };

// 16 bytes: one cp.async, one row of an 8x8 ldmatrix matrix = 8 16-bit elements.
inline constexpr int kChunkBytes = 16;
inline constexpr int kChunkElements = 8;

// The fragment maps are templates over the lane's integer type: int on the device, a
// vector of 32 lanes in the CPU emulation (emulation.hpp).
template <class Int>
struct RowCol {
  Int row;
  Int col;
};

// A (16x16, row-major) fragment: a lane holds a0..a7 in four 32-bit registers (two
// elements each): element e in [0, 8) is half e % 2 of register e / 2.
template <class Int>
FLASHATTN_HD RowCol<Int> mma_a_element(Int lane, int element) {
  return {lane / kQuad + 8 * ((element / 2) % 2), lane % kQuad * 2 + element % 2 + 8 * (element / 4)};
}
// B (16x8, "col": indexed (k, n)) fragment: b0..b3 in two registers.
template <class Int>
FLASHATTN_HD RowCol<Int> mma_b_element(Int lane, int element) {
  return {lane % kQuad * 2 + element % 2 + 8 * (element / 2), lane / kQuad};
}
// C/D (16x8, f32) fragment: c0..c3, one register each.
template <class Int>
FLASHATTN_HD RowCol<Int> mma_c_element(Int lane, int element) {
  return {lane / kQuad + 8 * (element / 2), lane % kQuad * 2 + element % 2};
}

// ldmatrix.m8n8.x4.b16: lane t supplies the address of row t % 8 of matrix t / 8 ...
// `bytes` into a tensor's memory. An empty tensor's data may be null, and offsetting a null
// pointer is undefined even when nothing is read through it: null stays null.
template <class Byte>
FLASHATTN_HD Byte* byte_offset(Byte* data, long long bytes) {
  return data == nullptr ? data : data + bytes;
}

template <class Int> FLASHATTN_HD Int ldmatrix_source_matrix(Int lane) { return lane / 8; }
template <class Int> FLASHATTN_HD Int ldmatrix_source_row(Int lane) { return lane % 8; }
// ... and receives in register j the elements (half 0, 1) at (row, col) of matrix j;
// .trans transposes each matrix on the way.
inline RowCol<int> ldmatrix_element(int lane, int half, bool trans) {
  const RowCol<int> plain{lane / kQuad, 2 * (lane % kQuad) + half};
  return trans ? RowCol<int>{plain.col, plain.row} : plain;
}

// Which 8x8 block (row block, col block) of the stored 16x16 tile matrix j of an x4
// ldmatrix reads, for the three operands of the kernels:
//  * row-fastest {j % 2, j / 2}: an A operand stored row-major (Q, K, dS), untransposed:
//    registers a01, a23, a45, a67 = rows 0-7 / 8-15 of cols 0-7, then of cols 8-15;
//    and a B operand stored k-major (V for P·V, dO for Pᵀ·dO), transposed: registers
//    b01, b23 of n-tile 0, then of n-tile 1.
//  * col-fastest {j / 2, j % 2}: a B operand stored n-major (K for Q·Kᵀ), untransposed:
//    registers b01, b23 of n-tile 0 (stored rows 0-7), then of n-tile 1 (rows 8-15).
template <class Int> FLASHATTN_HD RowCol<Int> x4_block_row_fastest(Int matrix) { return {matrix % 2, matrix / 2}; }
template <class Int> FLASHATTN_HD RowCol<Int> x4_block_col_fastest(Int matrix) { return {matrix / 2, matrix % 2}; }

// The f32 accumulators of two adjacent n8 tiles, rounded to 16 bits, are the A fragment of
// the next product over those 16 columns (P of S = QKᵀ feeds P·V without leaving
// registers): A register r packs elements (first, first + 1) of C tile c_tile_of_a_register.
FLASHATTN_HD constexpr int c_tile_of_a_register(int reg) { return reg / 2; }
FLASHATTN_HD constexpr int c_first_of_a_register(int reg) { return 2 * (reg % 2); }

// ---- shared memory: row-major tiles of 16-bit elements in 16-byte chunks, XOR-swizzled
// so that the 8 row addresses of one ldmatrix phase (one chunk column of 8 consecutive rows)
// and the 8 chunks a row of cp.async stores fall in 8 distinct 16-byte bank groups of the
// 128-byte bank line: chunk c of row r is stored at chunk c ^ (r % 8) within its group of 8.
// Rows are whole lines: row_chunks is a multiple of 8 (D and the dS tile's keys >= 64).
inline constexpr int kSwizzleChunks = 8;  // 8 chunks · 16 bytes = the 32 banks · 4 bytes
template <class Int>
FLASHATTN_HD Int swizzled_chunk(Int row, Int chunk) {
  return chunk - chunk % kSwizzleChunks + ((chunk ^ row) & (kSwizzleChunks - 1));
}
// Byte offset of element (row, col) in a tile whose rows hold `row_chunks` chunks.
template <class Int>
FLASHATTN_HD Int tile_offset(Int row, Int col, int row_chunks) {
  return (row * row_chunks + swizzled_chunk(row, col / kChunkElements)) * kChunkBytes +
         col % kChunkElements * 2;
}

// ---- tile shapes: one configuration per head-dimension bucket, a Plan reads them ---------
struct ForwardTile {
  int head_dim;  // the bucket: D rounded up to 64, 128 or 256; zero-padded columns
  int block_m;   // Q rows per thread block, split among the warps (no cross-warp reduction)
  int block_n;   // keys per K/V tile
  int warps;
  int stages;    // K/V tiles in flight in shared memory (cp.async)
  FLASHATTN_HD constexpr int warp_rows() const { return block_m / warps; }
  FLASHATTN_HD constexpr int m_tiles() const { return warp_rows() / kMmaM; }
  FLASHATTN_HD constexpr int threads() const { return warps * kWarpSize; }
  FLASHATTN_HD constexpr int row_chunks() const { return head_dim / kChunkElements; }
  // Q tile + stages · (K tile + V tile), 16-bit elements.
  FLASHATTN_HD constexpr int smem_bytes() const {
    return (block_m + 2 * stages * block_n) * head_dim * 2;
  }
};

// A thread holds m_tiles · (D + block_n) / 2 f32 accumulators (O and S) within the 255
// registers of sm_80/sm_90, and ptxas must neither spill nor use a stack frame (the
// cuda_gates test). D = 64: 128 rows, 32 per warp (each K/V fragment read from shared memory
// feeds two mma). D = 128: 128 rows over 8 warps, 16 each, so that each K/V tile in shared
// memory serves twice the rows of a 64-row block; on the H200 (docs/cuda.md) 8–9% faster than
// 64 rows over 4 warps at S ≥ 4096, 5% slower causal at S = 1024; 32 rows per warp spills.
// D = 256: 64 rows (O alone takes 128 accumulators). Two stages of K/V tiles: 48, 96 and
// 64 KiB of shared memory (smem_bytes), within the 163 KiB an sm_80 block may opt into.
inline constexpr ForwardTile kForwardTiles[] = {
    {64, 128, 64, 4, 2},
    {128, 128, 64, 8, 2},
    {256, 64, 16, 4, 2},
};

// Backward: a thread block owns block_n keys of one (batch, kv head), split among the
// warps (16 keys each: dK and dV stay in registers, no cross-warp reduction), and visits
// the Q tiles of every q head of its group.
struct BackwardTile {
  int head_dim;
  int block_m;  // Q rows per visited tile
  int block_n;  // keys per thread block
  int warps;
  int step_m;   // Q rows per step within a visit: the Sᵀ and dPᵀ registers hold one step
  FLASHATTN_HD constexpr int warp_keys() const { return block_n / warps; }
  FLASHATTN_HD constexpr int n_tiles() const { return warp_keys() / kMmaM; }
  FLASHATTN_HD constexpr int threads() const { return warps * kWarpSize; }
  FLASHATTN_HD constexpr int row_chunks() const { return head_dim / kChunkElements; }
  // K, V (block_n rows), Q, dO (block_m rows), dS (block_m x block_n), lse and delta.
  FLASHATTN_HD constexpr int smem_bytes() const {
    return (2 * block_n + 2 * block_m) * head_dim * 2 + block_m * block_n * 2 + 2 * block_m * 4;
  }
};
// 128 keys over 8 warps: each Q/dO tile brought into shared memory serves twice the keys of
// a 64-key block, and half as many dQ atomics reach the accumulator per FLOP. A visit's Q tile
// is worked through in steps of step_m rows, so that it can be larger than what the Sᵀ and dPᵀ
// registers hold (dK and dV alone take D accumulators a thread; 32 rows at D = 128 spill):
// fewer barriers and atomics per FLOP, and more dQ units for the warps. On the H200
// (docs/cuda.md) 64 rows in steps of 32 were best at D = 64, 32 rows in steps of 16 at D = 128
// (64 rows there: 0–12% slower). The lse/delta copy takes block_m ≤ 64.
inline constexpr BackwardTile kBackwardTiles[] = {
    {64, 64, 128, 8, 32},
    {128, 32, 128, 8, 16},
};

// ---- which tiles a Q tile visits (causal bottom-right aligned, ragged seqlen_k) ------------
struct KeyBlocks {
  int end;       // K/V tiles [0, end) are visited, from end − 1 down to 0
  int unmasked;  // tiles [0, unmasked) need no mask; [unmasked, end) hold the ragged end
                 // of seqlen_k or the causal diagonal
};

// Query row i sees key j iff j < seqlen_k and, when causal, j <= i + seqlen_k − seqlen_q.
template <class Int>
FLASHATTN_HD auto key_visible(const Int& row, const Int& key, std::int64_t seqlen_q,
                              std::int64_t seqlen_k, bool causal) {
  return key < seqlen_k && (!causal || key <= row + (seqlen_k - seqlen_q));
}

// The K/V tiles of size block_n that rows [row0, row0 + block_m) visit: tiles past the last
// visible key of the last row are skipped (causal block skipping), and the tiles that hold
// the causal diagonal of the first row or the ragged end of seqlen_k need a mask.
FLASHATTN_HD KeyBlocks key_blocks(std::int64_t row0, int block_m, int block_n,
                                  std::int64_t seqlen_q, std::int64_t seqlen_k, bool causal) {
  std::int64_t key_end = seqlen_k;
  std::int64_t unmasked_end = seqlen_k / block_n * block_n;  // whole tiles
  if (causal) {
    const std::int64_t offset = seqlen_k - seqlen_q;
    // The block's last real row (rows past seqlen_q are computed but never stored).
    const std::int64_t last_row = (row0 + block_m < seqlen_q ? row0 + block_m : seqlen_q) - 1;
    key_end = key_end < last_row + offset + 1 ? key_end : last_row + offset + 1;
    // Tile n is unmasked for every row of the block iff its last key <= row0 + offset.
    const std::int64_t diag = row0 + offset + 1;  // keys [0, diag) are seen by row0
    const std::int64_t whole = diag > 0 ? diag / block_n * block_n : 0;
    unmasked_end = unmasked_end < whole ? unmasked_end : whole;
  }
  const std::int64_t end = key_end > 0 ? (key_end + block_n - 1) / block_n : 0;
  const std::int64_t unmasked = unmasked_end / block_n;
  return {static_cast<int>(end), static_cast<int>(unmasked < end ? unmasked : end)};
}

// The Q tiles of size block_m that keys [key0, key0 + block_n) are seen by (backward):
// [begin, end), every tile when not causal.
struct QueryBlocks {
  int begin;
  int end;
};
FLASHATTN_HD QueryBlocks query_blocks(std::int64_t key0, int block_m, std::int64_t seqlen_q,
                                      std::int64_t seqlen_k, bool causal) {
  const std::int64_t end = (seqlen_q + block_m - 1) / block_m;
  if (!causal) return {0, static_cast<int>(end)};
  // Row i sees key0 iff i >= key0 − (seqlen_k − seqlen_q).
  std::int64_t first_row = key0 - (seqlen_k - seqlen_q);
  if (first_row < 0) first_row = 0;
  const std::int64_t begin = first_row / block_m;
  return {static_cast<int>(begin < end ? begin : end), static_cast<int>(end)};
}

}  // namespace flashattn::cuda
