// int8 KV caches (include/flashattn/kv_quant.hpp): u8 codes with scales and zero points and
// s8 codes with scales, per (page, kv head) or per token, K and V in formats of their own.
// The quantization an append applies within its stated bound; every kernel (decode, tiled)
// and both entry points (forward_with_kvcache, forward_varlen_paged) against the float64
// reference on the dequantized values; appends that write nothing beyond their slots; bad
// scales, zero points and formats rejected by name before anything is written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "src/cpu/planner.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

constexpr KvQuant kU8Token{KvCodes::u8, KvScaleGranularity::per_token};
constexpr KvQuant kU8Page{KvCodes::u8, KvScaleGranularity::per_page};
constexpr KvQuant kS8Token{KvCodes::s8, KvScaleGranularity::per_token};
constexpr KvQuant kS8Page{KvCodes::s8, KvScaleGranularity::per_page};
constexpr KvQuant kE4m3{};

std::string name(const KvQuant& q) { return std::string(to_string(q.codes)) + " " + to_string(q.granularity); }

// The bound kv_quant.hpp states for an appended x: (1/2 + 2^-23·(1 + |zero_point|))·scale.
double stated_bound(float scale, float zero_point) {
  return (0.5 + 0x1p-23 * (1.0 + std::fabs(static_cast<double>(zero_point)))) * static_cast<double>(scale);
}

// One quantized pool: codes (pages, slots, heads, dim), its scales and zero points as its
// format shapes them.
struct Pool {
  KvQuant quant;
  Tensor codes, scale, zero;
  static constexpr std::uint8_t kGuard = 0x55;
  static constexpr float kScaleGuard = -3.0f;

  Pool(KvQuant q, std::int64_t pages, std::int64_t slots, std::int64_t heads, std::int64_t dim) : quant(q) {
    codes = Tensor(DType::u8, {pages, slots, heads, dim});
    std::memset(codes.data(), kGuard, static_cast<std::size_t>(codes.numel()));
    const bool token = q.granularity == KvScaleGranularity::per_token;
    scale = token ? Tensor(DType::f32, {pages, slots, heads}) : Tensor(DType::f32, {pages, heads});
    for (std::int64_t i = 0; i < scale.numel(); ++i) scale.set(i, kScaleGuard);
    if (q.codes == KvCodes::u8) {
      zero = token ? Tensor(DType::f32, {pages, slots, heads}) : Tensor(DType::f32, {pages, heads});
      for (std::int64_t i = 0; i < zero.numel(); ++i) zero.set(i, kScaleGuard);
    }
  }
  std::int64_t heads() const { return codes.shape()[2]; }
  std::int64_t dim() const { return codes.shape()[3]; }
  std::int64_t at(std::int64_t page, std::int64_t slot, std::int64_t h) const {
    return quant.granularity == KvScaleGranularity::per_token ? (page * codes.shape()[1] + slot) * heads() + h
                                                              : page * heads() + h;
  }
  std::uint8_t& code(std::int64_t page, std::int64_t slot, std::int64_t h, std::int64_t e) {
    return codes.data_as<std::uint8_t>()[((page * codes.shape()[1] + slot) * heads() + h) * dim() + e];
  }
  float scale_of(std::int64_t page, std::int64_t slot, std::int64_t h) const { return scale.get(at(page, slot, h)); }
  float zero_of(std::int64_t page, std::int64_t slot, std::int64_t h) const {
    return quant.codes == KvCodes::u8 ? zero.get(at(page, slot, h)) : 0.0f;
  }
  // A code as decode_fp16 reads it: the e4m3 value, s8 as the integer, u8 as code − 128;
  // and the zero point likewise (z − 128 for u8, else 0).
  float code_read(std::int64_t page, std::int64_t slot, std::int64_t h, std::int64_t e) {
    const std::uint8_t c = code(page, slot, h, e);
    if (quant.codes == KvCodes::e4m3) return fp8_to_float(c, Fp8Format::e4m3);
    return quant.codes == KvCodes::s8 ? static_cast<float>(static_cast<std::int8_t>(c)) : static_cast<float>(c) - 128.0f;
  }
  float zero_read(std::int64_t page, std::int64_t slot, std::int64_t h) const {
    return quant.codes == KvCodes::u8 ? zero_of(page, slot, h) - 128.0f : 0.0f;
  }
  float value(std::int64_t page, std::int64_t slot, std::int64_t h, std::int64_t e) {
    const std::uint8_t c = code(page, slot, h, e);
    if (quant.codes == KvCodes::e4m3) return fp8_to_float(c, Fp8Format::e4m3) * scale_of(page, slot, h);
    return int8_code_value(quant.codes, c, scale_of(page, slot, h), zero_of(page, slot, h));
  }
  // Random codes (every byte; no e4m3 NaN) and random scales and zero points everywhere:
  // values of a few units at most, as a cache's keys and values are.
  void fill_random(std::mt19937_64& rng) {
    for (std::int64_t i = 0; i < codes.numel(); ++i) {
      std::uint8_t c;
      do c = static_cast<std::uint8_t>(rng()); while (quant.codes == KvCodes::e4m3 && (c & 0x7F) == 0x7F);
      codes.data_as<std::uint8_t>()[i] = c;
    }
    std::uniform_real_distribution<float> unit(0.5f, 2.0f), zero_points(90.0f, 160.0f);
    constexpr float base = 0x1p-7f;
    for (std::int64_t i = 0; i < scale.numel(); ++i) scale.set(i, base * unit(rng));
    if (quant.codes == KvCodes::u8)
      for (std::int64_t i = 0; i < zero.numel(); ++i) zero.set(i, zero_points(rng));
  }
  void attach(KvCache& c, bool is_k) {
    (is_k ? c.k_cache : c.v_cache) = codes.view();
    (is_k ? c.k_scale : c.v_scale) = scale.view();
    (is_k ? c.k_quant : c.v_quant) = quant;
    if (quant.codes == KvCodes::u8) (is_k ? c.k_zero_point : c.v_zero_point) = zero.view();
  }
};

// A KV cache reading pool kp as K and vp as V, seqlens keys each.
KvCache cache_of(Pool& kp, Pool& vp, const Tensor& seqlens) {
  KvCache c;
  kp.attach(c, true);
  vp.attach(c, false);
  c.cache_seqlens = seqlens.view();
  return c;
}

