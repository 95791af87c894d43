// `flashattn run`: the main job. Random inputs of a realistic shape, flashattn against
// standard attention, a small table of time, GFLOP/s, memory and accuracy.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <optional>
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

// One decoding step over a KV cache: time, bandwidth, accuracy.
void run_decode(const RunFlags& f) {
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
  std::printf("one token: %.3f ms, %.2f GB/s of K and V (%.1f MiB), max |err| vs float64 %.2e, kernel %s\n",
              m.seconds * 1e3, m.gbps, static_cast<double>(m.cache_bytes) / (1 << 20), m.max_error, m.kernel.c_str());
}

// A packed variable-length batch of random inputs with the offsets of two .npy files:
// flashattn only (the textbook baseline has no packed form), its time, GFLOP/s and the
// max error against float64 on sampled rows of every sequence.
void run_varlen(const RunFlags& f, const AttentionOptions& options) {
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

}  // namespace

void run(RunFlags& f) {
  if (f.decode) return run_decode(f);
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
  if (baseline) {
    std::printf("\nforward: flashattn is %.2fx faster and uses %.1fx less extra memory than standard attention\n",
                results[1].seconds / results[0].seconds,
                static_cast<double>(results[1].peak_bytes) / static_cast<double>(results[0].peak_bytes));
  } else {
    std::printf("\n(standard attention implements causal and window only: not timed with these variants)\n");
  }
  if (f.backward && baseline)
    std::printf("backward: flashattn is %.2fx faster and uses %.1fx less extra memory than standard attention\n",
                results[4].seconds / results[2].seconds,
                static_cast<double>(results[4].peak_bytes) / static_cast<double>(results[2].peak_bytes));
  if (f.backward)
    std::printf("deterministic backward costs %.2fx the default mode\n",
                results[bwd + 1].seconds / results[bwd].seconds);
  std::printf("(GFLOP/s counts 4*B*Hq*Sq*Sk*D, halved when causal, x2.5 for backward; "
              "forward error on %d sampled rows; gradients are checked by the tests)\n",
              f.samples);
}

}  // namespace flashattn::cli
