#include "validate.hpp"

#include <utility>
#include <array>
#include <cmath>
#include <sstream>

#include "flashattn/error.hpp"

namespace flashattn::detail {
namespace {

// Offset in elements of the last element, or -1 for an empty view.
std::int64_t last_offset(const TensorView& view) {
  if (view.numel() == 0) return -1;
  std::int64_t offset = 0;
  for (int d = 0; d < view.rank; ++d) offset += (view.shape[d] - 1) * view.strides[d];
  return offset;
}

struct ByteRange {
  std::uintptr_t begin = 0, end = 0;  // [begin, end)
};

ByteRange byte_range(const TensorView& view) {
  const std::int64_t last = last_offset(view);
  if (last < 0) return {};
  const auto begin = reinterpret_cast<std::uintptr_t>(view.data);
  return {begin, begin + static_cast<std::uintptr_t>(last + 1) * dtype_size(view.dtype)};
}

}  // namespace

std::string shape_string(const TensorView& view) {
  std::ostringstream s;
  s << '(';
  for (int d = 0; d < view.rank; ++d) s << (d ? ", " : "") << view.shape[d];
  s << ')';
  return s.str();
}

void check_view(const char* name, const TensorView& view, int rank, const char* layout) {
  if (view.device != Device::cpu)
    throw Error(std::string(name) + ": on " + to_string(view.device) + ", but this entry point runs on the cpu only");
  if (view.rank != rank)
    throw Error(std::string(name) + ": expected rank " + std::to_string(rank) + " " + layout + ", got rank " +
                std::to_string(view.rank));
  for (int d = 0; d < rank; ++d)
    if (view.shape[d] < 0)
      throw Error(std::string(name) + ": negative size " + std::to_string(view.shape[d]) + " in dim " +
                  std::to_string(d) + " of shape " + shape_string(view));
  for (int d = 0; d < rank; ++d) {
    if (view.strides[d] < 0)
      throw Error(std::string(name) + ": negative stride " + std::to_string(view.strides[d]) + " in dim " +
                  std::to_string(d) + " (only non-negative strides are supported)");
  }
  if (view.shape[rank - 1] > 1 && view.strides[rank - 1] != 1 && view.numel() > 0)
    throw Error(std::string(name) + ": last dimension must be contiguous (stride 1), got stride " +
                std::to_string(view.strides[rank - 1]));
  // Extent must be addressable: Σ (size − 1)·stride in bytes and the element count fit
  // in int64.
  std::int64_t extent = 0, count = 1, bytes = 0;
  for (int d = 0; d < rank; ++d) {
    std::int64_t term = 0;
    if (view.shape[d] > 0 &&
        (__builtin_mul_overflow(view.shape[d] - 1, view.strides[d], &term) ||
         __builtin_add_overflow(extent, term, &extent) ||
         __builtin_mul_overflow(count, view.shape[d], &count) ||
         __builtin_mul_overflow(extent + 1, static_cast<std::int64_t>(dtype_size(view.dtype)), &bytes)))
      throw Error(std::string(name) + ": shape " + shape_string(view) + " with its strides overflows 64-bit indexing");
  }
  if (view.data == nullptr && view.numel() > 0)
    throw Error(std::string(name) + ": null data with " + std::to_string(view.numel()) + " elements");
}

void check_dtype(const char* name, const TensorView& view, DType expected, const char* why) {
  if (view.dtype != expected)
    throw Error(std::string(name) + ": dtype " + to_string(view.dtype) + " but expected " +
                to_string(expected) + " (" + why + ")");
}

void check_shape(const char* name, const TensorView& view,
                 std::initializer_list<std::int64_t> expected, const char* layout) {
  bool same = static_cast<int>(expected.size()) == view.rank;
  int d = 0;
  for (std::int64_t e : expected) same = same && view.shape[d++] == e;
  if (!same) {
    std::ostringstream s;
    s << name << ": shape " << shape_string(view) << " but expected (";
    d = 0;
    for (std::int64_t e : expected) s << (d++ ? ", " : "") << e;
    s << ") " << layout;
    throw Error(s.str());
  }
}

void check_tensor(const char* name, const TensorView& view, DType dtype, const char* why,
                  std::initializer_list<std::int64_t> shape, const char* layout) {
  check_view(name, view, static_cast<int>(shape.size()), layout);
  check_dtype(name, view, dtype, why);
  check_shape(name, view, shape, layout);
}

void check_output_layout(const char* name, const TensorView& out) {
  if (out.numel() == 0) return;
  // Sufficient condition for no self-overlap: with dimensions sorted by stride, each
  // stride exceeds the extent of all inner dimensions.
  std::array<int, kMaxRank> order{};
  int used = 0;
  for (int d = 0; d < out.rank; ++d)
    if (out.shape[d] > 1) order[used++] = d;
  for (int i = 1; i < used; ++i)  // insertion sort by stride: at most 4 entries
    for (int j = i; j > 0 && out.strides[order[j]] < out.strides[order[j - 1]]; --j)
      std::swap(order[j], order[j - 1]);
  std::int64_t inner_extent = 0;
  for (int i = 0; i < used; ++i) {
    const int d = order[i];
    if (out.strides[d] <= inner_extent)
      throw Error(std::string(name) + ": stride " + std::to_string(out.strides[d]) +
                  " of dim " + std::to_string(d) +
                  " makes elements of the output overlap (outputs need distinct addresses)");
    inner_extent += (out.shape[d] - 1) * out.strides[d];
  }
}

void check_no_overlap(const char* out_name, const TensorView& out, const char* in_name,
                      const TensorView& in) {
  const ByteRange a = byte_range(out), b = byte_range(in);
  if (a.begin == a.end || b.begin == b.end) return;
  if (a.begin < b.end && b.begin < a.end)
    throw Error(std::string(out_name) + ": output memory overlaps input " + in_name +
                " (inputs are never modified; pass a separate buffer)");
}

void check_outputs_apart(std::initializer_list<NamedView> outputs, std::initializer_list<NamedView> inputs) {
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    check_output_layout(out->name, out->view);
    for (const NamedView& in : inputs) check_no_overlap(out->name, out->view, in.name, in.view);
    for (auto other = outputs.begin(); other != out; ++other)
      check_no_overlap(out->name, out->view, other->name, other->view);
  }
}

