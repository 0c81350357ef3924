// Stage 3 gradients: parameters are chunked per rank (ChunkLayout), so a bucket of consecutive
// parameters can be reduce-scattered directly. Each gradient is copied, chunk by chunk, into a
// staging buffer laid out rank-major ([rank 0's chunks | rank 1's chunks | ...]); the bucket's
// reduce-scatter then hands each rank exactly its chunks, summed, which it adds into its
// gradient shard. Staging buffers come from a small pool, as in stage 2.
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

class ScatterGradReducer final : public Reducer {
 public:
  ScatterGradReducer(const std::vector<FlatGroup*>& groups, std::shared_ptr<Comm> comm,
                     const ReduceOptions& options, MemoryAccount& memory);
  ~ScatterGradReducer() override;
  void grad_ready(int64_t index, const at::Tensor& grad) override;
  void finish() override;
  int64_t num_buckets() const override { return int64_t(buckets_.size()); }
  int64_t num_params() const override { return int64_t(plan_.bucket_of_param.size()); }

 private:
  struct Bucket {
    BucketSpec spec;
    int64_t shard_numel = 0;   // this bucket's chunks per rank
    int64_t local_begin = 0;   // where they start in a rank's gradient shard
    int64_t ready = 0;
    int buffer = -1;
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
  std::vector<int64_t> group_base_;  // global index of each group's first parameter
  std::vector<Bucket> buckets_;
  std::vector<at::Tensor> staging_;  // world_size * max shard_numel each
  std::vector<at::Tensor> received_; // max shard_numel each
  std::vector<bool> busy_;
  std::vector<int64_t> in_flight_;
  size_t pool_size_;
  int64_t max_shard_numel_ = 0;
  MemoryAccount& memory_;
  int64_t accounted_bytes_ = 0;
};

}  // namespace zeroshard
