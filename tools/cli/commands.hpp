// The subcommands of the flashattn CLI; each registers itself on the top-level app.
#pragma once

#include <CLI/CLI.hpp>

namespace flashattn::cli {

void register_run(CLI::App& app);     // the main job: flashattn vs standard attention
void register_attend(CLI::App& app);  // file mode on .npy inputs
void register_bench(CLI::App& app);   // the benchmark suite, JSON for machines
void register_numerics(CLI::App& app);  // the numerics experiments (docs/algorithm.md §2, §4, §5)
void register_explain(CLI::App& app); // the cost account of a problem (docs/cost_model.md)
void register_tour(CLI::App& app);    // the four generations measured beside the model
void register_ring(CLI::App& app);    // ring attention over MPI (built when MPI is found)

}  // namespace flashattn::cli
