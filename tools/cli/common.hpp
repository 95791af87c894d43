// Pieces shared by the CLI subcommands: the shape flags (named the same way in every
// subcommand), random inputs, timing, sampled accuracy and machine facts.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace flashattn::cli {

struct ShapeFlags {
  std::int64_t batch = 1;
  std::int64_t seqlen = 4096;
  std::optional<std::int64_t> seqlen_q, seqlen_k;
  std::int64_t heads = 16;
  std::optional<std::int64_t> heads_kv;
  std::int64_t dim = 128;
  std::optional<std::int64_t> dim_v;
  std::string dtype = "bf16";
  bool causal = true;
  std::optional<float> softmax_scale;
  int threads = 0;
  int num_splits = 0;
  std::string kernel = "auto";  // AttentionOptions::kernel by name
  std::string backward_kernel = "auto";  // AttentionOptions::backward_kernel by name

  // A benchmark case's dtype: a --kernel tiled_bf16 request applies to its bf16 cases, the
  // others (f32) keep the planner's choice, so that one run times both.
  void set_case_dtype(const std::string& case_dtype) {
    dtype = case_dtype;
    if (kernel == "tiled_bf16" && dtype != "bf16") kernel = "auto";
    if (backward_kernel == "tiled_bf16" && dtype != "bf16") backward_kernel = "auto";
  }
  // Sizes, --threads, --kernel and --backward-kernel; with_mode adds --dtype, --causal and
  // --softmax-scale too.
  void add_to(CLI::App& app, bool with_mode = true);
  AttentionOptions options() const;
  // Validated problem of these sizes with `options` (by default this->options()).
  AttentionProblem problem(const std::optional<AttentionOptions>& options = std::nullopt) const;
};

// The attention variants, named as upstream's Python arguments; side inputs come from
// .npy files and stay alive here while options point at them.
struct VariantFlags {
  std::vector<std::int64_t> window_size;  // (left, right), −1 = unbounded
  float softcap = 0.0f;
  std::string alibi_slopes_path;  // float32 (heads_q) or (batch, heads_q)
  float dropout_p = 0.0f;
  std::uint64_t seed = 0;
  std::string block_mask_path;  // bool/uint8 (q blocks, k blocks)
  std::int64_t block_size = 0;
  Tensor alibi_slopes, block_mask;

  void add_to(CLI::App& app);
  // Loads the files and sets the variant fields of `options`.
  void apply(AttentionOptions& options);
  bool needs_flashattn_only() const;  // beyond what the standard baseline implements
};

struct Inputs {
  Tensor q, k, v;
  Tensor dout;  // (batch, seqlen_q, heads_q, head_dim_v), for backward
};
Inputs random_inputs(const AttentionProblem& problem, std::uint64_t seed);

// Median wall time of `repeats` calls after `warmup` calls; reports progress on stderr
// under `label` when the whole measurement is expected to take more than a few seconds.
double median_seconds(const std::function<void()>& fn, int repeats, int warmup,
                      const std::string& label);

// Max |out − reference| over `samples` rows spread over batch, heads and sequence.
double sampled_max_error(const AttentionProblem& problem, const AttentionOptions& options,
                         const Inputs& in, const Tensor& out, int samples);

std::string cpu_model();
int resolved_threads(int requested);
// "1.5 MiB": bytes with a binary unit.
std::string human_bytes(double bytes);
// Nominal clock of this CPU in GHz (/proc/cpuinfo, else cpufreq); throws Error when unknown.
double cpu_clock_ghz();

}  // namespace flashattn::cli

namespace flashattn::cli {

enum class Impl { flashattn, standard };
const char* impl_name(Impl impl);
enum class Op { fwd, bwd };

struct Measurement {
  Impl impl;
  Op op = Op::fwd;
  bool deterministic = false;  // bwd only
  double seconds = 0.0;      // median
  double gflops = 0.0;       // conventional FLOPs: 4·B·Hq·Sq·Sk·D (halved when causal),
                             // 2.5× that for backward (upstream's convention); a window
                             // counts as its causal or full square, so it shows as speed
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

}  // namespace flashattn::cli

#include <nlohmann/json.hpp>

namespace flashattn::cli {

// One benchmark case in the JSON schema shared by `run --json` and `bench --json`.
nlohmann::json case_json(const Measurement& m, const AttentionProblem& p);
// Top-level facts of the machine and build: cpu, threads, simd_target, openblas_corename.
nlohmann::json machine_json(int threads);

}  // namespace flashattn::cli

namespace flashattn::cli {

// One decoding step over a KV cache of `cached` tokens: q is one token per sequence, one new
// token is appended (contiguous cache when page_size is 0, else paged). The cache has q's
// dtype, or FP8 e4m3 codes with one descale per (page or cache row, kv head). `kernel`: the
// request (--kernel), as AttentionOptions::kernel.
struct DecodeCase {
  std::int64_t batch = 1, heads = 32, heads_kv = 8, dim = 128, cached = 32768, page_size = 0;
  DType dtype = DType::bf16;
  bool fp8_cache = false;
  int threads = 0;
  ForwardKernel kernel = ForwardKernel::automatic;
};
struct DecodeMeasurement {
  double seconds = 0.0;
  double gbps = 0.0;       // K and V bytes read (the whole cache once) per second
  double max_error = 0.0;  // against float64 on the logical cache, sampled heads
  std::size_t cache_bytes = 0;
  std::string kernel;  // the plan's
};
DecodeMeasurement measure_decode(const DecodeCase& c, int repeats);
nlohmann::json decode_json(const DecodeCase& c, const DecodeMeasurement& m);

// Memory bandwidth of a large copy (bytes read + written per second), best of `repeats`.
double copy_gbps(int repeats);

}  // namespace flashattn::cli
