// `flashattn run`: the main job. Random inputs of a realistic shape, flashattn against
// standard attention, a small table of time, GFLOP/s, memory and accuracy.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "tools/baseline/standard_attention.hpp"
#include "tools/cli/commands.hpp"
#include "tools/cli/decode.hpp"
#include "tools/cli/machine.hpp"
#include "tools/cli/measure.hpp"
#include "tools/cli/report.hpp"
#include "tools/support/npy.hpp"

namespace flashattn::cli {
namespace {

// The options of `run` that one of its modes does not read: an Error naming the first one
// given, instead of a run that silently ignores it.
void refuse_unused(const RunFlags& f, const char* mode, std::initializer_list<const char*> unused) {
  for (const char* name : unused)
    if (f.given.count(name) > 0)  // given_options names both flags of --causal,!--no-causal
      throw Error(std::string(mode) + " does not take " + (std::string(name) == "--causal" ? "--causal/--no-causal" : name));
}

// One decoding step over a KV cache: time, bandwidth, accuracy.
void run_decode(const RunFlags& f) {
  // The decode case builds its own problem (one query over the cache, no mask or variant) and
  // checks it against a float64 reference of that problem: every option that would change it
  // is refused rather than dropped.
  refuse_unused(f, "--decode",
                {"--seqlen", "--seqlen-q", "--seqlen-k", "--dim-v", "--causal", "--softmax-scale",
                 "--num-splits", "--backward-kernel", "--pack-gqa", "--window-size", "--softcap", "--alibi-slopes",
                 "--dropout-p", "--seed", "--block-mask", "--block-size", "--attn-mask", "--backward", "--samples",
                 "--cu-seqlens-q", "--cu-seqlens-k"});
  DecodeCase c;
  c.batch = f.shape.batch;
  c.heads = f.given.count("--heads") ? f.shape.heads : 32;  // decode defaults: 32 q heads, 8 kv heads
  c.heads_kv = f.shape.heads_kv.value_or(f.given.count("--heads") ? f.shape.heads : 8);
  c.dim = f.shape.dim;
  c.dtype = parse_dtype(f.shape.dtype);
  c.threads = f.shape.threads;
  c.cached = f.cached;
  c.page_size = f.page_size;
  c.cache_format = f.cache_dtype;
  c.kernel = parse_forward_kernel(f.shape.kernel);
  const DecodeMeasurement m = measure_decode(c, f.repeats);
  if (f.json) {
    std::cout << decode_run_json(f.shape.threads, c, m) << "\n";
    return;
  }
  std::printf("flashattn run --decode: batch %lld, %lld q heads, %lld kv heads, dim %lld, %s cache of %lld tokens%s, causal=false\n",
              static_cast<long long>(c.batch), static_cast<long long>(c.heads), static_cast<long long>(c.heads_kv),
              static_cast<long long>(c.dim), c.cache_name().c_str(), static_cast<long long>(c.cached),
              c.page_size > 0 ? (", pages of " + std::to_string(c.page_size)).c_str() : " (contiguous)");
  std::printf("one token: %.3f ms, %.2f GB/s of K and V (%s), max |err| vs float64 %.2e, kernel %s\n",
              m.seconds * 1e3, m.gbps, human_bytes(static_cast<double>(m.cache_bytes)).c_str(), m.max_error,
              m.kernel.c_str());
}

// A packed variable-length batch of random inputs with the offsets of two .npy files:
// flashattn only (the textbook baseline has no packed form), its time, GFLOP/s and the
// max error against float64 on sampled rows of every sequence.
void run_varlen(const RunFlags& f, const AttentionOptions& options) {
  // The offsets give the batch and every sequence's lengths; the error is checked on three
  // rows of each sequence, not --samples.
  refuse_unused(f, "--cu-seqlens-q/--cu-seqlens-k", {"--batch", "--seqlen", "--seqlen-q", "--seqlen-k", "--samples"});
  const VarlenOffsets cu = read_varlen_offsets(f.cu_seqlens_q, f.cu_seqlens_k);
  const std::int64_t batch = cu.batch();
  double flops = 0.0;
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t sq = cu.at_q[b + 1] - cu.at_q[b], sk = cu.at_k[b + 1] - cu.at_k[b];
    ShapeFlags one = f.shape;
    one.batch = 1;
    one.seqlen_q = sq;
    one.seqlen_k = sk;
    flops += one.problem(options).visible_forward_flops();  // its visible pairs' FLOPs
  }
  ShapeFlags packed = f.shape;  // a (1, total, H, D) problem supplies the random tensors
  packed.batch = 1;
  packed.seqlen_q = cu.at_q.back();
  packed.seqlen_k = cu.at_k.back();
  AttentionOptions plain = options;
  plain.alibi_slopes = {};
  const AttentionProblem whole = packed.problem(plain);
  const Inputs in = random_inputs(whole, 1);
  auto drop_batch = [](const Tensor& t) {
    TensorView v = t.view();
    v.rank = 3;
    v.shape = {t.shape()[1], t.shape()[2], t.shape()[3], 0};
    v.strides = {t.view().strides[1], t.view().strides[2], 1, 0};
    return v;
  };
  const VarlenSeqlens seqlens{cu.q.view(), cu.k.view(), cu.max_q, cu.max_k};
  ForwardResult fwd;
  const double fwd_s = median_seconds(
      [&] { fwd = forward_varlen(drop_batch(in.q), drop_batch(in.k), drop_batch(in.v), seqlens, options); },
      f.repeats, 1, "flashattn varlen");
  double bwd_s = 0.0;
  if (f.backward)
    bwd_s = median_seconds(
        [&] {
          backward_varlen(drop_batch(in.dout), drop_batch(in.q), drop_batch(in.k), drop_batch(in.v),
                          fwd.out.view(), fwd.lse.view(), seqlens, options);
        },
        f.repeats, 1, "flashattn varlen backward");
  // Max error on sampled rows: each sequence as its own problem, through the reference.
  double error = 0.0;
  std::vector<double> row(static_cast<std::size_t>(whole.head_dim_v));
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t q0 = cu.at_q[b], k0 = cu.at_k[b];
    const std::int64_t sq = cu.at_q[b + 1] - q0, sk = cu.at_k[b + 1] - k0;
    if (sq == 0) continue;
    auto slice = [](const Tensor& t, std::int64_t begin, std::int64_t len) {
      TensorView v = t.view();
      v.data = static_cast<const unsigned char*>(v.data) + begin * v.strides[1] * static_cast<std::int64_t>(dtype_size(v.dtype));
      v.shape[1] = len;
      return v;
    };
    AttentionOptions ob = options;
    if (ob.alibi_slopes.rank == 2) {  // sequence b's row of (batch, heads) slopes
      ob.alibi_slopes.data = static_cast<const float*>(ob.alibi_slopes.data) + b * ob.alibi_slopes.strides[0];
      ob.alibi_slopes.rank = 1;
      ob.alibi_slopes.shape = {ob.alibi_slopes.shape[1], 0, 0, 0};
      ob.alibi_slopes.strides = {ob.alibi_slopes.strides[1], 0, 0, 0};
    }
    const TensorView qb = slice(in.q, q0, sq), kb = slice(in.k, k0, sk), vb = slice(in.v, k0, sk);
    const AttentionProblem pb = AttentionProblem::from_inputs(qb, kb, vb, ob);
    for (std::int64_t i : {std::int64_t{0}, sq / 2, sq - 1})
      for (std::int64_t h = 0; h < pb.heads_q; h += std::max<std::int64_t>(1, pb.heads_q - 1)) {
        double lse = 0.0;
        reference::attention_row(pb, ob, qb, kb, vb, 0, h, i, row.data(), &lse, b);  // dropout keyed by sequence
        for (std::int64_t c = 0; c < pb.head_dim_v; ++c)
          error = std::max(error, std::fabs(fwd.out.get(((q0 + i) * pb.heads_q + h) * pb.head_dim_v + c) -
                                            row[static_cast<std::size_t>(c)]));
      }
  }
  if (f.json) {
    VarlenRun r{batch, whole.seqlen_q, whole.seqlen_k, fwd_s, flops / fwd_s * 1e-9, error};
    if (f.backward) {
      r.bwd_seconds = bwd_s;
      r.bwd_gflops = 2.5 * flops / bwd_s * 1e-9;
    }
    std::cout << varlen_run_json(f.shape.threads, r) << "\n";
    return;
  }
  std::printf("flashattn run (varlen): %lld sequences, %lld queries, %lld keys in all; %s\n",
              static_cast<long long>(batch), static_cast<long long>(whole.seqlen_q),
              static_cast<long long>(whole.seqlen_k), whole.describe().c_str());
  std::printf("forward  %10.2f ms %10.1f GFLOP/s   max |err| vs float64 %.2e\n", fwd_s * 1e3,
              flops / fwd_s * 1e-9, error);
  if (f.backward)
    std::printf("backward %10.2f ms %10.1f GFLOP/s\n", bwd_s * 1e3, 2.5 * flops / bwd_s * 1e-9);
}

