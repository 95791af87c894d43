// `flashattn run`: the main job. Random inputs of a realistic shape, flashattn against
// standard attention, a small table of time, GFLOP/s, memory and accuracy.
#include <cstdio>
#include <iostream>
#include <memory>
#include <vector>

#include "src/baseline/standard_attention.hpp"
#include "tools/cli/commands.hpp"
#include "tools/cli/common.hpp"

namespace flashattn::cli {
namespace {

struct RunFlags {
  ShapeFlags shape;
  VariantFlags variants;
  bool json = false;
  int repeats = 3;
  int samples = 64;
  bool backward = false;
};

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 3) bytes /= 1024.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", bytes, units[u]);
  return buf;
}

void run(RunFlags& f) {
  AttentionOptions options = f.shape.options();
  f.variants.apply(options);
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
    nlohmann::json j = machine_json(f.shape.threads);
    for (std::size_t i = 0; i < results.size(); ++i) {
      j["cases"].push_back(case_json(results[i], p));
      if (i < errors.size()) j["cases"].back()["max_error"] = errors[i];
    }
    if (baseline) j["speedup"] = results[1].seconds / results[0].seconds;
    if (f.backward && baseline) j["backward_speedup"] = results[4].seconds / results[2].seconds;
    std::cout << j.dump(2) << "\n";
    return;
  }
  std::printf("flashattn run: %s\n", p.describe().c_str());
  std::printf("cpu: %s, %d threads, simd %s, OpenBLAS %s\n\n", cpu_model().c_str(),
              resolved_threads(f.shape.threads), cpu_simd_target().c_str(),
              baseline::openblas_corename().c_str());
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

}  // namespace

void register_run(CLI::App& app) {
  auto flags = std::make_shared<RunFlags>();
  CLI::App* cmd = app.add_subcommand("run", "time flashattn against standard attention on random inputs");
  flags->shape.add_to(*cmd);
  flags->variants.add_to(*cmd);
  cmd->add_flag("--json", flags->json, "machine-readable output");
  cmd->add_option("--repeats", flags->repeats, "timed runs (median reported)")->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--samples", flags->samples, "rows checked against the float64 reference")
      ->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_flag("--backward", flags->backward,
                "also time backward (default and deterministic) against standard attention's");
  cmd->callback([flags] { run(*flags); });
}

}  // namespace flashattn::cli