// quantize_int8 (what an append does) stays within the stated bound: per token on rows of
// every kind — centred, offset far from 0, constant, all zero, tiny, huge — and per page on
// values within the page's range, while values beyond it saturate to the end codes.
TEST(Int8Cache, QuantizationWithinTheStatedBound) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float offsets[] = {0.0f, 3.0f, -1000.0f, 1e-30f};
  const float spreads[] = {1.0f, 1e-3f, 0.0f, 1e20f, 1e-30f};
  for (KvCodes codes : {KvCodes::u8, KvCodes::s8})
    for (float offset : offsets)
      for (float spread : spreads) {
        SCOPED_TRACE(std::string(to_string(codes)) + " offset " + std::to_string(offset) + " spread " +
                     std::to_string(spread));
        std::vector<float> x(37);
        for (float& e : x) e = offset + spread * normal(rng);
        std::vector<std::uint8_t> out(x.size());
        float scale = 0.0f, zero = 0.0f;
        quantize_int8(codes, x.data(), static_cast<std::int64_t>(x.size()), true, &scale, &zero, out.data());
        ASSERT_TRUE(std::isfinite(scale) && scale > 0.0f) << scale;
        ASSERT_TRUE(std::isfinite(zero)) << zero;
        double lo = x[0], hi = x[0], amax = 0.0;
        for (float e : x) lo = std::min<double>(lo, e), hi = std::max<double>(hi, e), amax = std::max<double>(amax, std::fabs(e));
        // The scale is the one the header states (to float32 rounding), or 1 for a row it
        // cannot step; a constant u8 row c: codes 128, scale |c| (1 for 0), stored exactly.
        const double step = codes == KvCodes::u8 ? (hi - lo) / 255.0 : amax / 127.0;
        if (codes == KvCodes::u8 && hi == lo) {
          EXPECT_EQ(scale, lo != 0.0 ? std::fabs(static_cast<float>(lo)) : 1.0f);
          EXPECT_EQ(zero, lo > 0.0 ? 127.0f : lo < 0.0 ? 129.0f : 128.0f);
          for (std::size_t i = 0; i < x.size(); ++i) {
            ASSERT_EQ(out[i], 128) << "element " << i;
            ASSERT_EQ(int8_code_value(codes, out[i], scale, zero), x[i]) << "element " << i;
          }
        } else if (step >= FLT_MIN) {
          EXPECT_NEAR(scale, step, step * 0x1p-23);
        } else {
          EXPECT_EQ(scale, step > 0.0 ? FLT_MIN : 1.0f);
        }
        for (std::size_t i = 0; i < x.size(); ++i) {
          if (codes == KvCodes::s8) ASSERT_GE(static_cast<std::int8_t>(out[i]), -127);
          const double got = (static_cast<double>(codes == KvCodes::u8 ? out[i] : static_cast<std::int8_t>(out[i])) -
                              (codes == KvCodes::u8 ? zero : 0.0)) * scale;
          ASSERT_LE(std::fabs(got - x[i]), stated_bound(scale, codes == KvCodes::u8 ? zero : 0.0f)) << "element " << i;
        }
      }
  // Rows whose step is subnormal (normal values a few subnormal units apart): a subnormal scale
  // rounded down would clamp the row's largest element at the last code, 63× the bound.
  {
    const float u = 0x1p-149f;
    const std::vector<float> tiny_u8 = {0x1p-126f, 0x1p-126f + 637 * u, 0x1p-126f + 300 * u};
    const std::vector<float> tiny_s8 = {0.0f, 317 * u, -100 * u};
    for (KvCodes codes : {KvCodes::u8, KvCodes::s8}) {
      SCOPED_TRACE(std::string("subnormal step, ") + to_string(codes));
      const std::vector<float>& x = codes == KvCodes::u8 ? tiny_u8 : tiny_s8;
      std::vector<std::uint8_t> out(x.size());
      float scale = 0.0f, zero = 0.0f;
      quantize_int8(codes, x.data(), static_cast<std::int64_t>(x.size()), true, &scale, &zero, out.data());
      EXPECT_EQ(scale, FLT_MIN);
      for (std::size_t i = 0; i < x.size(); ++i)
        ASSERT_LE(std::fabs(int8_code_value(codes, out[i], scale, zero) - static_cast<double>(x[i])),
                  stated_bound(scale, codes == KvCodes::u8 ? zero : 0.0f))
            << "element " << i;
    }
  }
  // Per page: the caller's scale and zero point; x within [(lo − z)·s, (hi − z)·s] is held
  // to the bound, x beyond saturates.
  for (KvCodes codes : {KvCodes::u8, KvCodes::s8}) {
    SCOPED_TRACE(to_string(codes));
    float scale = 0.03f, zero = codes == KvCodes::u8 ? 100.25f : 0.0f;
    const double lo = codes == KvCodes::u8 ? (0.0 - zero) * scale : -127.0 * scale;
    const double hi = codes == KvCodes::u8 ? (255.0 - zero) * scale : 127.0 * scale;
    std::vector<float> x;
    for (int i = 0; i <= 1000; ++i) x.push_back(static_cast<float>(lo + (hi - lo) * i / 1000.0));
    x.push_back(static_cast<float>(lo - 1.0)), x.push_back(static_cast<float>(hi + 5.0));
    std::vector<std::uint8_t> out(x.size());
    quantize_int8(codes, x.data(), static_cast<std::int64_t>(x.size()), false, &scale, &zero, out.data());
    EXPECT_EQ(scale, 0.03f) << "a per-page scale is the caller's";
    for (std::size_t i = 0; i + 2 < x.size(); ++i)
      ASSERT_LE(std::fabs(int8_code_value(codes, out[i], scale, zero) - static_cast<double>(x[i])),
                stated_bound(scale, zero))
          << "element " << i;
    EXPECT_EQ(int8_code_value(codes, out[x.size() - 2], scale, zero), int8_code_value(codes, codes == KvCodes::u8 ? 0 : 0x81, scale, zero));
    EXPECT_EQ(int8_code_value(codes, out[x.size() - 1], scale, zero), int8_code_value(codes, codes == KvCodes::u8 ? 255 : 127, scale, zero));
  }
  expect_error([] { float s = 1, z = 0; std::uint8_t o; quantize_int8(KvCodes::e4m3, &s, 1, true, &s, &z, &o); },
               {"quantize_int8", "e4m3", "not int8"});
}

// The formats of K and V a test runs: both int8 of each kind, and int8 beside e4m3.
struct Formats {
  KvQuant k, v;
};
const Formats kFormats[] = {{kU8Token, kU8Token}, {kS8Page, kS8Page}, {kU8Page, kS8Token}, {kS8Token, kU8Page},
                            {kE4m3, kU8Token}, {kS8Page, kE4m3}};

