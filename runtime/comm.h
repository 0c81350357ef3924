// The one communication layer: a wrapper over a c10d ProcessGroup (NCCL for CUDA tensors, Gloo for
// CPU tensors) that issues async collectives on flat tensors. Every call gets a per-rank sequence
// number and a description (op, what, elements, bytes); a CommMonitor publishes them so that a
// failure or timeout names the collective every rank was in (see comm_monitor.h).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "runtime/comm_monitor.h"

namespace zeroshard {

// What a collective moves, for the comms logger and the trace (runtime/comm_stats.h, trace.h):
// its kind, the caller's description, the message's bytes, and when it was issued (0 when neither
// was recording then).
struct CommOp {
  const char* kind = "";
  std::string what;
  int64_t bytes = 0;
  int world_size = 1;
  std::string group;  // the process group's name ("" when it has none)
  int64_t issued_ns = 0;
};

// A collective in flight. wait() blocks until it finished (at most the timeout) and turns a
// backend failure, a timeout or another rank's failure into a CommError naming every rank's
// collective. CUDA work keeps the backend's stream semantics: wait() orders the current stream
// after it and the backend's watchdog enforces the timeout.
class CommWork {
 public:
  CommWork() = default;
  CommWork(c10::intrusive_ptr<c10d::Work> work, uint64_t seq, std::string what,
           std::shared_ptr<CommMonitor> monitor, bool device_async, bool point_to_point = false,
           CommOp op = {});
  void wait();
  bool pending() const { return static_cast<bool>(work_); }
  // Whether the backend finished it (a later wait() returns at once); true once waited for.
  bool completed() const { return !work_ || work_->isCompleted(); }
  uint64_t sequence() const { return seq_; }
  bool checks_agreement() const { return monitor_->checks_agreement(); }
  const FlightRecorder& recorder() const { return monitor_->recorder(); }
  const std::string& description() const { return what_; }

 private:
  void wait_for_backend(c10::intrusive_ptr<c10d::Work> work);
  // The comms logger's row and the trace's spans, once wait() saw the collective finish.
  void record_finished(int64_t wait_start_ns) const;

  c10::intrusive_ptr<c10d::Work> work_;
  uint64_t seq_ = 0;
  std::string what_;
  std::shared_ptr<CommMonitor> monitor_;
  bool device_async_ = false;
  bool point_to_point_ = false;
  CommOp op_;
  // When a host backend's thread finished it (its future's callback), 0 until then; null where
  // nothing records or the backend has no future.
  std::shared_ptr<std::atomic<int64_t>> finished_ns_;
};

class Comm {
 public:
  // store: the process group's store (torch.distributed's default store for WORLD); without it
  // errors name only this rank. check_agreement: nullopt reads ZEROSHARD_DEBUG_COLLECTIVES.
  explicit Comm(c10::intrusive_ptr<c10d::ProcessGroup> group,
                std::chrono::milliseconds timeout = std::chrono::minutes(30),
                c10::intrusive_ptr<c10d::Store> store = {},
                std::optional<bool> check_agreement = std::nullopt);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const std::string& backend() const { return backend_; }
  uint64_t sequence() const { return seq_; }
  bool checks_agreement() const { return monitor_->checks_agreement(); }
  const FlightRecorder& recorder() const { return monitor_->recorder(); }

  // Sum over ranks, in place.
  CommWork all_reduce(at::Tensor tensor, const std::string& what);
  // Max over ranks, in place (overflow flags, agreement checks).
  CommWork all_reduce_max(at::Tensor tensor, const std::string& what);
  // input: world_size * n elements; output: this rank's n-element slice of the sum.
  CommWork reduce_scatter(at::Tensor output, at::Tensor input, const std::string& what);
  // buffer: world_size equal parts. Afterwards this rank's part, [rank*n, (rank+1)*n), holds the
  // sum over ranks of that part; the other parts are scratch. NCCL reduce-scatters in place (its
  // output is that part). Other backends all-reduce the buffer: Gloo's reduce-scatter copies its
  // whole input first, and measured slower here than an in-place all-reduce of the same buffer.
  CommWork reduce_scatter_in_place(at::Tensor buffer, const std::string& what);
  // input: n elements from each rank; output: world_size * n, rank r's input at [r*n, (r+1)*n).
  // input may alias output's own slice (the usual in-place gather of a sharded flat buffer).
  CommWork all_gather(at::Tensor output, at::Tensor input, const std::string& what);
  CommWork broadcast(at::Tensor tensor, int root, const std::string& what);
  CommWork send(at::Tensor tensor, int dst_rank, int tag, const std::string& what);
  CommWork recv(at::Tensor tensor, int src_rank, int tag, const std::string& what);
  void barrier(const std::string& what);
  // A communicator without a store (a sub-group's) ends its blocked collectives when `world`
  // (which has one) sees another rank's failure, instead of waiting for the peer's exit.
  void follow_aborts_of(const Comm& world) { monitor_->set_abort_source(world.monitor_); }
  // A failure outside any collective (a pipeline stage's forward raised): numbered and published
  // like a failed collective, so that the other ranks' errors name it, then thrown as CommError
  // naming every rank's state. cause: the original error's text.
  [[noreturn]] void fail_here(const std::string& what, const std::string& cause);

 private:
  // Numbers, records and publishes the next collective (and checks agreement in debug mode)
  // before it reaches the backend; returns its description.
  std::string begin(const std::string& description, bool whole_group);
  // Hands the backend's work to a CommWork; a synchronous backend error becomes a CommError too.
  template <typename Issue>
  CommWork issue(const std::string& description, bool device_async, Issue&& call,
                 bool point_to_point = false, CommOp op = {});
  // The op record for a collective of `tensor` (stamped with the issue time when recording).
  CommOp op_of(const char* kind, const at::Tensor& tensor, const std::string& what) const;
  void check_tensor(const at::Tensor& t, const char* op, const std::string& what) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::shared_ptr<CommMonitor> monitor_;
  int rank_;
  int world_size_;
  std::string group_name_;  // the process group's name, for the trace
  std::string backend_;
  uint64_t seq_ = 0;
};

}  // namespace zeroshard
