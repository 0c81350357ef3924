// Bucketed gradient all-reduce for stages 0 and 1. Buckets are contiguous slices of a group's flat
// gradient buffer, at most reduce_bucket_size elements, built from the last parameter backwards
// (the order backward produces gradients). A bucket's all-reduce starts from the gradient hook of
// its last-ready parameter, so communication overlaps the rest of backward.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "runtime/comm.h"
#include "zero/flat_group.h"

namespace zeroshard {

struct ReduceOptions {
  int64_t bucket_numel = 500000000;
  bool overlap_comm = true;             // false: each bucket is waited for as soon as it starts
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  at::ScalarType comm_dtype = at::ScalarType::Undefined;  // Undefined: the gradients' own dtype
};

class GradReducer {
 public:
  GradReducer(const std::vector<FlatGroup*>& groups, std::shared_ptr<Comm> comm,
              const ReduceOptions& options);
  // Parameter `index` (global, in group order) has its final gradient for this step.
  void grad_ready(int64_t index);
  // Starts every bucket not started yet (parameters that got no gradient), waits for all, and
  // leaves each gradient averaged over ranks. Resets for the next step.
  void finish();
  int64_t num_buckets() const { return int64_t(buckets_.size()); }
  int64_t num_params() const { return int64_t(bucket_of_.size()); }

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
  std::vector<Bucket> buckets_;
  std::vector<int64_t> bucket_of_;  // parameter index -> bucket
};

}  // namespace zeroshard
