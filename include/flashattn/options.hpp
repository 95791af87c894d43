// Options shared by every attention entry point, named as upstream FlashAttention's
// arguments. Every variant is exact and works in forward and backward.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>

#include "flashattn/counters.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn {

struct PlansRun;  // plan.hpp

// The exponential of the forward's softmax (docs/algorithm.md §5). `exact`: a degree-6 polynomial,
// within 2 float ulps. `poly3`: Cody–Waite reduction and a cubic, relative error 7.5e-5
// (below half a bf16 ulp). `mixed`: the first exp2_poly3_fraction of each tile row's
// exponentials through poly3, the rest exact (FlashAttention-4's split between the
// exponential unit and the FMA units). `automatic`: currently exact for every dtype (why:
// docs/numerics.md).
enum class Exp2Impl : std::uint8_t { automatic, exact, poly3, mixed };
const char* to_string(Exp2Impl impl);
// Parses "auto", "exact", "poly3", "mixed"; throws Error otherwise.
Exp2Impl parse_exp2_impl(const std::string& name);

// The CPU forward kernels, selectable by name (CpuForwardPlan::kernel, plan.hpp):
// "tiled" — the FlashAttention tiling on float32 products (K, V widened at packing);
// "tiled_bf16" — the same tiling with both products on bf16 dot products from bf16 q, k and
// v — AMX tiles (TDPBF16PS) where the CPU has them, else AVX512-BF16's VDPBF16PS — P
// rounded to bf16 before P·V as upstream does; "decode" — a few query rows per kv head
// (every q head of a GQA group and every query token together) read against K and V in
// place; "decode_fp16" — decode from a quantized KV cache (FP8 e4m3 or int8 codes,
// kv_quant.hpp) on AVX512-FP16: half-precision products and short half-precision partial
// sums, moved to float32 every few terms (errors a few percent of the codes' own quantization
// error; src/cpu/kernels/fp16_decode.hpp); "decode_bf16" — the same on AVX512-BF16 dot
// products (codes widened exactly to bf16, q and P rounded to bf16, sums in float32;
// src/cpu/kernels/bf16_decode.hpp; int8 K codes scored on AVX512-VNNI's integer products,
// int8_dot.hpp), for CPUs without AVX512-FP16 such as AMD Zen 4.
// `automatic` lets the planner choose: for at most 16 rows per kv head where the cache is
// quantized (FP8 or int8 codes), decode_fp16 where head_dim ≤ 512 (its half-precision bound)
// and the CPU has AVX512-FP16, else decode_bf16 where the CPU has AVX512-BF16, else decode
// (decode for unquantized caches); for more rows
// tiled_bf16 where the inputs are bf16, the CPU and SIMD target have AVX512-BF16 and its
// products outpace float32 FMA (AMX; AMD Zen 5's VDPBF16PS; not VDPBF16PS alone on Intel,
// where it has half FMA's FLOP rate), else tiled.
enum class ForwardKernel : std::uint8_t { automatic, tiled, tiled_bf16, decode, decode_fp16, decode_bf16 };
const char* to_string(ForwardKernel kernel);
// Parses "auto", "tiled", "tiled_bf16", "decode", "decode_fp16", "decode_bf16"; throws Error otherwise.
ForwardKernel parse_forward_kernel(const std::string& name);
// decode, decode_fp16 or decode_bf16: the kernels whose work item is (batch, key split) over
// every kv head.
constexpr bool is_decode(ForwardKernel kernel) {
  return kernel == ForwardKernel::decode || kernel == ForwardKernel::decode_fp16 ||
         kernel == ForwardKernel::decode_bf16;
}

// The CPU backward kernels, selectable by name (CpuBackwardPlan::kernel, plan.hpp): "tiled"
// — recomputation per pair of tiles on float32 products; "tiled_bf16" — the same tiling with
// all five products (S, dP, dV, dK, dQ) on bf16 dot products (AMX or VDPBF16PS, as the
// forward's) from bf16 inputs, P and dS rounded to bf16 before they multiply, as upstream
// rounds them. `automatic`: tiled_bf16 where the forward's automatic choice would take it
// (bf16 inputs, AVX512-BF16, products that outpace float32 FMA), else tiled.
enum class BackwardKernel : std::uint8_t { automatic, tiled, tiled_bf16 };
const char* to_string(BackwardKernel kernel);
// Parses "auto", "tiled", "tiled_bf16"; throws Error otherwise.
BackwardKernel parse_backward_kernel(const std::string& name);