// Every kernel reads every code: caches of random codes (every byte) with random scales and
// zero points, K and V of each pair of formats, contiguous and paged (pages in reverse order)
// with 339 keys, head dims with ragged vector tails (D 40, Dv 24; D 3, Dv 5), GQA groups
// with padding rows; one query (decode) and seven (tiled), (splits, threads) (1, 1), (4, 2),
// (4, 3) and (1, 3), every compiled SIMD target; against the float64 reference on the dequantized
// values within upstream's rule: decode and tiled within twice a naive float32
// implementation's error, decode_fp16 and decode_bf16 (one query, where the CPU has
// AVX512-FP16, AVX512-BF16) within twice the error of their yardstick
// (narrow_precision_attention) or of one rounding of the largest value in half (bf16). Paged caches are also read through
// forward_varlen_paged, which must agree bit for bit.
TEST(Int8Cache, KernelsReadEveryCodeOnEveryLayout) {
  struct Shape {
    std::int64_t hq, hkv, d, dv;
  };
  const Shape shapes[] = {{6, 2, 40, 24}, {16, 2, 128, 128}, {2, 2, 3, 5}};
  constexpr std::int64_t keys = 339;
  for_each_simd_target([&](const std::string&) {
    for (const Formats& f : kFormats)
      for (const Shape& s : shapes)
        for (std::int64_t ps : {0, 3, 16}) {
          SCOPED_TRACE("K " + name(f.k) + ", V " + name(f.v) + ", Hq " + std::to_string(s.hq) + " Hkv " +
                       std::to_string(s.hkv) + " D " + std::to_string(s.d) + " Dv " + std::to_string(s.dv) +
                       (ps == 0 ? std::string(", contiguous") : ", page size " + std::to_string(ps)));
          const std::int64_t pages = ps > 0 ? (keys + ps - 1) / ps : 1, slots = ps > 0 ? ps : keys;
          Pool kp(f.k, pages, slots, s.hkv, s.d), vp(f.v, pages, slots, s.hkv, s.dv);
          std::mt19937_64 rng(90 + static_cast<std::uint64_t>(ps + s.d));
          kp.fill_random(rng);
          vp.fill_random(rng);
          Tensor table(DType::i32, {1, pages}), seqlens(DType::i32, {1});
          for (std::int64_t pg = 0; pg < pages; ++pg) table.set(pg, static_cast<float>(pages - 1 - pg));  // reversed
          seqlens.set(0, static_cast<float>(keys));
          Tensor k(DType::f32, {1, keys, s.hkv, s.d}), v(DType::f32, {1, keys, s.hkv, s.dv});  // dequantized
          // As the narrow kernels read them (narrow_precision_attention): codes, factors, zero points.
          Tensor kc(DType::f32, {1, keys, s.hkv, s.d}), vc(DType::f32, {1, keys, s.hkv, s.dv});
          Tensor kd(DType::f32, {1, keys, s.hkv}), vd(DType::f32, {1, keys, s.hkv});
          Tensor kz(DType::f32, {1, keys, s.hkv}), vz(DType::f32, {1, keys, s.hkv});
          double v_max = 0.0;
          for (std::int64_t pos = 0; pos < keys; ++pos) {
            const std::int64_t page = ps > 0 ? pages - 1 - pos / ps : 0, slot = ps > 0 ? pos % ps : pos;
            for (std::int64_t h = 0; h < s.hkv; ++h) {
              for (std::int64_t e = 0; e < s.d; ++e) {
                k.set((pos * s.hkv + h) * s.d + e, kp.value(page, slot, h, e));
                kc.set((pos * s.hkv + h) * s.d + e, kp.code_read(page, slot, h, e));
              }
              for (std::int64_t e = 0; e < s.dv; ++e) {
                v.set((pos * s.hkv + h) * s.dv + e, vp.value(page, slot, h, e));
                vc.set((pos * s.hkv + h) * s.dv + e, vp.code_read(page, slot, h, e));
                v_max = std::max(v_max, std::fabs(static_cast<double>(vp.value(page, slot, h, e))));
              }
              kd.set(pos * s.hkv + h, kp.scale_of(page, slot, h));
              vd.set(pos * s.hkv + h, vp.scale_of(page, slot, h));
              kz.set(pos * s.hkv + h, kp.zero_read(page, slot, h));
              vz.set(pos * s.hkv + h, vp.zero_read(page, slot, h));
            }
          }
          for (std::int64_t sq : {1, 7}) {
            const Tensor q = random_tensor(DType::f32, {1, sq, s.hq, s.d}, 91);
            AttentionOptions o;
            const AttentionProblem p = AttentionProblem::from_sizes(1, sq, keys, s.hq, s.hkv, s.d, s.dv, DType::f32, o);
            const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
            const double naive_float = naive_output_error(naive_same_precision(p, o, q, k, v), want.out, p.dtype, o.exp2);
            std::vector<ForwardKernel> kernels{sq == 1 ? ForwardKernel::decode : ForwardKernel::tiled};
            if (sq == 1)
              for (const ForwardKernel narrow : narrow_decode_kernels()) kernels.push_back(narrow);
            for (const ForwardKernel kernel : kernels) {
            const bool narrow = kernel != ForwardKernel::decode && kernel != ForwardKernel::tiled;
            const reference::Result yardstick =
                narrow ? narrow_precision_attention(kernel, q, kc, kd, vc, vd, o, &kz, &vz, f.k.codes != KvCodes::e4m3)
                       : reference::Result{};
            for (const auto& [splits, threads] : {std::pair{1, 1}, {4, 2}, {4, 3}, {1, 3}}) {
              o.kernel = kernel;
              o.num_splits = splits;
              o.num_threads = threads;
              SCOPED_TRACE(std::string(to_string(o.kernel)) + ", splits " + std::to_string(splits) + ", threads " +
                           std::to_string(threads));
              KvCache c;
              kp.attach(c, true);
              vp.attach(c, false);
              if (ps > 0) c.block_table = table.view();
              c.cache_seqlens = seqlens.view();
              const ForwardResult got = forward_with_kvcache(q.view(), c, o);
              const double tolerance = std::max(
                  1e-5, 2.0 * (narrow ? std::max(yardstick_error(yardstick.out, want.out, "the narrow-precision yardstick's out", kNaiveOutputShare), narrow_rounding(kernel) * v_max)
                                      : naive_float));
              EXPECT_LE(max_abs_error(got.out, want.out), tolerance);
              const double lse_tolerance = narrow ? 1e-4 + 2.0 * yardstick_error(yardstick.lse, want.lse, "the narrow-precision yardstick's lse", INFINITY) : 1e-4;
              for (std::int64_t i = 0; i < got.lse.numel(); ++i)
                ASSERT_NEAR(got.lse.get(i), want.lse[static_cast<std::size_t>(i)],
                            lse_tolerance * (narrow ? std::max(1.0, std::fabs(want.lse[static_cast<std::size_t>(i)])) : 1.0))
                    << "lse " << i;
              if (ps == 0) continue;
              Tensor cu_q(DType::i32, {2});
              cu_q.set(1, static_cast<float>(sq));
              const TensorView packed_q(q.data(), DType::f32, {sq, s.hq, s.d});
              PagedKvBatch kv{kp.codes.view(), vp.codes.view(), table.view(), seqlens.view(), kp.scale.view(),
                              vp.scale.view(), f.k, f.v, {}, {}};
              if (f.k.codes == KvCodes::u8) kv.k_zero_point = kp.zero.view();
              if (f.v.codes == KvCodes::u8) kv.v_zero_point = vp.zero.view();
              const ForwardResult paged = forward_varlen_paged(packed_q, cu_q.view(), sq, kv, o);
              ASSERT_EQ(std::memcmp(paged.out.data(), got.out.data(), static_cast<std::size_t>(got.out.numel()) * 4), 0)
                  << "forward_varlen_paged reads the pools as forward_with_kvcache";
            }
            }
          }
        }
  });
}

// Scales near float32's largest (an append of values near it chooses an e4m3 descale of 2^120;
// a caller may set int8 scales so): the float32 decode kernel took kKvUnit·descale, P·kKvUnit·
// descale and (zero point − 128)·scale as products of their own, each past float32's largest
// where the values are not, and gave NaN; the tiled kernel read them. Page 1's kv head 0
// holds keys and values of about 2^112–2^116 (e4m3 at a descale of 2^121) or up to 3e38 and
// 3e37 (int8 at scales of 1e37); its scores are huge, so each row takes its largest key's value.
// The other head and page are ordinary. Against the float64 reference by upstream's rule, 1–3
// threads and split-KV, every SIMD target. (The narrow decode kernels take other steps: not
// covered here.)
TEST(Int8Cache, DecodeKernelReadsScalesNearFloat32sLargest) {
  constexpr std::int64_t hq = 4, hkv = 2, d = 24, ps = 16, pages = 2, keys = 32;
  for_each_simd_target([&](const std::string&) {
    for (const KvQuant& quant : {kE4m3, kU8Page, kS8Page}) {
      SCOPED_TRACE(name(quant));
      Pool kp(quant, pages, ps, hkv, d), vp(quant, pages, ps, hkv, d);
      std::mt19937_64 rng(120);
      kp.fill_random(rng);
      vp.fill_random(rng);
      // Page 1, kv head 0: huge scales over small codes.
      const bool fp8 = quant.codes == KvCodes::e4m3;
      kp.scale.set(kp.at(1, 0, 0), fp8 ? 0x1p121f : 1e37f);
      vp.scale.set(vp.at(1, 0, 0), fp8 ? 0x1p121f : 1e37f);
      if (quant.codes == KvCodes::u8) kp.zero.set(kp.at(1, 0, 0), 0.0f), vp.zero.set(vp.at(1, 0, 0), 0.0f);
      for (std::int64_t slot = 0; slot < ps; ++slot)
        for (std::int64_t e = 0; e < d; ++e) {
          const auto draw = [&](int most) { return static_cast<int>(rng() % static_cast<std::uint64_t>(2 * most + 1)) - most; };
          if (fp8) {  // e4m3 codes of exponent field ≤ 1: |value| < 2^-5, times the descale
            kp.code(1, slot, 0, e) = static_cast<std::uint8_t>((rng() & 0x80) | (rng() % 0x10));
            vp.code(1, slot, 0, e) = static_cast<std::uint8_t>((rng() & 0x80) | (rng() % 0x10));
          } else {  // int8 codes: K within ±30 (3e38), V within ±3 (3e37) of the zero point 0
            const auto code = [&](int most) {
              return static_cast<std::uint8_t>(quant.codes == KvCodes::u8 ? std::abs(draw(most)) : draw(most));
            };
            kp.code(1, slot, 0, e) = code(30);
            vp.code(1, slot, 0, e) = code(3);
          }
        }
      Tensor table(DType::i32, {1, pages}), seqlens(DType::i32, {1});
      table.set(0, 0.0f), table.set(1, 1.0f);
      seqlens.set(0, static_cast<float>(keys));
      Tensor k(DType::f32, {1, keys, hkv, d}), v(DType::f32, {1, keys, hkv, d});
      for (std::int64_t pos = 0; pos < keys; ++pos)
        for (std::int64_t h = 0; h < hkv; ++h)
          for (std::int64_t e = 0; e < d; ++e) {
            k.set((pos * hkv + h) * d + e, kp.value(pos / ps, pos % ps, h, e));
            v.set((pos * hkv + h) * d + e, vp.value(pos / ps, pos % ps, h, e));
          }
      Tensor q = random_tensor(DType::f32, {1, 1, hq, d}, 121);
      if (!fp8)  // q heads 0 and 1 read kv head 0: scores within float32's range
        for (std::int64_t e = 0; e < 2 * d; ++e) q.set(e, q.get(e) * 0x1p-20f);
      AttentionOptions o;
      o.kernel = ForwardKernel::decode;
      const AttentionProblem p = AttentionProblem::from_sizes(1, 1, keys, hq, hkv, d, d, DType::f32, o);
      const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
      // u8: the decode kernel's (P·scale)·(code − 128) − (P·scale)·(zero point − 128), as
      // kv_quant.hpp states: a float32 rounding of each term, up to 256 steps of the scale.
      const double decomposition = quant.codes == KvCodes::u8 ? 0x1p-23 * 256.0 * 1e37 : 0.0;
      const double tolerance =
          std::max({1e-5, 2.0 * naive_output_error(naive_same_precision(p, o, q, k, v), want.out, p.dtype, o.exp2), decomposition});
      for (const auto& [splits, threads] : {std::pair{1, 1}, {2, 2}, {2, 3}}) {
        SCOPED_TRACE("splits " + std::to_string(splits) + ", threads " + std::to_string(threads));
        o.num_splits = splits;
        o.num_threads = threads;
        KvCache c = cache_of(kp, vp, seqlens);
        c.block_table = table.view();
        const ForwardResult got = forward_with_kvcache(q.view(), c, o);
        for (std::int64_t i = 0; i < got.out.numel(); ++i) ASSERT_TRUE(std::isfinite(got.out.get(i))) << "out " << i;
        EXPECT_LE(max_abs_error(got.out, want.out), tolerance);
        for (std::int64_t i = 0; i < got.lse.numel(); ++i) {
          const double lse = want.lse[static_cast<std::size_t>(i)];
          EXPECT_NEAR(got.lse.get(i), lse, 1e-4 * std::max(1.0, std::fabs(lse))) << "lse " << i;
        }
      }
    }
  });
}

