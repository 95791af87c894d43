// The native half of the Python package: thin nanobind wrappers over the C++ API. The
// Python half (python/flashattn) owns upstream's function names, argument handling and
// output allocation; arrays arrive zero-copy as raw buffers plus a dtype name (float16
// and bfloat16 travel as uint16 views, since NumPy has no bfloat16 of its own).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace nb = nanobind;
// Arrays the library writes (outputs, caches it appends to) and arrays it only reads: In
// takes read-only NumPy arrays too (np.broadcast_to views, read-only memmaps), which
// nanobind refuses where a binding may write.
using Array = nb::ndarray<nb::device::cpu>;
using In = nb::ndarray<nb::ro, nb::device::cpu>;

namespace {

template <class A>
flashattn::DType dtype_of(const A& a, const std::string& name, const char* arg) {
  const flashattn::DType d = name == "i32"  ? flashattn::DType::i32
                             : name == "u8" ? flashattn::DType::u8  // FP8 e4m3 codes of a KV cache
                                            : flashattn::parse_dtype(name);
  const std::size_t bits = a.dtype().bits;
  if (bits != 8 * flashattn::dtype_size(d))
    throw nb::type_error((std::string(arg) + ": buffer of " + std::to_string(bits) +
                          "-bit elements does not hold dtype " + name).c_str());
  // Tables of indices and counts: integers, not another 32-bit type's bits read as them.
  if (d == flashattn::DType::i32 && a.dtype().code != static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int))
    throw nb::type_error((std::string(arg) + ": expected int32 elements, got 32-bit elements of another kind").c_str());
  return d;
}

template <class View, class A, class Ptr>
View view_of(const A& a, flashattn::DType dtype, Ptr data, const char* arg) {
  View v;
  v.data = data;
  v.dtype = dtype;
  v.rank = static_cast<int>(a.ndim());
  if (v.rank > flashattn::kMaxRank)
    throw nb::value_error((std::string(arg) + ": rank " + std::to_string(v.rank) +
                           " is not supported (at most 4)").c_str());
  for (int d = 0; d < v.rank; ++d) {
    v.shape[d] = static_cast<std::int64_t>(a.shape(d));
    v.strides[d] = static_cast<std::int64_t>(a.stride(d));
  }
  return v;
}

flashattn::TensorView in(const In& a, const std::string& dtype, const char* arg) {
  return view_of<flashattn::TensorView>(a, dtype_of(a, dtype, arg), static_cast<const void*>(a.data()), arg);
}

flashattn::MutableTensorView out(const Array& a, const std::string& dtype, const char* arg) {
  return view_of<flashattn::MutableTensorView>(a, dtype_of(a, dtype, arg), static_cast<void*>(a.data()), arg);
}

flashattn::TensorView optional_in(const std::optional<In>& a, const std::string& dtype,
                                  const char* arg) {
  return a ? in(*a, dtype, arg) : flashattn::TensorView{};
}

// Each array's dtype name by its argument name, as Python read it from the array itself:
// whether they agree (k has q's dtype, ...) is the library's check.
using Dtypes = std::map<std::string, std::string>;
const std::string& dtype_named(const Dtypes& dtypes, const char* arg) {
  const auto it = dtypes.find(arg);
  if (it == dtypes.end()) throw nb::value_error((std::string(arg) + ": no dtype given for it").c_str());
  return it->second;
}
flashattn::TensorView in(const In& a, const Dtypes& dtypes, const char* arg) {
  return in(a, dtype_named(dtypes, arg), arg);
}
flashattn::MutableTensorView out(const Array& a, const Dtypes& dtypes, const char* arg) {
  return out(a, dtype_named(dtypes, arg), arg);
}
flashattn::TensorView optional_in(const std::optional<In>& a, const Dtypes& dtypes, const char* arg) {
  return a ? in(*a, dtypes, arg) : flashattn::TensorView{};
}

// FlexAttention from Python (python/flashattn/_flex.py; docs/python.md): the user's
// mask_mod and score_mod arrive already evaluated, vectorised, by Python — the block mask's
// ScoreBlock states with the boolean content of its partial blocks, and score_mod as
// per-score coefficients of f(s) = a·s + c (it was checked to be affine in s) — so the
// kernels' ScoreHook reads tensors and never calls into Python (the GIL stays released).
struct FlexHook {
  flashattn::TensorView block_states;    // u8 ScoreBlock, (B or 1, Hq or 1, q blocks, kv blocks)
  flashattn::TensorView partial_index;   // i32 like block_states: a partial block's slot in partial_blocks
  flashattn::TensorView partial_blocks;  // u8 (slots, block_size, block_size): non-zero keeps the key
  std::int64_t block_size = 0;
  // f32, each dim its size in (B, Hq, Sq, Sk) or 1 (broadcast); null data: a ≡ 1, c ≡ 0.
  flashattn::TensorView score_a, score_c;

  bool has_mask() const { return block_states.data != nullptr; }
  bool has_score() const { return score_a.data != nullptr || score_c.data != nullptr; }

