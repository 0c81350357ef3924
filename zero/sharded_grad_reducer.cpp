// Stage 2's all-reduce of staged buckets into owned slices; see sharded_grad_reducer.h.
#include "zero/sharded_grad_reducer.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace zeroshard {

ShardedGradReducer::ShardedGradReducer(const std::vector<FlatGroup*>& groups,
                                       std::shared_ptr<Comm> comm, const ReduceOptions& options,
                                       MemoryAccount& memory)
    : StagedReducer(groups, std::move(comm), options, memory) {
  for (const BucketSpec& spec : plan_.buckets) {
    Bucket b;
    b.spec = spec;
    b.staged_numel = spec.numel;  // reduced in place
    add_bucket(std::move(b));
  }
}

void ShardedGradReducer::stage(const Bucket& b, at::Tensor staging, int64_t index,
                               const at::Tensor& grad) {
  staging.narrow(0, plan_.param_offset[size_t(index)] - b.spec.offset, grad.numel())
      .copy_(grad.reshape(-1));
}

CommWork ShardedGradReducer::reduce(const Bucket&, at::Tensor staging, const std::string& what) {
  return comm_->all_reduce(staging, what);
}

void ShardedGradReducer::accumulate(const Bucket& b, const at::Tensor& reduced, double scale) {
  FlatGroup& g = *groups_[size_t(b.spec.group)];
  const ShardRange own = g.owned();
  const int64_t begin = std::max(own.begin, b.spec.offset);
  const int64_t end = std::min(own.end, b.spec.offset + b.spec.numel);
  if (end <= begin) return;
  at::Tensor shard = g.owned_grads().narrow(0, begin - own.begin, end - begin);
  // Mixed dtypes add in the wider one, rounding once into the shard's.
  shard.add_(reduced.narrow(0, begin - b.spec.offset, end - begin), scale);
}

}  // namespace zeroshard