namespace {
constexpr const char* kOutLayout = "(batch, seqlen_q, heads_q, head_dim_v)";
}  // namespace

void check_forward_outputs(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                           const TensorView& v, const TensorView& out, const TensorView& lse) {
  check_view("out", out, 4, kOutLayout);
  check_dtype("out", out, q.dtype, "out must have q's dtype");
  check_forward_output_views(p, q, k, v, out, lse);
}

void check_forward_output_views(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                const TensorView& v, const TensorView& out, const TensorView& lse) {
  constexpr const char* kLseLayout = "(batch, heads_q, seqlen_q)";
  check_view("out", out, 4, kOutLayout);
  if (!is_floating(out.dtype))
    throw Error("out: dtype " + to_string(out.dtype) + " is not a floating dtype (f32, bf16, f16)");
  check_shape("out", out, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}, kOutLayout);
  check_tensor("lse", lse, DType::f32, "lse is always float32", {p.batch, p.heads_q, p.seqlen_q}, kLseLayout);
  check_output_layout("out", out);
  check_output_layout("lse", lse);
  for (const auto& [name, input] : {std::pair{"q", q}, {"k", k}, {"v", v}}) {
    check_no_overlap("out", out, name, input);
    check_no_overlap("lse", lse, name, input);
  }
  check_no_overlap("lse", lse, "out", out);
}

void check_rescale_counts(const AttentionProblem& p, const AttentionOptions& options, const TensorView& q,
                          const TensorView& k, const TensorView& v, const TensorView& out, const TensorView& lse) {
  const TensorView counts = options.rescale_counts;
  if (counts.data == nullptr && counts.rank == 0) return;
  constexpr const char* kLayout = "(batch, heads_q, seqlen_q)";
  check_tensor("rescale_counts", counts, DType::i32, "counts are int32", {p.batch, p.heads_q, p.seqlen_q}, kLayout);
  check_output_layout("rescale_counts", counts);
  for (const auto& [name, other] : {std::pair{"q", q}, {"k", k}, {"v", v}, {"out", out}, {"lse", lse}})
    check_no_overlap("rescale_counts", counts, name, other);
}

void reject_rescale_counts(const char* entry_point, const AttentionOptions& options) {
  if (options.rescale_counts.data != nullptr || options.rescale_counts.rank != 0)
    throw Error(std::string("rescale_counts: reported by forward() and forward_fp8() only, not by ") + entry_point);
}