  // The element offset of (b, h, i, j) in a view whose size-1 dims are broadcast.
  static std::int64_t offset(const flashattn::TensorView& v, std::int64_t b, std::int64_t h, std::int64_t i,
                             std::int64_t j) {
    const std::int64_t idx[4] = {b, h, i, j};
    std::int64_t o = 0;
    for (int d = 0; d < 4; ++d)
      if (v.shape[d] > 1) o += idx[d] * v.strides[d];
    return o;
  }
  static float coefficient(const flashattn::TensorView& v, float absent, std::int64_t b, std::int64_t h,
                           std::int64_t i, std::int64_t j) {
    return v.data == nullptr ? absent : static_cast<const float*>(v.data)[offset(v, b, h, i, j)];
  }

  flashattn::ScoreBlock state(std::int64_t b, std::int64_t h, std::int64_t bi, std::int64_t bj) const {
    return static_cast<flashattn::ScoreBlock>(
        static_cast<const std::uint8_t*>(block_states.data)[offset(block_states, b, h, bi, bj)]);
  }
  // The partial block (bi, bj)'s content from row i % block_size, column 0; key j at [j % block_size].
  const std::uint8_t* partial_row(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t bj) const {
    const std::int64_t slot =
        static_cast<const std::int32_t*>(partial_index.data)[offset(partial_index, b, h, i / block_size, bj)];
    return static_cast<const std::uint8_t*>(partial_blocks.data) + slot * partial_blocks.strides[0] +
           (i % block_size) * partial_blocks.strides[1];
  }
  bool keeps(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    const flashattn::ScoreBlock s = state(b, h, i / block_size, j / block_size);
    if (s != flashattn::ScoreBlock::partial) return s == flashattn::ScoreBlock::full;
    return partial_row(b, h, i, j / block_size)[(j % block_size) * partial_blocks.strides[2]] != 0;
  }

  // ScoreHook::apply: scores in log2 units, so f(s·ln 2)·log2 e = a·s + c·log2 e; one mask
  // block at a time (its content row looked up once), each through the library's vectorised
  // flex::detail::affine_span.
  static void apply(const void* self, const flashattn::ScoreSpan& sp) {
    constexpr float kLog2e = 1.442695040888963407f;
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    const FlexHook& m = *static_cast<const FlexHook*>(self);
    const bool mask = sp.mask && m.has_mask();
    const bool score = m.has_score();
    // a and c at the span's first key, and their key strides (0 where broadcast along the keys).
    const auto row = [&](const flashattn::TensorView& v) {
      if (v.data == nullptr) return static_cast<const float*>(nullptr);
      return static_cast<const float*>(v.data) + offset(v, sp.batch, sp.head, sp.q_idx, sp.kv_begin);
    };
    const float* a = row(m.score_a);
    const float* c = row(m.score_c);
    const std::int64_t a_step = a != nullptr && m.score_a.shape[3] > 1 ? m.score_a.strides[3] : 0;
    const std::int64_t c_step = c != nullptr && m.score_c.shape[3] > 1 ? m.score_c.strides[3] : 0;
    float* grad = score ? sp.grad : nullptr;  // mask_mod alone leaves the factors as they are
    const std::int64_t bits_step = m.partial_blocks.strides[2];
    for (std::int64_t k = 0; k < sp.n;) {
      const std::int64_t j0 = sp.kv_begin + k;
      const std::int64_t end = mask ? std::min(sp.n, k + m.block_size - j0 % m.block_size) : sp.n;
      const std::uint8_t* bits = nullptr;  // a partial block's content row; null: the block's state decides
      if (mask) {
        const flashattn::ScoreBlock state = m.state(sp.batch, sp.head, sp.q_idx / m.block_size, j0 / m.block_size);
        if (state == flashattn::ScoreBlock::empty) {
          std::fill(sp.scores + k, sp.scores + end, kNegInf);
          if (grad != nullptr) std::fill(grad + k, grad + end, 0.0f);
          k = end;
          continue;
        }
        if (state == flashattn::ScoreBlock::partial)
          bits = m.partial_row(sp.batch, sp.head, sp.q_idx, j0 / m.block_size) + (j0 % m.block_size) * bits_step;
      }
      if (score || bits != nullptr)
        flashattn::flex::detail::affine_span(sp.scores + k, grad != nullptr ? grad + k : nullptr, end - k,
                                             a != nullptr ? a + k * a_step : nullptr, a_step,
                                             c != nullptr ? c + k * c_step : nullptr, c_step, kLog2e, bits, bits_step);
      k = end;
    }
  }

  // The block states the kernels read (ScoreHook::block_mask): where block_size is a larger
  // multiple of kFineBlock (the CPU kernels' key panel), a copy in blocks of kFineBlock, each
  // inside a partial block classified from its content — so that the kernels narrow a row
  // strip on a mask's diagonal to the sub-blocks it sees and run apply() only on the partial
  // ones (docs/algorithm.md §6). apply() keeps reading the caller's blocks.
  static constexpr std::int64_t kFineBlock = 32;
  std::vector<std::uint8_t> fine_states;
  flashattn::TensorView fine_view;

