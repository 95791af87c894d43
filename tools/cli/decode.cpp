#include "tools/cli/decode.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tools/cli/measure.hpp"

namespace flashattn::cli {
namespace {

// Tokens [begin, begin + count) of every sequence of a (batch, seqlen, heads, dim) tensor.
TensorView tokens(const Tensor& t, std::int64_t begin, std::int64_t count) {
  TensorView v = t.view();
  v.data = static_cast<const unsigned char*>(v.data) + begin * v.strides[1] * static_cast<std::int64_t>(dtype_size(v.dtype));
  v.shape[1] = count;
  return v;
}

}  // namespace

DecodeMeasurement measure_decode(const DecodeCase& c, int repeats) {
  const std::int64_t cap = c.cached + 1;
  const bool paged = c.page_size > 0;
  const std::int64_t per_seq = paged ? (cap + c.page_size - 1) / c.page_size : 0;
  const std::int64_t pages = paged ? c.batch * per_seq : c.batch;  // a contiguous row is one "page"
  const std::int64_t slots = paged ? c.page_size : cap;
  const std::vector<std::int64_t> cache_shape{pages, slots, c.heads_kv, c.dim};
  // Random q, new token and cache contents: a (batch, cap) problem supplies the tensors.
  const AttentionProblem logical = AttentionProblem::from_sizes(c.batch, 1, cap, c.heads, c.heads_kv, c.dim,
                                                                c.dim, c.dtype, {});
  const Inputs in = random_inputs(logical, 11);
  const DType cache_dtype = c.cache_format.empty() ? c.dtype : DType::u8;
  const KvQuant quant = c.cache_format.empty() || c.cache_format == "e4m3"
                            ? KvQuant{}
                            : KvQuant{parse_kv_codes(c.cache_format), KvScaleGranularity::per_token};
  const bool per_token = quant.granularity == KvScaleGranularity::per_token;
  Tensor k_cache(cache_dtype, cache_shape), v_cache(cache_dtype, cache_shape), table(DType::i32, {c.batch, std::max<std::int64_t>(per_seq, 1)});
  const std::vector<std::int64_t> scale_shape =
      per_token ? std::vector<std::int64_t>{pages, slots, c.heads_kv} : std::vector<std::int64_t>{pages, c.heads_kv};
  Tensor k_scale(DType::f32, scale_shape), v_scale(DType::f32, scale_shape);
  Tensor k_zero(DType::f32, scale_shape), v_zero(DType::f32, scale_shape);
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t pg = 0; pg < per_seq; ++pg) table.set(b * per_seq + pg, static_cast<float>(b * per_seq + pg));
  Tensor seqlens(DType::i32, {c.batch});  // zero: the cache starts empty
  KvCache cache;
  cache.k_cache = k_cache.view();
  cache.v_cache = v_cache.view();
  if (paged) cache.block_table = table.view();
  if (!c.cache_format.empty()) {
    cache.k_scale = k_scale.view();
    cache.v_scale = v_scale.view();
    cache.k_quant = cache.v_quant = quant;
  }
  if (quant.codes == KvCodes::u8) {
    cache.k_zero_point = k_zero.view();
    cache.v_zero_point = v_zero.view();
  }
  cache.cache_seqlens = seqlens.view();
  AttentionOptions options;
  options.num_threads = c.threads;
  // The cached tokens enter the cache as a prefill leaves them: one append of each sequence's
  // first `cached` tokens by forward_with_kvcache itself (which, for a quantized cache,
  // quantizes them and sets the descales or scales); the output of that call is not used.
  if (c.cached > 0) {
    cache.k = tokens(in.k, 0, c.cached);
    cache.v = tokens(in.v, 0, c.cached);
    forward_with_kvcache(in.q.view(), cache, options);
  }
  for (std::int64_t b = 0; b < c.batch; ++b) seqlens.set(b, static_cast<float>(c.cached));
  // The appended token is the logical cache's last one, so the reference is `logical`.
  cache.k = tokens(in.k, c.cached, 1);
  cache.v = tokens(in.v, c.cached, 1);
  options.kernel = c.kernel;
  ForwardResult r;
  DecodeMeasurement m;
  PlansRun plans;  // one per sequence, all of one kernel: the sequences are alike
  options.plans_run = &plans;
  m.seconds = median_seconds([&] { r = forward_with_kvcache(in.q.view(), cache, options); }, repeats, 1,
                             paged ? "decode (paged)" : "decode");
  m.kernel = to_string(plans.forward.at(0).kernel);
  let_worker_threads_sleep();
  const std::int64_t row = c.heads_kv * c.dim;
  // The codes, and per token their scales (and zero points) as well.
  const std::int64_t per_token_bytes = per_token ? (quant.codes == KvCodes::u8 ? 8 : 4) : 0;
  m.cache_bytes = static_cast<std::size_t>(2 * c.batch * cap * (row * static_cast<std::int64_t>(dtype_size(cache_dtype)) +
                                                                  c.heads_kv * per_token_bytes));
  m.gbps = static_cast<double>(m.cache_bytes) / m.seconds * 1e-9;
  std::vector<double> ref(static_cast<std::size_t>(c.dim));
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t h = 0; h < c.heads; h += std::max<std::int64_t>(1, c.heads / 4)) {
      double lse = 0.0;
      reference::attention_row(logical, options, in.q.view(), in.k.view(), in.v.view(), b, h, 0, ref.data(), &lse);
      for (std::int64_t e = 0; e < c.dim; ++e)
        m.max_error = std::max(m.max_error, std::fabs(r.out.get((b * c.heads + h) * c.dim + e) - ref[static_cast<std::size_t>(e)]));
    }
  return m;
}

}  // namespace flashattn::cli
