// The account of every kernel (docs/algorithm.md §7.1): bytes moved between slow and fast memory,
// FLOPs, exponentials, and the clock cycles each unit of a GPU SM or a CPU core needs per
// tile. It reads the same tile sizes the CPU kernels execute (CpuForwardPlan,
// CpuBackwardPlan) and mirrors their loops, so the KernelCounters of a call equal these
// counts exactly; for GPUs it describes the FlashAttention-2..4 schedules on the
// architectures of the hardware table. docs/cost_model.md states every assumption.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "flashattn/plan.hpp"
#include "flashattn/problem.hpp"

namespace flashattn::cost {

// ---- the tiled schedule -------------------------------------------------------------

// Tile shape of a tiled schedule: Br query rows against Bc keys.
struct Tiling {
  std::int64_t block_q = 128;  // Br
  std::int64_t block_k = 128;  // Bc
  std::int64_t splits = 1;     // forward split-KV: key ranges per Q tile
  // Forward: the CPU decode kernel's schedule — per (batch, kv head) a tile of all its
  // group · seqlen_q rows, K/V read in place in chunks of block_k keys (the kernel runs
  // every kv head of a key chunk in one work item; the traffic and tiles are the same).
  bool decode = false;
  // Forward, tiled: q heads stacked in one Q tile (pack_gqa: every q head of a kv head,
  // block_q rows each), so an item streams its K/V tiles once for all of them.
  std::int64_t heads_per_item = 1;
};
Tiling tiling_of(const CpuForwardPlan& plan);
Tiling tiling_of(const CpuBackwardPlan& plan);

// ---- traffic ------------------------------------------------------------------------

// Elements (and bytes) moved between slow memory (HBM, DRAM) and fast memory (SRAM,
// registers, caches), one term per tensor and direction.
struct Traffic {
  struct Term {
    std::string tensor;  // "Q", "S", "dQ accum", ...
    bool write = false;
    std::int64_t elements = 0;
    int element_bytes = 0;
    std::int64_t bytes() const { return elements * element_bytes; }
  };
  std::vector<Term> terms;

