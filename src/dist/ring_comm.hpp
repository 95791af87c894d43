// The ring's transport on MPI: a private duplicate of the caller's communicator, non-blocking
// sends to the next rank and receives from the previous one, a helper thread that drives
// them while the kernels compute, and waits that give up at a deadline.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "flashattn/dist.hpp"

namespace flashattn::dist::detail {

// What a message carries; each kind has its own tag range, so the kinds of one step never
// match each other's receives.
enum class Payload { k, v, dk, dv };
const char* payload_name(Payload payload);

// Non-blocking transfers that are waited for together. Declared after the buffers they
// read and write: if anything throws before they are waited for (a kernel, an allocation),
// the destructor cancels and frees what is still posted, so that no late message lands in a
// buffer the unwinding frees.
struct Transfers {
  explicit Transfers(std::string what_) : what(std::move(what_)) {}
  ~Transfers();
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;

  std::vector<MPI_Request> requests;
  std::string what;  // for error messages, e.g. "K/V shard of rank 2 (step 1)"
};

class RingComm {
 public:
  // Duplicates `options.comm` (a polled MPI_Comm_idup, so a dead rank cannot hang it here).
  // `operation` names the calling function in every error message. A timeout_seconds that
  // is not > 0 is not thrown here, where the other ranks would wait in the duplication for
  // their whole timeout: it is options_error(), which the argument check that every rank
  // agrees on throws; until then the default timeout applies.
  RingComm(const RingOptions& options, const char* operation);
  ~RingComm();
  RingComm(const RingComm&) = delete;
  RingComm& operator=(const RingComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const char* operation() const { return operation_; }
  // What is wrong with the RingOptions this rank passed; empty when nothing is.
  const std::string& options_error() const { return options_error_; }

  // Sends `bytes` from `data` to rank + 1 / receives them from rank − 1; the buffer must stay
  // untouched until the transfers are waited for.
  void send(Transfers& transfers, const void* data, std::size_t bytes, Payload payload);
  void receive(Transfers& transfers, void* data, std::size_t bytes, Payload payload);

  // Runs `work` (the kernels) while a helper thread drives `pending` (MPI makes progress
  // only inside its calls); the time counts as compute time.
  void overlap(std::initializer_list<Transfers*> pending, const std::function<void()>& work);
  // Blocks until every transfer is done; the time counts as waiting. Throws Error when the
  // deadline passes first.
  void wait(Transfers& transfers);

  // Element-wise maximum over all ranks, in place (polled with the deadline).
  void allreduce_max(std::vector<std::int64_t>& values);

  // Throws Error(message) on every rank when `ok` is false on any rank; a rank whose own
  // check failed throws its own message, the others name the ranks that failed.
  void agree(bool ok, const std::string& local_message);

  std::int64_t bytes_sent() const { return bytes_sent_; }
  double compute_seconds() const { return compute_seconds_; }
  double wait_seconds() const { return wait_seconds_; }

 private:
  void check(int mpi_result, const std::string& what) const;
  // point_to_point: the requests are sends and receives (cancellable), not a collective.
  void poll_until_done(std::vector<MPI_Request>& requests, const std::string& what, bool point_to_point);
  [[noreturn]] void fail(std::vector<MPI_Request>& requests, const std::string& message, bool point_to_point);

  MPI_Comm comm_ = MPI_COMM_NULL;
  const char* operation_;
  double timeout_seconds_;
  std::string options_error_;
  int rank_ = 0, size_ = 1;
  bool helper_thread_allowed_ = false;  // MPI_THREAD_SERIALIZED or more
  std::int64_t bytes_sent_ = 0;
  double compute_seconds_ = 0.0, wait_seconds_ = 0.0;
};

// "the K/V exchange for step N (...)", naming the shards and the neighbours, for errors.
std::string kv_exchange_name(const RingComm& comm, int step, int key_rank);

}  // namespace flashattn::dist::detail
