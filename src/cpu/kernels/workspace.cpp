// The workspaces' layouts and allocation: the forward's (workspace.hpp) and the backward's
// (backward_kernel.hpp).
#include "src/cpu/kernels/workspace.hpp"

#include <algorithm>
#include <mutex>

#include "src/cpu/allocate.hpp"
#include "src/cpu/kernels/backward_kernel.hpp"

namespace flashattn::cpu {
namespace {
std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }
}  // namespace

ForwardLayout::ForwardLayout(const CpuForwardPlan& plan, const AttentionProblem& p) {
  const bool decode = is_decode(plan.kernel), bf16 = plan.kernel == ForwardKernel::tiled_bf16;
  // Tiles held at once: one, (decode) one per kv head — Q rows and a block of V rows each —
  // or (pack_gqa) one per q head of the kv head, stacked into one Q tile.
  const auto tiles_held = static_cast<std::size_t>(decode ? p.heads_kv : plan.heads_per_item);
  // A tiled item's rows: its heads' back to back, rounded up to whole micro-tile rows once.
  rows = static_cast<std::size_t>(plan.block_q) * tiles_held;
  if (!decode) rows = round_up(rows, static_cast<std::size_t>(plan.hardware.micro_rows));
  const auto bc = static_cast<std::size_t>(plan.block_k);
  const auto d = static_cast<std::size_t>(p.head_dim);
  const auto dv_pad = static_cast<std::size_t>(plan.head_dim_v_padded);
  const std::size_t keys_pad = decode ? 0 : round_up(static_cast<std::size_t>(p.seqlen_k), bc);
  const std::size_t d_pad = round_up(d, 32);  // a whole number of pairs of vectors on every target
  const std::size_t d_even = round_up(d, 2);  // whole bf16 pairs
  q_tile = bf16 ? 0 : rows * d_pad;
  s_tile = rows * bc;
  o_acc = rows * dv_pad;
  if (decode) {
    q_rows = 4 * d_pad;
    q_units = 3 * rows;
    v_units = tiles_held;
    descales = 5 * bc;
    decode_keys = bc + static_cast<std::size_t>(kDecodePrefetchKeys);
  } else if (bf16) {
    q_bf16 = rows * d_even;
    p_bf16 = rows * bc;
    k_pairs = keys_pad * d_even;
    k_pair_rows = static_cast<std::size_t>(plan.hardware.micro_cols) * d_pad;
    v_pairs = keys_pad * dv_pad;
    v_pair_rows = 2 * dv_pad;
  } else {
    k_rows = static_cast<std::size_t>(plan.hardware.micro_cols) * d_pad;
    v_row = dv_pad;
    k_packed = keys_pad * d;
    v_packed = keys_pad * dv_pad;
  }
  strips = (decode ? static_cast<std::size_t>(plan.block_q) : rows) / static_cast<std::size_t>(plan.hardware.micro_rows);
}

std::size_t ForwardLayout::bytes() const {
  const std::size_t floats = q_tile + k_rows + v_row + s_tile + o_acc + k_packed + v_packed + q_rows + q_units +
                             v_units + descales;
  const std::size_t halves = q_bf16 + p_bf16 + k_pairs + v_pairs + k_pair_rows + v_pair_rows;
  return floats * sizeof(float) + halves * sizeof(std::uint16_t) +
         rows * (sizeof(OnlineSoftmaxState) + sizeof(std::int32_t)) + decode_keys * DecodeKeys::kBytesPerKey +
         strips * sizeof(StripKeys);
}

void ForwardLayout::widen(const ForwardLayout& o) {
  for (auto [mine, theirs] :
       {std::pair{&rows, o.rows}, {&q_tile, o.q_tile}, {&k_rows, o.k_rows}, {&v_row, o.v_row}, {&s_tile, o.s_tile},
        {&o_acc, o.o_acc}, {&k_packed, o.k_packed}, {&v_packed, o.v_packed}, {&q_rows, o.q_rows},
        {&q_units, o.q_units}, {&v_units, o.v_units}, {&descales, o.descales}, {&q_bf16, o.q_bf16},
        {&p_bf16, o.p_bf16}, {&k_pairs, o.k_pairs}, {&v_pairs, o.v_pairs}, {&k_pair_rows, o.k_pair_rows},
        {&v_pair_rows, o.v_pair_rows}, {&strips, o.strips},
        {&decode_keys, o.decode_keys}})
    *mine = std::max(*mine, theirs);
}

