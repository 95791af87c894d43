// `flashattn attend`: file mode. Reads q, k, v from NumPy .npy files, writes out and lse,
// so anyone can check flashattn with their own tools.
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <optional>
#include <utility>

#include <unistd.h>

#include "tools/cli/commands.hpp"
#include "tools/support/npy.hpp"

namespace flashattn::cli {
namespace {

// An input file of attention values: a floating dtype, or an Error naming the flag and the
// file (an integer file would be converted value by value, silently).
Tensor read_values(const char* flag, const std::string& path) {
  Tensor t = support::read_npy(path);
  if (t.dtype() != DType::f32 && t.dtype() != DType::bf16 && t.dtype() != DType::f16)
    throw Error(std::string(flag) + ": " + path + " holds " + to_string(t.dtype()) +
                " values; attention takes a floating dtype (f32, bf16, f16)");
  return t;
}

Tensor converted(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  Tensor r(dtype, t.shape());
  for (std::int64_t i = 0; i < t.numel(); ++i) r.set(i, t.get(i));
  return r;
}

// An output path that a write could not create — its folder missing or not writable, or the
// path a folder or a read-only file — is an Error naming the option before anything runs:
// otherwise --out would be written and --dv then fail.
void check_writable(const char* name, const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code e;
  const fs::path folder = fs::path(path).has_parent_path() ? fs::path(path).parent_path() : fs::path(".");
  if (!fs::is_directory(folder, e))
    throw Error(std::string(name) + ": folder " + folder.string() + " of " + path + " is not an existing folder");
  if (fs::is_directory(path, e)) throw Error(std::string(name) + ": " + path + " is a folder, not a file");
  const bool exists = fs::exists(path, e);
  if (::access(exists ? path.c_str() : folder.c_str(), W_OK) != 0)
    throw Error(std::string(name) + ": " + (exists ? path : "folder " + folder.string()) + " is not writable");
}

// Every output path can be written (check_writable) and differs from the others and from
// every input's: a second output would overwrite the first.
void check_paths(const AttendFlags& f) {
  namespace fs = std::filesystem;
  const std::pair<const char*, const std::string*> inputs[] = {
      {"--q", &f.q}, {"--k", &f.k}, {"--v", &f.v}, {"--dout", &f.dout},
      {"--cu-seqlens-q", &f.cu_seqlens_q}, {"--cu-seqlens-k", &f.cu_seqlens_k}};
  const std::pair<const char*, const std::string*> outputs[] = {
      {"--out", &f.out}, {"--lse", &f.lse}, {"--dq", &f.dq}, {"--dk", &f.dk}, {"--dv", &f.dv}};
  auto same = [](const std::string& a, const std::string& b) {  // hard and symbolic links included
    std::error_code ea, eb, e;
    if (fs::equivalent(a, b, e) && !e) return true;
    return fs::weakly_canonical(a, ea) == fs::weakly_canonical(b, eb) && !ea && !eb;
  };
  for (std::size_t i = 0; i < std::size(outputs); ++i) {
    const auto& [name, path] = outputs[i];
    if (path->empty()) continue;
    check_writable(name, *path);
    for (std::size_t j = i + 1; j < std::size(outputs); ++j)
      if (!outputs[j].second->empty() && same(*path, *outputs[j].second))
        throw Error(std::string(name) + " and " + outputs[j].first + ": the same file (" + *path + ")");
    for (const auto& [input, in_path] : inputs)
      if (!in_path->empty() && same(*path, *in_path))
        throw Error(std::string(name) + ": the file of " + input + " (" + *path + "), which it would overwrite");
  }
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

}  // namespace

void attend(AttendFlags& f) {
  check_paths(f);
  Tensor q = read_values("--q", f.q), k = read_values("--k", f.k), v = read_values("--v", f.v);
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
  VarlenOffsets cu;
  VarlenSeqlens seqlens;
  if (varlen) {
    cu = read_varlen_offsets(f.cu_seqlens_q, f.cu_seqlens_k);
    seqlens = {cu.q.view(), cu.k.view(), cu.max_q, cu.max_k};
  }
  // Every input read and every result computed before the first output is written: a bad
  // dout (or a failing backward) leaves no file behind.
  const Tensor dout = f.dout.empty() ? Tensor() : converted(read_values("--dout", f.dout), dtype);
  const ForwardResult r = varlen ? forward_varlen(q.view(), k.view(), v.view(), seqlens, options)
                                 : forward(q.view(), k.view(), v.view(), options);
  std::optional<BackwardResult> g;
  if (!f.dout.empty())
    g = varlen ? backward_varlen(dout.view(), q.view(), k.view(), v.view(), r.out.view(), r.lse.view(), seqlens,
                                 options)
               : backward(dout.view(), q.view(), k.view(), v.view(), r.out.view(), r.lse.view(), options);
  // NumPy has no bf16: a bf16 result is written as float32 (exactly representable).
  auto write = [](const std::string& path, const Tensor& t) {
    support::write_npy(path, t.dtype() == DType::bf16 ? converted(t, DType::f32) : t);
  };
  write(f.out, r.out);
  if (!f.lse.empty()) write(f.lse, r.lse);
  if (!g) return;
  const std::pair<const std::string*, const Tensor*> grads[] = {{&f.dq, &g->dq}, {&f.dk, &g->dk}, {&f.dv, &g->dv}};
  for (const auto& [path, grad] : grads) write(*path, *grad);
}

}  // namespace flashattn::cli