// decode_fp16's half-precision sums cannot overflow over int8 codes at its largest head dim
// (512, fp16_decode.hpp): every code at an end of its range (u8 0 and 255, s8 −128 and 127:
// magnitude 128 read) and q rows of equal elements of one sign just below a power of two, so
// that every product of a score adds up with the same sign at the largest magnitude the
// kernel lets in; every key alike, so that every probability is 1 and P·V's half sums are
// the largest a block can give. Against the float64 reference within the half-precision
// yardstick's rule (as KernelsReadEveryCodeOnEveryLayout).
TEST(Int8Cache, DecodeFp16SumsStayFiniteAtItsLargestHeadDim) {
  if (!CpuHardware::detect(0).decode_fp16) GTEST_SKIP() << "no AVX512-FP16 on this CPU: decode_fp16 cannot run here";
  constexpr std::int64_t keys = 40, hq = 4, hkv = 1, d = 512;
  for (const KvQuant quant : {kU8Token, kS8Token})
    for (const std::uint8_t end : {std::uint8_t{0}, std::uint8_t{0x80}, std::uint8_t{0x7F}, std::uint8_t{0xFF}}) {
      if (quant.codes == KvCodes::u8 && (end == 0x80 || end == 0x7F)) continue;  // u8's ends: 0 and 255
      SCOPED_TRACE(name(quant) + ", every code " + std::to_string(end));
      Pool kp(quant, 1, keys, hkv, d), vp(quant, 1, keys, hkv, d);
      Tensor k(DType::f32, {1, keys, hkv, d}), v(DType::f32, {1, keys, hkv, d});
      Tensor kc(DType::f32, {1, keys, hkv, d}), vc(DType::f32, {1, keys, hkv, d});
      Tensor kd(DType::f32, {1, keys, hkv}), vd(DType::f32, {1, keys, hkv});
      Tensor kz(DType::f32, {1, keys, hkv}), vz(DType::f32, {1, keys, hkv});
      for (std::int64_t j = 0; j < keys; ++j) {
        for (Pool* pool : {&kp, &vp}) {
          pool->scale.set(j, 0x1.fcp-13f);  // just below a power of two: P·scale brought closest to its bound
          if (quant.codes == KvCodes::u8) pool->zero.set(j, 127.5f);
          for (std::int64_t e = 0; e < d; ++e) pool->code(0, j, 0, e) = end;
        }
        for (std::int64_t e = 0; e < d; ++e) {
          k.set(j * d + e, kp.value(0, j, 0, e));
          v.set(j * d + e, vp.value(0, j, 0, e));
          kc.set(j * d + e, kp.code_read(0, j, 0, e));
          vc.set(j * d + e, vp.code_read(0, j, 0, e));
        }
        kd.set(j, kp.scale_of(0, j, 0));
        vd.set(j, vp.scale_of(0, j, 0));
        kz.set(j, kp.zero_read(0, j, 0));
        vz.set(j, vp.zero_read(0, j, 0));
      }
      Tensor q(DType::f32, {1, 1, hq, d});
      for (std::int64_t i = 0; i < q.numel(); ++i) q.set(i, i / d % 2 == 0 ? 3.99f : -0.0312f);  // rows of one sign
      AttentionOptions o;
      const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
      const reference::Result yardstick =
          narrow_precision_attention(ForwardKernel::decode_fp16, q, kc, kd, vc, vd, o, &kz, &vz);
      double v_max = 0.0;
      for (std::int64_t i = 0; i < v.numel(); ++i) v_max = std::max(v_max, std::fabs(static_cast<double>(v.get(i))));
      o.kernel = ForwardKernel::decode_fp16;
      KvCache c;
      kp.attach(c, true);
      vp.attach(c, false);
      Tensor seqlens(DType::i32, {1});
      seqlens.set(0, static_cast<float>(keys));
      c.cache_seqlens = seqlens.view();
      const ForwardResult got = forward_with_kvcache(q.view(), c, o);
      for (std::int64_t i = 0; i < got.out.numel(); ++i) ASSERT_TRUE(std::isfinite(got.out.get(i))) << "out " << i;
      const double tolerance = 2.0 * std::max(yardstick_error(yardstick.out, want.out, "the narrow-precision yardstick's out", kNaiveOutputShare), 0x1p-11 * v_max);
      EXPECT_LE(max_abs_error(got.out, want.out), std::max(1e-5, tolerance));
      for (std::int64_t i = 0; i < got.lse.numel(); ++i)
        ASSERT_NEAR(got.lse.get(i), want.lse[static_cast<std::size_t>(i)],
                    (1e-4 + 2.0 * yardstick_error(yardstick.lse, want.lse, "the narrow-precision yardstick's lse", INFINITY)) *
                        std::max(1.0, std::fabs(want.lse[static_cast<std::size_t>(i)])))
            << "lse " << i;
    }
}

