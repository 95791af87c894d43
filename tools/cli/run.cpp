// `flashattn run`: the main job. Random inputs of a realistic shape, flashattn against
// standard attention, a small table of time, GFLOP/s, memory and accuracy.
#include <cstdio>
#include <iostream>
#include <memory>

#include "src/baseline/standard_attention.hpp"
#include "tools/cli/commands.hpp"
#include "tools/cli/common.hpp"

namespace flashattn::cli {
namespace {

struct RunFlags {
  ShapeFlags shape;
  bool json = false;
  int repeats = 3;
  int samples = 64;
};

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 3) bytes /= 1024.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", bytes, units[u]);
  return buf;
}

void run(const RunFlags& f) {
  const AttentionProblem p = f.shape.problem();
  const AttentionOptions options = f.shape.options();
  if (!f.json) std::cerr << "generating random inputs: " << p.describe() << "\n";
  const Inputs in = random_inputs(p, 1);
  Measurement results[] = {measure_forward(Impl::flashattn, p, options, in, f.repeats),
                           measure_forward(Impl::standard, p, options, in, f.repeats)};
  double errors[2];
  for (int i = 0; i < 2; ++i) errors[i] = sampled_max_error(p, in, results[i].out, f.samples);

  if (f.json) {
    nlohmann::json j = machine_json(f.shape.threads);
    for (int i = 0; i < 2; ++i) {
      j["cases"].push_back(case_json(results[i], p));
      j["cases"].back()["max_error"] = errors[i];
    }
    j["speedup"] = results[1].seconds / results[0].seconds;
    std::cout << j.dump(2) << "\n";
    return;
  }
  std::printf("flashattn run: %s\n", p.describe().c_str());
  std::printf("cpu: %s, %d threads, simd %s, OpenBLAS %s\n\n", cpu_model().c_str(),
              resolved_threads(f.shape.threads), cpu_simd_target().c_str(),
              baseline::openblas_corename().c_str());
  std::printf("%-10s %12s %10s %14s %22s\n", "impl", "time (ms)", "GFLOP/s", "extra memory",
              "max |err| vs float64");
  for (int i = 0; i < 2; ++i)
    std::printf("%-10s %12.2f %10.1f %14s %22.2e\n", impl_name(results[i].impl),
                results[i].seconds * 1e3, results[i].gflops,
                human_bytes(static_cast<double>(results[i].peak_bytes)).c_str(), errors[i]);
  std::printf("\nflashattn is %.2fx faster and uses %.1fx less extra memory than standard attention\n",
              results[1].seconds / results[0].seconds,
              static_cast<double>(results[1].peak_bytes) / static_cast<double>(results[0].peak_bytes));
  std::printf("(GFLOP/s counts 4*B*Hq*Sq*Sk*D, halved when causal; error on %d sampled rows)\n",
              f.samples);
}

}  // namespace

void register_run(CLI::App& app) {
  auto flags = std::make_shared<RunFlags>();
  CLI::App* cmd = app.add_subcommand("run", "time flashattn against standard attention on random inputs");
  flags->shape.add_to(*cmd);
  cmd->add_flag("--json", flags->json, "machine-readable output");
  cmd->add_option("--repeats", flags->repeats, "timed runs (median reported)")->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--samples", flags->samples, "rows checked against the float64 reference")
      ->capture_default_str()->check(CLI::PositiveNumber);
  cmd->callback([flags] { run(*flags); });
}

}  // namespace flashattn::cli
