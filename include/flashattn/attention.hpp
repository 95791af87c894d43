// The public attention entry points.
//
// Thread safety: every function may be called from many threads at once. The library keeps
// no mutable global state (beyond Highway's one-time choice of SIMD target); each call
// allocates its own workspace and runs its own OpenMP team. Inputs are only read, so
// concurrent calls may share them; outputs must not be shared between concurrent calls.
#pragma once

#include <string>

#include "flashattn/fp8.hpp"
#include "flashattn/kv_quant.hpp"
#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn {

// Exact attention, FlashAttention layout:
//   q   (batch, seqlen_q, heads_q,  head_dim)
//   k   (batch, seqlen_k, heads_kv, head_dim)
//   v   (batch, seqlen_k, heads_kv, head_dim_v)
//   out (batch, seqlen_q, heads_q,  head_dim_v)  same dtype as q
//   lse (batch, heads_q, seqlen_q)               float32, natural-log log-sum-exp of
//                                                each scaled score row
// heads_q must be a multiple of heads_kv (grouped / multi-query attention). Any strides
// are accepted as long as the last dimension is contiguous. Throws flashattn::Error on
// invalid input; writes nothing outside out and lse.
void forward(const TensorView& q, const TensorView& k, const TensorView& v,
             const MutableTensorView& out, const MutableTensorView& lse,
             const AttentionOptions& options = {});

struct ForwardResult {
  Tensor out;  // (batch, seqlen_q, heads_q, head_dim_v), q's dtype
  Tensor lse;  // (batch, heads_q, seqlen_q), float32
};
// Convenience overload that allocates its outputs.
ForwardResult forward(const TensorView& q, const TensorView& k, const TensorView& v,
                      const AttentionOptions& options = {});

// Gradients of Σ dout ∘ out with respect to q, k and v (docs/algorithm.md §2, §3, §5). P is
// recomputed tile by tile as exp(S·scale − lse) from the forward's lse; nothing
// O(seqlen_q·seqlen_k) is allocated.
//   dout (batch, seqlen_q, heads_q, head_dim_v)  same dtype and shape as out
//   out, lse                                     as returned by forward
//   dq, dk, dv                                   shapes and dtype of q, k, v
// For grouped-query attention dk/dv of a kv head sum the contributions of every q head
// that shares it. options.deterministic makes the result bit-identical for every run and
// thread count.
void backward(const TensorView& dout, const TensorView& q, const TensorView& k,
              const TensorView& v, const TensorView& out, const TensorView& lse,
              const MutableTensorView& dq, const MutableTensorView& dk,
              const MutableTensorView& dv, const AttentionOptions& options = {});

struct BackwardResult {
  Tensor dq, dk, dv;
};
// Convenience overload that allocates its outputs.
BackwardResult backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& out, const TensorView& lse,
                        const AttentionOptions& options = {});

// Variable-length packed batches (upstream's flash_attn_varlen_func): the sequences of a
// batch are concatenated along the token dimension and sequence b holds tokens
// [cu_seqlens[b], cu_seqlens[b + 1]); it attends only within itself. The forward runs the
// whole batch in one parallel region — every (sequence, Q tile, key split) one work item, the
// longest first — with each sequence planned on its own, so a sequence's out and lse are
// bit-identical alone, in any batch and on any thread count.
//   q (total_q, heads_q, head_dim), k (total_k, heads_kv, head_dim),
//   v (total_k, heads_kv, head_dim_v), out (total_q, heads_q, head_dim_v), lse (heads_q, total_q)
struct VarlenSeqlens {
  TensorView cu_seqlens_q;  // int32 (batch + 1): 0, ..., total_q, non-decreasing
  TensorView cu_seqlens_k;  // int32 (batch + 1): 0, ..., total_k, non-decreasing
  std::int64_t max_seqlen_q = 0;  // >= every query length
  std::int64_t max_seqlen_k = 0;  // >= every key length
};

void forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                    const VarlenSeqlens& seqlens, const MutableTensorView& out,
                    const MutableTensorView& lse, const AttentionOptions& options = {});
ForwardResult forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                             const VarlenSeqlens& seqlens, const AttentionOptions& options = {});

