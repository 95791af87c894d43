// Internal interface between the CPU forward driver (forward.cpp: validation, plan,
// threads) and the per-SIMD-target kernels.
//
// The kernel families of src/cpu/kernels/, one Highway compilation unit (foreach_target)
// each: tiled_forward.cpp (tiled, tiled_bf16), decode_forward.cpp (decode, decode_fp16),
// tiled_backward.cpp (backward_kernel.hpp). Micro-kernels compiled once for their ISA:
// bf16_dot.* (AVX512-BF16, AMX), fp16_decode.* (AVX512-FP16). Shared per-target steps:
// tile_ops-inl.h (micro-kernel, row conversion), kv_pack-inl.h (paged K/V reader, packing,
// prefetch), forward_rows-inl.h (mask, online softmax, output rows), score_mods-inl.h,
// simd_math-inl.h, fp8-inl.h. workspace.* lays out the forward's per-thread memory,
// mask_blocks.* summarises a boolean attn_mask per tile (forward and backward); the schedule
// the kernels walk is the plan's (ForwardSchedule, flashattn/plan.hpp).
#pragma once

#include <cstdint>
#include <optional>

#include "flashattn/options.hpp"
#include "flashattn/plan.hpp"
#include "flashattn/problem.hpp"
#include "flashattn/tensor.hpp"
#include "src/core/paged_kv.hpp"
#include "src/core/problem_internals.hpp"
#include "src/cpu/kernels/mask_blocks.hpp"
#include "src/cpu/kernels/workspace.hpp"

namespace flashattn::cpu {

using detail::KvScales;  // how a quantized pool reads (src/core/paged_kv.hpp)
using detail::PagedKv;   // the paged-KV source (src/core/paged_kv.hpp)

constexpr std::int64_t kCacheLineBytes = 64;  // x86: one prefetch per line

// Rows of the caller's tensors that the tiled kernel fetches ahead of the one it converts:
// K and V rows while packing, Q rows into the Q tile, output rows it stores. Consecutive
// rows of one head lie heads·D elements apart — 8 KiB at 16 heads × D 128 in float32 — each
// on a page of its own, where the hardware prefetchers, which stay within a page, do not
// follow; each row then waits for DRAM and often for a page walk. A packed row costs a few
// hundred cycles, a miss about as many, so a few rows ahead hide it (4, 8 and 16 measured
// alike on the Zen 3 of docs/performance.md; 8 is kept).
constexpr std::int64_t kRowPrefetchDistance = 8;

// Everything a work item needs; filled once per call by the driver.
struct ForwardParams {
  AttentionProblem problem;
  detail::ProblemInternals internals;  // a sequence's batch index, an FP8 cache, FP8 probabilities
  CpuForwardPlan plan;
  TensorView q, k, v;
  MutableTensorView out, lse;
  TensorView alibi_slopes, block_mask;  // from the options; empty when unused
  TensorView sinks;                     // from the options; empty when unused
  TensorView attn_mask;                 // from the options; empty when unused
  DenseMaskBlocks attn_mask_blocks;     // a boolean attn_mask's tiles (the driver's summary)
  ScoreHook score_hook;                 // from the options; apply null when unused
  // Split-KV partial results (plan.splits > 1): (splits, batch, seqlen_q, heads_q, Dv)
  // normalized outputs and each (splits, batch, heads_q, seqlen_q) row's softmax state, its
  // max (log2 units) and ℓ, float32, contiguous — apart, not as one lse, which float32 rounds
  // to the max where the scores are huge (a finfo.min mask row: log ℓ lost, splits of
  // different sizes weighed alike).
  float* split_out = nullptr;
  float* split_max = nullptr;
  float* split_sum = nullptr;
  PagedKv paged;
  float* lse_sums = nullptr;  // the job's (detail::ForwardJob::lse_sums): lse gets the max, this ℓ
  MutableTensorView rescale_counts;  // int32 (batch, heads_q, seqlen_q), zeroed; null when not asked
  AttentionOptions::KernelSwitches switches;
};

// Micro-kernel geometry of the SIMD target chosen at run time.
struct KernelGeometry {
  const char* target;
  int float_lanes;
  int micro_rows;
  int micro_cols;
};
KernelGeometry kernel_geometry();
// The geometry of the AVX2 target where it is compiled, the CPU runs it and
// set_avx2_decode_enabled has not turned it off, else nullopt: the 256-bit decode kernel of
// short decode calls on AVX-512 CPUs that lower their clock for 512-bit work
// (CpuHardware::short_decode_bytes). Cheap: no CPUID (a VM exit each) per call.
std::optional<KernelGeometry> avx2_kernel_geometry();
// Off (false): decode runs on the dispatched target alone, as the tests that loop over the
// SIMD targets need; on (the default) again with true. Not while a call plans.
void set_avx2_decode_enabled(bool enabled);

// The kernel for one work item (batch, q head, q block), resolved once per call; Error for
// tiled_bf16 where tiled_bf16_available() is false.
using ForwardWorkItemFn = void (*)(const ForwardParams&, ForwardWorkspace&, std::int64_t item);
ForwardWorkItemFn forward_work_item_kernel(const CpuForwardPlan& plan);
// The work item of decode, decode_fp16 or decode_bf16, resolved once per call
// (decode_forward.cpp); Error for decode_fp16 (decode_bf16) where the CPU lacks AVX512-FP16
// (AVX512-BF16). avx2: decode's item of the AVX2 target (a plan of avx2_kernel_geometry()).
ForwardWorkItemFn decode_work_item_kernel(ForwardKernel kernel, bool avx2);

// The CPU has AVX512-BF16 and the SIMD target chosen at run time has the tiled_bf16 kernel.
bool tiled_bf16_available();

}  // namespace flashattn::cpu
