// User-defined score and mask functions in FlexAttention's vocabulary: a score_mod(score, b,
// h, q_idx, kv_idx) and a mask_mod(b, h, q_idx, kv_idx), given as functors or lambdas,
// turned into the AttentionOptions::score_hook that forward() and backward() call once per
// span of a score row (options.hpp: ScoreHook). The templates below live in the caller's
// translation unit: the per-score loop over the user's functor is compiled there, inlined,
// with no indirect call per score. docs/algorithm.md §6.2.
//
//   const auto rel_bias = [&](auto s, std::int64_t, std::int64_t h, std::int64_t q, std::int64_t kv) {
//     return s + table[h][q - kv + max_len];
//   };
//   const auto causal_doc = [&](std::int64_t, std::int64_t, std::int64_t q, std::int64_t kv) {
//     return doc[q] == doc[kv] && kv <= q;
//   };
//   const flashattn::FlexMods mods(rel_bias, causal_doc);             // must outlive the calls
//   const flashattn::BlockMask blocks = flashattn::create_block_mask(causal_doc, 1, 1, S, S);
//   options.score_hook = mods.hook(&blocks);
//
// The backward needs d score_mod / d score. A score_mod generic in its score (`auto s`) is
// differentiated by the library: it is called with flex::Dual, a forward-mode dual number,
// for which +, −, ·, / and flex::tanh, exp, log, sqrt, abs are defined (write those
// unqualified or as flex::tanh, not std::tanh). Otherwise wrap it with its derivative:
// flex::WithDerivative{score_mod, dscore_mod}, dscore_mod(score, b, h, q_idx, kv_idx).
// A score_mod that is neither runs forward only; backward() rejects the hook by name. A
// functor with an overload for Dual<float> or Dual<double> is differentiated by the one it
// has. Dual has no comparisons: a generic score_mod whose body does not compile for Dual (a
// clamp through std::max, a branch on the score) is a compile error, not a forward-only mod
// (its body is instantiated to see what it returns): give such a mod a plain float score, or
// wrap it in WithDerivative.
//
// score_mod and mask_mod may throw (a table lookup out of range): FlexMods catches the first
// exception on the library's threads — where it would end the process — and forward() or
// backward() rethrows it after the call (its outputs are then unspecified), as
// create_block_mask rethrows mask_mod's. One FlexMods serves one call at a time (its
// exception slot is its own): a call given mods another call holds is an Error naming
// score_hook — concurrent calls each take a copy (cheap: the copy holds the same mods).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include "flashattn/error.hpp"
#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn {
namespace flex {

// value + grad·ε with ε² = 0: a function applied to Dual{x, 1} gives {f(x), f'(x)}.
template <class T>
struct Dual {
  T value;
  T grad;
};

template <class T> Dual<T> operator+(Dual<T> a, Dual<T> b) { return {a.value + b.value, a.grad + b.grad}; }
template <class T> Dual<T> operator-(Dual<T> a, Dual<T> b) { return {a.value - b.value, a.grad - b.grad}; }
template <class T> Dual<T> operator*(Dual<T> a, Dual<T> b) { return {a.value * b.value, a.grad * b.value + a.value * b.grad}; }
template <class T> Dual<T> operator/(Dual<T> a, Dual<T> b) {
  return {a.value / b.value, (a.grad * b.value - a.value * b.grad) / (b.value * b.value)};
}
template <class T> Dual<T> operator-(Dual<T> a) { return {-a.value, -a.grad}; }
// With a constant (any arithmetic type, converted to T).
template <class T, class U, class = std::enable_if_t<std::is_arithmetic_v<U>>>
Dual<T> operator+(Dual<T> a, U c) { return {a.value + static_cast<T>(c), a.grad}; }
template <class T, class U, class = std::enable_if_t<std::is_arithmetic_v<U>>>
Dual<T> operator+(U c, Dual<T> a) { return a + c; }
template <class T, class U, class = std::enable_if_t<std::is_arithmetic_v<U>>>
Dual<T> operator-(Dual<T> a, U c) { return {a.value - static_cast<T>(c), a.grad}; }
template <class T, class U, class = std::enable_if_t<std::is_arithmetic_v<U>>>
Dual<T> operator-(U c, Dual<T> a) { return {static_cast<T>(c) - a.value, -a.grad}; }
template <class T, class U, class = std::enable_if_t<std::is_arithmetic_v<U>>>
Dual<T> operator*(Dual<T> a, U c) { return {a.value * static_cast<T>(c), a.grad * static_cast<T>(c)}; }
template <class T, class U, class = std::enable_if_t<std::is_arithmetic_v<U>>>
Dual<T> operator*(U c, Dual<T> a) { return a * c; }
template <class T, class U, class = std::enable_if_t<std::is_arithmetic_v<U>>>
Dual<T> operator/(Dual<T> a, U c) { return {a.value / static_cast<T>(c), a.grad / static_cast<T>(c)}; }
template <class T, class U, class = std::enable_if_t<std::is_arithmetic_v<U>>>
Dual<T> operator/(U c, Dual<T> a) { return Dual<T>{static_cast<T>(c), T(0)} / a; }

// The elementary functions, for plain numbers and for Dual.
inline float tanh(float x) { return std::tanh(x); }
inline double tanh(double x) { return std::tanh(x); }
inline float exp(float x) { return std::exp(x); }
inline double exp(double x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
inline double log(double x) { return std::log(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline double sqrt(double x) { return std::sqrt(x); }
inline float abs(float x) { return std::fabs(x); }
inline double abs(double x) { return std::fabs(x); }
template <class T> Dual<T> tanh(Dual<T> a) {
  const T t = std::tanh(a.value);
  return {t, a.grad * (T(1) - t * t)};
}
template <class T> Dual<T> exp(Dual<T> a) {
  const T e = std::exp(a.value);
  return {e, a.grad * e};
}
template <class T> Dual<T> log(Dual<T> a) { return {std::log(a.value), a.grad / a.value}; }
template <class T> Dual<T> sqrt(Dual<T> a) {
  const T r = std::sqrt(a.value);
  return {r, a.grad / (T(2) * r)};
}
template <class T> Dual<T> abs(Dual<T> a) { return a.value < T(0) ? -a : a; }

// A score_mod with its derivative d score_mod / d score, both (score, b, h, q_idx, kv_idx).
template <class F, class DF>
struct WithDerivative {
  F f;
  DF df;
};
template <class F, class DF>
WithDerivative(F, DF) -> WithDerivative<F, DF>;

// "No score_mod" / "no mask_mod" for FlexMods.
struct NoScoreMod {};
struct NoMaskMod {};

namespace detail {

template <class F> struct IsWithDerivative : std::false_type {};
template <class F, class DF> struct IsWithDerivative<WithDerivative<F, DF>> : std::true_type {};

// score_mod at s, of type T (float in the kernels, double in the reference).
template <class T, class F>
T call_score(const F& f, T s, std::int64_t b, std::int64_t h, std::int64_t q, std::int64_t kv) {
  if constexpr (IsWithDerivative<F>::value) {
    return call_score(f.f, s, b, h, q, kv);
  } else if constexpr (std::is_invocable_v<const F&, T, std::int64_t, std::int64_t, std::int64_t, std::int64_t>) {
    return static_cast<T>(f(s, b, h, q, kv));
  } else {
    return static_cast<T>(f(static_cast<float>(s), b, h, q, kv));
  }
}

template <class T, class F>
constexpr bool kTakesDual = std::is_invocable_v<const F&, Dual<T>, std::int64_t, std::int64_t, std::int64_t, std::int64_t>;

// Whether the backward can differentiate score_mod: wrapped with its derivative, or callable
// on Dual<float> or Dual<double> — one rule for the kernels (float) and the reference (double),
// each calling the overload there is (a mod written for Dual<double> only is differentiated
// in double and rounded, not taken as having derivative 1).
template <class F>
constexpr bool kDifferentiable = IsWithDerivative<F>::value || kTakesDual<float, F> || kTakesDual<double, F>;

// {score_mod(s), d score_mod / d s}.
template <class T, class F>
Dual<T> call_with_derivative(const F& f, T s, std::int64_t b, std::int64_t h, std::int64_t q, std::int64_t kv) {
  if constexpr (IsWithDerivative<F>::value) {
    return {call_score(f.f, s, b, h, q, kv), static_cast<T>(f.df(s, b, h, q, kv))};
  } else {
    using U = std::conditional_t<kTakesDual<T, F>, T, std::conditional_t<std::is_same_v<T, float>, double, float>>;
    const auto r = f(Dual<U>{static_cast<U>(s), U(1)}, b, h, q, kv);
    return {static_cast<T>(r.value), static_cast<T>(r.grad)};
  }
}

// Runs row(item) for every item < count on the library's threads (OpenMP, dynamic schedule;
// src/core/flex.cpp), then rethrows the first exception a call threw. create_block_mask's
// rows of blocks: one indirect call per row, mask_mod inlined inside it.
void parallel_rows(std::int64_t count, const std::function<void(std::int64_t)>& row);

// A score hook's span for a score_mod evaluated as coefficients, f(s) = a·s + c, and a mask
// held as bytes (the Python FlexAttention's hook, src/python/module.cpp), on the CPU's widest
// SIMD target (src/cpu/flex_span.cpp): for k < n, where scores[k] is not −∞ and keep is null
// or keep[k·keep_step] is non-zero,
//   scores[k] = a[k·a_step]·scores[k] + c[k·c_step]·c_scale   (a null: 1; c null: 0)
//   grad[k]  *= a[k·a_step]                                    (grad null: none)
// and elsewhere scores[k] = −∞, grad[k] = 0. Steps of 0 broadcast one value.
void affine_span(float* scores, float* grad, std::int64_t n, const float* a, std::int64_t a_step, const float* c,
                 std::int64_t c_step, float c_scale, const std::uint8_t* keep, std::int64_t keep_step);

// Partial blocks kept as bytes (BlockMask::partial_keep; the dense attn_mask summary's copy):
// where `count` blocks of `block_bytes` take at most 128 bytes per (query + key) of each of
// `planes` (batch, head) planes — the diagonals of causal, window, document and prefix masks;
// a random-looking mask, partial everywhere, keeps none, so memory stays linear.
// In double: `count` blocks of block_rows × block_cols bytes overflowed int64 for a block_size
// near 2^32 or above, and a wrapped product passed the budget.
constexpr std::int64_t kPartialBytesPerKey = 128;
constexpr bool partial_blocks_fit(std::int64_t count, std::int64_t block_rows, std::int64_t block_cols,
                                  std::int64_t planes, std::int64_t seqlen_q, std::int64_t seqlen_k) {
  return count > 0 && static_cast<double>(count) * static_cast<double>(block_rows) * static_cast<double>(block_cols) <=
                          static_cast<double>(kPartialBytesPerKey) * static_cast<double>(planes) *
                              (static_cast<double>(seqlen_q) + static_cast<double>(seqlen_k));
}
// Numbers the partial blocks among states[0, n) (ScoreBlock values) in order: slots[e] is
// block e's slot, −1 where it is not partial; returns each slot's block.
std::vector<std::int64_t> number_partial_blocks(const std::uint8_t* states, std::int64_t n, std::int32_t* slots);

}  // namespace detail
}  // namespace flex

// A block mask derived from a mask_mod (create_block_mask); see ScoreHook::block_mask.
struct BlockMask {
  Tensor blocks;  // u8 ScoreBlock values, (batch or 1, heads or 1, q blocks, kv blocks)
  std::int64_t block_size = 0;
  // What the hook hands the kernels where block_size is a larger multiple of kKernelBlock (the
  // CPU kernels' key panel): the same mask in blocks of kKernelBlock, so that a row strip on
  // the mask's diagonal is narrowed to the sub-blocks it sees and mask_mod runs only on the
  // partial ones (docs/algorithm.md §6). Empty (kernel_block_size 0) otherwise.
  static constexpr std::int64_t kKernelBlock = 32;
  Tensor kernel_blocks;
  std::int64_t kernel_block_size = 0;
  // mask_mod's values on the partial blocks that the hook hands the kernels (kernel_blocks
  // where set, else blocks), so that the kernels read a byte per score there instead of calling
  // mask_mod (ScoreHook::partial_slots, partial_keep): i32 slots of that block grid's shape
  // (−1: none) and u8 (slots, size, size). Kept where they fit flex::detail::partial_blocks_fit
  // (a budget linear in the sequence lengths); a mask with more partial blocks (random-looking
  // ones) has none and calls mask_mod.
  Tensor partial_slots, partial_keep;
};

// Evaluates mask_mod(b, h, q_idx, kv_idx) over (b < batch, h < heads, q_idx < seqlen_q,
// kv_idx < seqlen_k), each element at most once, and classifies each block_size × block_size
// block as empty, partial or full (FlexAttention's create_block_mask); a block stops being
// evaluated after the row that showed it partial. The partial blocks handed to the kernels
// are then evaluated once more, whole, for their bytes (BlockMask::partial_keep) where those
// fit the budget. The rows of blocks run on the library's
// threads, so mask_mod is called from several threads at once — as the kernels call it: a
// pure function of its arguments, as FlexAttention's are. batch = 1 (heads = 1) when mask_mod
// does not depend on b (h): the block mask is then shared by every batch element (head).
template <class MaskMod>
BlockMask create_block_mask(const MaskMod& mask_mod, std::int64_t batch, std::int64_t heads, std::int64_t seqlen_q,
                            std::int64_t seqlen_k, std::int64_t block_size = 128) {
  if (batch < 1 || heads < 1 || seqlen_q < 0 || seqlen_k < 0)
    throw Error("create_block_mask: expected batch, heads >= 1 and seqlen_q, seqlen_k >= 0, got (" +
                std::to_string(batch) + ", " + std::to_string(heads) + ", " + std::to_string(seqlen_q) + ", " +
                std::to_string(seqlen_k) + ")");
  if (block_size < 1) throw Error("create_block_mask: block_size must be >= 1, got " + std::to_string(block_size));
  // Each element is evaluated once, into blocks of `unit` (kKernelBlock where it divides
  // block_size, else block_size itself); a block's state is its units' combined.
  const std::int64_t unit =
      block_size % BlockMask::kKernelBlock == 0 && block_size > BlockMask::kKernelBlock ? BlockMask::kKernelBlock
                                                                                          : block_size;
    const std::int64_t uq = blocks_of(seqlen_q, unit), uk = blocks_of(seqlen_k, unit);
  Tensor units(DType::u8, {batch, heads, uq, uk});
  std::uint8_t* u = units.data_as<std::uint8_t>();
  flex::detail::parallel_rows(batch * heads * uq, [&](std::int64_t item) {
    const std::int64_t plane = item / uq, bi = item % uq, b = plane / heads, h = plane % heads;
    const std::int64_t i_end = std::min(seqlen_q, (bi + 1) * unit);
    for (std::int64_t bj = 0; bj < uk; ++bj) {
      const std::int64_t j_end = std::min(seqlen_k, (bj + 1) * unit);
      bool any_kept = false, any_hidden = false;
      for (std::int64_t i = bi * unit; i < i_end && !(any_kept && any_hidden); ++i)
        for (std::int64_t j = bj * unit; j < j_end; ++j) {
          const bool kept = mask_mod(b, h, i, j);
          any_kept = any_kept || kept;
          any_hidden = any_hidden || !kept;
        }
      u[item * uk + bj] = static_cast<std::uint8_t>(classify_block(any_kept, any_hidden));
    }
  });
  // The partial units' bytes, within the budget: each evaluated again, whole.
  Tensor partial_slots, partial_keep;
  const std::int64_t partial = std::count(u, u + units.numel(), static_cast<std::uint8_t>(ScoreBlock::partial));
  if (flex::detail::partial_blocks_fit(partial, unit, unit, batch * heads, seqlen_q, seqlen_k)) {
    partial_slots = Tensor(DType::i32, {batch, heads, uq, uk});
    partial_keep = Tensor(DType::u8, {partial, unit, unit});
    const std::vector<std::int64_t> at =
        flex::detail::number_partial_blocks(u, units.numel(), partial_slots.data_as<std::int32_t>());
    std::uint8_t* keep = partial_keep.data_as<std::uint8_t>();
    flex::detail::parallel_rows(partial, [&](std::int64_t slot) {
      const std::int64_t e = at[static_cast<std::size_t>(slot)], bj = e % uk, bi = e / uk % uq, plane = e / (uk * uq);
      const std::int64_t b = plane / heads, h = plane % heads;
      std::uint8_t* bytes = keep + slot * unit * unit;
      for (std::int64_t r = 0; r < unit; ++r)
        for (std::int64_t c = 0; c < unit; ++c) {
          const std::int64_t i = bi * unit + r, j = bj * unit + c;
          bytes[r * unit + c] = i < seqlen_q && j < seqlen_k && mask_mod(b, h, i, j) ? 1 : 0;
        }
    });
  }
  if (unit == block_size)
    return BlockMask{std::move(units), block_size, {}, 0, std::move(partial_slots), std::move(partial_keep)};
  const std::int64_t r = block_size / unit, qb = blocks_of(seqlen_q, block_size), kb = blocks_of(seqlen_k, block_size);
  BlockMask m{Tensor(DType::u8, {batch, heads, qb, kb}), block_size, std::move(units), unit, std::move(partial_slots),
              std::move(partial_keep)};
  const std::uint8_t* fine = m.kernel_blocks.data_as<std::uint8_t>();
  std::uint8_t* out = m.blocks.data_as<std::uint8_t>();
  for (std::int64_t p = 0; p < batch * heads; ++p)
    for (std::int64_t bi = 0; bi < qb; ++bi)
      for (std::int64_t bj = 0; bj < kb; ++bj) {
        bool any_kept = false, any_hidden = false;
        for (std::int64_t fi = bi * r; fi < std::min(uq, (bi + 1) * r); ++fi)
          for (std::int64_t fj = bj * r; fj < std::min(uk, (bj + 1) * r); ++fj) {
            const auto state = static_cast<ScoreBlock>(fine[(p * uq + fi) * uk + fj]);
            any_kept = any_kept || state != ScoreBlock::empty;
            any_hidden = any_hidden || state != ScoreBlock::full;
          }
        out[(p * qb + bi) * kb + bj] = static_cast<std::uint8_t>(classify_block(any_kept, any_hidden));
      }
  return m;
}

// A score_mod and a mask_mod (either may be flex::NoScoreMod / flex::NoMaskMod) and the
// ScoreHook that runs them. The object must outlive every call given its hook.
template <class ScoreMod = flex::NoScoreMod, class MaskMod = flex::NoMaskMod>
class FlexMods {
 public:
  static constexpr bool kHasScore = !std::is_same_v<ScoreMod, flex::NoScoreMod>;
  static constexpr bool kHasMask = !std::is_same_v<MaskMod, flex::NoMaskMod>;

  explicit FlexMods(ScoreMod score_mod = {}, MaskMod mask_mod = {}) : score_mod_(score_mod), mask_mod_(mask_mod) {}
  // A copy holds the same mods, and no exception of the original's calls.
  FlexMods(const FlexMods& other) : score_mod_(other.score_mod_), mask_mod_(other.mask_mod_) {}
  FlexMods& operator=(const FlexMods& other) {
    score_mod_ = other.score_mod_;
    mask_mod_ = other.mask_mod_;
    return *this;
  }

  // The hook for AttentionOptions::score_hook; `block_mask` (null: none) must outlive the calls too.
  ScoreHook hook(const BlockMask* block_mask = nullptr) const {
    ScoreHook h;
    h.apply = &apply;
    h.take_error = &take_error;
    h.enter = &enter;
    h.leave = &leave;
    h.mods = this;
    if constexpr (kHasScore) {
      h.score = [](const void* self, double s, std::int64_t b, std::int64_t hd, std::int64_t q, std::int64_t kv) {
        return flex::detail::call_score(static_cast<const FlexMods*>(self)->score_mod_, s, b, hd, q, kv);
      };
      if constexpr (flex::detail::kDifferentiable<ScoreMod>)
        h.derivative = [](const void* self, double s, std::int64_t b, std::int64_t hd, std::int64_t q, std::int64_t kv) {
          return flex::detail::call_with_derivative(static_cast<const FlexMods*>(self)->score_mod_, s, b, hd, q, kv).grad;
        };
    }
    if constexpr (kHasMask)
      h.mask = [](const void* self, std::int64_t b, std::int64_t hd, std::int64_t q, std::int64_t kv) {
        return static_cast<bool>(static_cast<const FlexMods*>(self)->mask_mod_(b, hd, q, kv));
      };
    if (block_mask != nullptr) {
      const bool kernel = block_mask->kernel_block_size > 0;
      h.block_mask = kernel ? block_mask->kernel_blocks.view() : block_mask->blocks.view();
      h.block_size = kernel ? block_mask->kernel_block_size : block_mask->block_size;
      if constexpr (kHasMask)
        if (!block_mask->partial_slots.shape().empty()) {
          h.partial_slots = block_mask->partial_slots.view();
          h.partial_keep = block_mask->partial_keep.view();
        }
    }
    return h;
  }

 private:
  // The per-span loop (ScoreSpan): scores in log2 units go to score_mod in natural units and
  // back; the derivative is unit-free.
  template <bool Mask, bool Grad>
  static void run(const FlexMods& m, const ScoreSpan& sp) {
    constexpr float kLn2 = 0.693147180559945309f, kLog2e = 1.442695040888963407f;
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    for (std::int64_t c = 0; c < sp.n; ++c) {
      const float s = sp.scores[c];
      const std::int64_t kv = sp.kv_begin + c;
      bool keep = s != kNegInf;
      // `&`, not `&&`: no branch per score, so an inlined mask_mod vectorises over the span.
      if constexpr (Mask) keep = keep & static_cast<bool>(m.mask_mod_(sp.batch, sp.head, sp.q_idx, kv));
      float out = s;
      if constexpr (kHasScore) {
        if constexpr (Grad) {
          const flex::Dual<float> r =
              flex::detail::call_with_derivative(m.score_mod_, s * kLn2, sp.batch, sp.head, sp.q_idx, kv);
          out = r.value * kLog2e;
          sp.grad[c] *= keep ? r.grad : 0.0f;
        } else {
          out = flex::detail::call_score(m.score_mod_, s * kLn2, sp.batch, sp.head, sp.q_idx, kv) * kLog2e;
        }
      }
      sp.scores[c] = keep ? out : kNegInf;
    }
  }

  static void run_span(const FlexMods& m, const ScoreSpan& sp) {
    const bool mask = kHasMask && sp.mask;
    if constexpr (kHasScore && flex::detail::kDifferentiable<ScoreMod>) {
      if (sp.grad != nullptr) {
        if (mask) run<kHasMask, true>(m, sp); else run<false, true>(m, sp);
        return;
      }
    }
    if (mask) run<kHasMask, false>(m, sp); else run<false, false>(m, sp);
  }

  // The kernels' call (ScoreHook::apply): an exception is kept, not thrown (the span is then
  // hidden, so the call finishes) and ScoreHook::take_error hands it to forward()/backward().
  static void apply(const void* self, const ScoreSpan& sp) noexcept {
    const FlexMods& m = *static_cast<const FlexMods*>(self);
    try {
      run_span(m, sp);
    } catch (...) {
      if (!m.failed_.exchange(true)) m.error_ = std::current_exception();
      for (std::int64_t c = 0; c < sp.n; ++c) {
        sp.scores[c] = -std::numeric_limits<float>::infinity();
        if (sp.grad != nullptr) sp.grad[c] = 0.0f;
      }
    }
  }

  static std::exception_ptr take_error(const void* self) {
    const FlexMods& m = *static_cast<const FlexMods*>(self);
    if (!m.failed_.load()) return nullptr;
    std::exception_ptr e = m.error_;
    m.error_ = nullptr;
    m.failed_.store(false);
    return e;
  }

  // One call at a time (ScoreHook::enter, leave): the exception slot below is the object's.
  static bool enter(const void* self) { return !static_cast<const FlexMods*>(self)->in_call_.exchange(true); }
  static void leave(const void* self) { static_cast<const FlexMods*>(self)->in_call_.store(false); }

  ScoreMod score_mod_;
  MaskMod mask_mod_;
  // The first exception a mod threw during a call (apply), until take_error.
  mutable std::atomic<bool> failed_{false};
  mutable std::exception_ptr error_;
  mutable std::atomic<bool> in_call_{false};  // a call holds the object (enter)
};

}  // namespace flashattn