// The narrow kernels' P·V weights stay within their bound when the maximum grows by less
// than the rescale threshold: keys after the first blocks score 7.5 (log2 units) above the
// first block's maximum, so that under the threshold of 8 their probabilities would reach
// 2^7.5 against the reference taken at the first block — decode_fp16's half-precision P·V
// overflowed to inf there (a randomized run found it). K codes chosen for the two scores, V
// codes random; every format, against the float64 reference within the yardstick's rule.
TEST(Int8Cache, NarrowDecodeWhenLaterKeysScoreHigherWithinTheRescaleThreshold) {
  const std::vector<ForwardKernel> narrow = narrow_decode_kernels();
  if (narrow.empty()) GTEST_SKIP() << "no AVX512-FP16 or AVX512-BF16 on this CPU: no narrow decode kernel runs here";
  constexpr std::int64_t keys = 1000, low_keys = 100, hq = 2, hkv = 1, d = 64;
  // Score of a high key: d · w · (1/sqrt(d)) · log2(e) = 7.5 with q all ones.
  const float w = static_cast<float>(7.5 * std::sqrt(static_cast<double>(d)) / (d * std::log2(std::exp(1.0))));
  for (const KvQuant quant : {kU8Token, kS8Token, kE4m3}) {
    SCOPED_TRACE(name(quant));
    Pool kp(quant, 1, keys, hkv, d), vp(quant, 1, keys, hkv, d);
    std::mt19937_64 rng(2031);
    vp.fill_random(rng);
    kp.fill_random(rng);
    for (std::int64_t j = 0; j < keys; ++j) {
      const bool high = j >= low_keys;
      std::uint8_t c = 0;
      if (quant.codes == KvCodes::e4m3) {
        c = high ? std::uint8_t{0x38} : std::uint8_t{0};  // 1.0 or 0, times the page's scale w
      } else {
        kp.scale.set(j, w / 100.0f);
        if (quant.codes == KvCodes::u8) kp.zero.set(j, 128.0f);
        c = static_cast<std::uint8_t>((quant.codes == KvCodes::u8 ? 128 : 0) + (high ? 100 : 0));
      }
      for (std::int64_t e = 0; e < d; ++e) kp.code(0, j, 0, e) = c;
    }
    if (quant.codes == KvCodes::e4m3) kp.scale.set(0, w);
    Tensor k(DType::f32, {1, keys, hkv, d}), v(DType::f32, {1, keys, hkv, d});
    Tensor kc(DType::f32, {1, keys, hkv, d}), vc(DType::f32, {1, keys, hkv, d});
    Tensor kd(DType::f32, {1, keys, hkv}), vd(DType::f32, {1, keys, hkv});
    Tensor kz(DType::f32, {1, keys, hkv}), vz(DType::f32, {1, keys, hkv});
    double v_max = 0.0;
    for (std::int64_t j = 0; j < keys; ++j) {
      for (std::int64_t e = 0; e < d; ++e) {
        k.set(j * d + e, kp.value(0, j, 0, e));
        v.set(j * d + e, vp.value(0, j, 0, e));
        kc.set(j * d + e, kp.code_read(0, j, 0, e));
        vc.set(j * d + e, vp.code_read(0, j, 0, e));
        v_max = std::max(v_max, std::fabs(static_cast<double>(v.get(j * d + e))));
      }
      kd.set(j, kp.scale_of(0, j, 0));
      vd.set(j, vp.scale_of(0, j, 0));
      kz.set(j, kp.zero_read(0, j, 0));
      vz.set(j, vp.zero_read(0, j, 0));
    }
    Tensor q(DType::f32, {1, 1, hq, d});
    for (std::int64_t i = 0; i < q.numel(); ++i) q.set(i, 1.0f);
    AttentionOptions o;
    const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
    Tensor seqlens(DType::i32, {1});
    seqlens.set(0, static_cast<float>(keys));
    for (const ForwardKernel kernel : narrow) {
      SCOPED_TRACE(to_string(kernel));
      const reference::Result yardstick = narrow_precision_attention(kernel, q, kc, kd, vc, vd, o, &kz, &vz,
                                                                     quant.codes != KvCodes::e4m3);
      for (const int threads : {1, 2}) {
        o.kernel = kernel;
        o.num_splits = 1;
        o.num_threads = threads;
        const KvCache c = cache_of(kp, vp, seqlens);
        const ForwardResult got = forward_with_kvcache(q.view(), c, o);
        for (std::int64_t i = 0; i < got.out.numel(); ++i) ASSERT_TRUE(std::isfinite(got.out.get(i))) << "out " << i;
        const double tolerance =
            2.0 * std::max(yardstick_error(yardstick.out, want.out, "the narrow-precision yardstick's out", kNaiveOutputShare), narrow_rounding(kernel) * v_max);
        EXPECT_LE(max_abs_error(got.out, want.out), std::max(1e-5, tolerance));
      }
    }
  }
}

// decode_fp16's half-precision P·V takes P ≤ 1: dropout's 1/(1 − p) (forward_with_kvcache
// takes dropout_p from C++) overflowed it to inf at p = 0.97. Asked by name, it is an Error
// naming dropout; the planner takes another kernel, whose output is finite.
TEST(Int8Cache, DecodeFp16RefusesDropout) {
  if (!CpuHardware::detect(0).decode_fp16) GTEST_SKIP() << "no AVX512-FP16 on this CPU: decode_fp16 cannot run here";
  constexpr std::int64_t keys = 512, d = 64;
  Pool kp(kS8Token, 1, keys, 1, d), vp(kS8Token, 1, keys, 1, d);
  std::mt19937_64 rng(97);
  kp.fill_random(rng);
  vp.fill_random(rng);
  const Tensor q = random_tensor(DType::f32, {1, 1, 1, d}, 98);
  Tensor seqlens(DType::i32, {1});
  seqlens.set(0, static_cast<float>(keys));
  const KvCache c = cache_of(kp, vp, seqlens);
  AttentionOptions o;
  o.dropout_p = 0.97f;
  o.kernel = ForwardKernel::decode_fp16;
  expect_error([&] { forward_with_kvcache(q.view(), c, o); }, {"kernel decode_fp16", "no dropout (dropout_p: 0.97"});
  o.kernel = ForwardKernel::automatic;
  const ForwardResult got = forward_with_kvcache(q.view(), c, o);
  for (std::int64_t i = 0; i < got.out.numel(); ++i) ASSERT_TRUE(std::isfinite(got.out.get(i))) << "out " << i;
}

// Rows quantized per token that are constant — all zeros, or one value each (what appends of
// such rows store) — read back at the kernels' float32 accuracy on every decode kernel: the
// narrow ones read the u8 codes as code − 128, and a constant row stored at code 0 with scale
// 1 came back off by 2^-11·128 (−0.07 for zeros on decode_fp16; a randomized run found it).
TEST(Int8Cache, ConstantRowsPerTokenReadBackOnEveryDecodeKernel) {
  constexpr std::int64_t keys = 300, hq = 4, hkv = 2, d = 32;
  std::vector<ForwardKernel> kernels{ForwardKernel::decode};
  for (const ForwardKernel narrow : narrow_decode_kernels()) kernels.push_back(narrow);
  for (const KvQuant quant : {kU8Token, kS8Token})
    for (const float constant : {0.0f, 0.01f, -3.0f}) {
      if (quant.codes == KvCodes::s8 && constant != 0.0f) continue;  // s8: nonzero rows are no special case
      SCOPED_TRACE(name(quant) + ", every V row " + std::to_string(constant));
      Pool kp(quant, 1, keys, hkv, d), vp(quant, 1, keys, hkv, d);
      std::mt19937_64 rng(77);
      kp.fill_random(rng);
      const std::vector<float> row(d, constant);
      for (std::int64_t j = 0; j < keys; ++j)
        for (std::int64_t h = 0; h < hkv; ++h) {
          float* scale = vp.scale.data_as<float>() + vp.at(0, j, h);
          float zero_point = 0.0f;
          quantize_int8(quant.codes, row.data(), d, true, scale, &zero_point, &vp.code(0, j, h, 0));
          if (quant.codes == KvCodes::u8) vp.zero.set(vp.at(0, j, h), zero_point);
        }
      const Tensor q = random_tensor(DType::f32, {1, 1, hq, d}, 78);
      Tensor seqlens(DType::i32, {1});
      seqlens.set(0, static_cast<float>(keys));
      for (const ForwardKernel kernel : kernels) {
        SCOPED_TRACE(to_string(kernel));
        AttentionOptions o;
        o.kernel = kernel;
        const KvCache c = cache_of(kp, vp, seqlens);
        const ForwardResult got = forward_with_kvcache(q.view(), c, o);
        for (std::int64_t i = 0; i < got.out.numel(); ++i)  // P sums to 1: the mean of equal values
          ASSERT_NEAR(got.out.get(i), constant, 4e-7 * std::fabs(constant)) << "out " << i;
      }
    }
}

