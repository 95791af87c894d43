// `mpirun -np P flashattn ring`: ring attention across the ranks of MPI_COMM_WORLD. Every rank
// generates its own shard of random inputs (a pure function of the global token position, so
// no rank ever holds the whole sequence), runs ring_forward (and ring_backward), and rank 0
// prints per rank the time, the bytes sent, and how much of the communication the computation
// hid; for small sequences rank 0 also checks the gathered result against single-process
// flashattn on the whole sequence.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <limits>
#include <vector>

#include "flashattn/dist.hpp"
#include "tools/cli/commands.hpp"
#include "tools/cli/measure.hpp"

namespace flashattn::cli {
namespace {

// Input value of element `index` of tensor `stream`: uniform in [−√3, √3) (unit variance)
// from a splitmix64 hash, the same on every rank whatever the sharding.
float input_value(std::uint64_t stream, std::uint64_t index) {
  std::uint64_t z = index + stream * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  constexpr double kTwoToThe53 = 9007199254740992.0;
  const double unit = static_cast<double>(z >> 11) / kTwoToThe53;  // [0, 1)
  return static_cast<float>((2.0 * unit - 1.0) * std::sqrt(3.0));
}

// The rows `ranges` (global positions, storage order) of a (batch, seqlen, heads, dim) input.
Tensor generate(DType dtype, std::uint64_t stream, std::int64_t batch, std::int64_t seqlen, std::int64_t heads,
                std::int64_t dim, const std::vector<dist::TokenRange>& ranges) {
  std::int64_t local = 0;
  for (const auto& r : ranges) local += r.size();
  Tensor t(dtype, {batch, local, heads, dim});
  const std::int64_t row = heads * dim;
  for (std::int64_t b = 0; b < batch; ++b) {
    std::int64_t at = 0;
    for (const auto& r : ranges)
      for (std::int64_t s = r.begin; s < r.end; ++s, ++at)
        for (std::int64_t i = 0; i < row; ++i)
          t.set((b * local + at) * row + i, input_value(stream, static_cast<std::uint64_t>((b * seqlen + s) * row + i)));
  }
  return t;
}

struct Ranks {
  int size = 1, rank = 0;
};

// Rank 0 receives every rank's shard of a tensor whose token dimension is `dim` and puts the
// rows back in global order; the other ranks send theirs. Returns the whole tensor on rank 0.
Tensor gather(const Tensor& local, int dim, std::int64_t seqlen, dist::ShardLayout layout, const Ranks& ranks) {
  const std::size_t element = dtype_size(local.dtype());
  if (ranks.rank != 0) {
    MPI_Send(local.data(), static_cast<int>(static_cast<std::size_t>(local.numel()) * element), MPI_BYTE, 0, 0,
             MPI_COMM_WORLD);
    return {};
  }
  std::vector<std::int64_t> shape = local.shape();
  shape[static_cast<std::size_t>(dim)] = seqlen;
  Tensor whole(local.dtype(), shape);
  std::int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= shape[static_cast<std::size_t>(d)];
  for (std::size_t d = static_cast<std::size_t>(dim) + 1; d < shape.size(); ++d) inner *= shape[d];
  for (int r = 0; r < ranks.size; ++r) {
    const auto ranges = dist::shard_ranges(seqlen, ranks.size, r, layout);
    const std::int64_t n = dist::shard_length(seqlen, ranks.size, r, layout);
    std::vector<unsigned char> shard(static_cast<std::size_t>(outer * n * inner) * element);
    if (r == 0)
      std::memcpy(shard.data(), local.data(), shard.size());
    else
      MPI_Recv(shard.data(), static_cast<int>(shard.size()), MPI_BYTE, r, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    for (std::int64_t o = 0; o < outer; ++o) {
      std::int64_t at = 0;
      for (const auto& range : ranges)
        for (std::int64_t t = range.begin; t < range.end; ++t, ++at)
          std::memcpy(static_cast<unsigned char*>(whole.data()) + static_cast<std::size_t>((o * seqlen + t) * inner) * element,
                      shard.data() + static_cast<std::size_t>((o * n + at) * inner) * element,
                      static_cast<std::size_t>(inner) * element);
    }
  }
  return whole;
}

double max_abs_difference(const Tensor& a, const Tensor& b) {
  double e = 0.0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.get(i), y = b.get(i);
    if (!(std::isinf(x) && x == y)) e = std::fmax(e, std::fabs(x - y));
  }
  return e;
}
double max_abs(const Tensor& t) {
  double m = 0.0;
  for (std::int64_t i = 0; i < t.numel(); ++i) m = std::fmax(m, std::fabs(t.get(i)));
  return m;
}

// The ring's transfers alone, without computation, blocking: P − 1 exchanges of the K/V
// shards and, with gradients, P exchanges of the float32 dK/dV accumulators. What the
// overlap has to hide.
double communication_alone(const AttentionProblem& p, dist::ShardLayout layout, const Ranks& ranks, int repeats,
                           bool with_gradients) {
  const std::int64_t kv_row = p.heads_kv * (p.head_dim + p.head_dim_v);
  std::int64_t largest = 0;
  for (int r = 0; r < ranks.size; ++r) largest = std::max(largest, dist::shard_length(p.seqlen_q, ranks.size, r, layout));
  const std::size_t buffer = static_cast<std::size_t>(p.batch * largest * kv_row) * sizeof(float);
  if (buffer > static_cast<std::size_t>(std::numeric_limits<int>::max()))
    throw Error("ring: shards of " + std::to_string(buffer) + " bytes are too large for the communication-alone measurement");
  std::vector<unsigned char> send(buffer), receive(buffer);
  const int next = (ranks.rank + 1) % ranks.size, prev = (ranks.rank + ranks.size - 1) % ranks.size;
  // At step s this rank passes on the shard of rank r − s and takes that of r − s − 1.
  const auto exchange = [&](int step, std::size_t element) {
    const int mine = (ranks.rank - step + ranks.size) % ranks.size, theirs = (mine - 1 + ranks.size) % ranks.size;
    const auto bytes = [&](int r) {
      return static_cast<int>(static_cast<std::size_t>(p.batch * dist::shard_length(p.seqlen_q, ranks.size, r, layout) * kv_row) * element);
    };
    MPI_Sendrecv(send.data(), bytes(mine), MPI_BYTE, next, 0, receive.data(), bytes(theirs), MPI_BYTE, prev, 0,
                 MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  };
  return median_seconds(
      [&] {
        MPI_Barrier(MPI_COMM_WORLD);
        for (int step = 0; step + 1 < ranks.size; ++step) exchange(step, dtype_size(p.dtype));
        if (with_gradients && ranks.size > 1)
          for (int step = 0; step < ranks.size; ++step) exchange(step, sizeof(float));
      },
      repeats, 1, "communication alone");
}

// Median (by time) of `repeats` runs after one warm-up; the ranks start each run together.
// An Error for repeats < 1, before any run: every rank throws alike.
dist::RingStats median_run(int repeats, const std::function<dist::RingStats()>& run) {
  if (repeats < 1) throw Error("ring: the median of " + std::to_string(repeats) + " timed runs (at least 1)");
  run();
  std::vector<dist::RingStats> runs;
  for (int i = 0; i < repeats; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    runs.push_back(run());
  }
  std::sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) { return a.seconds < b.seconds; });
  return runs[runs.size() / 2];
}

// Rank 0 prints one line per rank.
void report(const char* pass, const dist::RingStats& s, double alone, std::int64_t tokens, double flops, const Ranks& ranks) {
  const double mine[6] = {static_cast<double>(tokens), s.seconds, s.compute_seconds, s.wait_seconds,
                          static_cast<double>(s.bytes_sent), alone};
  std::vector<double> all(static_cast<std::size_t>(6 * ranks.size));
  MPI_Gather(mine, 6, MPI_DOUBLE, all.data(), 6, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  if (ranks.rank != 0) return;
  double slowest = 0.0;
  std::printf("%s\n  rank  tokens   time ms  compute ms  waiting ms   sent MiB  comm alone ms  hidden\n", pass);
  for (int r = 0; r < ranks.size; ++r) {
    const double* x = &all[static_cast<std::size_t>(6 * r)];
    slowest = std::max(slowest, x[1]);
    char hidden[16] = "-";
    if (x[5] > 0.0) std::snprintf(hidden, sizeof hidden, "%.0f%%", 100.0 * std::clamp(1.0 - x[3] / x[5], 0.0, 1.0));
    std::printf("  %4d  %6.0f  %8.2f  %10.2f  %10.2f  %9.2f  %13.2f  %6s\n", r, x[0], x[1] * 1e3, x[2] * 1e3,
                x[3] * 1e3, x[4] / (1 << 20), x[5] * 1e3, hidden);
  }
  std::printf("  whole ring: %.2f ms (the slowest rank), %.1f GFLOP/s\n", slowest * 1e3, flops / slowest * 1e-9);
}

void run_ring(RingFlags& f) {
  if (f.shape.seqlen_q || f.shape.seqlen_k)
    throw Error("ring: --seqlen-q/--seqlen-k do not apply (self-attention over one sequence): use --seqlen");
  if (f.layout != "zigzag" && f.layout != "contiguous")
    throw Error("ring: --layout must be zigzag or contiguous, got " + f.layout);
  const dist::ShardLayout layout = f.layout == "zigzag" ? dist::ShardLayout::zigzag : dist::ShardLayout::contiguous;
  Ranks ranks;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks.size);
  MPI_Comm_rank(MPI_COMM_WORLD, &ranks.rank);

  AttentionOptions options = f.shape.options();
  options.softcap = f.softcap;
  const AttentionProblem p = f.shape.problem(options);
  dist::RingOptions ring;
  ring.seqlen = p.seqlen_q;
  ring.layout = layout;
  ring.timeout_seconds = f.timeout;
  const auto ranges = dist::shard_ranges(p.seqlen_q, ranks.size, ranks.rank, layout);
  const std::int64_t local = dist::shard_length(p.seqlen_q, ranks.size, ranks.rank, layout);
  const std::int64_t b = p.batch, s = p.seqlen_q;
  const Tensor q = generate(p.dtype, 0, b, s, p.heads_q, p.head_dim, ranges);
  const Tensor k = generate(p.dtype, 1, b, s, p.heads_kv, p.head_dim, ranges);
  const Tensor v = generate(p.dtype, 2, b, s, p.heads_kv, p.head_dim_v, ranges);
  const Tensor dout = generate(p.dtype, 3, b, s, p.heads_q, p.head_dim_v, ranges);
  Tensor out(p.dtype, {b, local, p.heads_q, p.head_dim_v}), lse(DType::f32, {b, p.heads_q, local});
  Tensor dq(p.dtype, q.shape()), dk(p.dtype, k.shape()), dv(p.dtype, v.shape());

  if (ranks.rank == 0)
    std::printf("flashattn ring: %d ranks, %s shards of %s\n", ranks.size, f.layout.c_str(), p.describe().c_str());
  const dist::RingStats fwd = median_run(f.repeats, [&] {
    return dist::ring_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), options, ring);
  });
  const double flops = p.visible_forward_flops();  // the visible pairs' FLOPs (ring takes no block mask)
  report("forward (median of runs)", fwd, communication_alone(p, layout, ranks, f.repeats, false), local, flops, ranks);
  if (f.backward) {
    const dist::RingStats bwd = median_run(f.repeats, [&] {
      return dist::ring_backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(),
                                 dk.view(), dv.view(), options, ring);
    });
    report("backward (median of runs)", bwd, communication_alone(p, layout, ranks, f.repeats, true), local,
           2.5 * flops, ranks);
  }

  if (s > f.verify_up_to) {
    if (ranks.rank == 0) std::printf("not verified: --seqlen above --verify-up-to %lld\n", static_cast<long long>(f.verify_up_to));
    return;
  }
  std::vector<Tensor> ring_results = {gather(out, 1, s, layout, ranks), gather(lse, 2, s, layout, ranks)};
  if (f.backward)
    for (const Tensor* g : {&dq, &dk, &dv}) ring_results.push_back(gather(*g, 1, s, layout, ranks));
  if (ranks.rank != 0) return;
  const std::vector<dist::TokenRange> all = {{0, s}};
  const Tensor gq = generate(p.dtype, 0, b, s, p.heads_q, p.head_dim, all);
  const Tensor gk = generate(p.dtype, 1, b, s, p.heads_kv, p.head_dim, all);
  const Tensor gv = generate(p.dtype, 2, b, s, p.heads_kv, p.head_dim_v, all);
  const Tensor gdout = generate(p.dtype, 3, b, s, p.heads_q, p.head_dim_v, all);
  const ForwardResult single = forward(gq.view(), gk.view(), gv.view(), options);
  const double u = unit_roundoff(p.dtype);
  // Forward: each partial output rounded once (≤ u·max|v|) and both final outputs once.
  struct Check {
    const char* name;
    double difference, tolerance;
  };
  std::vector<Check> checks = {
      {"out", max_abs_difference(ring_results[0], single.out), 2.0 * u * max_abs(gv) + 1e-5},
      {"lse", max_abs_difference(ring_results[1], single.lse), 1e-5 + 1e-6 * max_abs(single.lse)}};
  if (f.backward) {
    const BackwardResult grads =
        backward(gdout.view(), gq.view(), gk.view(), gv.view(), single.out.view(), single.lse.view(), options);
    // Gradients: up to 2P partial gradients, each rounded to the dtype once before the
    // float32 sum, and the sum rounded once.
    const Tensor* want[3] = {&grads.dq, &grads.dk, &grads.dv};
    const char* names[3] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; ++i)
      checks.push_back({names[i], max_abs_difference(ring_results[static_cast<std::size_t>(2 + i)], *want[i]),
                        (2.0 * ranks.size + 1.0) * u * max_abs(*want[i]) + 1e-4});
  }
  bool ok = true;
  std::printf("against single-process flashattn on rank 0:");
  for (const Check& c : checks) {
    std::printf(" %s %.1e (≤ %.1e)", c.name, c.difference, c.tolerance);
    ok = ok && c.difference <= c.tolerance;
  }
  std::printf("\n%s\n", ok ? "verified" : "MISMATCH");
  if (!ok) throw Error("ring: the ring's result differs from single-process flashattn beyond the merge's rounding");
}

}  // namespace

void ring(RingFlags& f) {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  try {
    run_ring(f);
  } catch (const Error& e) {
    std::fflush(stdout);
    std::cerr << "flashattn: error: " << e.what() << "\n";
    // A rank that fails leaves its peers waiting: end the whole job.
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  MPI_Finalize();
}

}  // namespace flashattn::cli
