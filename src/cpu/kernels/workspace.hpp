// The forward kernels' per-thread workspace as a named layout: ForwardLayout sizes every
// buffer from the plan, ForwardWorkspace allocates them, the plan reports their bytes
// (forward_workspace_bytes), and ForwardWorkspaces hands a call its threads' workspaces,
// kept from earlier calls where it can. Each buffer has one role; the kernels never carve
// one buffer out of another.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <hwy/aligned_allocator.h>

#include "flashattn/counters.hpp"
#include "flashattn/online_softmax.hpp"
#include "flashattn/plan.hpp"
#include "flashattn/problem.hpp"
#include "src/cpu/kernels/packed_head.hpp"
#include "src/cpu/kernels/strip_keys.hpp"

namespace flashattn::cpu {

// The decode kernel's view of a block of keys: key c's K and V rows of kv head 0 (the
// other heads follow at the views' head strides) and, for quantized pools, its scales and
// (u8 codes) zero points of kv head 0 (null otherwise; the other heads follow at the
// scales' head strides). Resolved once per key for every kv head; one array per field, so
// that a loop over keys reads each with an 8-byte stride.
struct DecodeKeys {
  std::vector<const unsigned char*> k, v;
  std::vector<const float*> k_descale, v_descale, k_zero_point, v_zero_point;
  void resize(std::size_t n) {
    k.resize(n);
    v.resize(n);
    k_descale.resize(n);
    v_descale.resize(n);
    k_zero_point.resize(n);
    v_zero_point.resize(n);
  }
  static constexpr std::size_t kBytesPerKey = 2 * sizeof(const unsigned char*) + 4 * sizeof(const float*);
};

// Keys whose K and V rows (every kv head: 2 KiB each at 8 heads × D 128 bf16) the decode
// kernel prefetches ahead of the keys it scores: K because it reads four keys' rows at once,
// four streams the hardware prefetcher does not follow; V because P·V reads it only after
// the block's softmax. On the Zen 3 of docs/performance.md distances of 0 to 16 keys, V
// alone, measured alike within the noise; on the Sapphire Rapids Xeon of 2026-12, prefetching
// K with V took bf16 decode from 6.6 to 5.0–5.3 ms, and distances of 8, 16 and 32 keys
// measured alike within the noise.
constexpr std::int64_t kDecodePrefetchKeys = 16;

// Elements of each buffer of ForwardWorkspace for a plan (0: the kernel does not use it).
// "rows" are the rows a work item holds: block_q, or (decode) block_q per kv head.
struct ForwardLayout {
  ForwardLayout(const CpuForwardPlan& plan, const AttentionProblem& problem);
  std::size_t bytes() const;
  // Every buffer at least as large as `other`'s: a workspace for the items of both plans.
  void widen(const ForwardLayout& other);

  std::size_t rows = 0;
  // float32
  std::size_t q_tile = 0, k_rows = 0, v_row = 0, s_tile = 0, o_acc = 0, k_packed = 0, v_packed = 0;
  std::size_t q_rows = 0, q_units = 0, v_units = 0, descales = 0;  // decode
  // bf16 (tiled_bf16)
  std::size_t q_bf16 = 0, p_bf16 = 0, k_pairs = 0, v_pairs = 0, k_pair_rows = 0, v_pair_rows = 0;
  std::size_t strips = 0;       // StripKeys (tiled)
  std::size_t decode_keys = 0;  // DecodeKeys entries (decode)
};

// Per-thread scratch memory, sized by the plan (ForwardLayout). The packed K/V of one
// (batch, kv head) stays cached across the work items of that head: a thread packs each
// head once.
struct ForwardWorkspace {
  explicit ForwardWorkspace(const CpuForwardPlan& plan, const AttentionProblem& problem);
  explicit ForwardWorkspace(const ForwardLayout& layout);

  ForwardLayout layout;  // what the buffers hold room for

