// FP8 formats (scalar and vectorised conversions), FP8 tensors with per-tensor and
// per-block scales, the Hadamard rotation, and the FP8 forward against the float64
// reference on the dequantized inputs.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "src/core/element.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

constexpr Fp8Format kFormats[] = {Fp8Format::e4m3, Fp8Format::e5m2};

bool is_nan_code(std::uint8_t code, Fp8Format f) { return std::isnan(fp8_to_float(code, f)); }

TEST(Fp8, KnownCodes) {
  EXPECT_EQ(fp8_to_float(0x38, Fp8Format::e4m3), 1.0f);
  EXPECT_EQ(fp8_to_float(0x7E, Fp8Format::e4m3), 448.0f);
  EXPECT_EQ(fp8_to_float(0x08, Fp8Format::e4m3), 0x1p-6f);
  EXPECT_EQ(fp8_to_float(0x01, Fp8Format::e4m3), 0x1p-9f);
  EXPECT_EQ(fp8_to_float(0xB8, Fp8Format::e4m3), -1.0f);
  EXPECT_TRUE(std::isnan(fp8_to_float(0x7F, Fp8Format::e4m3)));
  EXPECT_TRUE(std::isnan(fp8_to_float(0xFF, Fp8Format::e4m3)));
  EXPECT_EQ(fp8_to_float(0x3C, Fp8Format::e5m2), 1.0f);
  EXPECT_EQ(fp8_to_float(0x7B, Fp8Format::e5m2), 57344.0f);
  EXPECT_EQ(fp8_to_float(0x04, Fp8Format::e5m2), 0x1p-14f);
  EXPECT_EQ(fp8_to_float(0x01, Fp8Format::e5m2), 0x1p-16f);
  EXPECT_EQ(fp8_to_float(0x7C, Fp8Format::e5m2), std::numeric_limits<float>::infinity());
  EXPECT_EQ(fp8_to_float(0xFC, Fp8Format::e5m2), -std::numeric_limits<float>::infinity());
  for (std::uint8_t c : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) EXPECT_TRUE(std::isnan(fp8_to_float(c, Fp8Format::e5m2)));
  EXPECT_TRUE(std::signbit(fp8_to_float(0x80, Fp8Format::e4m3)));  // −0
}

TEST(Fp8, EveryCodeRoundTripsAndPositiveCodesAreMonotonic) {
  for (Fp8Format f : kFormats) {
    SCOPED_TRACE(to_string(f));
    const Fp8Info info = fp8_info(f);
    for (int c = 0; c < 256; ++c) {
      const auto code = static_cast<std::uint8_t>(c);
      const float x = fp8_to_float(code, f);
      if (std::isnan(x)) {
        EXPECT_EQ(float_to_fp8(x, f), info.nan_code | (code & 0x80)) << "code " << c;
      } else if (std::isinf(x)) {  // e5m2's ±∞ saturates (satfinite)
        EXPECT_EQ(float_to_fp8(x, f), info.max_code | (code & 0x80)) << "code " << c;
      } else {
        EXPECT_EQ(float_to_fp8(x, f), code) << "code " << c << " value " << x;
      }
    }
    for (int c = 1; c <= info.max_code; ++c)
      EXPECT_LT(fp8_to_float(static_cast<std::uint8_t>(c - 1), f), fp8_to_float(static_cast<std::uint8_t>(c), f));
    EXPECT_EQ(fp8_to_float(info.max_code, f), info.max);
  }
}

TEST(Fp8, TiesRoundToTheEvenCodeAndEverythingElseToTheNearest) {
  for (Fp8Format f : kFormats) {
    SCOPED_TRACE(to_string(f));
    for (int c = 0; c < fp8_info(f).max_code; ++c) {
      const auto lo = static_cast<std::uint8_t>(c), hi = static_cast<std::uint8_t>(c + 1);
      const float a = fp8_to_float(lo, f), b = fp8_to_float(hi, f);
      const float mid = (a + b) / 2.0f;  // exact: both have few mantissa bits
      for (float sign : {1.0f, -1.0f}) {
        const std::uint8_t s = sign < 0 ? 0x80 : 0x00;
        EXPECT_EQ(float_to_fp8(sign * mid, f), s | ((lo & 1) == 0 ? lo : hi)) << "tie between codes " << c << ", " << c + 1;
        EXPECT_EQ(float_to_fp8(sign * std::nextafter(mid, 0.0f), f), s | lo);
        EXPECT_EQ(float_to_fp8(sign * std::nextafter(mid, 1e9f), f), s | hi);
      }
    }
  }
}

TEST(Fp8, SaturatesAndKeepsNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  for (Fp8Format f : kFormats) {
    SCOPED_TRACE(to_string(f));
    const Fp8Info info = fp8_info(f);
    for (float big : {info.max * 1.0001f, info.max * 1.2f, 1e30f, inf}) {
      EXPECT_EQ(float_to_fp8(big, f), info.max_code) << big;
      EXPECT_EQ(float_to_fp8(-big, f), 0x80 | info.max_code) << -big;
    }
    EXPECT_EQ(float_to_fp8(std::nanf(""), f), info.nan_code);
    EXPECT_EQ(float_to_fp8(-std::nanf(""), f), 0x80 | info.nan_code);
    EXPECT_EQ(float_to_fp8(1e-30f, f), 0x00);  // underflow to +0, −0 keeps its sign
    EXPECT_EQ(float_to_fp8(-1e-30f, f), 0x80);
  }
  EXPECT_EQ(float_to_fp8(464.0f, Fp8Format::e4m3), 0x7E);  // halfway to 480 (not a value): max
}

// Inputs that exercise every rounding case: each code's value, the midpoints and their
// neighbours, random magnitudes over the whole range, specials.
std::vector<float> conversion_inputs(Fp8Format f) {
  std::vector<float> x;
  for (int c = 0; c < 256; ++c) {
    const float a = fp8_to_float(static_cast<std::uint8_t>(c), f);
    x.push_back(a);
    if ((c & 0x7F) == 0x7F) continue;
    const float b = fp8_to_float(static_cast<std::uint8_t>(c + 1), f);  // next magnitude, same sign
    if (std::isfinite(a) && std::isfinite(b)) {
      const float mid = (a + b) / 2.0f;
      x.insert(x.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, a < 0 ? -1e9f : 1e9f)});
    }
  }
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> log2_magnitude(-20.0f, 18.0f);
  for (int i = 0; i < 5000; ++i) x.push_back((i % 2 ? -1.0f : 1.0f) * std::exp2(log2_magnitude(rng)));
  x.insert(x.end(), {0.0f, -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                     std::nanf(""), 1e30f, -1e30f});
  x.push_back(1.0f);  // an odd length: the scalar tail too
  return x;
}

TEST(Fp8, BulkConversionsEqualTheScalarOnesOnEverySimdTarget) {
  for (Fp8Format f : kFormats) {
    SCOPED_TRACE(to_string(f));
    const std::vector<float> x = conversion_inputs(f);
    std::vector<std::uint8_t> all_codes(256);
    for (int c = 0; c < 256; ++c) all_codes[c] = static_cast<std::uint8_t>(c);
    for_each_simd_target([&](const std::string&) {
      for (float scale : {1.0f, 0.37f}) {
        std::vector<std::uint8_t> codes(x.size());
        convert_to_fp8(x.data(), codes.data(), x.size(), f, scale);
        for (std::size_t i = 0; i < x.size(); ++i)
          ASSERT_EQ(codes[i], float_to_fp8(x[i] * scale, f)) << "x = " << x[i] << " scale " << scale;
        std::vector<float> back(all_codes.size());
        convert_from_fp8(all_codes.data(), back.data(), all_codes.size(), f, scale);
        for (int c = 0; c < 256; ++c) {
          const float want = fp8_to_float(static_cast<std::uint8_t>(c), f) * scale;
          if (std::isnan(want)) {
            EXPECT_TRUE(std::isnan(back[c])) << "code " << c;
          } else {
            EXPECT_EQ(back[c], want) << "code " << c;
          }
        }
      }
    });
  }
}