void backward_varlen(const TensorView& dout, const TensorView& q, const TensorView& k,
                     const TensorView& v, const TensorView& out, const TensorView& lse,
                     const VarlenSeqlens& seqlens, const MutableTensorView& dq,
                     const MutableTensorView& dk, const MutableTensorView& dv,
                     const AttentionOptions& options = {});
BackwardResult backward_varlen(const TensorView& dout, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& out, const TensorView& lse,
                               const VarlenSeqlens& seqlens, const AttentionOptions& options = {});

// Paged variable-length batches, the serving call (upstream's flash_attn_varlen_func with
// block_table, and FA3's seqused_k): sequence b has the query rows [cu_seqlens_q[b],
// cu_seqlens_q[b + 1]) of the packed q — any number: decode rows (1), prefill chunks,
// none — and seqused_k[b] keys, read in place from the page pools: key j is row
// j % page_size of page block_table[b, j / page_size]. Causal is bottom-right aligned per
// sequence: query row i of a sequence with q_len rows and k_len keys sees keys
// j <= i + k_len − q_len. ALiBi slopes may be (heads_q) or (batch, heads_q).
//   q (total_q, heads_q, head_dim), out (total_q, heads_q, head_dim_v), lse (heads_q, total_q)
// The pools hold q's dtype, or u8 codes read as k_quant and v_quant say (kv_quant.hpp): FP8
// e4m3 codes with descales as KvCache's k_scale and v_scale, float32 (num_pages, heads_kv),
// or int8 codes (u8 with k_zero_point / v_zero_point, or s8) with scales per (page, kv head)
// or per token, (num_pages, page_size, heads_kv); every scale read finite and positive,
// every zero point read finite.
// The whole batch runs in one parallel region (docs/algorithm.md §3, work partitioning),
// and a sequence's plan — kernel, tiles, key splits — depends on its own lengths and the
// options alone: its out and lse are bit-identical alone, in any batch, on any number of
// threads. Nothing is appended: the pools are only read (forward_with_kvcache with
// cu_seqlens_q appends each sequence's new tokens, then runs the batch this way).
//
// Shared prefixes (cascade attention, FlashInfer's two-level cascade): sequences that continue
// one prefix — a system prompt shared by many requests — name it in prefix_idx, and their own
// block_table row and seqused_k then cover their suffix alone: sequence b with prefix p
// attends to the prefix_seqused_k[p] keys of prefix p (key j on page prefix_block_table[p,
// j / page_size]) followed by its own seqused_k[b]. The prefix's keys and values are read once
// for the query rows of all its sequences — one problem over all their rows, whose q heads
// share their kv head's K/V tiles — and that partial result is merged with each sequence's
// own by merge_attention_states' merge, in the same parallel region, from each row's softmax
// state (max and ℓ apart, not one float32 lse, which loses log ℓ where the scores are huge):
// out and lse equal the unshared call over the concatenated keys within float32 rounding of
// the merge.
// Rules, each an Error naming the argument: the sequences of one prefix are consecutive in the
// batch (their query rows are one block of q, as FlashInfer's per-level qo_indptr); a sequence's
// pages are not its prefix's pages; under causal (bottom-right over prefix + suffix) every query
// row sees the whole prefix, so seqused_k[b] >= its query rows − 1; window_size, ALiBi and
// dropout, which would need each row's absolute position in the prefix pass, are rejected.
// Sinks join each sequence's own pass (once per row). A sequence's result depends on its
// prefix's other sequences (the prefix pass is planned for all their rows), never on the rest
// of the batch or the thread count.
struct PagedKvBatch {
  TensorView k_cache, v_cache;  // (num_pages, page_size, heads_kv, head_dim / head_dim_v)
  TensorView block_table;       // int32 (batch, max_pages): each sequence's pages in order
  TensorView seqused_k;         // int32 (batch): keys of each sequence, <= max_pages · page_size
  TensorView k_scale, v_scale;  // quantized (u8) pools only
  KvQuant k_quant, v_quant;     // how each u8 pool reads: e4m3 (default), u8 or s8 codes
  TensorView k_zero_point, v_zero_point;  // u8 codes only: the scales' shape and strides
  // Shared prefixes: all three, or none.
  TensorView prefix_block_table;  // int32 (num_prefixes, max_prefix_pages): each prefix's pages in order
  TensorView prefix_seqused_k;    // int32 (num_prefixes): keys of each prefix, <= max_prefix_pages · page_size
  TensorView prefix_idx;          // int32 (batch): the prefix sequence b continues, or −1 for none
};