std::size_t forward_workspace_bytes(const CpuForwardPlan& plan, const AttentionProblem& p) {
  return ForwardLayout(plan, p).bytes();
}

ForwardWorkspace::ForwardWorkspace(const CpuForwardPlan& plan, const AttentionProblem& p)
    : ForwardWorkspace(ForwardLayout(plan, p)) {}

ForwardWorkspace::ForwardWorkspace(const ForwardLayout& l) : layout(l) {
  q_tile = allocate_floats(l.q_tile);
  s_tile = allocate_floats(l.s_tile);
  o_acc = allocate_floats(l.o_acc);
  k_packed = allocate_floats(l.k_packed);
  v_packed = allocate_floats(l.v_packed);
  k_rows = allocate_floats(l.k_rows);
  v_row = allocate_floats(l.v_row);
  q_rows = allocate_floats(l.q_rows);
  q_units = allocate_floats(l.q_units);
  v_units = allocate_floats(l.v_units);
  descales = allocate_floats(l.descales);
  states.resize(l.rows);
  rescales.resize(l.rows);
  strip_keys.resize(l.strips);
  strip_fresh.resize(l.strips);
  if (l.q_bf16 > 0) {
    q_bf16 = allocate_array<std::uint16_t>(l.q_bf16);
    p_bf16 = allocate_array<std::uint16_t>(l.p_bf16);
    k_pairs = allocate_array<std::uint16_t>(l.k_pairs);
    k_pair_rows = allocate_array<std::uint16_t>(l.k_pair_rows);
    v_pairs = allocate_array<std::uint16_t>(l.v_pairs);
    v_pair_rows = allocate_array<std::uint16_t>(l.v_pair_rows);
  }
  decode_keys.resize(l.decode_keys);
}

namespace {

// Every buffer of `have` at least as large as `need`'s.
bool has_room(const ForwardLayout& have, const ForwardLayout& need) {
  ForwardLayout both = have;
  both.widen(need);
  return both.bytes() == have.bytes();
}

// The workspaces given back, for later calls (ForwardWorkspaces).
struct KeptWorkspaces {
  std::mutex mutex;
  std::vector<std::unique_ptr<ForwardWorkspace>> kept;
  std::size_t bytes = 0;
};
KeptWorkspaces& kept_workspaces() {
  static KeptWorkspaces k;
  return k;
}

}  // namespace

ForwardWorkspaces::ForwardWorkspaces(const ForwardLayout& layout, int count) {
  std::vector<std::unique_ptr<ForwardWorkspace>> taken;
  {
    KeptWorkspaces& k = kept_workspaces();
    const std::lock_guard<std::mutex> lock(k.mutex);
    while (!k.kept.empty() && static_cast<int>(taken.size()) < count) {
      k.bytes -= k.kept.back()->layout.bytes();
      taken.push_back(std::move(k.kept.back()));
      k.kept.pop_back();
    }
  }
  held_.reserve(static_cast<std::size_t>(count));
  for (std::unique_ptr<ForwardWorkspace>& ws : taken) {
    if (!has_room(ws->layout, layout)) {
      ForwardLayout both = ws->layout;
      both.widen(layout);
      ws.reset();  // its memory back before the larger one is allocated
      ws = std::make_unique<ForwardWorkspace>(both);
    }
    ws->counters = {};
    ws->packed = {};
    held_.push_back(std::move(ws));
  }
  while (static_cast<int>(held_.size()) < count) held_.push_back(std::make_unique<ForwardWorkspace>(layout));
}

