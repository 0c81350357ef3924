// c10d wrapper; see comm.h. Gloo on torch 2.11 implements every collective used here
// (reduce_scatter_tensor and all_gather_into_tensor included, checked on 2.11.0), so nothing is
// emulated; the in-place all-gather clones its input on non-NCCL backends, which do not promise
// aliasing-safe copies.
#include "runtime/comm.h"

#include <ATen/ATen.h>

#include <exception>

#include "runtime/error.h"

namespace zeroshard {

namespace {
std::string describe(const char* op, const at::Tensor& t, const std::string& what) {
  return detail::cat(op, "(", what, ", ", t.numel(), " x ", t.scalar_type(), ")");
}
}  // namespace

CommWork::CommWork(c10::intrusive_ptr<c10d::Work> work, uint64_t seq, std::string what, int rank,
                   std::chrono::milliseconds timeout)
    : work_(std::move(work)), seq_(seq), what_(std::move(what)), rank_(rank), timeout_(timeout) {}

void CommWork::wait() {
  if (!work_) return;
  auto work = std::move(work_);
  work_.reset();
  bool finished = false;
  try {
    finished = work->wait(timeout_);
  } catch (const std::exception& e) {
    throw CommError(detail::cat("rank ", rank_, ": collective #", seq_, " ", what_,
                                " failed: ", e.what()));
  }
  // Backends that honour the timeout return false instead of throwing.
  if (!finished && !work->isCompleted()) {
    throw CommError(detail::cat("rank ", rank_, ": collective #", seq_, " ", what_,
                                " did not finish within ", timeout_.count(), " ms"));
  }
}

Comm::Comm(c10::intrusive_ptr<c10d::ProcessGroup> group, std::chrono::milliseconds timeout)
    : group_(std::move(group)), timeout_(timeout) {
  ZS_CHECK(group_, "Comm: process group is null");
  rank_ = group_->getRank();
  world_size_ = group_->getSize();
  backend_ = group_->getBackendName();
}

void Comm::check_tensor(const at::Tensor& t, const char* op, const std::string& what) const {
  ZS_CHECK(t.defined() && t.is_contiguous(), "rank ", rank_, ": ", op, "(", what,
           ") needs a defined contiguous tensor");
}

CommWork Comm::issue(c10::intrusive_ptr<c10d::Work> work, const char* op, const at::Tensor& t,
                     const std::string& what) {
  return CommWork(std::move(work), seq_, describe(op, t, what), rank_, timeout_);
}

CommWork Comm::all_reduce(at::Tensor tensor, const std::string& what) {
  check_tensor(tensor, "all_reduce", what);
  ++seq_;
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  return issue(group_->allreduce(ts, opts), "all_reduce", tensor, what);
}

CommWork Comm::all_reduce_max(at::Tensor tensor, const std::string& what) {
  check_tensor(tensor, "all_reduce_max", what);
  ++seq_;
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  return issue(group_->allreduce(ts, opts), "all_reduce_max", tensor, what);
}

CommWork Comm::reduce_scatter(at::Tensor output, at::Tensor input, const std::string& what) {
  check_tensor(output, "reduce_scatter", what);
  check_tensor(input, "reduce_scatter", what);
  ZS_CHECK(input.numel() == output.numel() * world_size_, "rank ", rank_, ": reduce_scatter(", what,
           "): input has ", input.numel(), " elements, expected world_size ", world_size_, " x ",
           output.numel());
  ++seq_;
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  return issue(group_->_reduce_scatter_base(output, input, opts), "reduce_scatter", input, what);
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
  ++seq_;
  return issue(group_->_allgather_base(output, input), "all_gather", output, what);
}

CommWork Comm::broadcast(at::Tensor tensor, int root, const std::string& what) {
  check_tensor(tensor, "broadcast", what);
  ++seq_;
  std::vector<at::Tensor> ts{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  return issue(group_->broadcast(ts, opts), "broadcast", tensor, what);
}

CommWork Comm::send(at::Tensor tensor, int dst_rank, int tag, const std::string& what) {
  check_tensor(tensor, "send", what);
  ++seq_;
  std::vector<at::Tensor> ts{tensor};
  return issue(group_->send(ts, dst_rank, tag), "send", tensor, what);
}

CommWork Comm::recv(at::Tensor tensor, int src_rank, int tag, const std::string& what) {
  check_tensor(tensor, "recv", what);
  ++seq_;
  std::vector<at::Tensor> ts{tensor};
  return issue(group_->recv(ts, src_rank, tag), "recv", tensor, what);
}

void Comm::barrier(const std::string& what) {
  ++seq_;
  CommWork(group_->barrier(), seq_, detail::cat("barrier(", what, ")"), rank_, timeout_).wait();
}

}  // namespace zeroshard
