#include "tools/cli/common.hpp"
#include "tools/support/npy.hpp"

#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

namespace flashattn::cli {

void ShapeFlags::add_to(CLI::App& app, bool with_mode) {
  app.add_option("--batch", batch, "batch size")->capture_default_str();
  app.add_option("--seqlen", seqlen, "sequence length of queries and keys")->capture_default_str();
  app.add_option("--seqlen-q", seqlen_q, "query sequence length (overrides --seqlen)");
  app.add_option("--seqlen-k", seqlen_k, "key/value sequence length (overrides --seqlen)");
  app.add_option("--heads", heads, "query heads")->capture_default_str();
  app.add_option("--heads-kv", heads_kv, "key/value heads (GQA/MQA; default: --heads)");
  app.add_option("--dim", dim, "head dimension of q and k")->capture_default_str();
  app.add_option("--dim-v", dim_v, "head dimension of v (default: --dim)");
  app.add_option("--threads", threads, "worker threads (0 = all cores)")->capture_default_str();
  app.add_option("--kernel", kernel,
                 "CPU forward kernel: auto, tiled, tiled_bf16 (bf16 on AVX512-BF16; bench: its bf16 cases), decode or "
                 "decode_fp16 (FP8 cache on AVX512-FP16; bench: its e4m3 decode cases)")
      ->capture_default_str()->check(CLI::IsMember({"auto", "tiled", "tiled_bf16", "decode", "decode_fp16"}));
  app.add_option("--backward-kernel", backward_kernel, "CPU backward kernel: auto, tiled or tiled_bf16 (bf16 on AVX512-BF16)")
      ->capture_default_str()->check(CLI::IsMember({"auto", "tiled", "tiled_bf16"}));
  if (!with_mode) return;
  app.add_option("--dtype", dtype, "f32, bf16 or f16")->capture_default_str();
  app.add_flag("--causal,!--no-causal", causal, "bottom-right aligned causal mask")
      ->capture_default_str();
  app.add_option("--softmax-scale", softmax_scale, "scale of Q·Kᵀ (default 1/sqrt(dim))");
  app.add_option("--num-splits", num_splits, "split-KV parts per Q tile (0 = automatic, 1 = none)")
      ->capture_default_str();
}

void VariantFlags::add_to(CLI::App& app) {
  app.add_option("--window-size", window_size, "sliding window LEFT RIGHT (-1 = unbounded)")
      ->expected(2);
  app.add_option("--softcap", softcap, "soft-capping: scores become softcap*tanh(s/softcap)");
  app.add_option("--alibi-slopes", alibi_slopes_path, "ALiBi slopes .npy, float32 (heads) or (batch, heads)")
      ->check(CLI::ExistingFile);
  app.add_option("--dropout-p", dropout_p, "dropout probability on the attention weights");
  app.add_option("--seed", seed, "dropout seed");
  CLI::Option* mask = app.add_option("--block-mask", block_mask_path,
                                     "block-sparse mask .npy, bool/uint8 (q blocks, k blocks)")
                          ->check(CLI::ExistingFile);
  CLI::Option* size = app.add_option("--block-size", block_size, "tokens per block of --block-mask");
  mask->needs(size);
  size->needs(mask);
}

void VariantFlags::apply(AttentionOptions& o) {
  if (!window_size.empty()) o.window_size = {window_size[0], window_size[1]};
  o.softcap = softcap;
  o.dropout_p = dropout_p;
  o.seed = seed;
  if (!alibi_slopes_path.empty()) {
    alibi_slopes = support::read_npy(alibi_slopes_path);
    o.alibi_slopes = alibi_slopes.view();
  }
  if (!block_mask_path.empty()) {
    block_mask = support::read_npy(block_mask_path);
    o.block_mask = block_mask.view();
    o.block_mask_block_size = block_size;
  }
}

bool VariantFlags::needs_flashattn_only() const {
  return softcap > 0.0f || dropout_p > 0.0f || !alibi_slopes_path.empty() || !block_mask_path.empty();
}

AttentionOptions ShapeFlags::options() const {
  AttentionOptions o;
  o.causal = causal;
  o.softmax_scale = softmax_scale;
  o.num_threads = threads;
  o.num_splits = num_splits;
  o.kernel = parse_forward_kernel(kernel);
  o.backward_kernel = parse_backward_kernel(backward_kernel);
  return o;
}

AttentionProblem ShapeFlags::problem(const std::optional<AttentionOptions>& o) const {
  return AttentionProblem::from_sizes(batch, seqlen_q.value_or(seqlen), seqlen_k.value_or(seqlen),
                                      heads, heads_kv.value_or(heads), dim, dim_v.value_or(dim),
                                      parse_dtype(dtype), o ? *o : options());
}

Inputs random_inputs(const AttentionProblem& p, std::uint64_t seed) {
  Inputs in{Tensor(p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim}),
            Tensor(p.dtype, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim}),
            Tensor(p.dtype, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim_v}),
            Tensor(p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v})};
  std::uint64_t stream = 0;
  for (Tensor* t : {&in.q, &in.k, &in.v, &in.dout}) {
    const std::int64_t n = t->numel();
    const std::uint64_t s = seed * 3 + stream++;
#pragma omp parallel
    {
      // One generator per thread and chunk: deterministic for a given thread count.
      const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
      std::mt19937_64 rng(s * 1000003 + static_cast<std::uint64_t>(tid));
      std::normal_distribution<float> normal;
      for (std::int64_t i = n * tid / nt; i < n * (tid + 1) / nt; ++i) t->set(i, normal(rng));
    }
  }
  return in;
}

