// Stage 2: no rank keeps full gradients. Each gradient is copied from param.grad into a staging
// bucket as backward produces it (the engine then drops param.grad), every bucket is all-reduced
// on every micro-step, and each rank adds only its owned slice into its gradient shard, where
// gradient accumulation happens. This is DeepSpeed's default for stage 2 (multi-rank bucket
// all-reduce rather than a reduce-scatter, whose equal per-rank slices would not line up with
// bucket boundaries). Staging buffers come from a small pool: two with overlap_comm, one without.
#pragma once
#include <memory>
#include <vector>

#include "runtime/comm.h"
#include "runtime/memory.h"
#include "zero/buckets.h"
#include "zero/flat_group.h"
#include "zero/grad_reducer.h"
#include "zero/reducer.h"

namespace zeroshard {

class ShardedGradReducer final : public Reducer {
 public:
  ShardedGradReducer(const std::vector<FlatGroup*>& groups, std::shared_ptr<Comm> comm,
                     const ReduceOptions& options, MemoryAccount& memory);
  ~ShardedGradReducer() override;
  void grad_ready(int64_t index, const at::Tensor& grad) override;
  void finish() override;
  int64_t num_buckets() const override { return int64_t(buckets_.size()); }
  int64_t num_params() const override { return int64_t(plan_.bucket_of_param.size()); }

 private:
  struct Bucket {
    BucketSpec spec;
    int64_t ready = 0;
    int buffer = -1;  // staging buffer in use, -1 when none
    CommWork work;
    enum class State { idle, filling, in_flight } state = State::idle;
  };
  int acquire_buffer();
  void start(Bucket& b);
  void complete(Bucket& b);

  std::vector<FlatGroup*> groups_;
  std::shared_ptr<Comm> comm_;
  ReduceOptions opt_;
  BucketPlan plan_;
  std::vector<Bucket> buckets_;
  std::vector<at::Tensor> buffers_;
  std::vector<bool> buffer_busy_;
  std::vector<int64_t> in_flight_;  // bucket indices in the order they started
  size_t pool_size_;
  MemoryAccount& memory_;
  int64_t accounted_bytes_ = 0;
};

}  // namespace zeroshard
