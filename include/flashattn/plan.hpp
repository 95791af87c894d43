// Plan, then run (docs/algorithm.md §7.4): tile sizes, thread partitioning and workspace for the
// CPU forward kernel come from one inspectable Plan computed from (problem, hardware).
// The kernel executes a Plan; the CLI and the cost model read the same Plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "flashattn/problem.hpp"

namespace flashattn {

// What the planner needs to know about the machine.
struct CpuHardware {
  std::size_t l1d_bytes = 48 * 1024;
  std::size_t l2_bytes = 1024 * 1024;
  int threads = 1;                // worker threads the plan may use
  std::string simd_target;        // Highway target the kernels dispatch to, e.g. "AVX3"
  int float_lanes = 4;            // fp32 lanes per vector of that target (the cost model's CPU entry)
  int micro_rows = 4;             // rows of the register-blocked micro-kernel
  int micro_cols = 8;             // columns (floats) of the register-blocked micro-kernel
  bool bf16_dot = false;          // the tiled_bf16 kernel can run: the CPU has AVX512-BF16 and
                                  // the dispatched target (AVX3, AVX3_DL) provides the kernel
  bool bf16_dot_fast = false;     // and its products outpace float32 FMA (AMX, or AMD's
                                  // VDPBF16PS): the bf16 kernels are planned by default
  bool amx_bf16 = false;          // and they run on AMX tiles (AMX-BF16, and Linux granted this
                                  // process the tile state)
  bool decode_fp16 = false;       // the decode_fp16 kernel can run: the CPU has AVX512-FP16
  bool decode_bf16 = false;       // the decode_bf16 kernel can run: the CPU has AVX512-BF16
  bool int8_dot = false;          // the CPU has AVX512-VNNI, on which decode_bf16 scores int8 K
                                  // codes (every CPU with AVX512-BF16 has it)
  // Decode calls over bf16 or f16 caches that read at most this many K/V bytes run the
  // decode kernel of the AVX2 target (256-bit vectors) instead of AVX-512's: set on Intel
  // CPUs dispatching to an AVX-512 target, whose 512-bit arithmetic slows the work around a
  // short call more than the wider vectors gain in it (docs/performance.md, thirty-second
  // session); 0 (never) elsewhere and where the AVX2 target is not compiled.
  std::size_t short_decode_bytes = 0;

