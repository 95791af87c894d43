// GoogleTest helpers: every SIMD target, expected Errors, what the CPU says about itself.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "flashattn/attention.hpp"

namespace flashattn::test {

// Runs `body` once per SIMD target compiled into the library and supported by this CPU,
// with dispatch forced to that target; the trace names the target.
void for_each_simd_target(const std::function<void(const std::string&)>& body);

// Calls `call` and expects an Error whose message contains every one of `fragments`.
void expect_error(const std::function<void()>& call, const std::vector<std::string>& fragments);

// What the CPU says about itself, independently of the library's detection: a machine that
// has AVX512-BF16 must run the bf16 kernels, never skip them.
bool cpu_has_avx512bf16();

// Whether two tensors hold the same number of elements and the same bytes.
bool bitwise_equal(const Tensor& a, const Tensor& b);

// Query rows [q0, q0 + n) of a packed batch's result — out (total_q, heads, head_dim_v),
// lse (heads, total_q) — as the (1, n, heads, head_dim_v) result of a batch of one.
ForwardResult packed_rows(const ForwardResult& all, std::int64_t q0, std::int64_t n);

}  // namespace flashattn::test