double median_seconds(const std::function<void()>& fn, int repeats, int warmup,
                      const std::string& label) {
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

std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

int resolved_threads(int requested) { return requested > 0 ? requested : omp_get_max_threads(); }

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 3) bytes /= 1024.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", bytes, units[u]);
  return buf;
}

double cpu_clock_ghz() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("cpu MHz", 0) == 0) return std::stod(line.substr(line.find(':') + 1)) * 1e-3;
  std::ifstream max_freq("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq");  // kHz
  double khz = 0.0;
  if (max_freq >> khz && khz > 0.0) return khz * 1e-6;
  throw Error("cpu clock: neither /proc/cpuinfo nor cpufreq states it");
}

}  // namespace flashattn::cli

#include "tools/baseline/standard_attention.hpp"

namespace flashattn::cli {
namespace {

// Idle worker threads busy-wait before they sleep — OpenBLAS's for about 2^28 cycles
// (~0.1 s), OpenMP's for a spin count — and on a 2-core machine they would steal a core
// from whichever implementation is timed next. Every measurement ends with a pause.
void let_worker_threads_sleep() { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }

}  // namespace

const char* impl_name(Impl impl) { return impl == Impl::flashattn ? "flashattn" : "standard"; }

Measurement measure_forward(Impl impl, const AttentionProblem& p, const AttentionOptions& options,
                            const Inputs& in, int repeats) {
  Measurement m{impl};
  m.out = Tensor(p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v});
  Tensor lse(DType::f32, {p.batch, p.heads_q, p.seqlen_q});
  const std::string label = std::string(impl_name(impl)) + " " + to_string(p.dtype) +
                            (p.causal ? " causal" : "");
  m.seconds = median_seconds(
      [&] {
        if (impl == Impl::flashattn) {
          forward(in.q.view(), in.k.view(), in.v.view(), m.out.view(), lse.view(), options);
        } else {
          m.peak_bytes = baseline::standard_attention(in.q.view(), in.k.view(), in.v.view(),
                                                      m.out.view(), lse.view(), options);
        }
      },
      repeats, 1, label);
  let_worker_threads_sleep();
  if (impl == Impl::flashattn) {
    const CpuForwardPlan plan =
        plan_forward(p, CpuHardware::detect(options.num_threads), options);
    m.peak_bytes = plan.workspace_bytes();
    m.kernel = to_string(plan.kernel);
    m.plan = plan.describe();
  }
  m.gflops = p.conventional_forward_flops() / m.seconds * 1e-9;
  return m;
}

Measurement measure_backward(Impl impl, const AttentionProblem& p, const AttentionOptions& options,
                             const Inputs& in, int repeats) {
  Measurement m{impl, Op::bwd, impl == Impl::flashattn && options.deterministic};
  const ForwardResult fwd = forward(in.q.view(), in.k.view(), in.v.view(), options);
  Tensor dq(p.dtype, in.q.shape()), dk(p.dtype, in.k.shape()), dv(p.dtype, in.v.shape());
  const std::string label = std::string(impl_name(impl)) + " backward " + to_string(p.dtype) +
                            (p.causal ? " causal" : "") + (m.deterministic ? " deterministic" : "");
  m.seconds = median_seconds(
      [&] {
        if (impl == Impl::flashattn) {
          backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), fwd.out.view(),
                   fwd.lse.view(), dq.view(), dk.view(), dv.view(), options);
        } else {
          m.peak_bytes = baseline::standard_attention_backward(in.dout.view(), in.q.view(),
                                                               in.k.view(), in.v.view(), dq.view(),
                                                               dk.view(), dv.view(), options);
        }
      },
      repeats, 1, label);
  let_worker_threads_sleep();
  if (impl == Impl::flashattn) {
    const CpuBackwardPlan plan =
        plan_backward(p, CpuHardware::detect(options.num_threads), options.deterministic, options.backward_kernel);
    m.peak_bytes = plan.workspace_bytes();
    m.kernel = to_string(plan.kernel);
  }
  m.gflops = 2.5 * p.conventional_forward_flops() / m.seconds * 1e-9;
  return m;
}

}  // namespace flashattn::cli