TEST(Fp8, QuantizeScalesEachTensorOrBlockToTheFormatsMax) {
  Tensor x = random_tensor(DType::f32, {2, 70, 3, 16}, 5);
  x.set(17 * 3 * 16 + 5, 40.0f);  // an outlier in block 0 of (batch 0, head 0)
  for (Fp8Format f : kFormats) {
    SCOPED_TRACE(to_string(f));
    const float max = fp8_info(f).max;
    const Fp8Tensor t = quantize_fp8(x.view(), f);
    ASSERT_EQ(t.descale.numel(), 1);
    EXPECT_FLOAT_EQ(t.descale.get(0), 40.0f / max);
    const Tensor back = dequantize_fp8(t.view());
    for (std::int64_t e = 0; e < x.numel(); ++e) {
      // Half a unit in the last of `mantissa_bits` bits, relative, for normal values.
      const double half_ulp = std::ldexp(1.0, -fp8_info(f).mantissa_bits - 1);
      if (std::fabs(x.get(e)) >= 0.1f) ASSERT_LE(std::fabs(back.get(e) - x.get(e)), half_ulp * std::fabs(x.get(e)) * 1.0001);
    }

    const std::int64_t block = 32;
    const Fp8Tensor b = quantize_fp8(x.view(), f, block);
    ASSERT_EQ(b.descale.shape(), (std::vector<std::int64_t>{2, 3, 3}));
    for (std::int64_t bb = 0; bb < 2; ++bb)
      for (std::int64_t h = 0; h < 3; ++h)
        for (std::int64_t blk = 0; blk < 3; ++blk) {
          float amax = 0.0f;
          for (std::int64_t s = blk * block; s < std::min<std::int64_t>(70, (blk + 1) * block); ++s)
            for (std::int64_t c = 0; c < 16; ++c) amax = std::fmax(amax, std::fabs(x.get(((bb * 70 + s) * 3 + h) * 16 + c)));
          EXPECT_FLOAT_EQ(b.descale.get((bb * 3 + h) * 3 + blk), amax / max);
        }
    const Tensor back_b = dequantize_fp8(b.view());
    EXPECT_NEAR(back_b.get(17 * 3 * 16 + 5), 40.0f, 1e-5f);
  }
}

// Blocks of tiny values (amax below 448·FLT_MIN): descale = amax / max would make 1 / descale
// +∞ — zeros encoded as 0·∞ = NaN, everything else as ±max — or round to 0 (an invalid
// descale). At least FLT_MIN, the codes stay finite and dequantize within half a unit.
TEST(Fp8, QuantizeTinyBlocksKeepsEveryCodeFinite) {
  for (Fp8Format f : kFormats)
    for (const float t : {1e-30f, 1e-37f, 1e-44f}) {
      SCOPED_TRACE(std::string(to_string(f)) + " t " + std::to_string(t));
      Tensor x(DType::f32, {1, 1, 1, 4});
      x.set(0, 0.0f), x.set(1, t), x.set(2, -t / 2), x.set(3, t / 3);
      const Fp8Tensor q = quantize_fp8(x.view(), f);
      const float descale = q.descale.get(0);
      ASSERT_TRUE(std::isfinite(descale) && descale >= FLT_MIN) << descale;
      const Tensor back = dequantize_fp8(q.view());
      const double half_ulp = std::ldexp(1.0, -fp8_info(f).mantissa_bits - 1);
      // Half a unit relative, or half the smallest subnormal step absolute.
      const double floor = std::ldexp(1.0, 1 - fp8_info(f).bias - fp8_info(f).mantissa_bits - 1) * descale;
      for (std::int64_t e = 0; e < 4; ++e)
        EXPECT_LE(std::fabs(back.get(e) - x.get(e)), std::max(half_ulp * std::fabs(x.get(e)) * 1.0001, floor)) << e;
    }
}

TEST(Fp8, QuantizeAndDequantizeRejectBadInput) {
  Tensor x = random_tensor(DType::f32, {1, 4, 1, 8}, 6);
  x.set(9, std::numeric_limits<float>::infinity());
  expect_error([&] { quantize_fp8(x.view(), Fp8Format::e4m3); }, {"x: element (0, 1, 0, 1)", "inf"});
  expect_error([&] { quantize_fp8(random_tensor(DType::f32, {1, 4, 1, 8}, 6).view(), Fp8Format::e4m3, -2); },
               {"block_size", "-2"});
  Fp8Tensor t = quantize_fp8(random_tensor(DType::f32, {1, 4, 1, 8}, 7).view(), Fp8Format::e4m3, 2);
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(), std::nanf("")}) {
    t.descale.set(1, bad);
    expect_error([&] { dequantize_fp8(t.view()); }, {"x.descale: entry (0, 0, 1)", "finite and > 0"});
  }
  Fp8View wrong = t.view();
  wrong.block_size = 1;  // implies 4 blocks; descale has 2
  expect_error([&] { dequantize_fp8(wrong); }, {"x.descale", "(1, 1, 4)"});
  expect_error([] { parse_fp8_format("e3m4"); }, {"e3m4", "e4m3 or e5m2"});
}