ForwardWorkspaces::~ForwardWorkspaces() {
  KeptWorkspaces& k = kept_workspaces();
  const std::lock_guard<std::mutex> lock(k.mutex);
  for (std::unique_ptr<ForwardWorkspace>& ws : held_) {
    const std::size_t bytes = ws->layout.bytes();
    if (bytes > kKeptBytes || k.bytes + bytes > kKeptTotalBytes) continue;
    k.bytes += bytes;
    k.kept.push_back(std::move(ws));
  }
}

namespace {
// Buffer sizes of one workspace: the float32 kernel's packed K/V are float32, tiled_bf16's
// bf16 (and its per-tile operands come on top of the float32 tiles both kernels use).
struct BackwardSizes {
  std::size_t bq, bc, d, dv, d_pad, dv_pad, keys_pad, mc, seqlen_q, group;
  bool bf16, keep_q;
  BackwardSizes(const CpuBackwardPlan& plan, const AttentionProblem& p)
      : bq(static_cast<std::size_t>(plan.block_q)), bc(static_cast<std::size_t>(plan.block_k)),
        d(static_cast<std::size_t>(p.head_dim)), dv(static_cast<std::size_t>(p.head_dim_v)),
        d_pad(static_cast<std::size_t>(plan.head_dim_padded)),
        dv_pad(static_cast<std::size_t>(plan.head_dim_v_padded)),
        keys_pad(round_up(static_cast<std::size_t>(p.seqlen_k), bc)),
        mc(static_cast<std::size_t>(plan.hardware.micro_cols)), seqlen_q(static_cast<std::size_t>(p.seqlen_q)),
        group(static_cast<std::size_t>(p.heads_q / p.heads_kv)), bf16(plan.kernel == BackwardKernel::tiled_bf16),
        keep_q(plan.keep_q_rows) {}
  std::size_t floats() const {
    return bq * (d_pad + dv_pad + 2 * kRowLdPad + 4 * bc + d_pad) + bc * (d_pad + dv_pad) +
           (bf16 ? bc * std::max(d_pad, dv_pad)
                 : keys_pad / bc * (d + dv) * (bc + kRowLdPad) + keys_pad * (d_pad + kRowLdPad) +
                       mc * std::max(d_pad, dv_pad));
  }
  // The kept Q/dO tiles (BackwardWorkspace::q_kept): rows of group · q_blocks tiles, float32
  // or (tiled_bf16) bf16 twice over (rows and transposed); their bytes whether kept or not.
  std::size_t kept_rows() const { return group * round_up(seqlen_q, bq); }
  std::size_t kept_q_bytes() const {
    return bf16 ? kept_rows() * 2 * (d_pad + dv_pad) * sizeof(std::uint16_t)
                : kept_rows() * (d_pad + dv_pad + 2 * kRowLdPad) * sizeof(float);
  }
  std::size_t bf16_elements() const {
    return bf16 ? 2 * bq * (d_pad + dv_pad) + bq * std::max(d_pad, dv_pad) + 3 * bq * bc +
                      keys_pad * (round_up(d, 2) + round_up(dv, 2) + d_pad) + mc * (d_pad + dv_pad)
                : 0;
  }
};
}  // namespace

std::size_t backward_workspace_bytes(const CpuBackwardPlan& plan, const AttentionProblem& p) {
  const BackwardSizes s(plan, p);
  return s.floats() * sizeof(float) + s.bf16_elements() * sizeof(std::uint16_t) + s.bq * 3 * sizeof(float) +
         (StripsFor(plan.block_q, plan.hardware.micro_rows) +
          KeyStripsFor(plan.block_k, plan.hardware.micro_rows)) *
             sizeof(StripKeys) +
         2 * s.dv_pad * sizeof(float) +
         (s.keep_q ? s.kept_q_bytes() + s.kept_rows() / s.bq : 0);
}

