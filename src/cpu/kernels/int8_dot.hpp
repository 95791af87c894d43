// The scores of a quantized decode over int8 K codes (u8 or s8, kv_quant.hpp) on AVX512-VNNI's
// integer dot products (VPDPBUSD: four products of an unsigned and a signed byte added to a
// 32-bit lane, exactly) — the S = Q·Kᵀ half of decode_bf16 whenever K holds int8 codes (its
// P·V stays on bf16), in place of widening every code to float32 and narrowing it to bf16.
// The codes go in as they are stored:
//   q rows are scaled by a power of two to a largest magnitude in [2^(kTop − 1), 2^kTop) and
//     rounded to integers (|error| ≤ 1/2 of the row's unit 2^-k, against the 2^-9 or 2^-12
//     relative rounding of bf16 or half; non-finite rows get a NaN unit, so their scores are
//     NaN, not wrapped integers); each integer q = 256·hi + lo, hi and lo signed bytes
//     (|hi| ≤ 2^(kTop − 8), lo in [−128, 128)), the two planes side by side in one vector;
//   codes are read as unsigned bytes — u8 as stored, s8 plus 128 (the top bit flipped) — and
//     broadcast to both planes, so one VPDPBUSD adds four products of each plane;
//   every product and sum is an exact integer (for any head dim the library takes, ≤ 576:
//     |hi sum| ≤ 576 · 64 · 255 < 2^24, |lo sum| ≤ 576 · 128 · 255 < 2^25), and a key's
//     score 256·Σhi + Σlo is formed in float32 (Σhi exact, Σlo and the sum each rounded
//     once, 2^-24 relative).
// So the scores are Q·(code + 128·[s8]) in q units: the caller takes 128·ΣQ back (for u8, whose
// codes the other kernels read as code − 128, the same 128). Compiled once for the baseline
// ISA, each function carrying the instructions in its target attribute; callers reach it only
// where available() says so.
#pragma once

#include <cstdint>

#include "flashattn/kv_quant.hpp"
#include "src/cpu/kernels/fp16_decode.hpp"

namespace flashattn::cpu::int8dot {

// q rows are brought below 2^kTop and rounded to integers, so that hi = ⌊(q + 128) / 256⌋ is a
// signed byte (|hi| ≤ 64) and the hi sums stay exact in float32 after the ×256.
constexpr int kTop = 14;

// True when the CPU has AVX512-VNNI with AVX512BW and AVX512VL.
bool available();

// The Q panel of four rows (of rows < 4 real ones, the others zero) in the layout of
// fp16_decode.hpp's PackQ4, 64 bytes per vector: vector j of row r at byte (4j + r)·64 of
// panel holds the hi bytes of elements [32j, 32j + 32) then their lo bytes, zeros past d;
// unit[r] = 2^-k_r, what the row's scores are to be multiplied by (NaN for a row with a
// non-finite element). top: kTop.
void PackQ4(const float* q, std::int64_t ldq, std::int64_t rows, std::int64_t d, int top, std::uint16_t* panel,
            float* unit);

// fp16_decode.hpp's ScoreKeys4 on u8 or s8 codes: s[(4i + r)·lds + k] = (row r of panel i)·
// (the d codes at krows[k] + g·k_head read as unsigned: u8 as stored, s8 + 128).
void ScoreKeys4(KvCodes codes, const std::uint16_t* panels, std::int64_t panel_count, std::int64_t head_panels,
                const unsigned char* const* krows, std::int64_t k_head, std::int64_t count, std::int64_t d, float* s,
                std::int64_t lds, const fp16dot::Fetch& fetch);

}  // namespace flashattn::cpu::int8dot
