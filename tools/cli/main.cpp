// flashattn — exact attention the FlashAttention way, from the command line.
//
// The only file that includes the command-line parser (CLI11, a header-only library compiled
// once here): every subcommand and its options are declared below and fill the plain structs
// of tools/cli/commands.hpp, which the subcommands' own files run.
#include <CLI/CLI.hpp>

#include <cerrno>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <new>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>

#include "flashattn/error.hpp"
#include "tools/cli/commands.hpp"

namespace flashattn::cli {

// An unsigned 64-bit option as written: digits only, at most 2^64 - 1 (CLI11 reads -1 and
// 2^64 as 2^64 - 1).
const CLI::Validator kUint64{[](const std::string& text) -> std::string {
                               const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
                               errno = 0;
                               if (!digits || (std::strtoull(text.c_str(), nullptr, 10), errno == ERANGE))
                                 return "expected an integer from 0 to 2^64 - 1, got " + text;
                               return std::string();
                             },
                             "UINT64"};

// A count such as --repeats: digits only, at least 1 (CLI11's PositiveNumber says "Value 0 not in
// range 0.000000 to 1797..." with all 309 digits of the largest double). Values past the
// option's type are CLI11's conversion error.
const CLI::Validator kPositiveInt{[](const std::string& text) -> std::string {
                                    const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
                                    if (!digits || text.find_first_not_of('0') == std::string::npos)
                                      return "must be a positive integer, got " + text;
                                    return std::string();
                                  },
                                  "POSITIVE"};

// The longest KV cache `run --decode` builds, and its largest page: cache positions are int32
// and pass through float on their way into the cache's tensors (exact up to 2^24), and
// cache_seqlen + 1 + page_size stays far from overflowing the int64 page arithmetic.
constexpr std::int64_t kMaxCacheTokens = (std::int64_t{1} << 24) - 1;
namespace {

// The long names of the options given on the command line, "--" included (both names of a
// "--causal,!--no-causal" pair when either is).
std::set<std::string> given_options(const CLI::App& cmd) {
  std::set<std::string> given;
  for (const CLI::Option* option : cmd.get_options())
    if (option->count() > 0)
      for (const std::string& name : option->get_lnames()) given.insert("--" + name);
  return given;
}

// --kernel, --backward-kernel and --pack-gqa.
void add_kernels(CLI::App& app, ShapeFlags& s) {
  app.add_option("--kernel", s.kernel,
                 "CPU forward kernel: auto, tiled, tiled_bf16 (bf16 on AVX512-BF16; bench: its bf16 cases), decode "
                 "(bench: its decode cases), decode_fp16 (FP8 or int8 cache on AVX512-FP16; bench: its e4m3, u8 and "
                 "s8 decode cases) or decode_bf16 (the same on AVX512-BF16)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "tiled", "tiled_bf16", "decode", "decode_fp16", "decode_bf16"}));
  app.add_option("--backward-kernel", s.backward_kernel, "CPU backward kernel: auto, tiled or tiled_bf16 (bf16 on AVX512-BF16)")
      ->capture_default_str()->check(CLI::IsMember({"auto", "tiled", "tiled_bf16"}));
  app.add_option("--pack-gqa", s.pack_gqa,
                 "tiled forward: stack the q heads of a kv head in one Q tile (FlashAttention-3's pack_gqa): auto "
                 "(the planner's choice), on or off")
      ->capture_default_str()->check(CLI::IsMember({"auto", "on", "off"}));
}

// Sizes, --threads and (with_kernels) --kernel, --backward-kernel and --pack-gqa; with_mode adds
// --dtype, --causal, --softmax-scale and --num-splits too.
void add_shape(CLI::App& app, ShapeFlags& s, bool with_mode = true, bool with_kernels = true) {
  app.add_option("--batch", s.batch, "batch size")->capture_default_str();
  app.add_option("--seqlen", s.seqlen, "sequence length of queries and keys")->capture_default_str();
  app.add_option("--seqlen-q", s.seqlen_q, "query sequence length (overrides --seqlen)");
  app.add_option("--seqlen-k", s.seqlen_k, "key/value sequence length (overrides --seqlen)");
  app.add_option("--heads", s.heads, "query heads")->capture_default_str();
  app.add_option("--heads-kv", s.heads_kv, "key/value heads (GQA/MQA; default: --heads)");
  app.add_option("--dim", s.dim, "head dimension of q and k")->capture_default_str();
  app.add_option("--dim-v", s.dim_v, "head dimension of v (default: --dim)");
  app.add_option("--threads", s.threads, "worker threads (0 = all cores)")
      ->check(CLI::Range(0, kMaxThreads))->capture_default_str();
  if (with_kernels) add_kernels(app, s);
  if (!with_mode) return;
  app.add_option("--dtype", s.dtype, "f32, bf16 or f16")->capture_default_str();
  app.add_flag("--causal,!--no-causal", s.causal, "bottom-right aligned causal mask")
      ->capture_default_str();
  app.add_option("--softmax-scale", s.softmax_scale, "scale of Q·Kᵀ (default 1/sqrt(dim))");
  app.add_option("--num-splits", s.num_splits, "split-KV parts per Q tile (0 = automatic, 1 = none)")
      ->capture_default_str();
}

void add_variants(CLI::App& app, VariantFlags& v) {
  app.add_option("--window-size", v.window_size, "sliding window LEFT RIGHT (-1 = unbounded)")
      ->expected(2);
  app.add_option("--softcap", v.softcap, "soft-capping: scores become softcap*tanh(s/softcap)");
  app.add_option("--alibi-slopes", v.alibi_slopes_path, "ALiBi slopes .npy, float32 (heads) or (batch, heads)")
      ->check(CLI::ExistingFile);
  app.add_option("--dropout-p", v.dropout_p, "dropout probability on the attention weights");
  app.add_option("--seed", v.seed, "dropout seed")->check(kUint64);
  CLI::Option* mask = app.add_option("--block-mask", v.block_mask_path,
                                     "block-sparse mask .npy, bool/uint8 (q blocks, k blocks)")
                          ->check(CLI::ExistingFile);
  CLI::Option* size = app.add_option("--block-size", v.block_size, "tokens per block of --block-mask");
  mask->needs(size);
  size->needs(mask);
  app.add_option("--attn-mask", v.attn_mask_path,
                 "dense mask .npy: bool/uint8 (true keeps) or float bias, rank 4, broadcastable to (batch, heads, "
                 "seqlen_q, seqlen_k)")
      ->check(CLI::ExistingFile);
}

void add_run(CLI::App& app) {
  auto flags = std::make_shared<RunFlags>();
  CLI::App* cmd = app.add_subcommand("run", "time flashattn against standard attention on random inputs");
  add_shape(*cmd, flags->shape);
  add_variants(*cmd, flags->variants);
  cmd->add_flag("--json", flags->json, "machine-readable output");
  cmd->add_option("--repeats", flags->repeats, "timed runs (median reported)")->capture_default_str()
      ->check(kPositiveInt);
  cmd->add_option("--samples", flags->samples, "rows checked against the float64 reference")
      ->capture_default_str()->check(kPositiveInt);
  CLI::Option* cq = cmd->add_option("--cu-seqlens-q", flags->cu_seqlens_q,
                                    "int32 offsets .npy (batch + 1): a packed variable-length batch")
                        ->check(CLI::ExistingFile);
  CLI::Option* ck = cmd->add_option("--cu-seqlens-k", flags->cu_seqlens_k, "int32 key offsets .npy (batch + 1)")
                        ->check(CLI::ExistingFile);
  cq->needs(ck);
  ck->needs(cq);
  cmd->add_flag("--backward", flags->backward,
                "also time backward (default and deterministic) against standard attention's");
  cmd->add_flag("--decode", flags->decode,
                "one decoding step over a KV cache (defaults: 32 q heads, 8 kv heads, 32768 cached tokens)");
  cmd->add_option("--cache-seqlen", flags->cached, "tokens already in the cache (--decode)")
      ->capture_default_str()->check(CLI::Range(std::int64_t{0}, kMaxCacheTokens));
  cmd->add_option("--page-size", flags->page_size,
                  "paged cache with pages of this many tokens (--decode; 0 = contiguous)")
      ->capture_default_str()->check(CLI::Range(std::int64_t{0}, kMaxCacheTokens));
  cmd->add_option("--cache-dtype", flags->cache_dtype,
                  "cache storage (--decode): e4m3 (FP8, one descale per page and kv head), u8 or s8 (int8, one "
                  "scale, and for u8 one zero point, per token and kv head); default: the --dtype")
      ->check(CLI::IsMember({"e4m3", "u8", "s8"}));
  cmd->callback([flags, cmd] {
    flags->given = given_options(*cmd);
    run(*flags);
  });
}

void add_attend(CLI::App& app) {
  auto flags = std::make_shared<AttendFlags>();
  CLI::App* cmd = app.add_subcommand(
      "attend", "attention on .npy inputs (float32/float16, layout (batch, seqlen, heads, dim))");
  cmd->add_option("--q", flags->q, "queries (B, Sq, Hq, D)")->required()->check(CLI::ExistingFile);
  cmd->add_option("--k", flags->k, "keys (B, Sk, Hkv, D)")->required()->check(CLI::ExistingFile);
  cmd->add_option("--v", flags->v, "values (B, Sk, Hkv, Dv)")->required()->check(CLI::ExistingFile);
  cmd->add_option("--out", flags->out, "output .npy (B, Sq, Hq, Dv); float32 when --dtype bf16")
      ->required();
  cmd->add_option("--lse", flags->lse, "log-sum-exp .npy (B, Hq, Sq), float32");
  cmd->add_option("--dtype", flags->dtype, "compute dtype f32|f16|bf16 (default: q's dtype)");
  cmd->add_flag("--causal", flags->causal, "bottom-right aligned causal mask");
  cmd->add_option("--softmax-scale", flags->softmax_scale, "scale of Q·Kᵀ (default 1/sqrt(D))");
  cmd->add_option("--threads", flags->threads, "worker threads (0 = all cores)")
      ->check(CLI::Range(0, kMaxThreads));
  CLI::Option* dout = cmd->add_option("--dout", flags->dout, "upstream gradient (B, Sq, Hq, Dv): computes dq, dk, dv")
                          ->check(CLI::ExistingFile);
  for (auto [name, target, help] : {std::tuple{"--dq", &flags->dq, "gradient of q (.npy)"},
                                     {"--dk", &flags->dk, "gradient of k (.npy)"},
                                     {"--dv", &flags->dv, "gradient of v (.npy)"}}) {
    CLI::Option* opt = cmd->add_option(name, *target, help);
    opt->needs(dout);
    dout->needs(opt);
  }
  cmd->add_flag("--deterministic", flags->deterministic,
                "bit-identical gradients for any run and thread count");
  add_variants(*cmd, flags->variants);
  CLI::Option* cq = cmd->add_option("--cu-seqlens-q", flags->cu_seqlens_q,
                                    "int32 offsets (batch + 1): q is packed (total_q, heads, dim)")
                        ->check(CLI::ExistingFile);
  CLI::Option* ck = cmd->add_option("--cu-seqlens-k", flags->cu_seqlens_k,
                                    "int32 offsets (batch + 1): k, v are packed (total_k, heads, dim)")
                        ->check(CLI::ExistingFile);
  cq->needs(ck);
  ck->needs(cq);
  cmd->callback([flags] { attend(*flags); });
}

void add_bench(CLI::App& app) {
  auto flags = std::make_shared<BenchFlags>();
  CLI::App* cmd = app.add_subcommand(
      "bench", "forward/backward benchmark: f32/bf16 x causal/full, flashattn and standard, vs OpenBLAS sgemm");
  add_shape(*cmd, flags->shape, /*with_mode=*/false);
  cmd->add_flag("--json", flags->json, "machine-readable output");
  cmd->add_option("--repeats", flags->repeats, "timed runs per case, median reported (>= 5)")
      ->capture_default_str()->check(CLI::Range(5, 1000));
  cmd->add_option("--sgemm-size", flags->sgemm_n, "n of the n^3 sgemm baseline")
      ->capture_default_str()->check(kPositiveInt);
  cmd->add_option("--ops", flags->ops, "which passes to time: fwd, bwd, decode, serve (issue 23's serving batch), serve_smoke "
                  "(a small one), masks (issue 24's document mask as mask_mod, varlen and a dense bool mask, and a "
                  "score_mod), masks_smoke (a small one) (--sweep: fwd, bwd; --quick: its fixed subset, not --ops)")
      ->capture_default_str()
      ->check(CLI::IsMember({"fwd", "bwd", "decode", "serve", "serve_smoke", "masks", "masks_smoke"}))
      ->delimiter(',');
  CLI::Option* sweep_flag = cmd->add_flag(
      "--sweep", flags->sweep,
      "flashattn over the grid of --seqlens x --dims x --dtypes x --causal, fwd and bwd, vs sgemm");
  cmd->add_flag("--quick", flags->quick,
                "issue 7's subset (2 threads, S=4096, D=128 unless set; D=64/256, 1 thread, 4*S) and its targets")
      ->excludes(sweep_flag);
  SweepFlags& g = flags->grid;
  cmd->add_option("--seqlens", g.seqlens, "--sweep: sequence lengths")
      ->capture_default_str()->delimiter(',')->check(kPositiveInt)->needs(sweep_flag);
  cmd->add_option("--dims", g.dims, "--sweep: head dimensions")
      ->capture_default_str()->delimiter(',')->check(kPositiveInt)->needs(sweep_flag);
  cmd->add_option("--dtypes", g.dtypes, "--sweep: f32, bf16")
      ->capture_default_str()->delimiter(',')->check(CLI::IsMember({"f32", "bf16"}))->needs(sweep_flag);
  cmd->add_option("--causal", g.causal, "--sweep: no, yes")
      ->capture_default_str()->delimiter(',')->check(CLI::IsMember({"no", "yes"}))->needs(sweep_flag);
  cmd->add_option("--plot", flags->plot, "--sweep or --quick: write GFLOP/s against S as SVG to this file");
  cmd->callback([flags, cmd] {
    flags->given = given_options(*cmd);
    bench(*flags);
  });
}

void add_numerics(CLI::App& app) {
  auto flags = std::make_shared<NumericsFlags>();
  flags->shape.seqlen = 2048;
  flags->shape.heads = 8;
  CLI::App* cmd = app.add_subcommand(
      "numerics", "the numerics experiments: online softmax, exp2 accuracy, rescale counts, FP8 error, speed");
  // The experiments choose their own kernels (exp2 variants, counters, FP8): no --kernel here.
  add_shape(*cmd, flags->shape, /*with_mode=*/false, /*with_kernels=*/false);
  cmd->add_option("--dtype", flags->shape.dtype, "dtype of the speed experiment: f32, bf16 or f16")
      ->capture_default_str();
  cmd->add_option("--seed", flags->seed, "seed of every random input")->capture_default_str()->check(kUint64);
  cmd->add_option("--repeats", flags->repeats, "timed rounds of the speed experiment (median)")
      ->capture_default_str()->check(CLI::Range(1, 1000));
  cmd->add_option("--fp8-format", flags->fp8_format, "FP8 format of the error experiment: e4m3 or e5m2")
      ->capture_default_str()->check(CLI::IsMember({"e4m3", "e5m2"}));
  cmd->add_flag("--json", flags->json, "machine-readable output");
  cmd->callback([flags] { numerics(*flags); });
}

void add_explain(CLI::App& app) {
  auto flags = std::make_shared<ExplainFlags>();
  flags->shape.causal = false;  // upstream's default (flash_attn_func: causal=False)
  CLI::App* cmd = app.add_subcommand("explain", "what a problem costs and why: traffic, FLOPs, per-unit cycles");
  add_shape(*cmd, flags->shape);
  cmd->add_option("--window-size", flags->window_size, "sliding window LEFT RIGHT (-1 = unbounded)")->expected(2);
  cmd->add_option("--arch", flags->arch, "a100, a100-40gb, a100-80gb, h100, h200, b200, b300 or cpu (measured here)")
      ->capture_default_str();
  cmd->add_option("--sram-elements", flags->sram_elements,
                  "fast-memory size M of the Θ-form (default: shared memory per SM, or L2 per core)");
  cmd->add_option("--tile", flags->tile, "tile BR BC of the model (GPU; with --measure, BR also sets the CPU's Q tile)")
      ->expected(2);
  cmd->add_option("--dropout-p", flags->dropout_p,
                  "dropout probability on the attention weights (eager: its kernels and keep mask; tiled: "
                  "regenerated from the seed, no traffic)");
  cmd->add_option("--preset", flags->preset,
                  "gpt2-medium: the first FlashAttention paper's GPT-2 medium attention on an A100 (batch 64, seqlen "
                  "1024, 16 heads, dim 64, f16, dropout 0.1, not causal), its figures beside the model's")
      ->check(CLI::IsMember({"gpt2-medium"}));
  cmd->add_option("--standard", flags->standard,
                  "standard attention's model: minimal (S and P written and read once each) or eager (one kernel "
                  "per step, as PyTorch's eager code)")
      ->capture_default_str()->check(CLI::IsMember({"minimal", "eager"}));
  cmd->add_flag("--measure", flags->measure, "run the CPU kernels with counters and show them beside the model");
  cmd->add_option("--repeats", flags->repeats, "timed runs of --measure (median)")->capture_default_str()
      ->check(kPositiveInt);
  cmd->add_flag("--json", flags->json, "machine-readable output");
  cmd->callback([flags, cmd] {
    flags->given = given_options(*cmd);
    explain(*flags);
  });
}

void add_tour(CLI::App& app) {
  auto flags = std::make_shared<TourFlags>();
  CLI::App* cmd = app.add_subcommand("tour", "a guided, measured walk through the four FlashAttention generations");
  cmd->add_option("--max-seqlen", flags->max_seqlen, "largest N of the sweeps (from 256, doubling; 16 to 2^24)")
      ->capture_default_str();
  cmd->add_option("--dim", flags->dim, "head dimension")->capture_default_str();
  cmd->add_option("--heads", flags->heads, "heads of the sweeps")->capture_default_str();
  cmd->add_option("--threads", flags->threads, "worker threads (0 = all cores)")
      ->check(CLI::Range(0, kMaxThreads))->capture_default_str();
  cmd->add_option("--repeats", flags->repeats, "timed runs per measurement (median)")->capture_default_str()
      ->check(kPositiveInt);
  cmd->add_option("--out", flags->out, "directory for the figures (SVG)");
  cmd->callback([flags] { tour(*flags); });
}

#ifdef FLASHATTN_CLI_RING
void add_ring(CLI::App& app) {
  auto flags = std::make_shared<RingFlags>();
  CLI::App* sub = app.add_subcommand(
      "ring", "ring attention over MPI: run under `mpirun -np P`; each rank holds S/P tokens (see docs/distributed.md)");
  add_shape(*sub, flags->shape);
  sub->add_option("--layout", flags->layout, "zigzag (balanced under causal) or contiguous")->capture_default_str();
  sub->add_flag("--backward", flags->backward, "also run ring_backward");
  sub->add_option("--repeats", flags->repeats, "timed runs (the median is reported)")->capture_default_str()
      ->check(kPositiveInt);
  sub->add_option("--softcap", flags->softcap, "soft-capping: scores become softcap*tanh(s/softcap)");
  sub->add_option("--timeout", flags->timeout, "seconds any wait for a peer may take before it is an error")
      ->capture_default_str();
  sub->add_option("--verify-up-to", flags->verify_up_to,
                  "rank 0 checks against single-process flashattn up to this seqlen")
      ->capture_default_str();
  sub->callback([flags] { ring(*flags); });
}
#endif

}  // namespace
}  // namespace flashattn::cli

int main(int argc, char** argv) {
  CLI::App app{"flashattn: exact tiled attention with an online softmax (FlashAttention) on the CPU"};
  app.set_version_flag("--version", std::string("flashattn ") + FLASHATTN_VERSION);
  app.require_subcommand(1);
  flashattn::cli::add_run(app);
  flashattn::cli::add_attend(app);
  flashattn::cli::add_bench(app);
  flashattn::cli::add_numerics(app);
  flashattn::cli::add_explain(app);
  flashattn::cli::add_tour(app);
#ifdef FLASHATTN_CLI_RING
  flashattn::cli::add_ring(app);
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const flashattn::Error& e) {
    std::cerr << "flashattn: error: " << e.what() << "\n";
    return 2;
  } catch (const std::bad_alloc&) {  // sizes the options allow but this machine's memory does not hold
    std::cerr << "flashattn: error: out of memory for the problem the options describe\n";
    return 2;
  } catch (const std::length_error& e) {  // sizes past what a std::vector can hold
    std::cerr << "flashattn: error: the problem the options describe is too large to allocate (" << e.what() << ")\n";
    return 2;
  } catch (const std::exception& e) {  // std::length_error and the like: never a terminate
    std::cerr << "flashattn: error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