  // The Q tile: (tiled) (block_q, head_dim), pre-scaled; (decode) the Q panels, (heads_kv ·
  // block_q, head_dim rounded to two vectors) — decode_fp16: the same panels in halves.
  hwy::AlignedFreeUniquePtr<float[]> q_tile;
  // (tiled) while packing, converted: the K rows of one panel, (micro_cols, head_dim rounded up
  // to 32), and one V row, (head_dim_v_padded)
  hwy::AlignedFreeUniquePtr<float[]> k_rows, v_row;
  hwy::AlignedFreeUniquePtr<float[]> s_tile;        // (rows, block_k): S, then P in place
  hwy::AlignedFreeUniquePtr<float[]> o_acc;         // (rows, head_dim_v_padded): õ
  // (tiled) k tiles of Kᵀ, each as contiguous panels of kMicroCols keys, (head_dim, kMicroCols)
  // each; v: k tiles of V, each as contiguous panels of kMicroCols columns, (block_k,
  // kMicroCols) each (Fp32Products::Pack in tiled_forward.cpp)
  hwy::AlignedFreeUniquePtr<float[]> k_packed;  // k_tiles · head_dim · block_k floats
  hwy::AlignedFreeUniquePtr<float[]> v_packed;  // k_tiles · block_k · head_dim_v_padded floats
  // (decode) Q rows in row order as loaded, before they go into panels (four: decode_fp16);
  // (decode_fp16) what each row's scores are multiplied by (rows) and each kv head's P·V
  // sums (heads_kv); (decode, int8 cache) q_units then holds each row's ΣQ (rows) and what
  // V's zero points take from each row's õ (rows); (decode, quantized cache) a key block's
  // per-key factors (block_k each): FP8 descales, K's then V's; int8: K's scales and
  // zero points, V's scales and zero points, then (the narrow products) K's zero·scale.
  hwy::AlignedFreeUniquePtr<float[]> q_rows, q_units, v_units, descales;
  std::vector<OnlineSoftmaxState> states;  // (rows): m and ℓ of each row
  std::vector<std::int32_t> rescales;      // (rows): rescales of each row (counters, rescale_counts)
  std::vector<StripKeys> strip_keys;       // (rows / micro_rows): each row strip's span of the current tile
  // (tiled) per row strip, whether no product has written its õ rows yet: its first P·V
  // stores instead of adding to zeros (no fill of õ per work item).
  std::vector<std::uint8_t> strip_fresh;
  // (tiled, float32 products) whether the tile's last strip holds at most kTailRows real rows
  // and so runs the half-height micro-tile: its other kMicroRows − kTailRows rows are neither
  // computed nor read.
  bool half_tail = false;
  // (tiled_bf16) bf16 operands of the VDPBF16PS micro-kernel (bf16_dot.hpp), all with pairs
  // along the products' depth: Q rows unscaled, head_dim rounded up to even (q_bf16, block_q
  // rows); P rounded, (block_q, block_k); k tiles of K, each as panels of kMicroCols keys,
  // (head_dim_pairs, kMicroCols, 2) each; k tiles of V, each as panels of kMicroCols columns,
  // (block_k / 2, kMicroCols, 2) each. The float32 Q tile and packed K/V are unused then.
  // k_pair_rows: while packing, the K rows of one panel as stored, (micro_cols, head_dim
  // rounded up to 32); v_pair_rows: the V rows of one pair of keys, (2, head_dim_v_padded).
  hwy::AlignedFreeUniquePtr<std::uint16_t[]> q_bf16, p_bf16, k_pairs, v_pairs, k_pair_rows, v_pair_rows;
  DecodeKeys decode_keys;  // (block_k + kDecodePrefetchKeys): a key block's rows (decode)
  PackedHead packed;       // which head k/v buffers hold, and how much of it
  KernelCounters counters;  // this thread's share of the call's counts (counters.hpp)
};

// Bytes ForwardWorkspace allocates for this plan (the plan reports it).
std::size_t forward_workspace_bytes(const CpuForwardPlan& plan, const AttentionProblem& problem);

// Forward workspaces kept from one call for the next. A new workspace's buffers are fresh
// pages, each faulted in and zeroed by the kernel on its first touch: the packed K/V alone
// are keys · (head_dim + head_dim_v_padded) floats a thread, 4 MiB at 4096 keys and D = 128,
// and issue 23's shared-prefix step faulted 2,300 pages a call, ~3 ms of CPU beside ~48 of
// attention (perf, Xeon of docs/performance.md, 2026-12-03). A call takes its workspaces
// before its threads start (so running out of memory is the caller's Error) and gives them
// back when it ends, even by an exception; concurrent calls take different ones. A kept
// workspace may be larger than the plan's workspace_bytes_per_thread: up to the largest
// layout its earlier calls needed, within kKeptBytes.
class ForwardWorkspaces {
 public:
  // `count` workspaces, each with room for `layout`: kept ones first (one too small is
  // replaced by one with room for both layouts, so that calls that alternate two layouts
  // stop allocating), then new ones. Counters zeroed, nothing packed.
  ForwardWorkspaces(const ForwardLayout& layout, int count);
  ~ForwardWorkspaces();
  ForwardWorkspaces(const ForwardWorkspaces&) = delete;
  ForwardWorkspaces& operator=(const ForwardWorkspaces&) = delete;

  ForwardWorkspace& operator[](std::size_t i) { return *held_[i]; }
  const std::vector<std::unique_ptr<ForwardWorkspace>>& all() const { return held_; }

  // What is kept at most: workspaces beyond kKeptBytes each (their calls' work dwarfs their
  // page faults: 8192 keys at D = 128 is 8 MiB) or beyond kKeptTotalBytes together (8 of
  // those: two per core on a 4-core machine) are freed when given back.
  static constexpr std::size_t kKeptBytes = std::size_t{16} << 20;
  static constexpr std::size_t kKeptTotalBytes = std::size_t{128} << 20;

 private:
  std::vector<std::unique_ptr<ForwardWorkspace>> held_;
};

}  // namespace flashattn::cpu
