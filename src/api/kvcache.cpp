// forward_with_kvcache in its steps: check the call, resolve its sequences (each checked,
// the backend's checks included), append the new tokens (rotated) into their cache slots,
// rotate q, then attend every sequence through the backend — a view of the cache when it
// is contiguous, the page pools read through the block table when it is paged. A quantized
// cache quantizes on append (fp8_append, int8_append below) and the kernels dequantize.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/error.hpp"
#include "flashattn/plan.hpp"
#include "src/core/element.hpp"
#include "src/api/backend.hpp"
#include "src/api/checks.hpp"
#include "src/api/kv_quant.hpp"
#include "src/api/route.hpp"
#include "src/api/sequences.hpp"
#include "src/core/validate.hpp"

namespace flashattn {
namespace {

std::string str(std::int64_t v) { return std::to_string(v); }
bool is_set(const TensorView& t) { return t.data != nullptr || t.rank != 0; }

std::vector<std::int64_t> read_i32(const char* name, const TensorView& t, std::int64_t batch) {
  detail::check_view(name, t, 1, "(batch)");
  detail::check_dtype(name, t, DType::i32, "int32");
  detail::check_shape(name, t, {batch}, "(batch)");
  std::vector<std::int64_t> r(static_cast<std::size_t>(batch));
  for (std::int64_t b = 0; b < batch; ++b)
    r[static_cast<std::size_t>(b)] = static_cast<const std::int32_t*>(t.data)[b * t.strides[0]];
  return r;
}

// Where logical token `pos` of sequence b lives: (cache row, slot) of a 4-d cache view.
struct Layout {
  bool paged = false;
  std::int64_t page_size = 0, capacity = 0;
  std::vector<std::int64_t> batch_idx;  // contiguous
  TensorView block_table;               // paged
  std::pair<std::int64_t, std::int64_t> locate(std::int64_t b, std::int64_t pos) const {
    if (!paged) return {batch_idx[static_cast<std::size_t>(b)], pos};
    const auto* t = static_cast<const std::int32_t*>(block_table.data);
    return {t[b * block_table.strides[0] + (pos / page_size) * block_table.strides[1]], pos % page_size};
  }
};

// out[0, d) = x rotated at `pos` over its first rotary_dim features (the rest copied).
void rotate(const KvCache& c, std::int64_t pos, const float* x, float* out, std::int64_t d) {
  std::copy(x, x + d, out);
  if (!is_set(c.rotary_cos)) return;
  const std::int64_t half = c.rotary_cos.shape[1];
  for (std::int64_t i = 0; i < half; ++i) {
    const float cos = detail::load_element(c.rotary_cos, pos * c.rotary_cos.strides[0] + i * c.rotary_cos.strides[1]);
    const float sin = detail::load_element(c.rotary_sin, pos * c.rotary_sin.strides[0] + i * c.rotary_sin.strides[1]);
    const std::int64_t a = c.rotary_interleaved ? 2 * i : i, b = c.rotary_interleaved ? 2 * i + 1 : i + half;
    out[a] = x[a] * cos - x[b] * sin;
    out[b] = x[a] * sin + x[b] * cos;
  }
}

// One kv head's descale in an FP8 scale view (pages or cache rows, heads_kv).
float& descale_at(const MutableTensorView& scale, std::int64_t page, std::int64_t h) {
  return static_cast<float*>(scale.data)[page * scale.strides[0] + h * scale.strides[1]];
}

// Appends `count` rows (width floats each, already rotated) of kv head h of sequence b at
// positions seqlen.. into an FP8 e4m3 pool, page by page (a contiguous cache row is one
// page). A page's descale is a power-of-two multiple of where it started: a page without
// tokens starts from FLT_MIN; when the new rows' largest magnitude exceeds 448·descale the
// descale doubles until it fits and the page's earlier codes are re-encoded for it. The
// division by a power of two is exact for normal codes; only codes that fall into the
// subnormal range round again, to a grid twice as coarse or more each time. Hence every
// stored x comes back as x̂ with |x̂ − x| ≤ 2^-4·|x| + 2^-9·descale (half an e4m3 ulp, plus
// the subnormal roundings summed as a geometric series), and descale < 2·amax(page)/448.
void fp8_append(const MutableTensorView& pool, const MutableTensorView& scale, const Layout& layout,
                std::int64_t b, std::int64_t h, std::int64_t first, std::int64_t seqlen, const float* rows,
                std::int64_t count, std::int64_t width) {
  constexpr float kMax = fp8_info(Fp8Format::e4m3).max;
  std::vector<float> decoded(static_cast<std::size_t>(width));
  auto codes = [&](std::int64_t page, std::int64_t slot) {
    return static_cast<std::uint8_t*>(pool.data) + detail::offset4(pool, page, slot, h, 0);
  };
  for (std::int64_t t = 0; t < count;) {
    const auto [page, slot] = layout.locate(b, seqlen + t);
    const std::int64_t page_start = seqlen + t - slot;  // logical position of slot 0
    const std::int64_t span = layout.paged ? std::min(count - t, layout.page_size - slot) : count - t;
    const std::int64_t old_begin = std::max(page_start, first) - page_start;
    const std::int64_t old_end = std::min(seqlen - page_start, slot);
    float amax = 0.0f;
    for (std::int64_t e = 0; e < span * width; ++e) amax = std::max(amax, std::fabs(rows[t * width + e]));
    float& stored = descale_at(scale, page, h);
    float descale = old_end > old_begin ? stored : FLT_MIN;
    float grown = descale;
    // A stored subnormal descale grows to a normal one: the codes are made with 1 / descale.
    while (amax > kMax * grown || grown < FLT_MIN) grown *= 2.0f;
    if (grown != descale) {
      for (std::int64_t i = old_begin; i < old_end; ++i) {
        convert_from_fp8(codes(page, i), decoded.data(), static_cast<std::size_t>(width), Fp8Format::e4m3,
                         descale / grown);
        convert_to_fp8(decoded.data(), codes(page, i), static_cast<std::size_t>(width), Fp8Format::e4m3);
      }
      descale = grown;
    }
    for (std::int64_t i = 0; i < span; ++i)
      convert_to_fp8(rows + (t + i) * width, codes(page, slot + i), static_cast<std::size_t>(width), Fp8Format::e4m3,
                     1.0f / descale);
    stored = descale;
    t += span;
  }
}

// Appends `count` rows (width floats each, already rotated) of kv head h of sequence b at
// positions seqlen.. into a pool of int8 codes (kv_quant.hpp): per token, each row's scale
// (and zero point) computed from it and written to its slot's; per page, read from the page's.
void int8_append(const MutableTensorView& pool, const detail::PoolScales& scales, const MutableTensorView& scale,
                 const MutableTensorView& zero_point, const Layout& layout, std::int64_t b, std::int64_t h,
                 std::int64_t seqlen, const float* rows, std::int64_t count, std::int64_t width) {
  for (std::int64_t t = 0; t < count; ++t) {
    const auto [page, slot] = layout.locate(b, seqlen + t);
    const std::int64_t at = scales.offset(page, slot, h);
    float row_scale = static_cast<const float*>(scale.data)[at];
    float row_zero = zero_point.data != nullptr ? static_cast<const float*>(zero_point.data)[at] : 0.0f;
    quantize_int8(scales.quant.codes, rows + t * width, width, scales.per_token(), &row_scale, &row_zero,
                  static_cast<std::uint8_t*>(pool.data) + detail::offset4(pool, page, slot, h, 0));
    if (!scales.per_token()) continue;
    static_cast<float*>(scale.data)[at] = row_scale;
    if (zero_point.data != nullptr) static_cast<float*>(zero_point.data)[at] = row_zero;
  }
}

// The append writes each new token to one slot: no two sequences may write one cache row
// (contiguous) or page, and a page that receives tokens may not also be read through another
// entry of the block table — the write would change what that entry holds.
void check_append_targets(const Layout& layout, const std::vector<std::int64_t>& seqlens,
                          const std::vector<std::int64_t>& added, std::int64_t batch) {
  auto entry = [](std::int64_t b, std::int64_t i) { return "[" + str(b) + ", " + str(i) + "]"; };
  std::map<std::int64_t, std::pair<std::int64_t, std::int64_t>> written;  // cache row or page -> (b, table column)
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t n = seqlens[static_cast<std::size_t>(b)], s_new = added[static_cast<std::size_t>(b)];
    if (s_new == 0) continue;
    const std::int64_t first = layout.paged ? n / layout.page_size : 0;
    const std::int64_t last = layout.paged ? (n + s_new - 1) / layout.page_size : 0;
    for (std::int64_t pg = first; pg <= last; ++pg) {
      const std::int64_t target = layout.locate(b, layout.paged ? pg * layout.page_size : 0).first;
      const auto [it, fresh] = written.emplace(target, std::pair{b, pg});
      if (!fresh)
        throw Error(layout.paged ? "block_table: page " + str(target) + " receives new tokens through both " +
                                       entry(it->second.first, it->second.second) + " and " + entry(b, pg) +
                                       "; an appended page must belong to one sequence"
                                 : "cache_batch_idx: sequences " + str(it->second.first) + " and " + str(b) +
                                       " both append to cache row " + str(target));
    }
  }
  if (!layout.paged) return;
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t pages =
        (seqlens[static_cast<std::size_t>(b)] + added[static_cast<std::size_t>(b)] + layout.page_size - 1) /
        layout.page_size;
    for (std::int64_t pg = 0; pg < pages; ++pg) {
      const std::int64_t page = layout.locate(b, pg * layout.page_size).first;
      const auto it = written.find(page);
      if (it != written.end() && it->second != std::pair{b, pg})
        throw Error("block_table: page " + str(page) + " receives new tokens through " +
                    entry(it->second.first, it->second.second) + " but is also read through " + entry(b, pg));
    }
  }
}

