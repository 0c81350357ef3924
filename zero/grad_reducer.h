// Stages 0 and 1: gradients accumulate in place in each group's full flat gradient buffer
// (param.grad are views into it); at the accumulation boundary each bucket is all-reduced in place,
// started from the gradient hook of its last-ready parameter so communication overlaps backward.
#pragma once
#include <memory>
#include <vector>

#include "runtime/comm.h"
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
  GradReducer(const std::vector<FlatGroup*>& groups, std::shared_ptr<Comm> comm,
              const ReduceOptions& options);
  // `grad` is ignored: the gradient already sits in the flat buffer (the engine keeps it there).
  void grad_ready(int64_t index, const at::Tensor& grad) override;
  void finish() override;
  int64_t num_buckets() const override { return int64_t(buckets_.size()); }
  int64_t num_params() const override { return int64_t(plan_.bucket_of_param.size()); }

 private:
  struct Bucket {
    at::Tensor grads;        // view into the group's flat gradient buffer
    at::Tensor comm_buffer;  // when reducing in another dtype
    int64_t num_params = 0;
    int64_t ready = 0;
    int64_t index = 0;
    CommWork work;
    enum class State { idle, in_flight, done } state = State::idle;
  };
  void start(Bucket& b);
  void complete(Bucket& b);

  std::shared_ptr<Comm> comm_;
  ReduceOptions opt_;
  BucketPlan plan_;
  std::vector<Bucket> buckets_;
};

}  // namespace zeroshard