  std::int64_t elements() const;
  std::int64_t bytes() const;
  // Elements of one tensor in one direction; 0 when the schedule does not move it.
  std::int64_t elements_of(std::string_view tensor, bool write) const;
  void add(std::string tensor, bool write, std::int64_t elements, int element_bytes);
};

// What a tiled schedule moves and computes; the tile grid is (Q tiles × K/V tiles) per
// (batch, head) — (batch, kv head) × K/V chunks for the decode schedule.
struct TiledAccount {
  Traffic traffic;
  std::int64_t tiles_computed = 0;
  std::int64_t tiles_skipped = 0;  // grid tiles outside every row's visible keys
  std::int64_t scores = 0;         // rows × keys of the computed tiles, masked entries included
  // Bytes streamed once per tile of the other side — forward: K and V per Q tile;
  // backward: Q, dO, lse, D and the dQ accumulator per K/V tile. The traffic that falls
  // as 1/M, and what tiles running at once can share through a cache (Prediction).
  std::int64_t restreamed_bytes = 0;
  std::int64_t restream_tiles = 0;  // tiles per (batch, head) that restream it: Q tiles, or K/V tiles
  // The restreamed tensors' bytes with every element counted once per (batch, head) — what
  // slow memory serves when a cache holds a head's restreamed data — and those heads.
  std::int64_t restreamed_once_bytes = 0;
  std::int64_t restream_heads = 0;
};

// Standard attention (docs/algorithm.md §1) as a sequence of kernels. `minimal` (FlashAttention paper
// Algorithm 0 and its backward): S and P of every (batch, q head) written to slow memory in
// full and read back once each, masks applied in place, dropout regenerated from its seed
// where P is read, as a fused implementation does; S, P, dP, dS in the input dtype. Per
// head, elements:
//   forward   Q, K, V read; S written, read; P written, read; O written:  4·N² + N·(2D + 2Dv)
//   backward  P read twice, dP written and read, dS written and read twice (7·N²), dO read
//             twice, Q, K, V read, dQ, dK, dV written
// `eager`: PyTorch's eager code as the first FlashAttention paper ran it, one kernel per
// step, each reading and writing its N×N operand in the input dtype — forward Q·Kᵀ, scale,
// mask, softmax, dropout (writing its one-byte keep mask), P·V; backward Pᵀ·dO, dO·Vᵀ,
// dropout, softmax, mask and scale backward, dS·K, dSᵀ·Q. The mask kernel runs whether or
// not the problem masks anything (the paper's benchmark applies a padding mask); dropout
// kernels only when dropout_p > 0.
enum class StandardModel { minimal, eager };
std::string to_string(StandardModel model);
// "minimal" or "eager"; throws flashattn::Error naming the choices otherwise.
StandardModel parse_standard_model(std::string_view name);

// One kernel of standard attention: what it moves and its matrix-product FLOPs (0 for an
// elementwise kernel).
struct Pass {
  std::string name;
  Traffic traffic;
  double flops = 0.0;
};
std::vector<Pass> standard_forward_passes(const AttentionProblem& problem, StandardModel model);
std::vector<Pass> standard_backward_passes(const AttentionProblem& problem, StandardModel model);
// The passes' traffic summed (terms merged by tensor and direction).
TiledAccount standard_forward(const AttentionProblem& problem, StandardModel model = StandardModel::minimal);
TiledAccount standard_backward(const AttentionProblem& problem, StandardModel model = StandardModel::minimal);

// The tiled algorithm with the given tiles, loop for loop as the CPU kernels run it:
// forward — per Q tile (and split): Q read once, each visible K/V tile read, O and lse
// written once; backward — per K/V tile: K, V read once, dK, dV written once, and per
// visible Q tile: Q, dO, lse, D read, the float32 dQ accumulator read and written; plus
// the D = rowsum(dO ∘ O) pass and the final dQ store. Causal and window masks are exact;
// a block mask is not modelled (its tiles count as computed).
TiledAccount flash_forward(const AttentionProblem& problem, const Tiling& tiling);
TiledAccount flash_backward(const AttentionProblem& problem, const Tiling& tiling);

// The Θ-forms of docs/algorithm.md §2 in elements, over batch · heads_q heads of N = seqlen_q queries
// and seqlen_k keys, for a fast memory of M elements: standard Θ(N·d + N²), tiled
// Θ(N²·d²/M) (a Q block holds about M/d rows, so K and V are streamed N·d/M times).
struct ThetaForms {
  double standard = 0.0;
  double flash = 0.0;
  double ratio = 0.0;  // flash / standard: d²/M when N ≫ d
};
ThetaForms theta_forms(const AttentionProblem& problem, double sram_elements);

// The lower bound of docs/algorithm.md §2 (Dao et al. 2022, Proposition 3), as a sentence.
extern const char* const kLowerBound;

// ---- work ---------------------------------------------------------------------------

// Matrix-product FLOPs (2 per multiply-add) and exponentials. The tiled kernels compute
// only visible (query, key) pairs (causal and window exact); standard attention computes
// the whole seqlen_q × seqlen_k matrix and masks it afterwards.
struct Work {
  std::int64_t visible_pairs = 0;     // Σ over rows of the keys each query sees
  double forward = 0.0;               // 2·pairs·(D + Dv): S = QKᵀ, O = PV
  double backward = 0.0;              // 2·pairs·(3D + 2Dv): S recomputed, dP, dV, dK, dQ
  double backward_recompute = 0.0;    // 2·pairs·D: the recomputation of S (P from it by exp)
  double standard_forward = 0.0;      // 2·Sq·Sk·(D + Dv) per head
  double standard_backward = 0.0;     // 2·Sq·Sk·(2D + 2Dv) per head, from the stored P
  double exp_forward = 0.0;           // one per visible pair
  double exp_backward = 0.0;          // one per visible pair (P recomputed)
  double exp_standard_forward = 0.0;  // one per score of the full matrix
};
Work work(const AttentionProblem& problem);

// ---- hardware -----------------------------------------------------------------------

// One processor, described per SM (GPU) or per core (CPU), per clock. Sources and
// derivations are cited where the table is defined (src/model/hardware.cpp).
struct Architecture {
  std::string name;         // "a100-40gb", "h100", ..., "cpu"
  std::string description;
  int units = 0;            // SMs or cores
  double clock_ghz = 0.0;
  // Dense matrix-unit FLOPs per clock per unit, by operand type; 0 where absent.
  double mma_16bit = 0.0;   // FP16/BF16 with FP32 accumulation
  double mma_tf32 = 0.0;    // FP32 inputs (TF32 on GPUs, FP32 FMA on a CPU)
  double mma_fp8 = 0.0;     // FP8 (E4M3/E5M2)
  double fp32_lanes = 0.0;  // FP32 (non-matrix) operations per clock per unit
  double exp_per_clock = 0.0;          // exp2 results per clock per unit (MUFU.EX2 on GPUs)
  // FP32-pipe operations of one polynomial exp2, the share TileOptions::poly_exp_fraction
  // moves off the exp unit (a CPU: its Exp2Poly3 instead of the exact Exp2).
  double poly_exp_ops = 0.0;
  double smem_bytes_per_clock = 0.0;   // shared memory (GPU) / L1 loads (CPU) per unit
  double smem_bytes = 0.0;             // fast memory per unit (shared memory, or CPU L2)
  double l2_bytes = 0.0;               // the cache between the units and slow memory (CPU: the cores' L2s together)
  double hbm_bytes_per_second = 0.0;   // slow memory bandwidth of the whole device
  double memory_bytes = 0.0;           // slow memory capacity (0: not stated)
  // A CPU core: exponentials (a polynomial) and the softmax run on the same FMA pipes as
  // the products, so those cycles add up instead of overlapping; tiles are float32.
  bool cpu = false;
  std::string source;       // where the numbers come from

