#include "flashattn/plan.hpp"

#include <omp.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <numeric>
#include <optional>
#include <sstream>
#include <tuple>

#include "flashattn/error.hpp"
#include "src/cpu/kernels/backward_kernel.hpp"
#include "src/cpu/kernels/bf16_dot.hpp"
#include "src/cpu/kernels/bf16_decode.hpp"
#include "src/cpu/kernels/fp16_decode.hpp"
#include "src/cpu/kernels/forward_kernel.hpp"
#include "src/cpu/kernels/int8_dot.hpp"
#include "src/cpu/planner.hpp"

namespace flashattn {
namespace {

std::int64_t round_up(std::int64_t n, std::int64_t m) { return (n + m - 1) / m * m; }

std::size_t cache_size(int name, std::size_t fallback) {
  const long bytes = sysconf(name);  // 0 or -1 in some VMs: keep the fallback
  return bytes > 0 ? static_cast<std::size_t>(bytes) : fallback;
}

}  // namespace

namespace cpu::fp16dot {
// Here, in a file compiled for the baseline ISA, not beside the kernels (fp16_decode.cpp is
// compiled for AVX512-FP16).
bool available() {
#if defined(FLASHATTN_FP16_DECODE) && defined(__x86_64__)
  static const bool has = [] {
    __builtin_cpu_init();  // AVX512-BW: the OS saves the 512-bit state; then CPUID.(7, 0):EDX[23]
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    constexpr unsigned kAvx512Fp16 = 1u << 23;
    return __builtin_cpu_supports("avx512bw") != 0 && __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) != 0 &&
           (edx & kAvx512Fp16) != 0;
  }();
  return has;
#else
  return false;
#endif
}
}  // namespace cpu::fp16dot

CpuHardware CpuHardware::detect(int num_threads) {
  CpuHardware hw;
  hw.l1d_bytes = cache_size(_SC_LEVEL1_DCACHE_SIZE, hw.l1d_bytes);
  hw.l2_bytes = cache_size(_SC_LEVEL2_CACHE_SIZE, hw.l2_bytes);
  hw.threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  const cpu::KernelGeometry g = cpu::kernel_geometry();
  hw.simd_target = g.target;
  hw.float_lanes = g.float_lanes;
  hw.micro_rows = g.micro_rows;
  hw.micro_cols = g.micro_cols;
  hw.bf16_dot = cpu::tiled_bf16_available();
  hw.bf16_dot_fast = hw.bf16_dot && cpu::bf16dot::outpaces_fma();
  hw.amx_bf16 = hw.bf16_dot && cpu::bf16dot::uses_amx();
  hw.decode_fp16 = cpu::fp16dot::available();
  hw.decode_bf16 = cpu::bf16decode::available();
  hw.int8_dot = cpu::int8dot::available();
  // Intel's cores slow down around 512-bit arithmetic (a lower clock licence while it runs
  // and after); AMD's Zen 4 does not. A Llama-style model's bf16 decode (8 q / 2 kv heads of
  // 64, 2 threads) ran at 1.01-1.04x SDPA's speed end to end with the AVX2 decode kernel
  // against 0.92-0.95x with AVX-512's over 1024 cached tokens (0.5 MiB of K and V a layer),
  // and alike over 4096 (2 MiB), on the Sapphire Rapids of docs/performance.md (thirty-second
  // session); float32 caches alike with either; long calls alone (a loop of them) run 10-20%
  // faster on AVX-512.
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  if (hw.float_lanes == 16 && intel && cpu::avx2_kernel_geometry()) hw.short_decode_bytes = std::size_t{1} << 20;
  return hw;
}

