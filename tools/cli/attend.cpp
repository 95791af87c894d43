// `flashattn attend`: file mode. Reads q, k, v from NumPy .npy files, writes out and lse,
// so anyone can check flashattn with their own tools.
#include <cstdio>
#include <iostream>
#include <optional>
#include <algorithm>

#include "tools/cli/commands.hpp"
#include "tools/support/npy.hpp"

namespace flashattn::cli {
namespace {

Tensor converted(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  Tensor r(dtype, t.shape());
  for (std::int64_t i = 0; i < t.numel(); ++i) r.set(i, t.get(i));
  return r;
}

// Largest difference of consecutive offsets (the longest sequence).
std::int64_t max_length(const Tensor& cu) {
  std::int64_t m = 0;
  for (std::int64_t b = 1; b < cu.numel(); ++b)
    m = std::max<std::int64_t>(m, static_cast<std::int64_t>(cu.get(b) - cu.get(b - 1)));
  return m;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

}  // namespace

void attend(AttendFlags& f) {
  Tensor q = support::read_npy(f.q), k = support::read_npy(f.k), v = support::read_npy(f.v);
  // --dtype bf16 rounds the inputs to bf16; by default the kernel runs in q's file dtype.
  const DType dtype = f.dtype ? parse_dtype(*f.dtype) : q.dtype();
  q = converted(q, dtype);
  k = converted(k, dtype);
  v = converted(v, dtype);
  AttentionOptions options;
  options.causal = f.causal;
  options.softmax_scale = f.softmax_scale;
  options.num_threads = f.threads;
  f.variants.apply(options);
  options.deterministic = f.deterministic;
  const bool varlen = !f.cu_seqlens_q.empty();
  std::printf("flashattn attend: q %s, dtype=%s causal=%s softmax_scale=%s deterministic=%s%s\n",
              shape_text(q.shape()).c_str(), to_string(dtype).c_str(), f.causal ? "true" : "false",
              f.softmax_scale ? std::to_string(*f.softmax_scale).c_str() : "1/sqrt(D)",
              f.deterministic ? "true" : "false", varlen ? " varlen" : "");
  Tensor cu_q, cu_k;
  VarlenSeqlens seqlens;
  if (varlen) {
    cu_q = support::read_npy(f.cu_seqlens_q);
    cu_k = support::read_npy(f.cu_seqlens_k);
    seqlens = {cu_q.view(), cu_k.view(), max_length(cu_q), max_length(cu_k)};
  }
  const ForwardResult r = varlen ? forward_varlen(q.view(), k.view(), v.view(), seqlens, options)
                                 : forward(q.view(), k.view(), v.view(), options);
  // NumPy has no bf16: a bf16 result is written as float32 (exactly representable).
  support::write_npy(f.out, r.out.dtype() == DType::bf16 ? converted(r.out, DType::f32) : r.out);
  if (!f.lse.empty()) support::write_npy(f.lse, r.lse);
  if (f.dout.empty()) return;
  const Tensor dout = converted(support::read_npy(f.dout), dtype);
  const BackwardResult g =
      varlen ? backward_varlen(dout.view(), q.view(), k.view(), v.view(), r.out.view(), r.lse.view(),
                               seqlens, options)
             : backward(dout.view(), q.view(), k.view(), v.view(), r.out.view(), r.lse.view(), options);
  const std::pair<const std::string*, const Tensor*> grads[] = {{&f.dq, &g.dq}, {&f.dk, &g.dk}, {&f.dv, &g.dv}};
  for (const auto& [path, grad] : grads)
    support::write_npy(*path, grad->dtype() == DType::bf16 ? converted(*grad, DType::f32) : *grad);
}

}  // namespace flashattn::cli
