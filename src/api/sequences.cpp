#include "src/api/sequences.hpp"

#include <string>

#include "flashattn/error.hpp"
#include "src/core/validate.hpp"

namespace flashattn::detail {
namespace {
std::string str(std::int64_t v) { return std::to_string(v); }
}  // namespace

std::vector<std::int64_t> read_offsets(const char* name, const TensorView& cu, std::int64_t total,
                                       std::int64_t max_seqlen, const char* max_name) {
  check_view(name, cu, 1, "(batch + 1)");
  check_dtype(name, cu, DType::i32, "offsets are int32");
  if (cu.shape[0] < 1) throw Error(std::string(name) + ": needs at least one offset (batch + 1)");
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(cu.shape[0]));
  for (std::int64_t b = 0; b < cu.shape[0]; ++b)
    offsets[static_cast<std::size_t>(b)] =
        static_cast<std::int64_t>(static_cast<const std::int32_t*>(cu.data)[b * cu.strides[0]]);
  if (offsets.front() != 0)
    throw Error(std::string(name) + ": must start at 0, got " + str(offsets.front()));
  for (std::size_t b = 1; b < offsets.size(); ++b) {
    const std::int64_t len = offsets[b] - offsets[b - 1];
    if (len < 0)
      throw Error(std::string(name) + ": must be non-decreasing, but [" + str(static_cast<std::int64_t>(b - 1)) +
                  "] = " + str(offsets[b - 1]) + " > [" + str(static_cast<std::int64_t>(b)) + "] = " + str(offsets[b]));
    if (len > max_seqlen)
      throw Error(std::string(name) + ": sequence " + str(static_cast<std::int64_t>(b - 1)) + " has length " +
                  str(len) + " > " + max_name + " = " + str(max_seqlen));
  }
  if (offsets.back() != total)
    throw Error(std::string(name) + ": last offset " + str(offsets.back()) +
                " does not match the " + str(total) + " packed tokens");
  return offsets;
}

void check_sequence_options(const AttentionOptions& options, std::int64_t batch, std::int64_t heads_q) {
  const TensorView& a = options.alibi_slopes;
  if (a.rank != 2) return;  // rank 1 (or anything else) is checked per sequence
  check_alibi_slopes(a, batch, heads_q);
}

AttentionOptions sequence_options(const AttentionOptions& options, std::int64_t b) {
  AttentionOptions o = options;
  const TensorView& a = options.alibi_slopes;
  if (a.rank == 2 && a.data != nullptr) {
    o.alibi_slopes.data = static_cast<const float*>(a.data) + b * a.strides[0];
    o.alibi_slopes.rank = 1;
    o.alibi_slopes.shape = {a.shape[1], 0, 0, 0, 0};
    o.alibi_slopes.strides = {a.strides[1], 0, 0, 0, 0};
  }
  return o;
}

}  // namespace flashattn::detail
