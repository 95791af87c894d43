// Measurement: random inputs, the median of timed runs, sampled accuracy against the
// float64 reference, and flashattn's and standard attention's forward and backward timed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "flashattn/flashattn.hpp"

namespace flashattn::cli {

struct Inputs {
  Tensor q, k, v;
  Tensor dout;  // (batch, seqlen_q, heads_q, head_dim_v), for backward
};
Inputs random_inputs(const AttentionProblem& problem, std::uint64_t seed);

// Median wall time of `repeats` calls after `warmup` calls; reports progress on stderr
// under `label` when the whole measurement is expected to take more than a few seconds.
// An Error for repeats < 1: no run to take the median of.
double median_seconds(const std::function<void()>& fn, int repeats, int warmup,
                      const std::string& label);

// Idle worker threads busy-wait before they sleep — OpenBLAS's for about 2^28 cycles
// (~0.1 s), OpenMP's for a spin count — and on a 2-core machine they would steal a core
// from whichever implementation is timed next. Every measurement ends with this pause.
void let_worker_threads_sleep();

// Max |out − reference| over `samples` rows spread over batch, heads and sequence.
double sampled_max_error(const AttentionProblem& problem, const AttentionOptions& options,
                         const Inputs& in, const Tensor& out, int samples);

// "1.5 MiB": bytes with a binary unit.
std::string human_bytes(double bytes);

// `value` printed with a printf `format` of one double ("%.2fx"), or "n/a" when it is not a
// number (the 0/0 of a ratio over an empty problem) or infinite.
std::string number_or_na(const char* format, double value);

enum class Impl { flashattn, standard };
const char* impl_name(Impl impl);
enum class Op { fwd, bwd };

struct Measurement {
  Impl impl;
  Op op = Op::fwd;
  bool deterministic = false;  // bwd only
  double seconds = 0.0;      // median
  double gflops = 0.0;       // visible pairs' FLOPs only (AttentionProblem::visible_forward_flops,
                             // causal, window and block mask counted exactly), 2.5× that
                             // for backward (upstream's ratio), so it never exceeds the peak
  double dense_equivalent_gflops = 0.0;  // upstream's headline: 4·B·Hq·Sq·Sk·D, halved when
                                         // causal, whatever the window or block mask hides
  std::size_t peak_bytes = 0;  // extra memory the implementation allocated
  std::string kernel, plan;    // flashattn: the plan's kernel and (fwd) its description
  Tensor out;                // fwd: output of the last run
};

// Times forward of `impl` on `in` (median of `repeats` after one warm-up).
Measurement measure_forward(Impl impl, const AttentionProblem& problem,
                            const AttentionOptions& options, const Inputs& in, int repeats);
// Times backward of `impl` on `in` (options.deterministic selects flashattn's mode).
Measurement measure_backward(Impl impl, const AttentionProblem& problem,
                             const AttentionOptions& options, const Inputs& in, int repeats);

// Memory bandwidth of a large copy (bytes read + written per second), best of `repeats`.
double copy_gbps(int repeats);
// Memory read bandwidth on `threads` threads (0: OpenMP's default), each summing its share of a
// buffer far beyond the caches (bytes read per second), best of `repeats`: the bound of a call
// that only reads, as a decode step reads K and V, on the threads it runs on (one memcpy
// thread's copy_gbps is not: a two-thread decode can read faster than that).
double read_gbps(int repeats, int threads);

}  // namespace flashattn::cli