  // Cache sizes from the OS, micro-kernel geometry from the dispatched SIMD target.
  static CpuHardware detect(int num_threads);
};

// The forward's schedule (docs/algorithm.md §3): how a problem's work is cut into work items
// and which query rows and keys each one computes. The kernels walk it, the planner counts
// its items and the cost model counts its tiles, so all three agree by construction.
struct ForwardSchedule {
  std::int64_t block_q = 0;   // Q rows per item (tiled)
  std::int64_t block_k = 0;   // keys per K/V tile
  std::int64_t q_blocks = 1;  // Q tiles per (batch, head); decode: 1
  std::int64_t splits = 1;    // split-KV: key shares per Q tile, merged by lse
  bool decode = false;        // an item is (batch, split) over every head and query (decode kernels)
  // Tiled: q heads whose rows one item computes together — 1, or every q head of a kv head
  // (pack_gqa: the item's Q tile holds block_q rows of each, so each K/V tile is streamed
  // once for the group instead of once per q head).
  std::int64_t heads_per_item = 1;
};

// One work item: query rows [row_begin, row_begin + rows) of (batch, head) — of heads
// [head, head + heads) under pack_gqa — against its
// share [key_begin, key_end) of the keys those rows see. Its key blocks start at
// first_block and are block_k apart: K/V tiles (tiled, key_begin rounded down to a tile) or
// blocks from key_begin on (decode).
struct ForwardWorkItem {
  std::int64_t batch = 0;
  std::int64_t head = 0;   // q head (pack_gqa: the first); decode: 0, the item covers every head
  std::int64_t heads = 1;  // q heads of the item's rows (tiled: schedule.heads_per_item)
  std::int64_t q_block = 0;
  std::int64_t split = 0;
  std::int64_t row_begin = 0, rows = 0;  // decode: every query, 0 and seqlen_q
  std::int64_t key_begin = 0, key_end = 0;
  std::int64_t first_block = 0;
};

// Work items of a problem under a schedule: batch · heads_q / heads_per_item · q_blocks ·
// splits, or (decode) batch · splits.
std::int64_t forward_work_items(const AttentionProblem& problem, const ForwardSchedule& schedule);

// Items are grouped by (batch, kv head): the q heads of one kv head are consecutive, so
// items [g·n, (g + 1)·n) of n = forward_items_per_kv_head read the K/V of group g alone
// (tiled; decode items read every kv head, n = splits).
std::int64_t forward_items_per_kv_head(const AttentionProblem& problem, const ForwardSchedule& schedule);

// Item `item` < forward_work_items. Items run head-major; within a head, causal Q tiles
// run longest first; the splits of one Q tile are consecutive items. Key ranges are
// non-decreasing in the row, so the rows see [first row's begin, last row's end); split s
// of S takes tiles [T·s/S, T·(s + 1)/S) of the T tiles that span it, clipped to it — or
// (decode, whose blocks start anywhere) keys [n·s/S, n·(s + 1)/S) of the n keys of it:
// shares equal to a key, so that no thread waits on a share of one tile more.
ForwardWorkItem forward_work_item(const AttentionProblem& problem, const ForwardSchedule& schedule, std::int64_t item);

struct CpuForwardPlan {
  ForwardKernel kernel = ForwardKernel::tiled;  // never automatic (options.hpp: ForwardKernel)
  std::int64_t block_q = 0;          // Q rows per work item (Br); decode: group · seqlen_q in fours (one or two: as they are), per kv head
  std::int64_t block_k = 0;          // keys per K/V tile (Bc), a multiple of micro_cols
  std::int64_t head_dim_v_padded = 0;  // Dv rounded up to micro_cols
  std::int64_t q_blocks = 0;         // per (batch, head)
  std::int64_t work_items = 0;       // batch · heads_q / heads_per_item · q_blocks · splits (decode: batch · splits)
  // tiled: 1, or heads_q / heads_kv under pack_gqa: block_q rows of each, back to back in the
  // Q tile, which is padded to whole micro-tile rows once (block_q need not be a multiple of
  // micro_rows: 4 heads of 32 rows are 132 rows on AVX2's 6-row strips, not 4 × 36)
  std::int64_t heads_per_item = 1;
  std::int64_t splits = 1;           // split-KV: key ranges per Q tile, merged by lse
  int threads = 1;
  std::size_t workspace_bytes_per_thread = 0;
  std::size_t shared_bytes = 0;      // split-KV partial outputs and softmax states (max and sum)
  // decode on the AVX2 target (CpuHardware::short_decode_bytes): hardware then holds that
  // target's name and micro-tile geometry, which the plan's sizes follow.
  bool avx2_decode = false;
  CpuHardware hardware;