namespace {

// Up to this many (q head, query) rows per kv head the decode kernel runs: each key then
// costs a handful of dot products, and reading K and V once in place beats packing them
// into micro-tiles that would be mostly padding.
constexpr std::int64_t kDecodeRows = 16;

// The kernel that runs `p` with k and v stored as `internals` say: the requested one, or
// (automatic) decode for few rows per kv head, tiled_bf16 where it can run and is the faster
// one (CpuHardware::bf16_dot_fast), tiled otherwise. A request the inputs or the hardware
// rule out is an Error that names the kernel and why.
ForwardKernel choose_kernel(const AttentionProblem& p, const detail::ProblemInternals& internals, const CpuHardware& hw,
                            ForwardKernel requested) {
  const DType kv_dtype = internals.kv_dtype(p);
  // FP8 caches (kv_dtype u8) and forward_fp8 (float32 values of FP8 codes) are not bf16.
  const bool bf16_inputs = p.dtype == DType::bf16 && kv_dtype == DType::bf16;
  if (requested == ForwardKernel::tiled_bf16) {
    if (!bf16_inputs)
      throw Error("kernel tiled_bf16: needs bf16 q, k and v, got q " + std::string(to_string(p.dtype)) + ", k/v " +
                  to_string(kv_dtype) + " (use kernel tiled or auto)");
    if (!hw.bf16_dot)
      throw Error("kernel tiled_bf16: not available here: it needs a CPU with AVX512-BF16 (VDPBF16PS) and the AVX3 "
                  "or AVX3_DL SIMD target (this CPU has AVX512-BF16: " +
                  std::string(cpu::bf16dot::available() ? "yes" : "no") + ", SIMD target: " + hw.simd_target +
                  "); use kernel tiled or auto");
    return requested;
  }
  const std::int64_t rows = p.heads_q / p.heads_kv * p.seqlen_q;  // per kv head
  // decode_fp16's half-precision sums of Q·Kᵀ are bounded for head_dim ≤ its own limit.
  if (requested == ForwardKernel::decode_fp16 && p.head_dim > cpu::fp16dot::kMaxHeadDim)
    throw Error("kernel decode_fp16: head_dim " + std::to_string(p.head_dim) + " above its limit " +
                std::to_string(cpu::fp16dot::kMaxHeadDim) + " (half-precision partial sums); use kernel decode or auto");
  const bool quantized = internals.fp8_kv_cache || internals.int8_kv_cache;
  // Its half-precision P·V takes P ≤ 1 (fp16_decode.hpp): dropout's 1/(1 − p) is refused.
  const bool fp16_decode = quantized && rows <= kDecodeRows && p.head_dim <= cpu::fp16dot::kMaxHeadDim &&
                           hw.decode_fp16 && p.dropout_p == 0.0f;
  // decode_bf16 scores int8 K codes on AVX512-VNNI (int8_dot.hpp), which every CPU with
  // AVX512-BF16 has.
  const bool vnni = !internals.int8_kv_cache || hw.int8_dot;
  const bool bf16_decode = quantized && rows <= kDecodeRows && hw.decode_bf16 && vnni;
  for (const auto& [kernel, runs, isa, has] :
       {std::tuple{ForwardKernel::decode_fp16, fp16_decode, "AVX512-FP16", hw.decode_fp16},
        std::tuple{ForwardKernel::decode_bf16, bf16_decode, "AVX512-BF16", hw.decode_bf16}})
    if (requested == kernel && !runs)
      throw Error("kernel " + std::string(to_string(kernel)) +
                  ": needs a quantized KV cache, FP8 (e4m3) or int8 codes (k/v: " + to_string(kv_dtype) + "), at most " +
                  std::to_string(kDecodeRows) + " query rows per kv head (heads_q / heads_kv · seqlen_q: " +
                  std::to_string(rows) + ") and a CPU with " + isa + " (this one: " + (has ? "yes" : "no") + ")" +
                  (kernel == ForwardKernel::decode_bf16 && internals.int8_kv_cache
                       ? std::string(", for int8 codes also AVX512-VNNI (this one: ") + (vnni ? "yes" : "no") + ")"
                       : std::string()) +
                  (kernel == ForwardKernel::decode_fp16 ? ", and no dropout (dropout_p: " + std::to_string(p.dropout_p) +
                                                              ")"
                                                        : std::string()) +
                  "; use kernel decode or auto");
  if (requested != ForwardKernel::automatic) return requested;
  // decode_fp16 for FP8 and int8 caches alike where it runs: over int8 codes it was within ±8%
  // of the float32 decode kernel on a Xeon without AMX and 15–40% faster on a Sapphire Rapids
  // (docs/performance.md, 2026-12-03 evening and nineteenth session); its half-precision
  // roundings stay a small part of the codes' own quantization error (kv_quant.hpp).
  // decode_bf16 only where VDPBF16PS itself outpaces float32 FMA (AMD's cores: bf16_dot_fast
  // without AMX). On the Sapphire Rapids of docs/performance.md, whose VDPBF16PS has half
  // FMA's FLOP rate, it ran at about 0.7× decode's speed (twenty-first session).
  const bool bf16_decode_fast = bf16_decode && hw.bf16_dot_fast && !hw.amx_bf16;
  if (rows <= kDecodeRows)
    return fp16_decode        ? ForwardKernel::decode_fp16
           : bf16_decode_fast ? ForwardKernel::decode_bf16
                              : ForwardKernel::decode;
  return bf16_inputs && hw.bf16_dot && hw.bf16_dot_fast ? ForwardKernel::tiled_bf16 : ForwardKernel::tiled;
}

std::int64_t choose_splits(int requested, std::int64_t items, std::int64_t k_tiles, int threads) {
  std::int64_t splits = requested;
  // Split the keys only when items would leave threads idle: never on one thread, where a
  // split only adds partial results and their merge.
  if (splits == 0)
    splits = items >= 2 * threads || threads == 1 ? 1 : (2 * threads + items - 1) / std::max<std::int64_t>(items, 1);
  return std::clamp<std::int64_t>(splits, 1, std::max<std::int64_t>(k_tiles, 1));
}

// Whether `kernel` runs on the AVX2 target (CpuHardware::short_decode_bytes): decode over a
// bf16 or f16 cache of values whose K and V, every batch element's, are at most that many
// bytes. The problem's own sizes alone decide, never the thread count, so that a sequence
// planned alone (plan_forward_alone) gets the same kernel in any batch.
bool short_decode_on_avx2(const AttentionProblem& p, const detail::ProblemInternals& internals, const CpuHardware& hw,
                          ForwardKernel kernel) {
  const DType kv = internals.kv_dtype(p);
  if (kernel != ForwardKernel::decode || hw.short_decode_bytes == 0 || internals.fp8_kv_cache ||
      internals.int8_kv_cache || (kv != DType::bf16 && kv != DType::f16))
    return false;
  const double bytes = static_cast<double>(p.batch) * static_cast<double>(p.seqlen_k) *
                       static_cast<double>(p.heads_kv) * static_cast<double>(p.head_dim + p.head_dim_v) *
                       static_cast<double>(dtype_size(kv));
  return bytes <= static_cast<double>(hw.short_decode_bytes);
}

}  // namespace

