// Stage 2: every bucket is all-reduced in its staging buffer and each rank keeps the slice that
// falls in its owned range of the flat layout. This is DeepSpeed's default for stage 2 (multi-rank
// bucket all-reduce rather than a reduce-scatter, whose equal per-rank slices would not line up
// with bucket boundaries).
#pragma once
#include "zero/staged_reducer.h"

namespace zeroshard {

class ShardedGradReducer final : public StagedReducer {
 public:
  ShardedGradReducer(const std::vector<FlatGroup*>& groups, std::shared_ptr<Comm> comm,
                     const ReduceOptions& options, MemoryAccount& memory);

 private:
  void stage(const Bucket& b, at::Tensor staging, int64_t index, const at::Tensor& grad) override;
  CommWork reduce(const Bucket& b, at::Tensor staging, const std::string& what) override;
  std::pair<int64_t, int64_t> accumulate(const Bucket& b, const at::Tensor& reduced, double scale) override;
};

}  // namespace zeroshard