  // Every block state is a ScoreBlock and every partial block's slot lies in partial_blocks
  // (the ops take these tables from any caller; apply() and refine() read them unchecked).
  void validate() const {
    const flashattn::TensorView& st = block_states;
    for (std::int64_t b = 0; b < st.shape[0]; ++b)
      for (std::int64_t h = 0; h < st.shape[1]; ++h)
        for (std::int64_t bi = 0; bi < st.shape[2]; ++bi)
          for (std::int64_t bj = 0; bj < st.shape[3]; ++bj) {
            const auto where = [&] {
              return " at (" + std::to_string(b) + ", " + std::to_string(h) + ", " + std::to_string(bi) + ", " +
                     std::to_string(bj) + ")";
            };
            const std::uint8_t s = static_cast<const std::uint8_t*>(st.data)[offset(st, b, h, bi, bj)];
            if (s > static_cast<std::uint8_t>(flashattn::ScoreBlock::full))
              throw flashattn::Error("block_mask: block state " + std::to_string(s) + where() +
                                     " is not 0 (empty), 1 (partial) or 2 (full)");
            if (s != static_cast<std::uint8_t>(flashattn::ScoreBlock::partial)) continue;
            const std::int32_t slot =
                static_cast<const std::int32_t*>(partial_index.data)[offset(partial_index, b, h, bi, bj)];
            if (slot < 0 || slot >= partial_blocks.shape[0])
              throw flashattn::Error("block_mask: partial index " + std::to_string(slot) + " of the partial block" +
                                     where() + " is outside its " + std::to_string(partial_blocks.shape[0]) +
                                     " partial blocks");
          }
  }

  // For a call of seqlen_q × seqlen_k (not refined where the caller's blocks do not cover it:
  // the library's check of their shape then names the mismatch).
  void refine(std::int64_t seqlen_q, std::int64_t seqlen_k) {
    const flashattn::TensorView& st = block_states;
    const std::int64_t r = block_size / kFineBlock;
    if (!has_mask() || block_size % kFineBlock != 0 || r < 2) return;
    const std::int64_t planes_b = st.shape[0], planes_h = st.shape[1], qb = st.shape[2], kb = st.shape[3];
    const std::int64_t fq = (seqlen_q + kFineBlock - 1) / kFineBlock, fk = (seqlen_k + kFineBlock - 1) / kFineBlock;
    if (seqlen_q < 1 || seqlen_k < 1 || fq > qb * r || fk > kb * r) return;
    fine_states.assign(static_cast<std::size_t>(planes_b * planes_h * fq * fk), 0);
    const auto* pb = static_cast<const std::uint8_t*>(partial_blocks.data);
    for (std::int64_t b = 0; b < planes_b; ++b)
      for (std::int64_t h = 0; h < planes_h; ++h)
        for (std::int64_t bi = 0; bi < qb; ++bi)
          for (std::int64_t bj = 0; bj < kb; ++bj) {
            const flashattn::ScoreBlock s = state(b, h, bi, bj);
            std::int64_t slot = -1;
            if (s == flashattn::ScoreBlock::partial)  // validate() checked it
              slot = static_cast<const std::int32_t*>(partial_index.data)[offset(partial_index, b, h, bi, bj)];
            for (std::int64_t fi = 0; fi < r && bi * r + fi < fq; ++fi)
              for (std::int64_t fj = 0; fj < r && bj * r + fj < fk; ++fj) {
                flashattn::ScoreBlock f = s;
                if (slot >= 0) {
                  bool any_kept = false, any_hidden = false;
                  for (std::int64_t y = fi * kFineBlock; y < (fi + 1) * kFineBlock; ++y) {
                    const std::uint8_t* row = pb + slot * partial_blocks.strides[0] + y * partial_blocks.strides[1];
                    for (std::int64_t x = fj * kFineBlock; x < (fj + 1) * kFineBlock; ++x)
                      (row[x * partial_blocks.strides[2]] != 0 ? any_kept : any_hidden) = true;
                  }
                  f = flashattn::classify_block(any_kept, any_hidden);
                }
                fine_states[static_cast<std::size_t>(((b * planes_h + h) * fq + bi * r + fi) * fk + bj * r + fj)] =
                    static_cast<std::uint8_t>(f);
              }
          }
    fine_view = flashattn::TensorView(fine_states.data(), flashattn::DType::u8, {planes_b, planes_h, fq, fk});
  }

