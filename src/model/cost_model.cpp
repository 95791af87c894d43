// The cost model: traffic, work, Θ-forms, per-tile unit cycles and predicted time.
// The tiled traffic walks the forward's schedule (forward_work_item, flashattn/plan.hpp: key
// ranges and split-KV shares) as the kernels of src/cpu/kernels/ do, and mirrors their tile
// skipping and the loops of src/cpu/kernels/tiled_backward.cpp, which is what lets tests
// demand equality with KernelCounters.
#include "flashattn/cost_model.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "flashattn/error.hpp"

namespace flashattn::cost {
namespace {

constexpr int kF32Bytes = 4;  // lse, D = rowsum(dO ∘ O), the dQ accumulator, split partials

// a ≥ 0, b ≥ 1; no a + b − 1 to overflow near INT64_MAX.
std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

int element_bytes(DType dtype) { return static_cast<int>(dtype_size(dtype)); }

void check_tiling(const Tiling& t) {
  if (t.block_q < 1 || t.block_k < 1 || t.splits < 1) {
    std::ostringstream s;
    s << "tiling: block_q, block_k and splits must be >= 1, got " << t.block_q << ", " << t.block_k << ", "
      << t.splits;
    throw Error(s.str());
  }
}

// The kernels' test for a (Q tile, K/V tile) pair with work: key ranges are non-decreasing
// in the row, so the first and the last row bound the tile's visible keys.
bool tile_has_work(const AttentionProblem& p, std::int64_t i0, std::int64_t rows, std::int64_t j0,
                   std::int64_t n) {
  return !(p.key_range(i0 + rows - 1).end <= j0 || p.key_range(i0).begin >= j0 + n);
}

}  // namespace

Tiling tiling_of(const CpuForwardPlan& plan) {
  return {plan.block_q, plan.block_k, plan.splits, is_decode(plan.kernel), plan.heads_per_item};
}

Tiling tiling_of(const CpuBackwardPlan& plan) { return {plan.block_q, plan.block_k, 1, false}; }

std::int64_t Traffic::elements() const {
  std::int64_t total = 0;
  for (const Term& t : terms) total += t.elements;
  return total;
}

std::int64_t Traffic::bytes() const {
  std::int64_t total = 0;
  for (const Term& t : terms) total += t.bytes();
  return total;
}

std::int64_t Traffic::elements_of(std::string_view tensor, bool write) const {
  std::int64_t total = 0;
  for (const Term& t : terms)
    if (t.tensor == tensor && t.write == write) total += t.elements;
  return total;
}

void Traffic::add(std::string tensor, bool write, std::int64_t elements, int bytes) {
  for (Term& t : terms)
    if (t.tensor == tensor && t.write == write) {
      t.elements += elements;
      return;
    }
  terms.push_back({std::move(tensor), write, elements, bytes});
}

std::string to_string(StandardModel model) { return model == StandardModel::eager ? "eager" : "minimal"; }

StandardModel parse_standard_model(std::string_view name) {
  if (name == "minimal") return StandardModel::minimal;
  if (name == "eager") return StandardModel::eager;
  throw Error("standard: unknown model '" + std::string(name) + "' (known: minimal, eager)");
}

namespace {

// The passes of standard attention over batch · heads_q heads. A pass's reads and writes
// are named by tensor; N×N operands are "S", "P", "P dropped", "dP", "dS" in the input
// dtype, the dropout keep mask one byte per score (PyTorch's bool mask).
struct PassBuilder {
  const AttentionProblem& p;
  std::int64_t heads, nn;
  int eb;
  std::vector<Pass> passes;

