// The products of a quantized decode on AVX512-BF16 dot products (the decode_bf16 kernel,
// options.hpp) — for CPUs that have VDPBF16PS but not AVX512-FP16 (AMD Zen 4), where the
// float32 decode kernel's widen-and-FMA of every code costs as much as the bf16 cache's own
// decode. One-byte codes widen to bf16 exactly — e4m3 codes through their half-precision
// bits (2^-8 times their values, subnormal codes included) and float32, int8 codes as the
// integers they are (u8 read as code − 128, s8 as is) — and each VDPBF16PS takes two
// products per float32 lane, summed in float32 (the instruction's own rounding, denormals
// read and written as zero):
//   S = Q·Kᵀ (e4m3 K codes; int8 K codes score on int8_dot.hpp's integer products): q rows
//     scaled by a power of two to a largest magnitude in [2^(e−1), 2^e), e = kTop, and
//     rounded to bf16 (2^-9 relative); each lane sums its pairs of products over the head
//     dimension in float32, then four keys' lanes add in a tree.
//   õ += P·V: P, times the V factor and a power of two that keeps it ≤ 2^kTop, is rounded to
//     bf16 in pairs of keys; the V rows of a pair of keys interleave so that one VDPBF16PS
//     adds both keys' products to each output column, in float32.
// Unlike decode_fp16 no partial sum is kept in a narrow type, so no head-dim bound applies;
// the roundings are of q (e4m3 K) and of P·factor, each 2^-9 relative, against the codes' own
// quantization (2^-4 relative for e4m3, half a step for int8: kv_quant.hpp). The tests hold
// the kernel to twice the error of a scalar yardstick that rounds the same two operands
// (tests/support/naive.hpp). Compiled once for the baseline ISA, each function carrying the
// instructions in its target attribute; callers reach it only where available() says so.
#pragma once

#include <cstdint>

#include "flashattn/kv_quant.hpp"
#include "src/cpu/kernels/fp16_decode.hpp"

namespace flashattn::cpu::bf16decode {

constexpr std::int64_t kPanelLanes = 32;  // bf16 lanes per vector; a panel's vectors are this wide
// q rows and the P·V weights are brought to at most 2^kTop: any exponent serves (bf16 has
// float32's range); 0 keeps both well inside it.
constexpr int kTop = 0;

// True when the CPU has AVX512-BF16 (bf16dot::available).
bool available();

// Whether e4m3 codes widen through byte tables (AVX512-VBMI's two-source byte permutes: six
// instructions for 64 codes) rather than through half precision and float32 (fourteen). On by
// default where the CPU has AVX512-VBMI (Zen 4, Intel since Ice Lake; not Cooper Lake); the
// products, their order and so the results are the same bits either way. Tests switch it off
// to reach the other widening; set_byte_tables(true) takes effect only with VBMI.
bool byte_tables();
void set_byte_tables(bool on);

// PackQ4 of fp16_decode.hpp in bf16: the Q panel of four rows, vector j of row r at
// panel + (4j + r)·kPanelLanes, each row times 2^k_r, unit[r] = 2^-k_r.
void PackQ4(const float* q, std::int64_t ldq, std::int64_t rows, std::int64_t d, int top, std::uint16_t* panel,
            float* unit);

// ScoreKeys4 of fp16_decode.hpp on bf16 dot products, for e4m3 codes only (`codes` must be
// e4m3: decode_bf16 scores int8 K codes on int8dot::ScoreKeys4).
void ScoreKeys4(KvCodes codes, const std::uint16_t* panels, std::int64_t panel_count, std::int64_t head_panels,
                const unsigned char* const* krows, std::int64_t k_head, std::int64_t count, std::int64_t d, float* s,
                std::int64_t lds, const fp16dot::Fetch& fetch);

// dst[c] = the bf16 of src[2c] (low half) and of src[2c + 1] (high half), c < n / 2 (n even):
// P in pairs of keys as AccumulateRows4 reads it. In place (dst == src) is allowed.
void PairKeys(const float* src, std::uint32_t* dst, std::int64_t n);

// o[r·ldo + e] += unit · Σ_{c < n} p_r[c] · (code e of vrows[c] + offset, read as the header
// says) for r < 4, e < dv; p_r[c] the bf16 in word c of row r's pairs at p + r·ldp, as
// PairKeys wrote them (|p| ≤ 2^kTop).
void AccumulateRows4(KvCodes codes, const std::uint32_t* p, std::int64_t ldp, const unsigned char* const* vrows,
                     std::int64_t offset, std::int64_t n, std::int64_t dv, float unit, float* o, std::int64_t ldo);

}  // namespace flashattn::cpu::bf16decode
