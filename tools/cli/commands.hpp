// The subcommands of the flashattn CLI: each one's options as a plain struct, which main.cpp
// (the one file that sees the command-line parser) declares and fills, and the function
// that runs it.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tools/cli/flags.hpp"

namespace flashattn::cli {

// `run`, the main job: flashattn vs standard attention.
struct RunFlags {
  ShapeFlags shape;
  VariantFlags variants;
  bool json = false;
  int repeats = 3;
  int samples = 64;
  bool backward = false;
  std::string cu_seqlens_q, cu_seqlens_k;  // a packed variable-length batch: both or neither
  bool decode = false;
  std::int64_t cached = 32768;
  std::int64_t page_size = 0;
  std::string cache_dtype;  // --decode: empty = q's dtype, or e4m3
  std::set<std::string> given;  // the options named on the command line ("--heads")
};
void run(RunFlags& f);

// `attend`, file mode on .npy inputs.
struct AttendFlags {
  std::string q, k, v, out, lse;
  std::string dout, dq, dk, dv;  // gradients: all four or none
  bool deterministic = false;
  std::optional<std::string> dtype;
  bool causal = false;
  std::optional<float> softmax_scale;
  int threads = 0;
  VariantFlags variants;
  std::string cu_seqlens_q, cu_seqlens_k;  // variable-length packed batch: both or neither
};
void attend(AttendFlags& f);

// `bench --sweep` and `--quick`: the grid of shapes (tools/cli/bench_sweep.hpp).
struct SweepFlags {
  ShapeFlags shape;  // batch and heads (and the base S, D and threads of --quick)
  int repeats = 5;
  int sgemm_n = 2048;
  std::vector<std::string> ops{"fwd", "bwd"};
  // The full grid of the issue; the flags of `--sweep` restrict it.
  std::vector<std::int64_t> seqlens{512, 1024, 2048, 4096, 8192, 16384};
  std::vector<std::int64_t> dims{64, 128, 256};
  std::vector<std::string> dtypes{"f32", "bf16"};
  std::vector<std::string> causal{"no", "yes"};
};

// `bench`, the benchmark suite, JSON for machines.
struct BenchFlags {
  ShapeFlags shape;
  bool json = false;
  int repeats = 5;
  int sgemm_n = 2048;
  std::vector<std::string> ops{"fwd", "bwd", "decode"};
  bool sweep = false, quick = false;
  SweepFlags grid;  // --seqlens, --dims, --dtypes, --causal of --sweep
  std::string plot;
  std::set<std::string> given;  // the options named on the command line ("--ops")
};
void bench(const BenchFlags& f);

// `numerics`, the numerics experiments (docs/algorithm.md §2, §4, §5).
struct NumericsFlags {
  ShapeFlags shape;
  std::uint64_t seed = 2024;
  int repeats = 5;
  std::string fp8_format = "e4m3";
  bool json = false;
};
void numerics(const NumericsFlags& f);

// `explain`, the cost account of a problem (docs/cost_model.md).
struct ExplainFlags {
  ShapeFlags shape;
  std::vector<std::int64_t> window_size;
  std::string arch = "h100";
  std::optional<double> sram_elements;
  std::vector<std::int64_t> tile;  // BR BC
  std::string standard = "minimal";  // cost::StandardModel by name
  float dropout_p = 0.0f;
  std::string preset;  // "" or a name of explain.cpp's presets
  bool measure = false;
  bool json = false;
  int repeats = 3;
  std::set<std::string> given;  // the options named on the command line ("--batch")
};
void explain(ExplainFlags f);

// `tour`, the four generations measured beside the model.
struct TourFlags {
  std::int64_t max_seqlen = 2048;  // chapters 1-3 sweep N = 256, 512, ... up to this
  std::int64_t dim = 64;
  std::int64_t heads = 2;
  int threads = 0;
  int repeats = 2;
  std::string out;  // directory for the SVG figures; empty: none
};
void tour(const TourFlags& f);

// `ring`, ring attention over MPI (built when MPI is found).
struct RingFlags {
  ShapeFlags shape;
  std::string layout = "zigzag";
  bool backward = false;
  int repeats = 3;
  float softcap = 0.0f;
  double timeout = 300.0;
  // Rank 0 recomputes the whole sequence in one process to check the ring up to this length;
  // beyond it, that check would cost more than the ring itself.
  std::int64_t verify_up_to = 8192;
};
void ring(RingFlags& f);

}  // namespace flashattn::cli
