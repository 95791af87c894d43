// The numerics experiments shared by `flashattn numerics` and `flashattn tour`.
#include "tools/cli/experiments.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <utility>
#include <vector>

#include "tools/cli/measure.hpp"

namespace flashattn::cli {

namespace {

// Classic against conditional rescaling on the same inputs: the kernel's counts and the
// largest output difference.
RescaleCase rescale_case(const Qkv& in, const AttentionProblem& p, int threads) {
  RescaleCase r;
  std::vector<Tensor> outs;
  for (float threshold : {0.0f, AttentionProblem::kDefaultRescaleThreshold}) {
    std::vector<std::int32_t> counts(static_cast<std::size_t>(p.batch * p.heads_q * p.seqlen_q));
    AttentionOptions o;
    o.num_threads = threads;
    o.rescale_threshold = threshold;
    o.rescale_counts = MutableTensorView(counts.data(), DType::i32, {p.batch, p.heads_q, p.seqlen_q});
    outs.push_back(forward(in.q.view(), in.k.view(), in.v.view(), o).out);
    std::int64_t total = 0;
    for (std::int32_t c : counts) total += c;
    (threshold == 0.0f ? r.classic : r.conditional) = total;
    (threshold == 0.0f ? r.classic_per_row : r.conditional_per_row) =
        static_cast<double>(total) / static_cast<double>(counts.size());
  }
  double diff = 0.0;
  for (std::int64_t e = 0; e < outs[0].numel(); ++e) diff = std::fmax(diff, std::fabs(outs[0].get(e) - outs[1].get(e)));
  r.max_abs_diff = diff;
  r.rows = p.batch * p.heads_q * p.seqlen_q;
  const std::int64_t bc = plan_forward(p, CpuHardware::detect(threads)).block_k;
  r.key_tiles = (p.seqlen_k + bc - 1) / bc;
  return r;
}

double rmse(const Tensor& out, const std::vector<double>& want) {
  double s = 0.0;
  for (std::int64_t e = 0; e < out.numel(); ++e) {
    const double d = out.get(e) - want[static_cast<std::size_t>(e)];
    s += d * d;
  }
  return std::sqrt(s / static_cast<double>(out.numel()));
}

}  // namespace

Qkv random_qkv(const AttentionProblem& p, std::mt19937_64& rng) {
  AttentionProblem f32 = p;
  f32.dtype = DType::f32;
  return support::random_inputs(f32, rng());
}

RescaleCounts rescale_counts(const AttentionProblem& p, std::mt19937_64& rng, int threads) {
  RescaleCounts r;
  const Qkv random = random_qkv(p, rng);
  r.random = rescale_case(random, p, threads);
  // Adversarial rows: every query's scores grow steadily with the key index, by
  // kGrowthPerKey log2 units — 1.92 per 128-key tile, below the threshold of 8 — so the
  // classic rule rescales in every tile and the conditional one in about every fifth. (Not
  // a power of two: rescale factors that are powers of two would be exact and hide any
  // rounding difference between the rules.)
  constexpr double kGrowthPerKey = 0.015;
  Qkv ramp = random_qkv(p, rng);
  for (std::int64_t e = 0; e < ramp.q.numel(); ++e) ramp.q.set(e, e % p.head_dim == 0 ? 1.0f : 0.0f);
  const double per_key = kGrowthPerKey / (p.softmax_scale * OnlineSoftmaxState::kLog2e);
  for (std::int64_t e = 0; e < ramp.k.numel(); ++e) {
    const std::int64_t key = e / (p.heads_kv * p.head_dim) % p.seqlen_k;
    ramp.k.set(e, e % p.head_dim == 0 ? static_cast<float>(per_key * static_cast<double>(key)) : 0.0f);
  }
  r.adversarial = rescale_case(ramp, p, threads);
  r.score_growth_log2 = kGrowthPerKey * static_cast<double>(p.seqlen_k - 1);
  r.threshold = AttentionProblem::kDefaultRescaleThreshold;
  return r;
}

Fp8Error fp8_error(const AttentionProblem& p, std::uint64_t seed, Fp8Format format, int threads) {
  constexpr double kOutlierFraction = 0.001, kOutlierStd = 10.0;
  std::mt19937_64 rng(seed);
  Qkv in = random_qkv(p, rng);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::normal_distribution<float> outlier(0.0f, static_cast<float>(kOutlierStd));
  for (Tensor* t : {&in.q, &in.k, &in.v})
    for (std::int64_t e = 0; e < t->numel(); ++e)
      if (uniform(rng) < kOutlierFraction) t->set(e, t->get(e) + outlier(rng));
  AttentionOptions o;
  o.num_threads = threads;
  o.softmax_scale = p.softmax_scale;  // 1/sqrt(D) also after a padded rotation
  std::cerr << "  fp8: float64 reference of " << p.describe() << "\n";
  const reference::Result want = reference::attention(in.q.view(), in.k.view(), in.v.view(), o);

  Fp8Error r;
  r.format = to_string(format);
  r.seed = seed;
  r.outlier_fraction = kOutlierFraction;
  r.outlier_std = kOutlierStd;
  r.output_dtype = "bf16";
  {  // bf16 attention: inputs rounded to bf16, the bf16 forward
    Tensor qb(DType::bf16, in.q.shape()), kb(DType::bf16, in.k.shape()), vb(DType::bf16, in.v.shape());
    for (auto [src, dst] : {std::pair{&in.q, &qb}, {&in.k, &kb}, {&in.v, &vb}})
      for (std::int64_t e = 0; e < src->numel(); ++e) dst->set(e, src->get(e));
    r.rmse_bf16 = rmse(forward(qb.view(), kb.view(), vb.view(), o).out, want.out);
  }
  const CpuForwardPlan plan = plan_forward(p, CpuHardware::detect(threads));
  r.block_q = plan.block_q;
  r.block_k = plan.block_k;
  const std::uint64_t rotation_seed = seed + 1;
  r.rotation_seed = rotation_seed;
  const Tensor q_rot = hadamard_rotate(in.q.view(), rotation_seed), k_rot = hadamard_rotate(in.k.view(), rotation_seed);
  auto fp8_rmse = [&](const Tensor& q, const Tensor& k, bool per_block) {
    const Fp8Tensor q8 = quantize_fp8(q.view(), format, per_block ? plan.block_q : 0);
    const Fp8Tensor k8 = quantize_fp8(k.view(), format, per_block ? plan.block_k : 0);
    const Fp8Tensor v8 = quantize_fp8(in.v.view(), format, per_block ? plan.block_k : 0);
    return rmse(forward_fp8(q8.view(), k8.view(), v8.view(), DType::bf16, o).out, want.out);
  };
  r.rmse_per_tensor = fp8_rmse(in.q, in.k, false);
  r.rmse_per_block = fp8_rmse(in.q, in.k, true);
  r.rmse_hadamard = fp8_rmse(q_rot, k_rot, false);
  r.rmse_per_block_hadamard = fp8_rmse(q_rot, k_rot, true);
  return r;
}

Exp2Throughput exp2_throughput(int repeats) {
  constexpr std::size_t kArray = 4096, kPasses = 4096;  // 16M exponentials per timing
  std::vector<float> x(kArray), y(kArray);
  for (std::size_t i = 0; i < kArray; ++i) x[i] = -20.0f * static_cast<float>(i) / kArray;
  std::vector<double> times[2];
  for (int r = 0; r <= repeats; ++r)
    for (int impl = 0; impl < 2; ++impl) {
      const auto t0 = std::chrono::steady_clock::now();
      for (std::size_t pass = 0; pass < kPasses; ++pass)
        exp2_array(impl == 0 ? Exp2Impl::exact : Exp2Impl::poly3, x.data(), y.data(), kArray);
      if (r > 0) times[impl].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  Exp2Throughput r;
  for (int impl = 0; impl < 2; ++impl) {
    std::sort(times[impl].begin(), times[impl].end());
    (impl == 0 ? r.exact_gexp_per_s : r.poly3_gexp_per_s) =
        static_cast<double>(kArray * kPasses) / times[impl][times[impl].size() / 2] * 1e-9;
  }
  return r;
}

void print_rescale_counts(const RescaleCounts& r) {
  for (const auto& [name, c] : {std::pair{"random", &r.random}, {"adversarial", &r.adversarial}})
    std::printf("   %-11s rows %lld, %lld key tiles: classic %lld (%s/row), conditional %lld (%s/row), max |diff| %.2e\n",
                name, static_cast<long long>(c->rows), static_cast<long long>(c->key_tiles),
                static_cast<long long>(c->classic), number_or_na("%.2f", c->classic_per_row).c_str(),
                static_cast<long long>(c->conditional), number_or_na("%.2f", c->conditional_per_row).c_str(),
                c->max_abs_diff);
}

void print_fp8_error(const Fp8Error& f) {
  const auto rmse = [](double x) { return number_or_na("%.3e", x); };
  std::printf("   bf16 attention                 %s\n", rmse(f.rmse_bf16).c_str());
  std::printf("   FP8 per tensor                 %s\n", rmse(f.rmse_per_tensor).c_str());
  std::printf("   FP8 per block (%lld/%lld rows)     %s\n", static_cast<long long>(f.block_q),
              static_cast<long long>(f.block_k), rmse(f.rmse_per_block).c_str());
  std::printf("   FP8 per tensor + Hadamard      %s\n", rmse(f.rmse_hadamard).c_str());
  std::printf("   FP8 per block + Hadamard       %s\n", rmse(f.rmse_per_block_hadamard).c_str());
}

}  // namespace flashattn::cli