// A KV cache call, checked: its sizes, where each sequence's tokens are and how many it has.
struct CacheCall {
  bool quantized = false;  // u8 codes, read as k_scales and v_scales say
  bool varlen = false;  // q, k, v packed, sequences cut by cu_seqlens_q and cu_seqlens_k_new
  std::int64_t batch = 0, hq = 0, hkv = 0, d = 0, dv = 0;
  std::vector<std::int64_t> cu_q, cu_new;  // varlen: the offsets of query rows and new tokens
  std::vector<std::int64_t> added;         // new tokens of each sequence
  Layout layout;
  std::vector<std::int64_t> seqlens, leftpad;
  bool positions_per_query = false;  // q rotated at cache_seqlens[b] + i (else at cache_seqlens[b])
  std::int64_t rotary_dim = 0;

  std::size_t at(std::int64_t b) const { return static_cast<std::size_t>(b); }
  // Sequence b's query rows of q or out, its lse, its new tokens of k or v: (1, rows, heads, dim) views.
  template <class View>
  View queries(const View& t, std::int64_t b) const {
    return varlen ? detail::packed_sequence(t, cu_q[at(b)], cu_q[at(b) + 1] - cu_q[at(b)]) : detail::batch_element(t, b);
  }
  template <class View>
  View lse_of(const View& t, std::int64_t b) const {
    return varlen ? detail::packed_lse(t, cu_q[at(b)], cu_q[at(b) + 1] - cu_q[at(b)]) : detail::batch_element(t, b);
  }
  template <class View>
  View new_tokens(const View& t, std::int64_t b) const {
    return varlen ? detail::packed_sequence(t, cu_new[at(b)], added[at(b)]) : detail::batch_element(t, b);
  }
};