namespace flashattn::cli {

nlohmann::json case_json(const Measurement& m, const AttentionProblem& p) {
  nlohmann::json j = {{"impl", impl_name(m.impl)},  {"op", m.op == Op::fwd ? "fwd" : "bwd"},
          {"dtype", to_string(p.dtype)}, {"batch", p.batch},
          {"heads", p.heads_q},          {"heads_kv", p.heads_kv},
          {"seqlen_q", p.seqlen_q},      {"seqlen_k", p.seqlen_k},
          {"dim", p.head_dim},           {"dim_v", p.head_dim_v},
          {"causal", p.causal},          {"seconds", m.seconds},
          {"gflops", m.gflops},          {"peak_bytes", m.peak_bytes}};
  if (m.op == Op::bwd) j["deterministic"] = m.deterministic;
  if (!m.kernel.empty()) j["kernel"] = m.kernel;
  if (p.window_left >= 0 || (p.window_right >= 0 && !p.causal)) {
    j["window_left"] = p.window_left;
    j["window_right"] = p.window_right;
  }
  return j;
}

nlohmann::json machine_json(int threads) {
  return {{"cpu", cpu_model()},
          {"threads", resolved_threads(threads)},
          {"simd_target", cpu_simd_target()},
          {"openblas_corename", baseline::openblas_corename()}};
}

}  // namespace flashattn::cli

#include <cstring>

