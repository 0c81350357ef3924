// Stages 0 and 1: gradients accumulate in place in each group's full flat gradient buffer
// (param.grad are views into it); at the accumulation boundary each bucket is all-reduced in place,
// started from the gradient hook of its last-ready parameter so communication overlaps backward.
// zero_grad only forgets what was written (the engine sets param.grad to None): the first backward
// of a window copies autograd's fresh gradient into its view, as DDP does, instead of adding it to
// a zeroed buffer, and when that copy is the whole window's gradient it also applies the mean's
// 1/world_size. That saves three passes over the gradients per step (zeroing, the add's extra
// read, the scaling after the sum); views that got no gradient are zeroed when their bucket starts.
#pragma once
#include <memory>
#include <vector>

#include "runtime/comm.h"
#include "runtime/memory.h"
#include "zero/buckets.h"
#include "zero/flat_group.h"
#include "zero/reducer.h"

namespace zeroshard {

struct ReduceOptions {
  int64_t bucket_numel = 500000000;
  bool overlap_comm = true;             // false: each bucket is waited for as soon as it starts
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  at::ScalarType comm_dtype = at::ScalarType::Undefined;  // Undefined: the gradients' own dtype

  // Applied before and after the sum, so the result is the mean over ranks.
  double pre_factor(int64_t world_size) const;
  double post_factor(int64_t world_size) const;
};

class GradReducer final : public Reducer {
 public:
  // A communication dtype other than the gradients' gives each bucket a buffer of that dtype,
  // accounted as comm_buffers in `memory`.
  GradReducer(const std::vector<FlatGroup*>& groups, std::shared_ptr<Comm> comm,
              const ReduceOptions& options, MemoryAccount& memory);
  ~GradReducer() override;
  void begin_backward(bool accumulation_boundary) override { boundary_ = accumulation_boundary; }
  // Called in every backward. `grad`: autograd's gradient when it is not the flat-buffer view
  // (the first backward since zero_grad, or a script that replaced param.grad), copied into the
  // view; undefined when it already accumulated in the view. Counts towards the bucket only in the
  // boundary backward.
  void grad_ready(int64_t index, const at::Tensor& grad) override;
  void finish() override;
  void abort() override;
  void zero_grad() override;
  int64_t num_buckets() const override { return int64_t(buckets_.size()); }
  int64_t num_params() const override { return int64_t(plan_.bucket_of_param.size()); }

 private:
  struct Bucket {
    at::Tensor grads;        // view into the group's flat gradient buffer
    at::Tensor comm_buffer;  // when reducing in another dtype
    int64_t first_param = 0;  // global index of the bucket's first parameter
    int64_t num_params = 0;
    bool folds_mean = false;  // its gradients may be copied in with the mean's factor applied
    int64_t ready = 0;
    int64_t index = 0;
    CommWork work;
    enum class State { idle, in_flight, done } state = State::idle;
  };
  void adopt(int64_t index, const at::Tensor& grad);
  void start(Bucket& b);
  void complete(Bucket& b);

  std::shared_ptr<Comm> comm_;
  ReduceOptions opt_;
  MemoryAccount& memory_;
  int64_t accounted_bytes_ = 0;
  BucketPlan plan_;
  std::vector<Bucket> buckets_;
  std::vector<at::Tensor> views_;  // flat view of each parameter's gradient
  // Per parameter, since zero_grad: its view holds this window's gradient; and that gradient
  // already carries the mean's factor (its whole window was one copy, or it is zero).
  std::vector<uint8_t> written_, scaled_;
  bool boundary_ = true;
};

}  // namespace zeroshard