detail::PoolScales k_scales(const KvCache& c) {
  return {"k_cache", "k_scale", "k_zero_point", "k_quant", c.k_quant, c.k_scale, c.k_zero_point};
}
detail::PoolScales v_scales(const KvCache& c) {
  return {"v_cache", "v_scale", "v_zero_point", "v_quant", c.v_quant, c.v_scale, c.v_zero_point};
}

// Step 1, the call's own arguments, checked in this order; nothing is written.
// The views and dtypes of q and the cache pools, and the call's sizes.
CacheCall check_cache_views(const TensorView& q, const KvCache& c, const AttentionOptions& options) {
  detail::reject_rescale_counts("forward_with_kvcache", options);
  detail::reject_attn_mask("forward_with_kvcache", options);
  detail::reject_top_left("forward_with_kvcache", options);
  detail::reject_score_hook("forward_with_kvcache", options);
  CacheCall r;
  r.varlen = is_set(c.cu_seqlens_q);
  if (r.varlen)
    detail::check_view("q", q, 3, "(total_q, heads_q, head_dim)");
  else
    detail::check_view("q", q, 4, "(batch, seqlen_q, heads_q, head_dim)");
  r.quantized = detail::check_cache_pools(
      q, c.k_cache, c.v_cache, k_scales(c), v_scales(c), "(batch_cache or pages, seqlen_cache or page_size, heads_kv, head_dim)",
      "(batch_cache or pages, seqlen_cache or page_size, heads_kv, head_dim_v)");
  r.hq = q.shape[r.varlen ? 1 : 2], r.hkv = c.k_cache.shape[2], r.d = c.k_cache.shape[3], r.dv = c.v_cache.shape[3];
  if (!r.varlen) {
    if (is_set(c.cu_seqlens_k_new)) throw Error("cu_seqlens_k_new: set without cu_seqlens_q (a packed batch)");
    r.batch = q.shape[0];
    r.added.assign(r.at(r.batch), is_set(c.k) ? c.k.shape[1] : 0);
    return r;
  }
  if (options.dropout_p != 0.0f)
    throw Error("dropout_p: " + std::to_string(options.dropout_p) +
                " not supported by a packed KV-cache batch (cu_seqlens_q: it runs as forward_varlen_paged, "
                "which is inference only)");
  r.cu_q = detail::read_offsets("cu_seqlens_q", c.cu_seqlens_q, q.shape[0], c.max_seqlen_q, "max_seqlen_q");
  r.batch = static_cast<std::int64_t>(r.cu_q.size()) - 1;
  if (!is_set(c.block_table))
    throw Error("cu_seqlens_q: a packed KV-cache batch needs a paged cache (block_table)");
  r.cu_new.assign(r.cu_q.size(), 0);
  if (is_set(c.k)) {
    if (!is_set(c.cu_seqlens_k_new))
      throw Error("cu_seqlens_k_new: packed new k, v (total_new, heads_kv, head_dim) need their offsets");
    detail::check_view("k", c.k, 3, "(total_new, heads_kv, head_dim)");
    r.cu_new = detail::read_offsets("cu_seqlens_k_new", c.cu_seqlens_k_new, c.k.shape[0], c.k.shape[0], "total_new");
    if (r.cu_new.size() != r.cu_q.size())
      throw Error("cu_seqlens_k_new: batch " + str(static_cast<std::int64_t>(r.cu_new.size()) - 1) +
                  " but cu_seqlens_q has batch " + str(r.batch));
  } else if (is_set(c.cu_seqlens_k_new)) {
    throw Error("cu_seqlens_k_new: set without new k, v");
  }
  for (std::int64_t b = 0; b < r.batch; ++b) r.added.push_back(r.cu_new[r.at(b) + 1] - r.cu_new[r.at(b)]);
  return r;
}

