// Stage 3: parameters are chunked per rank (ChunkLayout), so a bucket of consecutive parameters
// is reduce-scattered directly. Each gradient is staged chunk by chunk, rank-major
// ([rank 0's chunks | rank 1's chunks | ...]); the in-place reduce-scatter (Comm) then leaves each
// rank's chunks, summed, in its part of the staging buffer, from where they are copied (or, when
// a window accumulates, added) into its gradient shard.
#pragma once
#include "zero/staged_reducer.h"

namespace zeroshard {

class ScatterGradReducer final : public StagedReducer {
 public:
  ScatterGradReducer(const std::vector<FlatGroup*>& groups, std::shared_ptr<Comm> comm,
                     const ReduceOptions& options, MemoryAccount& memory);

 private:
  void stage(const Bucket& b, at::Tensor staging, int64_t index, const at::Tensor& grad) override;
  CommWork reduce(const Bucket& b, at::Tensor staging, const std::string& what) override;
  std::pair<int64_t, int64_t> accumulate(const Bucket& b, const at::Tensor& reduced, double scale) override;
};

}  // namespace zeroshard