  // The hook for AttentionOptions::score_hook, with the float64 reference's per-score forms.
  flashattn::ScoreHook hook() const {
    flashattn::ScoreHook h;
    h.apply = &apply;
    h.mods = this;
    if (has_score()) {
      h.score = [](const void* self, double s, std::int64_t b, std::int64_t hd, std::int64_t i, std::int64_t j) {
        const FlexHook& m = *static_cast<const FlexHook*>(self);
        return static_cast<double>(coefficient(m.score_a, 1.0f, b, hd, i, j)) * s +
               static_cast<double>(coefficient(m.score_c, 0.0f, b, hd, i, j));
      };
      h.derivative = [](const void* self, double, std::int64_t b, std::int64_t hd, std::int64_t i, std::int64_t j) {
        return static_cast<double>(coefficient(static_cast<const FlexHook*>(self)->score_a, 1.0f, b, hd, i, j));
      };
    }
    if (has_mask()) {
      h.mask = [](const void* self, std::int64_t b, std::int64_t hd, std::int64_t i, std::int64_t j) {
        return static_cast<const FlexHook*>(self)->keeps(b, hd, i, j);
      };
      const bool fine = fine_view.data != nullptr;
      h.block_mask = fine ? fine_view : block_states;
      h.block_size = fine ? kFineBlock : block_size;
    }
    return h;
  }
};
// A quantized cache's pool formats by argument name ("k_quant", "v_quant"), each "codes" or
// "codes/granularity" as Python resolved it (kv_quant.hpp: "u8/per_token"); absent: e4m3 per page.
using Quants = std::map<std::string, std::string>;
flashattn::KvQuant kv_quant(const Quants& quants, const char* arg) {
  const auto it = quants.find(arg);
  if (it == quants.end()) return {};
  const std::string& s = it->second;
  const std::size_t slash = s.find('/');
  flashattn::KvQuant q;
  q.codes = flashattn::parse_kv_codes(s.substr(0, slash));
  if (slash != std::string::npos) q.granularity = flashattn::parse_kv_scale_granularity(s.substr(slash + 1));
  return q;
}

struct Options {
  std::optional<float> softmax_scale;
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  std::optional<In> alibi_slopes;
  std::string alibi_dtype = "f32";  // the slopes' own dtype: the library checks it
  std::optional<In> sinks;       // (heads_q) sink logits
  std::string sinks_dtype = "f32";  // the sinks' own dtype: the library checks it
  std::optional<Array> dsinks;      // backward only: float32 (heads_q) receives the sinks' gradient
  std::optional<In> dlse;           // backward only: float32 of lse's shape, lse's gradient
  float dropout_p = 0.0f;
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  bool deterministic = false;
  int num_threads = 0;
  int num_splits = 0;
  std::optional<bool> pack_gqa;     // AttentionOptions::pack_gqa (None: the planner's choice)
  std::optional<In> block_mask;  // u8 (q blocks, k blocks)
  std::int64_t block_mask_block_size = 0;
  std::optional<In> attn_mask;         // rank 4, broadcastable to (batch, heads_q, seqlen_q, seqlen_k)
  std::string attn_mask_dtype = "u8";     // "u8" (a boolean mask) or a bias's floating dtype
  std::optional<Array> dbias;             // backward only: float32 of attn_mask's shape receives the bias's gradient
  std::string causal_alignment = "bottom_right";  // or "top_left" (SDPA's is_causal)
  std::string kernel = "auto";           // AttentionOptions::kernel by name
  std::string backward_kernel = "auto";  // AttentionOptions::backward_kernel by name
  // FlexAttention's evaluated mods (FlexHook): block mask and partial blocks, score_mod's a, c.
  std::optional<In> flex_block_states, flex_partial_index, flex_partial_blocks, flex_score_a, flex_score_c;
  std::int64_t flex_block_size = 0;
  std::int64_t flex_seqlen_q = 0, flex_seqlen_k = 0;  // the call's, for FlexHook::refine (0: not refined)
  // The hook's views, rebuilt by get(): AttentionOptions::score_hook points at it, so these
  // Options must outlive the call they configure (the bindings hold them through it).
  mutable FlexHook flex;

  flashattn::AttentionOptions get() const {
    flashattn::AttentionOptions o;
    o.softmax_scale = softmax_scale;
    o.causal = causal;
    o.window_size = {window_left, window_right};
    o.softcap = softcap;
    o.alibi_slopes = optional_in(alibi_slopes, alibi_dtype, "alibi_slopes");
    o.sinks = optional_in(sinks, sinks_dtype, "sinks");
    if (dsinks) o.dsinks = out(*dsinks, "f32", "dsinks");
    o.dlse = optional_in(dlse, "f32", "dlse");
    o.dropout_p = dropout_p;
    o.seed = seed;
    o.offset = offset;
    o.deterministic = deterministic;
    o.num_threads = num_threads;
    o.num_splits = num_splits;
    o.pack_gqa = pack_gqa;
    o.block_mask = optional_in(block_mask, "u8", "block_mask");
    o.block_mask_block_size = block_mask_block_size;
    o.attn_mask = optional_in(attn_mask, attn_mask_dtype, "attn_mask");
    if (dbias) o.dbias = out(*dbias, "f32", "dbias");
    o.causal_alignment = flashattn::parse_causal_alignment(causal_alignment);
    o.kernel = flashattn::parse_forward_kernel(kernel);
    o.backward_kernel = flashattn::parse_backward_kernel(backward_kernel);
    flex = FlexHook{optional_in(flex_block_states, "u8", "block_mask"),
                    optional_in(flex_partial_index, "i32", "block_mask partial index"),
                    optional_in(flex_partial_blocks, "u8", "block_mask partial blocks"),
                    flex_block_size,
                    optional_in(flex_score_a, "f32", "score_mod coefficient a"),
                    optional_in(flex_score_c, "f32", "score_mod coefficient c")};
    if (flex.has_mask()) {
      const flashattn::TensorView &st = flex.block_states, &ix = flex.partial_index, &pb = flex.partial_blocks;
      bool same = ix.data != nullptr && ix.rank == 4 && st.rank == 4;
      for (int d = 0; same && d < 4; ++d) same = ix.shape[d] == st.shape[d];
      if (!same || pb.data == nullptr || pb.rank != 3 || flex_block_size < 1 || pb.shape[1] != flex_block_size ||
          pb.shape[2] != flex_block_size)
        throw flashattn::Error("block_mask: its partial index must have the block states' shape and its partial "
                               "blocks shape (n, block_size, block_size) with block_size >= 1, got block_size " +
                               std::to_string(flex_block_size));
      flex.validate();
      flex.refine(flex_seqlen_q, flex_seqlen_k);
    }
    if (flex.has_mask() || flex.has_score()) o.score_hook = flex.hook();
    record_threads(o.num_threads);
    return o;
  }