// Where the diagonal of the (seqlen_q, seqlen_k) score matrix lies, the key position of
// query row i that causal, window_size and ALiBi measure from (docs/algorithm.md §6):
// `bottom_right` (upstream FlashAttention's): key i + seqlen_k − seqlen_q, the queries being
// the last seqlen_q positions of the keys' sequence; `top_left` (PyTorch SDPA's is_causal,
// torch.tril): key i, the queries being its first positions. They agree when seqlen_q ==
// seqlen_k.
enum class CausalAlignment : std::uint8_t { bottom_right, top_left };
const char* to_string(CausalAlignment alignment);
// Parses "bottom_right", "top_left"; throws Error otherwise.
CausalAlignment parse_causal_alignment(const std::string& name);
// User-defined score and mask functions (FlexAttention's score_mod and mask_mod), type-erased
// so that the library's kernels, compiled per SIMD target, can call the user's code: build
// one with include/flashattn/flex.hpp (FlexMods::hook), which instantiates these functions
// in the user's translation unit. docs/algorithm.md §6.2.
//
// The kernels call `apply` once per span of a score row (one row of a tile, or the part of
// it inside one block of `block_mask`), never per score: the per-score loop is the user's,
// inlined and vectorisable there. Threads call it concurrently: the functors must be thread-safe.
struct ScoreSpan {
  // n scores of query q_idx against keys kv_begin .. kv_begin + n − 1, in log2 units
  // (natural · log2 e, as the kernels keep them), after softmax_scale, softcap, ALiBi and
  // attn_mask; −∞ where the key is already hidden (it must stay −∞). `apply` replaces
  // them by score_mod's, and by −∞ where mask_mod hides the key.
  float* scores;
  // Backward only (null in the forward): the n factors d(score)/d(scaled score) so far, to
  // be multiplied by d score_mod / d score (the chain rule).
  float* grad;
  std::int64_t batch, head, q_idx, kv_begin, n;
  bool mask;  // evaluate mask_mod: false inside a block that block_mask calls full
};
// A block of ScoreHook::block_mask: every key of it hidden (the tile is skipped), some, or
// none (mask_mod is not evaluated).
enum class ScoreBlock : std::uint8_t { empty = 0, partial = 1, full = 2 };
// A block's state from whether some of its keys are kept and some hidden (a block of
// smaller blocks: kept = some is not empty, hidden = some is not full).
constexpr ScoreBlock classify_block(bool any_kept, bool any_hidden) {
  return !any_kept ? ScoreBlock::empty : any_hidden ? ScoreBlock::partial : ScoreBlock::full;
}
struct ScoreHook {
  // The kernels' call (null: no hook). `mods` is passed back to every function. It runs on
  // the library's threads (OpenMP) and must not throw: an exception would end the process.
  void (*apply)(const void* mods, const ScoreSpan& span) = nullptr;
  // Optional: the first exception apply caught during the call (null: none), taken and
  // rethrown by forward() and backward() once the call's threads are done (FlexMods keeps
  // what its mods throw this way).
  std::exception_ptr (*take_error)(const void* mods) = nullptr;
  // Optional, with take_error: a call holds `mods` from before its run to after its rethrow
  // (enter, then leave); enter returns false while another call holds them — an Error then,
  // as take_error's slot is the object's: concurrent calls would take each other's exception
  // (one failing for the other's mod, the other returning unspecified outputs silently).
  bool (*enter)(const void* mods) = nullptr;
  void (*leave)(const void* mods) = nullptr;
  // The float64 reference's per-score forms, in natural units: score_mod (null: none),
  // mask_mod (null: none; true keeps the key) and d score_mod / d score (null: the
  // backward rejects the hook).
  double (*score)(const void* mods, double s, std::int64_t b, std::int64_t h, std::int64_t q_idx,
                  std::int64_t kv_idx) = nullptr;
  bool (*mask)(const void* mods, std::int64_t b, std::int64_t h, std::int64_t q_idx, std::int64_t kv_idx) = nullptr;
  double (*derivative)(const void* mods, double s, std::int64_t b, std::int64_t h, std::int64_t q_idx,
                       std::int64_t kv_idx) = nullptr;
  const void* mods = nullptr;
  // Optional (flex.hpp: create_block_mask): u8 ScoreBlock values of shape (1 or batch,
  // 1 or heads_q, ceil(seqlen_q / block_size), ceil(seqlen_k / block_size)), a size-1 dim
  // shared by every batch element / head. It is a promise about mask_mod, as FlexAttention's
  // BlockMask: keys of an empty block are hidden without asking mask_mod, keys of a full block
  // kept without asking it. Unset: every block partial.
  TensorView block_mask;
  std::int64_t block_size = 0;
  // Optional, with block_mask (create_block_mask keeps them within a budget linear in the
  // sequence lengths): mask_mod's values on block_mask's partial blocks, so that the kernels
  // read one byte per score there instead of calling mask_mod. partial_slots: i32 of
  // block_mask's shape, each block's slot in partial_keep (−1: none, mask_mod is called);
  // partial_keep: u8 (slots, block_size, block_size), contiguous, row-major within a block
  // (query, key), non-zero where mask_mod keeps the key. A promise about mask_mod, as
  // block_mask is.
  TensorView partial_slots;
  TensorView partial_keep;
};

