// A causal document mask over 8 packed documents of 512 tokens (issue 24's measurement), in
// three forms: a mask_mod with its block mask (flex.hpp), forward_varlen over the 8
// documents, and a dense boolean attn_mask (1, 1, 4096, 4096). Prints the median of 7
// forward calls of each, and GFLOP/s on the visible pairs (4·D flops per pair).
//   build/flashattn_bench_flex [heads=8] [head_dim=64]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "flashattn/flex.hpp"
#include "tools/support/random_inputs.hpp"

namespace {

double median_ms(const std::function<void()>& call) {
  call();  // warm-up
  std::vector<double> ms;
  for (int r = 0; r < 7; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  using namespace flashattn;
  const std::int64_t heads = argc > 1 ? std::atoll(argv[1]) : 8, dim = argc > 2 ? std::atoll(argv[2]) : 64;
  constexpr std::int64_t kDocs = 8, kDocLen = 512, kTokens = kDocs * kDocLen;
  const Tensor q = support::random_tensor(DType::f32, {1, kTokens, heads, dim}, 1);
  const Tensor k = support::random_tensor(DType::f32, {1, kTokens, heads, dim}, 2);
  const Tensor v = support::random_tensor(DType::f32, {1, kTokens, heads, dim}, 3);
  const double visible = static_cast<double>(kDocs) * kDocLen * (kDocLen + 1) / 2.0 * static_cast<double>(heads);
  const auto report = [&](const char* form, double ms) {
    std::printf("%-28s %9.2f ms  %7.2f GFLOP/s (visible pairs)\n", form, ms, 4.0 * dim * visible / (ms * 1e6));
  };

  const auto doc_mask = [](std::int64_t, std::int64_t, std::int64_t qi, std::int64_t kv) {
    return qi / kDocLen == kv / kDocLen && kv <= qi;
  };
  const FlexMods mods(flex::NoScoreMod{}, doc_mask);
  BlockMask blocks;
  std::printf("%-28s %9.2f ms  (once per mask)\n", "create_block_mask (128)",
              median_ms([&] { blocks = create_block_mask(doc_mask, 1, 1, kTokens, kTokens, 128); }));
  AttentionOptions flex_options;
  flex_options.score_hook = mods.hook(&blocks);
  report("mask_mod + block mask", median_ms([&] { forward(q.view(), k.view(), v.view(), flex_options); }));

  Tensor cu(DType::i32, {kDocs + 1});
  for (std::int64_t d = 0; d <= kDocs; ++d) cu.set(d, static_cast<float>(d * kDocLen));
  const Tensor q3 = support::random_tensor(DType::f32, {kTokens, heads, dim}, 1);
  const Tensor k3 = support::random_tensor(DType::f32, {kTokens, heads, dim}, 2);
  const Tensor v3 = support::random_tensor(DType::f32, {kTokens, heads, dim}, 3);
  AttentionOptions causal;
  causal.causal = true;
  report("varlen, causal", median_ms([&] {
           forward_varlen(q3.view(), k3.view(), v3.view(), {cu.view(), cu.view(), kDocLen, kDocLen}, causal);
         }));

  Tensor dense(DType::u8, {1, 1, kTokens, kTokens});
  auto* m = dense.data_as<std::uint8_t>();
  for (std::int64_t i = 0; i < kTokens; ++i)
    for (std::int64_t j = 0; j < kTokens; ++j) m[i * kTokens + j] = doc_mask(0, 0, i, j) ? 1 : 0;
  AttentionOptions dense_options;
  dense_options.attn_mask = dense.view();
  report("dense bool attn_mask", median_ms([&] { forward(q.view(), k.view(), v.view(), dense_options); }));
  return 0;
}