  double mma_per_clock(DType dtype) const;  // f32 → mma_tf32, bf16/f16 → mma_16bit
  double peak_flops(DType dtype) const;     // units · clock · mma_per_clock
};

// A100 40 GB and 80 GB (SXM), H100 SXM, H200, B200, B300 (see hardware.cpp).
const std::vector<Architecture>& gpu_architectures();
// Throws flashattn::Error naming the known architectures when `name` is none of them.
const Architecture& gpu_architecture(std::string_view name);

// What the front end measured on this machine (cost_model.cpp derives the rest).
struct CpuMeasurements {
  double clock_ghz = 0.0;     // nominal clock (e.g. /proc/cpuinfo)
  double sgemm_gflops = 0.0;  // whole-machine single-precision GEMM throughput
  double copy_gbps = 0.0;     // bytes read + written per second by a large copy
};
// "This CPU": hardware.threads cores of hardware.float_lanes-wide vectors.
Architecture cpu_architecture(const CpuHardware& hardware, const CpuMeasurements& measured);

// ---- per-tile roofline --------------------------------------------------------------

// Algorithmic switches of docs/algorithm.md §5 that change the per-tile table.
struct TileOptions {
  DType dtype = DType::bf16;
  double poly_exp_fraction = 0.0;  // share of exponentials computed by a polynomial on the FP32 pipes
  double rescale_fraction = 1.0;   // share of tiles that rescale õ (conditional rescaling: < 1)
  bool two_cta = false;            // backward: 2-CTA MMA (pairs of SMs share the N-side operand)
  // Forward: false is FlashAttention-1's normalization at every tile — P divided by ℓ
  // (Br·Bc operations) and õ rescaled on every tile (Br·Dv) — instead of once at the end.
  bool deferred_normalization = true;
};

// Clock cycles each unit of one SM (core) needs for one tile, assuming the units overlap
// perfectly, so the slowest one sets the tile's time.
struct UnitCycles {
  double mma = 0.0;   // matrix units
  double exp = 0.0;   // exponential unit
  double fma = 0.0;   // FP32 pipes: softmax arithmetic, õ rescaling, polynomial exps
  double smem = 0.0;  // shared-memory (L1) reads and writes
  bool shared_pipes = false;  // CPU: mma, exp and fma are one set of pipes