ForwardKernel cpu::forward_kernel(const AttentionProblem& p, const detail::ProblemInternals& internals,
                                  const CpuHardware& hw, ForwardKernel requested) {
  return choose_kernel(p, internals, hw, requested);
}

namespace {

// The variant of `p` (or the options' score hook) whose values differ per q head, which a
// packed Q tile — one set of row variants for every head of a kv head — cannot apply; null
// when there is none.
const char* per_head_variant(const AttentionProblem& p, bool score_hook) {
  if (p.alibi) return "alibi_slopes";
  if (p.dropout_p > 0.0f) return "dropout_p";
  if (p.attn_mask != AttentionProblem::MaskKind::none) return "attn_mask";
  return score_hook ? "score_hook" : nullptr;
}

}  // namespace

std::optional<bool> cpu::pack_gqa_request(const AttentionProblem& p, const AttentionOptions& options) {
  const char* variant = per_head_variant(p, options.score_hook.apply != nullptr);
  if (variant == nullptr) return options.pack_gqa;
  if (options.pack_gqa.value_or(false) && p.heads_q > p.heads_kv)
    throw Error(std::string("pack_gqa: true is not supported with ") + variant +
                ", whose values differ per q head (unset or false runs one Q tile per head)");
  return false;
}

CpuForwardPlan cpu::plan_forward(const AttentionProblem& p, const detail::ProblemInternals& internals,
                                 const CpuHardware& hw, const AttentionOptions& options) {
  const std::optional<bool> pack = pack_gqa_request(p, options);
  if (options.switches.q_tile_parallelism)
    return plan_forward(p, internals, hw, options.num_splits, options.block_q, options.kernel, pack);
  return plan_forward(p, internals, hw, 1, std::max<std::int64_t>(p.seqlen_q, 1), options.kernel, false);
}

CpuForwardPlan plan_forward(const AttentionProblem& p, const CpuHardware& hw, const AttentionOptions& options) {
  return cpu::plan_forward(p, {}, hw, options);
}