  // The thread budget of the latest call: what the planner gets for these options
  // (CpuHardware::detect, as the call itself asks it), kept for Python to report.
  static std::atomic<int>& last_threads() {
    static std::atomic<int> threads{0};
    return threads;
  }
  static void record_threads(int requested) { last_threads() = flashattn::CpuHardware::detect(requested).threads; }
};

// An FP8 input: u8 codes with float32 descales of the layout its block_size implies.
flashattn::Fp8View fp8_in(const In& codes, const In& descale, const std::string& format,
                          std::int64_t block_size, const char* arg, const char* descale_arg) {
  return {in(codes, "u8", arg), in(descale, "f32", descale_arg), flashattn::parse_fp8_format(format), block_size};
}

nb::dict forward_plan_dict(const flashattn::CpuForwardPlan& p) {
  nb::dict d;
  d["kernel"] = flashattn::to_string(p.kernel);
  d["block_q"] = p.block_q;
  d["block_k"] = p.block_k;
  d["head_dim_v_padded"] = p.head_dim_v_padded;
  d["q_blocks"] = p.q_blocks;
  d["work_items"] = p.work_items;
  d["splits"] = p.splits;
  d["heads_per_item"] = p.heads_per_item;
  d["threads"] = p.threads;
  d["workspace_bytes_per_thread"] = p.workspace_bytes_per_thread;
  d["shared_bytes"] = p.shared_bytes;
  d["workspace_bytes"] = p.workspace_bytes();
  d["describe"] = p.describe();
  return d;
}