// R = H·diag(signs)/√n as the rotation of the rows of the identity.
std::vector<float> rotation_matrix(std::int64_t n, std::uint64_t seed) {
  Tensor eye(DType::f32, {1, n, 1, n});
  for (std::int64_t i = 0; i < n; ++i) eye.set(i * n + i, 1.0f);
  const Tensor r = hadamard_rotate(eye.view(), seed);
  return {r.data_as<float>(), r.data_as<float>() + n * n};
}

TEST(Hadamard, RotationIsOrthogonalWithEntriesOfMagnitudeOneOverSqrtN) {
  for (std::int64_t n : {1, 2, 4, 8, 64, 128, 512}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const std::vector<float> r = rotation_matrix(n, 42);
    for (float e : r) ASSERT_NEAR(std::fabs(e), 1.0 / std::sqrt(static_cast<double>(n)), 1e-6);
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        double dot = 0.0;
        for (std::int64_t c = 0; c < n; ++c) dot += static_cast<double>(r[i * n + c]) * r[j * n + c];
        ASSERT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-5) << i << ", " << j;
      }
  }
  EXPECT_NE(rotation_matrix(64, 1), rotation_matrix(64, 2));  // the signs depend on the seed
}

TEST(Hadamard, ScoresAreUnchangedAndOutliersSpread) {
  for (std::int64_t d : {128, 100}) {  // 100: zero-padded to 128
    SCOPED_TRACE("d = " + std::to_string(d));
    const Tensor q = random_tensor(DType::bf16, {1, 9, 2, d}, 1), k = random_tensor(DType::bf16, {1, 11, 2, d}, 2);
    const Tensor qr = hadamard_rotate(q.view(), 7), kr = hadamard_rotate(k.view(), 7);
    ASSERT_EQ(qr.shape()[3], 128);
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t i = 0; i < 9; ++i)
        for (std::int64_t j = 0; j < 11; ++j) {
          double want = 0.0, got = 0.0, magnitude = 0.0;
          for (std::int64_t c = 0; c < d; ++c) {
            want += static_cast<double>(q.get((i * 2 + h) * d + c)) * k.get((j * 2 + h) * d + c);
            magnitude += std::fabs(static_cast<double>(q.get((i * 2 + h) * d + c)) * k.get((j * 2 + h) * d + c));
          }
          for (std::int64_t c = 0; c < 128; ++c)
            got += static_cast<double>(qr.get((i * 2 + h) * 128 + c)) * kr.get((j * 2 + h) * 128 + c);
          // float32 rounding of log2(128) butterfly passes on each side: a few ulps of Σ|q·k|.
          ASSERT_NEAR(got, want, 1e-5 * magnitude) << i << ", " << j;
        }
  }
  Tensor spike(DType::f32, {1, 1, 1, 64});
  spike.set(3, 100.0f);
  const Tensor spread = hadamard_rotate(spike.view(), 9);
  for (std::int64_t c = 0; c < 64; ++c) EXPECT_NEAR(std::fabs(spread.get(c)), 100.0 / 8.0, 1e-4);
}

TEST(Hadamard, RejectsAnOutputOfTheWrongSize) {
  const Tensor x = random_tensor(DType::f32, {1, 3, 1, 100}, 1);
  Tensor y(DType::f32, {1, 3, 1, 100});
  expect_error([&] { hadamard_rotate(x.view(), y.view(), 1); }, {"y: last dim 100 must be 128", "power of two"});
  Tensor y16(DType::bf16, {1, 3, 1, 128});
  expect_error([&] { hadamard_rotate(x.view(), y16.view(), 1); }, {"y", "f32"});
}

