// How gradients reach the optimizer: the interface the gradient reducers implement. The stage
// strategy picks one (stages 0/1: in-place all-reduce of full flat gradients; stages 2/3: staged
// buckets reduced into each rank's owned shard).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <utility>

namespace zeroshard {

class Reducer {
 public:
  virtual ~Reducer() = default;
  // Before each backward: whether it ends a gradient accumulation window.
  virtual void begin_backward(bool accumulation_boundary) { (void)accumulation_boundary; }
  // Parameter `index` (global, groups in order) has its gradient for this backward in `grad`.
  virtual void grad_ready(int64_t index, const at::Tensor& grad) = 0;
  // After backward: starts every bucket not started (parameters with no gradient), waits for all.
  virtual void finish() = 0;
  // After a backward that raised: forgets its half-filled buckets, so the next backward starts
  // clean, and waits for the reductions it started (the backend may still be using their
  // buffers, which the next backward reuses). What was already reduced stays in the gradients
  // until zero_grad.
  virtual void abort() = 0;
  // The gradients this reducer keeps start again from zero (at the step, or the script's zero_grad).
  virtual void zero_grad() = 0;
  virtual int64_t num_buckets() const = 0;
  virtual int64_t num_params() const = 0;

  // Called in a backward that ends the accumulation window as each bucket's part of the owned
  // gradients becomes final (`begin`, `numel` in group `group`'s owned range), on the thread that
  // completes the bucket: optimizer offload starts copying them to host memory while backward
  // goes on. Only reducers whose gradients no script can reach (param.grad is dropped: stages
  // 2 and 3) call it; with full gradients a script may still edit them before the step.
  using FinalGradients = std::function<void(int64_t group, int64_t begin, int64_t numel)>;
  void on_final_gradients(FinalGradients fn) { on_final_ = std::move(fn); }

 protected:
  FinalGradients on_final_;
};

}  // namespace zeroshard