std::vector<CpuForwardPlan> cpu::plan_forward_together(std::span<const AttentionProblem> problems,
                                                       std::span<const detail::ProblemInternals> internals,
                                                       const CpuHardware& hw, const AttentionOptions& options) {
  if (internals.size() != problems.size())
    throw Error("plan_forward_together: " + std::to_string(internals.size()) + " internals for " +
                std::to_string(problems.size()) + " problems");
  AttentionOptions call = options;
  bool shared = problems.size() > 1;
  for (std::size_t i = 0; i < problems.size() && shared; ++i)
    shared = is_decode(choose_kernel(problems[i], internals[i], hw, options.kernel));
  if (shared && options.num_splits == 0 && options.switches.q_tile_parallelism) {
    const auto sequences = static_cast<std::int64_t>(problems.size());
    call.num_splits = static_cast<int>((2 * hw.threads + sequences - 1) / sequences);
  }
  std::vector<CpuForwardPlan> plans;
  plans.reserve(problems.size());
  for (std::size_t i = 0; i < problems.size(); ++i) plans.push_back(plan_forward(problems[i], internals[i], hw, call));
  return plans;
}

std::vector<CpuForwardPlan> plan_forward_together(std::span<const AttentionProblem> problems, const CpuHardware& hw,
                                                  const AttentionOptions& options) {
  const std::vector<detail::ProblemInternals> as_given(problems.size());
  return cpu::plan_forward_together(problems, as_given, hw, options);
}

CpuForwardPlan cpu::plan_forward_alone(const AttentionProblem& p, const detail::ProblemInternals& internals,
                                       const CpuHardware& hw, const AttentionOptions& options) {
  CpuHardware one = hw;
  one.threads = 1;
  const bool q_tiles = options.switches.q_tile_parallelism;
  const std::int64_t block_q = q_tiles ? options.block_q : std::max<std::int64_t>(p.seqlen_q, 1);
  const int requested = q_tiles ? options.num_splits : 1;
  const ForwardKernel kernel = choose_kernel(p, internals, one, options.kernel);
  int splits = requested == 0 ? 1 : requested;
  // An item of kSplitKeys keys of every kv head reads 2048 · 8 · (128 + 128) · 2 B = 8 MiB of
  // a bf16 cache at 8 kv heads, D = 128: long enough that its start and its share of the
  // merge (heads_q · head_dim_v floats per query row) are small beside it, short enough that
  // a 16k-token row is 8 items to balance among the threads.
  if (requested == 0 && is_decode(kernel) && p.seqlen_k > kSplitKeys)
    splits = static_cast<int>((p.seqlen_k + kSplitKeys - 1) / kSplitKeys);
  const std::optional<bool> pack = q_tiles ? pack_gqa_request(p, options) : false;
  CpuForwardPlan plan = plan_forward(p, internals, one, splits, block_q, kernel, pack);  // the kernel chosen once
  plan.hardware.threads = hw.threads;
  plan.threads = static_cast<int>(std::clamp<std::int64_t>(plan.work_items, 1, hw.threads));
  return plan;
}

bool plans_share_region(std::span<const CpuForwardPlan> plans) {
  return plans.size() > 1 &&
         std::all_of(plans.begin(), plans.end(), [](const CpuForwardPlan& plan) { return is_decode(plan.kernel); });
}

CpuForwardPlan plan_forward(const AttentionProblem& p, const CpuHardware& hw, int num_splits,
                            std::int64_t block_q, ForwardKernel kernel) {
  return cpu::plan_forward(p, {}, hw, num_splits, block_q, kernel);
}