// Naive FP8 attention on the dequantized inputs, in the precision a tensor core uses: S in
// float32, P = exp(S − rowmax) rounded to e4m3, O = Σ P·V / Σ exp(S − rowmax) in float32,
// rounded to out's dtype. Its error against float64 sets the tolerance (2×, upstream's rule).
std::vector<double> naive_fp8(const AttentionProblem& p, const AttentionOptions& options, const Tensor& q,
                              const Tensor& k, const Tensor& v, DType out_dtype) {
  const reference::Semantics sem{&p, &options};
  std::vector<double> out(static_cast<std::size_t>(p.batch * p.seqlen_q * p.heads_q * p.head_dim_v));
  std::vector<float> s(static_cast<std::size_t>(p.seqlen_k));
  const std::int64_t group = p.heads_q / p.heads_kv;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads_q; ++h)
      for (std::int64_t i = 0; i < p.seqlen_q; ++i) {
        float m = -INFINITY, sum = 0.0f;
        for (std::int64_t j = 0; j < p.seqlen_k; ++j) {
          s[j] = -INFINITY;
          if (!sem.visible(i, j)) continue;
          float dot = 0.0f;
          for (std::int64_t c = 0; c < p.head_dim; ++c)
            dot += q.get(((b * p.seqlen_q + i) * p.heads_q + h) * p.head_dim + c) *
                   k.get(((b * p.seqlen_k + j) * p.heads_kv + h / group) * p.head_dim + c);
          s[j] = dot * p.softmax_scale;
          m = std::fmax(m, s[j]);
        }
        if (p.sinks) {  // the sink: in the denominator, with no value
          const float sink = static_cast<float>(sem.sink(h));
          m = std::fmax(m, sink);
          sum = std::exp(sink - m);
        }
        for (std::int64_t j = 0; j < p.seqlen_k; ++j) {
          const float e = std::exp(s[j] - m);
          sum += e;
          s[j] = fp8_to_float(float_to_fp8(e, Fp8Format::e4m3), Fp8Format::e4m3);
        }
        for (std::int64_t c = 0; c < p.head_dim_v; ++c) {
          float acc = 0.0f;
          for (std::int64_t j = 0; j < p.seqlen_k; ++j)
            acc += s[j] * v.get(((b * p.seqlen_k + j) * p.heads_kv + h / group) * p.head_dim_v + c);
          out[static_cast<std::size_t>(((b * p.seqlen_q + i) * p.heads_q + h) * p.head_dim_v + c)] =
              round_to(out_dtype, acc / sum);
        }
      }
  return out;
}

// Each case's float32 inputs quantized to `format` with per-tensor (block 0) or per-block
// scales; out in `out`.
struct Quantization {
  Fp8Format format;
  std::int64_t block;
  DType out;
};

TEST(Fp8Forward, MatchesTheReferenceOnTheDequantizedInputs) {
  AttentionOptions full, causal, sinks;
  full.num_threads = causal.num_threads = sinks.num_threads = 2;
  causal.causal = sinks.causal = true;
  Tensor sink_logits(DType::f32, {4});
  for (std::int64_t h = 0; h < 4; ++h) sink_logits.set(h, 2.0f - static_cast<float>(h));
  sinks.sinks = sink_logits.view();
  const std::pair<Case, Quantization> cases[] = {
      {Case({1, 77, 131, 2, 1, 64, 64}, DType::f32, full, 900), {Fp8Format::e4m3, 0, DType::f32}},
      {Case({2, 65, 190, 4, 2, 32, 48}, DType::f32, causal, 903), {Fp8Format::e4m3, 64, DType::bf16}},
      {Case({1, 1, 300, 4, 1, 64, 64}, DType::f32, full, 906), {Fp8Format::e5m2, 32, DType::f32}},  // the decode kernel
      {Case({1, 129, 129, 1, 1, 128, 128}, DType::f32, causal, 909), {Fp8Format::e5m2, 0, DType::f16}},
      {Case({2, 65, 190, 4, 2, 32, 48}, DType::f32, sinks, 912), {Fp8Format::e4m3, 64, DType::f32}},
      {Case({1, 2, 300, 4, 1, 64, 64}, DType::f32, sinks, 915), {Fp8Format::e4m3, 0, DType::f32}},  // decode
  };
  for (const auto& [c, quant] : cases) {
    SCOPED_TRACE(c.describe() + " " + to_string(quant.format) + " block " + std::to_string(quant.block) + " out " +
                 to_string(quant.out));
    const Inputs in = c.inputs();
    const Fp8Tensor q = quantize_fp8(in.q.view(), quant.format, quant.block);
    const Fp8Tensor k = quantize_fp8(in.k.view(), quant.format, quant.block);
    const Fp8Tensor v = quantize_fp8(in.v.view(), quant.format, quant.block);
    const AttentionOptions& options = c.options();
    const ForwardResult got = forward_fp8(q.view(), k.view(), v.view(), quant.out, options);
    const Tensor qf = dequantize_fp8(q.view()), kf = dequantize_fp8(k.view()), vf = dequantize_fp8(v.view());
    const reference::Result want = reference::attention(qf.view(), kf.view(), vf.view(), options);
    const double naive =
        yardstick_error(naive_fp8(c.problem(), options, qf, kf, vf, quant.out), want.out, "the naive FP8 output", kNaiveOutputShare);
    EXPECT_LE(max_abs_error(got.out, want.out), 2.0 * naive + 1e-5);
    for (std::int64_t i = 0; i < got.lse.numel(); ++i)
      ASSERT_NEAR(got.lse.get(i), want.lse[static_cast<std::size_t>(i)], 1e-4) << "lse " << i;
    // P really is rounded to FP8: the float32 forward on the same values is much closer.
    const ForwardResult exact = forward(qf.view(), kf.view(), vf.view(), options);
    EXPECT_GT(max_abs_error(got.out, want.out), 10.0 * max_abs_error(exact.out, want.out));
  }
}