// Where each sequence's tokens live: the block table (paged) or the cache rows (contiguous).
void resolve_layout(const KvCache& c, CacheCall& r) {
  const std::int64_t batch = r.batch;
  Layout& layout = r.layout;
  layout.paged = is_set(c.block_table);
  if (layout.paged) {
    detail::check_view("block_table", c.block_table, 2, "(batch, max_pages_per_seq)");
    detail::check_dtype("block_table", c.block_table, DType::i32, "int32 page numbers");
    if (c.block_table.shape[0] != batch)
      throw Error("block_table: " + str(c.block_table.shape[0]) + " rows but q has batch " + str(batch));
    if (is_set(c.cache_batch_idx)) throw Error("cache_batch_idx: not supported with a paged cache (block_table)");
    layout.page_size = c.k_cache.shape[1];
    if (layout.page_size < 1) throw Error("k_cache: page size " + str(layout.page_size) + " must be >= 1");
    layout.capacity = c.block_table.shape[1] * layout.page_size;
    layout.block_table = c.block_table;
  } else {
    layout.capacity = c.k_cache.shape[1];
    layout.batch_idx = is_set(c.cache_batch_idx) ? read_i32("cache_batch_idx", c.cache_batch_idx, batch)
                                                  : std::vector<std::int64_t>(static_cast<std::size_t>(batch));
    if (!is_set(c.cache_batch_idx)) {
      if (batch > c.k_cache.shape[0])
        throw Error("k_cache: " + str(c.k_cache.shape[0]) + " cache rows but q has batch " + str(batch) +
                    " (sequence b reads row b unless cache_batch_idx says otherwise)");
      for (std::int64_t b = 0; b < batch; ++b) layout.batch_idx[static_cast<std::size_t>(b)] = b;
    }
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t row = layout.batch_idx[static_cast<std::size_t>(b)];
      if (row < 0 || row >= c.k_cache.shape[0])
        throw Error("cache_batch_idx: [" + str(b) + "] = " + str(row) + " outside the cache's " +
                    str(c.k_cache.shape[0]) + " rows");
    }
  }
}

// How many tokens each sequence holds and where they start, and the pages they span.
void resolve_sequences(const KvCache& c, CacheCall& r) {
  const std::int64_t batch = r.batch;
  const Layout& layout = r.layout;
  if (is_set(c.cache_seqlens)) {
    r.seqlens = read_i32("cache_seqlens", c.cache_seqlens, batch);
  } else {  // every sequence fills the cache
    for (std::int64_t b = 0; b < batch; ++b) {
      if (r.added[r.at(b)] > layout.capacity)
        throw Error("k: " + str(r.added[r.at(b)]) + " new tokens of sequence " + str(b) +
                    " do not fit the cache capacity " + str(layout.capacity) +
                    " (cache_seqlens unset: the cache holds capacity minus the new tokens)");
      r.seqlens.push_back(layout.capacity - r.added[r.at(b)]);
    }
  }
  const std::vector<std::int64_t>& seqlens = r.seqlens;
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t n = seqlens[static_cast<std::size_t>(b)], s_new = r.added[r.at(b)];
    if (n < 0 || n + s_new > layout.capacity)
      throw Error("cache_seqlens: [" + str(b) + "] = " + str(n) + " plus " + str(s_new) +
                  " new tokens does not fit the cache capacity " + str(layout.capacity));
  }
  // Upstream rejects left padding with a paged cache too: a sequence's pages are its own,
  // so there is nothing to pad.
  if (is_set(c.cache_leftpad) && layout.paged)
    throw Error("cache_leftpad: not supported with a paged cache (block_table)");
  r.leftpad = is_set(c.cache_leftpad) ? read_i32("cache_leftpad", c.cache_leftpad, batch)
                                      : std::vector<std::int64_t>(static_cast<std::size_t>(batch), 0);
  const std::vector<std::int64_t>& leftpad = r.leftpad;
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t pad = leftpad[static_cast<std::size_t>(b)], n = seqlens[static_cast<std::size_t>(b)];
    if (pad < 0 || pad > n)
      throw Error("cache_leftpad: [" + str(b) + "] = " + str(pad) + " outside [0, cache_seqlens[" + str(b) +
                  "] = " + str(n) + "]");
  }
  if (layout.paged) {
    const auto* t = static_cast<const std::int32_t*>(c.block_table.data);
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t pages = (seqlens[r.at(b)] + r.added[r.at(b)] + layout.page_size - 1) / layout.page_size;
      for (std::int64_t pg = 0; pg < pages; ++pg) {
        const std::int64_t page = t[b * c.block_table.strides[0] + pg * c.block_table.strides[1]];
        if (page < 0 || page >= c.k_cache.shape[0])
          throw Error("block_table: [" + str(b) + ", " + str(pg) + "] = " + str(page) + " outside the cache's " +
                      str(c.k_cache.shape[0]) + " pages");
      }
    }
  }
}

// A quantized cache's scales (and zero points): apart from the cache, q and the new tokens,
// and finite (scales positive) wherever they are read: the slots that hold tokens, and — int8
// codes per page, which appends read — the pages that receive them.
void check_scales(const TensorView& q, const KvCache& c, const CacheCall& r) {
  const Layout& layout = r.layout;
  const detail::NamedView views[] = {{"k_scale", c.k_scale}, {"v_scale", c.v_scale}, {"k_zero_point", c.k_zero_point},
                                     {"v_zero_point", c.v_zero_point}};
  for (std::size_t i = 0; i < std::size(views); ++i) {
    if (!is_set(views[i].view)) continue;
    for (const auto& [other, view] : {std::pair{"k_cache", TensorView(c.k_cache)}, {"v_cache", c.v_cache}, {"q", q},
                                      {"k", c.k}, {"v", c.v}})
      detail::check_no_overlap(views[i].name, views[i].view, other, view);
    for (std::size_t o = 0; o < i; ++o)
      if (is_set(views[o].view)) detail::check_no_overlap(views[i].name, views[i].view, views[o].name, views[o].view);
  }
  for (const detail::PoolScales& pool : {k_scales(c), v_scales(c)}) {
    const bool append_reads = pool.quant.codes != KvCodes::e4m3 && !pool.per_token();
    for (std::int64_t b = 0; b < r.batch; ++b) {
      const std::int64_t first = r.leftpad[r.at(b)], n = r.seqlens[r.at(b)];
      const std::int64_t end = n + (append_reads ? r.added[r.at(b)] : 0);
      const std::int64_t step = layout.paged ? layout.page_size : std::max<std::int64_t>(end, 1);
      for (std::int64_t pos = first / step * step; pos < end; pos += step) {
        const auto [page, slot] = layout.locate(b, std::max(pos, first));
        detail::check_scale_values(pool, page, slot, slot + std::min(end, pos + step) - std::max(pos, first), r.hkv,
                                   [&, pos = pos] {
                                     return "sequence " + str(b) + " has tokens there" +
                                            (append_reads && pos + step > n ? " or appends to it" : "");
                                   });
      }
    }
  }
}

