#include "flashattn/problem.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "flashattn/error.hpp"
#include "validate.hpp"

namespace flashattn {
namespace {

constexpr const char* kQLayout = "(batch, seqlen_q, heads_q, head_dim)";
constexpr const char* kKLayout = "(batch, seqlen_k, heads_kv, head_dim)";
constexpr const char* kVLayout = "(batch, seqlen_k, heads_kv, head_dim_v)";

// Throws Error(message()) unless ok: the message is built only when it is thrown (formatting
// the floats and sizes of ~20 messages was ~1 µs of every call).
template <class Message>
void require(bool ok, const Message& message) {
  if (!ok) [[unlikely]]
    throw Error(message());
}

std::string str(std::int64_t v) { return std::to_string(v); }
std::string num(float v) {  // six significant digits: 3e+38, not std::to_string's 39 digits
  std::ostringstream s;
  s << v;
  return s.str();
}

// score_hook.block_mask: every value a ScoreBlock, read in full like the slots below.
void check_block_states(const TensorView& m) {
  const auto* data = static_cast<const std::uint8_t*>(m.data);
  for (std::int64_t a = 0; a < m.shape[0]; ++a)
    for (std::int64_t b = 0; b < m.shape[1]; ++b)
      for (std::int64_t c = 0; c < m.shape[2]; ++c)
        for (std::int64_t d = 0; d < m.shape[3]; ++d) {
          const std::uint8_t s = data[a * m.strides[0] + b * m.strides[1] + c * m.strides[2] + d * m.strides[3]];
          require(s <= static_cast<std::uint8_t>(ScoreBlock::full), [&] {
            return "score_hook.block_mask: value " + str(s) + " at (" + str(a) + ", " + str(b) + ", " + str(c) +
                   ", " + str(d) + ") is not a ScoreBlock: 0 (empty), 1 (partial) or 2 (full)";
          });
        }
}

// score_hook.partial_slots and partial_keep (options.hpp), when set: slots of block_mask's
// shape, each −1 or a slot of partial_keep (slots, bs, bs) — every value read, so that no
// slot the kernels follow lies outside partial_keep.
void check_partial_blocks(const ScoreHook& hook, const TensorView& blocks, std::int64_t bs) {
  const TensorView &slots = hook.partial_slots, &keep = hook.partial_keep;
  if (slots.data == nullptr && slots.rank == 0 && keep.data == nullptr && keep.rank == 0) return;
  detail::check_view("score_hook.partial_slots", slots, 4, "(block_mask's shape)");
  detail::check_dtype("score_hook.partial_slots", slots, DType::i32, "a slot of partial_keep per block, or -1");
  for (int d = 0; d < 4; ++d)
    require(slots.shape[d] == blocks.shape[d], [&] {
      return "score_hook.partial_slots: shape " + detail::shape_string(slots) + " is not block_mask's " +
             detail::shape_string(blocks);
    });
  detail::check_view("score_hook.partial_keep", keep, 3, "(slots, block_size, block_size)");
  detail::check_dtype("score_hook.partial_keep", keep, DType::u8, "one byte per score, non-zero keeps the key");
  require(keep.shape[1] == bs && keep.shape[2] == bs && keep.strides[2] == 1 && keep.strides[1] == bs &&
              keep.strides[0] == bs * bs,
          [&] {
            return "score_hook.partial_keep: shape " + detail::shape_string(keep) +
                   " is not a contiguous (slots, " + str(bs) + ", " + str(bs) + ") for block_size " + str(bs);
          });
  const auto* data = static_cast<const std::int32_t*>(slots.data);
  for (std::int64_t a = 0; a < slots.shape[0]; ++a)
    for (std::int64_t b = 0; b < slots.shape[1]; ++b)
      for (std::int64_t c = 0; c < slots.shape[2]; ++c)
        for (std::int64_t d = 0; d < slots.shape[3]; ++d) {
          const std::int32_t slot =
              data[a * slots.strides[0] + b * slots.strides[1] + c * slots.strides[2] + d * slots.strides[3]];
          require(slot >= -1 && slot < keep.shape[0], [&] {
            return "score_hook.partial_slots: slot " + str(slot) + " at (" + str(a) + ", " + str(b) + ", " + str(c) +
                   ", " + str(d) + ") is not -1 or below partial_keep's " + str(keep.shape[0]) + " slots";
          });
        }
}

}  // namespace

void detail::check_alibi_slopes(const TensorView& a, std::int64_t batch, std::int64_t heads_q,
                                std::int64_t distance) {
  require(a.rank == 1 || a.rank == 2,
          [&] { return "alibi_slopes: expected rank 1 (heads_q) or 2 (batch, heads_q), got rank " + str(a.rank); });
  detail::check_view("alibi_slopes", a, a.rank, a.rank == 1 ? "(heads_q)" : "(batch, heads_q)");
  detail::check_dtype("alibi_slopes", a, DType::f32, "slopes are float32");
  if (a.rank == 1)
    detail::check_shape("alibi_slopes", a, {heads_q}, "(heads_q)");
  else
    detail::check_shape("alibi_slopes", a, {batch, heads_q}, "(batch, heads_q)");
  const std::int64_t rows = a.rank == 1 ? 1 : batch;
  const double largest = static_cast<double>(AttentionProblem::kLargestScaled) / static_cast<double>(std::max<std::int64_t>(distance, 1));
  for (std::int64_t b = 0; a.device == Device::cpu && b < rows; ++b)
    for (std::int64_t h = 0; h < heads_q; ++h) {
      const float x = static_cast<const float*>(a.data)[(a.rank == 1 ? 0 : b * a.strides[0]) + h * a.strides[a.rank - 1]];
      require(std::isfinite(x) && std::fabs(x) <= largest, [&] {
        return "alibi_slopes: slope of " + (a.rank == 1 ? std::string() : "batch " + str(b) + ", ") + "head " +
               str(h) + " is " + num(x) + ", expected finite, of magnitude at most " + num(static_cast<float>(largest)) +
               (distance > 1 ? " (" + num(AttentionProblem::kLargestScaled) + " over the largest query-key distance " +
                                   str(distance) + ": slope times distance must stay within float32)"
                             : std::string());
      });
    }
}

AttentionProblem AttentionProblem::from_sizes(std::int64_t batch, std::int64_t seqlen_q,
                                              std::int64_t seqlen_k, std::int64_t heads_q,
                                              std::int64_t heads_kv, std::int64_t head_dim,
                                              std::int64_t head_dim_v, DType dtype,
                                              const AttentionOptions& options) {
  require(batch >= 0, [&] { return "batch: must be >= 0, got " + str(batch); });
  require(seqlen_q >= 0, [&] { return "seqlen_q: must be >= 0, got " + str(seqlen_q); });
  require(seqlen_k >= 0, [&] { return "seqlen_k: must be >= 0, got " + str(seqlen_k); });
  require(heads_q >= 1, [&] { return "heads_q: must be >= 1, got " + str(heads_q); });
  require(heads_kv >= 1, [&] { return "heads_kv: must be >= 1, got " + str(heads_kv); });
  require(heads_q % heads_kv == 0, [&] {
    return "heads: q has " + str(heads_q) + " heads, not a multiple of k/v's " + str(heads_kv) +
           " heads (grouped-query attention needs heads_q = "
           "g · heads_kv)";
  });
  require(head_dim >= 1 && head_dim <= kMaxHeadDim,
          [&] { return "head_dim: " + str(head_dim) + " out of range [1, " + str(kMaxHeadDim) + "]"; });
  require(head_dim_v >= 1 && head_dim_v <= kMaxHeadDim,
          [&] { return "head_dim_v: " + str(head_dim_v) + " out of range [1, " + str(kMaxHeadDim) + "]"; });
  if (options.softmax_scale)
    require(std::isfinite(*options.softmax_scale) && std::fabs(*options.softmax_scale) <= kLargestScaled, [&] {
      return "softmax_scale: must be finite, of magnitude at most " + num(kLargestScaled) + ", got " +
             num(*options.softmax_scale);
    });
  require(options.window_size.left >= -1 && options.window_size.right >= -1, [&] {
    return "window_size: (" + str(options.window_size.left) + ", " + str(options.window_size.right) +
           ") but each side must be >= -1 (-1 = unbounded)";
  });
  require(std::isfinite(options.softcap) && options.softcap >= 0.0f && options.softcap <= kLargestScaled, [&] {
    return "softcap: must be >= 0 (0 disables it) and at most " + num(kLargestScaled) + ", got " +
           num(options.softcap);
  });
  require(options.dropout_p >= 0.0f && options.dropout_p < 1.0f,
          [&] { return "dropout_p: must be in [0, 1), got " + std::to_string(options.dropout_p); });
  require(options.num_splits >= 0,
          [&] { return "num_splits: must be >= 0 (0 = automatic), got " + str(options.num_splits); });
  require(options.exp2_poly3_fraction >= 0.0f && options.exp2_poly3_fraction <= 1.0f,
          [&] { return "exp2_poly3_fraction: must be in [0, 1], got " + std::to_string(options.exp2_poly3_fraction); });
  if (options.rescale_threshold) {
    const float t = *options.rescale_threshold;
    require(t >= 0.0f && t <= kMaxRescaleThreshold, [&] {
      return "rescale_threshold: must be in [0, " + std::to_string(kMaxRescaleThreshold) +
             "] (log2 units; 0 = rescale whenever the maximum grows), got " + std::to_string(t);
    });
  }
  require(options.block_q >= 0,
          [&] { return "block_q: must be >= 0 (0 = the planner's choice), got " + str(options.block_q); });
  require(options.num_threads >= 0 && options.num_threads <= kMaxThreads, [&] {
    return "num_threads: must be in [0, " + str(kMaxThreads) + "] (0 = all cores), got " + str(options.num_threads);
  });

  AttentionProblem p;
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.head_dim = head_dim;
  p.head_dim_v = head_dim_v;
  p.dtype = dtype;
  p.causal = options.causal;
  p.causal_alignment = options.causal_alignment;
  p.window_left = options.window_size.left;
  p.window_right = options.causal ? 0
                   : options.window_size.right;
  if (options.causal && options.window_size.right > 0)
    throw Error("window_size: right = " + str(options.window_size.right) +
                " contradicts causal = true (causal means right = 0)");
  p.softcap = options.softcap;
  p.dropout_p = options.dropout_p;
  p.seed = options.seed;
  p.offset = options.offset;
  p.alibi = options.alibi_slopes.data != nullptr || options.alibi_slopes.rank != 0;
  p.sinks = options.sinks.data != nullptr || options.sinks.rank != 0;
  if (p.sinks) {
    // Checked as on the host whatever its device (the CUDA backend rejects sinks by name);
    // the logits themselves are read only from host memory.
    const TensorView& s = options.sinks;
    detail::check_view("sinks", s.on(Device::cpu), 1, "(heads_q)");
    detail::check_dtype("sinks", s, DType::f32, "sink logits are float32");
    detail::check_shape("sinks", s, {heads_q}, "(heads_q)");
    for (std::int64_t h = 0; s.device == Device::cpu && h < heads_q; ++h) {
      const float x = static_cast<const float*>(s.data)[h * s.strides[0]];
      require(std::isfinite(x) && std::fabs(x) <= kLargestScaled, [&] {
        return "sinks: sink logit of head " + str(h) + " is " + num(x) +
               ", expected finite, of magnitude at most " + num(kLargestScaled);
      });
    }
  }
  p.block_mask_block_size = options.block_mask.data != nullptr || options.block_mask.rank != 0
                                ? options.block_mask_block_size
                                : 0;
  // automatic is exact for every dtype (docs/numerics.md): poly3 keeps bf16/f16 outputs
  // within their tolerance, but its 7.5e-5 relative error moves the float32 lse by as much,
  // beyond the 1e-5 the tests allow, and on this CPU it is no measurable speed-up.
  p.exp2 = options.exp2 != Exp2Impl::automatic ? options.exp2 : Exp2Impl::exact;
  p.exp2_poly3_fraction = p.exp2 == Exp2Impl::mixed ? options.exp2_poly3_fraction : 0.0f;
  p.rescale_threshold = options.rescale_threshold.value_or(kDefaultRescaleThreshold);
  p.softmax_scale = options.softmax_scale
                        ? *options.softmax_scale
                        : static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  if (p.alibi) detail::check_alibi_slopes(options.alibi_slopes, batch, heads_q, std::max(seqlen_q, seqlen_k));
  if (options.block_mask.data != nullptr || options.block_mask.rank != 0) {
    const std::int64_t bs = options.block_mask_block_size;
    require(bs >= 1, [&] { return "block_mask_block_size: must be >= 1 with a block_mask, got " + str(bs); });
    const TensorView& m = options.block_mask;
    detail::check_view("block_mask", m, 2, "(q blocks, k blocks)");
    detail::check_dtype("block_mask", m, DType::u8, "a boolean mask, one byte per block");
    detail::check_shape("block_mask", m, {blocks_of(seqlen_q, bs), blocks_of(seqlen_k, bs)},
                        "(ceil(seqlen_q / block), ceil(seqlen_k / block))");
  }
  if (options.attn_mask.data != nullptr || options.attn_mask.rank != 0) {
    const TensorView& m = options.attn_mask;
    // Checked as on the host whatever its device (the CUDA backend rejects it by name).
    detail::check_view("attn_mask", m.on(Device::cpu), 4, "broadcastable to (batch, heads_q, seqlen_q, seqlen_k)");
    require(m.dtype == DType::u8 || is_floating(m.dtype), [&] {
      return "attn_mask: dtype " + to_string(m.dtype) + " is neither u8 (a boolean mask) nor f32, bf16, f16 (a bias)";
    });
    const std::int64_t full[4] = {batch, heads_q, seqlen_q, seqlen_k};
    for (int d = 0; d < 4; ++d)
      require(m.shape[d] == full[d] || m.shape[d] == 1, [&] {
        return "attn_mask: shape " + detail::shape_string(m) +
               " does not broadcast to (batch, heads_q, seqlen_q, seqlen_k) = (" + str(batch) + ", " + str(heads_q) +
               ", " + str(seqlen_q) + ", " + str(seqlen_k) + "): dim " + str(d) + " must be " + str(full[d]) + " or 1";
      });
    p.attn_mask = m.dtype == DType::u8 ? MaskKind::boolean : MaskKind::bias;
  }
  if (const ScoreHook& hook = options.score_hook; hook.apply != nullptr) {
    require(hook.score != nullptr || hook.mask != nullptr, [&] {
      return "score_hook: has neither a score_mod nor a mask_mod (ScoreHook::score and ::mask are both null)";
    });
    if (hook.block_size != 0 || hook.block_mask.data != nullptr || hook.block_mask.rank != 0) {
      const std::int64_t bs = hook.block_size;
      require(bs >= 1, [&] { return "score_hook.block_size: must be >= 1 with a block mask, got " + str(bs); });
      const TensorView& m = hook.block_mask;
      detail::check_view("score_hook.block_mask", m, 4, "(batch or 1, heads_q or 1, q blocks, kv blocks)");
      detail::check_dtype("score_hook.block_mask", m, DType::u8, "ScoreBlock values, one byte per block");
      const std::int64_t want[4] = {batch, heads_q, blocks_of(seqlen_q, bs), blocks_of(seqlen_k, bs)};
      for (int d = 0; d < 4; ++d)
        require(m.shape[d] == want[d] || (d < 2 && m.shape[d] == 1), [&] {
          return "score_hook.block_mask: shape " + detail::shape_string(m) + " is not (batch or 1, heads_q or 1, " +
                 "ceil(seqlen_q / block), ceil(seqlen_k / block)) = (" + str(batch) + ", " + str(heads_q) + ", " +
                 str(want[2]) + ", " + str(want[3]) + ") for block_size " + str(bs);
        });
      check_block_states(m);
      check_partial_blocks(hook, m, bs);
    } else {
      require(hook.partial_slots.data == nullptr && hook.partial_keep.data == nullptr, [&] {
        return std::string("score_hook.partial_slots: set without a block_mask (they index its partial blocks)");
      });
    }
  } else {
    require(hook.score == nullptr && hook.mask == nullptr && hook.block_mask.data == nullptr, [&] {
      return "score_hook: apply is null but score, mask or block_mask is set (build it with FlexMods::hook)";
    });
  }
  return p;
}

AttentionProblem AttentionProblem::from_inputs(const TensorView& q, const TensorView& k,
                                               const TensorView& v,
                                               const AttentionOptions& options) {
  detail::check_view("q", q, 4, kQLayout);
  detail::check_view("k", k, 4, kKLayout);
  detail::check_view("v", v, 4, kVLayout);
  if (!is_floating(q.dtype))
    throw Error("q: dtype " + to_string(q.dtype) + " is not a floating dtype (f32, bf16, f16)");
  detail::check_dtype("k", k, q.dtype, "k must have q's dtype");
  detail::check_dtype("v", v, q.dtype, "v must have q's dtype");
  require(k.shape[0] == q.shape[0],
          [&] { return "k: batch " + str(k.shape[0]) + " does not match q batch " + str(q.shape[0]); });
  require(v.shape[0] == q.shape[0],
          [&] { return "v: batch " + str(v.shape[0]) + " does not match q batch " + str(q.shape[0]); });
  require(v.shape[1] == k.shape[1],
          [&] { return "v: seqlen " + str(v.shape[1]) + " does not match k seqlen " + str(k.shape[1]); });
  require(v.shape[2] == k.shape[2],
          [&] { return "v: heads " + str(v.shape[2]) + " does not match k heads " + str(k.shape[2]); });
  require(k.shape[3] == q.shape[3],
          [&] { return "k: head_dim " + str(k.shape[3]) + " does not match q head_dim " + str(q.shape[3]); });
  return from_sizes(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
                    v.shape[3], q.dtype, options);
}

AttentionProblem::KeyRange AttentionProblem::key_range(std::int64_t row) const {
  const std::int64_t d = diagonal(row);
  KeyRange r{0, seqlen_k};
  // Compared before subtracting or adding: a side up to INT64_MAX must not overflow (a side
  // reaching past every key is the unbounded one).
  if (window_left >= 0 && window_left < d) r.begin = d - window_left;
  if (window_right >= 0 && window_right < seqlen_k - d) r.end = std::max<std::int64_t>(d + window_right + 1, 0);
  return r;
}

const char* to_string(CausalAlignment alignment) {
  return alignment == CausalAlignment::top_left ? "top_left" : "bottom_right";
}

CausalAlignment parse_causal_alignment(const std::string& name) {
  for (CausalAlignment a : {CausalAlignment::bottom_right, CausalAlignment::top_left})
    if (name == to_string(a)) return a;
  throw Error("causal_alignment: unknown alignment '" + name + "' (expected bottom_right or top_left)");
}

const char* to_string(Exp2Impl impl) {
  switch (impl) {
    case Exp2Impl::automatic: return "auto";
    case Exp2Impl::exact: return "exact";
    case Exp2Impl::poly3: return "poly3";
    case Exp2Impl::mixed: return "mixed";
  }
  return "unknown";
}

Exp2Impl parse_exp2_impl(const std::string& name) {
  for (Exp2Impl impl : {Exp2Impl::automatic, Exp2Impl::exact, Exp2Impl::poly3, Exp2Impl::mixed})
    if (name == to_string(impl)) return impl;
  throw Error("exp2: unknown implementation '" + name + "' (expected auto, exact, poly3 or mixed)");
}

const char* to_string(ForwardKernel kernel) {
  switch (kernel) {
    case ForwardKernel::automatic: return "auto";
    case ForwardKernel::tiled: return "tiled";
    case ForwardKernel::tiled_bf16: return "tiled_bf16";
    case ForwardKernel::decode: return "decode";
    case ForwardKernel::decode_fp16: return "decode_fp16";
    case ForwardKernel::decode_bf16: return "decode_bf16";
  }
  return "unknown";
}

ForwardKernel parse_forward_kernel(const std::string& name) {
  for (ForwardKernel k : {ForwardKernel::automatic, ForwardKernel::tiled, ForwardKernel::tiled_bf16, ForwardKernel::decode,
                          ForwardKernel::decode_fp16, ForwardKernel::decode_bf16})
    if (name == to_string(k)) return k;
  throw Error("kernel: unknown forward kernel '" + name +
              "' (expected auto, tiled, tiled_bf16, decode, decode_fp16 or decode_bf16)");
}

const char* to_string(BackwardKernel kernel) {
  switch (kernel) {
    case BackwardKernel::automatic: return "auto";
    case BackwardKernel::tiled: return "tiled";
    case BackwardKernel::tiled_bf16: return "tiled_bf16";
  }
  return "unknown";
}

BackwardKernel parse_backward_kernel(const std::string& name) {
  for (BackwardKernel k : {BackwardKernel::automatic, BackwardKernel::tiled, BackwardKernel::tiled_bf16})
    if (name == to_string(k)) return k;
  throw Error("backward_kernel: unknown backward kernel '" + name + "' (expected auto, tiled or tiled_bf16)");
}

double AttentionProblem::conventional_forward_flops() const {
  const double full = 4.0 * static_cast<double>(batch) * static_cast<double>(heads_q) *
                      static_cast<double>(seqlen_q) * static_cast<double>(seqlen_k) *
                      static_cast<double>(head_dim);
  return causal ? full / 2.0 : full;
}

std::int64_t AttentionProblem::visible_pairs(const TensorView& block_mask) const {
  const bool masked = block_mask_block_size > 0 && block_mask.data != nullptr;
  const std::int64_t bs = block_mask_block_size;
  std::int64_t pairs = 0;
  for (std::int64_t row = 0; row < seqlen_q; ++row) {
    const KeyRange r = key_range(row);
    if (r.size() == 0) continue;
    if (!masked) {
      pairs += r.size();
      continue;
    }
    const auto* mask_row = static_cast<const std::uint8_t*>(block_mask.data) + (row / bs) * block_mask.strides[0];
    for (std::int64_t kb = r.begin / bs; kb * bs < r.end; ++kb) {
      if (mask_row[kb * block_mask.strides[1]] == 0) continue;
      pairs += std::min(r.end, (kb + 1) * bs) - std::max(r.begin, kb * bs);
    }
  }
  return pairs;
}

double AttentionProblem::visible_forward_flops(const TensorView& block_mask) const {
  return 2.0 * static_cast<double>(head_dim + head_dim_v) * static_cast<double>(batch) *
         static_cast<double>(heads_q) * static_cast<double>(visible_pairs(block_mask));
}

std::string AttentionProblem::describe() const {
  std::ostringstream s;
  s << "batch=" << batch << " seqlen_q=" << seqlen_q << " seqlen_k=" << seqlen_k
    << " heads_q=" << heads_q << " heads_kv=" << heads_kv << " head_dim=" << head_dim
    << " head_dim_v=" << head_dim_v << " dtype=" << to_string(dtype)
    << " causal=" << (causal ? "true" : "false") << " softmax_scale=" << softmax_scale;
  if (causal_alignment != CausalAlignment::bottom_right) s << " causal_alignment=" << to_string(causal_alignment);
  if (window_left >= 0 || (window_right >= 0 && !causal))
    s << " window_size=(" << window_left << ", " << window_right << ")";
  if (softcap > 0.0f) s << " softcap=" << softcap;
  if (alibi) s << " alibi";
  if (dropout_p > 0.0f) s << " dropout_p=" << dropout_p << " seed=" << seed;
  if (block_mask_block_size > 0) s << " block_mask_block_size=" << block_mask_block_size;
  if (attn_mask != MaskKind::none) s << " attn_mask=" << (attn_mask == MaskKind::boolean ? "bool" : "bias");
  s << " exp2=" << to_string(exp2);
  if (exp2 == Exp2Impl::mixed) s << " exp2_poly3_fraction=" << exp2_poly3_fraction;
  s << " rescale_threshold=" << rescale_threshold;
  return s.str();
}

}  // namespace flashattn
