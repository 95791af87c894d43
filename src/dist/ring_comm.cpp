#include "ring_comm.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "flashattn/error.hpp"

namespace flashattn::dist::detail {
namespace {

using Clock = std::chrono::steady_clock;

// MPI counts are int: a message is sent in pieces of at most 1 GiB, well below 2^31 − 1.
constexpr std::size_t kMaxPieceBytes = std::size_t{1} << 30;
// Tags of one payload kind: base + piece. 4 kinds × 4096 pieces stay below 32767, the smallest
// MPI_TAG_UB the standard allows; 4096 pieces of 1 GiB (4 TiB) bound one shard.
constexpr int kPiecesPerPayload = 4096;
// Polling period of the waits: far below one step (milliseconds and more) yet long enough
// that a waiting rank leaves its core to the ranks still computing when a node runs more
// ranks than cores.
constexpr auto kPollInterval = std::chrono::microseconds(20);
// The helper thread starts at kPollInterval and doubles its period while nothing completes, up
// to 1 ms: a transfer that waits for a slower peer then costs the computing cores at most
// 1000 wake-ups a second instead of 50000, and each MPI call still moves a whole
// shared-memory message or a socket buffer's worth.
constexpr auto kMaxHelperPollInterval = std::chrono::microseconds(1000);

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

const char* payload_name(Payload payload) {
  switch (payload) {
    case Payload::k: return "K";
    case Payload::v: return "V";
    case Payload::dk: return "dK";
    case Payload::dv: return "dV";
  }
  return "?";
}

RingComm::RingComm(const RingOptions& options, const char* operation)
    : operation_(operation), timeout_seconds_(options.timeout_seconds) {
  const std::string op = operation;
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized)
    throw Error(op + ": MPI is not initialized (call MPI_Init_thread first) or already finalized");
  if (options.comm == MPI_COMM_NULL) throw Error(op + ": comm is MPI_COMM_NULL");
  if (!(options.timeout_seconds > 0.0)) {
    options_error_ = op + ": timeout_seconds must be > 0, got " + std::to_string(options.timeout_seconds);
    timeout_seconds_ = RingOptions{}.timeout_seconds;
  }
  int thread_level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&thread_level);
  helper_thread_allowed_ = thread_level >= MPI_THREAD_SERIALIZED;

  // This rank's place, from the caller's communicator: the duplication's own errors and
  // timeout name it too.
  MPI_Comm_rank(options.comm, &rank_);
  MPI_Comm_size(options.comm, &size_);
  // A duplicate keeps the ring's messages apart from the caller's and lets errors return
  // instead of aborting.
  std::vector<MPI_Request> dup(1);
  check(MPI_Comm_idup(options.comm, &comm_, dup.data()), "MPI_Comm_idup");
  poll_until_done(dup, "every rank to enter the ring (communicator duplication)", false);
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
}