void forward_varlen_paged(const TensorView& q, const TensorView& cu_seqlens_q, std::int64_t max_seqlen_q,
                          const PagedKvBatch& kv, const MutableTensorView& out, const MutableTensorView& lse,
                          const AttentionOptions& options = {});
ForwardResult forward_varlen_paged(const TensorView& q, const TensorView& cu_seqlens_q, std::int64_t max_seqlen_q,
                                   const PagedKvBatch& kv, const AttentionOptions& options = {});

// The KV cache of an inference engine (upstream's flash_attn_with_kvcache). The cache is
// contiguous (batch_cache, seqlen_cache, heads_kv, dim) or paged (num_pages, page_size,
// heads_kv, dim) with an int32 block_table (batch, max_pages_per_seq) naming each
// sequence's pages in order. Sequence b holds cache_seqlens[b] tokens; new tokens k, v
// (batch, seqlen_new, heads_kv, dim) are written into the cache in place at positions
// cache_seqlens[b]..., then q attends to all cache_seqlens[b] + seqlen_new of them (causal is
// bottom-right aligned: new queries see the cache and the new tokens up to themselves).
// Rotary embeddings (rotary_cos, rotary_sin of shape (positions, rotary_dim / 2)) rotate the
// first rotary_dim features of the new keys at their positions and of q at positions
// cache_seqlens[b] + i when causal or windowed, else all at cache_seqlens[b] (as upstream);
// interleaved pairs (2i, 2i+1) or GPT-NeoX halves (i, i + rotary_dim/2). A window bound of at
// least the cache's capacity (seqlen_cache, or max_pages·page_size) counts as unbounded, as
// upstream's: such a call is not windowed.
// Left padding (cache_leftpad, contiguous caches only, as upstream): sequence b's tokens
// occupy slots [cache_leftpad[b], cache_seqlens[b]) of its cache row; the slots before are
// padding, never attended. Positions stay slot numbers (rotary angles are taken at the
// slot, as upstream), while causal, window and ALiBi see the logical sequence of
// cache_seqlens[b] − cache_leftpad[b] + seqlen_new keys (both ends align, so bottom-right
// causal is unchanged).
struct KvCache {
  MutableTensorView k_cache, v_cache;
  TensorView block_table;      // int32 (batch, max_pages): paged when set
  TensorView cache_seqlens;    // int32 (batch); unset: every sequence fills the cache
  TensorView cache_batch_idx;  // int32 (batch): cache row of each sequence (contiguous only)
  TensorView k, v;             // new tokens to append, or unset
  TensorView rotary_cos, rotary_sin;
  bool rotary_interleaved = true;
  TensorView cache_leftpad;  // int32 (batch): first slot of each sequence (contiguous only)
  // FP8 e4m3 cache: k_cache and v_cache of dtype u8 hold e4m3 codes, and these float32
  // descales (pages or batch_cache, heads_kv) turn them into values: value = code · descale,
  // one descale per (page, kv head) — per (cache row, kv head) for a contiguous cache.
  // Appending quantizes the new tokens (round to nearest even, saturating) and updates the
  // descales: a page's descale starts from its first append and only grows, by powers of
  // two, re-encoding the page's earlier tokens when it does; every stored x reads back as
  // x̂ with |x̂ − x| ≤ 2^-4·|x| + 2^-9·descale, descale < 2·(largest |x| of the page)/448.
  // Pages that already hold tokens must have finite positive descales; new k, v must be
  // finite (e4m3 has no infinity). Code 0x7F/0xFF (NaN) is not a cache value: appends never
  // write it, and a cache filled by the caller must not hold it (the float32 decode kernel
  // reads it as NaN, decode_fp16 and decode_bf16 as ±480·descale; unchecked). Codes are
  // read exactly whatever the CPU's denormals-are-zero mode (MXCSR DAZ, e.g.
  // torch.set_flush_denormal(True)): subnormal codes (|value| < 2^-6·descale) included.
  MutableTensorView k_scale, v_scale;
  // int8 caches (include/flashattn/kv_quant.hpp: the formats, what an append does, the error
  // bound): k_quant and v_quant, chosen independently, say how each u8 pool reads — e4m3 as
  // above (the default), u8 codes with zero points, value = (code − zero_point)·scale, or s8
  // codes, value = code·scale — with scales (and zero points) per (page, kv head), which the
  // caller sets and appends only read, or per token, (pages or batch_cache, page_size or
  // seqlen_cache, heads_kv), which appends compute and write for the new tokens' slots. The
  // zero points (u8 only) have their scales' shape and strides.
  KvQuant k_quant, v_quant;
  MutableTensorView k_zero_point, v_zero_point;
  // A packed batch (FA3's cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q), paged caches only:
  // q (total_q, heads_q, head_dim) with int32 offsets cu_seqlens_q (batch + 1) — any number
  // of query rows per sequence, decode rows and prefill chunks mixed — and new k, v
  // (total_new, heads_kv, dim) with int32 offsets cu_seqlens_k_new (batch + 1): sequence b
  // appends its rows [cu_seqlens_k_new[b], cu_seqlens_k_new[b + 1]) at cache_seqlens[b]...,
  // rotated as above, then attends to cache_seqlens[b] plus those keys; out (total_q,
  // heads_q, head_dim_v), lse (heads_q, total_q). Every sequence is planned on its own, as in
  // forward_varlen_paged. Unset: q and k, v are (batch, seqlen, ...) as above.
  TensorView cu_seqlens_q, cu_seqlens_k_new;
  std::int64_t max_seqlen_q = 0;
};

