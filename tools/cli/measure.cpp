#include "tools/cli/measure.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <thread>
#include <utility>
#include <vector>

#include <omp.h>

#include "flashattn/error.hpp"
#include "tools/baseline/standard_attention.hpp"
#include "tools/support/random_inputs.hpp"

namespace flashattn::cli {

Inputs random_inputs(const AttentionProblem& p, std::uint64_t seed) {
  // Seeds 4·seed … 4·seed + 3: the inputs of consecutive seeds never share a stream.
  support::Qkv qkv = support::random_inputs(p, 4 * seed);
  return {std::move(qkv.q), std::move(qkv.k), std::move(qkv.v),
          support::random_tensor(p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}, 4 * seed + 3)};
}

double median_seconds(const std::function<void()>& fn, int repeats, int warmup,
                      const std::string& label) {
  if (repeats < 1) throw Error(label + ": the median of " + std::to_string(repeats) + " timed runs (at least 1)");
  using clock = std::chrono::steady_clock;
  std::vector<double> times;
  const auto start = clock::now();
  bool announced = false;
  for (int r = 0; r < warmup + repeats; ++r) {
    const auto t0 = clock::now();
    fn();
    const double sec = std::chrono::duration<double>(clock::now() - t0).count();
    if (r >= warmup) times.push_back(sec);
    const double elapsed = std::chrono::duration<double>(clock::now() - start).count();
    const double expected = elapsed / (r + 1) * (warmup + repeats);
    if (expected > 3.0 && r + 1 < warmup + repeats) {
      std::cerr << "\r  " << label << ": run " << (r + 1) << "/" << (warmup + repeats) << std::flush;
      announced = true;
    }
  }
  if (announced) std::cerr << "\r  " << label << ": done" << std::string(12, ' ') << "\n";
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

double sampled_max_error(const AttentionProblem& p, const AttentionOptions& options,
                         const Inputs& in, const Tensor& out, int samples) {
  double worst = 0.0;
  std::vector<double> row(static_cast<std::size_t>(p.head_dim_v));
  const std::int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  for (int s = 0; s < samples && rows > 0; ++s) {
    // Evenly spread, always including the first and last row.
    const std::int64_t r = samples > 1 ? s * (rows - 1) / (samples - 1) : 0;
    const std::int64_t i = r % p.seqlen_q, h = (r / p.seqlen_q) % p.heads_q;
    const std::int64_t b = r / (p.seqlen_q * p.heads_q);
    double lse = 0.0;
    reference::attention_row(p, options, in.q.view(), in.k.view(), in.v.view(), b, h, i, row.data(), &lse);
    for (std::int64_t c = 0; c < p.head_dim_v; ++c)
      worst = std::fmax(worst, std::fabs(out.get(((b * p.seqlen_q + i) * p.heads_q + h) * p.head_dim_v + c) -
                                         row[static_cast<std::size_t>(c)]));
  }
  return worst;
}

void let_worker_threads_sleep() { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 3) bytes /= 1024.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", bytes, units[u]);
  return buf;
}

std::string number_or_na(const char* format, double value) {
  if (!std::isfinite(value)) return "n/a";
  char buf[64];
  std::snprintf(buf, sizeof buf, format, value);
  return buf;
}

const char* impl_name(Impl impl) { return impl == Impl::flashattn ? "flashattn" : "standard"; }

namespace {

// `options` that also hand the plans the call ran to `plans`.
AttentionOptions reporting_plans(const AttentionOptions& options, PlansRun& plans) {
  AttentionOptions reporting = options;
  reporting.plans_run = &plans;
  return reporting;
}

// How a timed run is named in progress output: "flashattn backward bf16 causal".
std::string run_label(const Measurement& m, const AttentionProblem& p) {
  return std::string(impl_name(m.impl)) + (m.op == Op::bwd ? " backward " : " ") + to_string(p.dtype) +
         (p.causal ? " causal" : "") + (m.deterministic ? " deterministic" : "");
}

}  // namespace