// Appends quantize: chunks of new tokens (rotated keys, magnitudes from 0.01 to 8) into
// contiguous and paged caches of each pair of formats, one sequence empty at first and one
// left-padded (contiguous); every stored value within the stated bound of the logical one
// (per page: values beyond the page's range saturate to its ends), the attention on the
// cache against the float64 reference on the dequantized values (decode, for few rows) or
// forward on them (tiled, for many: it reads exactly those values), and
// nothing written — codes, per-token scales, zero points — beyond the appended slots.
void check_append_run(const Formats& f, std::int64_t page_size) {
  constexpr std::int64_t kBatch = 2, kHq = 4, kHkv = 2, kDim = 24, kCap = 64;
  const std::int64_t per_seq = page_size > 0 ? (kCap + page_size - 1) / page_size : 0;
  const std::int64_t pages = page_size > 0 ? kBatch * per_seq : kBatch, slots = page_size > 0 ? page_size : kCap;
  Pool kp(f.k, pages, slots, kHkv, kDim), vp(f.v, pages, slots, kHkv, kDim);
  for (Pool* p : {&kp, &vp})  // per page: the caller's scales, covering ±12 (beyond: saturation)
    if (p->quant.granularity == KvScaleGranularity::per_page && p->quant.codes != KvCodes::e4m3)
      for (std::int64_t i = 0; i < p->scale.numel(); ++i) {
        p->scale.set(i, p->quant.codes == KvCodes::u8 ? 24.0f / 255.0f : 12.0f / 127.0f);
        if (p->quant.codes == KvCodes::u8) p->zero.set(i, 127.5f + static_cast<float>(i % 3) * 0.25f);
      }
  const Pool k_before = kp, v_before = vp;  // the guards
  Tensor table(DType::i32, {kBatch, std::max<std::int64_t>(per_seq, 1)});
  for (std::int64_t b = 0; b < kBatch; ++b)
    for (std::int64_t pg = 0; pg < per_seq; ++pg) table.set(b * per_seq + pg, static_cast<float>((pg * kBatch + b + 1) % pages));
  auto locate = [&](std::int64_t b, std::int64_t pos) -> std::pair<std::int64_t, std::int64_t> {
    if (page_size == 0) return {b, pos};
    return {static_cast<std::int64_t>(table.get(b * per_seq + pos / page_size)), pos % page_size};
  };
  // rotary_dim 8 of 24 by quarter turns: rotations exact in float32 however the library's
  // and this test's products are contracted, so q's rotation here is the library's (scores of
  // large keys would show a one-ulp difference in q above the tolerance).
  Tensor cos{DType::f32, {kCap, 4}}, sin{DType::f32, {kCap, 4}};
  const float quarter_cos[] = {1.0f, 0.0f, -1.0f, 0.0f};
  for (std::int64_t p = 0; p < kCap; ++p)
    for (std::int64_t i = 0; i < 4; ++i) {
      cos.set(p * 4 + i, quarter_cos[(p * (i + 1)) % 4]);
      sin.set(p * 4 + i, quarter_cos[(p * (i + 1) + 3) % 4]);
    }
  const std::int64_t leftpad[kBatch] = {0, page_size == 0 ? 2 : 0};
  std::vector<std::vector<float>> k_logical(kBatch), v_logical(kBatch);
  std::int64_t seqlen = 0;  // tokens of each sequence, from slot start[b] on
  const std::int64_t chunks[] = {5, 1, 20, 13, 1};
  const float magnitudes[] = {0.5f, 4.0f, 1.0f, 8.0f, 0.01f};
  std::uint64_t seed = 140;
  const std::int64_t start[kBatch] = {0, leftpad[1]};  // sequence 1's slots [0, 2) are padding (contiguous)
  for (std::size_t step = 0; step < std::size(chunks); ++step) {
    const std::int64_t n = chunks[step];
    SCOPED_TRACE("append " + std::to_string(step) + " of " + std::to_string(n) + " tokens");
    Tensor k_new = random_tensor(DType::f32, {kBatch, n, kHkv, kDim}, seed++);
    Tensor v_new = random_tensor(DType::f32, {kBatch, n, kHkv, kDim}, seed++);
    for (std::int64_t i = 0; i < k_new.numel(); ++i)
      k_new.set(i, k_new.get(i) * magnitudes[step]), v_new.set(i, v_new.get(i) * magnitudes[step]);
    const Tensor q = random_tensor(DType::f32, {kBatch, n, kHq, kDim}, seed++);
    Tensor seqlens(DType::i32, {kBatch}), pad(DType::i32, {kBatch});
    for (std::int64_t b = 0; b < kBatch; ++b) {
      seqlens.set(b, static_cast<float>(start[b] + seqlen));
      pad.set(b, static_cast<float>(leftpad[b]));
    }
    KvCache c;
    kp.attach(c, true);
    vp.attach(c, false);
    if (page_size > 0) c.block_table = table.view();
    else c.cache_leftpad = pad.view();
    c.cache_seqlens = seqlens.view();
    c.k = k_new.view();
    c.v = v_new.view();
    c.rotary_cos = cos.view();
    c.rotary_sin = sin.view();
    AttentionOptions o;
    o.causal = true;
    o.num_threads = static_cast<int>(1 + step % 3);
    if (n * (kHq / kHkv) <= 16) o.kernel = ForwardKernel::decode;
    const ForwardResult got = forward_with_kvcache(q.view(), c, o);

    // Row `row` (kDim values) of x rotated at `pos` (interleaved pairs, rotary_dim 8).
    auto rotated = [&](const Tensor& x, std::int64_t row, std::int64_t pos) {
      std::vector<float> r(kDim);
      for (std::int64_t e = 0; e < kDim; ++e) r[e] = x.get(row * kDim + e);
      const std::int64_t half = cos.shape()[1];
      for (std::int64_t i = 0; i < half; ++i) {
        const float cs = cos.get(pos * half + i), sn = sin.get(pos * half + i), xa = r[2 * i], xb = r[2 * i + 1];
        r[2 * i] = xa * cs - xb * sn;
        r[2 * i + 1] = xa * sn + xb * cs;
      }
      return r;
    };
    Tensor q_rot(DType::f32, {kBatch, n, kHq, kDim});
    for (std::int64_t b = 0; b < kBatch; ++b) {
      const std::int64_t at = start[b] + seqlen;  // slot (rotary position) of the first new token
      for (std::int64_t t = 0; t < n; ++t)
        for (std::int64_t h = 0; h < kHkv; ++h) {
          const std::vector<float> kr = rotated(k_new, (b * n + t) * kHkv + h, at + t);
          k_logical[b].insert(k_logical[b].end(), kr.begin(), kr.end());
          for (std::int64_t e = 0; e < kDim; ++e) v_logical[b].push_back(v_new.get(((b * n + t) * kHkv + h) * kDim + e));
        }
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t h = 0; h < kHq; ++h) {
          const std::vector<float> qr = rotated(q, (b * n + i) * kHq + h, at + i);
          for (std::int64_t e = 0; e < kDim; ++e) q_rot.set(((b * n + i) * kHq + h) * kDim + e, qr[e]);
        }
    }
    seqlen += n;
    for (std::int64_t b = 0; b < kBatch; ++b) {
      SCOPED_TRACE("sequence " + std::to_string(b));
      Tensor k_hat(DType::f32, {1, seqlen, kHkv, kDim}), v_hat(DType::f32, {1, seqlen, kHkv, kDim});
      for (std::int64_t pos = 0; pos < seqlen; ++pos)
        for (std::int64_t h = 0; h < kHkv; ++h) {
          const auto [page, slot] = locate(b, start[b] + pos);
          for (std::int64_t e = 0; e < kDim; ++e) {
            const std::int64_t i = (pos * kHkv + h) * kDim + e;
            for (auto [pool, logical, hat] : {std::tuple{&kp, &k_logical[b], &k_hat}, {&vp, &v_logical[b], &v_hat}}) {
              float x = (*logical)[static_cast<std::size_t>(i)];
              const float xq = pool->value(page, slot, h, e), scale = pool->scale_of(page, slot, h);
              const float zero = pool->zero_of(page, slot, h);
              if (pool->quant.codes != KvCodes::e4m3 && pool->quant.granularity == KvScaleGranularity::per_page) {
                // Per page, values beyond the page's range saturate to its ends.
                const bool u8 = pool->quant.codes == KvCodes::u8;
                x = std::clamp(x, int8_code_value(pool->quant.codes, u8 ? 0 : 0x81, scale, zero),
                               int8_code_value(pool->quant.codes, u8 ? 255 : 127, scale, zero));
              }
              const double bound = pool->quant.codes == KvCodes::e4m3
                                       ? 0x1p-4 * std::fabs(x) + 0x1p-9 * scale  // attention.hpp's FP8 cache bound
                                       : stated_bound(scale, zero);
              ASSERT_LE(std::fabs(static_cast<double>(xq) - x), bound)
                  << (pool == &kp ? "k" : "v") << " pos " << pos << " h " << h << " e " << e;
              hat->set(i, xq);
            }
          }
        }
      Tensor qb(DType::f32, {1, n, kHq, kDim});
      std::memcpy(qb.data(), q_rot.data_as<float>() + b * n * kHq * kDim, static_cast<std::size_t>(qb.numel()) * 4);
      const reference::Result want = reference::attention(qb.view(), k_hat.view(), v_hat.view(), o);
      const AttentionProblem p = AttentionProblem::from_sizes(1, n, seqlen, kHq, kHkv, kDim, kDim, DType::f32, o);
      const double naive = naive_output_error(naive_same_precision(p, o, qb, k_hat, v_hat), want.out, p.dtype, o.exp2);
      double err = 0.0;
      for (std::int64_t i = 0; i < qb.numel(); ++i)
        err = std::max(err, abs_difference(got.out.get(b * qb.numel() + i), want.out[static_cast<std::size_t>(i)]));
      if (o.kernel == ForwardKernel::decode) {
        EXPECT_LE(err, std::max(1e-5, 2.0 * naive));
        continue;
      }
      // The tiled kernel dequantizes as it packs, to exactly the values of k_hat and v_hat:
      // the result is forward's on them, bit for bit (whose own accuracy the forward tests
      // judge: on the SCALAR target, with these scores, it can exceed twice the naive error).
      const ForwardResult plain = forward(qb.view(), k_hat.view(), v_hat.view(), o);
      for (std::int64_t i = 0; i < qb.numel(); ++i)
        ASSERT_EQ(got.out.get(b * qb.numel() + i), plain.out.get(i)) << "element " << i;
    }
  }
  // Nothing written beyond the appended slots: their codes, per-token scales and zero points.
  std::vector<char> used(static_cast<std::size_t>(pages * slots), 0);
  for (std::int64_t b = 0; b < kBatch; ++b)
    for (std::int64_t pos = start[b]; pos < start[b] + seqlen; ++pos) {
      const auto [page, slot] = locate(b, pos);
      used[static_cast<std::size_t>(page * slots + slot)] = 1;
    }
  for (const auto& [pool, before] : {std::pair{&kp, &k_before}, {&vp, &v_before}})
    for (std::int64_t i = 0; i < pages * slots; ++i) {
      if (used[static_cast<std::size_t>(i)] != 0) continue;
      for (std::int64_t e = 0; e < kHkv * kDim; ++e)
        ASSERT_EQ(pool->codes.data_as<std::uint8_t>()[i * kHkv * kDim + e], Pool::kGuard) << "slot " << i;
      if (pool->quant.granularity != KvScaleGranularity::per_token) continue;
      for (std::int64_t h = 0; h < kHkv; ++h) {
        ASSERT_EQ(pool->scale.get(i * kHkv + h), Pool::kScaleGuard) << "scale of slot " << i;
        if (pool->quant.codes == KvCodes::u8) ASSERT_EQ(pool->zero.get(i * kHkv + h), Pool::kScaleGuard) << "slot " << i;
      }
    }
  for (const auto& [pool, before] : {std::pair{&kp, &k_before}, {&vp, &v_before}})
    if (pool->quant.granularity == KvScaleGranularity::per_page && pool->quant.codes != KvCodes::e4m3)
      EXPECT_EQ(std::memcmp(pool->scale.data(), before->scale.data(), static_cast<std::size_t>(pool->scale.numel()) * 4), 0)
          << "per-page scales are the caller's: appends only read them";
}