nb::dict backward_plan_dict(const flashattn::CpuBackwardPlan& p) {
  nb::dict d;
  d["kernel"] = flashattn::to_string(p.kernel);
  d["block_q"] = p.block_q;
  d["block_k"] = p.block_k;
  d["head_dim_padded"] = p.head_dim_padded;
  d["head_dim_v_padded"] = p.head_dim_v_padded;
  d["q_blocks"] = p.q_blocks;
  d["k_blocks"] = p.k_blocks;
  d["kv_work_items"] = p.kv_work_items;
  d["deterministic"] = p.deterministic;
  d["keep_q_rows"] = p.keep_q_rows;
  d["threads"] = p.threads;
  d["workspace_bytes_per_thread"] = p.workspace_bytes_per_thread;
  d["shared_bytes"] = p.shared_bytes;
  d["workspace_bytes"] = p.workspace_bytes();
  d["describe"] = p.describe();
  return d;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "flashattn native core: exact tiled attention with an online softmax on the CPU";
  m.attr("__version__") = FLASHATTN_VERSION;
  // The largest |softmax_scale|, |softcap|, sink logit, ALiBi slope or score_mod constant.
  m.attr("LARGEST_SCALED") = flashattn::AttentionProblem::kLargestScaled;
  m.attr("MAX_THREADS") = flashattn::kMaxThreads;
  // Options objects kept alive by torch autograd contexts at interpreter exit are not leaks.
  nb::set_leak_warnings(false);

  // flashattn::Error: dtype problems are TypeErrors, everything else ValueErrors; the
  // message (naming the argument and its values) is kept as it is.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const flashattn::Error& e) {
      const std::string what = e.what();
      PyErr_SetString(what.find(": dtype ") != std::string::npos ? PyExc_TypeError : PyExc_ValueError,
                      what.c_str());
    }
  });

  nb::class_<Options>(m, "Options")
      .def(nb::init<>())
      .def_rw("softmax_scale", &Options::softmax_scale)
      .def_rw("causal", &Options::causal)
      .def_rw("window_left", &Options::window_left)
      .def_rw("window_right", &Options::window_right)
      .def_rw("softcap", &Options::softcap)
      .def_rw("alibi_slopes", &Options::alibi_slopes)
      .def_rw("alibi_dtype", &Options::alibi_dtype)
      .def_rw("sinks", &Options::sinks)
      .def_rw("sinks_dtype", &Options::sinks_dtype)
      .def_rw("dsinks", &Options::dsinks)
      .def_rw("dlse", &Options::dlse)
      .def_rw("dropout_p", &Options::dropout_p)
      .def_rw("seed", &Options::seed)
      .def_rw("offset", &Options::offset)
      .def_rw("deterministic", &Options::deterministic)
      .def_rw("num_threads", &Options::num_threads)
      .def_rw("num_splits", &Options::num_splits)
      .def_rw("pack_gqa", &Options::pack_gqa)
      .def_rw("block_mask", &Options::block_mask)
      .def_rw("block_mask_block_size", &Options::block_mask_block_size)
      .def_rw("attn_mask", &Options::attn_mask)
      .def_rw("attn_mask_dtype", &Options::attn_mask_dtype)
      .def_rw("dbias", &Options::dbias)
      .def_rw("causal_alignment", &Options::causal_alignment)
      .def_rw("kernel", &Options::kernel)
      .def_rw("backward_kernel", &Options::backward_kernel)
      .def_rw("flex_block_states", &Options::flex_block_states)
      .def_rw("flex_partial_index", &Options::flex_partial_index)
      .def_rw("flex_partial_blocks", &Options::flex_partial_blocks)
      .def_rw("flex_block_size", &Options::flex_block_size)
      .def_rw("flex_seqlen_q", &Options::flex_seqlen_q)
      .def_rw("flex_seqlen_k", &Options::flex_seqlen_k)
      .def_rw("flex_score_a", &Options::flex_score_a)
      .def_rw("flex_score_c", &Options::flex_score_c);

  m.def(
      "forward",
      [](In q, In k, In v, Array o, Array lse, const Dtypes& dtypes, const Options& opt) {
        const flashattn::AttentionOptions options = opt.get();
        nb::gil_scoped_release release;
        flashattn::forward(in(q, dtypes, "q"), in(k, dtypes, "k"), in(v, dtypes, "v"), out(o, dtypes, "out"),
                           out(lse, "f32", "softmax_lse"), options);
      },
      "q, k, v (B, S, H, D) -> out, lse written in place");

  m.def(
      "backward",
      [](In dout, In q, In k, In v, In o, In lse, Array dq, Array dk, Array dv,
         const Dtypes& dtypes, const Options& opt) {
        const flashattn::AttentionOptions options = opt.get();
        nb::gil_scoped_release release;
        flashattn::backward(in(dout, dtypes, "dout"), in(q, dtypes, "q"), in(k, dtypes, "k"), in(v, dtypes, "v"),
                            in(o, dtypes, "out"), in(lse, dtypes, "softmax_lse"), out(dq, dtypes, "dq"),
                            out(dk, dtypes, "dk"), out(dv, dtypes, "dv"), options);
      },
      "gradients written into dq, dk, dv");

  m.def(
      "forward_varlen",
      [](In q, In k, In v, In cu_q, In cu_k, std::int64_t max_q, std::int64_t max_k,
         Array o, Array lse, const Dtypes& dtypes, const Options& opt) {
        const flashattn::AttentionOptions options = opt.get();
        const flashattn::VarlenSeqlens s{in(cu_q, "i32", "cu_seqlens_q"), in(cu_k, "i32", "cu_seqlens_k"), max_q,
                                         max_k};
        nb::gil_scoped_release release;
        flashattn::forward_varlen(in(q, dtypes, "q"), in(k, dtypes, "k"), in(v, dtypes, "v"), s,
                                  out(o, dtypes, "out"), out(lse, "f32", "softmax_lse"), options);
      },
      "packed variable-length batch: q (total_q, H, D) ...");

  m.def(
      "backward_varlen",
      [](In dout, In q, In k, In v, In o, In lse, In cu_q, In cu_k,
         std::int64_t max_q, std::int64_t max_k, Array dq, Array dk, Array dv, const Dtypes& dtypes,
         const Options& opt) {
        const flashattn::AttentionOptions options = opt.get();
        const flashattn::VarlenSeqlens s{in(cu_q, "i32", "cu_seqlens_q"), in(cu_k, "i32", "cu_seqlens_k"), max_q,
                                         max_k};
        nb::gil_scoped_release release;
        flashattn::backward_varlen(in(dout, dtypes, "dout"), in(q, dtypes, "q"), in(k, dtypes, "k"),
                                   in(v, dtypes, "v"), in(o, dtypes, "out"), in(lse, dtypes, "softmax_lse"), s,
                                   out(dq, dtypes, "dq"), out(dk, dtypes, "dk"), out(dv, dtypes, "dv"), options);
      },
      "gradients of a packed variable-length batch");

  m.def(
      "forward_varlen_paged",
      [](In q, In cu_q, std::int64_t max_q, In k_cache, In v_cache, In block_table, In seqused_k,
         std::optional<In> k_scale, std::optional<In> v_scale, std::optional<In> prefix_block_table,
         std::optional<In> prefix_seqused_k, std::optional<In> prefix_idx, Array o, Array lse,
         const Dtypes& dtypes, const Options& opt, std::optional<In> k_zero, std::optional<In> v_zero,
         const Quants& quants) {
        const flashattn::AttentionOptions options = opt.get();
        flashattn::PagedKvBatch kv{in(k_cache, dtypes, "k_cache"),
                                   in(v_cache, dtypes, "v_cache"),
                                   in(block_table, "i32", "block_table"),
                                   in(seqused_k, "i32", "seqused_k"),
                                   optional_in(k_scale, "f32", "k_scale"),
                                   optional_in(v_scale, "f32", "v_scale")};
        kv.prefix_block_table = optional_in(prefix_block_table, "i32", "prefix_block_table");
        kv.prefix_seqused_k = optional_in(prefix_seqused_k, "i32", "prefix_seqused_k");
        kv.prefix_idx = optional_in(prefix_idx, "i32", "prefix_idx");
        kv.k_quant = kv_quant(quants, "k_quant");
        kv.v_quant = kv_quant(quants, "v_quant");
        kv.k_zero_point = optional_in(k_zero, "f32", "k_zero_point");
        kv.v_zero_point = optional_in(v_zero, "f32", "v_zero_point");
        nb::gil_scoped_release release;
        flashattn::forward_varlen_paged(in(q, dtypes, "q"), in(cu_q, "i32", "cu_seqlens_q"), max_q, kv,
                                        out(o, dtypes, "out"), out(lse, "f32", "softmax_lse"), options);
      },
      "paged variable-length batch: q (total_q, H, D) over page pools through block_table, with shared prefixes "
      "(prefix_block_table, prefix_seqused_k, prefix_idx) or not");

  m.def(
      "attention_probs",
      [](In q, In k, In v, Array probs, const Dtypes& dtypes, const Options& opt, std::int64_t batch_offset) {
        const flashattn::AttentionOptions options = opt.get();
        nb::gil_scoped_release release;
        const flashattn::Tensor p = flashattn::reference::attention_probs(in(q, dtypes, "q"), in(k, dtypes, "k"),
                                                                          in(v, dtypes, "v"), options, batch_offset);
        const flashattn::MutableTensorView dst = out(probs, "f32", "S_dmask");
        bool same = dst.rank == 4 && p.shape().size() == 4;
        for (int d = 0; same && d < 4; ++d) same = dst.shape[d] == p.shape()[static_cast<std::size_t>(d)];
        if (!same) throw flashattn::Error("S_dmask: shape is not (batch, heads_q, seqlen_q, seqlen_k) of these inputs");
        // dst may be a view into a larger buffer (a sequence's corner of the varlen S_dmask).
        const float* src = p.data_as<float>();
        auto* base = static_cast<float*>(dst.data);
        for (std::int64_t b = 0; b < dst.shape[0]; ++b)
          for (std::int64_t h = 0; h < dst.shape[1]; ++h)
            for (std::int64_t i = 0; i < dst.shape[2]; ++i)
              for (std::int64_t j = 0; j < dst.shape[3]; ++j)
                base[b * dst.strides[0] + h * dst.strides[1] + i * dst.strides[2] + j * dst.strides[3]] = *src++;
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("probs"), nb::arg("dtypes"), nb::arg("options"),
      nb::arg("batch_offset") = 0,
      "dropped-and-scaled attention probabilities (B, Hq, Sq, Sk), float32 (testing only); batch_offset: the batch "
      "index of batch element 0 for dropout (a varlen sequence's own)");

  m.def(
      "forward_with_kvcache",
      [](In q, Array k_cache, Array v_cache, std::optional<In> k, std::optional<In> v,
         std::optional<In> cos, std::optional<In> sin, std::optional<In> cache_seqlens,
         std::optional<In> cache_batch_idx, std::optional<In> cache_leftpad, std::optional<In> block_table,
         bool interleaved, Array o, Array lse, const Dtypes& dtypes,
         std::optional<Array> k_scale, std::optional<Array> v_scale, const Options& opt, std::optional<In> cu_q,
         std::optional<In> cu_new, std::int64_t max_q, std::optional<Array> k_zero, std::optional<Array> v_zero,
         const Quants& quants) {
        const flashattn::AttentionOptions options = opt.get();
        flashattn::KvCache c;
        c.k_cache = out(k_cache, dtypes, "k_cache");
        c.v_cache = out(v_cache, dtypes, "v_cache");
        if (k_scale) c.k_scale = out(*k_scale, "f32", "k_scale");
        if (v_scale) c.v_scale = out(*v_scale, "f32", "v_scale");
        if (k_zero) c.k_zero_point = out(*k_zero, "f32", "k_zero_point");
        if (v_zero) c.v_zero_point = out(*v_zero, "f32", "v_zero_point");
        c.k_quant = kv_quant(quants, "k_quant");
        c.v_quant = kv_quant(quants, "v_quant");
        c.k = optional_in(k, dtypes, "k");
        c.v = optional_in(v, dtypes, "v");
        c.rotary_cos = optional_in(cos, "f32", "rotary_cos");
        c.rotary_sin = optional_in(sin, "f32", "rotary_sin");
        c.cache_seqlens = optional_in(cache_seqlens, "i32", "cache_seqlens");
        c.cache_batch_idx = optional_in(cache_batch_idx, "i32", "cache_batch_idx");
        c.cache_leftpad = optional_in(cache_leftpad, "i32", "cache_leftpad");
        c.block_table = optional_in(block_table, "i32", "block_table");
        c.rotary_interleaved = interleaved;
        c.cu_seqlens_q = optional_in(cu_q, "i32", "cu_seqlens_q");
        c.cu_seqlens_k_new = optional_in(cu_new, "i32", "cu_seqlens_k_new");
        c.max_seqlen_q = max_q;
        nb::gil_scoped_release release;
        flashattn::forward_with_kvcache(in(q, dtypes, "q"), c, out(o, dtypes, "out"), out(lse, "f32", "softmax_lse"),
                                        options);
      },
      "attention over a KV cache (of q's dtype, or u8 codes — FP8 e4m3, u8 or s8 as k_quant, v_quant say — with "
      "k_scale, v_scale and for u8 k_zero_point, v_zero_point), appending k, v in place");

  m.def(
      "forward_fp8",
      [](In q, In q_descale, const std::string& q_format, std::int64_t q_block, In k, In k_descale,
         const std::string& k_format, std::int64_t k_block, In v, In v_descale, const std::string& v_format,
         std::int64_t v_block, Array o, Array lse, const std::string& out_dtype, const Options& opt) {
        const flashattn::AttentionOptions options = opt.get();
        const flashattn::Fp8View qv = fp8_in(q, q_descale, q_format, q_block, "q", "q_descale");
        const flashattn::Fp8View kv = fp8_in(k, k_descale, k_format, k_block, "k", "k_descale");
        const flashattn::Fp8View vv = fp8_in(v, v_descale, v_format, v_block, "v", "v_descale");
        nb::gil_scoped_release release;
        flashattn::forward_fp8(qv, kv, vv, out(o, out_dtype, "out"), out(lse, "f32", "softmax_lse"), options);
      },
      "FP8 forward (forward_fp8): codes and descales per tensor or per block of rows -> out, lse in place");

  m.def(
      "merge_attention_states",
      [](In outs, In lses, Array o, Array lse, const std::string& out_dtype, int num_threads) {
        Options::record_threads(num_threads);
        nb::gil_scoped_release release;
        flashattn::merge_attention_states(in(outs, "f32", "out_partial"), in(lses, "f32", "lse_partial"),
                                          out(o, out_dtype, "out"), out(lse, "f32", "softmax_lse"), num_threads);
      },
      "partial (out, lse) pairs over disjoint key sets merged exactly: outs (splits, B, Sq, H, Dv), lses (splits, "
      "B, H, Sq)");

  m.def(
      "hadamard_rotate",
      [](In x, Array y, const std::string& dtype, std::uint64_t seed) {
        const flashattn::TensorView xv = in(x, dtype, "x");
        const flashattn::MutableTensorView yv = out(y, "f32", "out");
        nb::gil_scoped_release release;
        flashattn::hadamard_rotate(xv, yv, seed);
      },
      "y = x R along the last dimension, R = H diag(signs(seed)) / sqrt(n), x zero-padded to n");
  m.def("hadamard_dim", &flashattn::hadamard_dim, "the transform's size for rows of dim features");

  m.def(
      "plan",
      [](In q, In k, In v, const Dtypes& dtypes, const Options& opt) {
        const flashattn::AttentionOptions options = opt.get();
        // The calls forward() and backward() make: the same problem, hardware and planner.
        const flashattn::AttentionProblem problem = flashattn::AttentionProblem::from_inputs(
            in(q, dtypes, "q"), in(k, dtypes, "k"), in(v, dtypes, "v"), options);
        const flashattn::CpuHardware hw = flashattn::CpuHardware::detect(options.num_threads);
        nb::dict d;
        d["forward"] = forward_plan_dict(
            flashattn::plan_forward(problem, hw, options));
        d["backward"] = backward_plan_dict(
            flashattn::plan_backward(problem, hw, options.deterministic, options.backward_kernel));
        d["problem"] = problem.describe();
        return d;
      },
      "the forward and backward plans the library runs for these inputs and options");

  m.def("simd_target", &flashattn::cpu_simd_target, "the SIMD target the CPU kernels dispatch to");
  m.def(
      "thread_budget", [](int requested) { return flashattn::CpuHardware::detect(requested).threads; },
      "worker threads a call may use with options.num_threads = requested (0: the OpenMP default)");
  m.def(
      "cpu_hardware",
      [] {
        const flashattn::CpuHardware hw = flashattn::CpuHardware::detect(0);
        return std::map<std::string, std::string>{
            {"simd_target", hw.simd_target},
            {"threads", std::to_string(hw.threads)},
            {"l1d_bytes", std::to_string(hw.l1d_bytes)},
            {"l2_bytes", std::to_string(hw.l2_bytes)},
            {"tiled_bf16", hw.bf16_dot ? "1" : "0"},
            {"tiled_bf16_default", hw.bf16_dot_fast ? "1" : "0"},
            {"decode_fp16", hw.decode_fp16 ? "1" : "0"},
            {"decode_bf16", hw.decode_bf16 ? "1" : "0"},
            {"int8_dot", hw.int8_dot ? "1" : "0"},
            {"amx_bf16", hw.amx_bf16 ? "1" : "0"},
        };
      },
      "what the planner knows of this CPU (CpuHardware::detect), as strings");
  m.def(
      "last_thread_budget", [] { return Options::last_threads().load(); },
      "the thread budget of the latest call (0 before the first)");
}