// The most worker threads a call takes (AttentionOptions::num_threads, merge_attention_states):
// far beyond any machine's cores, well below what makes the OpenMP runtime fail to create a
// team (it ends the process) or a workspace per thread exhaust memory.
inline constexpr int kMaxThreads = 4096;

struct AttentionOptions {
  // Scale applied to Q·Kᵀ before the softmax; 1/sqrt(head_dim) when unset.
  std::optional<float> softmax_scale;
  // Causal mask: query i sees key j iff j <= diagonal(i), where diagonal(i) = i + seqlen_k −
  // seqlen_q (causal_alignment bottom_right, the default, as upstream) or i (top_left, as
  // SDPA's is_causal).
  bool causal = false;
  // Sliding window (local attention): query i sees keys j with
  //   diagonal(i) − left <= j <= diagonal(i) + right;  −1 means unbounded on that side.
  // causal is the same as right = 0. K/V tiles entirely outside the window are skipped.
  struct WindowSize {
    std::int64_t left = -1;
    std::int64_t right = -1;
  } window_size;
  // The diagonal of causal, window_size and ALiBi (see CausalAlignment). top_left is taken by
  // forward() / backward() (every CPU kernel, the reference and the cost
  // model); varlen, paged, KV cache, FP8, the ring and CUDA reject it by name.
  CausalAlignment causal_alignment = CausalAlignment::bottom_right;
  // Logit soft-capping: scores become softcap·tanh(s / softcap) before the softmax
  // (s already scaled); 0 disables it.
  float softcap = 0.0f;
  // ALiBi: adds −slope·|diagonal(i) − j| to score (i, j); float32 slopes of shape
  // (heads_q) or (batch, heads_q). Unset (null data) disables it.
  TensorView alibi_slopes;
  // Learnable attention sinks (gpt-oss `sinks`; FA4 `learnable_sink`, vLLM `s_aux`): float32
  // logits of shape (heads_q), one per q head, that join every row's softmax denominator
  // with no value: o_i = Σ_j e^{s_ij} v_j / (Σ_j e^{s_ij} + e^{sink_h}). A sink is already a
  // logit: neither softmax_scale nor softcap nor ALiBi touches it. lse includes it
  // (lse_i = log(Σ_j e^{s_ij} + e^{sink_h})); a row without visible keys gives o = 0 and
  // lse = sink_h. Unset (null data) disables it. docs/algorithm.md §"Attention sinks".
  TensorView sinks;
  // Dropout on the attention probabilities with probability dropout_p; kept weights are
  // scaled by 1/(1 − dropout_p). The mask is a pure function of (seed, offset, batch,
  // head, row, column) — see dropout_keep() — so it does not depend on tiling or threads
  // and is the same in forward and backward.
  float dropout_p = 0.0f;
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  // Block-sparse attention: u8 mask of shape (ceil(Sq / block), ceil(Sk / block)) shared by
  // every batch and head; score (i, j) is kept only where block_mask[i / block][j / block]
  // is non-zero. K/V tiles whose blocks are all masked are skipped. Unset disables it.
  TensorView block_mask;
  std::int64_t block_mask_block_size = 0;
  // Dense mask or additive bias (SDPA's attn_mask), rank 4, broadcastable over
  // (batch, heads_q, seqlen_q, seqlen_k): each dim is its size or 1 (a size-1 dim is read
  // once, never expanded; strides of size-1 dims are ignored). u8 (0 = hidden, non-zero =
  // kept, as SDPA's boolean mask: true keeps): score (i, j) is hidden where false; a tile
  // whose mask block is all false is skipped, one all true is not read (a per-call summary,
  // one pass over the mask; docs/algorithm.md §6). f32, bf16 or f16: added to the score
  // after softmax_scale, softcap and ALiBi (s = softcap·tanh(scale·q·k / softcap) − ALiBi
  // + bias; SDPA adds it to the scaled score, which is the same without softcap); −∞
  // entries hide their key, and only they: a finite bias beyond ±2.35e38 (float32's largest
  // over log2 e: the kernels add bias·log2 e) counts as ±2.35e38, so a row biased
  // finfo(float32).min everywhere weighs its keys alike. A row left without visible keys
  // gives o = 0 and lse = −∞ (or the sink). Combines with every other variant. Unset (null
  // data) disables it. Supported by attention_forward / attention_backward on the CPU (not
  // on CUDA, varlen, KV cache, FP8 or the ring, which reject it by name).
  TensorView attn_mask;
  // User-defined score_mod and mask_mod (see ScoreHook; built by flex.hpp), applied after
  // attn_mask: s = score_mod(softcap·tanh(scale·q·k / softcap) − ALiBi + bias, b, h, i, j),
  // and −∞ where mask_mod(b, h, i, j) is false (or the block is empty). Combines with every
  // other variant; the backward needs score_mod's derivative (ScoreHook::derivative).
  // Supported by attention_forward / attention_backward on the CPU (tiled and decode
  // kernels); CUDA, varlen, KV cache, paged, FP8 and the ring reject it by name.
  ScoreHook score_hook;
  // Worker threads; 0 means the OpenMP default (all cores); at most kMaxThreads.
  int num_threads = 0;
  // Forward only, split-KV ("flash-decoding"): the keys of every (batch, head, Q tile) are
  // split into this many parts that run in parallel and are merged exactly through their
  // log-sum-exps (merge_attention_states). 0 chooses from the problem and the thread
  // count (splits only when there are fewer Q tiles than threads, as in decoding, and never
  // on one thread); 1 never.
  // When the decode kernel runs (few query rows per kv head: plan.kernel == decode), a split
  // is a chunk of one batch element's keys read for every kv head, so this counts key chunks
  // per batch element.
  int num_splits = 0;
  // Backward only: bit-identical dq, dk, dv on every run and for every thread count: the
  // dQ shares of the K/V tiles are added in K/V-block order (a ticket per Q tile) instead
  // of as they finish. Costs waiting, not arithmetic.
  bool deterministic = false;
  // Backward only, with sinks: when set, float32 (heads_q) receives the sinks' gradient
  // dsinks_h = −Σ_{b,i} e^{sink_h − lse_{b,h,i}}·D_{b,h,i}, D = rowsum(dO ∘ O), summed in a
  // fixed order (bit-identical for every thread count). Unset: not computed.
  MutableTensorView dsinks;
  // Backward only, with a float attn_mask (a bias): when set, float32 of attn_mask's shape
  // receives the bias gradient dbias = dS, dS_ij = P_ij·(dP_ij − D_i) (dP after dropout's
  // weights): the gradient of the score after the mask step, before softcap's and
  // softmax_scale's chain rule — summed over attn_mask's size-1 (broadcast) dims, in a
  // fixed order (bit-identical for every thread count). float32 whatever the bias's dtype
  // (the sums over broadcast dims stay in float32; convert it if you want the bias's dtype).
  // Set without a float attn_mask, of another shape or dtype, or overlapping an input or
  // another output, or together with a score_hook (not supported): an Error. Unset (null
  // data): not computed.
  MutableTensorView dbias;
  // Backward only: the gradient of a loss with respect to lse, float32 of lse's shape —
  // (batch, heads_q, seqlen_q), or (heads_q, total_q) for backward_varlen — added to dq, dk
  // (and dsinks, dbias): ∂lse_i/∂s_ij = P_ij, so D_i becomes rowsum(dO ∘ O) − dlse_i. For
  // losses on lse itself (z-loss) or on a merge of partial results. Unset (null data): lse's
  // gradient is zero, as upstream FlashAttention takes it. CPU only (cuda and the ring
  // reject it by name).
  TensorView dlse;