  std::size_t workspace_bytes() const { return workspace_bytes_per_thread * threads + shared_bytes; }
  std::string describe() const;
  ForwardSchedule schedule() const { return {block_q, block_k, q_blocks, splits, is_decode(kernel), heads_per_item}; }
  ForwardWorkItem work_item(const AttentionProblem& problem, std::int64_t item) const {
    return forward_work_item(problem, schedule(), item);
  }
};

// The plan a call with these options runs: their num_splits, block_q and kernel, or one Q
// tile per head and no split where switches.q_tile_parallelism is off.
CpuForwardPlan plan_forward(const AttentionProblem& problem, const CpuHardware& hardware,
                            const AttentionOptions& options);

// The plans of problems that one call runs together (the sequences of a KV cache), under
// the call's options: each one's plan, except that when more than one takes a decode kernel
// and all do — they then share one parallel region — and num_splits is the planner's, keys
// split only as far as the sequences leave threads idle: ⌈2·threads / sequences⌉ shares.
std::vector<CpuForwardPlan> plan_forward_together(std::span<const AttentionProblem> problems,
                                                  const CpuHardware& hardware, const AttentionOptions& options);
// Whether plans of plan_forward_together share one parallel region.
bool plans_share_region(std::span<const CpuForwardPlan> plans);

// num_splits, block_q and kernel as AttentionOptions::num_splits, ::block_q and ::kernel
// (0 and automatic: the planner's choice). A kernel that the problem's dtypes or the
// hardware rule out is an Error naming it.
CpuForwardPlan plan_forward(const AttentionProblem& problem, const CpuHardware& hardware,
                            int num_splits = 0, std::int64_t block_q = 0,
                            ForwardKernel kernel = ForwardKernel::automatic);

// Backward: each work item owns one K/V tile of one (batch, kv head) and produces its dK
// and dV; its dQ shares go into a shared float32 accumulator — in any order by default,
// in K/V-block order when deterministic. Tile sizes never depend on the thread count, so
// deterministic results do not either.
struct CpuBackwardPlan {
  BackwardKernel kernel = BackwardKernel::tiled;  // never automatic (options.hpp: BackwardKernel)
  std::int64_t block_q = 0;            // Q rows per tile
  std::int64_t block_k = 0;            // keys per tile: a multiple of micro_rows and micro_cols
  std::int64_t head_dim_padded = 0;    // D rounded up to micro_cols
  std::int64_t head_dim_v_padded = 0;  // Dv rounded up to micro_cols
  std::int64_t q_blocks = 0;           // per (batch, head)
  std::int64_t k_blocks = 0;           // per (batch, kv head)
  std::int64_t kv_work_items = 0;      // batch · heads_kv · k_blocks
  bool deterministic = false;
  // Each thread keeps the Q and dO tiles of its current kv head's q heads as its products
  // read them (float32, Q times softmax_scale·log2e; tiled_bf16: paired and transposed too),
  // built once for all of that head's K/V tiles it runs, instead of gathering and converting
  // every Q tile again per K/V tile — where each copy
  // is within 64 MiB and all threads' together within the bytes of q and dout (or 16 MiB).
  // Off with AttentionOptions::switches.reuse_packed_kv.
  bool keep_q_rows = false;
  int threads = 1;
  std::size_t workspace_bytes_per_thread = 0;
  std::size_t shared_bytes = 0;        // rowsum(dO∘O), the float32 dQ accumulator, tickets
  CpuHardware hardware;

  std::size_t workspace_bytes() const { return workspace_bytes_per_thread * threads + shared_bytes; }
  std::string describe() const;
};

// kernel as AttentionOptions::backward_kernel: automatic is the planner's choice; a kernel
// that the problem's dtype or the hardware rule out is an Error naming it.
CpuBackwardPlan plan_backward(const AttentionProblem& problem, const CpuHardware& hardware,
                              bool deterministic, BackwardKernel kernel = BackwardKernel::automatic);

// The plans a call ran (AttentionOptions::plans_run), in the order it ran them: forward()
// and forward_fp8 one forward plan; forward_varlen, forward_with_kvcache and
// forward_varlen_paged one per sequence with query rows, in batch order (then, with shared
// prefixes, one per prefix whose sequences have query rows, in prefix order; the run order is
// the longest first); backward() one backward plan, backward_varlen one per
// sequence. A forward problem without query rows runs no plan, nor does a batch of 0. The
// CLI's measurements print these, not a plan of their own.
struct PlansRun {
  std::vector<CpuForwardPlan> forward;
  std::vector<CpuBackwardPlan> backward;
};

}  // namespace flashattn