void forward_with_kvcache(const TensorView& q, const KvCache& cache, const MutableTensorView& out,
                          const MutableTensorView& lse, const AttentionOptions& options = {});
ForwardResult forward_with_kvcache(const TensorView& q, const KvCache& cache,
                                   const AttentionOptions& options = {});

// The exact combination of partial attention results over disjoint key sets (split-KV
// decoding, cascade or distributed attention), through their log-sum-exps — the merge of
// OnlineSoftmaxState: lse = log Σ_s exp(lse_s), out = Σ_s exp(lse_s − lse)·out_s.
//   outs (splits, batch, seqlen_q, heads_q, head_dim_v) float32, each normalized
//   lses (splits, batch, heads_q, seqlen_q) float32; −∞ marks a split with no visible key
//   out (batch, seqlen_q, heads_q, head_dim_v) any floating dtype, lse (batch, heads_q, seqlen_q) float32
// Rows are merged in parallel on num_threads threads (0 = the OpenMP default); each row's
// result does not depend on the thread count.
void merge_attention_states(const TensorView& outs, const TensorView& lses,
                            const MutableTensorView& out, const MutableTensorView& lse, int num_threads = 0);

// FP8 attention (docs/algorithm.md §4): q, k, v as FP8 codes with descale factors, per tensor or per
// block of rows (see Fp8View and quantize_fp8), in the layout of forward(); out in any
// floating dtype, lse float32. Scores accumulate in float32 and P is rounded to e4m3 before
// P·V, as on an FP8 tensor core. On the CPU the FP8 values are decoded to float32 once per
// call (FP8 numerics, not FP8 speed). Bad codes (NaN; e5m2's ±∞), descales (<= 0,
// non-finite) or shapes throw Error; so does a rescale_threshold above 8 (unrescaled P ≤
// 2^threshold must fit e4m3).
void forward_fp8(const Fp8View& q, const Fp8View& k, const Fp8View& v, const MutableTensorView& out,
                 const MutableTensorView& lse, const AttentionOptions& options = {});
ForwardResult forward_fp8(const Fp8View& q, const Fp8View& k, const Fp8View& v, DType out_dtype,
                          const AttentionOptions& options = {});

// Name of the SIMD target the CPU kernels dispatch to on this machine, e.g. "AVX3".
std::string cpu_simd_target();

}  // namespace flashattn