void BackwardWorkspace::allocate_large_rows(const CpuBackwardPlan& plan) {
  const auto rows = static_cast<std::size_t>(kLargeRowsPerItem);
  const auto d_pad = static_cast<std::size_t>(plan.head_dim_padded), bc = static_cast<std::size_t>(plan.block_k);
  large_q = allocate_floats(rows * (d_pad + kRowLdPad));
  large_k_rows = allocate_floats(static_cast<std::size_t>(plan.hardware.micro_cols) * d_pad);
  large_kt = allocate_floats(d_pad * bc);
  large_scores = allocate_floats(rows * bc);
}

std::size_t backward_q_rows_bytes(const CpuBackwardPlan& plan, const AttentionProblem& p) {
  return BackwardSizes(plan, p).kept_q_bytes();
}

BackwardWorkspace::BackwardWorkspace(const CpuBackwardPlan& plan, const AttentionProblem& p)
    : row_lse2(static_cast<std::size_t>(plan.block_q)),
      row_lse2_low(static_cast<std::size_t>(plan.block_q)),
      row_delta(static_cast<std::size_t>(plan.block_q)),
      strip_keys(StripsFor(plan.block_q, plan.hardware.micro_rows)),
      key_strip_rows(KeyStripsFor(plan.block_k, plan.hardware.micro_rows)) {
  const BackwardSizes s(plan, p);
  delta_rows = allocate_floats(2 * s.dv_pad);
  q_tile = allocate_floats(s.bq * (s.d_pad + kRowLdPad));
  do_tile = allocate_floats(s.bq * (s.dv_pad + kRowLdPad));
  p_tile = allocate_floats(s.bq * s.bc);
  ds_tile = allocate_floats(s.bq * s.bc);
  g_tile = allocate_floats(s.bq * s.bc);
  w_tile = allocate_floats(s.bq * s.bc);
  dq_tile = allocate_floats(s.bq * s.d_pad);
  dk_acc = allocate_floats(s.bc * s.d_pad);
  dv_acc = allocate_floats(s.bc * s.dv_pad);
  if (s.keep_q) {
    kept_converted.assign(s.kept_rows() / s.bq, 0);
    if (s.bf16) {
      q_kept16 = allocate_array<std::uint16_t>(s.kept_rows() * 2 * s.d_pad);
      do_kept16 = allocate_array<std::uint16_t>(s.kept_rows() * 2 * s.dv_pad);
    } else {
      q_kept = allocate_floats(s.kept_rows() * (s.d_pad + kRowLdPad));
      do_kept = allocate_floats(s.kept_rows() * (s.dv_pad + kRowLdPad));
    }
  }
  if (!s.bf16) {
    row_scratch = allocate_floats(s.mc * std::max(s.d_pad, s.dv_pad));
    kt_packed = allocate_floats(s.keys_pad / s.bc * s.d * (s.bc + kRowLdPad) + 1);
    vt_packed = allocate_floats(s.keys_pad / s.bc * s.dv * (s.bc + kRowLdPad) + 1);
    k_packed = allocate_floats(s.keys_pad * (s.d_pad + kRowLdPad) + 1);
    return;
  }
  q_bf16 = allocate_array<std::uint16_t>(2 * s.bq * s.d_pad);
  do_bf16 = allocate_array<std::uint16_t>(2 * s.bq * s.dv_pad);
  pair_scratch = allocate_array<std::uint16_t>(s.bq * std::max(s.d_pad, s.dv_pad));
  pt_bf16 = allocate_array<std::uint16_t>(s.bq * s.bc);
  dst_bf16 = allocate_array<std::uint16_t>(s.bq * s.bc);
  ds_bf16 = allocate_array<std::uint16_t>(s.bq * s.bc);
  kv_rows = allocate_floats(s.bc * std::max(s.d_pad, s.dv_pad));
  kt_pairs = allocate_array<std::uint16_t>(s.keys_pad * round_up(s.d, 2));
  vt_pairs = allocate_array<std::uint16_t>(s.keys_pad * round_up(s.dv, 2));
  k_pairs = allocate_array<std::uint16_t>(s.keys_pad * s.d_pad);
  pack_rows = allocate_array<std::uint16_t>(s.mc * (s.d_pad + s.dv_pad));
}

}  // namespace flashattn::cpu