// The new tokens to append.
void check_new_tokens(const TensorView& q, const KvCache& c, const CacheCall& r) {
  const std::int64_t batch = r.batch, hkv = r.hkv, d = r.d, dv = r.dv;
  if (is_set(c.k) != is_set(c.v)) throw Error("k, v: the new keys and values come together");
  if (is_set(c.k)) {
    if (r.varlen) {
      const std::int64_t total = r.cu_new.back();
      detail::check_view("v", c.v, 3, "(total_new, heads_kv, head_dim_v)");
      detail::check_dtype("k", c.k, q.dtype, "new keys have q's dtype");
      detail::check_dtype("v", c.v, q.dtype, "new values have q's dtype");
      detail::check_shape("k", c.k, {total, hkv, d}, "(total_new, heads_kv, head_dim)");
      detail::check_shape("v", c.v, {total, hkv, dv}, "(total_new, heads_kv, head_dim_v)");
    } else {
      detail::check_view("k", c.k, 4, "(batch, seqlen_new, heads_kv, head_dim)");
      detail::check_view("v", c.v, 4, "(batch, seqlen_new, heads_kv, head_dim_v)");
      const std::int64_t s_new = c.k.shape[1];  // batch 0 has no added[0]
      detail::check_dtype("k", c.k, q.dtype, "new keys have q's dtype");
      detail::check_dtype("v", c.v, q.dtype, "new values have q's dtype");
      detail::check_shape("k", c.k, {batch, s_new, hkv, d}, "(batch, seqlen_new, heads_kv, head_dim)");
      detail::check_shape("v", c.v, {batch, s_new, hkv, dv}, "(batch, seqlen_new, heads_kv, head_dim_v)");
    }
    for (const auto& [name, input] : {std::pair{"k", c.k}, {"v", c.v}, {"q", q}}) {
      detail::check_no_overlap("k_cache", c.k_cache, name, input);
      detail::check_no_overlap("v_cache", c.v_cache, name, input);
    }
  }
}

// A quantized cache's new tokens as the append stores them, keys rotated: finite (no finite
// scale represents ±∞, and a NaN code would read back as a number) — a non-finite rotary
// entry, or a rotation that overflows, named as such. After check_rotary: its tables are
// known to cover every position.
void check_quantized_tokens(const KvCache& c, const CacheCall& r) {
  if (!r.quantized || !is_set(c.k)) return;
  std::vector<float> row(static_cast<std::size_t>(std::max(r.d, r.dv))), rotated(row.size());
  for (const auto& [name_of, input, keys] : {std::tuple{"k", c.k, true}, {"v", c.v, false}})
    for (std::int64_t b = 0; b < r.batch; ++b) {
      const std::string name = name_of;  // a lambda may not capture a structured binding (clang)
      const TensorView rows = r.new_tokens(input, b);
      const std::int64_t width = rows.shape[3], position = r.seqlens[r.at(b)];
      for (std::int64_t t = 0; t < rows.shape[1]; ++t)
        for (std::int64_t h = 0; h < r.hkv; ++h) {
          const auto where = [&](std::int64_t e) {
            return name + ": [" + str(b) + ", " + str(t) + ", " + str(h) + ", " + str(e) + "]";
          };
          for (std::int64_t e = 0; e < width; ++e) {
            row[e] = detail::load_element(rows, detail::offset4(rows, 0, t, h, e));
            if (!std::isfinite(row[e]))
              throw Error(where(e) + " is not finite; a quantized cache stores finite values only");
          }
          if (!keys || r.rotary_dim == 0) continue;
          rotate(c, position + t, row.data(), rotated.data(), width);
          for (std::int64_t e = 0; e < width; ++e)
            if (!std::isfinite(rotated[e]))
              throw Error(where(e) + " rotated at position " + str(position + t) + " is not finite (rotary_cos, " +
                          "rotary_sin: their entries there, or the rotation overflows); a quantized cache stores " +
                          "finite values only");
        }
    }
}

