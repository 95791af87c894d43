// The README's example: attention over random inputs, checked against the float64
// reference. Built and run by the tests so the README cannot drift from the API.
#include <flashattn/flashattn.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  const std::int64_t batch = 2, seqlen = 300, heads = 8, heads_kv = 2, dim = 64;
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  std::vector<float> q(batch * seqlen * heads * dim), k(batch * seqlen * heads_kv * dim),
      v(k.size()), out(q.size()), lse(batch * heads * seqlen);
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = normal(rng);

  using flashattn::DType;
  flashattn::TensorView qv(q.data(), DType::f32, {batch, seqlen, heads, dim});
  flashattn::TensorView kv(k.data(), DType::f32, {batch, seqlen, heads_kv, dim});
  flashattn::TensorView vv(v.data(), DType::f32, {batch, seqlen, heads_kv, dim});
  flashattn::AttentionOptions options;
  options.causal = true;  // grouped-query attention: 8 query heads share 2 k/v heads
  flashattn::forward(qv, kv, vv,
                     flashattn::MutableTensorView(out.data(), DType::f32, {batch, seqlen, heads, dim}),
                     flashattn::MutableTensorView(lse.data(), DType::f32, {batch, heads, seqlen}),
                     options);

  const flashattn::reference::Result ref = flashattn::reference::attention(qv, kv, vv, options);
  double max_error = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i)
    max_error = std::fmax(max_error, std::fabs(out[i] - ref.out[i]));
  std::printf("simd=%s max |out - reference| = %.2e\n", flashattn::cpu_simd_target().c_str(),
              max_error);
  return max_error <= 1e-5 ? 0 : 1;
}