  explicit PassBuilder(const AttentionProblem& problem)
      : p(problem), heads(problem.batch * problem.heads_q), nn(heads * problem.seqlen_q * problem.seqlen_k),
        eb(element_bytes(problem.dtype)) {}
  Pass& pass(std::string name, double flops = 0.0) {
    passes.push_back({std::move(name), {}, flops});
    return passes.back();
  }
  // An elementwise kernel on N×N operands: reads `in`, writes `out`.
  void elementwise(std::string name, std::initializer_list<const char*> in, const char* out) {
    Pass& k = pass(std::move(name));
    for (const char* t : in) k.traffic.add(t, false, nn, std::string_view(t) == "dropout mask" ? 1 : eb);
    k.traffic.add(out, true, nn, eb);
  }
  std::int64_t q() const { return heads * p.seqlen_q * p.head_dim; }
  std::int64_t k() const { return heads * p.seqlen_k * p.head_dim; }
  std::int64_t v() const { return heads * p.seqlen_k * p.head_dim_v; }
  std::int64_t o() const { return heads * p.seqlen_q * p.head_dim_v; }
  double mm(std::int64_t inner) const { return 2.0 * static_cast<double>(nn) * static_cast<double>(inner); }
};

TiledAccount summed(const std::vector<Pass>& passes, const AttentionProblem& p) {
  TiledAccount a;
  for (const Pass& k : passes)
    for (const Traffic::Term& t : k.traffic.terms) a.traffic.add(t.tensor, t.write, t.elements, t.element_bytes);
  a.tiles_computed = p.batch * p.heads_q;  // one "tile": the whole matrix of a head
  a.scores = p.batch * p.heads_q * p.seqlen_q * p.seqlen_k;
  return a;
}

}  // namespace

std::vector<Pass> standard_forward_passes(const AttentionProblem& p, StandardModel model) {
  PassBuilder b(p);
  const bool eager = model == StandardModel::eager, dropout = eager && p.dropout_p > 0.0f;
  Pass& qk = b.pass(eager ? "S = Q·Kᵀ" : "S = Q·Kᵀ·scale, masked", b.mm(p.head_dim));
  qk.traffic.add("Q", false, b.q(), b.eb);
  qk.traffic.add("K", false, b.k(), b.eb);
  qk.traffic.add("S", true, b.nn, b.eb);
  if (eager) {
    b.elementwise("scale", {"S"}, "S");
    b.elementwise("mask", {"S"}, "S");
  }
  b.elementwise("P = softmax(S)", {"S"}, "P");
  if (dropout) {
    b.elementwise("dropout", {"P"}, "P dropped");
    b.passes.back().traffic.add("dropout mask", true, b.nn, 1);
  }
  Pass& pv = b.pass(dropout ? "O = P dropped·V" : "O = P·V", b.mm(p.head_dim_v));
  pv.traffic.add(dropout ? "P dropped" : "P", false, b.nn, b.eb);
  pv.traffic.add("V", false, b.v(), b.eb);
  pv.traffic.add("O", true, b.o(), b.eb);
  return b.passes;
}

std::vector<Pass> standard_backward_passes(const AttentionProblem& p, StandardModel model) {
  PassBuilder b(p);
  const bool eager = model == StandardModel::eager, dropout = eager && p.dropout_p > 0.0f;
  const char* p_used = dropout ? "P dropped" : "P";
  Pass& dv = b.pass(std::string("dV = ") + p_used + "ᵀ·dO", b.mm(p.head_dim_v));
  dv.traffic.add(p_used, false, b.nn, b.eb);
  dv.traffic.add("dO", false, b.o(), b.eb);
  dv.traffic.add("dV", true, b.v(), b.eb);
  Pass& dp = b.pass("dP = dO·Vᵀ", b.mm(p.head_dim_v));
  dp.traffic.add("dO", false, b.o(), b.eb);
  dp.traffic.add("V", false, b.v(), b.eb);
  dp.traffic.add("dP", true, b.nn, b.eb);
  if (dropout) b.elementwise("dropout backward", {"dP", "dropout mask"}, "dP");
  b.elementwise("dS = P∘(dP − rowsum(P∘dP))", {"P", "dP"}, "dS");
  if (eager) {
    b.elementwise("mask backward", {"dS"}, "dS");
    b.elementwise("scale backward", {"dS"}, "dS");
  }
  Pass& dq = b.pass("dQ = dS·K", b.mm(p.head_dim));
  dq.traffic.add("dS", false, b.nn, b.eb);
  dq.traffic.add("K", false, b.k(), b.eb);
  dq.traffic.add("dQ", true, b.q(), b.eb);
  Pass& dk = b.pass("dK = dSᵀ·Q", b.mm(p.head_dim));
  dk.traffic.add("dS", false, b.nn, b.eb);
  dk.traffic.add("Q", false, b.q(), b.eb);
  dk.traffic.add("dK", true, b.k(), b.eb);
  return b.passes;
}

TiledAccount standard_forward(const AttentionProblem& p, StandardModel model) {
  return summed(standard_forward_passes(p, model), p);
}
TiledAccount standard_backward(const AttentionProblem& p, StandardModel model) {
  return summed(standard_backward_passes(p, model), p);
}

TiledAccount flash_forward(const AttentionProblem& p, const Tiling& tiling) {
  check_tiling(tiling);
  TiledAccount a;
  if (p.batch == 0 || p.seqlen_q == 0) return a;
  const std::int64_t bq = tiling.block_q, bc = tiling.block_k, splits = tiling.splits;
  const std::int64_t d = p.head_dim, dv = p.head_dim_v;
  const int eb = element_bytes(p.dtype);
  // Split partials are float32 and merged afterwards (merge_attention_states).
  const int out_bytes = splits > 1 ? kF32Bytes : eb;
  const char* out_name = splits > 1 ? "O partial" : "O";
  const char* lse_name = splits > 1 ? "lse partial" : "lse";
  const std::int64_t k_tiles = ceil_div(p.seqlen_k, bc);
  // Every (batch, head) — (batch, kv head) for decode — runs the same loops: count one, scale.
  std::int64_t q_elems = 0, k_keys = 0, out_rows = 0, computed = 0, scores = 0, grid = 0, copies = 0;
  // Keys of each K/V tile that some Q tile reads: the head's K/V as a cache would hold them.
  std::vector<std::int64_t> tile_keys(static_cast<std::size_t>(tiling.decode ? 0 : k_tiles), 0);
  std::int64_t once_keys = 0;
  // The work items of the first (batch, head) — (batch, kv head) for decode, whose items
  // hold every head's rows — as the kernels run them.
  const std::int64_t hpi = tiling.decode ? 1 : tiling.heads_per_item;
  if (hpi < 1 || p.heads_q / p.heads_kv % hpi != 0)
    throw Error("tiling: heads_per_item " + std::to_string(hpi) + " does not divide the " +
                std::to_string(p.heads_q / p.heads_kv) + " q heads of a kv head");
  const ForwardSchedule schedule{bq, bc, tiling.decode ? 1 : ceil_div(p.seqlen_q, bq), splits, tiling.decode, hpi};
  const std::int64_t items = schedule.q_blocks * splits;
  const std::int64_t group = tiling.decode ? p.heads_q / p.heads_kv : hpi;  // q heads per item's rows
  copies = tiling.decode ? p.batch * p.heads_kv : p.batch * p.heads_q / hpi;
  grid = schedule.q_blocks * k_tiles;
  for (std::int64_t item = 0; item < items; ++item) {
    const ForwardWorkItem w = forward_work_item(p, schedule, item);
    const std::int64_t rows = group * w.rows;
    q_elems += rows * d;
    out_rows += rows;
    for (std::int64_t j0 = w.first_block; j0 < w.key_end; j0 += bc) {
      const std::int64_t n = std::min(bc, w.key_end - j0);
      if (!tiling.decode && !tile_has_work(p, w.row_begin, w.rows, j0, n)) continue;
      ++computed;
      scores += rows * n;
      k_keys += n;
      if (tiling.decode) continue;
      std::int64_t& seen = tile_keys[static_cast<std::size_t>(j0 / bc)];
      seen = std::max(seen, n);
    }
  }
  if (tiling.decode) once_keys = k_keys;
  Traffic& t = a.traffic;
  t.add("Q", false, copies * q_elems, eb);
  t.add("K", false, copies * k_keys * d, eb);
  t.add("V", false, copies * k_keys * dv, eb);
  t.add(out_name, true, copies * out_rows * dv, out_bytes);
  t.add(lse_name, true, copies * out_rows, kF32Bytes);
  if (splits > 1) {  // the merge reads every partial and writes the output once
    t.add("O partial", false, copies * out_rows * dv, kF32Bytes);
    t.add("lse partial", false, copies * out_rows, kF32Bytes);
    t.add("O", true, p.batch * p.heads_q * p.seqlen_q * dv, eb);
    t.add("lse", true, p.batch * p.heads_q * p.seqlen_q, kF32Bytes);
  }
  a.tiles_computed = copies * computed;
  a.tiles_skipped = std::max<std::int64_t>(0, copies * grid - a.tiles_computed);
  a.scores = copies * scores;
  a.restreamed_bytes = copies * k_keys * (d + dv) * eb;
  a.restream_tiles = tiling.decode ? 1 : ceil_div(p.seqlen_q, bq);
  for (const std::int64_t n : tile_keys) once_keys += n;
  a.restreamed_once_bytes = copies * once_keys * (d + dv) * eb;
  a.restream_heads = copies;
  return a;
}

TiledAccount flash_backward(const AttentionProblem& p, const Tiling& tiling) {
  check_tiling(tiling);
  TiledAccount a;
  if (p.batch == 0) return a;
  const std::int64_t bq = tiling.block_q, bc = tiling.block_k;
  const std::int64_t d = p.head_dim, dv = p.head_dim_v, sq = p.seqlen_q, sk = p.seqlen_k;
  const int eb = element_bytes(p.dtype);
  const std::int64_t q_blocks = ceil_div(sq, bq), k_blocks = ceil_div(sk, bc);
  const std::int64_t heads = p.batch * p.heads_q, kv_heads = p.batch * p.heads_kv;
  // One q head against every K/V tile of its kv head (all q heads run the same loops).
  std::int64_t q_rows = 0, computed = 0, scores = 0, once_rows = 0;
  std::vector<char> q_tile_seen(static_cast<std::size_t>(q_blocks), 0);
  for (std::int64_t kb = 0; kb < k_blocks; ++kb) {
    const std::int64_t j0 = kb * bc, n = std::min(bc, sk - j0);
    for (std::int64_t qb = 0; qb < q_blocks; ++qb) {
      const std::int64_t i0 = qb * bq, rows = std::min(bq, sq - i0);
      if (!tile_has_work(p, i0, rows, j0, n)) continue;
      ++computed;
      scores += rows * n;
      q_rows += rows;
      if (!q_tile_seen[static_cast<std::size_t>(qb)]) once_rows += rows;
      q_tile_seen[static_cast<std::size_t>(qb)] = 1;
    }
  }
  Traffic& t = a.traffic;
  // D = rowsum(dO ∘ O) first, one pass over O and dO.
  t.add("O", false, heads * sq * dv, eb);
  t.add("dO", false, heads * sq * dv, eb);
  t.add("D", true, heads * sq, kF32Bytes);
  // Per K/V tile: K and V read once, dK and dV written once.
  t.add("K", false, kv_heads * sk * d, eb);
  t.add("V", false, kv_heads * sk * dv, eb);
  t.add("dK", true, kv_heads * sk * d, eb);
  t.add("dV", true, kv_heads * sk * dv, eb);
  // Per visible (K/V tile, Q tile) pair: the Q side streamed again.
  t.add("Q", false, heads * q_rows * d, eb);
  t.add("dO", false, heads * q_rows * dv, eb);
  t.add("lse", false, heads * q_rows, kF32Bytes);
  t.add("D", false, heads * q_rows, kF32Bytes);
  t.add("dQ accum", false, heads * q_rows * d, kF32Bytes);
  t.add("dQ accum", true, heads * q_rows * d, kF32Bytes);
  // Epilogue: dq = scale · accumulator.
  t.add("dQ accum", false, heads * sq * d, kF32Bytes);
  t.add("dQ", true, heads * sq * d, eb);
  a.tiles_computed = heads * computed;
  a.tiles_skipped = heads * q_blocks * k_blocks - a.tiles_computed;
  a.scores = heads * scores;
  a.restreamed_bytes = heads * q_rows * ((d + dv) * eb + (2 + 2 * d) * kF32Bytes);
  a.restream_tiles = k_blocks;
  a.restreamed_once_bytes = heads * once_rows * ((d + dv) * eb + (2 + 2 * d) * kF32Bytes);
  a.restream_heads = heads;
  return a;
}

ThetaForms theta_forms(const AttentionProblem& p, double m) {
  if (!(m > 0.0)) throw Error("sram_elements: must be > 0, got " + std::to_string(m));
  const double heads = static_cast<double>(p.batch * p.heads_q);
  const double sq = static_cast<double>(p.seqlen_q), sk = static_cast<double>(p.seqlen_k);
  const double d = static_cast<double>(p.head_dim);
  ThetaForms f;
  f.standard = heads * (sq * d + sq * sk);
  f.flash = heads * sq * sk * d * d / m;
  f.ratio = f.standard > 0.0 ? f.flash / f.standard : 0.0;
  return f;
}

const char* const kLowerBound =
    "No exact attention algorithm can, for every fast-memory size M in [d, N·d], move "
    "o(N²·d²/M) elements between slow and fast memory (Dao et al. 2022, FlashAttention, "
    "Proposition 3): tiling is asymptotically optimal in that range.";

Work work(const AttentionProblem& p) {
  Work w;
  std::int64_t per_head = 0;
  for (std::int64_t i = 0; i < p.seqlen_q; ++i) per_head += p.key_range(i).size();
  const double heads = static_cast<double>(p.batch * p.heads_q);
  const double d = static_cast<double>(p.head_dim), dv = static_cast<double>(p.head_dim_v);
  w.visible_pairs = per_head * p.batch * p.heads_q;
  const double pairs = static_cast<double>(w.visible_pairs);
  const double full = heads * static_cast<double>(p.seqlen_q) * static_cast<double>(p.seqlen_k);
  w.forward = 2.0 * pairs * (d + dv);
  w.backward_recompute = 2.0 * pairs * d;
  w.backward = 2.0 * pairs * (2.0 * d + 2.0 * dv) + w.backward_recompute;
  w.standard_forward = 2.0 * full * (d + dv);
  w.standard_backward = 2.0 * full * (2.0 * d + 2.0 * dv);
  w.exp_forward = pairs;
  w.exp_backward = pairs;
  w.exp_standard_forward = full;
  return w;
}

// ---- per-tile roofline --------------------------------------------------------------

namespace {

// FP32-pipe operations per score besides the exponential. Forward: the row maximum, the
// FMA s·scale − m, the row-sum add, and the conversion of P to 16 bits (one op per score,
// rounding the paired conversion up). Backward: the FMA s·scale − L, dP − D, the product
// with P, and the conversions of P and dS (one op for the pair, as paired conversions).
constexpr double kForwardSoftmaxOps = 4.0;
constexpr double kBackwardElementwiseOps = 4.0;
constexpr double kF32 = 4.0;  // bytes of a float32 (the dQ tile; CPU tiles)

// A tile's sizes as doubles, checked, and the bytes of its elements in fast memory (a
// CPU's tiles are float32 whatever the dtype: the kernels widen bf16/f16).
struct TileShape {
  double br, bc, d, dv, element_bytes;
};

TileShape tile_shape(const Architecture& arch, std::int64_t br, std::int64_t bc, std::int64_t d, std::int64_t dv,
                     const TileOptions& o) {
  if (br < 1 || bc < 1 || d < 1 || dv < 1) {
    std::ostringstream s;
    s << "tile: Br, Bc, D and Dv must be >= 1, got " << br << ", " << bc << ", " << d << ", " << dv;
    throw Error(s.str());
  }
  if (!(o.poly_exp_fraction >= 0.0 && o.poly_exp_fraction <= 1.0))
    throw Error("poly_exp_fraction: must be in [0, 1], got " + std::to_string(o.poly_exp_fraction));
  if (!(o.rescale_fraction >= 0.0 && o.rescale_fraction <= 1.0))
    throw Error("rescale_fraction: must be in [0, 1], got " + std::to_string(o.rescale_fraction));
  return {static_cast<double>(br), static_cast<double>(bc), static_cast<double>(d), static_cast<double>(dv),
          arch.cpu ? kF32 : static_cast<double>(dtype_size(o.dtype))};
}

// The exp unit's and the FP32 pipes' shares of `exps` exponentials. On a CPU the "exp
// unit" is the exact Exp2 on the FMA pipes and the polynomial share is Exp2Poly3; the
// shared_pipes rule adds their cycles.
void add_exponentials(const Architecture& arch, double exps, const TileOptions& o, UnitCycles& c) {
  c.exp = exps * (1.0 - o.poly_exp_fraction) / arch.exp_per_clock;
  c.fma += exps * o.poly_exp_fraction * arch.poly_exp_ops / arch.fp32_lanes;
}

double mma_rate(const Architecture& arch, DType dtype) {
  const double rate = arch.mma_per_clock(dtype);
  if (!(rate > 0.0)) throw Error("dtype: " + to_string(dtype) + " has no matrix-unit rate on " + arch.name);
  return rate;
}

}  // namespace

double Architecture::mma_per_clock(DType dtype) const { return dtype == DType::f32 ? mma_tf32 : mma_16bit; }

double Architecture::peak_flops(DType dtype) const { return units * clock_ghz * 1e9 * mma_per_clock(dtype); }

double UnitCycles::time() const {
  if (shared_pipes) return std::max(mma + exp + fma, smem);
  return std::max({mma, exp, fma, smem});
}

std::string UnitCycles::bottleneck() const {
  const double t = time();
  const auto is_max = [t](double v) { return std::fabs(v - t) <= 1e-9 * t; };
  if (shared_pipes) {
    const bool pipes = is_max(mma + exp + fma), l1 = is_max(smem);
    return pipes && l1 ? "fma pipes=smem" : pipes ? "fma pipes" : "smem";
  }
  std::string name;
  const std::pair<const char*, double> units[] = {{"mma", mma}, {"exp", exp}, {"fma", fma}, {"smem", smem}};
  for (const auto& [unit, cycles] : units)
    if (is_max(cycles)) {
      if (!name.empty()) name += '=';
      name += unit;
    }
  return name;
}

UnitCycles forward_tile_cycles(const Architecture& arch, std::int64_t block_q, std::int64_t block_k,
                               std::int64_t head_dim, std::int64_t head_dim_v, const TileOptions& o) {
  const auto [br, bc, d, dv, eb] = tile_shape(arch, block_q, block_k, head_dim, head_dim_v, o);
  UnitCycles c;
  c.shared_pipes = arch.cpu;
  c.mma = 2.0 * br * bc * (d + dv) / mma_rate(arch, o.dtype);
  // Softmax arithmetic on every score, and õ (Br × Dv) rescaled on the tiles that move m.
  c.fma = o.deferred_normalization ? (br * bc * kForwardSoftmaxOps + o.rescale_fraction * br * dv) / arch.fp32_lanes
                                    : (br * bc * (kForwardSoftmaxOps + 1.0) + br * dv) / arch.fp32_lanes;
  add_exponentials(arch, br * bc, o, c);
  // The matrix units read Q, K and V from shared memory; S and P never go there.
  c.smem = eb * (br * d + bc * d + bc * dv) / arch.smem_bytes_per_clock;
  return c;
}

UnitCycles backward_tile_cycles(const Architecture& arch, std::int64_t block_q, std::int64_t block_k,
                                std::int64_t head_dim, std::int64_t head_dim_v, const TileOptions& o) {
  const auto [br, bc, d, dv, eb] = tile_shape(arch, block_q, block_k, head_dim, head_dim_v, o);
  UnitCycles c;
  c.shared_pipes = arch.cpu;
  c.mma = 2.0 * br * bc * (3.0 * d + 2.0 * dv) / mma_rate(arch, o.dtype);
  c.fma = br * bc * kBackwardElementwiseOps / arch.fp32_lanes;
  add_exponentials(arch, br * bc, o, c);
  // Operand reads: Q for S and dK, K for S and dQ, dO for dP and dV, V for dP; dS written
  // once and read for dK and dQ (P stays in registers / tensor memory); the float32 dQ
  // tile written and read again by its reduction into slow memory.
  double elements = 2.0 * br * d + 2.0 * bc * d + 2.0 * br * dv + bc * dv + 3.0 * br * bc;
  double dq_bytes = 2.0 * kF32 * br * d;
  // 2-CTA MMA: two SMs compute a tile of 2·Bc keys together and each reads half of every
  // N-side operand — Q (for S and dK), dO (for dP and dV) and K (for dQ); and with twice
  // the keys per tile, each dQ row receives half as many partial sums to reduce.
  if (o.two_cta) {
    elements -= (2.0 * br * d + 2.0 * br * dv + bc * d) / 2.0;
    dq_bytes /= 2.0;
  }
  c.smem = (eb * elements + dq_bytes) / arch.smem_bytes_per_clock;
  return c;
}

// ---- the cache ----------------------------------------------------------------------

namespace {

std::string mib(double bytes) {
  std::ostringstream s;
  s.precision(3);
  s << bytes / (1024.0 * 1024.0) << " MiB";
  return s.str();
}

}  // namespace

CachedTraffic cached_traffic(const TiledAccount& a, const Architecture& arch, const char* pass) {
  CachedTraffic c;
  c.raw_bytes = static_cast<double>(a.traffic.bytes());
  c.bytes = c.raw_bytes;
  c.l2_bytes = arch.l2_bytes;
  const std::string what = std::string(pass) == "forward" ? "K/V" : "Q-side (Q, dO, lse, D, dQ accumulator)";
  if (a.restream_heads == 0 || a.restream_tiles <= 1) {
    c.fits = true;
    c.assumption = std::string(pass) + ": no tile is restreamed; the raw count is what slow memory serves";
    return c;
  }
  c.head_bytes = static_cast<double>(a.restreamed_once_bytes) / static_cast<double>(a.restream_heads);
  c.heads_in_flight = std::min(a.restream_heads, ceil_div(arch.units, a.restream_tiles));
  const double footprint = c.head_bytes * static_cast<double>(c.heads_in_flight);
  c.fits = footprint <= arch.l2_bytes;
  if (c.fits) c.bytes = c.raw_bytes - static_cast<double>(a.restreamed_bytes - a.restreamed_once_bytes);
  std::ostringstream s;
  s << pass << ": the " << a.restream_tiles << " tiles of a head restream its " << what << "; "
    << c.heads_in_flight << (c.heads_in_flight == 1 ? " head" : " heads") << " in flight (" << arch.units << " units / " << a.restream_tiles
    << " tiles per head) × " << mib(c.head_bytes) << " = " << mib(footprint)
    << (c.fits ? " fit in the " : " exceed the ") << mib(arch.l2_bytes) << " L2, so slow memory serves "
    << (c.fits ? "each element once per head" : "every restream (the raw count)");
  c.assumption = s.str();
  return c;
}

// ---- prediction ---------------------------------------------------------------------

namespace {

Prediction predict(const AttentionProblem& p, const Architecture& arch, const TiledAccount& account,
                   const UnitCycles& tile, double useful_flops, const char* pass) {
  Prediction r;
  const double clock_hz = arch.clock_ghz * 1e9;
  r.compute_seconds = static_cast<double>(account.tiles_computed) * tile.time() / (arch.units * clock_hz);
  const CachedTraffic cached = cached_traffic(account, arch, pass);
  r.memory_bytes = cached.bytes;
  r.memory_seconds = r.memory_bytes / arch.hbm_bytes_per_second;
  r.seconds = std::max(r.compute_seconds, r.memory_seconds);
  r.bound = r.compute_seconds >= r.memory_seconds ? tile.bottleneck() : "memory";
  if (r.seconds > 0.0) {
    r.tflops = useful_flops / r.seconds * 1e-12;
    r.utilisation = useful_flops / r.seconds / arch.peak_flops(p.dtype);
  }
  r.assumptions = {
      std::string("every ") + pass + " tile costs a full tile's cycles (masked entries of boundary tiles included)",
      "the units of an SM/core overlap perfectly: a tile takes its slowest unit's cycles",
      "all " + std::to_string(arch.units) + " SMs/cores stay busy (no tail wave, no load imbalance)",
      "slow-memory transfers overlap compute; time = max(compute, traffic / bandwidth)",
      cached.assumption,
      "peak clock and peak rates of the hardware table; no launch or synchronisation cost"};
  return r;
}

}  // namespace

Prediction predict_standard(const AttentionProblem& p, const Architecture& arch, const std::vector<Pass>& passes) {
  Prediction r;
  const double peak = arch.peak_flops(p.dtype);
  double flops = 0.0, memory_bound = 0.0;
  for (const Pass& k : passes) {
    const double compute = k.flops / peak, bytes = static_cast<double>(k.traffic.bytes());
    const double memory = bytes / arch.hbm_bytes_per_second;
    r.compute_seconds += compute;
    r.memory_seconds += memory;
    r.memory_bytes += bytes;
    r.seconds += std::max(compute, memory);
    if (memory >= compute) memory_bound += memory;
    flops += k.flops;
  }
  r.bound = memory_bound * 2.0 >= r.seconds ? "memory" : "mma";
  if (r.seconds > 0.0) {
    r.tflops = flops / r.seconds * 1e-12;
    r.utilisation = flops / r.seconds / peak;
  }
  r.assumptions = {
      "one kernel per pass, one after another: a pass takes max(its FLOPs at the matrix units' peak, its bytes "
      "at slow-memory bandwidth)",
      "no reuse between kernels through the cache (an N×N operand of all heads is larger than the L2)",
      "elementwise kernels' arithmetic hides under their memory traffic; no launch cost"};
  return r;
}

Prediction predict_forward(const AttentionProblem& p, const Architecture& arch, const Tiling& tiling,
                           const TileOptions& options) {
  // A tile holds block_q rows of each of its heads (pack_gqa).
  const std::int64_t rows = tiling.block_q * (tiling.decode ? 1 : tiling.heads_per_item);
  const UnitCycles tile = forward_tile_cycles(arch, rows, tiling.block_k, p.head_dim, p.head_dim_v, options);
  return predict(p, arch, flash_forward(p, tiling), tile, work(p).forward, "forward");
}

Prediction predict_backward(const AttentionProblem& p, const Architecture& arch, const Tiling& tiling,
                            const TileOptions& options) {
  const UnitCycles tile = backward_tile_cycles(arch, tiling.block_q, tiling.block_k, p.head_dim, p.head_dim_v, options);
  return predict(p, arch, flash_backward(p, tiling), tile, work(p).backward, "backward");
}

}  // namespace flashattn::cost
