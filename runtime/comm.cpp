// c10d wrapper; see comm.h. Gloo on torch 2.11 implements every collective used here
// (reduce_scatter_tensor and all_gather_into_tensor included, checked on 2.11.0), so nothing is
// emulated; the in-place all-gather clones its input on non-NCCL backends, which do not promise
// aliasing-safe copies.
#include "runtime/comm.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <exception>
#include <mutex>

#include "runtime/comm_stats.h"
#include "runtime/error.h"
#include "runtime/trace.h"

namespace zeroshard {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// How often a blocked wait looks in the store for another rank's failure.
constexpr milliseconds kAbortPollInterval{200};

// Torch 2.11's c10d flight recorder is one per process and, on a group's first collective, adds
// the group to a std::map before taking its lock (FlightRecorder::recordWithResetEnabled,
// all_pg_status_). Groups of one process issuing at once (ranks as threads, as in the in-process
// tests) corrupt that map: SIGSEGV in _Rb_tree_insert_and_rebalance under
// ProcessGroupGloo::enqueue. So host work is issued under one process-wide lock; a host backend's
// issue only enqueues, so the lock is never held for long. NCCL work is left out: its issue can
// block (lazy communicator set-up), and a shared lock there could deadlock ranks sharing a process.
std::mutex host_issue_mutex;

// "all_reduce(gradient bucket 3, 1024 x Float, 4096 B)"; extra: "root 0", "to rank 1".
std::string describe(const char* op, const at::Tensor& t, const std::string& what,
                     const std::string& extra = {}) {
  return detail::cat(op, "(", what, ", ", extra.empty() ? "" : extra + ", ", t.numel(), " x ",
                     t.scalar_type(), ", ", t.nbytes(), " B)");
}

}  // namespace

CommWork::CommWork(c10::intrusive_ptr<c10d::Work> work, uint64_t seq, std::string what,
                   std::shared_ptr<CommMonitor> monitor, bool device_async, bool point_to_point,
                   CommOp op)
    : work_(std::move(work)),
      seq_(seq),
      what_(std::move(what)),
      monitor_(std::move(monitor)),
      device_async_(device_async),
      point_to_point_(point_to_point),
      op_(std::move(op)) {
  // A host backend completes a collective on its own thread, and the caller may wait for it much
  // later (a prefetched gather): the future's callback notes when it finished, so the trace and
  // the comms logger see the collective's own time. Not NCCL (its future completes with stream
  // semantics, at issue) nor Gloo's send/recv (no future).
  if (op_.issued_ns == 0 || !work_ || device_async_ || point_to_point_) return;
  try {
    auto finished = std::make_shared<std::atomic<int64_t>>(0);
    work_->getFuture()->addCallback(
        [finished](c10::ivalue::Future&) { finished->store(trace::now_ns()); });
    finished_ns_ = std::move(finished);
  } catch (const std::exception&) {
    // A Work without a future: its end is when wait() returns.
  }
}

void CommWork::wait() {
  if (!work_) return;
  auto work = std::move(work_);
  work_.reset();
  const int64_t wait_start_ns = op_.issued_ns != 0 ? trace::now_ns() : 0;
  wait_for_backend(std::move(work));
  if (op_.issued_ns != 0) record_finished(wait_start_ns);
}

void CommWork::record_finished(int64_t wait_start_ns) const {
  // On NCCL "finished" is when the stream is ordered after the collective, not when it ran: the
  // device's own timing is the profiler's business; on host backends it is the completion.
  const int64_t end_ns = trace::now_ns();
  if (trace::timing()) trace::add_blocked_ns(end_ns - wait_start_ns);
  const int64_t finished_ns = finished_ns_ ? finished_ns_->load() : 0;
  const int64_t done_ns = finished_ns > 0 ? std::min(finished_ns, end_ns) : end_ns;
  CommStats::global().record(op_.kind, op_.what, op_.bytes, op_.world_size,
                             double(done_ns - op_.issued_ns) / 1e6);
  if (!trace::on()) return;
  const std::string args = detail::cat("\"seq\": ", seq_, ", \"op\": \"", op_.kind, "\", \"bytes\": ",
                                       op_.bytes, ", \"group\": \"", op_.group, "\", \"group_size\": ",
                                       op_.world_size);
  trace::span("comm", what_, op_.issued_ns, done_ns, args);
  // The part of it this thread spent blocked: exposed communication, what overlap did not hide.
  trace::span("wait", detail::cat("wait #", seq_, " ", op_.kind), wait_start_ns, end_ns, args);
}