// Rotary tables: shapes, and a position for every token they rotate.
void check_rotary(const TensorView& q, const KvCache& c, const AttentionOptions& options, CacheCall& r) {
  const std::int64_t batch = r.batch, d = r.d;
  const std::vector<std::int64_t>& seqlens = r.seqlens;
  r.positions_per_query = options.causal || options.window_size.left >= 0 || options.window_size.right >= 0;
  if (is_set(c.rotary_cos) || is_set(c.rotary_sin)) {
    detail::check_view("rotary_cos", c.rotary_cos, 2, "(positions, rotary_dim / 2)");
    detail::check_view("rotary_sin", c.rotary_sin, 2, "(positions, rotary_dim / 2)");
    for (const auto& [name, table] : {std::pair{"rotary_cos", c.rotary_cos}, {"rotary_sin", c.rotary_sin}})
      if (!is_floating(table.dtype))
        throw Error(std::string(name) + ": dtype " + to_string(table.dtype) + " is not a floating dtype");
    detail::check_shape("rotary_sin", c.rotary_sin, {c.rotary_cos.shape[0], c.rotary_cos.shape[1]},
                        "(the shape of rotary_cos)");
    r.rotary_dim = 2 * c.rotary_cos.shape[1];
    if (r.rotary_dim > d) throw Error("rotary_cos: rotary_dim " + str(r.rotary_dim) + " exceeds head_dim " + str(d));
    std::int64_t last = 0;
    for (std::int64_t b = 0; b < batch; ++b)
      last = std::max(last, seqlens[r.at(b)] +
                                std::max(r.added[r.at(b)], r.positions_per_query ? r.queries(q, b).shape[1] : 1) - 1);
    if (last >= c.rotary_cos.shape[0])
      throw Error("rotary_cos: " + str(c.rotary_cos.shape[0]) + " positions but position " + str(last) + " is needed");
  }
}

// The outputs whole (the per-sequence checks see only the views cut from them), what the
// append writes, and the options per sequence.
void check_outputs_and_targets(const TensorView& q, const KvCache& c, const MutableTensorView& out,
                               const MutableTensorView& lse, const AttentionOptions& options, const CacheCall& r) {
  const std::int64_t batch = r.batch, dv = r.dv;
  const Layout& layout = r.layout;
  const std::vector<std::int64_t>& seqlens = r.seqlens;
  if (r.varlen) {
    detail::check_tensor("out", out, q.dtype, "out must have q's dtype", {q.shape[0], q.shape[1], dv},
                         "(total_q, heads_q, head_dim_v)");
    detail::check_tensor("lse", lse, DType::f32, "lse is always float32", {q.shape[1], q.shape[0]},
                         "(heads_q, total_q)");
  } else {
    detail::check_tensor("out", out, q.dtype, "out must have q's dtype", {batch, q.shape[1], q.shape[2], dv},
                         "(batch, seqlen_q, heads_q, head_dim_v)");
    detail::check_tensor("lse", lse, DType::f32, "lse is always float32", {batch, q.shape[2], q.shape[1]},
                         "(batch, heads_q, seqlen_q)");
  }
  const std::initializer_list<detail::NamedView> tables = {
      {"block_table", c.block_table},     {"cache_seqlens", c.cache_seqlens}, {"cache_batch_idx", c.cache_batch_idx},
      {"cache_leftpad", c.cache_leftpad}, {"rotary_cos", c.rotary_cos},       {"rotary_sin", c.rotary_sin},
      {"cu_seqlens_q", c.cu_seqlens_q},   {"cu_seqlens_k_new", c.cu_seqlens_k_new}};
  detail::check_outputs_apart({{"out", out}, {"lse", lse}},
                              {{"q", q}, {"k_cache", c.k_cache}, {"v_cache", c.v_cache}, {"k", c.k}, {"v", c.v},
                               {"k_scale", c.k_scale}, {"v_scale", c.v_scale}, {"k_zero_point", c.k_zero_point},
                               {"v_zero_point", c.v_zero_point}});
  for (const detail::NamedView& table : tables) {
    detail::check_no_overlap("out", out, table.name, table.view);
    detail::check_no_overlap("lse", lse, table.name, table.view);
  }
  detail::check_apart_from_options("out", out, options);
  detail::check_apart_from_options("lse", lse, options);
  if (is_set(c.k)) {  // the append writes the pools (and a quantized cache's descales or per-token scales)
    detail::check_outputs_apart({{"k_cache", c.k_cache}, {"v_cache", c.v_cache}}, tables);
    detail::check_apart_from_options("k_cache", c.k_cache, options);
    detail::check_apart_from_options("v_cache", c.v_cache, options);
    for (const auto& [name, scale] : {std::pair{"k_scale", c.k_scale}, {"v_scale", c.v_scale},
                                      {"k_zero_point", c.k_zero_point}, {"v_zero_point", c.v_zero_point}})
      if (is_set(scale)) {
        for (const detail::NamedView& table : tables) detail::check_no_overlap(name, scale, table.name, table.view);
        detail::check_apart_from_options(name, scale, options);
      }
    // What appends write of them — an FP8 page's descale, per-token scales and zero points
    // (int8 per-page ones are the caller's, only read) — one element each: a stride-0 view
    // (an expanded tensor) would let one page's append rescale another's codes.
    for (const detail::PoolScales& pool : {k_scales(c), v_scales(c)})
      if (pool.quant.codes == KvCodes::e4m3 || pool.per_token())
        for (const auto& [name, view] : {std::pair{pool.scale_name, pool.scale}, {pool.zero_name, pool.zero_point}})
          if (is_set(view)) detail::check_output_layout(name, view);
    check_append_targets(layout, seqlens, r.added, batch);
  }
  detail::check_sequence_options(options, batch, r.hq);
}

CacheCall check_cache_call(const TensorView& q, const KvCache& c, const MutableTensorView& out,
                           const MutableTensorView& lse, const AttentionOptions& options) {
  CacheCall r = check_cache_views(q, c, options);
  resolve_layout(c, r);
  resolve_sequences(c, r);
  if (r.quantized) check_scales(q, c, r);
  check_new_tokens(q, c, r);
  check_rotary(q, c, options, r);
  check_quantized_tokens(c, r);
  check_outputs_and_targets(q, c, out, lse, options, r);
  return r;
}