CpuForwardPlan cpu::plan_forward(const AttentionProblem& p, const detail::ProblemInternals& internals,
                                 const CpuHardware& hw, int num_splits, std::int64_t block_q, ForwardKernel kernel,
                                 std::optional<bool> pack_gqa) {
  CpuForwardPlan plan;
  plan.hardware = hw;
  plan.kernel = choose_kernel(p, internals, hw, kernel);
  const std::optional<cpu::KernelGeometry> avx2 = cpu::avx2_kernel_geometry();
  if (avx2 && short_decode_on_avx2(p, internals, hw, plan.kernel)) {
    const cpu::KernelGeometry& g = *avx2;
    plan.avx2_decode = true;
    plan.hardware.simd_target = g.target;
    plan.hardware.float_lanes = g.float_lanes;
    plan.hardware.micro_rows = g.micro_rows;
    plan.hardware.micro_cols = g.micro_cols;
  }
  const std::int64_t mr = plan.hardware.micro_rows, mc = plan.hardware.micro_cols;
  plan.head_dim_v_padded = round_up(p.head_dim_v, mc);

  // K/V tile: its keys amortize the per-tile softmax bookkeeping (row max and sum, rescale
  // of õ, the mask step) over block_k·(D + Dv) FMAs per row. The tiled kernels take 256 keys:
  // measured against 128 on the Sapphire Rapids (48 KiB L1d, AVX-512's 32-float panels:
  // +2–5% for float32, twenty-eighth session; on AMX tiles +3–10%, õ's C tiles loaded and
  // stored once per K/V tile, eighteenth session; 512 no faster) and on a Zen 4, whose 32 KiB
  // L1d such a V panel (256 × 32 floats) fills entirely — a rule that the panel fill at most
  // two thirds of L1d kept it at 128 there until measured (forty-sixth session: float32
  // +4–6% dense, tiled_bf16 +7–11%, windows and block masks +6–20%). The decode kernels
  // start from 128 and fit their blocks to L1d and L2 below.
  const std::int64_t kBlockK = is_decode(plan.kernel) ? 128 : 256;
  plan.block_k = std::min(round_up(kBlockK, mc), round_up(std::max<std::int64_t>(p.seqlen_k, 1), mc));

  // Q tile: the Q rows, their õ accumulators and the S tile should fill at most half of
  // L2, leaving the rest for the streamed K/V panels. Capped at 128 rows.
  constexpr std::int64_t kMaxBlockQ = 128;
  const std::int64_t bytes_per_row =
      (p.head_dim + plan.head_dim_v_padded + plan.block_k) * static_cast<std::int64_t>(sizeof(float));
  std::int64_t bq = static_cast<std::int64_t>(hw.l2_bytes / 2) / bytes_per_row;
  bq = std::clamp(bq, mr, kMaxBlockQ) / mr * mr;  // a whole number of micro-tiles
  const std::int64_t head_rows = round_up(std::max<std::int64_t>(p.seqlen_q, 1), mr);
  // pack_gqa (AttentionOptions::pack_gqa): the q heads of a kv head share each Q tile, every
  // K/V tile streamed once for them all. Unset, it packs where a head's rows fill at most
  // half a Q tile: the tile then holds rows of every head of the group, instead of a few rows
  // of one head per pass over the whole of K and V. The tile's rows are shared among the
  // heads, block_q each, unrounded: their rows lie back to back and the tile is padded once.
  const std::int64_t group = p.heads_q / p.heads_kv;
  const bool variant_per_head = per_head_variant(p, false) != nullptr;
  const bool pack = !is_decode(plan.kernel) && group > 1 && !variant_per_head &&
                    pack_gqa.value_or(2 * head_rows <= bq);
  plan.heads_per_item = pack ? group : 1;
  if (pack)  // the tile's rows, rounded up once, by under micro_rows
    bq = std::clamp<std::int64_t>((bq + mr - 1) / group, 1, std::max<std::int64_t>(p.seqlen_q, 1));
  else
    bq = std::min(bq, head_rows);
  // Enough work items to keep every thread busy (docs/algorithm.md §3: parallelize over the sequence).
  const std::int64_t heads = p.batch * p.heads_q / plan.heads_per_item;
  while (bq > 2 * mr && heads * ((p.seqlen_q + bq - 1) / bq) < 4 * hw.threads)
    bq = std::max(mr, bq / 2 / mr * mr);
  if (block_q > 0) bq = round_up(std::min(block_q, std::max<std::int64_t>(p.seqlen_q, 1)), mr);
  plan.block_q = bq;
  plan.q_blocks = (p.seqlen_q + bq - 1) / bq;
  // Split-KV (flash-decoding): with fewer Q tiles than 2 per thread, split the keys so
  // that every thread has work; never more splits than K/V tiles.
  const std::int64_t k_tiles = (p.seqlen_k + plan.block_k - 1) / plan.block_k;
  if (is_decode(plan.kernel)) {
    // One work item = (batch, contiguous key chunk) over every kv head: a thread streams
    // whole token rows (the kv heads of a key are adjacent), which the hardware prefetcher
    // follows, instead of a strided 1/heads_kv of each row. Its rows are every q head's,
    // block_q (in fours) per kv head. The kernel reads a key block's V rows (in the storage
    // dtype) once per pair of õ vectors: one kv head's should fill at most half of L1d,
    // and every kv head's at most a quarter of L2, where they wait from their prefetch
    // during S = Q·Kᵀ until P·V. Larger blocks amortize the per-block softmax bookkeeping.
    // Rows in fours, but one or two alone on a cache of values: padded to four (multi-head
    // attention's decode, a group of two q heads) they cost four rows' products. The narrow
    // products (decode_fp16, decode_bf16) and quantized caches keep panels of four (fewer
    // instantiations of the kernel's products).
    const std::int64_t rows = std::max<std::int64_t>(1, group * p.seqlen_q);
    const bool values = !internals.fp8_kv_cache && !internals.int8_kv_cache;
    const std::int64_t rows4 =
        rows <= 2 && values && plan.kernel == ForwardKernel::decode ? rows : (rows + 3) / 4 * 4;
    plan.block_q = rows4;  // the rows of one (kv head, key block) tile, as the cost model counts
    plan.q_blocks = 1;
    const std::int64_t v_row_bytes = std::max<std::int64_t>(1, p.head_dim_v * static_cast<std::int64_t>(dtype_size(p.dtype)));
    const std::int64_t fit = std::min(static_cast<std::int64_t>(hw.l1d_bytes / 2) / v_row_bytes,
                                      static_cast<std::int64_t>(hw.l2_bytes / 4) / (p.heads_kv * v_row_bytes));
    plan.block_k = std::min(plan.block_k, std::max(mc, fit / mc * mc));
    const std::int64_t decode_tiles = (p.seqlen_k + plan.block_k - 1) / plan.block_k;
    plan.splits = choose_splits(num_splits, p.batch, decode_tiles, hw.threads);
  } else {
    plan.splits = choose_splits(num_splits, heads * plan.q_blocks, k_tiles, hw.threads);
  }
  plan.work_items = forward_work_items(p, plan.schedule());
  plan.threads = static_cast<int>(std::clamp<std::int64_t>(plan.work_items, 1, hw.threads));
  plan.workspace_bytes_per_thread = cpu::forward_workspace_bytes(plan, p);
  if (plan.splits > 1)
    plan.shared_bytes = static_cast<std::size_t>(plan.splits * p.batch * p.heads_q * p.seqlen_q *
                                                 (p.head_dim_v + 2)) * sizeof(float);
  return plan;
}