// "uses 3.3x less extra memory" (than standard attention), "more" where flashattn takes more,
// or what holds when either takes none (an empty problem: no ratio).
std::string memory_comparison(std::size_t flash, std::size_t standard) {
  char text[96];
  if (flash == 0 && standard == 0) return "neither takes extra memory";
  if (flash == 0) return "takes no extra memory (standard attention: " + human_bytes(static_cast<double>(standard)) + ")";
  if (standard == 0) return "takes " + human_bytes(static_cast<double>(flash)) + " of extra memory, standard attention none";
  const double ratio = static_cast<double>(standard) / static_cast<double>(flash);
  if (ratio >= 1.0)
    std::snprintf(text, sizeof text, "uses %.1fx less extra memory", ratio);
  else
    std::snprintf(text, sizeof text, "uses %.1fx more extra memory", 1.0 / ratio);
  return text;
}

// "2.00x faster" (or "slower") of two times; neither is a ratio when a clock read 0.
std::string speed_comparison(double flash_seconds, double standard_seconds) {
  if (!(flash_seconds > 0.0) || !(standard_seconds > 0.0)) return "too fast to time against standard attention";
  char text[64];
  const double ratio = standard_seconds / flash_seconds;
  if (ratio >= 1.0)
    std::snprintf(text, sizeof text, "%.2fx faster than standard attention", ratio);
  else
    std::snprintf(text, sizeof text, "%.2fx slower than standard attention", 1.0 / ratio);
  return text;
}

}  // namespace

