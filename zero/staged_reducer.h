// Shared machinery of the reducers that stage gradients (stages 2 and 3): gradients are copied from
// param.grad into a staging buffer per bucket as backward produces them (the engine then drops
// param.grad), every bucket is reduced on every micro-step in its staging buffer, and each rank
// adds its part of the result into its gradient shard, where gradient accumulation happens.
// Staging buffers come from a small pool: two with overlap_comm (one filling while one is
// reduced), one without; a pool that runs out first finishes its oldest reduction. A parameter
// larger than a bucket is reduced in pieces, one bucket each, so that it needs no staging of its
// own size (with overlap_comm one piece fills while the one before is reduced). Subclasses say how a
// gradient is staged, which in-place collective reduces a bucket, and where this rank's part of
// the result goes.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/comm.h"
#include "runtime/memory.h"
#include "zero/buckets.h"
#include "zero/flat_group.h"
#include "zero/grad_reducer.h"
#include "zero/reducer.h"

namespace zeroshard {

class StagedReducer : public Reducer {
 public:
  ~StagedReducer() override;
  void begin_backward(bool accumulation_boundary) final { boundary_ = accumulation_boundary; }
  void grad_ready(int64_t index, const at::Tensor& grad) final;
  void finish() final;
  void abort() final;
  void zero_grad() final;
  int64_t num_buckets() const final { return int64_t(buckets_.size()); }
  int64_t num_params() const final { return int64_t(plan_.bucket_of_param.size()); }

 protected:
  struct Bucket {
    BucketSpec spec;
    int64_t staged_numel = 0;   // elements of the staging buffer this bucket uses
    int64_t local_begin = 0;    // stage 3: where this rank's part lands in its gradient shard
    int64_t local_numel = 0;    // stage 3: elements per rank (the staging holds world_size parts)
    int64_t ready = 0;
    int buffer = -1;
    CommWork work;
    // idle -> filling -> in_flight -> done (reduced in this backward) -> idle again at finish().
    enum class State { idle, filling, in_flight, done } state = State::idle;
  };

  StagedReducer(const std::vector<FlatGroup*>& groups, std::shared_ptr<Comm> comm,
                const ReduceOptions& options, MemoryAccount& memory);
  // Called by the subclass constructor once every bucket's sizes are known, in plan order (the
  // pieces of one parameter one after another).
  void add_bucket(Bucket b);
  // Copies the part of parameter `index`'s gradient that the bucket holds (all of it, or one
  // piece) into the bucket's staging buffer.
  virtual void stage(const Bucket& b, at::Tensor staging, int64_t index, const at::Tensor& grad) = 0;
  // Starts the bucket's in-place collective on its staging buffer.
  virtual CommWork reduce(const Bucket& b, at::Tensor staging, const std::string& what) = 0;
  // Adds `scale` times this rank's part of the reduced (summed) staging buffer into its gradient
  // shard; the scale makes the sum a mean and is applied only to the part this rank keeps.
  // Returns the part's range in the owned range, {begin, numel} (numel 0: none).
  virtual std::pair<int64_t, int64_t> accumulate(const Bucket& b, const at::Tensor& reduced, double scale) = 0;
  const std::vector<Bucket>& buckets() const { return buckets_; }
  at::TensorOptions comm_options() const;

  std::vector<FlatGroup*> groups_;
  std::shared_ptr<Comm> comm_;
  ReduceOptions opt_;
  BucketPlan plan_;
  std::vector<int64_t> group_base_;  // global index of each group's first parameter

 private:
  int acquire_buffer(const Bucket& b);
  void start(Bucket& b);
  void complete(Bucket& b);

  std::vector<Bucket> buckets_;
  bool boundary_ = true;  // this backward ends the accumulation window
  // Global parameter index -> its first bucket and how many (more than one: pieces).
  std::vector<std::pair<int64_t, int64_t>> param_buckets_;
  // Whether each parameter's gradient arrived in this backward: a second would overwrite the
  // first in its staging buffer, or come after its bucket was reduced.
  std::vector<bool> arrived_;
  std::vector<at::Tensor> staging_;
  std::vector<bool> busy_;
  std::vector<int64_t> in_flight_;  // bucket indices in the order they started
  size_t pool_size_;
  MemoryAccount& memory_;
  int64_t accounted_bytes_ = 0;
};

}  // namespace zeroshard
