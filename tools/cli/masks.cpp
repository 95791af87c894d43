#include "tools/cli/masks.hpp"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <deque>
#include <functional>
#include <iostream>
#include <utility>
#include <vector>

#include "flashattn/flex.hpp"
#include "tools/cli/measure.hpp"

namespace flashattn::cli {

MaskCase MaskCase::issue() {
  MaskCase c;
  c.name = "issue";
  return c;
}

MaskCase MaskCase::smoke() {
  MaskCase c;
  c.name = "smoke";
  c.documents = 4;
  c.document_tokens = 40;
  c.heads = 2;
  c.dim = 16;
  c.block = 16;
  return c;
}

const MaskRun& MaskMeasurement::run(const std::string& form) const {
  const auto it = std::find_if(runs.begin(), runs.end(), [&](const MaskRun& r) { return r.form == form; });
  if (it == runs.end()) throw Error("masks: no form " + form + " was timed");
  return *it;
}

namespace {

// The largest |a − b| over two outputs of one shape (the varlen form's is (T, H, D), the
// others' (1, T, H, D): the same elements in the same order).
double max_diff(const Tensor& a, const Tensor& b) {
  double worst = 0.0;
  for (std::int64_t e = 0; e < a.numel(); ++e) worst = std::max(worst, std::fabs(double{a.get(e)} - b.get(e)));
  return worst;
}

}  // namespace

MaskMeasurement measure_masks(const MaskCase& c, int repeats) {
  const std::int64_t tokens = c.tokens(), length = c.document_tokens, heads = c.heads;
  const AttentionProblem p = AttentionProblem::from_sizes(1, tokens, tokens, heads, heads, c.dim, c.dim, c.dtype, {});
  const Inputs in = random_inputs(p, 11);
  // The varlen form's packed (T, H, D) views of the same memory.
  const auto packed = [&](const Tensor& t) { return TensorView(t.data(), t.dtype(), {tokens, heads, c.dim}); };
  const double all_pairs = static_cast<double>(tokens) * static_cast<double>(tokens) * static_cast<double>(heads);
  const double causal_pairs = static_cast<double>(tokens) * static_cast<double>(tokens + 1) / 2.0 * static_cast<double>(heads);
  const double document_pairs = static_cast<double>(c.documents) * static_cast<double>(length) *
                                static_cast<double>(length + 1) / 2.0 * static_cast<double>(heads);

  // Every form writes its own output; the document forms' are compared with varlen's.
  struct Form {
    std::string name;
    double pairs;
    AttentionOptions options;
    Tensor out, lse;
    std::function<void(Form&)> call;
    PlansRun plans;
    std::vector<double> seconds;
  };
  std::deque<Form> forms;  // add() hands back a reference that later forms must not move
  const auto add = [&](std::string name, double pairs, AttentionOptions options, bool packed_out = false) -> Form& {
    Form& f = forms.emplace_back();
    f.name = std::move(name);
    f.pairs = pairs;
    f.options = options;
    f.options.num_threads = c.threads;
    f.out = packed_out ? Tensor(c.dtype, {tokens, heads, c.dim}) : Tensor(c.dtype, {1, tokens, heads, c.dim});
    f.lse = packed_out ? Tensor(DType::f32, {heads, tokens}) : Tensor(DType::f32, {1, heads, tokens});
    f.call = [&in](Form& self) { forward(in.q.view(), in.k.view(), in.v.view(), self.out.view(), self.lse.view(), self.options); };
    return f;
  };
  AttentionOptions causal;
  causal.causal = true;
  add("unmasked", all_pairs, {});
  add("causal", causal_pairs, causal);

  Tensor cu(DType::i32, {c.documents + 1});
  for (std::int64_t d = 0; d <= c.documents; ++d) cu.data_as<std::int32_t>()[d] = static_cast<std::int32_t>(d * length);
  add("varlen", document_pairs, causal, /*packed_out=*/true).call = [&](Form& self) {
    forward_varlen(packed(in.q), packed(in.k), packed(in.v), {cu.view(), cu.view(), length, length}, self.out.view(),
                   self.lse.view(), self.options);
  };

  MaskMeasurement r;
  // FlexAttention's document mask: a document id per token, looked up (no division per score).
  std::vector<std::int32_t> document_id(static_cast<std::size_t>(tokens));
  for (std::int64_t t = 0; t < tokens; ++t) document_id[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(t / length);
  const auto document = [ids = document_id.data()](std::int64_t, std::int64_t, std::int64_t q_idx, std::int64_t kv_idx) {
    return ids[q_idx] == ids[kv_idx] && kv_idx <= q_idx;
  };
  const FlexMods document_mods(flex::NoScoreMod{}, document);
  BlockMask blocks;
  r.create_block_mask_seconds = median_seconds(
      [&] { blocks = create_block_mask(document, 1, 1, tokens, tokens, c.block); }, repeats, 1, "create_block_mask");
  AttentionOptions mask_mod;
  mask_mod.score_hook = document_mods.hook(&blocks);
  add("mask_mod", document_pairs, mask_mod);

  Tensor dense(DType::u8, {1, 1, tokens, tokens});
  auto* m = dense.data_as<std::uint8_t>();
  for (std::int64_t i = 0; i < tokens; ++i)
    for (std::int64_t j = 0; j < tokens; ++j) m[i * tokens + j] = document(0, 0, i, j) ? 1 : 0;
  AttentionOptions dense_bool;
  dense_bool.attn_mask = dense.view();
  add("dense_bool", document_pairs, dense_bool);

  // A relative-position bias (one slope per head, as ALiBi's) as a score_mod, causal.
  const FlexMods relative_bias([](auto score, std::int64_t, std::int64_t h, std::int64_t q_idx, std::int64_t kv_idx) {
    return score - 0.0625f / static_cast<float>(h + 1) * static_cast<float>(q_idx - kv_idx);
  });
  AttentionOptions score_mod = causal;
  score_mod.score_hook = relative_bias.hook();
  add("score_mod", causal_pairs, score_mod);

  // Rounds of one call per form, the first a warm-up: on a loaded machine every form sees
  // the same load, so their ratios hold better than those of forms timed one after another.
  for (int round = 0; round <= repeats; ++round) {
    std::cerr << "\r  masks: round " << round + 1 << "/" << repeats + 1 << std::flush;
    for (Form& f : forms) {
      f.options.plans_run = round == 0 ? &f.plans : nullptr;  // the warm-up reports its plan
      const auto t0 = std::chrono::steady_clock::now();
      f.call(f);
      if (round > 0) f.seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  std::cerr << "\n";
  let_worker_threads_sleep();
  const Form& varlen = forms[2];
  for (Form& f : forms) {
    std::sort(f.seconds.begin(), f.seconds.end());
    MaskRun run;
    run.form = f.name;
    run.seconds = f.seconds[f.seconds.size() / 2];
    run.visible_pairs = f.pairs;
    run.gflops = 4.0 * static_cast<double>(c.dim) * f.pairs / run.seconds * 1e-9;
    if (!f.plans.forward.empty()) run.kernel = to_string(f.plans.forward.front().kernel);
    if (f.pairs == document_pairs && &f != &varlen) run.max_diff = max_diff(f.out, varlen.out);
    r.runs.push_back(std::move(run));
  }
  return r;
}

}  // namespace flashattn::cli