TEST(Fp8Forward, RejectsBadDescalesCodesAndThresholds) {
  const Fp8Tensor q = quantize_fp8(random_tensor(DType::f32, {1, 8, 2, 16}, 1).view(), Fp8Format::e4m3);
  const Fp8Tensor k = quantize_fp8(random_tensor(DType::f32, {1, 9, 2, 16}, 2).view(), Fp8Format::e4m3, 4);
  const Fp8Tensor v = quantize_fp8(random_tensor(DType::f32, {1, 9, 2, 16}, 3).view(), Fp8Format::e4m3);
  Tensor bad_descale(DType::f32, {1});
  bad_descale.set(0, -0.5f);
  Fp8View qb = q.view();
  qb.descale = bad_descale.view();
  expect_error([&] { forward_fp8(qb, k.view(), v.view(), DType::f32); }, {"q.descale", "-0.5", "finite and > 0"});
  // NaN codes (and e5m2's ±∞) stand for no value an attention could use: named, not read.
  Fp8Tensor k_nan = quantize_fp8(random_tensor(DType::f32, {1, 9, 2, 16}, 2).view(), Fp8Format::e4m3, 4);
  k_nan.codes.data_as<std::uint8_t>()[(1 * 2 + 0) * 16 + 3] = 0xFF;
  expect_error([&] { forward_fp8(q.view(), k_nan.view(), v.view(), DType::f32); },
               {"k.codes: entry (0, 1, 0, 3)", "code 255", "NaN"});
  expect_error([&] { dequantize_fp8(k_nan.view()); }, {"x.codes: entry (0, 1, 0, 3)", "NaN"});
  Fp8Tensor v_inf = quantize_fp8(random_tensor(DType::f32, {1, 9, 2, 16}, 3).view(), Fp8Format::e5m2);
  v_inf.codes.data_as<std::uint8_t>()[(8 * 2 + 1) * 16 + 15] = 0x7C;  // e5m2 +∞
  expect_error([&] { forward_fp8(q.view(), k.view(), v_inf.view(), DType::f32); },
               {"v.codes: entry (0, 8, 1, 15)", "code 124", "NaN or infinite", "e5m2"});
  Fp8View kb = k.view();
  kb.codes = random_tensor(DType::f32, {1, 9, 2, 16}, 4).view();
  expect_error([&] { forward_fp8(q.view(), kb, v.view(), DType::f32); }, {"k.codes", "u8"});
  AttentionOptions options;
  options.rescale_threshold = 9.0f;
  expect_error([&] { forward_fp8(q.view(), k.view(), v.view(), DType::f32, options); },
               {"rescale_threshold", "at most 8", "9"});
  Tensor out(DType::u8, {1, 8, 2, 16}), lse(DType::f32, {1, 2, 8});
  expect_error([&] { forward_fp8(q.view(), k.view(), v.view(), out.view(), lse.view()); }, {"out", "u8", "floating"});
  // Outputs apart from the descales and the options' inputs, as forward()'s from its inputs.
  Tensor out_f(DType::f32, {1, 8, 2, 16});
  Fp8View q_in_out = q.view();
  out_f.set(0, 1.0f);  // a valid descale, until the call would write it
  q_in_out.descale = TensorView(out_f.data(), DType::f32, {1});
  expect_error([&] { forward_fp8(q_in_out, k.view(), v.view(), out_f.view(), lse.view()); },
               {"out: output memory overlaps input q_descale"});
  AttentionOptions sinks_in_lse;
  sinks_in_lse.sinks = TensorView(lse.data(), DType::f32, {2});
  expect_error([&] { forward_fp8(q.view(), k.view(), v.view(), out_f.view(), lse.view(), sinks_in_lse); },
               {"lse: output memory overlaps input sinks"});
}

}  // namespace
}  // namespace flashattn::test
