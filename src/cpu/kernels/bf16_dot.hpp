// The bf16 micro-kernel on AVX512-BF16: C(kRows × kCols) (+)= A·B with VDPBF16PS, which
// multiplies pairs of bf16 exactly and adds both products to a float32 lane. Highway 1.0.3
// does not emit it (its bf16 ReorderWidenMulAccumulate is emulated), so this is its own
// translation unit, compiled once (not per Highway target) with the instruction set enabled on each
// function that uses it; callers reach it only where available() says the CPU has it. Where
// the CPU also has AMX (and the OS grants its tile state), whole chunks of 16 depth pairs of
// row-major A operands run on AMX tiles (TDPBF16PS, the same exact pair products into float32),
// the rest on VDPBF16PS.
//
// Operands are laid out as pairs along the depth (the reduction dimension), each pair one
// 32-bit word:
//   A: kRows rows of bf16, lda elements apart; pair p of row r is elements 2p and 2p + 1
//      (a row-major bf16 matrix with an even row length is already in this form);
//   B: a panel of `pairs` steps, contiguous; step p holds (kCols, 2) bf16 — column c's
//      elements of depth 2p and 2p + 1 side by side — 128 bytes, 64-byte aligned.
// VDPBF16PS reads denormal bf16 inputs (below 2^-126) as zero and flushes denormal sums,
// whatever MXCSR says: operands that small contribute below float32's normal range.
// Reusable by any product C += A·B whose depth pairs are laid out so: the forward's S = Q·Kᵀ
// (pairs along head_dim) and õ += P·V (pairs along keys); a backward's dV += Pᵀ·dO likewise.
#pragma once

#include <cstdint>

namespace flashattn::cpu::bf16dot {

// Register blocking: 8 rows × 2 vectors of 16 float32 = 16 accumulators, 2 B vectors and
// one broadcast A pair: 19 of AVX-512's 32 registers, and 16 independent dot-product chains
// for the ≈ 6-cycle latency of VDPBF16PS on two ports (12 would do).
constexpr std::int64_t kRows = 8;
constexpr std::int64_t kCols = 32;
constexpr std::int64_t kPairStep = 2 * kCols;  // bf16 elements of one step of a B panel

// True when the CPU executes VDPBF16PS (AVX512-BF16; checked once).
bool available();

// True when the bf16 products retire more FLOPs per cycle than float32 FMA does, so that the
// bf16 kernels should outrun the float32 ones: AMD's AVX512-BF16 cores (Zen 5: two
// VDPBF16PS per cycle, 128 FLOP against FMA's 64), and CPUs with AMX, whose tiles take every
// whole chunk of 16 depth pairs. Not Intel's VDPBF16PS alone: on the Sapphire Rapids of
// docs/performance.md one holds both FMA ports for a cycle (32 FLOP against FMA's 64), and
// the bf16 kernel on it ran at 0.66× the float32 one there.
bool outpaces_fma();
// True when the products run on AMX tiles (AMX-BF16, Linux granted the tile state, and
// not switched off).
bool uses_amx();
// Switches AMX off (false) or back on for every thread: for tests of the VDPBF16PS path on
// a CPU with AMX. Not while a product runs.
void set_amx_enabled(bool enabled);

// AMX tile state belongs to the thread, and every library in the process shares it: oneDNN
// under PyTorch or OpenVINO configures tiles of its own shapes on the same OpenMP threads
// and releases them after its products. A TileScope around a work item's products makes this
// file's configuration valid for that span: the first product in it loads the configuration
// (whatever ran on the thread before), later ones reuse it, and on leaving the thread gets
// back the state it came in with — released, or the other library's configuration. Outside
// any scope every product loads the configuration itself. Without AMX it does nothing.
class TileScope {
 public:
  TileScope();
  ~TileScope();
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  alignas(64) unsigned char saved_[64];  // the thread's configuration on entry (STTILECFG)
  bool active_;
};

// C = scale · A(kRows × 2·pairs)·B(2·pairs × kCols): a product stored, scaled in float32.
// C rows are ldc floats apart and 64-byte aligned.
void DotStore(const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b, std::int64_t pairs, float scale,
              float* c, std::int64_t ldc);
// C += A(kRows × 2·pairs)·B(2·pairs × kCols).
void DotAccumulate(const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b, std::int64_t pairs, float* c,
                   std::int64_t ldc);

// dst[2k], dst[2k + 1] = row0[k], row1[k] rounded to bf16 (as RoundToBf16), k < n, n a
// multiple of 16: two rows of a float32 matrix as one row of depth pairs — B-panel steps
// (pairs along the rows of a row-major B, kCols columns per panel, steps 2·n apart).
void PairRows(const float* row0, const float* row1, std::uint16_t* dst, std::int64_t n);
// The same from two rows already in bf16 (copied, not rounded); n a multiple of 32.
void PairRowsBf16(const std::uint16_t* row0, const std::uint16_t* row1, std::uint16_t* dst, std::int64_t n);

// dst(cols × rows) = src(rows × cols)ᵀ for 32-bit words (bf16 pairs): rows and cols
// multiples of 16, strides in words. Turns a matrix paired along its rows (PairRows) into
// the row-major A operand of its transpose.
void TransposeWords(const std::uint32_t* src, std::int64_t src_stride, std::uint32_t* dst, std::int64_t dst_stride,
                    std::int64_t rows, std::int64_t cols);

// C(rows × cols) = scale·A·B, or C += A·B when `accumulate` (scale then 1): a whole product
// of row-major A (pairs contiguous, rows lda elements apart) and B panels of kCols columns,
// panel k at b + k·b_panel_stride with steps b_step elements apart. rows a multiple of kRows,
// cols of kCols. With AMX it runs 32 × 32 blocks of C on four tiles (rows a multiple of 32),
// which keeps four TDPBF16PS in flight; else as DotStore / DotAccumulate micro-tiles.
void DotBlock(const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b, std::int64_t b_panel_stride,
              std::int64_t b_step, std::int64_t pairs, float scale, bool accumulate, float* c, std::int64_t ldc,
              std::int64_t rows, std::int64_t cols);

// dst[0, n) = src[0, n) rounded to bf16, to nearest even (NaN stays NaN); n a multiple of
// kCols. Values below float's normal range (< 2^-126) become zero: the conversion, like
// VDPBF16PS itself, treats denormals as zero.
void RoundToBf16(const float* src, std::uint16_t* dst, std::int64_t n);

}  // namespace flashattn::cpu::bf16dot
