// Stage 2's all-reduce of staged buckets into owned slices; see sharded_grad_reducer.h.
#include "zero/sharded_grad_reducer.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "kernels/ops.h"

namespace zeroshard {

ShardedGradReducer::ShardedGradReducer(const std::vector<FlatGroup*>& groups,
                                       std::shared_ptr<Comm> comm, const ReduceOptions& options,
                                       MemoryAccount& memory)
    : StagedReducer(groups, std::move(comm), options, memory) {
  for (const BucketSpec& spec : plan_.buckets) {
    // Only a bucket of one parameter can be larger than bucket_numel: its pieces are ranges of
    // the flat layout like any bucket.
    for (int64_t at = 0; at < spec.numel; at += opt_.bucket_numel) {
      Bucket b;
      b.spec = spec;
      b.spec.offset = spec.offset + at;
      b.spec.numel = std::min(opt_.bucket_numel, spec.numel - at);
      b.staged_numel = b.spec.numel;  // reduced in place
      add_bucket(std::move(b));
    }
  }
}

void ShardedGradReducer::stage(const Bucket& b, at::Tensor staging, int64_t index,
                               const at::Tensor& grad) {
  const int64_t offset = plan_.param_offset[size_t(index)];
  const int64_t begin = std::max(offset, b.spec.offset);
  const int64_t end = std::min(offset + grad.numel(), b.spec.offset + b.spec.numel);
  staging.narrow(0, begin - b.spec.offset, end - begin)
      .copy_(grad.reshape(-1).narrow(0, begin - offset, end - begin));
}

CommWork ShardedGradReducer::reduce(const Bucket&, at::Tensor staging, const std::string& what) {
  return comm_->all_reduce(staging, what);
}

std::pair<int64_t, int64_t> ShardedGradReducer::accumulate(const Bucket& b, const at::Tensor& reduced,
                                                           double scale) {
  FlatGroup& g = *groups_[size_t(b.spec.group)];
  const ShardRange own = g.owned();
  const int64_t begin = std::max(own.begin, b.spec.offset);
  const int64_t end = std::min(own.end, b.spec.offset + b.spec.numel);
  const int64_t total = g.layout().total_numel;
  // A rank whose owned range is padding only is final with the last bucket too.
  if (own.begin >= total) return {0, b.spec.offset + b.spec.numel == total ? own.numel() : 0};
  if (end <= begin) return {0, 0};
  at::Tensor shard = g.owned_grads().narrow(0, begin - own.begin, end - begin);
  // Mixed dtypes add in the wider one, rounding once into the shard's.
  ops::add_scaled_(shard, reduced.narrow(0, begin - b.spec.offset, end - begin), scale);
  // The flat buffer's padding after the last tensor is in no bucket and stays zero: it is final
  // with the last bucket, so the owned range is reported whole.
  const int64_t final_end = end == total ? own.end : end;
  return {begin - own.begin, final_end - begin};
}

}  // namespace zeroshard