  double time() const;                // cycles of the tile: the bottleneck's
  std::string bottleneck() const;     // "mma", "exp", "fma", "smem", "fma pipes"; ties joined by '='
};

// Forward tile: S = Q·Kᵀ and O += P·V (2·Br·Bc·(D + Dv) FLOPs), Br·Bc exponentials; the
// tensor cores read Q, K and V from shared memory, P stays in registers / tensor memory.
UnitCycles forward_tile_cycles(const Architecture& arch, std::int64_t block_q, std::int64_t block_k,
                               std::int64_t head_dim, std::int64_t head_dim_v, const TileOptions& options);
// Backward tile: S recomputed, dP = dO·Vᵀ, dV += Pᵀ·dO, dK += dSᵀ·Q, dQ = dS·K
// (2·Br·Bc·(3D + 2Dv) FLOPs), Br·Bc exponentials; shared memory carries Q, K and dO twice,
// V once, dS written once and read twice, and the float32 dQ tile out to its reduction.
UnitCycles backward_tile_cycles(const Architecture& arch, std::int64_t block_q, std::int64_t block_k,
                                std::int64_t head_dim, std::int64_t head_dim_v, const TileOptions& options);

// ---- the cache ----------------------------------------------------------------------

// A tiled account's slow-memory bytes when the L2 serves restreamed tiles. Work items run
// head-major, so the units hold the tiles of min(heads, ceil(units / tiles per head)) heads
// at once; when those heads' restreamed data (forward: a head's K and V; backward: its Q,
// dO, lse, D and dQ accumulator) fit in the L2, slow memory serves each element once per
// head and the L2 the repeats. Otherwise every restream comes from slow memory (the raw count).
struct CachedTraffic {
  double bytes = 0.0;            // slow-memory bytes with the cache
  double raw_bytes = 0.0;        // every restreamed tile from slow memory
  double head_bytes = 0.0;       // restreamed data of one head
  std::int64_t heads_in_flight = 0;
  double l2_bytes = 0.0;
  bool fits = false;
  std::string assumption;  // the rule and its numbers, as a sentence
};
CachedTraffic cached_traffic(const TiledAccount& account, const Architecture& arch, const char* pass);

// ---- prediction ---------------------------------------------------------------------

struct Prediction {
  double seconds = 0.0;          // max(compute, memory)
  double compute_seconds = 0.0;  // computed tiles · bottleneck cycles / (units · clock)
  double memory_seconds = 0.0;   // slow-memory bytes / bandwidth
  double memory_bytes = 0.0;     // slow-memory bytes: tiled with the L2 (cached_traffic), or the passes'
  double tflops = 0.0;           // useful FLOPs (Work) per second, in 10¹²
  double utilisation = 0.0;      // of the matrix units' peak for the dtype
  std::string bound;             // the tile bottleneck, or "memory"
  std::vector<std::string> assumptions;
};
Prediction predict_forward(const AttentionProblem& problem, const Architecture& arch,
                           const Tiling& tiling, const TileOptions& options);
Prediction predict_backward(const AttentionProblem& problem, const Architecture& arch,
                            const Tiling& tiling, const TileOptions& options);
// Standard attention, kernel after kernel: each pass takes max(its FLOPs at the matrix
// units' peak, its bytes at slow-memory bandwidth); the passes add up.
Prediction predict_standard(const AttentionProblem& problem, const Architecture& arch,
                            const std::vector<Pass>& passes);

}  // namespace flashattn::cost
