// The one communication layer: a wrapper over a c10d ProcessGroup (NCCL for CUDA tensors, Gloo for
// CPU tensors) that issues async collectives on flat tensors. Every call gets a per-rank sequence
// number and a description, so a failure or timeout says which collective each rank was in.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <string>

namespace zeroshard {

// A collective in flight. wait() blocks until it finished and turns any backend failure into a
// CommError naming the rank, sequence number and collective.
class CommWork {
 public:
  CommWork() = default;
  CommWork(c10::intrusive_ptr<c10d::Work> work, uint64_t seq, std::string what, int rank,
           std::chrono::milliseconds timeout);
  void wait();
  bool pending() const { return static_cast<bool>(work_); }
  uint64_t sequence() const { return seq_; }
  const std::string& description() const { return what_; }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  uint64_t seq_ = 0;
  std::string what_;
  int rank_ = 0;
  std::chrono::milliseconds timeout_{0};
};

class Comm {
 public:
  explicit Comm(c10::intrusive_ptr<c10d::ProcessGroup> group,
                std::chrono::milliseconds timeout = std::chrono::minutes(30));

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const std::string& backend() const { return backend_; }
  uint64_t sequence() const { return seq_; }

  // Sum over ranks, in place.
  CommWork all_reduce(at::Tensor tensor, const std::string& what);
  // Max over ranks, in place (overflow flags, agreement checks).
  CommWork all_reduce_max(at::Tensor tensor, const std::string& what);
  // input: world_size * n elements; output: this rank's n-element slice of the sum.
  CommWork reduce_scatter(at::Tensor output, at::Tensor input, const std::string& what);
  // input: n elements from each rank; output: world_size * n, rank r's input at [r*n, (r+1)*n).
  // input may alias output's own slice (the usual in-place gather of a sharded flat buffer).
  CommWork all_gather(at::Tensor output, at::Tensor input, const std::string& what);
  CommWork broadcast(at::Tensor tensor, int root, const std::string& what);
  CommWork send(at::Tensor tensor, int dst_rank, int tag, const std::string& what);
  CommWork recv(at::Tensor tensor, int src_rank, int tag, const std::string& what);
  void barrier(const std::string& what);

 private:
  CommWork issue(c10::intrusive_ptr<c10d::Work> work, const char* op, const at::Tensor& t,
                 const std::string& what);
  void check_tensor(const at::Tensor& t, const char* op, const std::string& what) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::chrono::milliseconds timeout_;
  int rank_;
  int world_size_;
  std::string backend_;
  uint64_t seq_ = 0;
};

}  // namespace zeroshard
