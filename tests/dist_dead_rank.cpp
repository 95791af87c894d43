// One rank of a ring is killed (SIGKILL) while ring_forward runs. The survivors must leave
// ring_forward with a flashattn::Error naming the peer they waited for, within their timeout,
// instead of hanging. With the argument "absent" the rank never enters the ring (it sleeps
// past the others' timeout, then exits): the others time out duplicating the communicator,
// each naming itself. dist_dead_rank.sh runs both under mpirun and checks what they print.
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>

#include "flashattn/dist.hpp"
#include "flashattn/error.hpp"

namespace {

constexpr int kVictim = 1;
// The survivors give up this long after their peer stopped answering.
constexpr double kTimeoutSeconds = 2.0;
// The victim dies this long into the call: well inside it, since one rank's share of the
// problem below is 4.6e10 FLOP, about 0.5 s on one core even at 100 GFLOP/s (a second here).
constexpr auto kKillAfter = std::chrono::milliseconds(100);
// A causal problem large enough that every step computes for a while: S = 16384, 4 heads of 64.
constexpr std::int64_t kSeqlen = 16384, kHeads = 4, kDim = 64;

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);

  flashattn::dist::RingOptions ring;
  ring.seqlen = kSeqlen;
  ring.timeout_seconds = kTimeoutSeconds;
  const std::int64_t local = flashattn::dist::shard_length(kSeqlen, ranks, rank, ring.layout);
  using flashattn::DType;
  flashattn::Tensor q(DType::f32, {1, local, kHeads, kDim}), k(DType::f32, {1, local, kHeads, kDim}),
      v(DType::f32, {1, local, kHeads, kDim}), out(DType::f32, {1, local, kHeads, kDim}),
      lse(DType::f32, {1, kHeads, local});
  for (flashattn::Tensor* t : {&q, &k, &v})
    for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, static_cast<float>(i % 7) * 0.125f);
  flashattn::AttentionOptions options;
  options.causal = true;
  options.num_threads = 1;

  if (rank == kVictim && argc > 1 && std::string(argv[1]) == "absent") {
    std::this_thread::sleep_for(std::chrono::duration<double>(2 * kTimeoutSeconds + 1.0));
    std::printf("rank %d: absent\n", rank);
    std::fflush(stdout);
    _exit(4);  // the others' duplication of the communicator is still posted
  }
  if (rank == kVictim)
    std::thread([] {
      std::this_thread::sleep_for(kKillAfter);
      std::raise(SIGKILL);
    }).detach();
  try {
    flashattn::dist::ring_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), options, ring);
    std::printf("rank %d: finished\n", rank);
  } catch (const flashattn::Error& e) {
    std::printf("rank %d: flashattn::Error: %s\n", rank, e.what());
    std::fflush(stdout);
    _exit(3);  // MPI_Finalize would wait for the dead rank
  }
  MPI_Finalize();
  return 0;
}