// A query row with a non-finite element: decode_bf16's integer scores (int8_dot.hpp, which
// round q to integers) give that (q head)'s output NaN, not the scores of wrapped integers,
// and every other head the output of the finite query, bit for bit; likewise for the other
// kernels this CPU runs over the cache (decode, decode_fp16), which compute with q as it is.
TEST(Int8Cache, NonFiniteQueryRowGivesNaNOnlyThere) {
  constexpr std::int64_t keys = 37, hq = 4, hkv = 2, d = 40, bad_head = 1;
  Pool kp(kS8Token, 1, keys, hkv, d), vp(kU8Token, 1, keys, hkv, d);
  std::mt19937_64 rng(5);
  kp.fill_random(rng);
  vp.fill_random(rng);
  Tensor seqlens(DType::i32, {1});
  seqlens.set(0, static_cast<float>(keys));
  const Tensor q = random_tensor(DType::f32, {1, 1, hq, d}, 6);
  std::vector<ForwardKernel> kernels{ForwardKernel::decode};
  for (const ForwardKernel narrow : narrow_decode_kernels()) kernels.push_back(narrow);
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()})
    for (const ForwardKernel kernel : kernels) {
      SCOPED_TRACE(std::string(to_string(kernel)) + ", q element " + std::to_string(bad));
      Tensor q_bad = random_tensor(DType::f32, {1, 1, hq, d}, 6);
      q_bad.set(bad_head * d + 7, bad);
      AttentionOptions o;
      o.kernel = kernel;
      const KvCache c = cache_of(kp, vp, seqlens);
      const ForwardResult good = forward_with_kvcache(q.view(), c, o);
      const ForwardResult got = forward_with_kvcache(q_bad.view(), c, o);
      for (std::int64_t h = 0; h < hq; ++h)
        for (std::int64_t e = 0; e < d; ++e) {
          const float x = got.out.get(h * d + e);
          if (h == bad_head)
            ASSERT_TRUE(std::isnan(x)) << "head " << h << " element " << e << ": " << x;
          else
            ASSERT_EQ(x, good.out.get(h * d + e)) << "head " << h << " element " << e;
        }
    }
}

TEST(Int8Cache, AppendsQuantizeWithinTheStatedBound) {
  for_each_simd_target([](const std::string&) {
    for (const Formats& f : kFormats)
      for (std::int64_t ps : {0, 1, 3, 16}) {
        SCOPED_TRACE("K " + name(f.k) + ", V " + name(f.v) +
                     (ps == 0 ? std::string(", contiguous") : ", page size " + std::to_string(ps)));
        check_append_run(f, ps);
      }
  });
}

