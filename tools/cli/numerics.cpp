// `flashattn numerics`: the experiments behind docs/algorithm.md §2, §4 and §5, each printing what it
// measured on this machine — the online softmax step by step, the accuracy of the two
// exp2s before and after bf16 rounding, rescale counts with and without a threshold, FP8
// attention error with outliers (per tensor, per block, Hadamard), and the speed of the
// forward with each exp2 and rescaling rule.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <iterator>
#include <random>
#include <vector>

#include "tools/cli/commands.hpp"
#include "tools/cli/experiments.hpp"
#include "tools/cli/machine.hpp"
#include "tools/cli/measure.hpp"
#include "tools/cli/report.hpp"

namespace flashattn::cli {
namespace {

constexpr double kLn2 = 0.6931471805599453;

// --- 1. the online softmax on [1, 3, 2, 5], blocks [1, 3] and [2, 5] ------------------------
OnlineSoftmaxSteps online_softmax_steps() {
  const std::vector<std::vector<float>> blocks = {{1.0f, 3.0f}, {2.0f, 5.0f}};
  constexpr float kLog2e = OnlineSoftmaxState::kLog2e;
  OnlineSoftmaxState state;  // log2 units inside, reported in natural units
  OnlineSoftmaxSteps r;
  r.scores = {1, 3, 2, 5};
  r.blocks = blocks;
  for (const auto& block : blocks) {
    float block_max = -INFINITY;
    for (float x : block) block_max = std::fmax(block_max, x * kLog2e);
    state.rescale_to(block_max);
    float sum = 0.0f;
    for (float x : block) sum += std::exp2(x * kLog2e - state.max);
    state.add(sum);
    r.steps.push_back({state.max * kLn2, state.sum});
  }
  std::vector<double>& online = r.probabilities;
  std::vector<double>& one_pass = r.one_pass;
  double max = -INFINITY, total = 0.0, diff = 0.0;
  for (const auto& block : blocks)
    for (float x : block) max = std::fmax(max, x);
  for (const auto& block : blocks)
    for (float x : block) total += std::exp(x - max);
  for (const auto& block : blocks)
    for (float x : block) {
      online.push_back(std::exp2(x * kLog2e - state.max) * state.inverse_sum());
      one_pass.push_back(std::exp(x - max) / total);
      diff = std::fmax(diff, std::fabs(online.back() - one_pass.back()));
    }
  r.l_final = state.sum;
  r.max_abs_diff = diff;
  return r;
}

// --- 2. exp2 accuracy on the attention range x ≤ 0 ------------------------------------------
Exp2Accuracy exp2_accuracy() {
  // A dense uniform sweep of [−126, 0] (below, results are subnormal; the kernels see
  // x ≤ 0 after subtracting the maximum) plus a finer one of [−1, 0], where every binade's
  // fraction f = x − floor(x) is covered densely.
  constexpr int kCoarse = 1 << 22, kFine = 1 << 20;
  std::vector<float> x;
  x.reserve(kCoarse + kFine + 1);
  for (int i = 0; i <= kCoarse; ++i) x.push_back(-126.0f * static_cast<float>(i) / kCoarse);
  for (int i = 1; i <= kFine; ++i) x.push_back(-static_cast<float>(i) / kFine);
  std::vector<float> exact(x.size()), poly3(x.size());
  exp2_array(Exp2Impl::exact, x.data(), exact.data(), x.size());
  exp2_array(Exp2Impl::poly3, x.data(), poly3.data(), x.size());
  double e_exact = 0, e_poly = 0, e_exact_bf16 = 0, e_poly_bf16 = 0;
  std::int64_t bf16_differs = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp2(static_cast<double>(x[i]));
    auto rel = [&](float y) { return std::fabs(static_cast<double>(y) - want) / want; };
    e_exact = std::fmax(e_exact, rel(exact[i]));
    e_poly = std::fmax(e_poly, rel(poly3[i]));
    const float eb = round_to(DType::bf16, exact[i]), pb = round_to(DType::bf16, poly3[i]);
    e_exact_bf16 = std::fmax(e_exact_bf16, rel(eb));
    e_poly_bf16 = std::fmax(e_poly_bf16, rel(pb));
    bf16_differs += eb != pb;
  }
  return {x.size(),    -126.0,      0.0, e_exact, e_poly, e_exact_bf16, e_poly_bf16, unit_roundoff(DType::bf16),
          static_cast<double>(bf16_differs) / static_cast<double>(x.size())};
}

// --- 5. speed of each exp2 and rescaling rule, one run -------------------------------------
Speed speed(const AttentionProblem& p, std::mt19937_64& rng, int threads, int repeats) {
  struct Variant {
    Exp2Impl exp2;
    float threshold;
  };
  const Variant variants[] = {{Exp2Impl::exact, 0.0f}, {Exp2Impl::exact, 8.0f}, {Exp2Impl::poly3, 0.0f},
                              {Exp2Impl::poly3, 8.0f}, {Exp2Impl::mixed, 8.0f}};
  const Qkv f32 = random_qkv(p, rng);
  Tensor q(p.dtype, f32.q.shape()), k(p.dtype, f32.k.shape()), v(p.dtype, f32.v.shape());
  for (auto [src, dst] : {std::pair{&f32.q, &q}, {&f32.k, &k}, {&f32.v, &v}})
    for (std::int64_t e = 0; e < src->numel(); ++e) dst->set(e, src->get(e));
  Tensor out(p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}), lse(DType::f32, {p.batch, p.heads_q, p.seqlen_q});
  std::vector<std::vector<double>> times(std::size(variants));
  // Round robin (one call of each variant per round) so that drift in the machine's speed,
  // from other work on it, lands on every variant alike; median per variant.
  for (int r = 0; r <= repeats; ++r)
    for (std::size_t i = 0; i < std::size(variants); ++i) {
      AttentionOptions o;
      o.num_threads = threads;
      o.exp2 = variants[i].exp2;
      o.rescale_threshold = variants[i].threshold;
      const auto t0 = std::chrono::steady_clock::now();
      forward(q.view(), k.view(), v.view(), out.view(), lse.view(), o);
      if (r > 0) times[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  Speed r{to_string(p.dtype), p.causal, repeats, {}, exp2_throughput(repeats)};
  double baseline = 0.0;
  for (std::size_t i = 0; i < std::size(variants); ++i) {
    std::sort(times[i].begin(), times[i].end());
    const double seconds = times[i][times[i].size() / 2];
    const double gflops = p.visible_forward_flops() / seconds * 1e-9;  // the visible pairs' FLOPs
    if (i == 0) baseline = gflops;
    SpeedCase c{to_string(variants[i].exp2), variants[i].threshold, seconds, gflops, gflops / baseline};
    if (variants[i].exp2 == Exp2Impl::mixed) c.exp2_poly3_fraction = AttentionOptions{}.exp2_poly3_fraction;
    r.cases.push_back(c);
  }
  return r;
}

void print_report(const NumericsReport& r) {
  const OnlineSoftmaxSteps& os = r.online_softmax;
  std::printf("1. online softmax of [1, 3, 2, 5] in blocks [1, 3], [2, 5] (natural units)\n");
  for (std::size_t s = 0; s < os.steps.size(); ++s)
    std::printf("   after block %zu: m = %.6f, l = %.6f\n", s + 1, os.steps[s].m, static_cast<double>(os.steps[s].l));
  std::printf("   probabilities  ");
  for (double x : os.probabilities) std::printf(" %.6f", x);
  std::printf("\n   one-pass       ");
  for (double x : os.one_pass) std::printf(" %.6f", x);
  std::printf("\n   max |online - one-pass| = %.2e\n", os.max_abs_diff);

  const Exp2Accuracy& e = r.exp2;
  std::printf("\n2. exp2 over %lld points of [-126, 0], max relative error vs float64\n",
              static_cast<long long>(e.points));
  std::printf("   float32:        exact %.2e   poly3 %.2e\n", e.exact_max_rel_err_f32, e.poly3_max_rel_err_f32);
  std::printf("   rounded to bf16: exact %.2e   poly3 %.2e   (half a bf16 ulp: %.2e; results differing: %.3f%%)\n",
              e.exact_max_rel_err_bf16, e.poly3_max_rel_err_bf16, e.bf16_half_ulp,
              100.0 * e.bf16_results_differing_fraction);

  std::printf("\n3. rescales of the online-softmax state, classic (threshold 0) vs conditional (threshold %g)\n",
              r.rescale.threshold);
  print_rescale_counts(r.rescale);

  const Fp8Error& fp8 = r.fp8;
  std::printf("\n4. attention output RMSE vs float64, N(0,1) inputs + N(0, %g^2) on %.1f%% of entries (seed %llu), %s\n",
              fp8.outlier_std, 100.0 * fp8.outlier_fraction, static_cast<unsigned long long>(fp8.seed), fp8.format.c_str());
  print_fp8_error(fp8);

  const Speed& s = r.speed;
  std::printf("\n5. forward speed, %s, median of %d round-robin runs\n", s.dtype.c_str(), s.repeats);
  for (const SpeedCase& c : s.cases)
    std::printf("   exp2 %-5s threshold %g: %7.1f GFLOP/s  (%s exact/classic)\n", c.exp2.c_str(), c.rescale_threshold,
                c.gflops, number_or_na("%.3fx", c.ratio_to_exact_classic).c_str());
  std::printf("   exp2 alone, one thread: exact %.2f, poly3 %.2f billion per second\n",
              s.exp2_throughput.exact_gexp_per_s, s.exp2_throughput.poly3_gexp_per_s);
}

}  // namespace

void numerics(const NumericsFlags& f) {
  NumericsReport r;
  r.threads = f.shape.threads;
  std::mt19937_64 rng(f.seed);
  r.seed = f.seed;
  r.online_softmax = online_softmax_steps();
  std::cerr << "exp2 sweep\n";
  r.exp2 = exp2_accuracy();
  ShapeFlags f32_shape = f.shape;
  f32_shape.dtype = "f32";
  f32_shape.causal = false;
  AttentionOptions scale_only;
  scale_only.softmax_scale = f.shape.softmax_scale;
  const AttentionProblem p = f32_shape.problem(scale_only);
  std::cerr << "rescale counts\n";
  r.rescale = rescale_counts(p, rng, f.shape.threads);
  r.fp8 = fp8_error(p, f.seed, parse_fp8_format(f.fp8_format), f.shape.threads);
  ShapeFlags speed_shape = f32_shape;
  speed_shape.dtype = f.shape.dtype;
  std::cerr << "speed\n";
  r.speed = speed(speed_shape.problem(scale_only), rng, f.shape.threads, f.repeats);
  if (f.json) {
    std::cout << numerics_json(r) << "\n";
    return;
  }
  std::printf("flashattn numerics: %s (speed: dtype=%s) seed=%llu fp8_format=%s repeats=%d\n", p.describe().c_str(),
              f.shape.dtype.c_str(), static_cast<unsigned long long>(f.seed), f.fp8_format.c_str(), f.repeats);
  std::printf("cpu: %s, %d threads, simd %s\n\n", cpu_model().c_str(), resolved_threads(f.shape.threads),
              cpu_simd_target().c_str());
  print_report(r);
}

}  // namespace flashattn::cli