void CommWork::wait_for_backend(c10::intrusive_ptr<c10d::Work> work) {
  const milliseconds timeout = monitor_->timeout();
  if (device_async_) {
    // NCCL: wait() only orders the current stream after the collective; its watchdog owns the
    // timeout, so there is nothing to poll here.
    try {
      work->wait(timeout);
    } catch (const std::exception& e) {
      monitor_->fail(seq_, what_, CommFailure::backend, e.what());
    }
    monitor_->finished(seq_);
    return;
  }
  // Host-blocking backends: wait in slices so that another rank's failure (published in the
  // store) ends this wait too, instead of each rank discovering it at its own timeout. Not for
  // Gloo's send/recv: their wait(timeout) gives up the receive when it expires, so the monitor's
  // watcher thread aborts them instead.
  const bool poll = monitor_->can_poll_abort() && !point_to_point_;
  const auto watched = point_to_point_ ? monitor_->watch_blocking(work) : nullptr;
  const auto deadline = Clock::now() + timeout;
  while (true) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) monitor_->fail(seq_, what_, CommFailure::timeout, {});
    try {
      work->wait(poll ? std::min(left, kAbortPollInterval) : left);
      if (watched && watched->aborted()) monitor_->fail(seq_, what_, CommFailure::aborted, {});
      break;
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      // c10d's Work::wait throws both when the slice runs out ("Operation timed out!") and for
      // the backend's error. Only the work's own exception is an error: a collective that
      // completed between the slice's end and this check succeeded (reporting it as failed
      // ended a test run on that race once).
      if (work->isCompleted()) {
        const std::exception_ptr error = work->exception();
        if (!error) break;
        try {
          std::rethrow_exception(error);
        } catch (const std::exception& backend_error) {
          monitor_->fail(seq_, what_, CommFailure::backend, backend_error.what());
        } catch (...) {
          monitor_->fail(seq_, what_, CommFailure::backend, e.what());
        }
      }
    }
    if ((poll || watched) && monitor_->abort_requested()) monitor_->fail(seq_, what_, CommFailure::aborted, {});
  }
  monitor_->finished(seq_);
}

Comm::Comm(c10::intrusive_ptr<c10d::ProcessGroup> group, milliseconds timeout,
           c10::intrusive_ptr<c10d::Store> store, std::optional<bool> check_agreement)
    : group_(std::move(group)) {
  ZS_CHECK(group_, "Comm: process group is null");
  ZS_REQUIRE(timeout.count() > 0, "Comm: timeout must be positive, got ", timeout.count(), " ms");
  rank_ = group_->getRank();
  world_size_ = group_->getSize();
  backend_ = group_->getBackendName();
  try {
    group_name_ = group_->getGroupName();
  } catch (const std::exception&) {
    // A group built without torch.distributed's registry (tests' in-process world) has no name.
  }
  monitor_ = std::make_shared<CommMonitor>(std::move(store), rank_, world_size_, timeout,
                                           check_agreement);
}

void Comm::check_tensor(const at::Tensor& t, const char* op, const std::string& what) const {
  ZS_CHECK(t.defined() && t.is_contiguous(), "rank ", rank_, ": ", op, "(", what,
           ") needs a defined contiguous tensor");
}

std::string Comm::begin(const std::string& description, bool whole_group) {
  ++seq_;
  monitor_->starting(seq_, description, whole_group);
  return description;
}

CommOp Comm::op_of(const char* kind, const at::Tensor& tensor, const std::string& what) const {
  CommOp op;
  if (!trace::on() && !trace::timing() && !CommStats::global().enabled()) return op;
  op.kind = kind;
  op.what = what;
  op.bytes = static_cast<int64_t>(tensor.nbytes());
  op.world_size = world_size_;
  op.group = group_name_;
  op.issued_ns = trace::now_ns();
  return op;
}

template <typename Issue>
CommWork Comm::issue(const std::string& description, bool device_async, Issue&& call,
                     bool point_to_point, CommOp op) {
  c10::intrusive_ptr<c10d::Work> work;
  try {
    std::unique_lock<std::mutex> serialized(host_issue_mutex, std::defer_lock);
    if (!device_async) serialized.lock();  // see host_issue_mutex
    work = call();
  } catch (const std::exception& e) {
    monitor_->fail(seq_, description, CommFailure::backend, e.what());
  }
  return CommWork(std::move(work), seq_, description, monitor_, device_async, point_to_point,
                  std::move(op));
}