// Bad scales, zero points and formats: an Error naming the argument and the value, raised
// before the append writes anything.
TEST(Int8Cache, BadInputNamesTheArgument) {
  constexpr std::int64_t kPages = 4, kPage = 16, kHkv = 2, kDim = 8;
  Pool kp(kU8Token, kPages, kPage, kHkv, kDim), vp(kS8Page, kPages, kPage, kHkv, kDim);
  for (std::int64_t i = 0; i < kp.scale.numel(); ++i) kp.scale.set(i, 1.0f), kp.zero.set(i, 128.0f);
  for (std::int64_t i = 0; i < vp.scale.numel(); ++i) vp.scale.set(i, 0.5f);
  Tensor table(DType::i32, {1, 2}), seqlens(DType::i32, {1});
  table.set(0, 2.0f), table.set(1, 1.0f);
  seqlens.set(0, 15.0f);  // the next token goes to page 1, slot 0
  const Tensor q = random_tensor(DType::f32, {1, 2, 4, kDim}, 1);
  Tensor k_new = random_tensor(DType::f32, {1, 2, kHkv, kDim}, 2);
  const Tensor v_new = random_tensor(DType::f32, {1, 2, kHkv, kDim}, 3);
  auto cache = [&] {
    KvCache c;
    kp.attach(c, true);
    vp.attach(c, false);
    c.block_table = table.view();
    c.cache_seqlens = seqlens.view();
    c.k = k_new.view();
    c.v = v_new.view();
    return c;
  };
  const Pool k_before = kp, v_before = vp;
  auto unchanged = [&] {
    for (const auto& [now, before] : {std::pair{&kp, &k_before}, {&vp, &v_before}}) {
      EXPECT_EQ(std::memcmp(now->codes.data(), before->codes.data(), static_cast<std::size_t>(now->codes.numel())), 0);
      EXPECT_EQ(std::memcmp(now->scale.data(), before->scale.data(), static_cast<std::size_t>(now->scale.numel()) * 4), 0);
    }
  };
  KvCache c = cache();
  c.k_zero_point = {};
  expect_error([&] { forward_with_kvcache(q.view(), c); }, {"k_zero_point", "need their zero points"});
  c = cache();
  c.v_zero_point = kp.zero.view();
  expect_error([&] { forward_with_kvcache(q.view(), c); }, {"v_zero_point", "s8 codes have no zero point"});
  c = cache();
  c.k_scale = vp.scale.view();  // per-page shape for per-token scales
  expect_error([&] { forward_with_kvcache(q.view(), c); }, {"k_scale", "(pages or batch_cache, page_size or seqlen_cache, heads_kv)"});
  c = cache();
  Tensor half_zero(DType::f16, {kPages, kPage, kHkv});
  c.k_zero_point = half_zero.view();
  expect_error([&] { forward_with_kvcache(q.view(), c); }, {"k_zero_point", "float32 zero points"});
  c = cache();
  const Tensor transposed(DType::f32, {kPages, kPage, kHkv});
  c.k_zero_point = MutableTensorView(const_cast<void*>(transposed.data()), DType::f32, {kPages, kPage, kHkv},
                                     {kHkv, kPages * kHkv, 1});
  expect_error([&] { forward_with_kvcache(q.view(), c); }, {"k_zero_point", "strides differ from k_scale's"});
  c = cache();
  c.k_quant = {KvCodes::e4m3, KvScaleGranularity::per_token};
  expect_error([&] { forward_with_kvcache(q.view(), c); }, {"k_quant", "e4m3 codes take per_page"});
  c = cache();
  vp.scale.set(1 * kHkv + 1, 0.0f);  // page 1, head 1: the append writes there
  expect_error([&] { forward_with_kvcache(q.view(), c); },
               {"v_scale: [1, 1] = 0", "not a finite positive scale", "sequence 0", "appends to it"});
  vp.scale.set(1 * kHkv + 1, 0.5f);
  kp.zero.set((2 * kPage + 14) * kHkv + 0, INFINITY);  // page 2, slot 14: a token read
  expect_error([&] { forward_with_kvcache(q.view(), c); }, {"k_zero_point: [2, 14, 0] = inf", "not a finite zero point"});
  kp.zero.set((2 * kPage + 14) * kHkv + 0, 128.0f);
  kp.scale.set((2 * kPage + 3) * kHkv + 1, NAN);
  expect_error([&] { forward_with_kvcache(q.view(), c); }, {"k_scale: [2, 3, 1] = nan", "sequence 0 has tokens there"});
  kp.scale.set((2 * kPage + 3) * kHkv + 1, 1.0f);
  {  // scales and zero points as views of wider buffers (slots kHkv floats apart, NaN
     // between): the check reads the view's elements, not the run of floats around them
    Tensor wide_scale(DType::f32, {kPages, kPage, 2 * kHkv}), wide_zero(DType::f32, {kPages, kPage, 2 * kHkv});
    for (std::int64_t i = 0; i < wide_scale.numel(); ++i)
      wide_scale.set(i, i % (2 * kHkv) < kHkv ? 1.0f : NAN), wide_zero.set(i, i % (2 * kHkv) < kHkv ? 128.0f : NAN);
    c = cache();
    c.k = {};  // no append: the pools stay as they were
    c.v = {};
    c.k_scale = MutableTensorView(wide_scale.data(), DType::f32, {kPages, kPage, kHkv},
                                  {kPage * 2 * kHkv, 2 * kHkv, 1});
    c.k_zero_point = MutableTensorView(wide_zero.data(), DType::f32, {kPages, kPage, kHkv},
                                       {kPage * 2 * kHkv, 2 * kHkv, 1});
    const ForwardResult strided = forward_with_kvcache(q.view(), c);
    for (std::int64_t i = 0; i < strided.out.numel(); ++i) ASSERT_TRUE(std::isfinite(strided.out.get(i))) << i;
    wide_scale.set((2 * kPage + 3) * 2 * kHkv + 1, NAN);  // page 2, slot 3, head 1: a token read
    expect_error([&] { forward_with_kvcache(q.view(), c); }, {"k_scale: [2, 3, 1] = nan", "sequence 0 has tokens there"});
  }
  c = cache();
  k_new.set(3, INFINITY);
  expect_error([&] { forward_with_kvcache(q.view(), c); }, {"k: [0, 0, 0, 3] is not finite", "quantized cache"});
  k_new.set(3, 0.0f);
  // Per-token scales an append writes, as a stride-0 view over the slots (an expanded
  // tensor): one float for every token of a page would take each new token's scale.
  c = cache();
  c.k_scale = MutableTensorView(kp.scale.data(), DType::f32, {kPages, kPage, kHkv}, {kPage * kHkv, 0, 1});
  c.k_zero_point = MutableTensorView(kp.zero.data(), DType::f32, {kPages, kPage, kHkv}, {kPage * kHkv, 0, 1});
  expect_error([&] { forward_with_kvcache(q.view(), c); }, {"k_scale: stride 0 of dim 1", "distinct addresses"});
  unchanged();
  // forward_varlen_paged: the slots each sequence reads.
  Tensor cu_q(DType::i32, {2});
  cu_q.set(1, 2.0f);
  const TensorView packed_q(q.data(), DType::f32, {2, 4, kDim});
  PagedKvBatch kv{kp.codes.view(), vp.codes.view(), table.view(), seqlens.view(), kp.scale.view(),
                  vp.scale.view(), kU8Token, kS8Page, kp.zero.view(), {}};
  kp.scale.set((1 * kPage + 0) * kHkv + 0, -1.0f);  // page 1 slot 0: not read with 15 keys
  EXPECT_NO_THROW(forward_varlen_paged(packed_q, cu_q.view(), 2, kv));
  seqlens.set(0, 17.0f);
  expect_error([&] { forward_varlen_paged(packed_q, cu_q.view(), 2, kv); },
               {"k_scale: [1, 0, 0] = -1", "sequence 0 reads page 1"});
  // Formats, zero points on a cache of values.
  const Tensor bf16_cache(DType::bf16, {kPages, kPage, kHkv, kDim});
  const Tensor qb = random_tensor(DType::bf16, {1, 1, 4, kDim}, 3);
  KvCache plain{MutableTensorView(const_cast<void*>(bf16_cache.data()), DType::bf16, {kPages, kPage, kHkv, kDim}),
                MutableTensorView(const_cast<void*>(bf16_cache.data()), DType::bf16, {kPages, kPage, kHkv, kDim})};
  plain.v_quant = kS8Page;
  expect_error([&] { forward_with_kvcache(qb.view(), plain); }, {"v_quant: s8 per_page describes u8 codes", "bf16"});
  plain.v_quant = {};
  plain.k_zero_point = kp.zero.view();
  expect_error([&] { forward_with_kvcache(qb.view(), plain); }, {"k_zero_point: zero points belong to a cache of u8 codes"});
}

}  // namespace
}  // namespace flashattn::test