  // Forward numerics (docs/algorithm.md §5); the backward always recomputes P with the exact exp2.
  Exp2Impl exp2 = Exp2Impl::automatic;
  float exp2_poly3_fraction = 0.5f;  // mixed only: share of each row's exponentials, [0, 1]
  // Conditional rescaling, in log2 units: the online-softmax state (m, ℓ, õ) is rescaled
  // only when a tile's maximum exceeds the reference m by more than this; otherwise m is
  // kept and that tile's probabilities are computed against it (they stay below
  // 2^threshold). The final õ/ℓ is exact for any threshold, as long as the unnormalized õ,
  // up to seqlen_k·2^threshold·max|v|, stays below float32's largest (|v| below about 1e33
  // for a million keys at the default). 0 is the classic rule (rescale whenever the maximum
  // grows); unset means 8 (a factor 256). The narrow decode kernels (decode_fp16,
  // decode_bf16) always take 0: their half-precision or bf16 P·V needs P ≤ 1.
  std::optional<float> rescale_threshold;
  // Statistics, forward() only: when set, int32 (batch, heads_q, seqlen_q) receives the
  // number of times each row's state was rescaled (its reference maximum moved after the
  // first visible key). Unset (null data) costs nothing.
  MutableTensorView rescale_counts;
  // Forward only: Q rows per tile (Br), rounded up to the micro-kernel's rows; 0 lets the
  // planner choose from the L2 size. For experiments such as the cost model's sweep of
  // traffic against tile size (flashattn tour); the result does not depend on it.
  std::int64_t block_q = 0;
  // Forward only (CPU tiled kernels), FlashAttention-3's pack_gqa: one Q tile holds block_q
  // query rows of every q head that shares a kv head (GQA/MQA), so each K/V tile is streamed
  // once for the group instead of once per q head — what calls with few query rows per head
  // (chunked prefill, speculative decoding, a shared prefix's pass) are bound by. Unset: the
  // planner packs where heads_q > heads_kv and a head's rows fill less than half a Q tile;
  // true: wherever heads_q > heads_kv; false: never. Not with alibi_slopes, dropout,
  // attn_mask or a score_hook, which differ per q head (true with one is an Error; unset
  // does not pack). The result does not depend on it (bit for bit at num_splits 1, with
  // exp2 exact or poly3 and deferred normalization — under mixed a row's split between the
  // two follows its micro-tile's span of keys, which packing may widen, and without deferred
  // normalization each tile of the span rescales õ).
  std::optional<bool> pack_gqa;
  // Forward only (CPU): the kernel to run (see ForwardKernel); a kernel the inputs or this
  // CPU cannot run is an Error naming it. `tiled` forces the float32 products on bf16
  // inputs, e.g. to compare the two tiled kernels.
  ForwardKernel kernel = ForwardKernel::automatic;
  // Backward only (CPU): the kernel to run (see BackwardKernel), as `kernel` for the forward.
  BackwardKernel backward_kernel = BackwardKernel::automatic;
  // Instrumentation: when set, the call adds what its kernels read, wrote and computed
  // to *counters (see counters.hpp). Off (null) by default.
  KernelCounters* counters = nullptr;
  // When set, *plans_run receives the plans the call ran (plan.hpp: PlansRun): its contents
  // are replaced once the call's checks have passed (a rejected call leaves it as it was).
  // The CPU backend's plans; a CUDA call with it set is an Error.
  PlansRun* plans_run = nullptr;
  // For measurement only (flashattn tour): turn one technique of the CPU kernels
  // off to time what it is worth (packing and prefetch: the tiled kernels); the result does
  // not change beyond float32 rounding.
  struct KernelSwitches {
    // Off: every Q tile packs the K/V tiles it streams again, instead of reusing the
    // thread's packed head (counted: kv_packed = k_read + v_read for whole tiles); and the
    // backward converts the Q and dO tiles of every K/V tile again, instead of reading the
    // thread's converted tiles of its kv head (CpuBackwardPlan::keep_q_rows).
    bool reuse_packed_kv = true;
    // Off: no software prefetch of the K/V rows being packed, the Q rows being loaded and
    // the output rows being stored.
    bool software_prefetch = true;
    // Off: õ is kept divided by ℓ at every key tile, as FlashAttention-1 did (one more
    // multiply per score and per output element each tile), instead of FlashAttention-2's
    // single division at the end. The result agrees to float32 rounding, not bit for bit.
    bool deferred_normalization = true;
    // Off: FlashAttention-1's partitioning — one work item per (batch, head), its query rows
    // one tile (block_q = seqlen_q) and no key splits — instead of FlashAttention-2's Q tiles
    // spread over the threads; block_q and num_splits are then ignored.
    bool q_tile_parallelism = true;
  };
  KernelSwitches switches;
};

}  // namespace flashattn
