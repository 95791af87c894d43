// flashattn — exact attention the FlashAttention way, from the command line.
#include <CLI/CLI.hpp>

#include <iostream>

#include "flashattn/error.hpp"
#include "tools/cli/commands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"flashattn: exact tiled attention with an online softmax (FlashAttention) on the CPU"};
  app.require_subcommand(1);
  flashattn::cli::register_run(app);
  flashattn::cli::register_attend(app);
  flashattn::cli::register_bench(app);
  flashattn::cli::register_numerics(app);
  flashattn::cli::register_explain(app);
  flashattn::cli::register_tour(app);
#ifdef FLASHATTN_CLI_RING
  flashattn::cli::register_ring(app);
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const flashattn::Error& e) {
    std::cerr << "flashattn: error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