Measurement measure_forward(Impl impl, const AttentionProblem& p, const AttentionOptions& options,
                            const Inputs& in, int repeats) {
  Measurement m{impl};
  m.out = Tensor(p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v});
  Tensor lse(DType::f32, {p.batch, p.heads_q, p.seqlen_q});
  PlansRun plans;  // what the timed calls ran, reported below
  const AttentionOptions reporting = reporting_plans(options, plans);
  m.seconds = median_seconds(
      [&] {
        if (impl == Impl::flashattn) {
          forward(in.q.view(), in.k.view(), in.v.view(), m.out.view(), lse.view(), reporting);
        } else {
          m.peak_bytes = baseline::standard_attention(in.q.view(), in.k.view(), in.v.view(),
                                                      m.out.view(), lse.view(), options);
        }
      },
      repeats, 1, run_label(m, p));
  let_worker_threads_sleep();
  if (!plans.forward.empty()) {
    const CpuForwardPlan& plan = plans.forward.front();
    m.peak_bytes = plan.workspace_bytes();
    m.kernel = to_string(plan.kernel);
    m.plan = plan.describe();
  }
  m.gflops = p.visible_forward_flops(options.block_mask) / m.seconds * 1e-9;
  m.dense_equivalent_gflops = p.conventional_forward_flops() / m.seconds * 1e-9;
  return m;
}

Measurement measure_backward(Impl impl, const AttentionProblem& p, const AttentionOptions& options,
                             const Inputs& in, int repeats) {
  Measurement m{impl, Op::bwd, impl == Impl::flashattn && options.deterministic};
  const ForwardResult fwd = forward(in.q.view(), in.k.view(), in.v.view(), options);
  Tensor dq(p.dtype, in.q.shape()), dk(p.dtype, in.k.shape()), dv(p.dtype, in.v.shape());
  PlansRun plans;  // what the timed calls ran, reported below
  const AttentionOptions reporting = reporting_plans(options, plans);
  m.seconds = median_seconds(
      [&] {
        if (impl == Impl::flashattn) {
          backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), fwd.out.view(),
                   fwd.lse.view(), dq.view(), dk.view(), dv.view(), reporting);
        } else {
          m.peak_bytes = baseline::standard_attention_backward(in.dout.view(), in.q.view(),
                                                               in.k.view(), in.v.view(), dq.view(),
                                                               dk.view(), dv.view(), options);
        }
      },
      repeats, 1, run_label(m, p));
  let_worker_threads_sleep();
  if (!plans.backward.empty()) {
    const CpuBackwardPlan& plan = plans.backward.front();
    m.peak_bytes = plan.workspace_bytes();
    m.kernel = to_string(plan.kernel);
  }
  m.gflops = 2.5 * p.visible_forward_flops(options.block_mask) / m.seconds * 1e-9;
  m.dense_equivalent_gflops = 2.5 * p.conventional_forward_flops() / m.seconds * 1e-9;
  return m;
}

double copy_gbps(int repeats) {
  constexpr std::size_t kBytes = std::size_t{256} << 20;  // far beyond the caches
  std::vector<unsigned char> src(kBytes, 1), dst(kBytes, 0);
  double best = 1e30;
  for (int r = 0; r < repeats + 1; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), src.data(), kBytes);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::min(best, sec);
  }
  return 2.0 * static_cast<double>(kBytes) / best * 1e-9;
}

double read_gbps(int repeats, int threads) {
  constexpr std::size_t kWords = (std::size_t{256} << 20) / sizeof(std::uint64_t);
  std::vector<std::uint64_t> src(kWords, 1);
  const int team = threads > 0 ? threads : omp_get_max_threads();
  double best = 1e30;
  std::uint64_t sum = 0;
  for (int r = 0; r < repeats + 1; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    std::uint64_t part = 0;
#pragma omp parallel for num_threads(team) reduction(+ : part) schedule(static)
    for (std::size_t i = 0; i < kWords; ++i) part += src[i];
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sum += part;
    if (r > 0) best = std::min(best, sec);
  }
  if (sum != static_cast<std::uint64_t>(repeats + 1) * kWords) throw Error("read_gbps: the sum of ones is wrong");
  return static_cast<double>(kWords * sizeof(std::uint64_t)) / best * 1e-9;
}

}  // namespace flashattn::cli