void run(RunFlags& f) {
  if (f.decode) return run_decode(f);
  refuse_unused(f, "run without --decode", {"--cache-seqlen", "--page-size", "--cache-dtype"});
  AttentionOptions options = f.shape.options();
  f.variants.apply(options);
  if (!f.cu_seqlens_q.empty()) return run_varlen(f, options);
  const AttentionProblem p = f.shape.problem(options);
  const bool baseline = !f.variants.needs_flashattn_only();
  if (!f.json) std::cerr << "generating random inputs: " << p.describe() << "\n";
  const Inputs in = random_inputs(p, 1);
  std::vector<Measurement> results;
  results.push_back(measure_forward(Impl::flashattn, p, options, in, f.repeats));
  if (baseline) results.push_back(measure_forward(Impl::standard, p, options, in, f.repeats));
  std::vector<double> errors;  // forward only: max |out − float64| on sampled rows
  for (const Measurement& m : results) errors.push_back(sampled_max_error(p, options, in, m.out, f.samples));
  if (f.backward) {
    AttentionOptions det = options;
    det.deterministic = true;
    results.push_back(measure_backward(Impl::flashattn, p, options, in, f.repeats));
    results.push_back(measure_backward(Impl::flashattn, p, det, in, f.repeats));
    if (baseline) results.push_back(measure_backward(Impl::standard, p, options, in, f.repeats));
  }
  // Positions in `results`: forward flashattn[, standard], backward default, deterministic[, standard].
  const std::size_t bwd = baseline ? 2 : 1;

  if (f.json) {
    std::optional<double> speedup, backward_speedup;
    if (baseline) speedup = results[1].seconds / results[0].seconds;
    if (f.backward && baseline) backward_speedup = results[4].seconds / results[2].seconds;
    std::cout << run_json(f.shape.threads, p, results, errors, speedup, backward_speedup) << "\n";
    return;
  }
  std::printf("flashattn run: %s\n", p.describe().c_str());
  std::printf("cpu: %s, %d threads, simd %s, OpenBLAS %s\n\n", cpu_model().c_str(),
              resolved_threads(f.shape.threads), cpu_simd_target().c_str(),
              baseline::openblas_corename().c_str());
  std::printf("flashattn forward plan: %s\n\n", results[0].plan.c_str());
  std::printf("%-10s %-18s %12s %10s %14s %22s\n", "impl", "op", "time (ms)", "GFLOP/s",
              "extra memory", "max |err| vs float64");
  for (std::size_t i = 0; i < results.size(); ++i) {
    const Measurement& m = results[i];
    const char* op = m.op == Op::fwd ? "forward" : (m.deterministic ? "backward (determ.)" : "backward");
    char error[32] = "-";
    if (i < errors.size()) std::snprintf(error, sizeof error, "%.2e", errors[i]);
    std::printf("%-10s %-18s %12.2f %10.1f %14s %22s\n", impl_name(m.impl), op, m.seconds * 1e3,
                m.gflops, human_bytes(static_cast<double>(m.peak_bytes)).c_str(), error);
  }
  const auto compare = [&](const char* pass, const Measurement& flash, const Measurement& standard) {
    std::printf("%s: flashattn is %s and %s\n", pass, speed_comparison(flash.seconds, standard.seconds).c_str(),
                memory_comparison(flash.peak_bytes, standard.peak_bytes).c_str());
  };
  std::printf("\n");
  if (baseline) {
    compare("forward", results[0], results[1]);
  } else {
    std::printf("(standard attention implements causal and window only: not timed with these variants)\n");
  }
  if (f.backward && baseline) compare("backward", results[2], results[4]);
  if (f.backward)
    std::printf("deterministic backward costs %.2fx the default mode\n",
                results[bwd + 1].seconds / results[bwd].seconds);
  std::printf("(GFLOP/s counts the FLOPs of the visible (query, key) pairs only, 2*(D+Dv) per pair and query head, "
              "causal, window and block mask counted exactly; x2.5 for backward; forward error on %d sampled rows; "
              "gradients are checked by the tests)\n",
              f.samples);
}

}  // namespace flashattn::cli