// Step 2: each sequence as its own problem (its own number of keys) on views of q (rotated
// or not), the cache and the outputs: the pools read in place through the block table when
// paged, a view of the sequence's rows when contiguous. Each problem's output views are
// checked here.
std::vector<detail::ForwardJob> sequence_jobs(const CacheCall& r, const TensorView& q_used, const KvCache& c,
                                              const MutableTensorView& out, const MutableTensorView& lse,
                                              const AttentionOptions& options) {
  std::vector<detail::ForwardJob> jobs;
  for (std::int64_t b = 0; b < r.batch; ++b) {
    const std::int64_t first = r.leftpad[static_cast<std::size_t>(b)];
    const std::int64_t keys = r.seqlens[r.at(b)] + r.added[r.at(b)] - first;
    detail::ForwardJob job{{},
                           detail::cache_internals(b, r.quantized, c.k_quant, c.v_quant),
                           r.queries(q_used, b),
                           c.k_cache,
                           c.v_cache,
                           r.queries(out, b),
                           r.lse_of(lse, b),
                           detail::sequence_options(options, b),
                           {}};
    std::int64_t scale_row = 0;
    if (r.layout.paged) {
      job.paged.block_table = static_cast<const std::int32_t*>(c.block_table.data) + b * c.block_table.strides[0];
      job.paged.table_stride = c.block_table.strides[1];
      job.paged.page_size = r.layout.page_size;
    } else {
      scale_row = r.layout.batch_idx[static_cast<std::size_t>(b)];
      job.k = detail::cache_rows(TensorView(c.k_cache), scale_row, first, keys);
      job.v = detail::cache_rows(TensorView(c.v_cache), scale_row, first, keys);
    }
    if (r.quantized) {
      job.paged.k = detail::kv_scales(k_scales(c), r.layout.paged, scale_row, first);
      job.paged.v = detail::kv_scales(v_scales(c), r.layout.paged, scale_row, first);
    }
    job.problem = AttentionProblem::from_sizes(1, job.q.shape[1], keys, job.q.shape[2], job.k.shape[2],
                                               job.q.shape[3], job.v.shape[3], job.q.dtype, job.options);
    detail::check_forward_outputs(job.problem, job.q, job.k, job.v, job.out, job.lse);
    jobs.push_back(job);
  }
  return jobs;
}

// Step 3: the new tokens (keys rotated) into their slots, and nowhere else (an FP8 page
// whose descale must grow also re-encodes its earlier tokens, see fp8_append; per-token
// int8 scales are written for the new slots, see int8_append).
void append(const KvCache& c, const CacheCall& r) {
  const std::int64_t batch = r.batch, hkv = r.hkv, d = r.d, dv = r.dv;
  const Layout& layout = r.layout;
  const std::vector<std::int64_t>& seqlens = r.seqlens;
  const std::vector<std::int64_t>& leftpad = r.leftpad;
  std::vector<float> row(static_cast<std::size_t>(std::max(d, dv))), k_rows, v_rows;
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < hkv; ++h) {
      const std::int64_t seqlen = seqlens[r.at(b)], s_new = r.added[r.at(b)];
      const TensorView k = r.new_tokens(c.k, b), v = r.new_tokens(c.v, b);
      k_rows.resize(static_cast<std::size_t>(s_new * d));
      v_rows.resize(static_cast<std::size_t>(s_new * dv));
      for (std::int64_t t = 0; t < s_new; ++t) {
        for (std::int64_t e = 0; e < d; ++e) row[e] = detail::load_element(k, detail::offset4(k, 0, t, h, e));
        rotate(c, seqlen + t, row.data(), k_rows.data() + t * d, d);
        for (std::int64_t e = 0; e < dv; ++e) v_rows[t * dv + e] = detail::load_element(v, detail::offset4(v, 0, t, h, e));
      }
      if (r.quantized) {
        const std::int64_t first = leftpad[static_cast<std::size_t>(b)];
        for (const auto& [pool, scales, scale, zero_point, rows, width] :
             {std::tuple{c.k_cache, k_scales(c), c.k_scale, c.k_zero_point, k_rows.data(), d},
              {c.v_cache, v_scales(c), c.v_scale, c.v_zero_point, v_rows.data(), dv}}) {
          if (scales.quant.codes == KvCodes::e4m3)
            fp8_append(pool, scale, layout, b, h, first, seqlen, rows, s_new, width);
          else
            int8_append(pool, scales, scale, zero_point, layout, b, h, seqlen, rows, s_new, width);
        }
        continue;
      }
      for (std::int64_t t = 0; t < s_new; ++t) {
        const auto [cache_row, slot] = layout.locate(b, seqlen + t);
        for (std::int64_t e = 0; e < d; ++e)
          detail::store_element(c.k_cache, detail::offset4(c.k_cache, cache_row, slot, h, e), k_rows[t * d + e]);
        for (std::int64_t e = 0; e < dv; ++e)
          detail::store_element(c.v_cache, detail::offset4(c.v_cache, cache_row, slot, h, e), v_rows[t * dv + e]);
      }
    }

}

