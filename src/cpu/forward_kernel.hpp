// Internal interface between the CPU forward driver (forward.cpp: validation, plan,
// threads) and the per-SIMD-target kernel (forward_kernel.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include <hwy/aligned_allocator.h>

#include "flashattn/counters.hpp"
#include "flashattn/online_softmax.hpp"
#include "flashattn/plan.hpp"
#include "flashattn/problem.hpp"
#include "flashattn/tensor.hpp"
#include "src/core/paged_kv.hpp"
#include "src/cpu/packed_head.hpp"

namespace flashattn::cpu {

using detail::PagedKv;  // the paged-KV source (src/core/paged_kv.hpp)

// The decode kernel's view of a block of keys: key c's K and V rows of kv head 0 (the
// other heads follow at the views' head strides) and, for FP8 pools, its page's descales
// of kv head 0 (null otherwise). Resolved once per key for every kv head; one array per
// field, so that a loop over keys reads each with an 8-byte stride.
struct DecodeKeys {
  std::vector<const unsigned char*> k, v;
  std::vector<const float*> k_descale, v_descale;
  void resize(std::size_t n) {
    k.resize(n);
    v.resize(n);
    k_descale.resize(n);
    v_descale.resize(n);
  }
  static constexpr std::size_t kBytesPerKey = 2 * sizeof(const unsigned char*) + 2 * sizeof(const float*);
};

// Keys whose K and V rows (every kv head: 2 KiB each at 8 heads × D 128 bf16) the decode
// kernel prefetches ahead of the keys it scores: K because it reads four keys' rows at once,
// four streams the hardware prefetcher does not follow; V because P·V reads it only after
// the block's softmax. On the Zen 3 of docs/performance.md distances of 0 to 16 keys, V
// alone, measured alike within the noise; on the Sapphire Rapids Xeon of 2026-12, prefetching
// K with V took bf16 decode from 6.6 to 5.0–5.3 ms, and distances of 8, 16 and 32 keys
// measured alike within the noise.
constexpr std::int64_t kDecodePrefetchKeys = 16;
constexpr std::int64_t kCacheLineBytes = 64;  // x86: one prefetch per line

// Rows of the caller's tensors that the tiled kernel fetches ahead of the one it converts:
// K and V rows while packing, Q rows into the Q tile, output rows it stores. Consecutive
// rows of one head lie heads·D elements apart — 8 KiB at 16 heads × D 128 in float32 — each
// on a page of its own, where the hardware prefetchers, which stay within a page, do not
// follow; each row then waits for DRAM and often for a page walk. A packed row costs a few
// hundred cycles, a miss about as many, so a few rows ahead hide it (4, 8 and 16 measured
// alike on the Zen 3 of docs/performance.md; 8 is kept).
constexpr std::int64_t kRowPrefetchDistance = 8;

// Columns [begin, end) of a K/V tile that one row strip of a Q tile (the micro-kernel's
// rows) computes, in whole micro-kernel panels; begin == end: none (forward_kernel.cpp,
// FindStripKeys).
struct StripKeys {
  std::int64_t begin = 0;
  std::int64_t end = 0;
};

// Everything a work item needs; filled once per call by the driver.
struct ForwardParams {
  AttentionProblem problem;
  CpuForwardPlan plan;
  TensorView q, k, v;
  MutableTensorView out, lse;
  TensorView alibi_slopes, block_mask;  // from the options; empty when unused
  // Split-KV partial results (plan.splits > 1): (splits, batch, seqlen_q, heads_q, Dv)
  // normalized outputs and (splits, batch, heads_q, seqlen_q) lses, float32, contiguous.
  float* split_out = nullptr;
  float* split_lse = nullptr;
  PagedKv paged;
  MutableTensorView rescale_counts;  // int32 (batch, heads_q, seqlen_q), zeroed; null when not asked
  AttentionOptions::KernelSwitches switches;
};

// Per-thread scratch memory, sized by the plan. The packed K/V of one (batch, kv head)
// stays cached across the work items of that head: a thread packs each head once.
struct ForwardWorkspace {
  explicit ForwardWorkspace(const CpuForwardPlan& plan, const AttentionProblem& problem);

  hwy::AlignedFreeUniquePtr<float[]> q_tile;    // (block_q, head_dim rounded to two vectors), pre-scaled,
                                                // (decode) plus one row in row order; also the row
                                                // scratch of K packing
  hwy::AlignedFreeUniquePtr<float[]> s_tile;    // (block_q, block_k): S, then P in place
  hwy::AlignedFreeUniquePtr<float[]> o_acc;     // (block_q, head_dim_v_padded): õ; (decode) plus block_k
                                                // floats: a key block's FP8 V descales
  std::vector<OnlineSoftmaxState> states;       // (block_q): m and ℓ of each row
  std::vector<std::int32_t> rescales;           // (block_q): rescales of each row (counters, rescale_counts)
  std::vector<StripKeys> strip_keys;            // (block_q / micro_rows): each row strip's span of the current tile
  // (tiled) k tiles of Kᵀ, each as contiguous panels of kMicroCols keys, (head_dim, kMicroCols)
  // each; v: k tiles of V, each as contiguous panels of kMicroCols columns, (block_k,
  // kMicroCols) each (Fp32Products::Pack in forward_kernel.cpp)
  hwy::AlignedFreeUniquePtr<float[]> k_packed;  // k_tiles · head_dim · block_k floats
  hwy::AlignedFreeUniquePtr<float[]> v_packed;  // k_tiles · block_k · head_dim_v_padded floats
  // (tiled_bf16) bf16 operands of the VDPBF16PS micro-kernel (bf16_dot.hpp), all with pairs
  // along the products' depth: Q rows unscaled, head_dim rounded up to even (q_bf16, block_q
  // rows); P rounded, (block_q, block_k); k tiles of K, each as panels of kMicroCols keys,
  // (head_dim_pairs, kMicroCols, 2) each; k tiles of V, each as panels of kMicroCols columns,
  // (block_k / 2, kMicroCols, 2) each. k_packed and v_packed are unused then.
  hwy::AlignedFreeUniquePtr<std::uint16_t[]> q_bf16, p_bf16, k_pairs, v_pairs;
  DecodeKeys decode_keys;                       // (block_k + kDecodePrefetchKeys): a key block's rows (decode)
  PackedHead packed;  // which head k/v buffers hold, and how much of it
  KernelCounters counters;  // this thread's share of the call's counts (counters.hpp)
};

// Bytes ForwardWorkspace allocates for this plan (the plan reports it).
std::size_t forward_workspace_bytes(const CpuForwardPlan& plan, const AttentionProblem& problem);

// Micro-kernel geometry of the SIMD target chosen at run time.
struct KernelGeometry {
  const char* target;
  int float_lanes;
  int micro_rows;
  int micro_cols;
};
KernelGeometry kernel_geometry();

// The kernel for one work item (batch, q head, q block), resolved once per call; Error for
// tiled_bf16 where tiled_bf16_available() is false.
using ForwardWorkItemFn = void (*)(const ForwardParams&, ForwardWorkspace&, std::int64_t item);
ForwardWorkItemFn forward_work_item_kernel(ForwardKernel kernel);

// The CPU has AVX512-BF16 and the SIMD target chosen at run time has the tiled_bf16 kernel.
bool tiled_bf16_available();

}  // namespace flashattn::cpu