void reject_top_left(const char* entry_point, const AttentionOptions& options) {
  if (options.causal_alignment != CausalAlignment::bottom_right)
    throw Error(std::string("causal_alignment: ") + to_string(options.causal_alignment) + " is not supported by " +
                entry_point + " (forward and backward take it)");
}

void reject_attn_mask(const char* entry_point, const AttentionOptions& options) {
  if (options.attn_mask.data != nullptr || options.attn_mask.rank != 0)
    throw Error(std::string("attn_mask: not supported by ") + entry_point + " (forward and backward take it)");
}

void reject_score_hook(const char* entry_point, const AttentionOptions& options) {
  if (options.score_hook.apply != nullptr)
    throw Error(std::string("score_hook: not supported by ") + entry_point + " (forward and backward take it)");
}

}  // namespace flashattn::detail

namespace flashattn::detail {

void check_fp8_input(const char* name, const Fp8View& x) {
  constexpr const char* kLayout = "(batch, seqlen, heads, dim)";
  const std::string codes_name = std::string(name) + ".codes", descale_name = std::string(name) + ".descale";
  check_view(codes_name.c_str(), x.codes, 4, kLayout);
  check_dtype(codes_name.c_str(), x.codes, DType::u8, "FP8 codes are one byte each");
  if (x.block_size < 0)
    throw Error(std::string(name) + ".block_size: must be >= 0 (0 = one scale per tensor), got " +
                std::to_string(x.block_size));
  const std::int64_t batch = x.codes.shape[0], seqlen = x.codes.shape[1], heads = x.codes.shape[2];
  const std::int64_t blocks = x.block_size == 0 ? 1 : blocks_of(seqlen, x.block_size);
  check_dtype(descale_name.c_str(), x.descale, DType::f32, "descale factors are float32");
  if (x.block_size == 0) {
    check_view(descale_name.c_str(), x.descale, 1, "(1) per tensor");
    check_shape(descale_name.c_str(), x.descale, {1}, "(1) per tensor");
  } else {
    check_view(descale_name.c_str(), x.descale, 3, "(batch, heads, blocks) per block");
    check_shape(descale_name.c_str(), x.descale, {batch, heads, blocks},
                "(batch, heads, ceil(seqlen / block_size)) per block");
  }
  const auto* descale = static_cast<const float*>(x.descale.data);
  for (std::int64_t b = 0; b < (x.block_size == 0 ? 1 : batch); ++b)
    for (std::int64_t h = 0; h < (x.block_size == 0 ? 1 : heads); ++h)
      for (std::int64_t block = 0; block < blocks; ++block) {
        const float d = x.block_size == 0 ? descale[0]
                                          : descale[b * x.descale.strides[0] + h * x.descale.strides[1] +
                                                    block * x.descale.strides[2]];
        if (!(std::isfinite(d) && d > 0.0f))
          throw Error(descale_name + ": entry (" + std::to_string(b) + ", " + std::to_string(h) + ", " +
                      std::to_string(block) + ") is " + std::to_string(d) +
                      " (descale factors must be finite and > 0)");
      }
  // NaN codes (and e5m2's ±∞, which quantize_fp8 never writes: it saturates) stand for no
  // value an attention could use; one would turn its rows' outputs into NaN.
  const Fp8Info info = fp8_info(x.format);
  const auto bad = [&](std::uint8_t c) {
    return x.format == Fp8Format::e4m3 ? (c & 0x7F) == info.nan_code : (c & 0x7C) == 0x7C;
  };
  const auto* codes = static_cast<const std::uint8_t*>(x.codes.data);
  const std::int64_t dim = x.codes.shape[3];
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t s = 0; s < seqlen; ++s)
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::uint8_t* row = codes + b * x.codes.strides[0] + s * x.codes.strides[1] + h * x.codes.strides[2];
        for (std::int64_t c = 0; c < dim; ++c)
          if (bad(row[c * x.codes.strides[3]]))
            throw Error(codes_name + ": entry (" + std::to_string(b) + ", " + std::to_string(s) + ", " +
                        std::to_string(h) + ", " + std::to_string(c) + ") is code " +
                        std::to_string(row[c * x.codes.strides[3]]) + ", " +
                        (x.format == Fp8Format::e4m3 ? "NaN in e4m3" : "NaN or infinite in e5m2") +
                        " (codes must stand for finite values)");
      }
}

}  // namespace flashattn::detail