// Step 4: q rotated at its positions (a copy; q itself is never written).
Tensor rotated_queries(const TensorView& q, const KvCache& c, const CacheCall& r) {
  const std::int64_t d = r.d;
  Tensor q_rot(q.dtype, std::vector<std::int64_t>(q.shape.begin(), q.shape.begin() + q.rank));
  std::vector<float> row(static_cast<std::size_t>(d)), rotated(static_cast<std::size_t>(d));
  for (std::int64_t b = 0; b < r.batch; ++b) {
    const TensorView src = r.queries(q, b);
    const MutableTensorView dst = r.queries(q_rot.view(), b);
    for (std::int64_t i = 0; i < src.shape[1]; ++i)
      for (std::int64_t h = 0; h < src.shape[2]; ++h) {
        for (std::int64_t e = 0; e < d; ++e) row[e] = detail::load_element(src, detail::offset4(src, 0, i, h, e));
        rotate(c, r.seqlens[r.at(b)] + (r.positions_per_query ? i : 0), row.data(), rotated.data(), d);
        for (std::int64_t e = 0; e < d; ++e) detail::store_element(dst, detail::offset4(dst, 0, i, h, e), rotated[e]);
      }
  }
  return q_rot;
}

// The route first: the checks read the tables' values, which only the host can.
const detail::Backend& cache_backend(const TensorView& q, const KvCache& c, const TensorView& out,
                                     const TensorView& lse) {
  return detail::route("forward_with_kvcache", &detail::Backend::forward_with_kvcache,
                       {{"q", q},
                        {"k_cache", c.k_cache},
                        {"v_cache", c.v_cache},
                        {"block_table", c.block_table},
                        {"cache_seqlens", c.cache_seqlens},
                        {"cache_batch_idx", c.cache_batch_idx},
                        {"k", c.k},
                        {"v", c.v},
                        {"rotary_cos", c.rotary_cos},
                        {"rotary_sin", c.rotary_sin},
                        {"cache_leftpad", c.cache_leftpad},
                        {"cu_seqlens_q", c.cu_seqlens_q},
                        {"cu_seqlens_k_new", c.cu_seqlens_k_new},
                        {"k_scale", c.k_scale},
                        {"v_scale", c.v_scale},
                        {"k_zero_point", c.k_zero_point},
                        {"v_zero_point", c.v_zero_point},
                        {"out", out},
                        {"lse", lse}});
}

// As upstream: a window bound of at least the cache's capacity (its slots per sequence) is no
// bound — unbounded, and not local, so q rotates at cache_seqlens[b] unless causal.
AttentionOptions capacity_windows(const KvCache& c, const AttentionOptions& options) {
  if (c.k_cache.rank != 4 || (is_set(c.block_table) && c.block_table.rank != 2)) return options;  // refused by the checks
  const std::int64_t capacity = c.k_cache.shape[1] * (is_set(c.block_table) ? c.block_table.shape[1] : 1);
  AttentionOptions r = options;
  for (std::int64_t* bound : {&r.window_size.left, &r.window_size.right})
    if (*bound >= capacity) *bound = -1;
  return r;
}

}  // namespace

void forward_with_kvcache(const TensorView& q, const KvCache& c, const MutableTensorView& out,
                          const MutableTensorView& lse, const AttentionOptions& given) {
  const AttentionOptions options = capacity_windows(c, given);
  const detail::Backend& backend = cache_backend(q, c, out, lse);
  const CacheCall call = check_cache_call(q, c, out, lse, options);
  // Every sequence is checked — options, output views, the kernel — before the append
  // writes the cache, so a rejected call leaves the cache as it was.
  for (const detail::ForwardJob& job : sequence_jobs(call, q, c, out, lse, options)) backend.check_forward(job);
  if (call.varlen && backend.forward_varlen_paged == nullptr)
    throw Error("cu_seqlens_q: a packed KV-cache batch runs as forward_varlen_paged, which this backend lacks");
  detail::begin_run(options);
  append(c, call);
  const Tensor q_rot = call.rotary_dim > 0 ? rotated_queries(q, c, call) : Tensor();
  // The sequences attend together after the append (the backend shares one parallel region
  // among them where it can).
  // A packed batch runs as forward_varlen_paged does: each sequence planned on its own.
  const std::vector<detail::ForwardJob> jobs =
      sequence_jobs(call, call.rotary_dim > 0 ? q_rot.view() : q, c, out, lse, options);
  if (call.varlen) {
    backend.forward_varlen_paged(jobs, {});
  } else {
    backend.forward_with_kvcache(jobs);
  }
}

ForwardResult forward_with_kvcache(const TensorView& q, const KvCache& cache, const AttentionOptions& options) {
  cache_backend(q, cache, {}, {});
  detail::check_view("v_cache", cache.v_cache, 4, "(pages or batch, slots, heads_kv, head_dim_v)");
  if (cache.cu_seqlens_q.data != nullptr || cache.cu_seqlens_q.rank != 0) {
    detail::check_view("q", q, 3, "(total_q, heads_q, head_dim)");
    ForwardResult r{Tensor(q.dtype, {q.shape[0], q.shape[1], cache.v_cache.shape[3]}),
                    Tensor(DType::f32, {q.shape[1], q.shape[0]})};
    forward_with_kvcache(q, cache, r.out.view(), r.lse.view(), options);
    return r;
  }
  detail::check_view("q", q, 4, "(batch, seqlen_q, heads_q, head_dim)");
  ForwardResult r{Tensor(q.dtype, {q.shape[0], q.shape[1], q.shape[2], cache.v_cache.shape[3]}),
                  Tensor(DType::f32, {q.shape[0], q.shape[2], q.shape[1]})};
  forward_with_kvcache(q, cache, r.out.view(), r.lse.view(), options);
  return r;
}

}  // namespace flashattn