CommWork Comm::all_reduce(at::Tensor tensor, const std::string& what) {
  check_tensor(tensor, "all_reduce", what);
  const auto d = begin(describe("all_reduce", tensor, what), true);
  return issue(d, tensor.is_cuda(), [&] {
    std::vector<at::Tensor> ts{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    return group_->allreduce(ts, opts);
  }, false, op_of("all_reduce", tensor, what));
}

CommWork Comm::all_reduce_max(at::Tensor tensor, const std::string& what) {
  check_tensor(tensor, "all_reduce_max", what);
  const auto d = begin(describe("all_reduce_max", tensor, what), true);
  return issue(d, tensor.is_cuda(), [&] {
    std::vector<at::Tensor> ts{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    return group_->allreduce(ts, opts);
  }, false, op_of("all_reduce_max", tensor, what));
}

CommWork Comm::reduce_scatter(at::Tensor output, at::Tensor input, const std::string& what) {
  check_tensor(output, "reduce_scatter", what);
  check_tensor(input, "reduce_scatter", what);
  ZS_CHECK(input.numel() == output.numel() * world_size_, "rank ", rank_, ": reduce_scatter(", what,
           "): input has ", input.numel(), " elements, expected world_size ", world_size_, " x ",
           output.numel());
  const auto d = begin(describe("reduce_scatter", input, what), true);
  return issue(d, input.is_cuda(), [&] {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    return group_->_reduce_scatter_base(output, input, opts);
  }, false, op_of("reduce_scatter", input, what));
}

CommWork Comm::reduce_scatter_in_place(at::Tensor buffer, const std::string& what) {
  check_tensor(buffer, "reduce_scatter_in_place", what);
  ZS_CHECK(buffer.numel() % world_size_ == 0, "rank ", rank_, ": reduce_scatter_in_place(", what,
           "): ", buffer.numel(), " elements do not split into world_size ", world_size_, " parts");
  if (backend_ != "nccl") return all_reduce(buffer, what);
  const int64_t part = buffer.numel() / world_size_;
  at::Tensor output = buffer.narrow(0, rank_ * part, part);
  const auto d = begin(describe("reduce_scatter", buffer, what), true);
  return issue(d, buffer.is_cuda(), [&] {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    return group_->_reduce_scatter_base(output, buffer, opts);
  }, false, op_of("reduce_scatter", buffer, what));
}

CommWork Comm::all_gather(at::Tensor output, at::Tensor input, const std::string& what) {
  check_tensor(output, "all_gather", what);
  check_tensor(input, "all_gather", what);
  ZS_CHECK(output.numel() == input.numel() * world_size_, "rank ", rank_, ": all_gather(", what,
           "): output has ", output.numel(), " elements, expected world_size ", world_size_, " x ",
           input.numel());
  if (backend_ != "nccl" && input.data_ptr() >= output.data_ptr() &&
      static_cast<char*>(input.data_ptr()) < static_cast<char*>(output.data_ptr()) + output.nbytes()) {
    input = input.clone();
  }
  const auto d = begin(describe("all_gather", output, what), true);
  return issue(d, output.is_cuda(), [&] { return group_->_allgather_base(output, input); }, false,
               op_of("all_gather", output, what));
}

CommWork Comm::broadcast(at::Tensor tensor, int root, const std::string& what) {
  check_tensor(tensor, "broadcast", what);
  const auto d = begin(describe("broadcast", tensor, what, detail::cat("root ", root)), true);
  return issue(d, tensor.is_cuda(), [&] {
    std::vector<at::Tensor> ts{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    return group_->broadcast(ts, opts);
  }, false, op_of("broadcast", tensor, what));
}

// send/recv involve two ranks, so the debug agreement check (over the whole group) skips them.
void Comm::fail_here(const std::string& what, const std::string& cause) {
  const auto d = begin(what, false);
  monitor_->fail(seq_, d, CommFailure::backend, cause);
}

CommWork Comm::send(at::Tensor tensor, int dst_rank, int tag, const std::string& what) {
  check_tensor(tensor, "send", what);
  const auto d = begin(describe("send", tensor, what, detail::cat("to rank ", dst_rank)), false);
  return issue(d, tensor.is_cuda(), [&] {
    std::vector<at::Tensor> ts{tensor};
    return group_->send(ts, dst_rank, tag);
  }, true, op_of("send", tensor, what));
}

CommWork Comm::recv(at::Tensor tensor, int src_rank, int tag, const std::string& what) {
  check_tensor(tensor, "recv", what);
  const auto d = begin(describe("recv", tensor, what, detail::cat("from rank ", src_rank)), false);
  return issue(d, tensor.is_cuda(), [&] {
    std::vector<at::Tensor> ts{tensor};
    return group_->recv(ts, src_rank, tag);
  }, true, op_of("recv", tensor, what));
}

void Comm::barrier(const std::string& what) {
  const auto d = begin(detail::cat("barrier(", what, ")"), true);
  issue(d, backend_ == "nccl", [&] { return group_->barrier(); }).wait();
}

}  // namespace zeroshard