namespace flashattn::cli {

DecodeMeasurement measure_decode(const DecodeCase& c, int repeats) {
  const std::int64_t cap = c.cached + 1;
  const bool paged = c.page_size > 0;
  const std::int64_t per_seq = paged ? (cap + c.page_size - 1) / c.page_size : 0;
  const std::int64_t pages = paged ? c.batch * per_seq : c.batch;  // a contiguous row is one "page"
  const std::int64_t slots = paged ? c.page_size : cap;
  const std::vector<std::int64_t> cache_shape{pages, slots, c.heads_kv, c.dim};
  // Random q, new token and cache contents: a (batch, cap) problem supplies the tensors.
  const AttentionProblem logical = AttentionProblem::from_sizes(c.batch, 1, cap, c.heads, c.heads_kv, c.dim,
                                                                c.dim, c.dtype, {});
  const Inputs in = random_inputs(logical, 11);
  const DType cache_dtype = c.fp8_cache ? DType::u8 : c.dtype;
  Tensor k_cache(cache_dtype, cache_shape), v_cache(cache_dtype, cache_shape), table(DType::i32, {c.batch, std::max<std::int64_t>(per_seq, 1)});
  Tensor k_scale(DType::f32, {pages, c.heads_kv}), v_scale(DType::f32, {pages, c.heads_kv});
  const std::int64_t row = c.heads_kv * c.dim;
  auto slot_of = [&](std::int64_t b, std::int64_t pos) {  // (page, slot) of a logical token
    return paged ? std::pair{b * per_seq + pos / c.page_size, pos % c.page_size} : std::pair{b, pos};
  };
  if (c.fp8_cache) {
    // The cached tokens quantized as appends leave them: per (page, kv head), the smallest
    // power-of-two multiple of FLT_MIN with amax ≤ 448·descale.
    std::vector<float> x(static_cast<std::size_t>(c.dim));
    for (const auto& [src, codes, scale] : {std::tuple{&in.k, &k_cache, &k_scale}, {&in.v, &v_cache, &v_scale}}) {
      std::vector<float> amax(static_cast<std::size_t>(pages * c.heads_kv), 0.0f);
      for (std::int64_t b = 0; b < c.batch; ++b)
        for (std::int64_t pos = 0; pos < c.cached; ++pos)
          for (std::int64_t e = 0; e < row; ++e) {
            float& a = amax[static_cast<std::size_t>(slot_of(b, pos).first * c.heads_kv + e / c.dim)];
            a = std::max(a, std::fabs(src->get((b * cap + pos) * row + e)));
          }
      for (std::int64_t i = 0; i < pages * c.heads_kv; ++i) {
        float descale = FLT_MIN;
        while (amax[static_cast<std::size_t>(i)] > fp8_info(Fp8Format::e4m3).max * descale) descale *= 2.0f;
        scale->set(i, descale);
      }
      for (std::int64_t b = 0; b < c.batch; ++b)
        for (std::int64_t pos = 0; pos < c.cached; ++pos)
          for (std::int64_t h = 0; h < c.heads_kv; ++h) {
            const auto [page, slot] = slot_of(b, pos);
            for (std::int64_t e = 0; e < c.dim; ++e) x[static_cast<std::size_t>(e)] = src->get(((b * cap + pos) * c.heads_kv + h) * c.dim + e);
            convert_to_fp8(x.data(), codes->data_as<std::uint8_t>() + ((page * slots + slot) * c.heads_kv + h) * c.dim,
                           static_cast<std::size_t>(c.dim), Fp8Format::e4m3, 1.0f / scale->get(page * c.heads_kv + h));
          }
    }
  } else {
    for (std::int64_t b = 0; b < c.batch; ++b)
      for (std::int64_t pos = 0; pos < cap; ++pos) {
        const auto [page, slot] = slot_of(b, pos);
        const std::int64_t dst = (page * slots + slot) * row;
        std::memcpy(static_cast<unsigned char*>(k_cache.data()) + dst * dtype_size(c.dtype),
                    static_cast<const unsigned char*>(in.k.data()) + (b * cap + pos) * row * dtype_size(c.dtype),
                    row * dtype_size(c.dtype));
        std::memcpy(static_cast<unsigned char*>(v_cache.data()) + dst * dtype_size(c.dtype),
                    static_cast<const unsigned char*>(in.v.data()) + (b * cap + pos) * row * dtype_size(c.dtype),
                    row * dtype_size(c.dtype));
      }
  }
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t pg = 0; pg < per_seq; ++pg) table.set(b * per_seq + pg, static_cast<float>(b * per_seq + pg));
  Tensor seqlens(DType::i32, {c.batch});
  for (std::int64_t b = 0; b < c.batch; ++b) seqlens.set(b, static_cast<float>(c.cached));
  // The appended token is the logical cache's last one, so the reference is `logical`.
  Tensor k_new(c.dtype, {c.batch, 1, c.heads_kv, c.dim}), v_new(c.dtype, {c.batch, 1, c.heads_kv, c.dim});
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t e = 0; e < row; ++e) {
      k_new.set(b * row + e, in.k.get((b * cap + c.cached) * row + e));
      v_new.set(b * row + e, in.v.get((b * cap + c.cached) * row + e));
    }
  KvCache cache;
  cache.k_cache = k_cache.view();
  cache.v_cache = v_cache.view();
  if (paged) cache.block_table = table.view();
  if (c.fp8_cache) {
    cache.k_scale = k_scale.view();
    cache.v_scale = v_scale.view();
  }
  cache.cache_seqlens = seqlens.view();
  cache.k = k_new.view();
  cache.v = v_new.view();
  AttentionOptions options;
  options.num_threads = c.threads;
  options.kernel = c.kernel;
  ForwardResult r;
  DecodeMeasurement m;
  AttentionProblem planned = logical;  // as forward_with_kvcache plans it: the cache's dtype
  planned.kv_dtype = cache_dtype;
  m.kernel = to_string(plan_forward(planned, CpuHardware::detect(c.threads), options.num_splits, 0, options.kernel).kernel);
  m.seconds = median_seconds([&] { r = forward_with_kvcache(in.q.view(), cache, options); }, repeats, 1,
                             paged ? "decode (paged)" : "decode");
  let_worker_threads_sleep();
  m.cache_bytes = static_cast<std::size_t>(2 * c.batch * cap * row) * dtype_size(cache_dtype);
  m.gbps = static_cast<double>(m.cache_bytes) / m.seconds * 1e-9;
  std::vector<double> ref(static_cast<std::size_t>(c.dim));
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t h = 0; h < c.heads; h += std::max<std::int64_t>(1, c.heads / 4)) {
      double lse = 0.0;
      reference::attention_row(logical, options, in.q.view(), in.k.view(), in.v.view(), b, h, 0, ref.data(), &lse);
      for (std::int64_t e = 0; e < c.dim; ++e)
        m.max_error = std::max(m.max_error, std::fabs(r.out.get((b * c.heads + h) * c.dim + e) - ref[static_cast<std::size_t>(e)]));
    }
  return m;
}

nlohmann::json decode_json(const DecodeCase& c, const DecodeMeasurement& m) {
  return {{"impl", "flashattn"}, {"op", "decode"},        {"dtype", to_string(c.dtype)},
          {"batch", c.batch},    {"heads", c.heads},      {"heads_kv", c.heads_kv},
          {"dim", c.dim},        {"cached", c.cached},    {"page_size", c.page_size},
          {"cache_dtype", c.fp8_cache ? "e4m3" : to_string(c.dtype)},
          {"seconds", m.seconds}, {"gbps", m.gbps},       {"cache_bytes", m.cache_bytes},
          {"max_error", m.max_error}, {"kernel", m.kernel}};
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

}  // namespace flashattn::cli