RingComm::~RingComm() {
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void RingComm::check(int mpi_result, const std::string& what) const {
  if (mpi_result == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(mpi_result, text, &length);
  throw Error(std::string(operation_) + ": rank " + std::to_string(rank_) + " of " +
              std::to_string(size_) + ": MPI error in " + what + ": " + std::string(text, length));
}

namespace {

// One message of a payload as the ring posts it: bytes [offset, offset + count), its tag.
struct Piece {
  std::size_t offset;
  int count;
  int tag;
};

std::vector<Piece> pieces(const char* operation, std::size_t bytes, Payload payload) {
  std::vector<Piece> out;
  const int base = static_cast<int>(payload) * kPiecesPerPayload;
  for (std::size_t offset = 0; offset < bytes; offset += kMaxPieceBytes) {
    if (out.size() >= static_cast<std::size_t>(kPiecesPerPayload))
      throw Error(std::string(operation) + ": a " + payload_name(payload) + " message of " + std::to_string(bytes) +
                  " bytes exceeds 4096 pieces of 1 GiB");
    out.push_back({offset, static_cast<int>(std::min(kMaxPieceBytes, bytes - offset)),
                   base + static_cast<int>(out.size())});
  }
  return out;
}

}  // namespace

void RingComm::send(Transfers& transfers, const void* data, std::size_t bytes, Payload payload) {
  const int next = (rank_ + 1) % size_;
  const auto* p = static_cast<const unsigned char*>(data);
  for (const Piece& piece : pieces(operation_, bytes, payload)) {
    MPI_Request request;
    check(MPI_Isend(p + piece.offset, piece.count, MPI_BYTE, next, piece.tag, comm_, &request), "MPI_Isend");
    transfers.requests.push_back(request);
  }
  bytes_sent_ += static_cast<std::int64_t>(bytes);
}

void RingComm::receive(Transfers& transfers, void* data, std::size_t bytes, Payload payload) {
  const int prev = (rank_ + size_ - 1) % size_;
  auto* p = static_cast<unsigned char*>(data);
  for (const Piece& piece : pieces(operation_, bytes, payload)) {
    MPI_Request request;
    check(MPI_Irecv(p + piece.offset, piece.count, MPI_BYTE, prev, piece.tag, comm_, &request), "MPI_Irecv");
    transfers.requests.push_back(request);
  }
}

namespace {

// Best effort: pending receives are cancelled so that no late message lands in a freed
// buffer, and the requests are freed.
void cancel_all(std::vector<MPI_Request>& requests) {
  for (MPI_Request& request : requests)
    if (request != MPI_REQUEST_NULL) {
      MPI_Cancel(&request);
      MPI_Request_free(&request);
    }
  requests.clear();
}

}  // namespace

Transfers::~Transfers() { cancel_all(requests); }

void RingComm::fail(std::vector<MPI_Request>& requests, const std::string& message, bool point_to_point) {
  // A collective's request may be neither cancelled nor freed (MPI-3 §5.12): it is abandoned.
  if (point_to_point)
    cancel_all(requests);
  else
    requests.clear();
  throw Error(message);
}

void RingComm::poll_until_done(std::vector<MPI_Request>& requests, const std::string& what,
                               bool point_to_point) {
  const Clock::time_point start = Clock::now();
  for (;;) {
    int done = 0;
    const int result =
        MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE);
    if (result != MPI_SUCCESS) {
      try {
        check(result, "waiting for " + what);
      } catch (const Error& e) {
        fail(requests, e.what(), point_to_point);
      }
    }
    if (done) break;
    const double waited = seconds_since(start);
    if (waited > timeout_seconds_) {
      char text[160];
      std::snprintf(text, sizeof text, ": rank %d of %d waited %.1f s (RingOptions::timeout_seconds %g) for ",
                    rank_, size_, waited, timeout_seconds_);
      fail(requests, operation_ + (text + what) + ": a peer is dead or stalled", point_to_point);
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  requests.clear();
}

void RingComm::wait(Transfers& transfers) {
  const Clock::time_point start = Clock::now();
  poll_until_done(transfers.requests, transfers.what, true);
  wait_seconds_ += seconds_since(start);
}

void RingComm::overlap(std::initializer_list<Transfers*> pending, const std::function<void()>& work) {
  const Clock::time_point start = Clock::now();
  std::vector<std::vector<MPI_Request>*> requests;
  for (Transfers* t : pending)
    if (!t->requests.empty()) requests.push_back(&t->requests);
  if (!helper_thread_allowed_ || requests.empty()) {
    work();
    compute_seconds_ += seconds_since(start);
    return;
  }
  // The helper is the only thread calling MPI until it is joined (MPI_THREAD_SERIALIZED).
  std::atomic<bool> stop{false};
  int helper_result = MPI_SUCCESS;
  std::thread helper([&] {
    auto period = kPollInterval;
    while (!stop.load(std::memory_order_acquire)) {
      bool all_done = true;
      for (std::vector<MPI_Request>* r : requests) {
        int done = 0;
        helper_result = MPI_Testall(static_cast<int>(r->size()), r->data(), &done, MPI_STATUSES_IGNORE);
        if (helper_result != MPI_SUCCESS) return;
        all_done = all_done && done;
      }
      if (all_done) return;
      std::this_thread::sleep_for(period);
      period = std::min(2 * period, kMaxHelperPollInterval);
    }
  });
  struct Join {
    std::atomic<bool>& stop;
    std::thread& helper;
    ~Join() {
      stop.store(true, std::memory_order_release);
      helper.join();
    }
  };
  {
    Join join{stop, helper};
    work();
  }
  compute_seconds_ += seconds_since(start);
  check(helper_result, "progressing transfers during computation");
}

void RingComm::allreduce_max(std::vector<std::int64_t>& values) {
  std::vector<MPI_Request> request(1);
  check(MPI_Iallreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_INT64_T,
                       MPI_MAX, comm_, request.data()),
        "MPI_Iallreduce");
  poll_until_done(request, "every rank's arguments (set-up)", false);
}

void RingComm::agree(bool ok, const std::string& local_message) {
  std::vector<std::int64_t> failed(static_cast<std::size_t>(size_), 0);
  failed[static_cast<std::size_t>(rank_)] = ok ? 0 : 1;
  allreduce_max(failed);
  if (!ok) throw Error(local_message);
  std::string ranks;
  for (int r = 0; r < size_; ++r)
    if (failed[static_cast<std::size_t>(r)]) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  if (!ranks.empty())
    throw Error(std::string(operation_) + ": rank(s) " + ranks +
                " rejected their arguments (their errors name them); rank " + std::to_string(rank_) +
                " stops too");
}

std::string kv_exchange_name(const RingComm& comm, int step, int key_rank) {
  const int p = comm.size();
  return "the K/V exchange for step " + std::to_string(step + 1) + " (rank " + std::to_string((key_rank - 1 + p) % p) +
         "'s shard from rank " + std::to_string((comm.rank() - 1 + p) % p) + ", rank " + std::to_string(key_rank) +
         "'s to rank " + std::to_string((comm.rank() + 1) % p) + ")";
}

}  // namespace flashattn::dist::detail