CpuBackwardPlan plan_backward(const AttentionProblem& p, const CpuHardware& hw,
                              bool deterministic, BackwardKernel kernel) {
  CpuBackwardPlan plan;
  plan.hardware = hw;
  if (kernel == BackwardKernel::tiled_bf16) {
    if (p.dtype != DType::bf16)
      throw Error("backward_kernel tiled_bf16: needs bf16 q, k and v, got " + to_string(p.dtype) +
                  " (use backward_kernel tiled or auto)");
    if (!hw.bf16_dot)
      throw Error("backward_kernel tiled_bf16: not available here: it needs a CPU with AVX512-BF16 (VDPBF16PS) and "
                  "the AVX3 or AVX3_DL SIMD target (SIMD target: " + hw.simd_target +
                  "); use backward_kernel tiled or auto");
  }
  plan.kernel = kernel == BackwardKernel::automatic
                    ? (p.dtype == DType::bf16 && hw.bf16_dot && hw.bf16_dot_fast ? BackwardKernel::tiled_bf16
                                                                                 : BackwardKernel::tiled)
                    : kernel;
  plan.deterministic = deterministic;
  const std::int64_t mr = hw.micro_rows, mc = hw.micro_cols;
  plan.head_dim_padded = round_up(p.head_dim, mc);
  plan.head_dim_v_padded = round_up(p.head_dim_v, mc);
  // A K/V tile is the row side of the dK/dV products and the column side of S and dP:
  // whole micro-tiles both ways, about 128 keys (the float32 forward's 256 were 0.93–1.04×
  // here: docs/performance.md, twenty-eighth session).
  const std::int64_t unit = std::lcm(mr, mc);
  constexpr std::int64_t kBlockK = 128;
  plan.block_k = std::max<std::int64_t>(1, (kBlockK + unit / 2) / unit) * unit;
  plan.block_k = std::min(plan.block_k, round_up(std::max<std::int64_t>(p.seqlen_k, 1), unit));
  // Q tile: about 64 rows keep Q, dO, P, dS and the dK/dV accumulators (≈ 320 KiB at
  // D = 128) inside a 512 KiB L2. The float32 kernel's tiles share the rows evenly, whole
  // micro-tiles each, so that no short last tile pays a tile's fixed costs for a few rows
  // (128 rows: two of 66, not 60, 60 and 8); tiled_bf16 pads rows to whole AMX chunks and
  // keeps 64. Independent of the thread count, so deterministic results are too.
  constexpr std::int64_t kBlockQ = 64;
  plan.block_q = std::max(mr, kBlockQ / mr * mr);
  if (plan.kernel == BackwardKernel::tiled && p.seqlen_q > 0) {
    const std::int64_t tiles = (p.seqlen_q + kBlockQ - 1) / kBlockQ;
    plan.block_q = round_up((p.seqlen_q + tiles - 1) / tiles, mr);
  }
  plan.q_blocks = (p.seqlen_q + plan.block_q - 1) / plan.block_q;
  plan.k_blocks = (p.seqlen_k + plan.block_k - 1) / plan.block_k;
  plan.kv_work_items = p.batch * p.heads_kv * plan.k_blocks;
  plan.threads = static_cast<int>(std::clamp<std::int64_t>(
      std::max(plan.kv_work_items, p.batch * p.heads_q), 1, hw.threads));
  // The threads' Q/dO copies (BackwardWorkspace::q_kept): each within kQCacheBytes, and
  // together within what they copy from (q and dout) unless that is under kQCacheFreeBytes —
  // what they save is gathering rows H·D apart, so few heads (rows close together) and long
  // sequences gain least from them and pay most.
  const std::size_t copy = cpu::backward_q_rows_bytes(plan, p), copies = copy * static_cast<std::size_t>(plan.threads);
  const std::size_t copied = static_cast<std::size_t>(p.batch * p.heads_q * p.seqlen_q * (p.head_dim + p.head_dim_v)) *
                             dtype_size(p.dtype);
  plan.keep_q_rows = copy <= cpu::kQCacheBytes &&
                     (copies <= copied || copies <= cpu::kQCacheFreeBytes);
  plan.workspace_bytes_per_thread = cpu::backward_workspace_bytes(plan, p);
  const std::size_t rows = static_cast<std::size_t>(p.batch * p.heads_q * p.seqlen_q);
  plan.shared_bytes = rows * sizeof(float) * (1 + static_cast<std::size_t>(plan.head_dim_padded)) +
                      (deterministic ? static_cast<std::size_t>(p.batch * p.heads_q * plan.q_blocks) *
                                           sizeof(std::int64_t)
                                     : 0);
  return plan;
}

std::string CpuBackwardPlan::describe() const {
  std::ostringstream s;
  s << "kernel=" << to_string(kernel) << " simd=" << hardware.simd_target << " micro_tile=" << hardware.micro_rows
    << "x" << hardware.micro_cols << " block_q=" << block_q << " block_k=" << block_k
    << " work_items=" << kv_work_items
    << " deterministic=" << (deterministic ? "true" : "false") << " keep_q_rows=" << (keep_q_rows ? "true" : "false")
    << " threads=" << threads
    << " workspace_bytes=" << workspace_bytes();
  return s.str();
}

std::string CpuForwardPlan::describe() const {
  std::ostringstream s;
  s << "kernel=" << to_string(kernel) << " simd=" << hardware.simd_target << " micro_tile="
    << hardware.micro_rows << "x" << hardware.micro_cols << " block_q=" << block_q << " block_k=" << block_k
    << " q_blocks=" << q_blocks << " heads_per_item=" << heads_per_item << " splits=" << splits
    << " work_items=" << work_items
    << " threads=" << threads
    << " workspace_bytes=" << workspace_bytes();
  return s.str();
}

}  // namespace flashattn
